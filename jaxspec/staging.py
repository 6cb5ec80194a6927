"""A program's small per-call inputs copied into one buffer of its own before anything reads them.

On a GPU XLA runs a program as a command buffer (CUDA graph) and, before each launch, compares the address of every
buffer a graph node reads with the last launch's: a node whose buffer moved is re-recorded on the host. A caller that
hands the program fresh arrays each call (host numpy: the benchmarks' goal rows, a server's new batch, the engine's
page tables whenever a request grows by a page) moves every node that reads one, and the small integer inputs feed
most of a step: the cached lengths become positions, masks and RoPE angles, the page table the K/V addresses, each
fused into its consumers, so every consumer reads the parameter itself. The E4B drafter's bs-1 propose re-recorded
147 of its graph's 209 nodes a call that way, ~350-670 us of host time; with its inputs on the device at the same
addresses every call it ran in 597 instead of 807 us (BENCHMARKS.md session 20).

`stage` copies the chosen inputs into one fresh array at the program's start (one small kernel, the only node that
reads them) behind an optimization barrier, so that every other node reads that copy: a temporary of the program,
which sits at the same address call after call. `hold` keeps the copy alive until the program's outputs exist, so
that XLA's buffer assignment cannot place it inside an output's allocation (a fresh output of a caller that still
holds the last one moves). jvp / vmap never see these programs; values pass through bit for bit (floats travel as
their bits).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# leaves staged: 32-bit and bool arrays up to this size (the per-call metadata; never weights, K/V or hidden rows)
MAX_LEAF_BYTES = 1 << 18
_WORD = jnp.int32


def stageable(a) -> bool:
    dtype = np.dtype(a.dtype)
    return (dtype == np.bool_ or dtype.itemsize == 4) and math.prod(a.shape) * dtype.itemsize <= MAX_LEAF_BYTES


def _to_words(a):
    if a.dtype == jnp.bool_:
        return a.astype(_WORD)
    return a if a.dtype == _WORD else jax.lax.bitcast_convert_type(a, _WORD)


def _from_words(w, dtype):
    if dtype == jnp.bool_:
        return w != 0
    return w if dtype == _WORD else jax.lax.bitcast_convert_type(w, dtype)


def stage(tree):
    """(tree with its stageable leaves read from one fresh buffer, that buffer) — or (tree, None) if none is."""
    leaves, treedef = jax.tree.flatten(tree)
    picked = [i for i, a in enumerate(leaves) if stageable(a)]
    if not picked:
        return tree, None
    # a one-word tail: even a single leaf is copied (a concatenate of one array is the array itself)
    words = jnp.concatenate([_to_words(leaves[i]).reshape(-1) for i in picked] + [jnp.zeros((1,), _WORD)])
    words = jax.lax.optimization_barrier(words)
    out, at = list(leaves), 0
    for i in picked:
        a = leaves[i]
        n = math.prod(a.shape)
        out[i] = _from_words(words[at:at + n].reshape(a.shape), a.dtype)
        at += n
    return treedef.unflatten(out), words


def hold(outputs, words):
    """outputs (fresh arrays, never donated state), each one big enough to hold `words` (stage's buffer, or None)
    made while words is still live.

    Such a leaf is selected by words' zero tail: its value passes through bit for bit (a select, fused into the
    leaf's producer where XLA can; after a library or Pallas call, one small kernel), and the copy's lifetime reaches
    the output's definition, so that it cannot share that output's allocation. (An optimization barrier orders the
    schedule but leaves no use behind: XLA's buffer assignment still put the copy in an output's allocation, checked
    on the CPU.) A smaller output cannot hold the copy and is left alone."""
    if words is None:
        return outputs
    keep = words[-1] == 0
    room = words.size * words.dtype.itemsize

    def held(a):
        return jnp.where(keep, a, jnp.zeros_like(a)) if a.size * a.dtype.itemsize >= room else a

    return jax.tree.map(held, outputs)

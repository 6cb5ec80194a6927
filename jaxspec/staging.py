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
holds the last one moves). `stage(..., outputs=)` goes further and makes the outputs' own buffers at the start
(`hold` then writes them in place), so that no temporary lives in an output's allocation either. jvp / vmap never
see these programs; values pass through bit for bit (floats travel as their bits).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import env_switch

# leaves staged: 32-bit and bool arrays up to this size (the per-call metadata; never weights, K/V or hidden rows)
MAX_LEAF_BYTES = 1 << 18
_WORD = jnp.int32


def enabled() -> bool:
    """JAXSPEC_STAGE_INPUTS: on unless 0. On the H200 (BENCHMARKS.md session 28, goal-row processes side by side) the
    bs-64 propose ran 3 214 against 3 453 us, the bs-1 verify step 4.51 against 4.65 ms, bs 16 6.91 against 7.01, the
    decode step 4.47 against 4.58; the bs-1 propose tied (726 / 725 us)."""
    return env_switch("JAXSPEC_STAGE_INPUTS") is not False


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


class Staged(NamedTuple):
    words: jax.Array  # the copy of the staged inputs, a zero word last
    pins: object  # None, or the outputs' buffers (a pytree), made with the copy at the program's start


def stage(tree, outputs=None):
    """(tree with its stageable leaves read from one fresh buffer, a Staged) — or (tree, None) if none is.

    outputs: the program's fresh outputs as ShapeDtypeStructs (a pytree). Their buffers are then made here, at the
    program's start, beside the copy, and `hold` writes the outputs into them in place: each output's allocation is live
    from start to end, so XLA's buffer assignment can place no temporary in it, and a caller that moves an output
    (a fresh output while it still holds the last one, or an allocator shifted by fresh inputs) moves only the
    kernel that writes it, not every kernel whose temporaries shared its allocation (on the H200 programs: 13 of the
    bs-1 propose's 110 kernels, 136 of the bs-64 one's, 437 of the verify step's; BENCHMARKS.md session 27)."""
    leaves, treedef = jax.tree.flatten(tree)
    picked = [i for i, a in enumerate(leaves) if stageable(a)]
    if not picked:
        return tree, None
    # a one-word tail: even a single leaf is copied (a concatenate of one array is the array itself)
    words = jnp.concatenate([_to_words(leaves[i]).reshape(-1) for i in picked] + [jnp.zeros((1,), _WORD)])
    pins = None if outputs is None else jax.tree.map(lambda o: jnp.zeros(o.shape, o.dtype), outputs)
    words, pins = jax.lax.optimization_barrier((words, pins))
    out, at = list(leaves), 0
    for i in picked:
        a = leaves[i]
        n = math.prod(a.shape)
        out[i] = _from_words(words[at:at + n].reshape(a.shape), a.dtype)
        at += n
    return treedef.unflatten(out), Staged(words, pins)


def stage_step(inputs, pages, outputs=None):
    """(inputs, pages, Staged): `stage` of a step's per-call inputs and its page table (a PageTables, whose other
    field, the cache's own SWA translation, stays as it is: it does not move)."""
    (inputs, table), staged = stage((inputs, pages.page_table), outputs=outputs)
    return inputs, dataclasses.replace(pages, page_table=table), staged


def hold(outputs, staged):
    """outputs (fresh arrays, never donated state), made while the copy is still live: written into the pinned
    buffers if `stage` made them, else each one big enough to hold the copy selected by its zero tail.

    Both read the copy's last word (zero, which XLA cannot know), so the copy's lifetime reaches every output's
    definition and the copy cannot share an output's allocation. (An optimization barrier orders the schedule but
    leaves no use behind: XLA's buffer assignment still put the copy in an output's allocation, checked on the CPU.)
    A pinned output is written by two dynamic-update-slices at that zero offset, in place in its buffer
    (`_write_into`); a select passes the value through bit for bit and fuses into the output's producer where XLA
    can. A smaller output cannot hold the copy and is left alone."""
    if staged is None:
        return outputs
    words, pins = staged
    zero = words[-1]
    if pins is not None:
        return jax.tree.map(lambda p, o: _write_into(p, o, zero), pins, outputs)
    keep = zero == 0
    room = words.size * words.dtype.itemsize

    def held(a):
        return jnp.where(keep, a, jnp.zeros_like(a)) if a.size * a.dtype.itemsize >= room else a

    return jax.tree.map(held, outputs)


def _write_into(pin, out, zero):
    """`out` written into `pin` in place, in two pieces along its first axis longer than 1 (one update of the whole
    buffer would be simplified by XLA into `out` itself, a buffer of its own again); a one-element output is returned
    as it is, not pinned."""
    axis = next((i for i, n in enumerate(out.shape) if n > 1), None)
    if axis is None:
        return out
    n = out.shape[axis]
    at = [zero] * out.ndim
    pin = jax.lax.dynamic_update_slice(pin, jax.lax.slice_in_dim(out, 0, 1, axis=axis), at)
    at[axis] = zero + 1
    return jax.lax.dynamic_update_slice(pin, jax.lax.slice_in_dim(out, 1, n, axis=axis), at)


# ---- per-call host inputs through persistent pinned host buffers -----------------------------------------------------
PINNED = "pinned_host"


def pinned_enabled(backend: str | None = None) -> bool:
    """JAXSPEC_PINNED_INPUTS: `BucketedDrafter` takes its packed per-call input from a `PinnedRing` instead of a
    transfer a call; on a GPU unless 0, elsewhere only with 1 (the CPU gains nothing: its host memory is its device's).
    On the H100 (BENCHMARKS.md session 35, `bench propose --variants bucketed,pinned` and the other order, four
    processes): the bs-1 propose 718 against 771 us (3 of 4 pairs), bs 64 3 365 against 3 599 (4 of 4). backend: the
    platform the program runs on (default: jax's default backend; `bench graph` compiles for a GPU from a CPU)."""
    value = env_switch("JAXSPEC_PINNED_INPUTS")
    return (backend or jax.default_backend()) == "gpu" if value is None else value


def pinned_sharding(device):
    """`device`'s pinned host memory, where a program's pinned input lives."""
    return jax.sharding.SingleDeviceSharding(device, memory_kind=PINNED)


def pinned_supported(device) -> bool:
    """Whether `device` has a pinned host memory space (GPUs and the CPU do)."""
    try:
        return any(m.kind == PINNED for m in device.addressable_memories())
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return False


class PinnedRing:
    """`depth` persistent arrays of one shape in `device`'s pinned host memory, each call's host input written into
    one of them by the host (a memmove: no PJRT transfer), for a program that copies it to the device
    itself (`to_device`, a copy inside its own command buffer). The way vLLM feeds its CUDA graphs: persistent
    pinned host buffers, copied to the device on the program's stream.

    A transfer of a 1-KB array costs ~170-230 us of host and stream time on the H100 / H200 (BENCHMARKS.md session 29,
    `put_only`), most of a bs-1 propose's host input. An array is written again only once the call that read it last
    has finished (`used_by` records that call's outputs). `write` takes the array written last whenever its call is
    done (a caller that reads each call's result before the next: the same array, at the same address, every call;
    an input that moves makes XLA re-record the graph node reading it, session 20), else one whose call is done,
    else waits for the one after it: a ring of two lets one call be launched while the last is still running. A slot
    whose outputs were deleted (by the caller or by donation) gets a fresh array, used only when no other is free (the
    old one lives as long as its call). JAX treats arrays as immutable: these are never handed to a caller, only to
    the program that reads them."""

    def __init__(self, shape, dtype, device, depth: int = 2):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.sharding = pinned_sharding(device)
        self.arrays = [self._fresh() for _ in range(depth)]
        self.users: list = [None] * depth
        self.last = 0

    def _fresh(self):
        a = jax.device_put(np.zeros(self.shape, self.dtype), self.sharding)
        a.block_until_ready()
        return a

    def _free_slot(self) -> int:
        """The array to write: see the class."""
        n = len(self.arrays)
        order = [(self.last + j) % n for j in range(n)]
        unknown = None
        for i in order:
            users = jax.tree.leaves(self.users[i])
            if any(u.is_deleted() for u in users):
                unknown = i if unknown is None else unknown
            elif all(u.is_ready() for u in users):
                return i
        if unknown is not None:
            self.arrays[unknown] = self._fresh()
            return unknown
        i = order[1 % n]
        jax.block_until_ready(self.users[i])
        return i

    def write(self, host: np.ndarray) -> jax.Array:
        """An array of the ring, holding `host` (same shape; cast to the ring's dtype)."""
        host = np.ascontiguousarray(host, self.dtype)
        if host.shape != self.shape:
            raise ValueError(f"pinned input of shape {host.shape}, the ring holds {self.shape}")
        i = self.last = self._free_slot()
        self.users[i] = None
        ctypes.memmove(self.arrays[i].unsafe_buffer_pointer(), host.ctypes.data, host.nbytes)
        return self.arrays[i]

    def used_by(self, outputs) -> None:
        """Record the outputs of the call that read the array `write` returned last."""
        self.users[self.last] = outputs


def to_device(x, device):
    """Inside a program: `x` (in pinned host memory) copied to `device`'s own memory."""
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind="device"))

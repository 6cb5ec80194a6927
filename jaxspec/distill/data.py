"""The training data: the target's greedy (and, optionally, sampled) continuations of the prompts and, from one
teacher-forced dense forward over prompt + continuation, the post-norm hidden and the store-layer K/V at every
position; the kept vocabulary."""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ConfigError, TargetConfig
from jaxspec.model import gemma4


@functools.partial(jax.jit, static_argnums=(1, 3))
def _greedy(params, cfg: TargetConfig, prompts, new_tokens: int):
    """Greedy continuation int32[B, new_tokens] of prompts int32[B, P] (dense cache, one scan over decode steps)."""
    return _continue(params, cfg, prompts, new_tokens, None, None)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _sampled(params, cfg: TargetConfig, prompts, new_tokens: int, temperature, key):
    """Continuation int32[B, new_tokens] sampled from softmax(logits / temperature), every row and position drawn
    independently from `key`."""
    return _continue(params, cfg, prompts, new_tokens, temperature, key)


def _continue(params, cfg: TargetConfig, prompts, new_tokens: int, temperature, key):
    B, P = prompts.shape
    cache = gemma4.init_dense_cache(cfg, B, P + new_tokens, params["embed"].dtype)

    def next_token(cache, tokens, positions):
        hidden, cache = gemma4.forward(params, cfg, tokens, positions, gemma4.dense_attend(cfg, positions), cache)
        logits = gemma4.logits(params, cfg, hidden[:, -1]).astype(jnp.float32)
        if key is None:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache
        step_key = jax.random.fold_in(key, positions[0, -1])  # one key a position: the rows of a draw independent
        return jax.random.categorical(step_key, logits / temperature, axis=-1).astype(jnp.int32), cache

    first, cache = next_token(cache, prompts, jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P)))

    def step(carry, pos):
        token, cache = next_token(carry[1], carry[0][:, None], jnp.full((B, 1), pos, jnp.int32))
        return (token, cache), token

    _, rest = jax.lax.scan(step, (first, cache), P + jnp.arange(new_tokens - 1, dtype=jnp.int32))
    return jnp.concatenate([first[:, None], rest.T], axis=1)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _teacher(params, cfg: TargetConfig, tokens, types: tuple[str, ...]):
    """One dense forward over tokens int32[B, T]: post-norm hidden [B, T, H] and the store layers' K/V
    {'{type}_k': [B, T, KVH, d], '{type}_v': ...}."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = gemma4.init_dense_cache(cfg, B, T, params["embed"].dtype)
    hidden, cache = gemma4.forward(params, cfg, tokens, positions, gemma4.dense_attend(cfg, positions), cache)
    return {"hidden": hidden} | {f"{t}_{x}": getattr(cache[t], x)[-1] for t in types for x in "kv"}


def padded_batches(n: int, batch: int):
    """(rows, padded rows) chunks of range(n), each padded with row 0 to `batch` rows: every call has one shape, also
    for a set smaller than a batch (the held-out set then reuses the training set's compiled programs)."""
    for s in range(0, n, batch):
        rows = np.arange(s, min(n, s + batch))
        yield rows, np.concatenate([rows, np.zeros(batch - len(rows), np.int64)])


def batches_by_length(prompts: list[list[int]], rows: np.ndarray, batch: int):
    """(the rows of one batch, int32[batch, P] their prompts padded with the batch's first) for `rows` of `prompts`,
    grouped by prompt length (one compiled program per length), `batch` at a time."""
    lengths = np.asarray([len(prompts[i]) for i in rows], np.int32)
    for P in sorted(set(lengths.tolist())):
        idx = rows[lengths == P]
        group = np.asarray([prompts[i] for i in idx], np.int32)
        for part, padded in padded_batches(len(idx), batch):
            yield idx[part], group[padded]


def greedy_continuations(params, cfg: TargetConfig, prompts: list[list[int]], new_tokens: int, batch: int, *,
                         known: dict | None = None, deadline: float | None = None, on_batch=None):
    """The target's greedy continuations int32[N, new_tokens] of prompts and bool[N]: which rows are filled.

    Rows whose prompt is in `known` ({tuple(prompt): int32[new_tokens]}, from `load_continuations`) are taken from
    it; the rest are generated `batch` at a time (one compiled program per prompt length), each new row added to
    `known`, and `on_batch()` called after each batch (to save them). Past `deadline` (time.monotonic()) no new
    batch starts: the rows not reached stay unfilled."""
    known = {} if known is None else known
    N = len(prompts)
    conts, done = np.zeros((N, new_tokens), np.int32), np.zeros(N, bool)
    for i, p in enumerate(prompts):
        c = known.get(tuple(p))
        if c is not None:
            conts[i], done[i] = c, True
    for rows, group in batches_by_length(prompts, np.flatnonzero(~done), batch):
        if deadline is not None and time.monotonic() > deadline:
            return conts, done
        out = np.asarray(_greedy(params, cfg, jnp.asarray(group), new_tokens))[: len(rows)]
        conts[rows], done[rows] = out, True
        known.update((tuple(prompts[i]), c) for i, c in zip(rows, out))
        if on_batch is not None:
            on_batch()
    return conts, done


def sampled_continuations(params, cfg: TargetConfig, prompts: list[list[int]], new_tokens: int, batch: int, *,
                          temperature: float, seed: int, copy: int = 0) -> np.ndarray:
    """Continuations int32[N, new_tokens] of prompts sampled from the target at `temperature` (> 0): more varied
    training text than the greedy continuation alone. Reproducible: a batch's draws come from (seed, copy, its first
    row), so the same arguments give the same rows and another `copy` other rows. Not saved to a file (only greedy
    continuations are)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    base = jax.random.fold_in(jax.random.PRNGKey(seed), copy)
    conts = np.zeros((len(prompts), new_tokens), np.int32)
    for rows, group in batches_by_length(prompts, np.arange(len(prompts)), batch):
        key = jax.random.fold_in(base, int(rows[0]))
        conts[rows] = np.asarray(_sampled(params, cfg, jnp.asarray(group), new_tokens, jnp.float32(temperature),
                                          key))[: len(rows)]
    return conts


def build_dataset(params, cfg: TargetConfig, prompts: list[list[int]], new_tokens: int, types, batch: int, *,
                  continuations: np.ndarray | None = None) -> dict:
    """Sequences ready for training, as device arrays:

    tokens int32[N, T] (prompt + greedy continuation, zero-padded; T = longest prompt + new_tokens),
    prompt_len int32[N], end int32[N] (the last position a draft may target: the continuation's end or its first
    EOS), hidden [N, T, H], '{type}_k' / '{type}_v' [N, T, KVH, d] for each store type in `types`.
    `continuations` int32[N, new_tokens]: the greedy continuations when they are known (`greedy_continuations`).
    """
    if continuations is None:
        continuations, _ = greedy_continuations(params, cfg, prompts, new_tokens, batch)
    N, L = len(prompts), max(len(p) for p in prompts)
    T = L + new_tokens
    tokens = np.zeros((N, T), np.int32)
    prompt_len = np.asarray([len(p) for p in prompts], np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)], tokens[i, len(p): len(p) + new_tokens] = p, continuations[i]
    pos = np.arange(T)[None, :]
    cont = (pos >= prompt_len[:, None]) & (pos < prompt_len[:, None] + new_tokens)
    eos = cont & np.isin(tokens, list(cfg.eos_token_ids))
    end = np.where(eos.any(1), np.argmax(eos, axis=1), prompt_len + new_tokens - 1).astype(np.int32)
    # the set is written batch by batch into buffers of its full size (donated, so updated in place): its peak is
    # one copy of it, where a concatenate of the batches held two (the hidden and K/V are ~0.6 MB a 192-token
    # sequence of the 270M target: 100 K sequences are ~64 GB)
    shapes = jax.eval_shape(lambda t: _teacher(params, cfg, t, tuple(types)),
                            jax.ShapeDtypeStruct((batch, T), jnp.int32))
    data = {name: jnp.zeros((N, *s.shape[1:]), s.dtype) for name, s in shapes.items()}
    for rows, padded in padded_batches(N, batch):
        out = _teacher(params, cfg, jnp.asarray(tokens[padded]), tuple(types))
        data = _put_rows(data, jax.tree.map(lambda a: a[: len(rows)], out), jnp.int32(rows[0]))
    return data | {"tokens": jnp.asarray(tokens), "prompt_len": jnp.asarray(prompt_len), "end": jnp.asarray(end)}


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(data: dict, part: dict, start):
    """data with part's rows written from row `start` on, in data's own (donated) buffers."""
    return jax.tree.map(lambda d, p: jax.lax.dynamic_update_slice_in_dim(d, p, start, axis=0), data, part)


def load_continuations(path: str, fingerprint: str, new_tokens: int) -> dict:
    """{tuple(prompt): int32[new_tokens]} saved by `save_continuations` at `path` ({} when there is no file yet).
    A file made for another target, dtype or number of new tokens is refused (ConfigError): its rows would be
    another model's greedy output."""
    if not os.path.exists(path):
        return {}
    try:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            flat, lens, conts = z["prompts"], z["prompt_lens"], z["continuations"]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{path}: not a continuations file of jaxspec.distill ({e})") from None
    if meta != {"target": fingerprint, "new_tokens": new_tokens}:
        raise ConfigError(f"{path}: continuations of another run (target {meta.get('target')}, new tokens "
                          f"{meta.get('new_tokens')}; this run: {fingerprint}, {new_tokens})")
    starts = np.concatenate([[0], np.cumsum(lens)])
    return {tuple(flat[a:b].tolist()): c for a, b, c in zip(starts[:-1], starts[1:], conts)}


def save_continuations(path: str, fingerprint: str, new_tokens: int, known: dict) -> None:
    """Write `known` to `path` (replaced atomically: an interrupted save leaves the previous file)."""
    keys = list(known)
    meta = json.dumps({"target": fingerprint, "new_tokens": new_tokens})
    tmp = f"{path}.tmp.npz"
    np.savez(tmp, meta=np.asarray(meta),
             prompts=np.asarray([t for k in keys for t in k], np.int32),
             prompt_lens=np.asarray([len(k) for k in keys], np.int64),
             continuations=np.asarray([known[k] for k in keys], np.int32).reshape(len(keys), new_tokens))
    os.replace(tmp, path)


def draft_targets(data: dict) -> np.ndarray:
    """Every token a draft step is trained to predict (positions prompt_len+1 .. end of each sequence)."""
    tokens, P, end = (np.asarray(data[n]) for n in ("tokens", "prompt_len", "end"))
    pos = np.arange(tokens.shape[1])[None, :]
    return tokens[(pos > P[:, None]) & (pos <= end[:, None])]


def kept_vocabulary(targets: np.ndarray, keep: int, vocab_size: int) -> np.ndarray:
    """The `keep` most frequent target tokens (ties: lower id first), as sorted ids int32[K] (K <= keep: tokens
    that never occur get no row)."""
    counts = np.bincount(targets, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return np.sort(order[: min(keep, np.count_nonzero(counts))]).astype(np.int32)

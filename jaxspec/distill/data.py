"""The training data: the target's greedy continuations of the prompts and, from one teacher-forced dense forward over
prompt + continuation, the post-norm hidden and the store-layer K/V at every position; the kept vocabulary."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import TargetConfig
from jaxspec.model import gemma4


@functools.partial(jax.jit, static_argnums=(1, 3))
def _greedy(params, cfg: TargetConfig, prompts, new_tokens: int):
    """Greedy continuation int32[B, new_tokens] of prompts int32[B, P] (dense cache, one scan over decode steps)."""
    B, P = prompts.shape
    cache = gemma4.init_dense_cache(cfg, B, P + new_tokens, params["embed"].dtype)

    def next_token(cache, tokens, positions):
        hidden, cache = gemma4.forward(params, cfg, tokens, positions, gemma4.dense_attend(cfg, positions), cache)
        return jnp.argmax(gemma4.logits(params, cfg, hidden[:, -1]), axis=-1).astype(jnp.int32), cache

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


def build_dataset(params, cfg: TargetConfig, prompts: list[list[int]], new_tokens: int, types, batch: int) -> dict:
    """Sequences ready for training, as device arrays:

    tokens int32[N, T] (prompt + greedy continuation, zero-padded; T = longest prompt + new_tokens),
    prompt_len int32[N], end int32[N] (the last position a draft may target: the continuation's end or its first
    EOS), hidden [N, T, H], '{type}_k' / '{type}_v' [N, T, KVH, d] for each store type in `types`.
    """
    N, L = len(prompts), max(len(p) for p in prompts)
    T = L + new_tokens
    tokens = np.zeros((N, T), np.int32)
    prompt_len = np.asarray([len(p) for p in prompts], np.int32)
    for P in sorted(set(prompt_len.tolist())):  # one compiled program per prompt length
        idx = np.flatnonzero(prompt_len == P)
        group = np.asarray([prompts[i] for i in idx], np.int32)
        for rows, padded in padded_batches(len(idx), batch):
            out = np.asarray(_greedy(params, cfg, jnp.asarray(group[padded]), new_tokens))
            tokens[idx[rows], :P] = group[rows]
            tokens[idx[rows][:, None], P + np.arange(new_tokens)] = out[: len(rows)]
    pos = np.arange(T)[None, :]
    cont = (pos >= prompt_len[:, None]) & (pos < prompt_len[:, None] + new_tokens)
    eos = cont & np.isin(tokens, list(cfg.eos_token_ids))
    end = np.where(eos.any(1), np.argmax(eos, axis=1), prompt_len + new_tokens - 1).astype(np.int32)
    parts = []
    for rows, padded in padded_batches(N, batch):
        out = _teacher(params, cfg, jnp.asarray(tokens[padded]), tuple(types))
        parts.append(jax.tree.map(lambda a: a[: len(rows)], out))
    data = jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
    return data | {"tokens": jnp.asarray(tokens), "prompt_len": jnp.asarray(prompt_len), "end": jnp.asarray(end)}


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

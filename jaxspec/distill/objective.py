"""The objective: the drafter exactly as the engine runs it, at every continuation position of every sequence at once
(the engine's own `draft_hidden`, with a training `attend` that masks each query's store-layer K/V window), and the
loss of the reduced-vocabulary head without the V-wide logits.

Head: the plain tied head over a reduced vocabulary. Only the K most frequent target outputs of the training data
get trainable rows; every other row is exactly zero (logit 0 at inference), so the loss is the exact inference
head's: logsumexp = logaddexp(lse(kept logits), log(V - K)), never the V-wide vector.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import SLIDING, AssistantConfig
from jaxspec.model.assistant import draft_hidden
from jaxspec.model.weights import F32_LEAVES
from jaxspec.model.attention import attention

# ---- the reduced-vocabulary head -------------------------------------------------------------------------------------


def vocab_head(kept_ids: np.ndarray, vocab_size: int) -> dict:
    """ids int32[K] (sorted), index int32[V] (row of each token, -1: a zero row), free: the lowest zero-row id."""
    index = np.full(vocab_size, -1, np.int32)
    index[kept_ids] = np.arange(len(kept_ids), dtype=np.int32)
    zero_rows = np.flatnonzero(index < 0)
    free = int(zero_rows[0]) if len(zero_rows) else vocab_size
    return {"ids": jnp.asarray(kept_ids), "index": jnp.asarray(index), "free": jnp.asarray(free, jnp.int32)}


def head_outputs(kept_embed, head: dict, vocab_size: int, hn, labels):
    """Cross-entropy and greedy token of the inference head (logits hn·E over all V rows, zero outside the kept
    rows), computed on the kept rows only. hn: [M, Ha]; labels int32[M]. Returns (ce fp32[M], token int32[M])."""
    logits = jnp.einsum("mh,kh->mk", hn, kept_embed, preferred_element_type=jnp.float32)  # [M, K]
    zero_rows = vocab_size - kept_embed.shape[0]
    lse = jax.nn.logsumexp(logits, axis=-1)
    if zero_rows:
        lse = jnp.logaddexp(lse, math.log(zero_rows))
    row = head["index"][labels]
    label_logit = jnp.take_along_axis(logits, jnp.maximum(row, 0)[:, None], axis=1)[:, 0]
    ce = lse - jnp.where(row >= 0, label_logit, 0.0)
    best, kept_token = jnp.max(logits, axis=-1), head["ids"][jnp.argmax(logits, axis=-1)]
    # argmax over the full vector: a zero row (the lowest free id) wins unless a kept logit beats 0; ties go to the
    # lower id, as jnp.argmax does (kept ids are sorted, so argmax over them already picks the lowest)
    kept_wins = (best > 0) | ((best == 0) & (kept_token < head["free"])) | (head["free"] >= vocab_size)
    return ce, jnp.where(kept_wins, kept_token, head["free"]).astype(jnp.int32)


# ---- the training forward: every continuation position of every sequence at once -------------------------------------


def window_mask(layer_type: str, cached_len, num_keys: int, window: int):
    """bool[B, Q, S]: the keys a drafter query at cached_len int32[B, Q] reads (DESIGN.md §3): full layers
    [0, cached_len), sliding layers the last W+1 positions [max(0, cached_len - W - 1), cached_len)."""
    kpos = jnp.arange(num_keys, dtype=jnp.int32)
    c = cached_len[..., None]
    valid = kpos < c
    if layer_type == SLIDING:
        valid &= kpos >= c - window - 1
    return valid


def training_attend(acfg: AssistantConfig, cached_len, num_keys: int):
    """An `Attend` for `draft_hidden` over dense per-sequence store K/V (the `cache` argument: {'{t}_k': [B, S, KVH,
    d], ...}); drafter rows are the B*Q (sequence, position) pairs of cached_len int32[B, Q]."""
    B, Q = cached_len.shape
    types = acfg.text.layer_types
    masks = {t: window_mask(t, cached_len, num_keys, acfg.text.sliding_window) for t in set(types)}

    def attend(store, i, q, k, v):
        t = types[i]
        out = attention(q.reshape(B, Q, *q.shape[2:]), store[f"{t}_k"], store[f"{t}_v"], masks[t])
        return out.reshape(q.shape), store

    return attend


def draft_forward(params, acfg: AssistantConfig, target_embed, batch: dict, k: int, num_queries: int):
    """k teacher-forced drafter steps at the first `num_queries` continuation positions of each sequence.

    batch: a slice of `build_dataset`'s arrays (B sequences). params: the drafter weights `draft_hidden` reads.
    Returns hn [k, B*Q, Ha], labels int32[k, B*Q] (step j's target tok[p + j]) and mask bool[k, B*Q].
    """
    tokens = batch["tokens"]
    B, T = tokens.shape
    cached_len = batch["prompt_len"][:, None] + jnp.arange(num_queries, dtype=jnp.int32)[None, :]  # [B, Q]

    def token_at(pos):
        return jnp.take_along_axis(tokens, jnp.minimum(pos, T - 1), axis=1).reshape(-1)

    seed = jnp.take_along_axis(batch["hidden"], (cached_len - 1)[:, :, None], axis=1).reshape(B * num_queries, -1)
    store = {f"{t}_{x}": batch[f"{t}_{x}"] for t in set(acfg.text.layer_types) for x in "kv"}
    attend = training_attend(acfg, cached_len, T)
    positions = cached_len.reshape(-1)
    tok, h, hns, labels, masks = token_at(cached_len), seed, [], [], []
    for j in range(1, k + 1):
        hn, h = draft_hidden(params, acfg, target_embed, tok, h, positions, attend, store)
        tok = token_at(cached_len + j)  # step j's target, and step j+1's input
        hns.append(hn)
        labels.append(tok)
        masks.append((cached_len + j <= batch["end"][:, None]).reshape(-1))
    return jnp.stack(hns), jnp.stack(labels), jnp.stack(masks)


def compute_params(params, dtype):
    """The forward's copy of fp32 master params: matrices in `dtype`, norms and scalars fp32 (as the engine loads)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if path[-1].key in F32_LEAVES else x.astype(dtype), params)

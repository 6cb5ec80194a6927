"""Pure-jnp references of every kernel: the CPU fallback and the oracle the Pallas kernels are tested against.

Each function has the same signature as its kernel in `kv_indices.py` / `paged_attention.py`.
KV storage of one layer is flat over slots: `[num_slots, KVH, D]` with `slot = page * page_size + offset`.
Slot 0 lies on the dummy page 0 that padded rows write to, so it may hold garbage: masks use `where`, never `*`.
"""

from __future__ import annotations

import jax.numpy as jnp


def gather_kv_indices_ref(page_table, starts, ends, swa_of_full, *, width: int, page_size: int):
    """Slot indices of the window `[starts, ends)` of each row.

    page_table: int32[B, max_pages]   full-pool page id of each logical page (0: dummy)
    starts, ends: int32[B]            absolute positions; ends - starts <= width
    swa_of_full: int32[num_full_pages] or None   full page id -> SWA page id (the sliding-layer translation)
    Returns int32[B, width]: entry i is the slot of position starts + i for i < ends - starts. Entries past the
    live count are unspecified (the reference writes 0); consumers mask them by position.
    """
    pos = starts[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, W]
    live = pos < ends[:, None]
    logical = jnp.where(live, pos // page_size, 0)
    page = jnp.take_along_axis(page_table, logical, axis=1)
    if swa_of_full is not None:
        page = swa_of_full[page]
    return jnp.where(live, page * page_size + pos % page_size, 0).astype(jnp.int32)


def attention(q, k, v, valid, *, scale: float = 1.0):
    """Masked softmax attention with GQA.

    q: [B, Tq, NH, D]; k, v: [B, S, KVH, D]; valid: bool[B, Tq, S].
    Scores and softmax in fp32 (fp64 for fp64 inputs); keys that no query may see are zeroed before P·V (garbage/NaN cannot leak);
    a query with no valid key returns 0. Returns [B, Tq, NH, D] in q.dtype.
    """
    B, Tq, NH, D = q.shape
    KVH = k.shape[2]
    G = NH // KVH
    qg = q.reshape(B, Tq, KVH, G, D)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=acc) * scale
    mask = valid[:, None, None, :, :]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    key_live = jnp.any(valid, axis=1)  # [B, S]
    v = jnp.where(key_live[:, :, None, None], v, jnp.zeros((), v.dtype))
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=acc)
    o = o / jnp.where(denom > 0, denom, 1.0).transpose(0, 3, 1, 2, 4)
    return o.reshape(B, Tq, NH, D).astype(q.dtype)


def paged_attention_ref(q, k_cache, v_cache, kv_indices, kv_start, q_lo, q_hi, *, scale: float = 1.0):
    """Attention of q over the keys listed in `kv_indices` (an XLA gather, then dense masked attention).

    q: [B, Tq, NH, D]; k_cache, v_cache: [num_slots, KVH, D] (one layer's pool).
    kv_indices: int32[B, width]: key i of row b sits in slot kv_indices[b, i] and has absolute position
                kv_start[b] + i.
    q_lo, q_hi: int32[B, Tq]: query t may attend the keys whose position p satisfies q_lo <= p <= q_hi.
    Returns [B, Tq, NH, D] in q.dtype.
    """
    width = kv_indices.shape[1]
    pos = kv_start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, W]
    valid = (pos[:, None, :] >= q_lo[:, :, None]) & (pos[:, None, :] <= q_hi[:, :, None])
    idx = jnp.where(jnp.any(valid, axis=1), kv_indices, 0)
    return attention(q, k_cache[idx], v_cache[idx], valid, scale=scale)


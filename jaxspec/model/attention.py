"""Dense masked attention with GQA: the target's dense-cache reference, the paged kernels' reference after their
gather, and the distillation objective all use this one function."""

from __future__ import annotations

import jax.numpy as jnp


def attention(q, k, v, valid, *, scale: float = 1.0):
    """Masked softmax attention with GQA.

    q: [B, Tq, NH, D]; k, v: [B, S, KVH, D]; valid: bool[B, Tq, S].
    Scores and softmax in fp32 (fp64 for fp64 inputs); keys that no query may see are zeroed before P·V (garbage/NaN
    cannot leak); a query with no valid key returns 0. Returns [B, Tq, NH, D] in q.dtype.
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

"""The Gemma 4 assistant (MTP drafter): one draft step, Q-only attention over the target's store-layer K/V.

    x      = pre_projection(concat(E_target[token] * sqrt(H_target), seed_hidden))
    x      = Q-only decoder layers (each reads the target store layer of its attention type)
    hn     = final_norm(x)
    h_next = post_projection(hn)                     -> the next step's seed hidden
    token  = argmax(hn · E_assistantᵀ)               plain head, no softcap
           | argmax over the top-k centroids' tokens  centroid head (`use_ordered_embeddings`)

The eager and bucketed drafters (`jaxspec.draft`) both call `draft_step`; they differ only in how it is driven and
where the attention metadata comes from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.config import AssistantConfig
from jaxspec.model.gemma4 import decoder_layer, layer_weights
from jaxspec.model.layers import acc_dtype, linear, rms_norm, sqrt_scale


def draft_hidden(aparams, acfg: AssistantConfig, target_embed, tokens, seed_hidden, positions, attend, cache):
    """One drafter step up to the final norm.

    tokens: int32[B]; seed_hidden: [B, H_target]; positions: int32[B] (the pending token's position).
    attend(cache, layer, q, None, None) reads the target store layer of that drafter layer's type.
    Returns (hn [B, H_assistant], h_next [B, H_target]).
    """
    dtype = aparams["pre_projection"].dtype
    emb = target_embed[tokens] * sqrt_scale(acfg.backbone_hidden_size, target_embed.dtype)
    x = linear(jnp.concatenate([emb.astype(dtype), seed_hidden.astype(dtype)], axis=-1)[:, None, :],
               aparams["pre_projection"])  # [B, 1, Ha]
    text = acfg.text
    for i in range(text.num_layers):
        x, cache = decoder_layer(layer_weights(aparams, text, i), text, i, x, positions[:, None], None, attend, cache)
    hn = rms_norm(x[:, 0], aparams["final_norm"], text.rms_norm_eps)
    return hn, linear(hn, aparams["post_projection"])


# Above this many comparisons (B * C * C) top_k_ids uses lax.top_k (a sort on GPUs); below, ranking by comparison.
RANK_TOP_K_MAX = 1 << 24


def top_k_ids(x, k: int):
    """int32[B, k]: the indices of the k largest entries of each row of x [B, C], largest first, ties to the lower
    index — exactly `jax.lax.top_k(x, k)[1]`. Small batches rank by comparison (every pair once, a single fused
    reduction) instead of XLA's sort, which on the H200 costs ~15 µs per call even for one row of 2048."""
    B, C = x.shape
    if B * C * C > RANK_TOP_K_MAX:
        return jax.lax.top_k(x, k)[1].astype(jnp.int32)
    idx = jnp.arange(C, dtype=jnp.int32)
    xi, xj = x[:, :, None], x[:, None, :]
    beats = (xj > xi) | ((xj == xi) & (idx[None, None, :] < idx[None, :, None]))  # j ranks before i
    rank = jnp.sum(beats, axis=2, dtype=jnp.int32)  # [B, C]: a permutation of 0..C-1 per row
    hit = rank[:, None, :] == jnp.arange(k, dtype=jnp.int32)[None, :, None]  # [B, k, C]
    return jnp.sum(jnp.where(hit, idx, 0), axis=2, dtype=jnp.int32)


def candidates(aparams, acfg: AssistantConfig, hn):
    """Centroid head: the token ids of the top-k centroids [B, k * V/C] and their logits (fp32)."""
    c_logits = jnp.einsum("bh,ch->bc", hn, aparams["centroids"], preferred_element_type=acc_dtype(hn.dtype))
    top = top_k_ids(c_logits, acfg.centroid_top_k)  # [B, k]
    per = acfg.vocab_size // acfg.num_centroids
    cand = aparams["token_ordering"].reshape(acfg.num_centroids, per)[top].reshape(hn.shape[0], -1)
    sel = jnp.einsum("bh,bnh->bn", hn, aparams["embed"][cand], preferred_element_type=acc_dtype(hn.dtype))
    return cand, sel


def draft_token(aparams, acfg: AssistantConfig, hn):
    """Greedy draft id int32[B]. The centroid head scores only its candidates (never the full vocabulary); ties go to
    the lowest vocabulary id, as argmax over transformers' full masked vector does."""
    if not acfg.use_ordered_embeddings:
        logits = jnp.einsum("bh,vh->bv", hn, aparams["embed"], preferred_element_type=acc_dtype(hn.dtype))
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    cand, sel = candidates(aparams, acfg, hn)
    best = jnp.max(sel, axis=-1, keepdims=True)
    return jnp.min(jnp.where(sel == best, cand, acfg.vocab_size), axis=-1).astype(jnp.int32)


def propose(aparams, acfg: AssistantConfig, target_embed, pending_token, seed_hidden, cached_len, attend, cache, *,
            k: int):
    """k recurrent draft steps at one position over one window: step 1 takes the pending token and the target's
    seed hidden, step j+1 takes draft j and step j's h_next. Returns (drafts int32[B, k], last h_next [B, H_t])."""
    tokens, h, drafts = pending_token, seed_hidden, []
    for _ in range(k):
        hn, h = draft_hidden(aparams, acfg, target_embed, tokens, h, cached_len, attend, cache)
        tokens = draft_token(aparams, acfg, hn)
        drafts.append(tokens)
    return jnp.stack(drafts, axis=1), h

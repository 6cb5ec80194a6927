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


def _candidates(aparams, acfg: AssistantConfig, hn):
    """Centroid head: the token ids of the top-k centroids [B, k * V/C] and their logits (fp32)."""
    c_logits = jnp.einsum("bh,ch->bc", hn, aparams["centroids"], preferred_element_type=acc_dtype(hn.dtype))
    _, top = jax.lax.top_k(c_logits, acfg.centroid_top_k)  # [B, k]
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
    cand, sel = _candidates(aparams, acfg, hn)
    best = jnp.max(sel, axis=-1, keepdims=True)
    return jnp.min(jnp.where(sel == best, cand, acfg.vocab_size), axis=-1).astype(jnp.int32)


def full_logits(aparams, acfg: AssistantConfig, hn):
    """The full-vocabulary logits [B, V] as transformers returns them (tests only; the centroid head fills
    non-candidates with min(candidate logits) - 1)."""
    if not acfg.use_ordered_embeddings:
        return jnp.einsum("bh,vh->bv", hn, aparams["embed"], preferred_element_type=acc_dtype(hn.dtype))
    cand, sel = _candidates(aparams, acfg, hn)
    base = jnp.min(sel, axis=-1, keepdims=True) - 1.0
    out = jnp.broadcast_to(base, (hn.shape[0], acfg.vocab_size))
    return out.at[jnp.arange(hn.shape[0])[:, None], cand].set(sel)


def propose(aparams, acfg: AssistantConfig, target_embed, pending, seed_hidden, positions, attend, cache, k: int):
    """k recurrent draft steps at one position over one window: step 1 takes the pending token and the target's
    seed hidden, step j+1 takes draft j and step j's h_next. Returns (drafts int32[B, k], last h_next [B, H_t])."""
    tokens, h, drafts = pending, seed_hidden, []
    for _ in range(k):
        hn, h = draft_hidden(aparams, acfg, target_embed, tokens, h, positions, attend, cache)
        tokens = draft_token(aparams, acfg, hn)
        drafts.append(tokens)
    return jnp.stack(drafts, axis=1), h

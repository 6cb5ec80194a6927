"""The Gemma 4 assistant (MTP drafter): one draft step, Q-only attention over the target's store-layer K/V.

    x      = pre_projection(concat(E_target[token] * sqrt(H_target), seed_hidden))
    x      = Q-only decoder layers (each reads the target store layer of its attention type)
    hn     = final_norm(x)
    h_next = post_projection(hn)                     -> the next step's seed hidden
    token  = argmax(hn · E_assistantᵀ)               plain head, no softcap
           | argmax over the top-k centroids' tokens  centroid head (`use_ordered_embeddings`)

The eager and bucketed drafters (`jaxspec.draft`) both call `propose`; they differ only in how it is driven and
where the attention metadata comes from. The bucketed path can also run the same step through the fused Pallas
kernels of `jaxspec.pallas.draft_layer` (`propose_fused`, `fused=True`): the same math and the same roundings, ~6
launches a layer instead of ~15, equal to `draft_hidden` up to summation order (tests/test_drafter.py); off by
default: on the H200 it is level with the default step, not faster (BENCHMARKS.md, session 8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jaxspec.config import AssistantConfig, rope_inv_freq
from jaxspec.model.gemma4 import REFERENCE_OPS, LayerOps, decoder_layers
from jaxspec.model.layers import acc_dtype, linear, sqrt_scale
from jaxspec.pallas import draft_layer
from jaxspec.pallas.paged_attention import query_rows


def draft_hidden(aparams, acfg: AssistantConfig, target_embed, tokens, seed_hidden, positions, attend, cache,
                 ops: LayerOps = REFERENCE_OPS):
    """One drafter step up to the final norm.

    tokens: int32[B]; seed_hidden: [B, H_target]; positions: int32[B] (the pending token's position).
    attend(cache, layer, q, None, None) reads the target store layer of that drafter layer's type.
    Returns (hn [B, H_assistant], h_next [B, H_target]).
    """
    dtype = aparams["pre_projection"].dtype
    emb = target_embed[tokens] * sqrt_scale(acfg.backbone_hidden_size, target_embed.dtype)
    x = linear(jnp.concatenate([emb.astype(dtype), seed_hidden.astype(dtype)], axis=-1)[:, None, :],
               aparams["pre_projection"])  # [B, 1, Ha]
    hn, cache = decoder_layers(aparams, acfg.text, x, positions[:, None], None, attend, cache, aparams["final_norm"],
                               ops)
    hn = hn[:, 0]
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


def compact_head(aparams, acfg: AssistantConfig) -> dict:
    """aparams with the plain head's nonzero rows as `head_rows` [K, Ha] and their ids `head_ids` i32[K], when at
    least a quarter of its rows are exactly zero (a distilled drafter keeps rows only for the tokens its target
    produces: the bundled one 11 662 of 262 144), so that a draft step reads K rows instead of the vocabulary.
    `draft_token` gives the same ids either way. Other heads are returned as they are."""
    if acfg.use_ordered_embeddings:
        return aparams
    embed = np.asarray(jax.device_get(aparams["embed"]))
    kept = np.flatnonzero(np.any(embed != 0, axis=1))
    if len(kept) == 0 or len(kept) > 0.75 * embed.shape[0]:
        return aparams
    zero = np.flatnonzero(~np.any(embed != 0, axis=1))[0]  # the first zero row: the argmax among all of them
    ids = np.concatenate([kept, [zero]]).astype(np.int32)
    rows = np.concatenate([embed[kept], np.zeros((1, embed.shape[1]), embed.dtype)])
    return {**aparams, "head_rows": jnp.asarray(rows), "head_ids": jnp.asarray(ids)}


def draft_token(aparams, acfg: AssistantConfig, hn):
    """Greedy draft id int32[B]. The centroid head scores only its candidates (never the full vocabulary); ties go to
    the lowest vocabulary id, as argmax over transformers' full masked vector does. A compacted plain head
    (`compact_head`) scores its nonzero rows and one zero row, whose logit 0 stands for every zero row."""
    if "head_rows" in aparams:
        cand = jnp.broadcast_to(aparams["head_ids"], (hn.shape[0], aparams["head_ids"].shape[0]))
        sel = jnp.einsum("bh,nh->bn", hn, aparams["head_rows"], preferred_element_type=acc_dtype(hn.dtype))
    elif not acfg.use_ordered_embeddings:
        logits = jnp.einsum("bh,vh->bv", hn, aparams["embed"], preferred_element_type=acc_dtype(hn.dtype))
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        cand, sel = candidates(aparams, acfg, hn)
    return lowest_best(sel, cand, acfg.vocab_size)


def lowest_best(sel, ids, missing: int):
    """int32[B]: per row, the lowest of `ids` whose `sel` is the row's maximum — `min(where(sel == max(sel), ids,
    missing))` (`lowest_best_ref`), `missing` where a row holds a NaN — as one variadic reduction of (value, id) pairs,
    one kernel where the two-pass form takes two (a max, then the lowest id at it). A pure selection, so its result
    does not depend on the order XLA combines the pairs in."""
    nan = jnp.isnan(sel)
    ids = jnp.where(nan, missing, jnp.broadcast_to(ids, sel.shape).astype(jnp.int32))
    init = (jnp.array(-jnp.inf, sel.dtype), jnp.array(missing, jnp.int32))
    return lax.reduce((sel, ids), init, _pick_lowest_best, (sel.ndim - 1,))[1]


def _pick_lowest_best(a, b):
    """`lowest_best`'s combiner of two (value, id) pairs. At module level, so that lax.reduce traces it once per
    shape: a closure made per call is a new function each time, and the eager reference path (`draft_mode="eager"`)
    then compiled its reduction again at every draft step."""
    (av, ai), (bv, bi) = a, b
    a_nan, b_nan = jnp.isnan(av), jnp.isnan(bv)
    take_a = a_nan | (~b_nan & ((av > bv) | ((av == bv) & (ai < bi))))  # a NaN wins (its id is `missing`)
    return jnp.where(take_a, av, bv), jnp.where(take_a, ai, bi)


def lowest_best_ref(sel, ids, missing: int):
    """`lowest_best` in two passes: the row's maximum, then the lowest id at it (NaN: `missing`)."""
    best = jnp.max(sel, axis=-1, keepdims=True)
    return jnp.min(jnp.where(sel == best, ids, missing), axis=-1).astype(jnp.int32)


def propose(aparams, acfg: AssistantConfig, target_embed, pending_token, seed_hidden, cached_len, attend, cache, *,
            k: int, ops: LayerOps = REFERENCE_OPS):
    """k recurrent draft steps at one position over one window: step 1 takes the pending token and the target's
    seed hidden, step j+1 takes draft j and step j's h_next. Returns (drafts int32[B, k], last h_next [B, H_t])."""
    tokens, h, drafts = pending_token, seed_hidden, []
    for _ in range(k):
        hn, h = draft_hidden(aparams, acfg, target_embed, tokens, h, cached_len, attend, cache, ops)
        tokens = draft_token(aparams, acfg, hn)
        drafts.append(tokens)
    return jnp.stack(drafts, axis=1), h


# ---- the fused step (Pallas kernels; the bucketed path with kernels on) ---------------------------------------------


def fused_supported(acfg: AssistantConfig) -> bool:
    text = acfg.text
    return draft_layer.supported(text.hidden_size, {text.layer_head_dim(i) for i in range(text.num_layers)},
                                 text.intermediate_size, acfg.backbone_hidden_size)


def fused_draft_hidden(aparams, acfg: AssistantConfig, target_embed, tokens, seed_hidden, rope_tables, attend_rows):
    """`draft_hidden` through the fused kernels. tokens: i32[B]; seed_hidden: [B, Ht]; B = draft_layer.padded_rows(B).
    rope_tables: {layer type: (cos, sin) fp32 [B, D]}. attend_rows(i, q, rope) -> the attention of drafter layer i in
    the same row layout, q normed and rotated in the kernel (`paged_attention_rows`' rope). Returns (hn [B, Ha],
    h_next [B, Ht])."""
    text = acfg.text
    eps = text.rms_norm_eps
    layers = aparams["layers"]
    x = draft_layer.pre_projection(tokens, seed_hidden, target_embed, aparams["pre_projection"])
    stream, prev = x, None
    for i in range(text.num_layers):
        group, j = text.group_of(i)
        w = layers[group]
        _, rows = draft_layer_rows(text, i)
        q, q_swap, x = draft_layer.q_proj(stream, w["norms"], j, w["q_proj"], head_dim=text.layer_head_dim(i),
                                          num_kv_heads=text.layer_kv_heads(i), rows_per_kv_head=rows, eps=eps,
                                          prev=prev)
        cos, sin = rope_tables[text.layer_types[i]]
        a = attend_rows(i, q, (q_swap, w["q_norm"], j, cos, sin, eps))
        o = draft_layer.o_proj(a, w["o_proj"], j, num_heads=text.num_heads)
        m, x1 = draft_layer.mlp_up(x, o, w["norms"], w["gate_up"], j, eps=eps)
        d = draft_layer.mlp_down(m, w["down"], j)
        stream, prev = (x1, d), (w["norms"], j, w["layer_scalar"])
    (x1, d), (norms, j, scalar) = stream, prev
    return draft_layer.final_projection(x1, d, norms, j, scalar, aparams["final_norm"], aparams["post_projection"],
                                        eps=eps)


def draft_layer_rows(text, i: int) -> tuple[int, int]:
    """(block_q, rows per kv head) of drafter layer i's queries in the attention's row layout (one query)."""
    G = text.num_heads // text.layer_kv_heads(i)
    return query_rows(1, G, text.layer_head_dim(i))


def propose_fused(aparams, acfg: AssistantConfig, target_embed, pending_token, seed_hidden, cached_len, attend_rows,
                  *, k: int):
    """`propose` through `fused_draft_hidden`: the batch padded to the kernels' rows once (`draft_layer.padded_rows`;
    padding rows are never attended: attend_rows covers the live rows), RoPE tables built once (all k steps sit at
    one position). Returns (drafts int32[B, k], last h_next [B, H_t])."""
    B = pending_token.shape[0]
    pad = draft_layer.padded_rows(B) - B
    tokens = jnp.pad(pending_token, (0, pad))
    h = jnp.pad(seed_hidden, ((0, pad), (0, 0)))
    positions = jnp.pad(cached_len, (0, pad))
    text = acfg.text
    tables = {}
    for i, t in enumerate(text.layer_types):
        D = text.layer_head_dim(i)
        tables[t] = draft_layer.rope_tables(positions, jnp.asarray(rope_inv_freq(text.rope(t), D, np.float32)))
    drafts = []
    for _ in range(k):
        hn, h = fused_draft_hidden(aparams, acfg, target_embed, tokens, h, tables, attend_rows)
        tokens = draft_token(aparams, acfg, hn)
        drafts.append(tokens[:B])
    return jnp.stack(drafts, axis=1), h[:B]

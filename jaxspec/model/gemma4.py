"""The Gemma 4 text decoder (and Gemma 3 through config switches), generic over where K/V lives.

`forward` runs the decoder over tokens at given positions and calls `attend(cache, layer, q, k, v)` for attention:
the dense cache below (the reference) and the paged cache (`jaxspec.paged_kv.cache`) both implement it. A layer that
reuses K/V (KV sharing) passes k = v = None and reads its store layer's storage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable

import jax
import jax.numpy as jnp

from jaxspec.config import SLIDING, ConfigError, TargetConfig, env_switch
from jaxspec.model.attention import attention
from jaxspec.model.layers import (acc_dtype, apply_rope, gated_ple, joint_heads, linear, mlp_activation, moe, rms_norm,
                                  rope_tables, softcap, sqrt_scale)
from jaxspec.paged_kv.cache import LayerKV, paged_attend
from jaxspec.paged_kv.metadata import StepMetadata
from jaxspec.pallas import row_norms
from jaxspec.pallas.row_norms import Vec, add_norm_ref

# attend(cache, layer, q [B,T,NH,d], k [B,T,KVH,d] | None, v | None) -> (out [B,T,NH,d], cache)
Attend = Callable


def embed(params, cfg: TargetConfig, tokens):
    """Scaled token embedding [B, T, H] and, for PLE models, the per-layer inputs [B, T, L, P]."""
    dtype = params["embed"].dtype
    x = params["embed"][tokens] * sqrt_scale(cfg.hidden_size, dtype)
    if not cfg.hidden_size_per_layer_input:
        return x, None
    B, T = tokens.shape
    L, P = cfg.num_layers, cfg.hidden_size_per_layer_input
    tok = (params["ple_embed"][tokens] * sqrt_scale(P, dtype)).reshape(B, T, L, P)
    proj = (linear(x, params["ple_model_proj"]) * cfg.hidden_size**-0.5).reshape(B, T, L, P)
    proj = rms_norm(proj, params["ple_proj_norm"], cfg.rms_norm_eps)
    return x, (proj + tok) * 2.0**-0.5


class LayerWeights(Mapping):
    """Layer i's weights: `w[name]` is its slice of the group's stack; `w.vec(name, *index)` names one vector of it
    in place (`row_norms.Vec`), for kernels that read the stack at a static index instead of a sliced copy."""

    def __init__(self, group: dict, j: int):
        self._group, self._j = group, j

    def __getitem__(self, name):
        return self._group[name][self._j]

    def __iter__(self):
        return iter(self._group)

    def __len__(self):
        return len(self._group)

    def vec(self, name: str, *index: int) -> Vec:
        return Vec(self._group[name], (self._j, *index))


def layer_weights(params, cfg: TargetConfig, i: int) -> LayerWeights:
    group, j = cfg.group_of(i)
    return LayerWeights(params["layers"][group], j)


def vec_linear(x, w: Vec):
    """x [..., K] @ w.T for w = w.stack[w.index] [N, K], one matrix of a stack (`linear`)."""
    return linear(x, w.get())


@dataclasses.dataclass(frozen=True)
class LayerOps:
    """What kernels may take over between a layer's weights and its values: the residual stream's norms between the
    products (`row_norms.add_norm_ref` or its kernel); the products stay XLA's. `layer_ops` picks them."""

    add_norm: Callable = add_norm_ref


REFERENCE_OPS = LayerOps()


QKV_PARTS = ("q_proj", "k_proj", "v_proj")


def fuse_qkv(params) -> dict:
    """params with each layer group's q, k and v projection stacks as one `qkv_proj` stack [L, Nq + Nk (+ Nv), H]
    (rows in that order; groups without k_proj keep q_proj as it is). The engine's default on one device
    (JAXSPEC_FUSE_QKV=0 keeps three stacks): XLA merges the three products of a multi-row step into one GEMM over
    their concatenated weights, and for that copied each layer's three weight slices out of their stacks every call
    (session 12's trace: 54 copies a verify call of the 270M target); one stored stack is read in place (session 13,
    H200, with JAXSPEC_ATTN_GATHER_Q: +6.8% plain, +5.8% k 4 on the default pair)."""
    groups = {}
    for name, group in params["layers"].items():
        if "k_proj" not in group:
            groups[name] = group
            continue
        parts = [group[n] for n in QKV_PARTS if n in group]
        rest = {n: a for n, a in group.items() if n not in QKV_PARTS}
        groups[name] = {**rest, "qkv_proj": jnp.concatenate(parts, axis=1)}
    return {**params, "layers": groups}


def is_fused(params) -> bool:
    return any("qkv_proj" in group for group in params["layers"].values())


def stored_params(params, tensor_parallel_size: int = 1) -> dict:
    """The target's weights as the engine stores them: on one device one q/k/v stack per layer group (`fuse_qkv`,
    unless JAXSPEC_FUSE_QKV=0); split over devices the stacks as loaded (the shardings name them). Loaders call it,
    so that the caller's copy is the engine's and the loaded stacks are not held beside it; the engine calls it again
    (a no-op on stored weights). ConfigError for fused weights on several devices."""
    if tensor_parallel_size > 1:
        if is_fused(params):
            raise ConfigError("tensor parallelism splits q, k and v by head: it takes the three projection stacks, "
                              "not fused ones (load the weights with JAXSPEC_FUSE_QKV=0)")
        return params
    if env_switch("JAXSPEC_FUSE_QKV") is not False:
        params = fuse_qkv(params)
    return params


def qkv(w, cfg: TargetConfig, i: int, h, positions, out=None):
    """Projected, normed and rotated q [B,T,NH,d] and, for a non-shared layer, k, v [B,T,KVH,d] (else None).
    out: the fused stack's product of h where the caller has it already."""
    B, T = positions.shape
    eps, d = cfg.rms_norm_eps, cfg.layer_head_dim(i)
    rope = cfg.rope(cfg.layer_types[i])
    if "qkv_proj" in w:  # fuse_qkv's stack: one product; q's rows first, then K's and V's (equal) or K's alone
        out = vec_linear(h, w.vec("qkv_proj")) if out is None else out
        if env_switch("JAXSPEC_JOINT_QK_NORM") is not False:
            return joint_qkv(w, cfg, i, out, positions)
        q, kv = out[..., : cfg.num_heads * d], out[..., cfg.num_heads * d:]
        proj = {"q_proj": q, **(dict(zip(("k_proj", "v_proj"), jnp.split(kv, 2, axis=-1))) if cfg.has_v_proj(i)
                                else {"k_proj": kv})}
    else:
        proj = {name: vec_linear(h, w.vec(name)) for name in QKV_PARTS if name in w}
    q = proj["q_proj"].reshape(B, T, cfg.num_heads, d)
    q = apply_rope(rms_norm(q, w["q_norm"], eps), positions, rope)
    if "k_proj" not in proj:
        return q, None, None
    k = proj["k_proj"].reshape(B, T, -1, d)
    v = proj["v_proj"].reshape(B, T, -1, d) if "v_proj" in proj else k  # k_eq_v: V is the raw K projection
    k = apply_rope(rms_norm(k, w["k_norm"], eps), positions, rope)
    if cfg.use_v_norm:
        v = rms_norm(v, None, eps)
    return q, k, v


def joint_qkv(w, cfg: TargetConfig, i: int, out, positions):
    """`qkv` from the fused stack's product out [B, T, (NH + KVH (+ KVH)) d], its heads normed and rotated together
    (on by default; JAXSPEC_JOINT_QK_NORM=0 runs them separately): q's and k's heads (and v's, with the weightless
    v-norm) as one [B, T, heads, d] array, each head normed with its own weight (q_norm, k_norm, or 1: exact), then
    q's and k's heads rotated at once. Element by element the same operations as `qkv`'s separate ones; XLA gets one
    reduction and one elementwise pass a layer to fuse instead of one of each per q, k and v (E4B's verify step: four
    to six kernels a layer, ~209 µs a step; BENCHMARKS.md session 16; session 17 measured 44 launches and 77 µs of
    kernels fewer a step, the wall time a tie)."""
    d = cfg.layer_head_dim(i)
    cos, sin = rope_tables(positions, cfg.rope(cfg.layer_types[i]), d, acc_dtype(out.dtype))
    return joint_heads(out, w["q_norm"], w["k_norm"], cos, sin, num_heads=cfg.num_heads, head_dim=d,
                       has_v=cfg.has_v_proj(i), v_norm=cfg.use_v_norm, eps=cfg.rms_norm_eps)


def decoder_layer(w: LayerWeights, cfg: TargetConfig, i: int, x, h, positions, ple_i, attend: Attend, cache, *,
                  next_norm: Vec, ops: LayerOps = REFERENCE_OPS):
    """One decoder layer. x: [B, T, H] the residual stream, h its input norm (`norms[0]`); ple_i: [B, T, P] or None.
    Returns (x, h_next = rms_norm(x, next_norm): the next layer's input or the final norm, cache). ops: the
    reference's or the kernel's norms (`LayerOps`)."""
    eps, add_norm = cfg.rms_norm_eps, ops.add_norm
    B, T = positions.shape
    into_cache = getattr(attend, "qkv_into_cache", None)  # `cache.qkv_kernel_on`: norms, RoPE, K/V write in one kernel
    shared_q = getattr(attend, "shared_q", None)  # a KV-shared layer's q norm and RoPE in the attention kernel
    qkv_attend = getattr(attend, "qkv_attend", None)  # a non-shared layer's too, and its K/V write
    shared = "q_proj" in w and "k_proj" not in w  # a KV-shared layer: q's norm and RoPE only
    a = None
    if "qkv_proj" in w and (into_cache is not None or qkv_attend is not None):
        out = vec_linear(h, w.vec("qkv_proj"))
        done = None if qkv_attend is None else qkv_attend(cache, i, out, w.vec("q_norm"), w.vec("k_norm"), positions)
        if done is not None:
            a, cache = done
        elif into_cache is not None:
            q, cache = into_cache(cache, i, out, w.vec("q_norm"), w.vec("k_norm"), positions)
            k = v = None  # written
        else:
            q, k, v = qkv(w, cfg, i, h, positions, out=out)
    elif shared and shared_q is not None:
        a, cache = shared_q(cache, i, vec_linear(h, w.vec("q_proj")), w.vec("q_norm"), positions)
    elif shared and into_cache is not None:
        q, k, v = attend.q_rope(i, vec_linear(h, w.vec("q_proj")), w.vec("q_norm"), positions), None, None
    else:
        q, k, v = qkv(w, cfg, i, h, positions)
    if a is None:
        a, cache = attend(cache, i, q, k, v)
    a = a.reshape(B, T, -1)
    o = vec_linear(a, w.vec("o_proj"))
    x, h = add_norm(o, x, w.vec("norms", 1), w.vec("norms", 2), None, eps)
    act = mlp_activation(h, w["gate_up"])
    residual = x
    m = linear(act, w["down"])
    if cfg.enable_moe_block:
        experts = moe(h, residual, w, top_k=cfg.top_k_experts, eps=eps)
        m = rms_norm(m, w["moe_norms"][1], eps) + rms_norm(experts, w["moe_norms"][2], eps)
    if ple_i is None:
        x, h = add_norm(m, residual, w.vec("norms", 3), next_norm, w.vec("layer_scalar"), eps)
        return x, h, cache
    x, _ = add_norm(m, residual, w.vec("norms", 3), None, None, eps)
    g = gated_ple(vec_linear(x, w.vec("ple_gate")), ple_i)
    p = vec_linear(g, w.vec("ple_proj"))
    x, h = add_norm(p, x, w.vec("ple_norm"), next_norm, w.vec("layer_scalar"), eps)
    return x, h, cache


def decoder_layers(params, cfg: TargetConfig, x, positions, ple, attend: Attend, cache, final_norm,
                   ops: LayerOps = REFERENCE_OPS):
    """Every decoder layer and the final norm (final_norm: its [H] weight). ple: [B, T, L, P] or None.
    Returns (rms_norm(x_out, final_norm) [B, T, H], cache)."""
    ws = [layer_weights(params, cfg, i) for i in range(cfg.num_layers)]
    h = rms_norm(x, ws[0]["norms"][0], cfg.rms_norm_eps)
    for i, w in enumerate(ws):
        next_norm = ws[i + 1].vec("norms", 0) if i + 1 < len(ws) else Vec(final_norm)
        ple_i = None if ple is None else ple[:, :, i]
        x, h, cache = decoder_layer(w, cfg, i, x, h, positions, ple_i, attend, cache, next_norm=next_norm, ops=ops)
    return h, cache


def forward(params, cfg: TargetConfig, tokens, positions, attend: Attend, cache, ops: LayerOps = REFERENCE_OPS):
    """Run the decoder. tokens, positions: int32[B, T]. Returns (post-final-norm hidden [B, T, H], cache)."""
    x, ple = embed(params, cfg, tokens)
    return decoder_layers(params, cfg, x, positions, ple, attend, cache, params["final_norm"], ops)


def logits(params, cfg: TargetConfig, hidden):
    """Tied-head logits in fp32, softcapped where configured. hidden: [..., H] -> [..., V]."""
    head = params.get("lm_head", params["embed"])
    out = jnp.einsum("...h,vh->...v", hidden, head, preferred_element_type=acc_dtype(hidden.dtype))
    return softcap(out, cfg.final_logit_softcapping)


# ---- the dense cache: the reference the paged cache must match ------------------------------------------------------


def init_dense_cache(cfg: TargetConfig, batch: int, max_len: int, dtype) -> dict[str, LayerKV]:
    """K/V of every non-shared layer, per attention type: k, v [L_type, B, S, KVH, d], zero-initialised."""
    cache = {}
    for t, layers in cfg.kv_layers.items():
        if layers:
            shape = (len(layers), batch, max_len, cfg.type_kv_heads(t), cfg.type_head_dim(t))
            cache[t] = LayerKV(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    return cache


def dense_attend(cfg: TargetConfig, positions) -> Attend:
    """Attention over a dense cache: write the new K/V at `positions`, attend causally (sliding: the last W)."""

    def attend(cache, i, q, k, v):
        t, slot = cfg.kv_slot(i)
        B = q.shape[0]
        rows = jnp.arange(B)[:, None]
        if k is not None:
            stack = cache[t]
            cache = {**cache, t: LayerKV(k=stack.k.at[slot, rows, positions].set(k),
                                         v=stack.v.at[slot, rows, positions].set(v))}
        keys, values = cache[t].k[slot], cache[t].v[slot]
        kpos = jnp.arange(keys.shape[1])[None, None, :]
        qpos = positions[:, :, None]
        valid = kpos <= qpos
        if t == SLIDING:
            valid &= kpos > qpos - cfg.sliding_window
        return attention(q, keys, values, valid, scale=cfg.query_scale), cache

    return attend


def dense_forward(params, cfg: TargetConfig, tokens, start, cache):
    """Process tokens [B, T] at positions start..start+T-1 over a dense cache.

    Returns (logits [B, T, V] fp32, hidden [B, T, H], cache). The store layers' K/V are `cache[type].k[-1]` and
    `cache[type].v[-1]` (the last non-shared layer of each type).
    """
    T = tokens.shape[1]
    positions = (start + jnp.arange(T, dtype=jnp.int32))[None, :].repeat(tokens.shape[0], 0)
    hidden, cache = forward(params, cfg, tokens, positions, dense_attend(cfg, positions), cache)
    return logits(params, cfg, hidden), hidden, cache


dense_forward_jit = jax.jit(dense_forward, static_argnums=(1,), donate_argnums=(4,))


# ---- the paged cache: what the engine runs ---------------------------------------------------------------------------


def paged_forward(params, cfg: TargetConfig, kv, meta: StepMetadata, tokens, *, use_kernels: bool = True, mesh=None):
    """Process tokens [B, T] over the paged cache, as `meta` (`paged_kv.metadata.step_metadata`) places them: a
    prefill chunk, a decode or a verify step; padded positions' outputs are meaningless.

    Returns (hidden [B, T, H], kv). Logits are taken by the caller on the rows it needs (`logits`).
    """
    return forward(params, cfg, tokens, meta.positions, paged_attend(cfg, meta, use_kernels=use_kernels, mesh=mesh),
                   kv, layer_ops(use_kernels, mesh))


def layer_ops(use_kernels: bool, mesh=None) -> LayerOps:
    """The kernels a layer runs between its weights and values, with the kernels on one device: the residual stream's
    norms (`row_norms.add_norm`) unless JAXSPEC_FUSED_NORMS=0; the jnp reference otherwise. The norms kernel is on by
    default: on the H200 it took E4B's bs-1 decode step from 4.55-4.65 to 4.28-4.34 ms (-6%, XLA splits each norm of
    a single row into two kernels) and tied on the verify step and the bs-64 propose (BENCHMARKS.md session 29). Three
    kernels of the products were slower and are removed (session 37; commit a536233 has them): the small products
    alone (`gemv`, session 17: E4B's verify step 14-29% slower), a layer's products with their norms
    (`layer_products`, session 26: 2.8x) and o / down in pieces summed in the norms kernel (session 33: decode +3%)."""
    on = use_kernels and mesh is None
    return LayerOps(
        add_norm=row_norms.add_norm if on and env_switch("JAXSPEC_FUSED_NORMS") is not False else add_norm_ref)

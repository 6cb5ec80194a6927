"""Building blocks of the Gemma 4 / Gemma 3 text decoder (exact semantics: shared/reference/gemma4_arch.md §2)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import Rope, rope_inv_freq


def acc_dtype(dtype):
    """Accumulation dtype: fp32 for bf16/fp32 activations, fp64 when the model runs in fp64 (oracle tests)."""
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(x, weight=None, eps: float = 1e-6):
    """x * (mean(x²) + eps)^-1/2 * weight, computed in fp32 and cast back. `weight` is fp32 (Gemma 3's 1+w is folded
    in at load time), None for the weightless v-norm / router norm."""
    xf = x.astype(acc_dtype(x.dtype))
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(xf.dtype)
    return y.astype(x.dtype)


def apply_rope(x, positions, rope: Rope):
    """Rotary embedding in the rotate-half layout (pairs i and i + D/2).

    x: [B, T, N, D]; positions: int32[B, T]. Proportional (partial) RoPE has zero tail frequencies, which leaves
    those dims unrotated (cos 1, sin 0).
    """
    cos, sin = rope_tables(positions, rope, x.shape[-1], acc_dtype(x.dtype))
    return rotate(x, cos[:, :, None, :], sin[:, :, None, :])


def rope_tables(positions, rope: Rope, D: int, dtype):
    """cos, sin [B, T, D] in `dtype` (the accumulation dtype) of the rotate-half layout at positions int32[B, T]."""
    inv = jnp.asarray(rope_inv_freq(rope, D, np.dtype(dtype)))  # [D/2]
    f = positions.astype(dtype)[..., None] * inv  # [B, T, D/2]
    emb = jnp.concatenate([f, f], axis=-1)  # [B, T, D]
    return jnp.cos(emb), jnp.sin(emb)


def rotate(x, cos, sin):
    """x [..., D] rotated by tables cos, sin that broadcast to it, computed in their dtype, rounded to x's."""
    D = x.shape[-1]
    xf = x.astype(cos.dtype)
    rot = jnp.concatenate([-xf[..., D // 2:], xf[..., : D // 2]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


def joint_heads(out, q_norm, k_norm, cos, sin, *, num_heads: int, head_dim: int, has_v: bool, v_norm: bool,
                eps: float):
    """A fused q/k/v product out [B, T, (NH + KVH (+ KVH)) D] -> (q, k, v) [B, T, heads, D]: q's and k's heads (and
    v's, with the weightless v-norm) normed as one array, each head with its own weight (q_norm, k_norm: [D], or 1:
    exact), then q's and k's heads rotated at once by cos, sin [B, T, D] (`rope_tables`). Without has_v, V is the raw
    K projection (normed where v_norm)."""
    B, T, _ = out.shape
    heads = out.reshape(B, T, -1, head_dim)
    NH = num_heads
    KVH = (heads.shape[2] - NH) // (2 if has_v else 1)
    acc = acc_dtype(out.dtype)
    weights = [jnp.broadcast_to(q_norm.astype(acc), (NH, head_dim)),
               jnp.broadcast_to(k_norm.astype(acc), (KVH, head_dim))]
    if has_v and v_norm:
        weights.append(jnp.ones((KVH, head_dim), acc))
    normed = rms_norm(heads[:, :, : NH + KVH * len(weights[1:])], jnp.concatenate(weights), eps)
    qk = rotate(normed[:, :, : NH + KVH], cos[:, :, None, :], sin[:, :, None, :])
    if has_v:
        v = normed[:, :, NH + KVH:] if v_norm else heads[:, :, NH + KVH:]
    else:  # k_eq_v: V is the raw K projection
        v = heads[:, :, NH:]
        v = rms_norm(v, None, eps) if v_norm else v
    return qk[:, :, :NH], qk[:, :, NH:], v


def one_row(x) -> bool:
    """Whether x [..., K] holds a single row: the steps where XLA on the GPU strength-reduces products (`linear`) and
    fuses an exp-form activation into them (`gated_ple`)."""
    return math.prod(x.shape[:-1]) == 1


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def gelu_tanh_exp(x):
    """`gelu_tanh`, transformers' gelu_pytorch_tanh 0.5 x (1 + tanh(t)) with t = sqrt(2/pi) (x + 0.044715 x^3),
    written as the identical x / (1 + exp(-2t)), in x's dtype. In fp32 its largest error against the tanh form in
    fp64 is 5.2e-7 over [-20, 20] (jax.nn.gelu's: 7.8e-7). XLA's GPU compiler fuses this form into a one-row product
    that reads it, not the tanh form (`gated_ple`)."""
    u = (x + 0.044715 * (x * x * x)) * (2 * math.sqrt(2 / math.pi))
    return x / (1 + jnp.exp(-u))


def gated_ple(gate, ple):
    """gelu_tanh(gate) * ple: the per-layer input branch's gate, in gate's dtype. One row takes `gelu_tanh_exp`,
    which XLA on the GPU fuses into the ple_proj product's reduction that follows, where the tanh form is a kernel of
    its own (E4B's bs-1 decode step 658 -> 616 launches, 34.7 us less kernel time a step on the H100: BENCHMARKS.md
    session 38). More rows keep the tanh form: at 256 rows (E4B's bs-64 verify step) XLA folds the ple_gate GEMM's
    split-K reduction into a tanh consumer and not into the exp one (+42 launches, compiled for the H200). As the
    one-row products (`linear`), a row's rounding may so differ between one-row and many-row steps; the
    batch-invariant mode's steps have at least two rows."""
    act = gelu_tanh_exp if one_row(gate) else gelu_tanh
    return act(gate) * ple


# XLA's GPU compiler rewrites a product of one row whose weight has at most this many elements into a multiply and a
# reduction (its dot strength reduction, `IsMatrixMultiplicationTooSmallForRewriting(dot, 10000000)`), and runs the
# multiply in the dot's dtype: in bf16 each term is rounded to bf16 before the fp32 sum (BENCHMARKS.md, session 34).
STRENGTH_REDUCED_MAX = 10_000_000


def linear(x, w):
    """x @ w.T with w in HF layout [out, in]. Where XLA on the GPU would strength-reduce it (one row of a 16-bit
    dtype, at most STRENGTH_REDUCED_MAX weights), the same multiply and reduction written out with fp32 terms
    (`one_row_product`), as transformers' cuBLAS products and XLA's own GEMMs (every product of more rows) compute
    them; XLA fuses them into the one reduction kernel it would have made. Other platforms keep the dot."""
    if (jnp.dtype(x.dtype).itemsize < 4 and x.dtype == w.dtype and one_row(x)
            and w.size <= STRENGTH_REDUCED_MAX):
        return jax.lax.platform_dependent(x, w, cuda=one_row_product, default=dot)
    return dot(x, w)


def dot(x, w):
    return jnp.einsum("...i,oi->...o", x, w)


def one_row_product(x, w):
    """x @ w.T as a multiply in fp32 (every term exact) and an fp32 sum over the input, rounded once to x's dtype."""
    acc = acc_dtype(x.dtype)
    return jnp.sum(x.astype(acc)[..., None, :] * w.astype(acc), axis=-1).astype(x.dtype)


def mlp_activation(x, gate_up):
    """gelu_tanh(gate(x)) * up(x) in x's dtype; gate_up: [2I, H] (gate rows first)."""
    gu = linear(x, gate_up)
    g, u = jnp.split(gu.astype(acc_dtype(x.dtype)), 2, axis=-1)  # one rounding, whether fused (jit) or not (eager)
    return (gelu_tanh(g) * u).astype(x.dtype)


def gated_mlp(x, gate_up, down):
    """down(gelu_tanh(gate(x)) * up(x)); gate_up: [2I, H] (gate rows first), down: [H, I]."""
    return linear(mlp_activation(x, gate_up), down)


def moe(x, residual, w, *, top_k: int, eps: float):
    """The MoE branch of a Gemma 4 26B-A4B layer (router on the residual stream, experts on its own norm).

    x is unused by the router on purpose: transformers routes the pre-MLP residual. residual: [..., H].
    w: router_proj [E, H], router_scale [H], per_expert_scale [E], experts_gate_up [E, 2I, H], experts_down [E, H, I],
    moe_norms[1] = pre_feedforward_layernorm_2.
    Returns the expert mixture [..., H] (before post_feedforward_layernorm_2).
    """
    del x
    shape = residual.shape
    r = residual.reshape(-1, shape[-1])  # [N, H]
    H = shape[-1]
    rn = rms_norm(r, None, eps) * w["router_scale"].astype(r.dtype) * H**-0.5
    acc = acc_dtype(r.dtype)
    probs = jax.nn.softmax(linear(rn, w["router_proj"]).astype(acc), axis=-1)  # [N, E]
    topw, topi = jax.lax.top_k(probs, top_k)
    topw = topw / jnp.sum(topw, axis=-1, keepdims=True) * w["per_expert_scale"][topi].astype(acc)
    x2 = rms_norm(r, w["moe_norms"][0], eps)  # [N, H]
    E = w["experts_gate_up"].shape[0]
    if r.shape[0] * top_k <= E:
        # Few tokens (decode): read only the selected experts' weights.
        gu = jnp.einsum("nh,nkih->nki", x2, w["experts_gate_up"][topi])
        g, u = jnp.split(gu, 2, axis=-1)
        y = jnp.einsum("nki,nkhi->nkh", gelu_tanh(g) * u, w["experts_down"][topi])
        out = jnp.sum(y.astype(acc) * topw[..., None], axis=1)
    else:
        # Many tokens (prefill): every expert on every token, combined with routing weights (0 off the top-k).
        dense_w = jnp.zeros(probs.shape, acc).at[jnp.arange(r.shape[0])[:, None], topi].set(topw)
        gu = jnp.einsum("nh,eih->nei", x2, w["experts_gate_up"])
        g, u = jnp.split(gu, 2, axis=-1)
        y = jnp.einsum("nei,ehi->neh", gelu_tanh(g) * u, w["experts_down"])
        out = jnp.einsum("neh,ne->nh", y.astype(acc), dense_w)
    return out.astype(residual.dtype).reshape(shape)


def softcap(x, cap):
    if not cap:
        return x
    return jnp.tanh(x / cap) * cap


def sqrt_scale(n: int, dtype):
    """sqrt(n) cast to the weight dtype, as transformers does (bf16: sqrt(1536) = 39.25)."""
    return jnp.asarray(np.float32(np.sqrt(n)), dtype)

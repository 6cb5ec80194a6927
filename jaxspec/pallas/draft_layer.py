"""Pallas (Triton) kernels of the drafter's step, fused around its matrix-vector products, each beside its jnp
reference of the same call (`*_ref`: the CPU path's math and the kernels' test oracle).

A drafter step is ~70 XLA kernels of 1-5 µs when every norm, cast, transpose and RoPE is its own fusion (H200,
bench/results/h200-trace-propose-bs1.json). Here each product carries what surrounds it, so a layer is five launches
(q, attention, o, up, down) plus the attention's split merge:

    pre_projection  x   = W_pre · [E_target[token]·√Ht, seed]
    q_heads         x   = (x1 + norm(d)·n3) · layer_scalar          (the previous layer's residual, or x itself)
                    q   = rope(norm_head(W_q · norm(x)·n0))         written straight in the attention's row layout
    o_proj          o   = W_o · attention                            (the attention's row layout read as is)
    mlp_up          x1  = x + norm(o)·n1;  m = gelu(W_g · norm(x1)·n2) * (W_u · norm(x1)·n2)
    mlp_down        d   = W_d · m
    final_projection hn = norm((x1 + norm(d)·n3) · layer_scalar)·n_final;  h_next = W_post · hn

Every program reads the whole (small) rows it normalises and one slice of the weight; a norm needs the full row, so
a split product cannot normalise its own output: the next kernel does, in its prologue. Rows come in blocks of
`BLOCK_ROWS` (tt.dot needs M >= 16): callers pad the batch to a multiple. Values are rounded to the compute dtype
exactly where the reference rounds (each product's output, each norm's, each residual sum), so bf16 results differ
from the reference only by summation order. Weight stacks are read at a static layer index through the BlockSpecs
(no slice copies). Shapes: `supported` says which drafter geometries these kernels take; others use the reference.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxspec.model.layers import gelu_tanh, linear, rms_norm, sqrt_scale

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)

BLOCK_ROWS = 16


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n (1 if n is odd)."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def supported(hidden: int, head_dims, intermediate: int, backbone_hidden: int) -> bool:
    """Whether the kernels take this drafter: power-of-two hidden size and head dims (whole rows are loaded as one
    tile), and product sizes with power-of-two blocks of at least 16 (Triton's dot)."""
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return (pow2(hidden) and all(pow2(d) for d in head_dims) and _pow2_divisor(intermediate, 64) >= 16
            and _pow2_divisor(backbone_hidden, 64) >= 16)


def _interpret(interpret):
    return jax.default_backend() == "cpu" if interpret is None else interpret


def _params(num_warps=4, num_stages=2):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _dot(x, w):
    """x [M, K] · w[N, K]ᵀ in fp32 (full fp32 precision for fp32 operands)."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _inv_rms(xf, eps):
    """rsqrt(mean(x²) + eps) of fp32 rows [M, H]: [M, 1]."""
    return lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + eps)


def _round(x, dtype):
    """x rounded to the compute dtype and back to fp32: where the reference materialises a value in its dtype."""
    return x.astype(dtype).astype(jnp.float32)


def _chunk(ref, k0, block_k):
    """Columns [k0, k0 + block_k) of a [M, K] ref (or of a [K] vector ref) in fp32."""
    if len(ref.shape) == 1:
        return ref[pl.ds(k0, block_k)].astype(jnp.float32)[None, :]
    return ref[:, pl.ds(k0, block_k)].astype(jnp.float32)


class _Stream:
    """The residual stream entering a layer or the final norm, by column chunks: x itself, or the previous layer's
    output (x1 + norm(d)·n3) · layer_scalar, rounded as `decoder_layer` rounds it. Products read their weights in
    column chunks (a whole [D, H] weight tile does not fit a program's registers), so the rows are rebuilt chunk by
    chunk from their refs, with each norm's row scale taken once from the whole row."""

    def __init__(self, x_ref, d_ref=None, n3_ref=None, scale=None, *, eps, dtype):
        self.x_ref, self.d_ref, self.n3_ref, self.dtype = x_ref, d_ref, n3_ref, dtype
        if d_ref is not None:
            self.r_d = _inv_rms(d_ref[...].astype(jnp.float32), eps)
            self.scale = _round(scale, dtype)
        self.full = self.chunk(0, x_ref.shape[1])  # [M, H] fp32

    def chunk(self, k0, block_k):
        x = _chunk(self.x_ref, k0, block_k)
        if self.d_ref is None:
            return x
        y = _round(_chunk(self.d_ref, k0, block_k) * self.r_d * _chunk(self.n3_ref, k0, block_k), self.dtype)
        return _round(_round(x + y, self.dtype) * self.scale, self.dtype)


def _normed_products(chunk, weights, r, norm_ref, *, hidden, block_k, dtype, acc_shapes):
    """Σ over column chunks of norm(x)·n [M, bk] (in the compute dtype) times each weight chunk: one fp32 [M, N]
    accumulator per weight. chunk(k0, bk): the rows' columns; r: their row scale; weights: functions k0 -> [N, bk]."""
    def body(j, accs):
        k0 = pl.multiple_of(j * block_k, block_k)
        h = (chunk(k0, block_k) * r * _chunk(norm_ref, k0, block_k)).astype(dtype)
        return tuple(acc + _dot(h, w(k0)) for acc, w in zip(accs, weights))

    init = tuple(jnp.zeros(shape, jnp.float32) for shape in acc_shapes)
    return lax.fori_loop(0, hidden // block_k, body, init)


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


# ---- pre_projection ----------------------------------------------------------------------------------------------------


def _pre_kernel(tok_ref, seed_ref, emb_ref, w_ref, o_ref, *, scale, block_k, backbone):
    tok = jnp.clip(tok_ref[...], 0, emb_ref.shape[0] - 1)  # [BM]; an id past the table must not read past it
    dtype = o_ref.dtype

    def body(j, acc):
        k0 = pl.multiple_of(j * block_k, block_k)
        e = _round(emb_ref[tok, pl.ds(k0, block_k)].astype(jnp.float32) * scale, emb_ref.dtype).astype(dtype)
        s = seed_ref[:, pl.ds(k0, block_k)].astype(dtype)
        acc = acc + _dot(e, w_ref[:, pl.ds(k0, block_k)])
        return acc + _dot(s, w_ref[:, pl.ds(backbone + k0, block_k)])

    acc = lax.fori_loop(0, backbone // block_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(dtype)


def pre_projection(tokens, seed, target_embed, w_pre, *, interpret=None):
    """x [B, H] = W_pre · concat(E_target[tokens] · √Ht, seed). tokens: i32[B]; seed: [B, Ht]; target_embed: [V, Ht];
    w_pre: [H, 2 Ht]. B a multiple of BLOCK_ROWS."""
    B, Ht = seed.shape
    H = w_pre.shape[0]
    if tokens.shape != (B,) or B % BLOCK_ROWS:
        raise ValueError(f"tokens {tokens.shape} and seed rows {B} must agree and be a multiple of {BLOCK_ROWS}")
    bn, bk = 16, _pow2_divisor(Ht, 128)
    scale = float(np.float32(np.sqrt(Ht)).astype(target_embed.dtype))  # `sqrt_scale`, on the host
    kernel = functools.partial(_pre_kernel, scale=scale, block_k=bk, backbone=Ht)
    return pl.pallas_call(
        kernel, grid=(B // BLOCK_ROWS, H // bn),
        in_specs=[pl.BlockSpec((BLOCK_ROWS,), lambda i, n: (i,)),
                  pl.BlockSpec((BLOCK_ROWS, Ht), lambda i, n: (i, 0)),
                  _whole(target_embed.shape),
                  pl.BlockSpec((bn, 2 * Ht), lambda i, n: (n, 0))],
        out_specs=pl.BlockSpec((BLOCK_ROWS, bn), lambda i, n: (i, n)),
        out_shape=jax.ShapeDtypeStruct((B, H), w_pre.dtype),
        compiler_params=_params(), interpret=_interpret(interpret), name="draft_pre_projection",
    )(tokens.astype(jnp.int32), seed, target_embed, w_pre)


def pre_projection_ref(tokens, seed, target_embed, w_pre, *, interpret=None):
    del interpret
    dtype = w_pre.dtype
    emb = target_embed[tokens] * sqrt_scale(seed.shape[1], target_embed.dtype)
    return linear(jnp.concatenate([emb.astype(dtype), seed.astype(dtype)], axis=-1), w_pre)


# ---- q_heads ----------------------------------------------------------------------------------------------------------


def _q_kernel(*refs, eps, chained, dtype, block_k):
    if chained:
        x1_ref, d_ref, n3_ref, ls_ref, n0_ref, w_ref, qn_ref, cos_ref, sin_ref, q_ref, x_ref = refs
        stream = _Stream(x1_ref, d_ref, n3_ref, ls_ref[0], eps=eps, dtype=dtype)
    else:
        x_ref, n0_ref, w_ref, qn_ref, cos_ref, sin_ref, q_ref = refs
        stream = _Stream(x_ref, eps=eps, dtype=dtype)
    D, H = w_ref.shape
    M = stream.full.shape[0]
    # RoPE's rotate-half partner of column j is column (j + D/2) % D, negated in the first half: the partner columns
    # come from the same weight rows in permuted order (no register shuffle), through the same norm.
    perm = (lax.iota(jnp.int32, D) + D // 2) % D
    sign = jnp.where(lax.iota(jnp.int32, D) < D // 2, -1.0, 1.0).astype(jnp.float32)
    q, q_partner = _normed_products(
        stream.chunk, (lambda k0: w_ref[:, pl.ds(k0, block_k)], lambda k0: w_ref[perm, pl.ds(k0, block_k)]),
        _inv_rms(stream.full, eps), n0_ref, hidden=H, block_k=block_k, dtype=dtype, acc_shapes=[(M, D)] * 2)
    q, q_partner = _round(q, dtype), _round(q_partner, dtype)
    r = _inv_rms(q, eps)
    q = _round(q * r * qn_ref[...][None, :], dtype)
    q_partner = _round(q_partner * r * qn_ref[perm][None, :], dtype)
    q_ref[...] = (q * cos_ref[...] + sign[None, :] * q_partner * sin_ref[...]).astype(q_ref.dtype)
    if chained:
        @pl.when(pl.program_id(1) == 0)
        def _():
            x_ref[...] = stream.full.astype(x_ref.dtype)


def q_heads(stream, norms, layer, w_q, q_norm, cos, sin, *, num_kv_heads, rows_per_kv_head, eps, prev=None,
            interpret=None):
    """The layer's queries, normed and rotated, in the attention kernel's row layout, and the layer input x.

    stream: x [B, H] (the first layer), or (x1, d) of the previous layer with prev = (norms_prev, layer_prev,
    layer_scalar_prev) to apply its residual first. norms: [L, 4, H] fp32 stack (norms[layer, 0] is the input norm);
    w_q: [L, NH·D, H]; q_norm: [L, D]; cos, sin: fp32 [B, D] (RoPE of each row's position, `rope_tables`).
    Returns (q_rows [B, KVH, rows_per_kv_head, D]: head h = kvh·G + g in row g of kv head kvh, rows G.. unwritten;
    x [B, H]).
    """
    chained = prev is not None
    D = q_norm.shape[-1]
    NH = w_q.shape[1] // D
    G = NH // num_kv_heads
    if chained:
        x1, d = stream
        norms_prev, layer_prev, scalar_prev = prev
    else:
        x1 = stream
    B, H = x1.shape
    dtype = w_q.dtype
    rows = lambda i, h: (i, 0)  # noqa: E731
    q_spec = pl.BlockSpec((BLOCK_ROWS, None, None, D), lambda i, h: (i, h // G, h % G, 0))
    w_specs = [pl.BlockSpec((None, None, H), lambda i, h: (layer, 0, 0)),
               pl.BlockSpec((None, D, H), lambda i, h: (layer, h, 0)),
               pl.BlockSpec((None, D), lambda i, h: (layer, 0)),
               pl.BlockSpec((BLOCK_ROWS, D), rows), pl.BlockSpec((BLOCK_ROWS, D), rows)]
    q_shape = jax.ShapeDtypeStruct((B, num_kv_heads, rows_per_kv_head, D), dtype)
    # two [rows, D] fp32 accumulators and a [D, block_k] weight chunk (twice, permuted) per program: at D = 512 a
    # narrower chunk and more warps keep both in registers and shared memory
    block_k = _pow2_divisor(H, 32 if D >= 512 else 64)
    kernel = functools.partial(_q_kernel, eps=eps, chained=chained, dtype=dtype, block_k=block_k)
    call = functools.partial(pl.pallas_call, kernel, grid=(B // BLOCK_ROWS, NH),
                             compiler_params=_params(num_warps=8 if D >= 512 else 4),
                             interpret=_interpret(interpret), name="draft_q_heads")
    if not chained:
        q = call(in_specs=[pl.BlockSpec((BLOCK_ROWS, H), rows), *w_specs], out_specs=q_spec, out_shape=q_shape)(
            x1, norms, w_q, q_norm, cos, sin)
        return q, x1
    in_specs = [pl.BlockSpec((BLOCK_ROWS, H), rows), pl.BlockSpec((BLOCK_ROWS, H), rows),
                pl.BlockSpec((None, None, H), lambda i, h: (layer_prev, 3, 0)),
                pl.BlockSpec((1,), lambda i, h: (layer_prev,)), *w_specs]
    return call(in_specs=in_specs, out_specs=[q_spec, pl.BlockSpec((BLOCK_ROWS, H), rows)],
                out_shape=[q_shape, jax.ShapeDtypeStruct((B, H), dtype)])(
        x1, d, norms_prev, scalar_prev, norms, w_q, q_norm, cos, sin)


def residual_ref(x1, d, norms, layer, layer_scalar, eps):
    """The reference of the residual the kernels apply in their prologues: `decoder_layer`'s last two lines."""
    x = x1 + rms_norm(d, norms[layer, 3], eps)
    return x * layer_scalar[layer].astype(x.dtype)


def q_heads_ref(stream, norms, layer, w_q, q_norm, cos, sin, *, num_kv_heads, rows_per_kv_head, eps, prev=None,
                interpret=None):
    """The reference: `decoder_layer`'s query path, RoPE as `apply_rope` computes it from the same cos / sin tables;
    rows G.. of each kv head are zero."""
    del interpret
    x = stream if prev is None else residual_ref(*stream, prev[0], prev[1], prev[2], eps)
    B, H = x.shape
    D = q_norm.shape[-1]
    NH = w_q.shape[1] // D
    h = rms_norm(x, norms[layer, 0], eps)
    q = rms_norm(linear(h, w_q[layer]).reshape(B, NH, D), q_norm[layer], eps)
    qf = q.astype(cos.dtype)
    rot = jnp.concatenate([-qf[..., D // 2:], qf[..., : D // 2]], axis=-1)
    q = (qf * cos[:, None, :] + rot * sin[:, None, :]).astype(q.dtype)
    G = NH // num_kv_heads
    q = q.reshape(B, num_kv_heads, G, D)
    return jnp.pad(q, ((0, 0), (0, 0), (0, rows_per_kv_head - G), (0, 0))), x


def rope_tables(positions, inv_freq):
    """cos, sin fp32 [B, D] of each row's position, as `apply_rope` builds them (inv_freq: [D/2], zeros unrotated)."""
    f = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


# ---- o_proj -----------------------------------------------------------------------------------------------------------


def _o_kernel(a_ref, w_ref, o_ref, *, num_kv_heads, group, head_dim):
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for kvh in range(num_kv_heads):
        for g in range(group):
            h = kvh * group + g
            acc = acc + _dot(a_ref[:, kvh, g, :], w_ref[:, pl.ds(h * head_dim, head_dim)])
    o_ref[...] = acc.astype(o_ref.dtype)


def o_proj(a_rows, w_o, layer, *, num_heads, interpret=None):
    """o [B, H] = W_o · attention. a_rows: [B, KVH, R, D] (the attention's row layout, rows < G read); w_o: [L, H,
    NH·D]."""
    B, KVH, R, D = a_rows.shape
    H = w_o.shape[1]
    bn = 16
    kernel = functools.partial(_o_kernel, num_kv_heads=KVH, group=num_heads // KVH, head_dim=D)
    return pl.pallas_call(
        kernel, grid=(B // BLOCK_ROWS, H // bn),
        in_specs=[pl.BlockSpec((BLOCK_ROWS, KVH, R, D), lambda i, n: (i, 0, 0, 0)),
                  pl.BlockSpec((None, bn, w_o.shape[2]), lambda i, n: (layer, n, 0))],
        out_specs=pl.BlockSpec((BLOCK_ROWS, bn), lambda i, n: (i, n)),
        out_shape=jax.ShapeDtypeStruct((B, H), w_o.dtype),
        compiler_params=_params(), interpret=_interpret(interpret), name="draft_o_proj",
    )(a_rows, w_o)


def o_proj_ref(a_rows, w_o, layer, *, num_heads, interpret=None):
    del interpret
    B, KVH, R, D = a_rows.shape
    a = a_rows[:, :, : num_heads // KVH].reshape(B, num_heads * D)
    return linear(a, w_o[layer])


# ---- mlp_up / mlp_down ------------------------------------------------------------------------------------------------


def _up_kernel(x_ref, o_ref, n1_ref, n2_ref, wg_ref, wu_ref, m_ref, x1_ref, *, eps, block_k):
    dtype = m_ref.dtype
    r_o = _inv_rms(o_ref[...].astype(jnp.float32), eps)

    def x1_chunk(k0, bk):  # x + norm(o)·n1, rounded as decoder_layer rounds it
        y = _round(_chunk(o_ref, k0, bk) * r_o * _chunk(n1_ref, k0, bk), dtype)
        return _round(_chunk(x_ref, k0, bk) + y, dtype)

    H = x_ref.shape[1]
    x1 = x1_chunk(0, H)
    g, u = _normed_products(
        x1_chunk, (lambda k0: wg_ref[:, pl.ds(k0, block_k)], lambda k0: wu_ref[:, pl.ds(k0, block_k)]),
        _inv_rms(x1, eps), n2_ref, hidden=H, block_k=block_k, dtype=dtype, acc_shapes=[m_ref.shape] * 2)
    m_ref[...] = (gelu_tanh(_round(g, dtype)) * _round(u, dtype)).astype(dtype)

    @pl.when(pl.program_id(1) == 0)
    def _():
        x1_ref[...] = x1.astype(x1_ref.dtype)


def mlp_up(x, o, norms, gate_up, layer, *, eps, interpret=None):
    """x1 = x + norm(o)·n1 and m = gelu(W_g · norm(x1)·n2) * (W_u · norm(x1)·n2). x, o: [B, H]; norms: [L, 4, H];
    gate_up: [L, 2I, H] (gate rows first). Returns (m [B, I], x1 [B, H])."""
    B, H = x.shape
    I = gate_up.shape[1] // 2
    bn = _pow2_divisor(I, 64)
    rows = pl.BlockSpec((BLOCK_ROWS, H), lambda i, n: (i, 0))
    return pl.pallas_call(
        functools.partial(_up_kernel, eps=eps, block_k=_pow2_divisor(H, 64)), grid=(B // BLOCK_ROWS, I // bn),
        in_specs=[rows, rows,
                  pl.BlockSpec((None, None, H), lambda i, n: (layer, 1, 0)),
                  pl.BlockSpec((None, None, H), lambda i, n: (layer, 2, 0)),
                  pl.BlockSpec((None, bn, H), lambda i, n: (layer, n, 0)),
                  pl.BlockSpec((None, bn, H), lambda i, n: (layer, n + I // bn, 0))],
        out_specs=[pl.BlockSpec((BLOCK_ROWS, bn), lambda i, n: (i, n)), rows],
        out_shape=[jax.ShapeDtypeStruct((B, I), gate_up.dtype), jax.ShapeDtypeStruct((B, H), gate_up.dtype)],
        compiler_params=_params(), interpret=_interpret(interpret), name="draft_mlp_up",
    )(x, o, norms, norms, gate_up, gate_up)


def mlp_up_ref(x, o, norms, gate_up, layer, *, eps, interpret=None):
    del interpret
    x1 = x + rms_norm(o, norms[layer, 1], eps)
    h = rms_norm(x1, norms[layer, 2], eps)
    gu = linear(h, gate_up[layer])
    g, u = jnp.split(gu.astype(jnp.promote_types(gu.dtype, jnp.float32)), 2, axis=-1)
    return (gelu_tanh(g) * u).astype(x.dtype), x1


def _down_kernel(m_ref, w_ref, d_ref, *, block_k):
    def body(j, acc):
        k0 = pl.multiple_of(j * block_k, block_k)
        return acc + _dot(m_ref[:, pl.ds(k0, block_k)], w_ref[:, pl.ds(k0, block_k)])

    acc = lax.fori_loop(0, m_ref.shape[1] // block_k, body, jnp.zeros(d_ref.shape, jnp.float32))
    d_ref[...] = acc.astype(d_ref.dtype)


def mlp_down(m, down, layer, *, interpret=None):
    """d [B, H] = W_d · m. m: [B, I]; down: [L, H, I]."""
    B, I = m.shape
    H = down.shape[1]
    bn, bk = 16, _pow2_divisor(I, 256)
    return pl.pallas_call(
        functools.partial(_down_kernel, block_k=bk), grid=(B // BLOCK_ROWS, H // bn),
        in_specs=[pl.BlockSpec((BLOCK_ROWS, I), lambda i, n: (i, 0)),
                  pl.BlockSpec((None, bn, I), lambda i, n: (layer, n, 0))],
        out_specs=pl.BlockSpec((BLOCK_ROWS, bn), lambda i, n: (i, n)),
        out_shape=jax.ShapeDtypeStruct((B, H), down.dtype),
        compiler_params=_params(), interpret=_interpret(interpret), name="draft_mlp_down",
    )(m, down)


def mlp_down_ref(m, down, layer, *, interpret=None):
    del interpret
    return linear(m, down[layer])


# ---- final_projection -------------------------------------------------------------------------------------------------


def _final_kernel(x1_ref, d_ref, n3_ref, ls_ref, nf_ref, w_ref, h_ref, hn_ref, *, eps, block_k):
    dtype = h_ref.dtype
    stream = _Stream(x1_ref, d_ref, n3_ref, ls_ref[0], eps=eps, dtype=dtype)
    r = _inv_rms(stream.full, eps)
    (h,) = _normed_products(stream.chunk, (lambda k0: w_ref[:, pl.ds(k0, block_k)],), r, nf_ref,
                            hidden=x1_ref.shape[1], block_k=block_k, dtype=dtype, acc_shapes=[h_ref.shape])
    h_ref[...] = h.astype(dtype)

    @pl.when(pl.program_id(1) == 0)
    def _():
        hn_ref[...] = (stream.full * r * nf_ref[...][None, :]).astype(hn_ref.dtype)


def final_projection(x1, d, norms, layer, layer_scalar, final_norm, w_post, *, eps, interpret=None):
    """The last layer's residual, the final norm and the post projection: (hn [B, H], h_next [B, Ht]).
    norms, layer_scalar: the last layer's stacks ([L, 4, H], [L]) and its index; w_post: [Ht, H]."""
    B, H = x1.shape
    Ht = w_post.shape[0]
    bn = _pow2_divisor(Ht, 64)
    rows = pl.BlockSpec((BLOCK_ROWS, H), lambda i, n: (i, 0))
    h_next, hn = pl.pallas_call(
        functools.partial(_final_kernel, eps=eps, block_k=_pow2_divisor(H, 64)), grid=(B // BLOCK_ROWS, Ht // bn),
        in_specs=[rows, rows,
                  pl.BlockSpec((None, None, H), lambda i, n: (layer, 3, 0)),
                  pl.BlockSpec((1,), lambda i, n: (layer,)),
                  _whole(final_norm.shape),
                  pl.BlockSpec((bn, H), lambda i, n: (n, 0))],
        out_specs=[pl.BlockSpec((BLOCK_ROWS, bn), lambda i, n: (i, n)), rows],
        out_shape=[jax.ShapeDtypeStruct((B, Ht), w_post.dtype), jax.ShapeDtypeStruct((B, H), w_post.dtype)],
        compiler_params=_params(), interpret=_interpret(interpret), name="draft_final_projection",
    )(x1, d, norms, layer_scalar, final_norm, w_post)
    return hn, h_next


def final_projection_ref(x1, d, norms, layer, layer_scalar, final_norm, w_post, *, eps, interpret=None):
    del interpret
    hn = rms_norm(residual_ref(x1, d, norms, layer, layer_scalar, eps), final_norm, eps)
    return hn, linear(hn, w_post)

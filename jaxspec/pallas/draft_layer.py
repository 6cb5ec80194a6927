"""Pallas (Triton) kernels of the drafter's step, fused around its matrix-vector products, each beside its jnp
reference of the same call (`*_ref`: the CPU path's math and the kernels' test oracle).

A drafter step is ~70 XLA kernels of 1-5 µs when every norm, cast, transpose and RoPE is its own fusion (H200,
bench/results/h200-trace-propose-bs1.json). Here each product carries what surrounds it, so a layer is five launches
(q, attention, o, up, down) plus the attention's split merge:

    pre_projection   x   = W_pre · [E_target[token]·√Ht, seed]
    q_proj           x   = (x1 + norm(d)·n3) · layer_scalar         (the previous layer's residual, or x itself)
                     q   = W_q · norm(x)·n0, and its RoPE partner   both straight in the attention's row layout
    (attention)      q-norm and RoPE in the attention kernel's prologue (`paged_attention_rows(..., rope=...)`)
    o_proj           o   = W_o · attention                           (the attention's row layout read as is)
    mlp_up           x1  = x + norm(o)·n1;  m = gelu(W_g · norm(x1)·n2) * (W_u · norm(x1)·n2)
    mlp_down         d   = W_d · m
    final_projection hn  = norm((x1 + norm(d)·n3) · layer_scalar)·n_final;  h_next = W_post · hn

Every program reads the whole (small) rows it normalises and a few rows of the weight (2 to 16), so a product spreads
over 128 to 256 programs that each stream a few KB, the way XLA's small reduce fusions do; the rows are multiplied by
broadcast and sum (not `tt.dot`, whose 16-row tiles would be 1/16 used at batch 1). A program loads its whole weight
block first, every chunk at once (a static unroll, no loop), then every small operand of its prologue (`_Rows`), and
only then reduces: one memory round trip, not one per chunk and phase (tests/test_triton_lowering.py checks the order
in the Triton IR). A norm needs the full row, so a split product cannot normalise its own output: the next kernel
does, in its prologue. Values are rounded to the compute dtype exactly where the reference rounds (each product's
output, each norm's, each residual sum), so bf16 results differ from the reference only by summation order. Weight
stacks are read at a static layer index through the BlockSpecs (no slice copies). Rows: the batch padded to
`padded_rows` (a power of two below 16, a multiple of 16 above); `supported` says which drafter geometries these
kernels take (others use the reference step).
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
from jaxspec.pallas import interpret_by_default

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)

MAX_BLOCK_ROWS = 16
TILE = 8192  # elements of a program's [rows, weight rows, chunk] product: its registers
# Weight rows a program of the products with a long input (pre, o, down: K 1 024-5 120) multiplies: 2 spreads E4B's
# drafter's 256 outputs over 128 programs, one per multiprocessor of the H200, each holding 2 x K weights in flight
# (4 left 64 of its 132 multiprocessors idle; session 20's trace: down 2.7 µs, o 4.9 µs where XLA's take 1.8)
PROGRAM_ROWS = 2
UP_ROWS = 8  # gate rows (and as many up rows) a program of mlp_up multiplies (K: the drafter's hidden size)
FINAL_ROWS = 16  # output rows a program of the final (post) projection multiplies


def padded_rows(n: int) -> int:
    """Rows the kernels take for a batch of n: the next power of two below 16, a multiple of 16 from there."""
    return 1 << max(n - 1, 0).bit_length() if n < MAX_BLOCK_ROWS else -(-n // MAX_BLOCK_ROWS) * MAX_BLOCK_ROWS


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n (1 if n is odd)."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def supported(hidden: int, head_dims, intermediate: int, backbone_hidden: int) -> bool:
    """Whether the kernels take this drafter: power-of-two hidden size and head dims (whole rows are loaded as one
    tile; a head's halves are whole weight blocks), and product sizes with power-of-two blocks."""
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return (pow2(hidden) and all(pow2(d) for d in head_dims) and intermediate % 8 == 0
            and _pow2_divisor(backbone_hidden, 16) == 16)


def _interpret(interpret):
    return interpret_by_default() if interpret is None else interpret


def _params(num_warps=4, num_stages=2):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _block_rows(B: int) -> int:
    if B != padded_rows(B):
        raise ValueError(f"{B} rows: pad the batch to padded_rows({B}) = {padded_rows(B)}")
    return min(B, MAX_BLOCK_ROWS)


def _chunk_size(K: int, rows: int, weight_rows: int) -> int:
    """Columns a program multiplies at once: [rows, weight_rows, chunk] fits TILE elements."""
    return _pow2_divisor(K, max(16, TILE // (rows * weight_rows)))


def _inv_rms(xf, eps):
    """rsqrt(mean(x²) + eps) of fp32 rows [M, H]: [M, 1]."""
    return lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + eps)


def _round(x, dtype):
    """x rounded to the compute dtype and back to fp32: where the reference materialises a value in its dtype."""
    return x.astype(dtype).astype(jnp.float32)


def _cols(ref, k0, size):
    """Columns [k0, k0 + size) of a [M, K] ref (or of a [K] vector ref, as [1, size]) in fp32."""
    if len(ref.shape) == 1:
        return ref[pl.ds(k0, size)].astype(jnp.float32)[None, :]
    return ref[:, pl.ds(k0, size)].astype(jnp.float32)


def _load_chunks(w, *, K: int, block_k: int):
    """Every column chunk [N, block_k] of a program's weight block (w: k0 -> its load), loaded at once. Kernels call
    this first, before their prologue's loads and norms: the chunks' loads are then all in flight together, one
    memory round trip for the whole block. (Session 20's trace of these kernels: chunks loaded in a loop, one
    dependent round trip after another, made an o projection of 0.5 MB take 4.9 µs where XLA's takes 1.8.)"""
    return [w(k0) for k0 in range(0, K, block_k)]


class _Rows:
    """The small operands a kernel reads whole (the rows it normalises or adds, norm weights), loaded at its start
    right after its weights, so that their loads are in flight with the weights' and the prologue pays one memory
    round trip, not one per operand it reaches after a reduction has stalled it. `cols` serves a chunk that is the
    whole row from here; narrower chunks (batches of 16 rows and more) are read again from the ref (cache hits by
    then)."""

    def __init__(self, *refs):
        self._full = {id(r): _cols(r, 0, r.shape[-1]) for r in refs}

    def cols(self, ref, k0, size):
        full = self._full.get(id(ref))
        if full is not None and k0 == 0 and size == ref.shape[-1]:
            return full
        return _cols(ref, k0, size)


def _products(x_cols, weights, *, block_k: int):
    """Σ over column chunks of x [rows, chunk] (fp32, already rounded as the reference's operand) times each weight's
    chunk [N, chunk], chunk by chunk in column order (a static unroll, no loop): one fp32 [rows, N] accumulator per
    weight. x_cols(k0): the rows' columns; weights: each weight's chunks (`_load_chunks`)."""
    accs = [None] * len(weights)
    for j in range(len(weights[0])):
        x = x_cols(j * block_k)[:, None, :]
        for i, chunks in enumerate(weights):
            p = jnp.sum(x * chunks[j].astype(jnp.float32)[None, :, :], axis=2)
            accs[i] = p if accs[i] is None else accs[i] + p
    return tuple(accs)


class _Stream:
    """The residual stream entering a layer or the final norm, by column chunks: x itself, or the previous layer's
    output (x1 + norm(d)·n3) · layer_scalar, rounded as `decoder_layer` rounds it. Products read their weights in
    column chunks, so the rows are rebuilt chunk by chunk (`rows`: the kernel's `_Rows`, holding x, d, n3 and the
    norm weight whole), each norm's row scale taken once from the whole row."""

    def __init__(self, rows, x_ref, d_ref=None, n3_ref=None, scale=None, *, eps, dtype):
        self.rows, self.x_ref, self.d_ref, self.n3_ref, self.dtype = rows, x_ref, d_ref, n3_ref, dtype
        self.H = x_ref.shape[1]
        if d_ref is not None:
            self.r_d = _inv_rms(rows.cols(d_ref, 0, self.H), eps)
            self.scale = _round(scale, dtype)
        self.full = self._cols(0, self.H)  # [M, H] fp32

    def _cols(self, k0, size):
        x = self.rows.cols(self.x_ref, k0, size)
        if self.d_ref is None:
            return x
        y = _round(self.rows.cols(self.d_ref, k0, size) * self.r_d * self.rows.cols(self.n3_ref, k0, size),
                   self.dtype)
        return _round(_round(x + y, self.dtype) * self.scale, self.dtype)

    def cols(self, k0, size):
        return self.full if k0 == 0 and size == self.H else self._cols(k0, size)

    def normed(self, norm_ref, eps):
        """cols(k0, size) of norm(stream)·n, rounded to the dtype (the product's operand)."""
        r = _inv_rms(self.full, eps)
        return lambda k0, size: _round(self.cols(k0, size) * r * self.rows.cols(norm_ref, k0, size), self.dtype)


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


# ---- pre_projection --------------------------------------------------------------------------------------------------


def _pre_kernel(tok_ref, seed_ref, emb_ref, w_ref, o_ref, *, scale, block_k, backbone):
    w_e = _load_chunks(lambda k0: w_ref[:, pl.ds(k0, block_k)], K=backbone, block_k=block_k)
    w_s = _load_chunks(lambda k0: w_ref[:, pl.ds(backbone + k0, block_k)], K=backbone, block_k=block_k)
    seed = _load_chunks(lambda k0: _cols(seed_ref, k0, block_k), K=backbone, block_k=block_k)
    tok = jnp.clip(tok_ref[...], 0, emb_ref.shape[0] - 1)  # [M]; an id past the table must not read past it
    dtype = o_ref.dtype

    def emb_cols(k0):  # E_target[tok]·√Ht, rounded as the reference rounds it
        e = emb_ref[tok, pl.ds(k0, block_k)].astype(jnp.float32) * scale
        return _round(_round(e, emb_ref.dtype), dtype)

    emb = _load_chunks(emb_cols, K=backbone, block_k=block_k)  # every chunk's load issued before the first product
    (acc_e,) = _products(lambda k0: emb[k0 // block_k], (w_e,), block_k=block_k)
    (acc_s,) = _products(lambda k0: _round(seed[k0 // block_k], dtype), (w_s,), block_k=block_k)
    o_ref[...] = (acc_e + acc_s).astype(dtype)


def pre_projection(tokens, seed, target_embed, w_pre, *, interpret=None):
    """x [B, H] = W_pre · concat(E_target[tokens] · √Ht, seed). tokens: i32[B]; seed: [B, Ht];
    target_embed: [V, Ht]; w_pre: [H, 2 Ht]. B = padded_rows(B)."""
    B, Ht = seed.shape
    H = w_pre.shape[0]
    M = _block_rows(B)
    if tokens.shape != (B,):
        raise ValueError(f"tokens {tokens.shape} and seed rows {B} must agree")
    bn = PROGRAM_ROWS
    bk = _pow2_divisor(Ht, max(16, TILE // (M * bn)))
    scale = float(np.float32(np.sqrt(Ht)).astype(target_embed.dtype))  # `sqrt_scale`, on the host
    kernel = functools.partial(_pre_kernel, scale=scale, block_k=bk, backbone=Ht)
    return pl.pallas_call(
        kernel, grid=(B // M, H // bn),
        in_specs=[pl.BlockSpec((M,), lambda i, n: (i,)),
                  pl.BlockSpec((M, Ht), lambda i, n: (i, 0)),
                  _whole(target_embed.shape),
                  pl.BlockSpec((bn, 2 * Ht), lambda i, n: (n, 0))],
        out_specs=pl.BlockSpec((M, bn), lambda i, n: (i, n)),
        out_shape=jax.ShapeDtypeStruct((B, H), w_pre.dtype),
        compiler_params=_params(), interpret=_interpret(interpret), name="draft_pre_projection",
    )(tokens.astype(jnp.int32), seed, target_embed, w_pre)


def pre_projection_ref(tokens, seed, target_embed, w_pre, *, interpret=None):
    del interpret
    dtype = w_pre.dtype
    emb = target_embed[tokens] * sqrt_scale(seed.shape[1], target_embed.dtype)
    return linear(jnp.concatenate([emb.astype(dtype), seed.astype(dtype)], axis=-1), w_pre)


# ---- q_proj ----------------------------------------------------------------------------------------------------------

Q_ROWS = 8  # weight rows a q program multiplies: divides every head's half


def _q_kernel(*refs, eps, chained, dtype, block_k):
    w_ref = refs[-4 if chained else -3]
    w = _load_chunks(lambda k0: w_ref[:, pl.ds(k0, block_k)], K=w_ref.shape[1], block_k=block_k)
    if chained:
        x1_ref, d_ref, n3_ref, ls_ref, n0_ref, w_ref, q_ref, qs_ref, x_ref = refs
        stream = _Stream(_Rows(x1_ref, d_ref, n3_ref, n0_ref), x1_ref, d_ref, n3_ref, ls_ref[0], eps=eps, dtype=dtype)
    else:
        x_ref, n0_ref, w_ref, q_ref, qs_ref = refs
        stream = _Stream(_Rows(x_ref, n0_ref), x_ref, eps=eps, dtype=dtype)
    normed = stream.normed(n0_ref, eps)
    (q,) = _products(lambda k0: normed(k0, block_k), (w,), block_k=block_k)
    q = q.astype(q_ref.dtype)
    q_ref[...] = q
    qs_ref[...] = q  # the same values at the rotate-half partner's columns (the out BlockSpec's shift)
    if chained:
        @pl.when(pl.program_id(1) == 0)
        def _():
            x_ref[...] = stream.full.astype(x_ref.dtype)


def q_proj(stream, norms, layer, w_q, *, head_dim, num_kv_heads, rows_per_kv_head, eps, prev=None, interpret=None):
    """The layer's raw query projections in the attention kernel's row layout, their RoPE partners, and the layer
    input x. The attention kernel norms and rotates them (`paged_attention_rows(..., rope=...)`).

    stream: x [B, H] (the first layer), or (x1, d) of the previous layer with prev = (norms_prev, layer_prev,
    layer_scalar_prev) to apply its residual first. norms: [L, 4, H] fp32 stack (norms[layer, 0] is the input norm);
    w_q: [L, NH·D, H]. Returns (q, q_swap [B, KVH, rows_per_kv_head, D]: head h = kvh·G + g in row g of kv head kvh,
    rows G.. unwritten; q_swap[..., j] = q[..., (j + D/2) % D]; x [B, H]).
    """
    chained = prev is not None
    D = head_dim
    NH = w_q.shape[1] // D
    G = NH // num_kv_heads
    x1, d = stream if chained else (stream, None)
    B, H = x1.shape
    M = _block_rows(B)
    dtype = w_q.dtype
    per_head = D // Q_ROWS
    rows = lambda i, n: (i, 0)  # noqa: E731

    def q_block(shift):
        def index(i, n):
            h, c = n // per_head, n % per_head
            return i, h // G, h % G, (c + shift) % per_head
        return pl.BlockSpec((M, None, None, Q_ROWS), index)

    w_specs = [pl.BlockSpec((None, None, H), lambda i, n: (layer, 0, 0)),
               pl.BlockSpec((None, Q_ROWS, H), lambda i, n: (layer, n, 0))]
    q_shape = jax.ShapeDtypeStruct((B, num_kv_heads, rows_per_kv_head, D), dtype)
    out_specs, out_shape = [q_block(0), q_block(per_head // 2)], [q_shape, q_shape]
    kernel = functools.partial(_q_kernel, eps=eps, chained=chained, dtype=dtype,
                               block_k=_chunk_size(H, M, Q_ROWS))
    call = functools.partial(pl.pallas_call, kernel, grid=(B // M, NH * per_head), compiler_params=_params(),
                             interpret=_interpret(interpret), name="draft_q_proj")
    if not chained:
        q, q_swap = call(in_specs=[pl.BlockSpec((M, H), rows), *w_specs], out_specs=out_specs, out_shape=out_shape)(
            x1, norms, w_q)
        return q, q_swap, x1
    norms_prev, layer_prev, scalar_prev = prev
    in_specs = [pl.BlockSpec((M, H), rows), pl.BlockSpec((M, H), rows),
                pl.BlockSpec((None, None, H), lambda i, n: (layer_prev, 3, 0)),
                pl.BlockSpec((1,), lambda i, n: (layer_prev,)), *w_specs]
    return tuple(call(in_specs=in_specs, out_specs=[*out_specs, pl.BlockSpec((M, H), rows)],
                      out_shape=[*out_shape, jax.ShapeDtypeStruct((B, H), dtype)])(
        x1, d, norms_prev, scalar_prev, norms, w_q))


def residual_ref(x1, d, norms, layer, layer_scalar, eps):
    """The reference of the residual the kernels apply in their prologues: `decoder_layer`'s last two lines."""
    x = x1 + rms_norm(d, norms[layer, 3], eps)
    return x * layer_scalar[layer].astype(x.dtype)


def q_proj_ref(stream, norms, layer, w_q, *, head_dim, num_kv_heads, rows_per_kv_head, eps, prev=None,
               interpret=None):
    """The reference (rows G.. of each kv head zero)."""
    del interpret
    x = stream if prev is None else residual_ref(*stream, prev[0], prev[1], prev[2], eps)
    B, H = x.shape
    D = head_dim
    NH = w_q.shape[1] // D
    G = NH // num_kv_heads
    q = linear(rms_norm(x, norms[layer, 0], eps), w_q[layer]).reshape(B, num_kv_heads, G, D)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows_per_kv_head - G), (0, 0)))
    return q, jnp.roll(q, -(D // 2), axis=-1), x


def norm_rope_ref(q, q_norm, layer, cos, sin, eps):
    """What the attention kernel's prologue makes of `q_proj`'s output (the reference of `_norm_rope`):
    `decoder_layer`'s q-norm and `apply_rope` from the same tables. q: [B, KVH, R, D]; cos, sin fp32 [B, D]."""
    q = rms_norm(q, q_norm[layer], eps)
    D = q.shape[-1]
    qf = q.astype(cos.dtype)
    rot = jnp.concatenate([-qf[..., D // 2:], qf[..., : D // 2]], axis=-1)
    return (qf * cos[:, None, None, :] + rot * sin[:, None, None, :]).astype(q.dtype)


def rope_tables(positions, inv_freq):
    """cos, sin fp32 [B, D] of each row's position, as `apply_rope` builds them (inv_freq: [D/2], zeros unrotated)."""
    f = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


# ---- o_proj ----------------------------------------------------------------------------------------------------------


def _o_kernel(a_ref, w_ref, o_ref, *, num_kv_heads, group, head_dim, block_k):
    dtype = o_ref.dtype
    heads = [(kvh, g) for kvh in range(num_kv_heads) for g in range(group)]
    w = [_load_chunks(lambda k0, h=h: w_ref[:, pl.ds(h * head_dim + k0, block_k)], K=head_dim, block_k=block_k)
         for h in range(len(heads))]
    a = [_load_chunks(lambda k0, kvh=kvh, g=g: a_ref[:, kvh, g, pl.ds(k0, block_k)], K=head_dim, block_k=block_k)
         for kvh, g in heads]  # every head's attention row, in flight with the weights
    accs = [_products(lambda k0, h=h: _round(a[h][k0 // block_k].astype(jnp.float32), dtype), (w[h],),
                      block_k=block_k)[0] for h in range(len(heads))]
    o_ref[...] = sum(accs).astype(dtype)


def o_proj(a_rows, w_o, layer, *, num_heads, interpret=None):
    """o [B, H] = W_o · attention. a_rows: [B, KVH, R, D] (the attention's row layout, rows < G read); w_o: [L, H,
    NH·D]."""
    B, KVH, R, D = a_rows.shape
    H = w_o.shape[1]
    M = _block_rows(B)
    bn = PROGRAM_ROWS
    kernel = functools.partial(_o_kernel, num_kv_heads=KVH, group=num_heads // KVH, head_dim=D,
                               block_k=_chunk_size(D, M, bn))
    return pl.pallas_call(
        kernel, grid=(B // M, H // bn),
        in_specs=[pl.BlockSpec((M, KVH, R, D), lambda i, n: (i, 0, 0, 0)),
                  pl.BlockSpec((None, bn, w_o.shape[2]), lambda i, n: (layer, n, 0))],
        out_specs=pl.BlockSpec((M, bn), lambda i, n: (i, n)),
        out_shape=jax.ShapeDtypeStruct((B, H), w_o.dtype),
        compiler_params=_params(), interpret=_interpret(interpret), name="draft_o_proj",
    )(a_rows, w_o)


def o_proj_ref(a_rows, w_o, layer, *, num_heads, interpret=None):
    del interpret
    B, KVH, R, D = a_rows.shape
    a = a_rows[:, :, : num_heads // KVH].reshape(B, num_heads * D)
    return linear(a, w_o[layer])


# ---- mlp_up / mlp_down -----------------------------------------------------------------------------------------------


def _up_kernel(x_ref, o_ref, n1_ref, n2_ref, wg_ref, wu_ref, m_ref, x1_ref, *, eps, block_k):
    H = x_ref.shape[1]
    wg = _load_chunks(lambda k0: wg_ref[:, pl.ds(k0, block_k)], K=H, block_k=block_k)
    wu = _load_chunks(lambda k0: wu_ref[:, pl.ds(k0, block_k)], K=H, block_k=block_k)
    rows = _Rows(x_ref, o_ref, n1_ref, n2_ref)
    dtype = m_ref.dtype
    r_o = _inv_rms(rows.cols(o_ref, 0, H), eps)

    def x1_cols(k0, size):  # x + norm(o)·n1, rounded as decoder_layer rounds it
        y = _round(rows.cols(o_ref, k0, size) * r_o * rows.cols(n1_ref, k0, size), dtype)
        return _round(rows.cols(x_ref, k0, size) + y, dtype)

    x1 = x1_cols(0, H)
    r2 = _inv_rms(x1, eps)
    g, u = _products(lambda k0: _round((x1 if block_k == H else x1_cols(k0, block_k)) * r2
                                       * rows.cols(n2_ref, k0, block_k), dtype), (wg, wu), block_k=block_k)
    m_ref[...] = (gelu_tanh(_round(g, dtype)) * _round(u, dtype)).astype(dtype)

    @pl.when(pl.program_id(1) == 0)
    def _():
        x1_ref[...] = x1.astype(x1_ref.dtype)


def mlp_up(x, o, norms, gate_up, layer, *, eps, interpret=None):
    """x1 = x + norm(o)·n1 and m = gelu(W_g · norm(x1)·n2) * (W_u · norm(x1)·n2). x, o: [B, H]; norms: [L, 4, H];
    gate_up: [L, 2I, H] (gate rows first). Returns (m [B, I], x1 [B, H])."""
    B, H = x.shape
    I = gate_up.shape[1] // 2
    M = _block_rows(B)
    bn = UP_ROWS
    rows = pl.BlockSpec((M, H), lambda i, n: (i, 0))
    return pl.pallas_call(
        functools.partial(_up_kernel, eps=eps, block_k=_chunk_size(H, M, 2 * bn)), grid=(B // M, I // bn),
        in_specs=[rows, rows,
                  pl.BlockSpec((None, None, H), lambda i, n: (layer, 1, 0)),
                  pl.BlockSpec((None, None, H), lambda i, n: (layer, 2, 0)),
                  pl.BlockSpec((None, bn, H), lambda i, n: (layer, n, 0)),
                  pl.BlockSpec((None, bn, H), lambda i, n: (layer, n + I // bn, 0))],
        out_specs=[pl.BlockSpec((M, bn), lambda i, n: (i, n)), rows],
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
    w = _load_chunks(lambda k0: w_ref[:, pl.ds(k0, block_k)], K=m_ref.shape[1], block_k=block_k)
    dtype = d_ref.dtype
    m = _load_chunks(lambda k0: _cols(m_ref, k0, block_k), K=m_ref.shape[1], block_k=block_k)
    (acc,) = _products(lambda k0: _round(m[k0 // block_k], dtype), (w,), block_k=block_k)
    d_ref[...] = acc.astype(dtype)


def mlp_down(m, down, layer, *, interpret=None):
    """d [B, H] = W_d · m. m: [B, I]; down: [L, H, I]."""
    B, I = m.shape
    H = down.shape[1]
    M = _block_rows(B)
    bn = PROGRAM_ROWS
    return pl.pallas_call(
        functools.partial(_down_kernel, block_k=_chunk_size(I, M, bn)), grid=(B // M, H // bn),
        in_specs=[pl.BlockSpec((M, I), lambda i, n: (i, 0)),
                  pl.BlockSpec((None, bn, I), lambda i, n: (layer, n, 0))],
        out_specs=pl.BlockSpec((M, bn), lambda i, n: (i, n)),
        out_shape=jax.ShapeDtypeStruct((B, H), down.dtype),
        compiler_params=_params(), interpret=_interpret(interpret), name="draft_mlp_down",
    )(m, down)


def mlp_down_ref(m, down, layer, *, interpret=None):
    del interpret
    return linear(m, down[layer])


# ---- final_projection ------------------------------------------------------------------------------------------------


def _final_kernel(x1_ref, d_ref, n3_ref, ls_ref, nf_ref, w_ref, h_ref, hn_ref, *, eps, block_k):
    w = _load_chunks(lambda k0: w_ref[:, pl.ds(k0, block_k)], K=x1_ref.shape[1], block_k=block_k)
    dtype = h_ref.dtype
    stream = _Stream(_Rows(x1_ref, d_ref, n3_ref, nf_ref), x1_ref, d_ref, n3_ref, ls_ref[0], eps=eps, dtype=dtype)
    normed = stream.normed(nf_ref, eps)
    (h,) = _products(lambda k0: normed(k0, block_k), (w,), block_k=block_k)
    h_ref[...] = h.astype(dtype)

    @pl.when(pl.program_id(1) == 0)
    def _():
        hn_ref[...] = normed(0, x1_ref.shape[1]).astype(hn_ref.dtype)


def final_projection(x1, d, norms, layer, layer_scalar, final_norm, w_post, *, eps, interpret=None):
    """The last layer's residual, the final norm and the post projection: (hn [B, H], h_next [B, Ht]).
    norms, layer_scalar: the last layer's stacks ([L, 4, H], [L]) and its index; w_post: [Ht, H]."""
    B, H = x1.shape
    Ht = w_post.shape[0]
    M = _block_rows(B)
    bn = FINAL_ROWS
    rows = pl.BlockSpec((M, H), lambda i, n: (i, 0))
    h_next, hn = pl.pallas_call(
        functools.partial(_final_kernel, eps=eps, block_k=_chunk_size(H, M, bn)), grid=(B // M, Ht // bn),
        in_specs=[rows, rows,
                  pl.BlockSpec((None, None, H), lambda i, n: (layer, 3, 0)),
                  pl.BlockSpec((1,), lambda i, n: (layer,)),
                  _whole(final_norm.shape),
                  pl.BlockSpec((bn, H), lambda i, n: (n, 0))],
        out_specs=[pl.BlockSpec((M, bn), lambda i, n: (i, n)), rows],
        out_shape=[jax.ShapeDtypeStruct((B, Ht), w_post.dtype), jax.ShapeDtypeStruct((B, H), w_post.dtype)],
        compiler_params=_params(), interpret=_interpret(interpret), name="draft_final_projection",
    )(x1, d, norms, layer_scalar, final_norm, w_post)
    return hn, h_next


def final_projection_ref(x1, d, norms, layer, layer_scalar, final_norm, w_post, *, eps, interpret=None):
    del interpret
    hn = rms_norm(residual_ref(x1, d, norms, layer, layer_scalar, eps), final_norm, eps)
    return hn, linear(hn, w_post)

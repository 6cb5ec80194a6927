"""Pallas (Triton) kernel of a target layer's products with the norms around them, for steps of 1 to 16 rows (decode
and verify at small batch), and its jnp reference (`stream_product_ref`: the ops `decoder_layer` runs without it).
Behind JAXSPEC_LAYER_PRODUCTS=1, off by default: on the H200 (session 26) E4B's bs-1 verify step took 12.67 ms with it
against 4.55 without, because every program redoes its rows' residual and norm (K walked three times a row before and
during the product: the time grows with the rows where XLA's does not) and no product splits K (down's 10 240-long
sums run in 160 programs); BENCHMARKS.md has each site against XLA's ops.

Issue #14's "fold each RMSNorm into the projection that follows it". A Gemma 4 layer normalises between its products:

    x3 = (x2 + norm(p)·n_ple)·s ;  qkv = W_qkv · norm(x3)·n0       (the previous layer's end, this layer's input)
    o  = W_o · attention
    x1 = x3 + norm(o)·n1        ;  m = gelu(W_g · norm(x1)·n2) * (W_u · norm(x1)·n2)
    d  = W_d · m
    x2 = x1 + norm(d)·n3        ;  g = gelu(W_pg · x2) * ple_i
    p  = W_pp · g

XLA runs each norm site as its own kernel (or two at one row), each MLP activation as another, and splits the small
products over K with a reduction kernel after them: ~17 launches a layer of E4B's verify step (`bench graph`). A norm
needs the whole row, so a product split over its outputs cannot normalise its own output; here the *next* product
does it in its prologue, the way the drafter's fused kernels do (`draft_layer`): every program rebuilds the stream
(x + norm(y)·w_y, scaled) and its norm chunk by chunk from the few rows it reads whole, multiplies the normalised
chunk by its block of weight rows, and program 0 writes the new stream for the layer's residual. So a layer is
q/k/v (with the last layer's end), its norms/RoPE/K/V write (`qkv_cache`, JAXSPEC_QKV_KERNEL=1), the attention and
its merge, o, gate/up (with the post-attention residual and the activation), down, the PLE gate (with the post-MLP
residual and its activation), the PLE projection: 9 launches instead of ~17, no split-K reduction.

Each program sums its whole K in fp32 in one order (no split over K, nothing that depends on the rows), by `tt.dot`
over the rows placed in a 16-row tile or by sums across its threads (`Config.form`; fp32 operands at IEEE fp32:
`--dtype fp32` means fp32), so a row's result never depends on the other rows. Values are rounded to the compute dtype exactly where the reference rounds them (each norm's output, each
residual sum, the scaled stream, the product, the activation), so results differ from the reference only by
summation order. Weights and norm vectors are read from their stacks at a static layer index through the BlockSpecs
(`Vec`, no slice copies); the PLE inputs of every layer are one stack read the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxspec.config import LAYER_PRODUCT_SITES
from jaxspec.model.layers import acc_dtype, gelu_tanh, linear, mlp_activation, rms_norm
from jaxspec.pallas.draft_layer import _interpret, _pow2_divisor, _round
from jaxspec.pallas.row_norms import Vec, _scalar_spec, _vec_spec, add_norm_ref

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)

pallas_call = pl.pallas_call  # (a module name, so that tests can watch the kernel's calls)
MAX_ROWS = 16
SITES = LAYER_PRODUCT_SITES  # the products that may run here (`decoder_layer`)
EPILOGUES = (None, "gelu_pair", "gelu_mul")
PROGRAMS = 264  # aim: two programs per multiprocessor of the H200 (132), each streaming a block of weight rows
DOT_ROWS = 16  # `tt.dot`'s smallest tile of rows
FORMS = ("dot", "bsum")
TILE = 8192  # elements of a program's [weight rows, chunk] weight tiles a step (its registers; as `draft_layer`)


@dataclasses.dataclass(frozen=True)
class Residual:
    """The stream x' = (x + norm(y)·w_y)·scalar, not yet computed: `add_norm_ref`'s x' (scalar None: no scaling).
    A product that takes it rebuilds it in its prologue (and writes it once); `decoder_layer` hands the last one of a
    layer to the next layer's q/k/v product this way."""

    x: jax.Array
    y: jax.Array
    w_y: Vec
    scalar: Vec | None = None


@dataclasses.dataclass(frozen=True)
class Config:
    """How a program multiplies. form "dot": the rows in a DOT_ROWS-row tile, `tt.dot` on the tensor cores (weight
    rows a program >= 16, `tt.dot`'s tile); "bsum": each chunk's products summed across the program's threads (CUDA
    cores, any number of weight rows; session 17 measured this cut of a plain product 2-5.6x slower than XLA's and
    the dot cut 1.1-2x, BENCHMARKS.md). A program multiplies up to `bn` weight rows (`block_rows`: as many as spread
    the product over about PROGRAMS programs; each program rebuilds its prologue's rows, so fewer programs read them
    fewer times), `bk` columns a step of its K loop at most (fewer where [weight rows, columns] would pass TILE
    elements). Neither depends on the rows: a row's sums run in one order whatever M is (batch invariance)."""

    form: str = "dot"
    bn: int = 64
    bk: int = 256
    warps: int = 4
    stages: int = 2


DEFAULT = Config()


def _rows(a) -> int:
    return math.prod(a.shape[:-1])


def stream_product_ref(stream, norm: Vec | None, w: Vec, *, eps: float, epilogue: str | None = None,
                       mul: Vec | None = None):
    """(out, x') of `stream_product` as `decoder_layer` computes them: x' = the Residual's stream (None for plain
    rows), h = rms_norm(x', norm) (x' itself without norm), out = h @ W.T, then the epilogue: "gelu_pair" the MLP's
    activation over W's gate and up halves (`mlp_activation`), "gelu_mul" gelu(out) * mul (the PLE gate)."""
    x_new = None
    if isinstance(stream, Residual):
        x_new, _ = add_norm_ref(stream.y, stream.x, stream.w_y, None, stream.scalar, eps)
        # x' materialised in its dtype before its norm, as transformers has it (and the kernel): XLA would otherwise
        # feed the norm the unrounded fp32 sum (its excess precision), ~2^-9 off in every element
        h = x_new = lax.optimization_barrier(x_new)
    else:
        h = stream
    if norm is not None:
        h = rms_norm(h, norm.get(), eps)
    if epilogue == "gelu_pair":
        return mlp_activation(h, w.get()), x_new
    out = linear(h, w.get())
    if epilogue == "gelu_mul":  # gelu in fp32, its output materialised (transformers: act_fn(gate), then * the input)
        out = lax.optimization_barrier(gelu_tanh(out.astype(acc_dtype(out.dtype))).astype(out.dtype)) * mul.get()
    return out, x_new


def rows_supported(x) -> bool:
    """Whether the kernel takes these rows [..., K]: bf16 or fp32, a power of two of them up to MAX_ROWS."""
    M = _rows(x)
    return x.dtype in (jnp.bfloat16, jnp.float32) and 0 < M <= MAX_ROWS and M & (M - 1) == 0


def supported(stream, w: Vec, epilogue: str | None = None) -> bool:
    """Whether the kernel takes this product: bf16 or fp32 rows, a power of two of them up to MAX_ROWS, the weight
    [N, K] in their dtype, K in chunks of >= 16 (any N: a program takes the power of two of rows that divides it)."""
    x = stream.x if isinstance(stream, Residual) else stream
    N, K = w.stack.shape[-2:]
    N_out = N // 2 if epilogue == "gelu_pair" else N
    ok = (rows_supported(x) and w.stack.dtype == x.dtype and x.shape[-1] == K and len(w.index) == w.stack.ndim - 2
          and _pow2_divisor(K, 16) == 16 and N_out >= 1)
    if isinstance(stream, Residual):
        ok = ok and stream.y.shape == x.shape and stream.y.dtype == x.dtype
    return ok


def _kernel(*refs, residual: bool, scaled: bool, normed: bool, epilogue: str | None, weights: int, bk: int,
            eps: float, form: str):
    refs = list(refs)
    take = lambda n: [refs.pop(0) for _ in range(n)]  # noqa: E731
    (x_ref,) = take(1)
    y_ref, wy_ref = take(2) if residual else (None, None)
    (s_ref,) = take(1) if scaled else (None,)
    (n_ref,) = take(1) if normed else (None,)
    w_refs = take(weights)
    (mul_ref,) = take(1) if epilogue == "gelu_mul" else (None,)
    (o_ref,) = take(1)
    (xo_ref,) = take(1) if residual else (None,)
    M, K = x_ref.shape
    steps = K // bk
    dtype = o_ref.dtype
    # Row by row: every row's sums run the same [bk] and [bn, bk] code whatever M is, so a row's result does not
    # depend on how many rows share the call (batch invariance), and the weight chunk is loaded once for all rows.
    row = lambda ref, m, k0: ref[m, pl.ds(k0, bk)].astype(jnp.float32)  # noqa: E731
    vec = lambda ref, k0: ref[pl.ds(k0, bk)].astype(jnp.float32)  # noqa: E731

    def inv_rms(cols):  # rsqrt(mean(v²) + eps) of each row (cols(k0, m): [bk] fp32), summed chunk by chunk
        def body(j, sums):
            k0 = pl.multiple_of(j * bk, bk)
            return tuple(s + jnp.sum(cols(k0, m) * cols(k0, m)) for m, s in enumerate(sums))
        sums = lax.fori_loop(0, steps, body, tuple(jnp.zeros((), jnp.float32) for _ in range(M)))
        return [lax.rsqrt(s / K + eps) for s in sums]

    if residual:
        r_y = inv_rms(lambda k0, m: row(y_ref, m, k0))
        scale = _round(s_ref[0].astype(jnp.float32), dtype) if scaled else None

        def stream(k0, m):  # (x + norm(y)·w_y)·s, rounded as add_norm_ref rounds it
            v = _round(row(x_ref, m, k0) + _round(row(y_ref, m, k0) * r_y[m] * vec(wy_ref, k0), dtype), dtype)
            return _round(v * scale, dtype) if scaled else v
    else:
        def stream(k0, m):
            return row(x_ref, m, k0)

    if normed:
        r_h = inv_rms(stream)

        def operand(k0, m):
            return _round(stream(k0, m) * r_h[m] * vec(n_ref, k0), dtype)
    else:
        operand = stream

    bn = w_refs[0].shape[0]
    if form == "dot":
        # The rows placed in a DOT_ROWS-row tile in registers (the rest zero) and multiplied by `tt.dot` (bf16 in,
        # fp32 out; fp32 in IEEE fp32): tensor cores, one [DOT_ROWS, bn] accumulator, whatever M is.
        tile_rows = lax.broadcasted_iota(jnp.int32, (DOT_ROWS, bk), 0)
        precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None

        def body(j, accs):
            k0 = pl.multiple_of(j * bk, bk)
            tile = jnp.zeros((DOT_ROWS, bk), jnp.float32)
            for m in range(M):
                tile = jnp.where(tile_rows == m, operand(k0, m)[None, :], tile)
            tile = tile.astype(dtype)
            return tuple(acc + lax.dot_general(tile, w_ref[:, pl.ds(k0, bk)], (((1,), (1,)), ((), ())),
                                               precision=precision, preferred_element_type=jnp.float32)
                         for acc, w_ref in zip(accs, w_refs))

        accs = lax.fori_loop(0, steps, body, tuple(jnp.zeros((DOT_ROWS, bn), jnp.float32) for _ in w_refs))
        out_rows = lax.broadcasted_iota(jnp.int32, (DOT_ROWS, bn), 0)
        accs = [[jnp.sum(jnp.where(out_rows == m, acc, 0.0), axis=0) for m in range(M)] for acc in accs]
    else:
        # Each chunk's products summed across the program's threads (CUDA cores; no tile of unused rows)
        def body(j, accs):
            k0 = pl.multiple_of(j * bk, bk)
            ws = [w_ref[:, pl.ds(k0, bk)].astype(jnp.float32) for w_ref in w_refs]  # [bn, bk] each
            hs = [operand(k0, m)[None, :] for m in range(M)]
            return tuple(tuple(a + jnp.sum(w * h, axis=1) for a, h in zip(acc, hs)) for acc, w in zip(accs, ws))

        zeros = tuple(jnp.zeros((bn,), jnp.float32) for _ in range(M))
        accs = lax.fori_loop(0, steps, body, (zeros,) * weights)
    for m in range(M):
        if epilogue == "gelu_pair":  # mlp_activation: the products rounded, then gelu(gate) * up in fp32, rounded
            out = gelu_tanh(_round(accs[0][m], dtype)) * _round(accs[1][m], dtype)
        elif epilogue == "gelu_mul":  # gelu(product) * ple_i, each op rounded as the reference's dtype arithmetic
            out = _round(gelu_tanh(_round(accs[0][m], dtype)), dtype) * mul_ref[m, :].astype(jnp.float32)
        else:
            out = accs[0][m]
        o_ref[m, :] = out.astype(dtype)

    if residual:
        @pl.when(pl.program_id(0) == 0)
        def _():
            def store(j, carry):
                k0 = pl.multiple_of(j * bk, bk)
                for m in range(M):
                    xo_ref[m, pl.ds(k0, bk)] = stream(k0, m).astype(xo_ref.dtype)
                return carry
            lax.fori_loop(0, steps, store, 0)


def block_rows(N: int, bn: int, least: int = 1) -> int:
    """Weight rows a program multiplies: the largest power of two up to bn dividing N that still gives PROGRAMS
    programs, at least `least` (`tt.dot`'s 16) where N allows."""
    b = _pow2_divisor(N, bn)
    while b > least and N // b < PROGRAMS:
        b //= 2
    return b


def chunk_columns(K: int, bn: int, weights: int, bk: int) -> int:
    """Columns a step of the K loop multiplies: up to bk, [weights * bn, columns] within TILE (at least 16); never
    a function of the rows (batch invariance)."""
    return _pow2_divisor(K, max(16, min(bk, TILE // (bn * weights))))


def _weight_spec(w: Vec, bn: int, K: int, shift: int):
    """Program n's block of bn rows of w.stack[w.index] [N, K], read in place: rows (n + shift)·bn onwards (shift:
    the up half of a gate/up stack)."""
    idx = tuple(w.index)
    return pl.BlockSpec((*(None,) * len(idx), bn, K), lambda n: (*idx, n + shift, 0))


def stream_product(stream, norm: Vec | None, w: Vec, *, eps: float, epilogue: str | None = None,
                   mul: Vec | None = None, interpret: bool | None = None, config: Config | None = None):
    """`stream_product_ref` in one kernel launch where `supported`; the reference otherwise.

    stream: rows [..., K] (plain) or a Residual (its x, y [..., K]); norm: the [K] norm of the product's input (None:
    the stream itself); w: the weight [N, K] (gate rows then up rows for "gelu_pair"); mul: [..., N] rows read at
    a static index of their stack (the PLE inputs [L, ..., P] of every layer), for "gelu_mul". Returns (out [..., N]
    ([..., N/2] for "gelu_pair"), the Residual's x' [..., K] or None)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue {epilogue!r}: one of {EPILOGUES}")
    if not supported(stream, w, epilogue):
        return stream_product_ref(stream, norm, w, eps=eps, epilogue=epilogue, mul=mul)
    c = config or DEFAULT
    residual = isinstance(stream, Residual)
    x = stream.x if residual else stream
    lead, K = x.shape[:-1], x.shape[-1]
    M = _rows(x)
    N = w.stack.shape[-2]
    N_out = N // 2 if epilogue == "gelu_pair" else N
    weights = 2 if epilogue == "gelu_pair" else 1
    if c.form not in FORMS:
        raise ValueError(f"form {c.form!r}: one of {FORMS}")
    form = c.form if _pow2_divisor(N_out, DOT_ROWS) == DOT_ROWS else "bsum"  # `tt.dot` needs 16 weight rows
    bn = block_rows(N_out, c.bn, DOT_ROWS if form == "dot" else 1)
    bk = chunk_columns(K, bn, weights, c.bk)
    rows = pl.BlockSpec((M, K), lambda n: (0, 0))
    operands, in_specs = [x.reshape(M, K)], [rows]
    if residual:
        operands += [stream.y.reshape(M, K), stream.w_y.stack]
        in_specs += [rows, _vec_spec(stream.w_y, K)]
        if stream.scalar is not None:
            operands.append(stream.scalar.stack.reshape(1) if not stream.scalar.index else stream.scalar.stack)
            in_specs.append(_scalar_spec(stream.scalar))
    if norm is not None:
        operands.append(norm.stack)
        in_specs.append(_vec_spec(norm, K))
    operands += [w.stack] * weights
    in_specs += [_weight_spec(w, bn, K, 0)] + ([_weight_spec(w, bn, K, N_out // bn)] if weights == 2 else [])
    if epilogue == "gelu_mul":
        if mul is None or mul.stack.shape[len(mul.index):] != (*lead, N_out):
            raise ValueError(f"gelu_mul needs rows {(*lead, N_out)} to multiply, got {mul}")
        m_idx = tuple(mul.index)
        operands.append(mul.stack.reshape(*mul.stack.shape[:len(m_idx)], M, N_out))
        in_specs.append(pl.BlockSpec((*(None,) * len(m_idx), M, bn), lambda n: (*m_idx, 0, n)))
    out_specs = [pl.BlockSpec((M, bn), lambda n: (0, n))]
    out_shape = [jax.ShapeDtypeStruct((M, N_out), x.dtype)]
    if residual:
        out_specs.append(rows)
        out_shape.append(jax.ShapeDtypeStruct((M, K), x.dtype))
    kernel = functools.partial(_kernel, residual=residual, scaled=residual and stream.scalar is not None,
                               normed=norm is not None, epilogue=epilogue, weights=weights, bk=bk, eps=float(eps),
                               form=form)
    outs = pallas_call(
        kernel, grid=(N_out // bn,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=c.warps, num_stages=c.stages),
        interpret=_interpret(interpret), name="layer_product",
    )(*operands)
    out = outs[0].reshape(*lead, N_out)
    return out, outs[1].reshape(*lead, K) if residual else None

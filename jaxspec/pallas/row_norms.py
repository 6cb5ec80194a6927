"""Pallas (Triton) kernel of the residual stream's norms between a decoder layer's products, and its jnp reference
(`add_norm_ref`: the same call, the CPU path's math and the kernel's test oracle).

Between two products a Gemma 4 layer normalises a product's output, adds it to the residual stream, may scale the
stream (`layer_scalar`), and normalises the stream again for the next product:

    x' = (x + norm(y)·w_y) · s          h = norm(x')·w_h

XLA runs each norm's reduction as its own small kernel (and the sums and casts around them in others): several
1–5 µs launches at every such point, two points a layer (after the o projection; after the MLP or the per-layer
input branch, where h is the next layer's input norm or the final norm). Here one program per row does all of it,
the row loaded once in column chunks (every load issued up front) and held in registers between the two norms.
Values are rounded to the stream's dtype where the reference rounds them (the norm's output, the sum, the scaled
sum), so a row's result never depends on the other rows (batch
invariant) and differs from the reference's only by the order of a mean's summation. Weights are read from their
stacks at a static index through the BlockSpecs (`Vec`), never sliced out into copies.
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

from jaxspec.model.layers import rms_norm
from jaxspec.pallas.draft_layer import _interpret, _pow2_divisor

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)

pallas_call = pl.pallas_call  # (a module name, so that tests can watch the kernel's calls)
MAX_ROWS = 128  # more rows (prefill chunks): XLA's fusions, which tile many rows a program
MAX_CHUNK = 1024  # columns a pass loads at once


@dataclasses.dataclass(frozen=True)
class Vec:
    """One weight vector of a stack, `stack[index]` (index: a static tuple; () for a vector stored alone)."""

    stack: jax.Array
    index: tuple[int, ...] = ()

    def get(self):
        return self.stack[self.index] if self.index else self.stack


def add_norm_ref(y, x, w_y: Vec, w_h: Vec | None, scalar: Vec | None, eps: float):
    """(x' = (x + rms_norm(y, w_y)) · scalar, h = rms_norm(x', w_h)) rounded as `decoder_layer` rounds them; h is
    None without w_h, the scaling skipped without scalar. y, x: [..., H] in one dtype."""
    x = x + rms_norm(y, w_y.get(), eps)
    if scalar is not None:
        x = x * scalar.get().astype(x.dtype)
    return x, None if w_h is None else rms_norm(x, w_h.get(), eps)


def chunk_size(H: int) -> int:
    """The largest power of two dividing H, up to MAX_CHUNK (1 for odd H)."""
    return _pow2_divisor(H, MAX_CHUNK)


def supported(y, x) -> bool:
    """Whether the kernel takes these rows: bf16 or fp32, at most MAX_ROWS of them, columns in chunks of >= 16."""
    rows = math.prod(x.shape[:-1])
    return (y.shape == x.shape and y.dtype == x.dtype and x.dtype in (jnp.bfloat16, jnp.float32)
            and 0 < rows <= MAX_ROWS and chunk_size(x.shape[-1]) >= 16)


def _kernel(*refs, eps: float, chunk: int, has_scalar: bool, has_h: bool):
    y_ref, x_ref, wy_ref, *refs = refs
    wh_ref = refs.pop(0) if has_h else None
    s_ref = refs.pop(0) if has_scalar else None
    xo_ref, *refs = refs
    ho_ref = refs[0] if has_h else None
    H = x_ref.shape[0]
    dtype = xo_ref.dtype
    rnd = lambda v: v.astype(dtype).astype(jnp.float32)  # noqa: E731  (where the reference materialises a value)
    # The row's chunks unrolled: every load is issued before any result is needed (one memory round trip, not one a
    # chunk), and the row stays in registers between the two norms.
    chunks = [pl.ds(j * chunk, chunk) for j in range(H // chunk)]

    def load(ref):
        return [ref[c].astype(jnp.float32) for c in chunks]

    def inv_rms(parts):  # rsqrt(mean + eps) of the row's chunks
        return lax.rsqrt(sum(jnp.sum(p * p) for p in parts) / H + eps)

    ys, xs, wys = load(y_ref), load(x_ref), load(wy_ref)
    r_y = inv_rms(ys)
    out = [rnd(x + rnd(y * r_y * w)) for y, x, w in zip(ys, xs, wys)]
    if has_scalar:
        scale = rnd(s_ref[0].astype(jnp.float32))
        out = [rnd(v * scale) for v in out]
    for c, v in zip(chunks, out):
        xo_ref[c] = v.astype(dtype)
    if has_h:
        r_h = inv_rms(out)
        for c, v, w in zip(chunks, out, load(wh_ref)):
            ho_ref[c] = (v * r_h * w).astype(dtype)


def _vec_spec(v: Vec, H: int):
    """The BlockSpec that reads v.stack[v.index] (a [H] vector) in place."""
    idx = tuple(v.index)
    return pl.BlockSpec((*(None,) * len(idx), H), lambda r: (*idx, 0))


def _scalar_spec(v: Vec):
    """The BlockSpec of one element v.stack[v.index] of a stack of scalars ([L], or [] for a scalar alone)."""
    if not v.index:
        return pl.BlockSpec((1,), lambda r: (0,))
    idx = tuple(v.index)
    return pl.BlockSpec((*(None,) * (len(idx) - 1), 1), lambda r: idx)


def add_norm(y, x, w_y: Vec, w_h: Vec | None, scalar: Vec | None, eps: float, *, interpret: bool | None = None):
    """`add_norm_ref` in one kernel launch (one program per row) where `supported`; the reference otherwise.
    interpret: None runs the interpreter on CPU backends and compiles with Triton elsewhere."""
    if not supported(y, x):
        return add_norm_ref(y, x, w_y, w_h, scalar, eps)
    interpret = _interpret(interpret)
    shape, H = x.shape, x.shape[-1]
    M = math.prod(shape[:-1])
    row = pl.BlockSpec((None, H), lambda r: (r, 0))
    operands, in_specs = [y.reshape(M, H), x.reshape(M, H), w_y.stack], [row, row, _vec_spec(w_y, H)]
    if w_h is not None:
        operands.append(w_h.stack)
        in_specs.append(_vec_spec(w_h, H))
    if scalar is not None:
        operands.append(scalar.stack.reshape(1) if not scalar.index else scalar.stack)
        in_specs.append(_scalar_spec(scalar))
    out = jax.ShapeDtypeStruct((M, H), x.dtype)
    kernel = functools.partial(_kernel, eps=float(eps), chunk=chunk_size(H), has_scalar=scalar is not None,
                               has_h=w_h is not None)
    outs = pallas_call(
        kernel, grid=(M,), in_specs=in_specs,
        out_specs=[row, row] if w_h is not None else [row],
        out_shape=[out, out] if w_h is not None else [out],
        compiler_params=pltriton.CompilerParams(num_warps=8 if H >= 2048 else 4, num_stages=1), interpret=interpret,
        name="add_norm",
    )(*operands)
    x_new = outs[0].reshape(shape)
    return x_new, None if w_h is None else outs[1].reshape(shape)

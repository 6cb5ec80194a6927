"""Pallas (Triton) kernel of a decode step's small products (a few rows times a weight matrix), and its jnp reference
(`gemv_ref`: `linear`, the CPU path's math and the kernel's test oracle). Behind JAXSPEC_GEMV=1, off by default.

With 1 to 16 rows (a decode or verify step at small batch) a product is a stream over its weight: XLA's autotuned GEMM
splits K to find enough programs for a small N and reduces the split in a second kernel. Here the weight is split
over N only, one launch a product and no reduction kernel after it; each program sums its whole K in fp32 (IEEE fp32
in fp32, never TF32) and rounds once, as the reference's product does, and a row's result never depends on the other
rows (the dot cut always pads them to 16). The weight is read from its stack at a static index through the BlockSpec
(`Vec`), never sliced out into a copy. `Config` picks the cut.

Measured on the H200 (BENCHMARKS.md session 17, `bench/diag_gemv.py`): XLA's products, split-K reduction included, are
1.1-2x faster than the best cut here at every E4B shape (2.5-3.3 TB/s already), and E4B's verify step was 14% (dot
cut) to 29% (bsum cut) slower with it. Kept, off, with its tests, as the measured alternative.
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

from jaxspec.model.layers import linear
from jaxspec.pallas.draft_layer import TILE, _interpret, _pow2_divisor, _products
from jaxspec.pallas.row_norms import Vec

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)

pallas_call = pl.pallas_call  # (a module name, so that tests can watch the kernel's calls)
MAX_ROWS = 16
PROGRAMS = 512  # at least this many programs where N allows it (each SM holds several: their loads overlap)


def gemv_ref(x, w: Vec):
    """x [..., K] @ w.T for w = w.stack[w.index] [N, K]: `linear`."""
    return linear(x, w.get())


def rows_of(x) -> int:
    return math.prod(x.shape[:-1])


def supported(x, w: Vec) -> bool:
    """Whether the kernel takes this product: bf16 or fp32 rows, a power of two of them up to MAX_ROWS, the weight
    [N, K] in the rows' dtype with K in chunks of >= 16."""
    M, (N, K) = rows_of(x), w.stack.shape[-2:]
    return (x.dtype in (jnp.bfloat16, jnp.float32) and w.stack.dtype == x.dtype and x.shape[-1] == K
            and 0 < M <= MAX_ROWS and M & (M - 1) == 0 and _pow2_divisor(K, 16) == 16
            and len(w.index) == w.stack.ndim - 2)


@dataclasses.dataclass(frozen=True)
class Config:
    """How the kernel cuts a product. mode "bsum": each chunk's [rows, bn, bk] products summed over the chunk at once
    (a reduction across threads every chunk); "acc": the products added elementwise into a [rows, bn, bk] fp32
    accumulator, summed over bk once at the end; "dot": the rows padded to 16 and each chunk multiplied by `tt.dot`
    (bf16 or IEEE fp32 inputs, fp32 accumulation: the rows' padding costs nothing in a product that streams its
    weight). bn: weight rows a program (None: `block_rows`); bk: columns a chunk (None: the register rule)."""
    mode: str = "bsum"
    bn: int | None = None
    bk: int | None = None
    warps: int = 4
    stages: int = 2


DEFAULT = Config("dot", 16, 256, 4, 3)


def block_rows(N: int) -> int:
    """Weight rows a program multiplies: up to 8, fewer where N gives fewer than PROGRAMS programs."""
    return _pow2_divisor(N, min(8, max(1, N // PROGRAMS)))


def _kernel(x_ref, w_ref, o_ref, *, block_k: int):
    (acc,) = _products(lambda k0: x_ref[:, pl.ds(k0, block_k)].astype(jnp.float32),
                       (lambda k0: w_ref[:, pl.ds(k0, block_k)],), K=x_ref.shape[1], block_k=block_k,
                       rows=o_ref.shape[0])
    o_ref[...] = acc.astype(o_ref.dtype)


def _acc_kernel(x_ref, w_ref, o_ref, *, block_k: int):
    M, bn = o_ref.shape

    def body(j, acc):
        k0 = pl.multiple_of(j * block_k, block_k)
        x = x_ref[:, pl.ds(k0, block_k)].astype(jnp.float32)
        return acc + x[:, None, :] * w_ref[:, pl.ds(k0, block_k)].astype(jnp.float32)[None, :, :]

    acc = lax.fori_loop(0, x_ref.shape[1] // block_k, body, jnp.zeros((M, bn, block_k), jnp.float32))
    o_ref[...] = jnp.sum(acc, axis=2).astype(o_ref.dtype)


def _dot_kernel(x_ref, w_ref, o_ref, *, block_k: int):
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def body(j, acc):
        k0 = pl.multiple_of(j * block_k, block_k)
        return acc + lax.dot_general(x_ref[:, pl.ds(k0, block_k)], w_ref[:, pl.ds(k0, block_k)],
                                     (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, x_ref.shape[1] // block_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


DOT_ROWS = 16  # `tt.dot`'s smallest tile of rows


def gemv(x, w: Vec, *, interpret: bool | None = None, config: Config | None = None):
    """`gemv_ref` in one kernel launch where `supported`; the reference otherwise. interpret: None runs the
    interpreter on CPU backends and compiles with Triton elsewhere."""
    if not supported(x, w):
        return gemv_ref(x, w)
    c = config or DEFAULT
    M, (N, K) = rows_of(x), w.stack.shape[-2:]
    xs = x.reshape(M, K)
    rows = DOT_ROWS if c.mode == "dot" else M
    if rows > M:
        xs = jnp.pad(xs, ((0, rows - M), (0, 0)))
    bn = _pow2_divisor(N, c.bn) if c.bn else block_rows(N)
    bk = _pow2_divisor(K, c.bk) if c.bk else _pow2_divisor(K, max(16, TILE // (M * bn)))
    kernel = {"bsum": _kernel, "acc": _acc_kernel, "dot": _dot_kernel}[c.mode]
    idx = tuple(w.index)
    out = pallas_call(
        functools.partial(kernel, block_k=bk), grid=(N // bn,),
        in_specs=[pl.BlockSpec((rows, K), lambda n: (0, 0)),
                  pl.BlockSpec((*(None,) * len(idx), bn, K), lambda n: (*idx, n, 0))],
        out_specs=pl.BlockSpec((rows, bn), lambda n: (0, n)),
        out_shape=jax.ShapeDtypeStruct((rows, N), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=c.warps, num_stages=c.stages),
        interpret=_interpret(interpret), name="gemv",
    )(xs, w.stack)
    return out[:M].reshape(*x.shape[:-1], N)

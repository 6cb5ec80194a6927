"""Pallas (Triton) kernel of a decode step's small products (a few rows times a weight matrix), and its jnp reference
(`gemv_ref`: `linear`, the CPU path's math and the kernel's test oracle). Behind JAXSPEC_GEMV=1, off by default.

With 1 to 16 rows (a decode or verify step at small batch) a product is a stream over its weight: XLA's autotuned GEMM
splits K to find enough programs for a small N and reduces the split in a second kernel. Here the weight is split
over N only, one launch a product and no reduction kernel after it; each program sums its whole K in fp32 (IEEE fp32
in fp32, never TF32) and rounds once, as the reference's product does, and a row's result never depends on the other
rows (the dot cut always pads them to 16). The weight is read from its stack at a static index through the BlockSpec
(`Vec`), never sliced out into a copy. `Config` sets the cut's sizes.

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
from jaxspec.pallas.draft_layer import _interpret, _pow2_divisor
from jaxspec.pallas.row_norms import Vec

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)

pallas_call = pl.pallas_call  # (a module name, so that tests can watch the kernel's calls)
MAX_ROWS = 16
DOT_ROWS = 16  # `tt.dot`'s smallest tile of rows


def gemv_ref(x, w: Vec):
    """x [..., K] @ w.T for w = w.stack[w.index] [N, K]: `linear`."""
    return linear(x, w.get())


def rows_of(x) -> int:
    return math.prod(x.shape[:-1])


def supported(x, w: Vec) -> bool:
    """Whether the kernel takes this product: bf16 or fp32 rows, a power of two of them up to MAX_ROWS, the weight
    [N, K] in the rows' dtype with N and K in chunks of >= 16 (`tt.dot`'s tiles)."""
    M, (N, K) = rows_of(x), w.stack.shape[-2:]
    return (x.dtype in (jnp.bfloat16, jnp.float32) and w.stack.dtype == x.dtype and x.shape[-1] == K
            and 0 < M <= MAX_ROWS and M & (M - 1) == 0 and _pow2_divisor(K, 16) == _pow2_divisor(N, 16) == 16
            and len(w.index) == w.stack.ndim - 2)


@dataclasses.dataclass(frozen=True)
class Config:
    """How the kernel cuts a product: the rows padded to DOT_ROWS and each [rows, bk] x [bk, bn] chunk multiplied by
    `tt.dot` (bf16 inputs, or IEEE fp32 ones in fp32; fp32 accumulation), bn weight rows a program. Two other cuts
    were measured and dropped (session 17, BENCHMARKS.md; commit a5c92fb has them): each chunk's products summed
    across threads (2-5.6x slower than XLA's product) and an elementwise fp32 accumulator summed once (1.3-2x)."""
    bn: int = 16
    bk: int = 256
    warps: int = 4
    stages: int = 3


DEFAULT = Config()


def _kernel(x_ref, w_ref, o_ref, *, block_k: int):
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def body(j, acc):
        k0 = pl.multiple_of(j * block_k, block_k)
        return acc + lax.dot_general(x_ref[:, pl.ds(k0, block_k)], w_ref[:, pl.ds(k0, block_k)],
                                     (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, x_ref.shape[1] // block_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)



def gemv(x, w: Vec, *, interpret: bool | None = None, config: Config | None = None):
    """`gemv_ref` in one kernel launch where `supported`; the reference otherwise. interpret: None runs the
    interpreter on CPU backends and compiles with Triton elsewhere."""
    if not supported(x, w):
        return gemv_ref(x, w)
    c = config or DEFAULT
    M, (N, K) = rows_of(x), w.stack.shape[-2:]
    xs = jnp.pad(x.reshape(M, K), ((0, DOT_ROWS - M), (0, 0)))  # `tt.dot`'s smallest tile; a row alone in it
    bn, bk = _pow2_divisor(N, c.bn), _pow2_divisor(K, c.bk)
    idx = tuple(w.index)
    out = pallas_call(
        functools.partial(_kernel, block_k=bk), grid=(N // bn,),
        in_specs=[pl.BlockSpec((DOT_ROWS, K), lambda n: (0, 0)),
                  pl.BlockSpec((*(None,) * len(idx), bn, K), lambda n: (*idx, n, 0))],
        out_specs=pl.BlockSpec((DOT_ROWS, bn), lambda n: (0, n)),
        out_shape=jax.ShapeDtypeStruct((DOT_ROWS, N), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=c.warps, num_stages=c.stages),
        interpret=_interpret(interpret), name="gemv",
    )(xs, w.stack)
    return out[:M].reshape(*x.shape[:-1], N)

"""Session 34 (issue #14): a bf16 product of 1 and 4 rows (K 640, the 270M's width; 512 outputs a row;
tests/test_layer_products.py's "o" site) computed four ways — the layer products kernel, XLA's dot as compiled by
default, XLA's dot with its dot strength reduction turned off, and `layers.linear` (since session 34
`one_row_product` on the GPU) — each against the fp64 product of the same bf16 values: how many outputs are more than
half a bf16 ulp from it (0 when every output is the exactly rounded sum). On the GPU XLA rewrites a one-row product
into a multiply and a reduction whose multiply runs in bf16. Run from the repository root:
`PYTHONPATH=. python3 bench/diag_one_row_products.py`.
"""
import sys

import jax
import jax.numpy as jnp

from jaxspec.model import layers

sys.path.insert(0, "tests")
import test_layer_products as t  # noqa: E402  (its operands, sites and reference compile options)
from conftest import bf16_not_exactly_rounded  # noqa: E402

for rows in (1, 4):
    ops = t.operands(jnp.bfloat16, rows, 640, 256)
    x, w = ops[0], ops[5][1]
    dot = jax.jit(layers.dot).lower(x, w)
    res = {"kernel": t.run("o", ops)[0], "xla dot default": dot.compile()(x, w),
           "xla dot no strength reduction": dot.compile(t.REFERENCE_OPTIONS)(x, w),
           "layers.linear": jax.jit(layers.linear)(x, w)}
    print(f"rows {rows}: of {ops[5].shape[1] * rows} values, more than half a bf16 ulp from fp64: "
          + ", ".join(f"{k} {bf16_not_exactly_rounded(v, x, w)}" for k, v in res.items()))

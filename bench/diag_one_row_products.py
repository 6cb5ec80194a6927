"""Session 34 (issue #14): a bf16 product of 1 and 4 rows (K 640, the 270M's width, 512 outputs; tests/test_layer_products.py's
"o" site) computed three ways — the layer products kernel, XLA's own product as compiled by default, and XLA's with
its dot strength reduction turned off — each against the fp64 product of the same bf16 values: how many outputs are
more than half a bf16 ulp from it (0 when every output is the exactly rounded sum). On the GPU XLA rewrites a one-row
product into a multiply and a reduction whose multiply runs in bf16. Run from the repository root:
`PYTHONPATH=. python3 bench/diag_one_row_products.py`.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.pallas.layer_products import stream_product_ref

sys.path.insert(0, "tests")
import test_layer_products as t  # noqa: E402  (its operands, sites and reference compile options)

for rows in (1, 4):
    ops = t.operands(jnp.bfloat16, rows, 640, 256)
    x, w = np.asarray(ops[0], np.float64), np.asarray(ops[5][1], np.float64)
    exact = (x @ w.T).reshape(-1)
    f = lambda *o: stream_product_ref(*t.SITES["o"](*o)[:3], eps=t.EPS)[0]
    low = jax.jit(f).lower(*ops)
    res = {"kernel": t.run("o", ops)[0], "xla default": low.compile()(*ops),
           "xla no strength reduction": low.compile(t.REFERENCE_OPTIONS)(*ops)}
    half_ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))) - 8)
    print(f"rows {rows}: of {exact.size} values, more than half a bf16 ulp from fp64: " + ", ".join(
        f"{k} {int((np.abs(np.asarray(v, np.float64).reshape(-1) - exact) > half_ulp * 1.0001).sum())}"
        for k, v in res.items()))

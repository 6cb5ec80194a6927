"""Diagnosis (issue #14): the layer products kernel (`jaxspec/pallas/layer_products.py`) against XLA's ops, site by
site, at E4B's shapes, and its cuts.

Each site is a product with what `decoder_layer` runs around it: q/k/v (the previous layer's end (x + norm(p)·n)·s,
then the input norm), o and down (the rows as they are), gate/up (the post-attention residual, the MLP's input norm,
gelu · up), the PLE gate (the post-MLP residual, gelu · input). A jitted chain of L layers, each with its own weight (so
each streams from HBM), runs the site; the next layer's inputs are the last one's outputs (the stream x' and the
product folded into y through a tiny reduction, the same in every variant). Variants: "xla" (the ops as
`decoder_layer` runs them without the kernel: `add_norm_ref`, `linear`, `mlp_activation`, gelu · input) and the
kernel's cuts FORM:BN:BK[:WARPS[:STAGES]] (`layer_products.Config`). Reported a layer: wall µs (median of the chain / L), with
--profile the device kernels' µs and their count, and the largest difference from the xla variant in units of its
magnitude.

    python bench/diag_layer_products.py --sites qkv,o,mlp,down,ple --rows 4,1 \
        --cuts xla,dot:64:256,dot:16:256,dot:16:512:4:4,dot:32:256:8:3,bsum:64:256,bsum:8:256 --profile --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model.layers import gelu_tanh, linear, mlp_activation
from jaxspec.pallas import layer_products
from jaxspec.pallas.layer_products import Residual, stream_product
from jaxspec.pallas.row_norms import Vec, add_norm_ref

from diag_split import kernels_per_call  # noqa: E402 (bench/ is the script's first path)
from diag_splits import median_us  # noqa: E402

# site: (weight rows N, input width K) at E4B's shapes (a sliding layer's q/k/v; gate/up: 2 x 10 240 rows)
SITES = {"qkv": (3072, 2560), "o": (2560, 2048), "mlp": (20480, 2560), "down": (2560, 10240), "ple": (256, 2560)}
EPS = 1e-6


def site_call(site: str, cut: str):
    """f(x, y, norms [4, K], scalar [1], w [N, K], mul [1, rows, N']) -> (out, x') of the site in this variant."""
    def f(x, y, norms, scalar, w, mul):
        if cut == "xla":
            if site in ("o", "down"):
                return linear(x, w), x
            if site == "qkv":
                xn, h = add_norm_ref(y, x, Vec(norms, (3,)), Vec(norms, (0,)), Vec(scalar, (0,)), EPS)
                return linear(h, w), xn
            if site == "mlp":
                xn, h = add_norm_ref(y, x, Vec(norms, (1,)), Vec(norms, (2,)), None, EPS)
                return mlp_activation(h, w), xn
            xn, _ = add_norm_ref(y, x, Vec(norms, (3,)), None, None, EPS)
            return gelu_tanh(linear(xn, w)) * mul[0], xn
        form, *sizes = cut.split(":")
        config = layer_products.Config(form, *map(int, sizes))  # FORM:BN:BK[:WARPS[:STAGES]]
        W = Vec(w[None], (0,))
        if site in ("o", "down"):
            out, _ = stream_product(x, None, W, eps=EPS, config=config)
            return out, x
        if site == "qkv":
            return stream_product(Residual(x, y, Vec(norms, (3,)), Vec(scalar, (0,))), Vec(norms, (0,)), W,
                                  eps=EPS, config=config)
        if site == "mlp":
            return stream_product(Residual(x, y, Vec(norms, (1,))), Vec(norms, (2,)), W, eps=EPS,
                                  epilogue="gelu_pair", config=config)
        return stream_product(Residual(x, y, Vec(norms, (3,))), None, W, eps=EPS, epilogue="gelu_mul",
                              mul=Vec(mul, (0,)), config=config)
    return f


def chain(site: str, cut: str):
    f = site_call(site, cut)

    def run(x, y, norms, scalar, ws, mul):
        outs = []
        for w in ws:
            out, x_new = f(x, y, norms, scalar, w, mul)
            outs.append(out)
            fold = (jnp.sum(out[..., :1].astype(jnp.float32)) * 1e-30).astype(x.dtype)
            x, y = (x + fold, y) if site in ("o", "down") else (x_new, y + fold)
        return jnp.stack(outs)
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", default="qkv,o,mlp,down,ple")
    ap.add_argument("--rows", default="4,1")
    ap.add_argument("--cuts", default="xla,dot:64:256,dot:16:256,dot:16:512:4:4,dot:32:256:8:3,bsum:64:256,bsum:8:256",
                    help="xla, or FORM:BN:BK[:WARPS[:STAGES]] of layer_products.Config")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", action="store_true", help="also the device kernels' µs and count (GPU only)")
    ap.add_argument("--shrink", type=int, default=1, help="N and K divided by this (a CPU smoke run: 32)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    results = []
    for site in a.sites.split(","):
        N, K = (n // a.shrink for n in SITES[site])
        keys = jax.random.split(jax.random.PRNGKey(0), a.layers + 5)
        ws = [(jax.random.normal(k, (N, K)) * K**-0.5).astype(dtype) for k in keys[5:]]
        norms = (1 + 0.1 * jax.random.normal(keys[2], (4, K))).astype(jnp.float32)
        scalar = jnp.asarray([0.7], dtype)
        N_out = N // 2 if site == "mlp" else N
        for rows in map(int, a.rows.split(",")):
            x = jax.random.normal(keys[0], (1, rows, K)).astype(dtype)
            y = (jax.random.normal(keys[1], (1, rows, K)) * 30).astype(dtype)
            mul = jax.random.normal(keys[3], (1, 1, rows, N_out)).astype(dtype)
            want = None
            for cut in a.cuts.split(","):
                run = chain(site, cut)
                inputs = (x, y, norms, scalar, ws, mul)
                try:
                    out = np.asarray(jax.block_until_ready(run(*inputs)), np.float32)
                except Exception as e:  # a cut that does not compile (registers, shapes): say so, go on
                    print(f"{site:5s} rows {rows:2d} {cut}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                us = median_us(run, inputs, a.iters) / a.layers
                k_us, count = (kernels_per_call(run, inputs, 10, f"/tmp/diag_lp_{site}_{cut}") if a.profile
                               else (float("nan"),) * 2)
                if want is None:
                    want = out
                err = float(np.abs(out - want).max() / np.abs(want).max())
                row = dict(site=site, N=N, K=K, rows=rows, cut=cut, us=us, kernel_us=k_us / a.layers,
                           kernels=count / a.layers, err=err)
                results.append(row)
                print(f"{site:5s} {N}x{K} rows {rows:2d} {cut:14s}: {us:7.2f} us a layer, kernels "
                      f"{row['kernel_us']:6.2f} us in {row['kernels']:5.2f}, err {err:.1e}", flush=True)
            if a.json:  # after every row count: a call cut by its time limit keeps what it measured
                with open(a.json, "w") as f:
                    json.dump(dict(command=" ".join(sys.argv), jax_version=jax.__version__,
                                   device_kind=jax.devices()[0].device_kind, layers=a.layers, results=results), f,
                              indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

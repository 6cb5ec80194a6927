"""Diagnosis (issue #14): which cut of the small products' kernel (`gemv.Config`) streams E4B's decode-step weights
fastest, against XLA's own product (`gemv_ref` jitted: its autotuned GEMM, split-K and reduction included)?

For each (N, K) weight shape of E4B's layers (q/k/v of a sliding and a global layer, q alone of a KV-shared layer,
o, the per-layer-input gate and projection) one jitted program applies the product to L different weights in a
chain (each output folded into the next layer's rows through a tiny reduction, so XLA can neither merge the products
nor run them at once, and the weights, L of them, outrun the L2 cache), as a decode step does. Reported: µs a product
(median wall time of the program / L, the same chain overhead in every line) and the largest difference from XLA's
output in units of the output's magnitude. Rows 4 (a verify of k 3 at bs 1) and 1 (a decode step at bs 1).

    python bench/diag_gemv.py --rows 4,1 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.pallas.gemv import Config, gemv, gemv_ref
from jaxspec.pallas.row_norms import Vec

from diag_splits import median_us  # noqa: E402 (bench/ is the script's first path)

SHAPES = {"qkv": (3072, 2560), "o": (2560, 2048), "ple_gate": (256, 2560), "ple_proj": (2560, 256),
          "qkv_global": (6144, 2560), "q_shared": (2048, 2560), "tiny": (64, 128)}
CONFIGS = {  # XLA's product, then the kernel's cut at several sizes (the two other cuts session 17 measured: a5c92fb)
    "xla": None,
    **{f"dot-{bn}x{bk}-s{s}": Config(bn, bk, 4, s) for bn, bk, s in ((16, 256, 3), (16, 256, 4), (16, 512, 3),
                                                                  (32, 128, 4), (32, 256, 3), (64, 128, 4))},
}


def kernel_us(run, inputs, iters: int, directory: str) -> tuple[float, float]:
    """(µs of device kernels a call, of them the products' kernels: `gemv` or XLA's GEMM fusions and their split-K
    reductions) from a profile of `iters` calls (jax.profiler; the kernels read as `bench trace` reads them)."""
    from jaxspec.bench.trace import device_events, newest_trace

    shutil.rmtree(directory, ignore_errors=True)
    with jax.profiler.trace(directory):
        for _ in range(iters):
            jax.block_until_ready(run(*inputs))
    kernels, _ = device_events(newest_trace(directory))
    total = sum(k.end - k.start for k in kernels) / 1e3 / iters
    prod = sum(k.end - k.start for k in kernels if k.name.startswith(("gemv", "gemm", "cutlass", "sm90", "nvjet"))
               or "dot" in k.name or "split_k" in k.name or "splitk" in k.name) / 1e3 / iters
    return total, prod


def chain(config):
    def run(x, ws):
        outs = []
        for w in ws:
            y = gemv_ref(x, Vec(w, ())) if config is None else gemv(x, Vec(w, ()), config=config)
            outs.append(y)
            x = x + (jnp.sum(y[..., :1].astype(jnp.float32)) * 1e-30).astype(x.dtype)
        return jnp.stack(outs)
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="4,1")
    ap.add_argument("--shapes", default=",".join(s for s in SHAPES if s != "tiny"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", action="store_true", help="also the device kernels' µs (jax.profiler, GPU only)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    results = []
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        keys = jax.random.split(jax.random.PRNGKey(0), a.layers + 1)
        ws = [(jax.random.normal(k, (N, K)) * K**-0.5).astype(dtype) for k in keys[1:]]
        for rows in map(int, a.rows.split(",")):
            x = jax.random.normal(keys[0], (1, rows, K)).astype(dtype)
            want = None
            line = []
            for cname in a.configs.split(","):
                try:
                    run = chain(CONFIGS[cname])
                    out = np.asarray(jax.block_until_ready(run(x, ws)), np.float32)
                    us = median_us(run, (x, ws), a.iters) / a.layers
                    k_us, p_us = (kernel_us(run, (x, ws), 10, f"/tmp/diag_gemv_{cname}") if a.profile
                                  else (float("nan"),) * 2)
                    k_us, p_us = k_us / a.layers, p_us / a.layers
                except Exception as e:  # a cut Triton cannot compile: said, and the sweep goes on
                    print(f"{name} rows {rows} {cname}: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                          flush=True)
                    continue
                if want is None:
                    want = out
                err = float(np.abs(out - want).max() / np.abs(want).max())
                mb = N * K * dtype.itemsize / 1e6
                results.append(dict(shape=name, N=N, K=K, rows=rows, config=cname, us=us, kernel_us=k_us,
                                    product_us=p_us, tb_s=mb / us, err=err))
                line.append((k_us if a.profile else us, cname))
                # products 0: no kernel named as a product (XLA's 1-row product is a reduction fusion): read the
                # chain's kernels instead
                rate = f"{mb / p_us * 1e3:6.0f} GB/s" if p_us > 0 else "     - GB/s"
                print(f"{name:10s} {N}x{K} rows {rows:2d} {cname:14s} {us:7.2f} us  {mb / us * 1e3:6.0f} GB/s  "
                      f"kernels {k_us:6.2f} us  products {p_us:6.2f} us {rate}  err {err:.1e}", flush=True)
            if not line:
                continue
            line.sort()
            print(f"== {name} rows {rows}: best {line[0][1]} {line[0][0]:.2f} us; xla "
                  f"{next((u for u, c in line if c == 'xla'), float('nan')):.2f} us", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), jax_version=jax.__version__,
                           device_kind=jax.devices()[0].device_kind, layers=a.layers, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

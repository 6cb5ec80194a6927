"""Diagnosis (issue #14): can the split-K reduction kernel after the o and down products go away?

XLA splits E4B's o and down products over K (4-16 pieces at 1-4 rows) and sums the pieces in a kernel of its own, 84
launches a verify step, because the residual norm that follows is a row reduction and XLA fuses no reduction into
another. Here the split is written out instead: the weight stored as S pieces [S, N, K/S] (one batched product whose
batch is the split, the pieces' sum left to the consumer) and the norm site summing the S partials as elementwise adds,
which XLA can fuse into the norm's own reduction. For each site (o: 2560 x 2048; down: 2560 x 10240) and row count a
jitted chain of L layers, each a different weight, runs the product and the residual-norm site (`add_norm_ref`:
x' = x + rms_norm(y) w1, h = rms_norm(x') w2), the next layer's input folded from h through a tiny reduction (the
same in every variant). Reported a layer: wall µs (median of the chain / L), with --profile the device kernels' µs
and their count, and the largest difference of h from XLA's own split's in units of its magnitude.

    python bench/diag_split.py --sites o,down --rows 4,1 --splits 0,4,8,16 --profile --json OUT.json

S 0 is XLA's own product (`linear`); the weight stacks in [S, N, K/S] are made once, as an engine would store them.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model.layers import linear, split_linear, split_weight
from jaxspec.pallas.row_norms import Vec, add_norm_ref

from diag_splits import median_us  # noqa: E402 (bench/ is the script's first path)

SITES = {"o": (2560, 2048), "down": (2560, 10240), "tiny": (64, 256)}
EPS = 1e-6


def chain(splits: int, layers: int):
    def run(a, x, ws, n1, n2):
        hs = []
        for w in ws:
            y = linear(a, w) if splits == 0 else split_linear(a, w)  # as the engine's JAXSPEC_SPLIT_PRODUCTS=1
            x, h = add_norm_ref(y, x, Vec(n1, ()), Vec(n2, ()), None, EPS)
            hs.append(h)
            a = a + (jnp.sum(h[..., :1].astype(jnp.float32)) * 1e-30).astype(a.dtype)
        return jnp.stack(hs)
    return jax.jit(run)


def kernels_per_call(run, inputs, iters: int, directory: str) -> tuple[float, float]:
    """(µs of device kernels, kernels) a call, from a profile of `iters` calls."""
    import shutil

    from jaxspec.bench.trace import device_events, newest_trace

    shutil.rmtree(directory, ignore_errors=True)
    with jax.profiler.trace(directory):
        for _ in range(iters):
            jax.block_until_ready(run(*inputs))
    kernels, _ = device_events(newest_trace(directory))
    return sum(k.end - k.start for k in kernels) / 1e3 / iters, len(kernels) / iters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", default="o,down")
    ap.add_argument("--rows", default="4,1")
    ap.add_argument("--splits", default="0,4,8,16", help="pieces of K; 0: XLA's own product")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", action="store_true", help="also the device kernels' µs and count (GPU only)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    results = []
    for site in a.sites.split(","):
        N, K = SITES[site]
        keys = jax.random.split(jax.random.PRNGKey(0), a.layers + 4)
        ws = [(jax.random.normal(k, (N, K)) * K**-0.5).astype(dtype) for k in keys[4:]]
        n1, n2 = [(1 + 0.1 * jax.random.normal(keys[i], (N,))).astype(jnp.float32) for i in (2, 3)]
        for rows in map(int, a.rows.split(",")):
            act = jax.random.normal(keys[0], (1, rows, K)).astype(dtype)
            x = jax.random.normal(keys[1], (1, rows, N)).astype(dtype)
            want = None
            for S in map(int, a.splits.split(",")):
                if S and K % S:
                    continue
                stacks = ws if S == 0 else [split_weight(w, S) for w in ws]
                run = chain(S, a.layers)
                inputs = (act, x, stacks, n1, n2)
                out = np.asarray(jax.block_until_ready(run(*inputs)), np.float32)
                us = median_us(run, inputs, a.iters) / a.layers
                k_us, count = (kernels_per_call(run, inputs, 10, f"/tmp/diag_split_{site}_{S}") if a.profile
                               else (float("nan"),) * 2)
                if want is None:
                    want = out
                err = float(np.abs(out - want).max() / np.abs(want).max())
                row = dict(site=site, N=N, K=K, rows=rows, splits=S, us=us, kernel_us=k_us / a.layers,
                           kernels=count / a.layers, err=err)
                results.append(row)
                print(f"{site:5s} {N}x{K} rows {rows:2d} S {S:2d} ({'xla' if S == 0 else 'written'}): {us:7.2f} us a "
                      f"layer, kernels {row['kernel_us']:6.2f} us in {row['kernels']:5.2f}, err {err:.1e}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), jax_version=jax.__version__,
                           device_kind=jax.devices()[0].device_kind, layers=a.layers, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Diagnosis (session 21, issue #14): what one dependent phase costs inside a thread-block-cluster kernel.

    python3 bench/diag_cluster.py [--configs 2:256,4:256,8:512,16:1024] [--layers 1,2,4,6] [--calls 300]
    python3 bench/diag_cluster.py --check   # the CPU: every config against the jnp chain in Mosaic GPU's interpreter

A propose is ~90 dependent phases (BENCHMARKS.md session 21): a kernel per phase costs ≥ ~1.05 µs each on the H200
before any byte moves, so the 200-µs goal needs several phases per launch, synchronised for well under a µs. Here the
simplest such chain: L dependent products y_{l+1} = W_l · y_l (N × N bf16, fp32 sums, rounded to bf16 per layer) in
one Mosaic GPU kernel over a cluster of C blocks. Block c owns rows [64 c, 64 c + 64) of every W_l (N = 64 C: the
WGMMA register layout takes 64-row tiles), copies its tiles into its shared memory with the TMA at the start, all at
once (the `prefetch` form: L tiles must fit, ≤ 192 KB), or each right before its layer (`stream`); after each layer
it stores its slice of y_{l+1} (a TMA store, waited for), meets the others at a cluster barrier, and loads the whole
y_{l+1} back. Against it, XLA's own chain of the same L products (one kernel each).

Printed per config and form: µs per call for each L (wall, and device time: R chained calls in one program minus
one, over R - 1, so the ~60-µs per-call floor cancels), and the cost of one more phase (the slope over L, least
squares). Session 22 measured 0.8-1.9 µs a phase at 2-4 blocks (BENCHMARKS.md), no less than a kernel boundary. Equivalence: `--check` runs every config through the GPU interpreter
(`plgpu.InterpretGPUParams`: blocks, shared memory and barriers simulated on the CPU) against the jnp chain; on the
GPU each timed config is also checked against XLA's chain, bit for bit (same products, same roundings, the sums'
order aside: the max |difference| is printed).
"""
import argparse
import json
import statistics
import sys
import time

SMEM_BYTES = 192 * 1024
ROWS = 64  # a block's rows of each W: one WGMMA register tile
TMA_MAX = 256  # elements a TMA copy moves along one dimension at most


def cluster_chain(C: int, L: int, prefetch: bool, interpret=None, sync: bool = True):
    """f(x [N], w [L, N, N]) -> y_L [N] as one cluster kernel (module docstring). sync=False leaves the cluster
    barriers out (a block then reads y_{l+1} before the others stored their slices: the interpreter shows the race,
    tests/test_bench.py)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    N = ROWS * C
    slots = L if prefetch else 1
    width = min(N, TMA_MAX)  # a TMA copy moves at most 256 elements along a dimension: wider rows in pieces
    pieces = [pl.ds(j, width) for j in range(0, N, width)]

    def body(x_ref, w_ref, o_ref, y_ref, w_smem, y_smem, out_smem, tma, cbar):
        c = jax.lax.axis_index("c")
        rows = pl.ds(c * ROWS, ROWS)

        def fetch(l):
            for j, cols in enumerate(pieces):  # shared memory holds a tile as [pieces, 64, width]: each contiguous
                plgpu.copy_gmem_to_smem(w_ref.at[l, rows, cols], w_smem.at[l % slots, j], tma.at[l])

        def fetch_y(src, barrier):
            for j, cols in enumerate(pieces):
                plgpu.copy_gmem_to_smem(src.at[cols], y_smem.at[j], barrier)

        for l in range(slots):  # prefetch: every tile in flight at once
            fetch(l)
        fetch_y(x_ref, tma.at[L])
        plgpu.barrier_wait(tma.at[L])
        for l in range(L):
            if l >= slots:
                fetch(l)
            plgpu.barrier_wait(tma.at[l])
            acc = None
            for j in range(len(pieces)):
                w = plgpu.load(w_smem.at[l % slots, j], (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                y = plgpu.load(y_smem.at[j], (), layout=plgpu.Layout.WGMMA.reduce(0)).astype(jnp.float32)
                part = jnp.sum(w * y[None, :], axis=1)
                acc = part if acc is None else acc + part
            out_smem[...] = acc.astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, o_ref.at[rows] if l == L - 1 else y_ref.at[l + 1, rows])
            plgpu.wait_smem_to_gmem(0)
            if l < L - 1:  # every block's slice stored: the whole y_{l+1} back into this block
                if sync:
                    plgpu.barrier_arrive(cbar.at[l])
                    plgpu.barrier_wait(cbar.at[l])
                fetch_y(y_ref.at[l + 1], tma.at[L + 1 + l])
                plgpu.barrier_wait(tma.at[L + 1 + l])

    kernel = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((N,), jnp.bfloat16), jax.ShapeDtypeStruct((L, N), jnp.bfloat16)),
        scratch_types=[plgpu.SMEM((slots, len(pieces), ROWS, width), jnp.bfloat16),
                       plgpu.SMEM((len(pieces), width), jnp.bfloat16),
                       plgpu.SMEM((ROWS,), jnp.bfloat16), plgpu.Barrier(num_arrivals=len(pieces), num_barriers=2 * L),
                       plgpu.ClusterBarrier(collective_axes=("c",), num_barriers=max(L - 1, 1))],
        grid=(1,), grid_names=("g",), cluster=(C,), cluster_names=("c",), interpret=interpret)
    return lambda x, w: kernel(x, w)[0]


def xla_chain(x, w):
    import jax.numpy as jnp

    y = x
    for l in range(w.shape[0]):
        y = jnp.einsum("nk,k->n", w[l], y, preferred_element_type=jnp.float32).astype(x.dtype)
    return y


def inputs(N: int, L: int, seed: int = 0):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=N), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(L, N, N)) / np.sqrt(N), jnp.bfloat16)
    return x, w


def fits(C: int, L: int, prefetch: bool) -> bool:
    return (L if prefetch else 1) * ROWS * ROWS * C * 2 <= SMEM_BYTES


def median_us(fn, args, calls: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def repeated(fn, R: int):
    """R calls of fn(x, w) -> y chained (y feeds the next call's x) in one compiled program: its time minus one
    call's, over R - 1, is a call's device time without the per-call floor (dispatch and sync, ~60 µs here)."""
    import jax

    def f(x, w):
        for _ in range(R):
            x = fn(x, w)
        return x

    return jax.jit(f)


def device_us(fn, args, calls: int, R: int) -> float:
    """A call's device time: (median of R chained calls - median of one) / (R - 1)."""
    return (median_us(repeated(fn, R), args, calls) - median_us(repeated(fn, 1), args, calls)) / (R - 1)


def slope(points):
    """Least-squares µs per layer over (L, µs) points (None with fewer than two)."""
    if len(points) < 2:
        return None
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def lowers_for_cuda(fn, *args) -> bool:
    """Whether fn lowers for CUDA here (no GPU needed: Mosaic GPU's lowering runs in Python; its layouts, copy sizes
    and shared-memory shapes are checked there)."""
    from unittest import mock

    import jax

    with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    return True


def check(configs, layers, sync: bool = True) -> int:
    """Every config and form lowered for CUDA, and run in the GPU interpreter against the jnp chain; returns the
    number of mismatches."""
    import numpy as np
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bad = 0
    for C, _ in configs:
        for L in layers:
            for prefetch in (True, False):
                if not fits(C, L, prefetch):
                    continue
                x, w = inputs(ROWS * C, L)
                lowers_for_cuda(cluster_chain(C, L, prefetch, sync=sync), x, w)
                got = cluster_chain(C, L, prefetch, interpret=plgpu.InterpretGPUParams(), sync=sync)(x, w)
                want = xla_chain(x, w)
                err = float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))
                scale = float(np.max(np.abs(np.asarray(want, np.float32))))
                ok = err <= 2 ** -7 * max(scale, 1.0)  # bf16 outputs: the sums' order may move the last bit
                bad += not ok
                print(f"check C {C:2d} L {L:2d} {'prefetch' if prefetch else 'stream':8s}: max |diff| {err:.3g} "
                      f"(outputs up to {scale:.3g}) {'ok' if ok else 'MISMATCH'}")
    return bad


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="2:128,4:256,8:512,16:1024",
                   help="C:N pairs (N = 64 C: each block owns one 64-row tile)")
    p.add_argument("--layers", default="1,2,4,6")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=32, help="R: chained calls a program for the device time")
    p.add_argument("--check", action="store_true", help="the CPU: the interpreter against the jnp chain, no timing")
    p.add_argument("--json")
    args = p.parse_args(argv)
    try:
        configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
        layers = sorted({int(v) for v in args.layers.split(",")})
    except ValueError:
        p.error(f"--configs wants C:N pairs and --layers integers, got {args.configs} and {args.layers}")
    if any(len(c) != 2 or c[0] < 1 or c[1] != ROWS * c[0] for c in configs):
        p.error(f"--configs wants C:N pairs with C >= 1 and N = {ROWS} x C, got {args.configs}")
    if layers[0] < 1:
        p.error(f"--layers must be >= 1, got {args.layers}")
    if args.repeats < 2 or args.calls < 1:
        p.error(f"--repeats must be >= 2 and --calls >= 1, got {args.repeats} and {args.calls}")
    if args.check:
        raise SystemExit(1 if check(configs, sorted({min(layers), 2})) else 0)

    import jax
    import numpy as np

    rows = []
    for C, N in configs:
        for form in ("prefetch", "stream", "xla"):
            points, dev_points = [], []
            for L in layers:
                if form != "xla" and not fits(C, L, form == "prefetch"):
                    continue
                x, w = inputs(N, L)
                chain = xla_chain if form == "xla" else cluster_chain(C, L, form == "prefetch")
                fn = jax.jit(chain)
                try:
                    us = median_us(fn, (x, w), args.calls)
                    dev = device_us(chain, (x, w), max(args.calls // 3, 1), args.repeats)
                    diff = float(np.max(np.abs(np.asarray(fn(x, w), np.float32)
                                               - np.asarray(jax.jit(xla_chain)(x, w), np.float32))))
                except Exception as e:  # noqa: BLE001 - report and go on with the next config
                    print(f"C {C} N {N} L {L} {form}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    continue
                points.append((L, us))
                dev_points.append((L, dev))
                rows.append({"C": C, "N": N, "L": L, "form": form, "us": us, "device_us": dev,
                             "max_diff_vs_xla": diff})
                print(f"C {C:2d} N {N:5d} L {L:2d} {form:8s}: {us:8.1f} us a call, {dev:7.2f} us of device time "
                      f"(max |diff| vs XLA {diff:.3g})")
            s, ds = slope(points), slope(dev_points)
            if s is not None:
                print(f"C {C:2d} N {N:5d} {form:8s}: {s:6.2f} us per more layer (wall), {ds:6.2f} (device)")
                rows.append({"C": C, "N": N, "form": form, "us_per_layer": s, "device_us_per_layer": ds})
            if args.json:  # after each form, so that a run stopped by its time limit keeps what it measured
                with open(args.json, "w") as f:
                    command = " ".join(["python3 bench/diag_cluster.py", *(sys.argv[1:] if argv is None else argv)])
                    json.dump({"command": command, "device": str(jax.devices()[0].device_kind),
                               "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Diagnosis (session 48, issue #14, for the next step): what a barrier across every block of one Mosaic GPU kernel
costs, against a kernel boundary of XLA's.

    python3 bench/diag_grid_barrier.py [--blocks 132] [--phases 2,18,66] [--calls 200] [--json F]
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python3 bench/diag_grid_barrier.py --deviceless   # compile only, for an H200

The missed bs-1 goals need a layer in one or two kernels (session 37: ~400 launches of 1-7 µs a decode step, ~1 µs
of each the floor). A layer's phases (norm, q/k/v, attention, o, norm, gate/up, down) each need the previous phase's
whole output, i.e. a barrier across the grid, which Triton kernels cannot wait on; Mosaic GPU's GMEM semaphores can,
while every block is resident (a grid of at most one block per SM here). This measures whether that barrier is
cheaper than the kernel boundary it would replace.

The kernel (`barrier_chain`): `phases` rounds over a (blocks, 128) float32 array in two buffers; in round p block b
reads row (b + 1) % blocks of one buffer, adds 1 and writes its own row of the other, then signals one counter and
waits (without decrement) until it reaches blocks * (p + 1). After P rounds row b holds the input's row (b + P) %
blocks plus 1 added P times, checked against numpy: without the barrier's ordering a block reads a row not yet
written. The baseline (`xla_chain`): the same rounds as XLA kernels (`roll` + 1, each its own fusion through an
optimization barrier). Printed: µs a call for each phase count (median of `calls`, each synced) and the slope between the
smallest and largest count: µs a barrier against µs a kernel boundary.
"""
import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROW = 128  # one warpgroup's row of float32


def barrier_chain(blocks: int, phases: int):
    """The Mosaic GPU kernel: `phases` (even) rounds separated by a grid-wide barrier on a GMEM counter."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    assert phases % 2 == 0, "two rounds an iteration (one buffer to the other and back)"

    def body(x_ref, o_ref, tmp_ref, count_ref):
        b = jax.lax.axis_index("b")
        nb = jax.lax.rem(b + 1, blocks)

        def meet(p):  # every block has written its row of round p
            plgpu.semaphore_signal(count_ref, 1, memory_scope="gpu")
            plgpu.semaphore_wait(count_ref, blocks * (p + 1), decrement=False, memory_scope="gpu")

        o_ref[b] = x_ref[b]  # round 0 reads o
        meet(0)

        def two_rounds(i, carry):
            tmp_ref[b] = o_ref[nb] + 1.0
            meet(2 * i + 1)
            o_ref[b] = tmp_ref[nb] + 1.0
            meet(2 * i + 2)
            return carry

        jax.lax.fori_loop(0, phases // 2, two_rounds, 0)

    def run(x):
        out, _ = plgpu.kernel(
            body, out_type=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype)),
            grid=(blocks,), grid_names=("b",), scratch_types=[plgpu.SemaphoreType.REGULAR(())])(x)
        return out

    return run


def xla_chain(phases: int):
    """The baseline: the same rounds, one XLA kernel each (kept apart by optimization barriers)."""
    def run(x):
        for _ in range(phases):
            x = jax.lax.optimization_barrier(jnp.roll(x, -1, axis=0) + 1.0)
        return x

    return run


def expected(x: np.ndarray, phases: int) -> np.ndarray:
    """Round by round in float32, as the device adds (adding `phases` at once rounds otherwise)."""
    for _ in range(phases):
        x = np.roll(x, -1, axis=0) + np.float32(1)
    return x


def per_call(fn, x, calls: int) -> float:
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=132, help="grid size (every block must be resident)")
    ap.add_argument("--phases", default="2,18,66", help="even round counts")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", default=None)
    ap.add_argument("--deviceless", action="store_true", help="compile for an H200 described to XLA, run nothing")
    args = ap.parse_args(argv)
    try:
        phases = [int(p) for p in args.phases.split(",")]
    except ValueError:
        phases = []
    if not phases or any(p % 2 or p < 2 for p in phases):
        print(f"error: --phases must be even counts >= 2, got {args.phases!r}", file=sys.stderr)
        return 2
    if args.blocks < 1 or args.calls < 1:
        print(f"error: --blocks and --calls must be >= 1, got {args.blocks} and {args.calls}", file=sys.stderr)
        return 2
    shape = jax.ShapeDtypeStruct((args.blocks, ROW), jnp.float32)
    if args.deviceless:
        from jax.sharding import SingleDeviceSharding

        from jaxspec.bench.graph import target_device
        device, _ = target_device()
        placed = jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=SingleDeviceSharding(device))
        for p in phases:
            for name, fn in (("barrier", barrier_chain(args.blocks, p)), ("xla", xla_chain(p))):
                jax.jit(fn).trace(placed).lower(lowering_platforms=("cuda",)).compile()
                print(f"compiled {name} chain, {p} rounds, {args.blocks} blocks, for {device.device_kind}")
        return 0
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape.shape, np.float32))
    rows = []
    for p in phases:
        row = {"phases": p}
        for name, fn in (("barrier", jax.jit(barrier_chain(args.blocks, p))), ("xla", jax.jit(xla_chain(p)))):
            np.testing.assert_array_equal(np.asarray(fn(x)), expected(np.asarray(x), p), err_msg=f"{name} {p}")
            row[f"{name}_us"] = per_call(fn, x, args.calls)
        rows.append(row)
        print(f"rounds {p:4d}: one kernel with barriers {row['barrier_us']:8.1f} µs, "
              f"XLA kernels {row['xla_us']:8.1f} µs")
    lo, hi = rows[0], rows[-1]
    span = hi["phases"] - lo["phases"]
    slope = {k: (hi[f"{k}_us"] - lo[f"{k}_us"]) / span for k in ("barrier", "xla")} if span else {}
    if slope:
        print(f"per round: {slope['barrier']:.3f} µs a grid barrier ({args.blocks} blocks) against "
              f"{slope['xla']:.3f} µs an XLA kernel boundary")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device_kind": jax.devices()[0].device_kind, "blocks": args.blocks, "calls": args.calls,
                       "rows": rows, "us_per_round": slope}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Diagnosis (session 10, issues #14 and #17): what a call of an N-kernel program costs the host on this device.

    XLA_FLAGS=... python3 bench/diag_launch.py [--kernels 50,200,800] [--size 4096] [--calls 200]

A chain of N small dependent reductions (each its own kernel: `x = x * 0.5 + sum(x) * 1e-6`), compiled once per
N, called in four ways: the input kept and a fresh output each call (`fresh`), the input donated so that the output
can take its buffer (`donated`), and each of them as a back-to-back stream of calls with one sync at the end
(`stream`: the host's cost per call when the device never waits for it, or the device's when the host keeps up).
Printed per N: the kernels in the compiled program, then microseconds per call for each way; a `loop` row runs the
same chain as the body of a `lax.while_loop` of 8 iterations (one call).
"""
import argparse
import json
import os
import statistics
import time


def chain(n: int):
    import jax.numpy as jnp

    def f(x):
        for _ in range(n):
            x = x * 0.5 + jnp.sum(x) * 1e-6
        return x

    return f


def entry_kernels(hlo: str) -> int:
    """Fusions and custom calls in the compiled module's ENTRY computation (one kernel launch each, or more)."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[: entry.index("\n}")]
    return sum(1 for line in entry.splitlines() if " fusion(" in line or " custom-call(" in line)


def per_call(fn, x, calls: int, donate: bool, stream: bool, pair: bool = False) -> float:
    import jax

    if pair:  # fn returns (donated state, a small fresh output): the engine's decode call
        cur = x + 0
        jax.block_until_ready(cur)
        times, t0 = [], time.perf_counter()
        for _ in range(calls):
            t1 = time.perf_counter()
            cur, small = fn(cur)
            if not stream:
                jax.block_until_ready(small)
                times.append(time.perf_counter() - t1)
        jax.block_until_ready(cur)
        return (time.perf_counter() - t0) / calls * 1e6 if stream else statistics.median(times) * 1e6

    y = fn(x if not donate else x + 0)
    jax.block_until_ready(y)
    times = []
    if stream:
        cur = x + 0
        jax.block_until_ready(cur)
        t0 = time.perf_counter()
        for _ in range(calls):
            cur = fn(cur) if donate else fn(x)
        jax.block_until_ready(cur)
        return (time.perf_counter() - t0) / calls * 1e6
    cur = x + 0
    for _ in range(calls):
        t0 = time.perf_counter()
        cur = fn(cur) if donate else fn(x)
        jax.block_until_ready(cur)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", default="50,200,800")
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import jax
    import jax.numpy as jnp
    from jax import lax

    x = jnp.ones((a.size,), jnp.float32)
    rows = []
    print("XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""))
    print(f"{'N':>5} {'kernels':>7} {'fresh':>9} {'donated':>9} {'fresh stream':>12} {'donated stream':>14} "
          f"{'state+small':>11} {'state+small stream':>18} {'loop x8':>9}")
    for n in [int(v) for v in a.kernels.split(",")]:
        f = chain(n)
        fresh = jax.jit(f)
        donated = jax.jit(f, donate_argnums=0)
        hlo = fresh.lower(x).compile().as_text()
        kernels = entry_kernels(hlo)

        def loop_fn(x):
            return lax.while_loop(lambda c: c[0] < 8, lambda c: (c[0] + 1, f(c[1])), (0, x))[1]

        loop = jax.jit(loop_fn)
        state_small = jax.jit(lambda x: (lambda y: (y, jnp.sum(y)[None]))(f(x)), donate_argnums=0)
        row = {"n": n, "kernels": kernels,
               "fresh_us": per_call(fresh, x, a.calls, False, False),
               "donated_us": per_call(donated, x, a.calls, True, False),
               "fresh_stream_us": per_call(fresh, x, a.calls, False, True),
               "donated_stream_us": per_call(donated, x, a.calls, True, True),
               "state_small_out_us": per_call(state_small, x, a.calls, True, False, pair=True),
               "state_small_out_stream_us": per_call(state_small, x, a.calls, True, True, pair=True),
               "loop8_us": per_call(loop, x, max(a.calls // 8, 5), False, False)}
        rows.append(row)
        print(f"{n:5d} {kernels:7d} {row['fresh_us']:9.1f} {row['donated_us']:9.1f} {row['fresh_stream_us']:12.1f} "
              f"{row['donated_stream_us']:14.1f} {row['state_small_out_us']:11.1f} {row['state_small_out_stream_us']:18.1f} "
              f"{row['loop8_us']:9.1f}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"xla_flags": os.environ.get("XLA_FLAGS", ""), "device": str(jax.devices()[0]),
                       "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

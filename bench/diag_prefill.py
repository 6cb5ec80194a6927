"""Diagnosis (session 9, issue #16): how long one prefill call takes on this device, by rows and Pallas kernels on/off.

    python3 bench/diag_prefill.py MODEL [--rows 1,8,32] [--kernels on,off] [--profile DIR]

Each row of the table: a fresh batch of `rows` requests with 64-token prompts and max_new_tokens 1 (the prefill's
token ends them), run through the engine 5 times after its warm-up; the prefill phase's wall time per call.
"""
import argparse
import time

import numpy as np


def top_kernels(directory: str, top: int = 12) -> None:
    from jaxspec.bench.trace import busy_fraction, device_events, newest_trace, totals

    kernels, _ = device_events(newest_trace(directory))
    if not kernels:
        print("  (no device kernels in the trace)")
        return
    span = (max(k.end for k in kernels) - min(k.start for k in kernels)) / 1e6
    busy = busy_fraction([(k.start, k.end) for k in kernels])
    print(f"  trace: {len(kernels)} kernels over {span:.1f} ms, busy {busy:.2f}; the top {top} by time:")
    for name, (calls, us) in sorted(totals(kernels).items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {us / 1e3:9.2f} ms  {calls:5d}x  {name[:110]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--kernels", default="on,off")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--profile", default=None, help="a jax.profiler trace of one prefill per configuration")
    a = p.parse_args()
    import jax

    from jaxspec.engine import Engine, Request, SamplingParams
    from jaxspec.config import PRESETS
    from jaxspec.model.weights import load_target

    if a.model in PRESETS:  # random weights of a preset's shape
        from jaxspec.model.weights import random_target_params

        cfg = PRESETS[a.model]
        params = random_target_params(cfg, 0, jax.numpy.bfloat16)
    else:
        cfg, params = load_target(a.model, "bf16")
    rows = [int(x) for x in a.rows.split(",")]
    rng = np.random.default_rng(0)
    for kernels in a.kernels.split(","):
        eng = Engine(cfg, params, draft_mode="off", buckets=tuple(rows), max_running=max(rows),
                     prefill_chunk=a.chunk, use_kernels=kernels == "on")
        t0 = time.perf_counter()
        eng.warmup()
        print(f"kernels {kernels}: compiled and primed in {time.perf_counter() - t0:.1f} s", flush=True)
        for n in rows:
            times = []
            for it in range(6):
                if a.profile and it == 5:
                    jax.profiler.start_trace(f"{a.profile}/k{kernels}-b{n}")
                before = eng.stats.prefill_s
                for _ in range(n):
                    eng.add_request(Request(prompt_ids=rng.integers(10, min(1000, cfg.vocab_size), 64).tolist(),
                                            params=SamplingParams(max_new_tokens=1, ignore_eos=True)))
                while eng.has_work():
                    eng.step()
                if a.profile and it == 5:
                    jax.profiler.stop_trace()
                    top_kernels(f"{a.profile}/k{kernels}-b{n}")
                times.append(eng.stats.prefill_s - before)
            print(f"kernels {kernels} rows {n}: prefill {np.median(times[1:]) * 1e3:.1f} ms (median of 5; first "
                  f"{times[0] * 1e3:.1f} ms), {eng.stats.prefill_calls} calls so far", flush=True)


if __name__ == "__main__":
    main()

"""Diagnosis (session 29, issue #14): where a bs-1 propose's time goes when its inputs come from the host.

    python3 bench/diag_dispatch.py [--preset E4B] [--bs 1] [--ctx 4096] [--iters 200] [--profile-dir DIR] [--json F]

The propose goal row (`bench propose --variants bucketed`) calls the drafter with fresh host numpy inputs each call:
733 us at bs 1 on the H200 (session 28), of which 440-490 us pass before the call returns, against ~120 us for the
same program called with its inputs already on the device (the `stable` variant). This times one compiled bucket
(the default program: staged inputs, `BucketedDrafter`) called in ways that separate the parts of that difference:

    goal            drafter.propose_bucket(host numpy)           the goal row's call
    exe_numpy       the executable on the packed numpy array     the call without the Python packing
    exe_no_tracing  exe_numpy inside `jax.no_tracing(True)`       what propose_bucket's guard costs
    pack_only       BucketedDrafter.pack alone                    the Python packing
    put_in_call     jax.device_put(packed) then the executable   an explicit transfer
    preput_rotate   the executable on device arrays put earlier,  moved addresses, no transfer
                    a different one each call
    preput_same     the executable on one device array            no transfer, no moved address
    pinned_in_call  device_put to pinned host memory, then a      the input read from pinned host memory by the
                    program that moves it to the device itself    program (a copy inside its command buffer)
    put_only        jax.device_put(packed) alone (waited for)
    pinned_put_only the pinned-host device_put alone
    pinned_reused   one pinned-host array made once, each call's  the transfer as vLLM makes it (a persistent
                    input written into its memory by the host,    pinned host buffer, copied to the device inside the
                    then the program of pinned_in_call            program): no PJRT transfer a call (session 35)
    trivial_numpy   jit(x + 1) on the packed numpy array          the floor of a call with a host input
    trivial_device  the same on a device array

Each gets the median wall time of a call waited for, and (where it launches the drafter) the median time until the
call returns. With --profile-dir, 20 calls each of `goal` and `preput_same` are traced and the host's events (XLA's
and PJRT's TraceMe spans, per thread) summarised per call: the spans that the host inputs add; with
XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true the graph's kernels are traced too, and each call's
graph launch (`cuGraphLaunch`, host) is set against them (`timeline`): whether the GPU waits for the launch.
"""
import argparse
import json
import os
import sys
from collections import defaultdict


def host_spans(path: str, calls: int, top: int) -> list[dict]:
    """Host TraceMe spans of a trace, per call: name -> (count, total us), the longest first."""
    from jax.profiler import ProfileData

    out = defaultdict(lambda: [0, 0.0])
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            for ev in line.events:
                name = ev.name.split("#")[0][:100]
                out[name][0] += 1
                out[name][1] += (ev.end_ns - ev.start_ns) / 1e3
    rows = [{"span": k, "per_call": n / calls, "us_per_call": t / calls} for k, (n, t) in out.items()]
    return sorted(rows, key=lambda r: -r["us_per_call"])[:top]


def timeline(path: str) -> dict:
    """Each traced call's graph launch against its kernels (traced with
    --xla_enable_command_buffers_during_profiling=true, so the graph's kernels are listed), medians over the calls:
    from the launch's start to the first kernel, the launch's host time, the kernels started before the launch
    returned, from the launch's end to the last kernel's end, and the GPU's busy fraction from first to last kernel."""
    import numpy as np
    from jax.profiler import ProfileData

    launches, kernels = [], []
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            for ev in line.events:
                if plane.name.startswith("/host:") and ev.name.startswith("cuGraphLaunch"):
                    launches.append((ev.start_ns, ev.end_ns))
                elif plane.name.startswith("/device:") and line.name.startswith("Stream"):
                    kernels.append((ev.start_ns, ev.end_ns))
    launches.sort()
    kernels.sort()
    rows = []
    for j, (ls, le) in enumerate(launches):
        nxt = launches[j + 1][0] if j + 1 < len(launches) else float("inf")
        ks = [k for k in kernels if ls <= k[0] < nxt]
        if not ks:
            continue
        busy = sum(e - s for s, e in ks)  # one stream: kernels do not overlap
        span = max(e for _, e in ks) - ks[0][0]
        rows.append({"first_kernel_after_launch_start_us": (ks[0][0] - ls) / 1e3, "launch_host_us": (le - ls) / 1e3,
                     "kernels": len(ks), "kernels_started_during_launch": sum(1 for k in ks if k[0] < le),
                     "last_kernel_end_after_launch_end_us": (max(e for _, e in ks) - le) / 1e3,
                     "kernel_us": busy / 1e3, "first_to_last_kernel_us": span / 1e3,
                     "busy_fraction": busy / span if span else None})
    if not rows:
        return {"calls": 0}
    return {"calls": len(rows), **{k: float(np.median([r[k] for r in rows])) for k in rows[0] if rows[0][k] is not None}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="E4B")
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--profile-dir", default=None)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json", default=None)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    from jaxspec.aot import compile_ahead, matmul_precision
    from jaxspec.bench.common import DTYPE, median_dispatch_us, median_us, paged_cache, request_groups
    from jaxspec.bench.propose import propose_sets
    from jaxspec.bench.trace import newest_trace
    from jaxspec.config import bench_pair
    from jaxspec.draft.bucketed import BucketedDrafter
    from jaxspec.model.weights import random_assistant_params

    cfg, acfg = bench_pair(a.preset)
    aparams = random_assistant_params(acfg, 0, dtype=DTYPE)
    embed = jax.random.normal(jax.random.PRNGKey(1), (cfg.vocab_size, cfg.hidden_size), DTYPE)
    n = request_groups([a.bs])
    cache, rids = paged_cache(cfg, n, a.ctx, max_context=a.ctx, page_size=16, max_step_tokens=256, seed=a.ctx)
    drafter = BucketedDrafter(aparams, acfg, embed, cfg, a.k, buckets=(a.bs,), seed_slots=n + 1, stage_inputs=True,
                              pinned_inputs=False)  # the transfer a call (pinned_* rows: the pinned input)
    drafter.attach(cache)
    seed_table = jax.random.normal(jax.random.PRNGKey(2), (n + 1, cfg.hidden_size), DTYPE)
    sets = propose_sets(np.random.default_rng(0), cache, rids, a.bs, a.ctx, seed_table, cfg.vocab_size)
    packs = [drafter.pack(s[0], s[1], s[2], s[4]) for s in sets]
    S = len(sets)
    exe = drafter.executables[a.bs]
    fixed = (aparams, embed, cache.kv, cache.swa_of_full)
    dev = jax.devices()[0]
    device_packs = [jax.device_put(x) for x in packs]
    rows = {}

    def run(name, call, launches=True):
        """call(i): the i-th of the S input sets (common.median_us rotates i through them)."""
        row = {"wall_us": median_us(call, a.iters, num_sets=S)}
        if launches:
            row["dispatch_us"] = median_dispatch_us(call, a.iters, num_sets=S)
        rows[name] = row
        print(f"{name:16s} " + "  ".join(f"{k} {v:8.1f}" for k, v in row.items()), flush=True)

    goal = lambda i: drafter.propose_bucket(a.bs, *sets[i % S])  # noqa: E731
    preput_same = lambda i: exe(*fixed, device_packs[0], seed_table)  # noqa: E731
    run("goal", goal)
    run("exe_numpy", lambda i: exe(*fixed, packs[i % S], seed_table))

    def exe_no_tracing(i):
        with jax.no_tracing(True):
            return exe(*fixed, packs[i % S], seed_table)

    run("exe_no_tracing", exe_no_tracing)
    run("pack_only", lambda i: drafter.pack(sets[i % S][0], sets[i % S][1], sets[i % S][2], sets[i % S][4]),
        launches=False)
    run("put_in_call", lambda i: exe(*fixed, jax.device_put(packs[i % S]), seed_table))
    run("preput_rotate", lambda i: exe(*fixed, device_packs[i % S], seed_table))
    run("preput_same", preput_same)
    run("put_only", lambda i: jax.device_put(packs[i % S]), launches=False)
    trivial = jax.jit(lambda x: x + 1)
    run("trivial_numpy", lambda i: trivial(packs[i % S]))
    run("trivial_device", lambda i: trivial(device_packs[i % S]))
    try:
        pinned = SingleDeviceSharding(dev, memory_kind="pinned_host")
        on_device = SingleDeviceSharding(dev, memory_kind="device")
        spec = jax.ShapeDtypeStruct(packs[0].shape, jnp.int32, sharding=pinned)

        def from_pinned(ap, te, kv, swa, packed, seed):
            return drafter._packed_program(ap, te, kv, swa, jax.device_put(packed, on_device), seed)

        exe_pinned = compile_ahead(from_pinned, aparams, embed, cache.kv, cache.swa_of_full, spec, seed_table,
                                   compiler_options=drafter.compiler_options,
                                   precision=matmul_precision(embed.dtype))
        run("pinned_put_only", lambda i: jax.device_put(packs[i % S], pinned), launches=False)
        run("pinned_in_call", lambda i: exe_pinned(*fixed, jax.device_put(packs[i % S], pinned), seed_table))
        same = np.mean(np.asarray(exe_pinned(*fixed, jax.device_put(packs[0], pinned), seed_table)[0])
                       == np.asarray(exe(*fixed, packs[0], seed_table)[0]))
        rows["pinned_same_drafts"] = float(same)
        print(f"pinned_in_call drafts equal the default's: {same:.2f}")
        from jaxspec.staging import PinnedRing

        ring = PinnedRing(packs[0].shape, np.int32, dev, depth=1)  # one array (every call is waited for)

        def pinned_reused(i):
            return exe_pinned(*fixed, ring.write(packs[i % S]), seed_table)

        run("pinned_reused", pinned_reused)
        # every set's drafts through the reused buffer against the default program's on that set: the program reads
        # what the host wrote last, not what the buffer held when it was made
        same = [np.array_equal(np.asarray(pinned_reused(i)[0]), np.asarray(exe(*fixed, packs[i], seed_table)[0]))
                for i in range(S)]
        differ = sum(not np.array_equal(np.asarray(exe(*fixed, packs[i], seed_table)[0]),
                                        np.asarray(exe(*fixed, packs[0], seed_table)[0])) for i in range(S))
        rows["pinned_reused_same_drafts"] = float(np.mean(same))
        rows["sets_whose_drafts_differ_from_set_0"] = int(differ)
        print(f"pinned_reused drafts equal the default's on {sum(same)} of {S} sets ({differ} sets differ from set 0)")
    except Exception as e:  # noqa: BLE001 - the diagnosis reports what this backend does not take
        rows["pinned_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print("pinned:", rows["pinned_error"])

    spans = {}
    if a.profile_dir:
        for name, call in (("goal", goal), ("preput_same", preput_same)):
            d = os.path.join(a.profile_dir, name)
            jax.block_until_ready(call(0))
            jax.profiler.start_trace(d)
            for i in range(20):
                jax.block_until_ready(call(i))
            jax.profiler.stop_trace()
            trace = newest_trace(d)
            spans[name] = host_spans(trace, 20, a.top)
            print(f"host spans a call, {name}:")
            for r in spans[name]:
                print(f"  {r['us_per_call']:9.1f} us {r['per_call']:6.1f}x  {r['span']}")
            spans[name + "_timeline"] = timeline(trace)
            print(f"graph launch against its kernels, {name} (medians):",
                  ", ".join(f"{k} {v:.1f}" for k, v in spans[name + "_timeline"].items()))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"command": "python3 bench/diag_dispatch.py " + " ".join(sys.argv[1:]),
                       "device_kind": dev.device_kind, "jax_version": jax.__version__, "preset": a.preset,
                       "client_env": {k: v for k, v in os.environ.items() if k.startswith("XLA_PYTHON_CLIENT_")},
                       "bs": a.bs, "ctx": a.ctx, "k": a.k, "iters": a.iters, "rows": rows, "host_spans": spans},
                      fh, indent=1)


if __name__ == "__main__":
    main()

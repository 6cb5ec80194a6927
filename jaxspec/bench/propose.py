"""`bench propose`: the drafter's propose latency, bucketed (command buffers on and off), the fused kernels' step and
eager, side by side in one run.

The bucketed drafter runs one compiled program per batch bucket; the eager drafter runs the same model function op by
op (the reference path). All read one paged cache of random K/V at cached_len = ctx.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from jaxspec.bench.common import (DTYPE, NUM_SETS, PRESET_NAMES, after_trace, median_dispatch_us, median_us,
                                  memory_note, names_from, paged_cache, positive, print_table, profile_calls, ratio,
                                  request_groups, sizes)
from jaxspec.config import bench_pair
from jaxspec.draft.bucketed import BucketedDrafter
from jaxspec.draft.eager import EagerDrafter
from jaxspec.model.weights import random_assistant_params
from jaxspec.paged_kv.cache import PagedKVCache

NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
VARIANTS = ("bucketed", "pinned", "staged", "stable", "fused", "fused_stable", "unfused", "unfused_stable",
            "no_cmd_buffer", "eager")
# inputs on the device (the same buffers every call), outputs into donated buffers
STABLE = ("stable", "fused_stable", "unfused_stable")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, default="E4B", help="target preset; the drafter is "
                   "assistant_preset(target): hidden 256, [S,S,S,F], 2048 centroids top-32")
    p.add_argument("-k", type=positive, default=3, help="draft steps per call")
    p.add_argument("--bs", type=sizes, default=[1, 4, 16, 64], help="batch sizes, each a compiled bucket")
    p.add_argument("--ctx", type=sizes, default=[4096, 32768], help="cached_len of every request")
    p.add_argument("--chunk", type=positive, default=256, help="prefill chunk: the pool's max_step_tokens")
    p.add_argument("--variants", type=names_from(VARIANTS), default="bucketed,unfused,fused,eager",
                   help="drafters to time: bucketed (the default step: buckets up to FUSED_MAX_BUCKET through the "
                   "fused kernels, larger ones through the jnp step with the attention kernel), stable (bucketed "
                   "with its inputs on the device, the same buffers every call, and its outputs written into the "
                   "buffers its last call returned: the addresses the engine's round programs see), staged (bucketed, "
                   "called as bucketed is, its inputs packed into one array transferred each call and copied into one "
                   "buffer of the program's own first: what bucketed is with JAXSPEC_PINNED_INPUTS=0), pinned "
                   "(staged, the packed array written into persistent pinned host arrays that the program copies "
                   "itself: what bucketed is on a GPU unless JAXSPEC_PINNED_INPUTS=0), fused (the "
                   "fused kernels at every bucket), fused_stable (fused, called as stable is), unfused (the jnp "
                   "step at every bucket), unfused_stable, no_cmd_buffer (bucketed without command buffers), "
                   "eager; the first one is traced with --profile-dir")
    p.add_argument("--eager-iters", type=positive, help="timed calls of the eager drafter, ~0.3 s each on the H200 "
                   "(default: --iters, at most 50)")


def propose_sets(rng, cache: PagedKVCache, rids, bs: int, ctx: int, seed_table, vocab: int) -> list[tuple]:
    """Propose inputs (page_table, cached_len, pending, seed_table, seed_rows) as host numpy, the seed table on the
    device. A small batch reads another group of requests in each set, so its K/V is not served from L2."""
    groups = max(1, min(NUM_SETS, len(rids) // bs))
    return [(cache.pool.page_table(rids[(j % groups) * bs:(j % groups + 1) * bs]), np.full(bs, ctx, np.int32),
             rng.integers(0, vocab, bs).astype(np.int32), seed_table,
             rng.permutation(seed_table.shape[0])[:bs].astype(np.int32)) for j in range(NUM_SETS)]


def propose_rows(args, model, ctx: int, num_requests: int, eager_iters: int, rng) -> list[dict]:
    """One paged cache of `num_requests` requests at cached_len = ctx; a row per batch size."""
    cfg, acfg, aparams, target_embed = model
    cache, rids = paged_cache(cfg, num_requests, ctx, max_context=ctx, page_size=args.page_size,
                              max_step_tokens=max(args.chunk, args.k + 1), seed=args.seed + ctx)
    note = memory_note(cache.kv)
    print(f"ctx {ctx}: {num_requests} requests; {note}")
    kw = dict(buckets=args.bs, seed_slots=num_requests + 1)
    variants = list(args.variants)
    make = {"bucketed": lambda: BucketedDrafter(aparams, acfg, target_embed, cfg, args.k, **kw),
            "staged": lambda: BucketedDrafter(aparams, acfg, target_embed, cfg, args.k, stage_inputs=True,
                                              pinned_inputs=False, **kw),
            "pinned": lambda: BucketedDrafter(aparams, acfg, target_embed, cfg, args.k, stage_inputs=True,
                                              pinned_inputs=True, **kw),
            "stable": lambda: BucketedDrafter(aparams, acfg, target_embed, cfg, args.k, donate_outputs=True, **kw),
            "fused": lambda: BucketedDrafter(aparams, acfg, target_embed, cfg, args.k, fused=True, **kw),
            "fused_stable": lambda: BucketedDrafter(aparams, acfg, target_embed, cfg, args.k, fused=True,
                                                    donate_outputs=True, **kw),
            "unfused": lambda: BucketedDrafter(aparams, acfg, target_embed, cfg, args.k, fused=False, **kw),
            "unfused_stable": lambda: BucketedDrafter(aparams, acfg, target_embed, cfg, args.k, fused=False,
                                                      donate_outputs=True, **kw),
            "no_cmd_buffer": lambda: BucketedDrafter(aparams, acfg, target_embed, cfg, args.k, **kw,
                                                     compiler_options=NO_COMMAND_BUFFERS),
            "eager": lambda: EagerDrafter(aparams, acfg, target_embed, cfg, args.k)}
    if jax.default_backend() != "gpu" and "no_cmd_buffer" in variants:
        variants.remove("no_cmd_buffer")
    drafters = {name: make[name]() for name in variants}
    for drafter in drafters.values():
        drafter.attach(cache)
    seed_table = jax.random.normal(jax.random.PRNGKey(args.seed + 2), (num_requests + 1, cfg.hidden_size), DTYPE)
    rows = []
    for bs in args.bs:
        sets = propose_sets(rng, cache, rids, bs, ctx, seed_table, cfg.vocab_size)
        fixed = jax.device_put(sets[0])  # one input set already on the device: the same buffers every call
        calls = {name: (lambda i, d=d: d.propose(*sets[i])) if name == "eager"
                 else (lambda i, d=d, bs=bs: d.propose_bucket(bs, *fixed)) if name in STABLE
                 else (lambda i, d=d, bs=bs: d.propose_bucket(bs, *sets[i]))
                 for name, d in drafters.items()}
        row = {"ctx": ctx, "bs": bs, "k": args.k, **{f"{v}_us": None for v in make}, "memory": note,
               "after_trace": after_trace(args)}
        for name, call in calls.items():
            row[f"{name}_us"] = median_us(call, eager_iters if name == "eager" else args.iters,
                                          num_sets=1 if name in STABLE else NUM_SETS)
            if name in STABLE:
                row[f"{name}_dispatch_us"] = median_dispatch_us(call, args.iters, num_sets=1)
            if name == "bucketed":
                row["bucketed_dispatch_us"] = median_dispatch_us(call, args.iters)
                row["bucketed_device_inputs_us"] = median_us(
                    lambda i, d=drafters["bucketed"], bs=bs: d.propose_bucket(bs, *fixed), args.iters, num_sets=1)
        # the first variant listed is the one traced, after every variant is timed (common.profile_calls)
        traced = profile_calls(args, calls[variants[0]], f"propose {variants[0]} bs {bs} ctx {ctx}")
        if traced:
            row.update(traced_variant=variants[0], **traced)
        if "stable" in calls and "bucketed" in calls:  # the same drafts from the same inputs
            row["stable_same_drafts"] = float(np.mean(np.asarray(calls["stable"](0)[0])
                                                      == np.asarray(calls["bucketed"](0)[0])))
        if "staged" in calls and "bucketed" in calls:
            row["staged_same_drafts"] = float(np.mean(np.asarray(calls["staged"](0)[0])
                                                      == np.asarray(calls["bucketed"](0)[0])))
        if "pinned" in calls and "bucketed" in calls:
            row["pinned_same_drafts"] = float(np.mean(np.asarray(calls["pinned"](0)[0])
                                                      == np.asarray(calls["bucketed"](0)[0])))
        if "eager" in calls and "bucketed" in calls:
            same = np.asarray(calls["bucketed"](0)[0]) == calls["eager"](0)[0]
            row["same_drafts"] = float(np.mean(np.all(same, axis=1)))
        row["eager/bucketed"] = ratio(row["eager_us"], row["bucketed_us"])
        row["fused/bucketed"] = ratio(row["fused_us"], row["bucketed_us"])
        row["stable/bucketed"] = ratio(row["stable_us"], row["bucketed_us"])
        row["staged/bucketed"] = ratio(row["staged_us"], row["bucketed_us"])
        row["pinned/bucketed"] = ratio(row["pinned_us"], row["bucketed_us"])
        row["fused_stable/stable"] = ratio(row["fused_stable_us"], row["stable_us"])
        row["stable/unfused_stable"] = ratio(row["stable_us"], row["unfused_stable_us"])
        row["no_cmd/bucketed"] = ratio(row["no_cmd_buffer_us"], row["bucketed_us"])
        rows.append(row)
        print(f"propose ctx {ctx} bs {bs}: " + ", ".join(f"{n} {row[n + '_us']:.1f} µs" for n in drafters))
    return rows


def run(args) -> dict:
    """Propose latency: BucketedDrafter.propose_bucket (command buffers on / off) vs EagerDrafter.propose."""
    cfg, acfg = bench_pair(args.preset)
    aparams = random_assistant_params(acfg, args.seed, dtype=DTYPE)
    target_embed = jax.random.normal(jax.random.PRNGKey(args.seed + 1), (cfg.vocab_size, cfg.hidden_size), DTYPE)
    num_requests = request_groups(args.bs)
    eager_iters = args.eager_iters or min(args.iters, 50)
    rng = np.random.default_rng(args.seed)
    rows = []
    for ctx in args.ctx:
        rows += propose_rows(args, (cfg, acfg, aparams, target_embed), ctx, num_requests, eager_iters, rng)
        args.write_partial({"preset": args.preset, "eager_iters": eager_iters, "rows": rows})
    print_table(f"propose, k={args.k}: drafter of {args.preset} (hidden {acfg.hidden_size}, "
                f"{acfg.text.num_layers} layers, {acfg.num_centroids} centroids top-{acfg.centroid_top_k}), "
                f"paged cache page {args.page_size}, random bf16", [
                    ("ctx", "ctx", "{}"), ("bs", "bs", "{}"), ("bucketed_us", "bucketed_us", "{:.1f}"),
                    ("bucketed_dispatch_us", "launch_us", "{:.1f}"),
                    ("bucketed_device_inputs_us", "device_inputs_us", "{:.1f}"),
                    ("stable_us", "stable_us", "{:.1f}"), ("stable_dispatch_us", "stable_launch_us", "{:.1f}"),
                    ("stable/bucketed", "stable/bucketed", "{:.2f}"), ("staged_us", "staged_us", "{:.1f}"),
                    ("staged/bucketed", "staged/bucketed", "{:.2f}"), ("pinned_us", "pinned_us", "{:.1f}"),
                    ("pinned/bucketed", "pinned/bucketed", "{:.2f}"), ("fused_stable_us", "fused_stable_us", "{:.1f}"),
                    ("fused_stable/stable", "fused_stable/stable", "{:.2f}"),
                    ("unfused_stable_us", "unfused_stable_us", "{:.1f}"),
                    ("stable/unfused_stable", "stable/unfused_stable", "{:.2f}"),
                    ("fused_us", "fused_us", "{:.1f}"), ("fused/bucketed", "fused/bucketed", "{:.2f}"),
                    ("no_cmd_buffer_us", "no_cmdbuf_us", "{:.1f}"), ("eager_us", "eager_us", "{:.1f}"),
                    ("eager/bucketed", "eager/bucketed", "{:.2f}"), ("no_cmd/bucketed", "no_cmd/bucketed", "{:.2f}"),
                    ("same_drafts", "same_drafts", "{:.2f}")], rows)
    return {"preset": args.preset, "eager_iters": eager_iters, "rows": rows}

"""`python -m jaxspec.bench SUBCOMMAND`: GPU figures with random bf16 weights at the public sizes (DESIGN.md §8).

    kernels   gather_kv_indices vs a whole-row translation; paged_attention vs its XLA reference
    propose   the bucketed drafter (command buffers on and off) vs the eager drafter
    decode    one target decode step over the dense and the paged cache, against the HBM bound
    memory    KV bytes per request with and without the SWA pool (arithmetic only)

Latency is the median over --iters calls of the wall time of `fn(...)` + `jax.block_until_ready`, after one warm-up
call (compile) on each of the input sets the calls rotate through, so that a small working set is not served from
L2. Each subcommand prints fixed-width tables and writes JSON (--json; default bench/results/<subcommand>-<time>.json)
with the jax version, the device, the date and the command line. Timings never belong in tests.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxspec.config import (FULL, LAYER_TYPES, PRESETS, SLIDING, AssistantConfig, ConfigError,
                            TargetConfig, bench_pair)
from jaxspec.draft.bucketed import BucketedDrafter
from jaxspec.draft.eager import EagerDrafter
from jaxspec.engine import Engine, Request, SamplingParams
from jaxspec.model import gemma4
from jaxspec.model.weights import random_assistant_params, random_target_params
from jaxspec.paged_kv.cache import PagedKVCache, round_width
from jaxspec.paged_kv.pool import swa_pages_bound_for
from jaxspec.pallas.kv_indices import gather_kv_indices
from jaxspec.pallas.paged_attention import paged_attention
from jaxspec.pallas.reference import paged_attention_ref

DTYPE = jnp.bfloat16
HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
NUM_SETS = 3  # input sets the timed calls rotate through
SLACK_PAGES = 8
ROTATE_ROWS_UP_TO = 16  # batches up to this size read disjoint requests per input set (their K/V could sit in L2)
ATTN_HEADS, ATTN_KV_HEADS = 8, 2  # E4B: 8 query heads over 2 KV heads in both layer types
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}

# E4B's structure (PLE, KV sharing, both layer types, centroid drafter head) at sizes a CPU compiles in seconds.
PRESET_NAMES = ("tiny", *PRESETS)


def target_preset(name: str) -> TargetConfig:
    return bench_pair(name)[0]


def drafter_preset(name: str, cfg: TargetConfig) -> AssistantConfig:
    return bench_pair(name)[1]


# ---- measuring and reporting -----------------------------------------------------------------------------------------


def median_us(call, iters: int, num_sets: int = NUM_SETS) -> float:
    """Median wall time in µs of `call(i)` + block_until_ready over `iters` calls rotating i through the input sets,
    after one warm-up call per set."""
    for i in range(num_sets):
        jax.block_until_ready(call(i))
    times = []
    for n in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(call(n % num_sets))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def profile_calls(args, call, label: str, calls: int = 20) -> None:
    """With --profile-dir: record `calls` more calls of the first figure asked for into a profiler trace (once per
    run; summarise with `python -m jaxspec.bench trace DIR --rounds {calls}`)."""
    if not getattr(args, "profile_dir", None) or getattr(args, "profiled", None):
        return
    jax.block_until_ready(call(0))
    jax.profiler.start_trace(args.profile_dir)
    for n in range(calls):
        jax.block_until_ready(call(n % NUM_SETS))
    jax.profiler.stop_trace()
    args.profiled = label
    print(f"profiled {calls} calls of {label} into {args.profile_dir}")


def median_dispatch_us(call, iters: int, num_sets: int = NUM_SETS) -> float:
    """Median host time in µs until `call(i)` returns (the launch; the result is waited for outside the timing)."""
    times = []
    for n in range(iters):
        t0 = time.perf_counter()
        out = call(n % num_sets)
        times.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return float(np.median(times)) * 1e6


@jax.jit
def dispatch_floor(*args):
    """The cheapest call on a figure's own arguments: the dispatch + sync cost that every figure of its row includes
    (on a virtualised host tens of µs, more than a small kernel runs)."""
    return min(args, key=lambda a: a.size) + 1


def ratio(a, b):
    return None if a is None or b is None else a / b


def print_table(title: str, columns, rows) -> None:
    """columns: (key, header, format); a None value prints as '-'."""
    cells = [["-" if r[k] is None else fmt.format(r[k]) for k, _, fmt in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_note(arrays) -> str:
    """K/V bytes held and, where the backend reports it, device memory in use and its peak."""
    note = f"K/V arrays {gib(sum(a.nbytes for a in jax.tree.leaves(arrays)))}"
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_in_use" in stats:
        note += f"; device in use {gib(stats['bytes_in_use'])}, peak {gib(stats.get('peak_bytes_in_use', 0))}"
    return note


def environment() -> dict:
    device = jax.devices()[0]
    return {"jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__, "backend": jax.default_backend(),
            "device_kind": device.device_kind, "device_count": jax.device_count(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


# ---- random state on the device --------------------------------------------------------------------------------------


@functools.partial(jax.jit, donate_argnums=0)
def _fill_layer(stack, key, layer):
    return stack.at[layer].set(jax.random.normal(key, stack.shape[1:], stack.dtype))


def randomize(arrays: dict, seed: int) -> None:
    """Random values in every stack [L, ...] of `arrays`, in place, one layer at a time (a 64 x 32K E4B cache has
    17 GB stacks: drawing a whole one at once would need that much again)."""
    key = jax.random.PRNGKey(seed)
    for n, name in enumerate(sorted(arrays)):
        for layer in range(arrays[name].shape[0]):
            arrays[name] = _fill_layer(arrays[name], jax.random.fold_in(key, 1000 * n + layer), layer)


def paged_cache(cfg: TargetConfig, num_requests: int, cached: int, *, max_context: int, page_size: int,
                max_step_tokens: int, seed: int) -> tuple[PagedKVCache, list[int]]:
    """A paged cache with random K/V whose `num_requests` requests hold `cached` positions each, allocated through
    the pool in steps of max_step_tokens, interleaved across requests as an engine's prefill would."""
    bound = swa_pages_bound_for(page_size=page_size, swa_keep=cfg.sliding_window + 1, max_step_tokens=max_step_tokens)
    cache = PagedKVCache(cfg, page_size=page_size, num_full_pages=num_requests * -(-max_context // page_size) + 1
                         + SLACK_PAGES, num_swa_pages=num_requests * bound + 1 + SLACK_PAGES,
                         max_context=max_context, max_step_tokens=max_step_tokens, dtype=DTYPE)
    rids = list(range(num_requests))
    for rid in rids:
        cache.pool.add(rid)
    for start in range(0, cached, max_step_tokens):
        for rid in rids:
            if not cache.pool.prepare(rid, start, min(cached, start + max_step_tokens)):
                raise RuntimeError(f"the benchmark's pool is too small at request {rid}, position {start}")
    randomize(cache.arrays, seed)
    return cache, rids


def request_groups(bs_list) -> int:
    """Requests to allocate: the largest batch, or three disjoint groups of the largest batch that may fit in L2."""
    small = [b for b in bs_list if b <= ROTATE_ROWS_UP_TO]
    return max(max(bs_list), NUM_SETS * max(small, default=0))


# ---- kernels ------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("width", "page_size"))
def whole_row_kv_indices(page_table, starts, ends, swa_of_full, *, width: int, page_size: int):
    """Baseline of `gather_kv_indices`: translate every slot of every page-table row to SWA slots (B x max_context,
    as a page-size-1 design translates its whole fixed index buffer), then take the window. int32[B, width]."""
    max_context = page_table.shape[1] * page_size
    pos = jnp.arange(max_context, dtype=jnp.int32)
    row = swa_of_full[page_table][:, pos // page_size] * page_size + pos % page_size  # [B, max_context]
    row = jax.lax.optimization_barrier(row)  # written out whole, as that design does; XLA must not fuse it away
    i = starts[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    taken = jnp.take_along_axis(row, jnp.minimum(i, max_context - 1), axis=1)
    return jnp.where(i < ends[:, None], taken, 0)


def gather_sets(rng, bs: int, table: int, window: int, page_size: int) -> list[tuple]:
    """Input sets of a bs-row batch whose page-table rows cover `table` positions and end `window + 1` live
    positions past their start; each set has its own page permutation and SWA mapping of the live pages."""
    max_pages = -(-table // page_size)
    num_full = bs * max_pages + 1
    num_swa = bs * swa_pages_bound_for(page_size=page_size, swa_keep=window + 1, max_step_tokens=1) + 1
    sets = []
    for j in range(NUM_SETS):
        page_table = rng.permutation(np.arange(1, num_full, dtype=np.int32)).reshape(bs, max_pages)
        ends = np.full(bs, table - j, np.int32)
        starts = np.maximum(ends - window - 1, 0)
        live = np.unique(np.concatenate([page_table[b, starts[b] // page_size: (ends[b] - 1) // page_size + 1]
                                         for b in range(bs)]))
        swa_of_full = np.zeros(num_full, np.int32)
        swa_of_full[live] = rng.permutation(np.arange(1, num_swa, dtype=np.int32))[: len(live)]
        sets.append(tuple(jnp.asarray(x) for x in (page_table, starts, ends, swa_of_full)))
    return sets


def attention_sets(rng, key, bs: int, ctx: int, head_dim: int, page_size: int):
    """One layer's K/V pool [slots, KVH, d] (random bf16) and, per input set, kv_indices [bs, width] of distinct
    pages (each set reads its own pages): every row holds `ctx` keys at positions 0 .. ctx - 1."""
    pages_per_row = -(-ctx // page_size)
    num_pages = NUM_SETS * bs * pages_per_row + 1
    shape = (num_pages * page_size, ATTN_KV_HEADS, head_dim)
    k_cache = jax.random.normal(jax.random.fold_in(key, 0), shape, DTYPE)
    v_cache = jax.random.normal(jax.random.fold_in(key, 1), shape, DTYPE)
    pages = rng.permutation(np.arange(1, num_pages, dtype=np.int32)).reshape(NUM_SETS, bs, pages_per_row)
    slots = (pages[..., None] * page_size + np.arange(page_size, dtype=np.int32)).reshape(NUM_SETS, bs, -1)[..., :ctx]
    width = round_width(ctx)
    indices = [jnp.asarray(np.pad(s, ((0, 0), (0, width - ctx)))) for s in slots]
    return k_cache, v_cache, indices


def kernels_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=("gather", "attention", "all"), default="all")
    p.add_argument("--bs", type=sizes, help="batch sizes (default: gather 1,64; attention 1,16,64)")
    p.add_argument("--table", type=sizes, default=[4096, 131072], help="gather: page-table row length in positions")
    p.add_argument("--window", type=positive, default=512, help="gather: sliding window W (W + 1 live entries)")
    p.add_argument("--ctx", type=sizes, default=[4096, 32768], help="attention: cached keys per row")
    p.add_argument("--head-dim", type=sizes, default=[256, 512], help="attention: head_dim (8 q heads, 2 kv heads)")
    p.add_argument("--tq", type=sizes, default=[1, 4], help="attention: queries per row (1 decode/draft, k+1 verify)")


def gather_rows(args, rng) -> list[dict]:
    P, width = args.page_size, round_width(args.window + 1)
    rows = []
    for bs in args.bs or [1, 64]:
        for table in args.table:
            sets = gather_sets(rng, bs, table, args.window, P)
            row = {"bs": bs, "table": table, "window": args.window, "live": args.window + 1, "width": width,
                   "floor_us": median_us(lambda i: dispatch_floor(*sets[i]), args.iters)}
            for name, fn in (("kernel_us", gather_kv_indices), ("whole_row_us", whole_row_kv_indices)):
                row[name] = median_us(lambda i, fn=fn: fn(*sets[i], width=width, page_size=P), args.iters)
            row["whole/kernel"] = row["whole_row_us"] / row["kernel_us"]
            rows.append(row)
            print(f"gather bs {bs} table {table}: {row['kernel_us']:.1f} vs {row['whole_row_us']:.1f} µs")
    print_table(f"gather_kv_indices: live window of W+1 = {args.window + 1} positions (page {P}) vs whole-row "
                "translation", [("bs", "bs", "{}"), ("table", "table", "{}"), ("floor_us", "floor_us", "{:.1f}"),
                                ("kernel_us", "kernel_us", "{:.1f}"), ("whole_row_us", "whole_row_us", "{:.1f}"),
                                ("whole/kernel", "whole/kernel", "{:.2f}")], rows)
    return rows


def attention_rows(args, rng) -> list[dict]:
    if any(d & (d - 1) or d < 16 for d in args.head_dim):
        raise ConfigError(f"paged_attention needs power-of-two head dims >= 16, got {args.head_dim}")
    key = jax.random.PRNGKey(args.seed)
    ref = jax.jit(paged_attention_ref)
    rows = []
    for d in args.head_dim:
        for bs in args.bs or [1, 16, 64]:
            for ctx in args.ctx:
                k_cache, v_cache, indices = attention_sets(rng, jax.random.fold_in(key, d * 1000 + bs), bs, ctx, d,
                                                           args.page_size)
                kv_bytes = bs * ctx * ATTN_KV_HEADS * d * 2 * jnp.dtype(DTYPE).itemsize
                kv_start = jnp.zeros(bs, jnp.int32)
                for tq in args.tq:
                    qs = [jax.random.normal(jax.random.fold_in(key, j), (bs, tq, ATTN_HEADS, d), DTYPE)
                          for j in range(NUM_SETS)]
                    q_lo = jnp.zeros((bs, tq), jnp.int32)
                    q_hi = jnp.broadcast_to(ctx - tq + jnp.arange(tq, dtype=jnp.int32), (bs, tq))
                    row = {"head_dim": d, "bs": bs, "ctx": ctx, "tq": tq, "kv_bytes": kv_bytes,
                           "bound_us": kv_bytes / args.hbm_bw * 1e6}
                    for name, fn in (("floor_us", dispatch_floor), ("kernel_us", paged_attention), ("ref_us", ref)):
                        row[name] = median_us(lambda i, fn=fn: fn(qs[i], k_cache, v_cache, indices[i], kv_start,
                                                                  q_lo, q_hi), args.iters)
                    row["ref/kernel"] = row["ref_us"] / row["kernel_us"]
                    row["kernel/bound"] = row["kernel_us"] / row["bound_us"]
                    row["ref/bound"] = row["ref_us"] / row["bound_us"]
                    rows.append(row)
                    print(f"attention d {d} bs {bs} ctx {ctx} tq {tq}: {row['kernel_us']:.1f} vs "
                          f"{row['ref_us']:.1f} µs")
                del k_cache, v_cache, indices
    print_table(f"paged_attention ({ATTN_HEADS} q / {ATTN_KV_HEADS} kv heads, all cached keys, bf16) vs XLA gather + "
                f"attention; HBM bound = K/V bytes / {args.hbm_bw:.3g} B/s", [
                    ("head_dim", "d", "{}"), ("bs", "bs", "{}"), ("ctx", "ctx", "{}"), ("tq", "tq", "{}"),
                    ("floor_us", "floor_us", "{:.1f}"), ("kernel_us", "kernel_us", "{:.1f}"),
                    ("ref_us", "ref_us", "{:.1f}"), ("ref/kernel", "ref/kernel", "{:.2f}"),
                    ("bound_us", "bound_us", "{:.1f}"), ("kernel/bound", "kernel/bound", "{:.2f}"),
                    ("ref/bound", "ref/bound", "{:.2f}")], rows)
    return rows


def run_kernels(args) -> dict:
    """gather_kv_indices vs whole-row translation; paged_attention vs paged_attention_ref (XLA gather + attention)."""
    rng = np.random.default_rng(args.seed)
    return {"gather": gather_rows(args, rng) if args.part in ("gather", "all") else [],
            "attention": attention_rows(args, rng) if args.part in ("attention", "all") else []}


# ---- propose ------------------------------------------------------------------------------------------------------


def propose_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, default="E4B", help="target preset; the drafter is "
                   "assistant_preset(target): hidden 256, [S,S,S,F], 2048 centroids top-32")
    p.add_argument("-k", type=positive, default=3, help="draft steps per call")
    p.add_argument("--bs", type=sizes, default=[1, 4, 16, 64], help="batch sizes, each a compiled bucket")
    p.add_argument("--ctx", type=sizes, default=[4096, 32768], help="cached_len of every request")
    p.add_argument("--chunk", type=positive, default=256, help="prefill chunk: the pool's max_step_tokens")
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
    note = memory_note(cache.arrays)
    print(f"ctx {ctx}: {num_requests} requests; {note}")
    kw = dict(buckets=args.bs, seed_slots=num_requests + 1)
    drafters = {"bucketed": BucketedDrafter(aparams, acfg, target_embed, cfg, args.k, **kw)}
    if jax.default_backend() == "gpu":
        drafters["no_cmd_buffer"] = BucketedDrafter(aparams, acfg, target_embed, cfg, args.k, **kw,
                                                    compiler_options=NO_COMMAND_BUFFERS)
    drafters["eager"] = EagerDrafter(aparams, acfg, target_embed, cfg, args.k)
    for drafter in drafters.values():
        drafter.attach(cache)
    seed_table = jax.random.normal(jax.random.PRNGKey(args.seed + 2), (num_requests + 1, cfg.hidden_size), DTYPE)
    rows = []
    for bs in args.bs:
        sets = propose_sets(rng, cache, rids, bs, ctx, seed_table, cfg.vocab_size)
        calls = {name: (lambda i, d=d: d.propose(*sets[i])) if name == "eager"
                 else (lambda i, d=d, bs=bs: d.propose_bucket(bs, *sets[i]))
                 for name, d in drafters.items()}
        row = {"ctx": ctx, "bs": bs, "k": args.k, "no_cmd_buffer_us": None, "memory": note}
        for name, call in calls.items():
            row[f"{name}_us"] = median_us(call, eager_iters if name == "eager" else args.iters)
            if name == "bucketed":
                row["bucketed_dispatch_us"] = median_dispatch_us(call, args.iters)
                fixed = jax.device_put(sets[0])  # one input set already on the device: the same buffers every call
                row["bucketed_device_inputs_us"] = median_us(lambda i, d=drafters["bucketed"], bs=bs: d.propose_bucket(bs, *fixed),
                                                             args.iters, num_sets=1)
            if name == "bucketed":
                profile_calls(args, call, f"propose bs {bs} ctx {ctx}")
        same = np.asarray(calls["bucketed"](0)[0]) == calls["eager"](0)[0]
        row["same_drafts"] = float(np.mean(np.all(same, axis=1)))
        row["eager/bucketed"] = row["eager_us"] / row["bucketed_us"]
        row["no_cmd/bucketed"] = ratio(row["no_cmd_buffer_us"], row["bucketed_us"])
        rows.append(row)
        print(f"propose ctx {ctx} bs {bs}: bucketed {row['bucketed_us']:.1f} µs, eager {row['eager_us']:.1f} µs")
    return rows


def run_propose(args) -> dict:
    """Propose latency: BucketedDrafter.propose_bucket (command buffers on / off) vs EagerDrafter.propose."""
    cfg = target_preset(args.preset)
    acfg = drafter_preset(args.preset, cfg)
    aparams = random_assistant_params(acfg, args.seed, dtype=DTYPE)
    target_embed = jax.random.normal(jax.random.PRNGKey(args.seed + 1), (cfg.vocab_size, cfg.hidden_size), DTYPE)
    num_requests = request_groups(args.bs)
    eager_iters = args.eager_iters or min(args.iters, 50)
    rng = np.random.default_rng(args.seed)
    rows = []
    for ctx in args.ctx:
        rows += propose_rows(args, (cfg, acfg, aparams, target_embed), ctx, num_requests, eager_iters, rng)
        args.write_partial({"preset": args.preset, "eager_iters": eager_iters, "rows": rows})
        gc.collect()  # the cache and its drafters reference each other (rebuild callbacks): free the K/V now
    print_table(f"propose, k={args.k}: drafter of {args.preset} (hidden {acfg.hidden_size}, "
                f"{acfg.text.num_layers} layers, {acfg.num_centroids} centroids top-{acfg.centroid_top_k}), "
                f"paged cache page {args.page_size}, random bf16", [
                    ("ctx", "ctx", "{}"), ("bs", "bs", "{}"), ("bucketed_us", "bucketed_us", "{:.1f}"),
                    ("bucketed_dispatch_us", "launch_us", "{:.1f}"),
                    ("bucketed_device_inputs_us", "device_inputs_us", "{:.1f}"),
                    ("no_cmd_buffer_us", "no_cmdbuf_us", "{:.1f}"), ("eager_us", "eager_us", "{:.1f}"),
                    ("eager/bucketed", "eager/bucketed", "{:.2f}"), ("no_cmd/bucketed", "no_cmd/bucketed", "{:.2f}"),
                    ("same_drafts", "same_drafts", "{:.2f}")], rows)
    return {"preset": args.preset, "eager_iters": eager_iters, "rows": rows}


# ---- decode -------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=(3,))
def paged_decode_step(params, cfg, spec, arrays, page_table, swa_of_full, tokens, start, num_tokens):
    """One target step over the paged cache (Pallas kernels) -> (fp32 logits of the last position [B, V], arrays)."""
    hidden, arrays = gemma4.paged_forward(params, cfg, spec, arrays, page_table, swa_of_full, tokens, start,
                                          num_tokens, use_kernels=True)
    return gemma4.logits(params, cfg, hidden[:, -1]), arrays


def decode_bytes(cfg: TargetConfig, params, bs: int, ctx: int) -> dict[str, int]:
    """Bytes one decode step at position ctx - 1 must read, each once: every weight (the embedding only as the tied
    LM head, plus the PLE rows of the batch's tokens; MoE experts only the at most bs * top_k used), and the K/V of
    every layer (sliding min(ctx, W) positions, full ctx; a KV-shared layer reads its store layer's K/V again)."""
    out = {"lm_head": params["embed"].nbytes}
    ple = params.get("ple_embed")
    out["ple_rows"] = 0 if ple is None else bs * ple.shape[1] * ple.dtype.itemsize
    out["globals"] = sum(a.nbytes for name, a in params.items() if name not in ("embed", "ple_embed", "layers"))
    used = min(cfg.num_experts, bs * cfg.top_k_experts) / cfg.num_experts if cfg.enable_moe_block else 1.0
    out["layers"] = int(sum(a.nbytes * (used if name.startswith("experts_") else 1)
                            for group in params["layers"].values() for name, a in group.items()))
    item = jnp.dtype(DTYPE).itemsize
    for t in LAYER_TYPES:
        positions = min(ctx, cfg.sliding_window) if t == SLIDING else ctx
        layers = sum(1 for lt in cfg.layer_types if lt == t)
        out[f"kv_{t.split('_')[0]}"] = layers * bs * positions * cfg.type_kv_heads(t) * cfg.type_head_dim(t) * 2 * item
    out["total"] = sum(out.values())
    return out


def decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, default="E4B")
    p.add_argument("--bs", type=sizes, default=[1, 16])
    p.add_argument("--ctx", type=sizes, default=[4096], help="positions in the cache after the step")
    p.add_argument("--cache", choices=("dense", "paged", "both"), default="both")
    p.add_argument("--unstacked", action="store_true", help="also time the paged step with per-layer weight leaves "
                   "(one array per layer instead of one stack per layer group)")
    p.add_argument("--chunk", type=positive, default=256, help="prefill chunk: the pool's max_step_tokens")


def dense_decode(params, cfg: TargetConfig, bs: int, ctx: int, tokens, seed: int):
    """A decode step at position ctx - 1 over a dense [bs, ctx] cache of random K/V (donated, threaded through the
    calls). Returns (call(i) -> logits, jit argument leaves, memory note)."""
    box = [gemma4.init_dense_cache(cfg, bs, ctx, DTYPE)]
    randomize(box[0], seed)
    start = jnp.int32(ctx - 1)

    def call(i):
        logits, _, box[0] = gemma4.dense_forward_jit(params, cfg, tokens[i], start, box[0])
        return logits

    return call, len(jax.tree.leaves((params, tokens[0], start, box[0]))), memory_note(box[0])


def paged_decode(params, cfg: TargetConfig, bs: int, ctx: int, tokens, args):
    """The same step over a paged cache through the Pallas kernels: each request holds ctx - T positions and the
    step writes the last T (T = 1: decode; T = k + 1: a verify step)."""
    T = tokens[0].shape[1]
    cache, rids = paged_cache(cfg, bs, ctx - T, max_context=ctx, page_size=args.page_size,
                              max_step_tokens=max(args.chunk, T), seed=args.seed)
    for rid in rids:
        cache.pool.prepare(rid, ctx - T, ctx)
    fixed = (jnp.asarray(cache.pool.page_table(rids)), cache.swa_of_full)
    start, num_tokens = jnp.full(bs, ctx - T, jnp.int32), jnp.full(bs, T, jnp.int32)
    box = [cache.arrays]

    def call(i):
        logits, box[0] = paged_decode_step(params, cfg, cache.spec, box[0], *fixed, tokens[i], start, num_tokens)
        return logits

    leaves = len(jax.tree.leaves((params, box[0], fixed, tokens[0], start, num_tokens)))
    return call, leaves, memory_note(box[0])


def run_decode(args) -> dict:
    """One target decode step (T=1): dense cache vs paged cache (Pallas kernels), against the HBM bound."""
    cfg = target_preset(args.preset)
    params = random_target_params(cfg, args.seed, dtype=DTYPE)
    weights = sum(a.nbytes for a in jax.tree.leaves(params))
    print(f"{args.preset}: weights {gib(weights)} in {len(jax.tree.leaves(params))} leaves")
    rng = np.random.default_rng(args.seed)
    modes = ("dense", "paged") if args.cache == "both" else (args.cache,)
    if args.unstacked:
        modes += ("paged-unstacked",)
        unstacked = dict(params, layers={g: {n: tuple(a[i] for i in range(a.shape[0])) for n, a in w.items()}
                                         for g, w in params["layers"].items()})
    rows, needs = [], []
    for ctx in args.ctx:
        for bs in args.bs:
            need = decode_bytes(cfg, params, bs, ctx)
            needs.append({"bs": bs, "ctx": ctx, **need})
            T = getattr(args, "positions", 1)
            tokens = [jnp.asarray(rng.integers(0, cfg.vocab_size, (bs, T)), jnp.int32) for _ in range(NUM_SETS)]
            for mode in modes:
                if mode == "dense":
                    call, leaves, note = dense_decode(params, cfg, bs, ctx, tokens, args.seed)
                elif mode == "paged":
                    call, leaves, note = paged_decode(params, cfg, bs, ctx, tokens, args)
                else:
                    call, leaves, note = paged_decode(unstacked, cfg, bs, ctx, tokens, args)
                step_us = median_us(call, args.iters)
                if mode == "paged":
                    profile_calls(args, call, f"paged step of {T} position(s), bs {bs} ctx {ctx}")
                bound_us = need["total"] / args.hbm_bw * 1e6
                rows.append({"cache": mode, "bs": bs, "ctx": ctx, "positions": T, "step_ms": step_us / 1e3,
                             "tokens_per_s": bs / step_us * 1e6, "bound_ms": bound_us / 1e3,
                             "step/bound": step_us / bound_us, "jit_leaves": leaves, "memory": note})
                print(f"step of {T} position(s), {mode} bs {bs} ctx {ctx}: {step_us / 1e3:.3f} ms; {note}")
                del call
                gc.collect()
    keys = [k for k in needs[0] if k not in ("bs", "ctx")]
    print_table(f"MiB one decode step reads, each once (the HBM bound is total / {args.hbm_bw:.3g} B/s)",
                [("bs", "bs", "{}"), ("ctx", "ctx", "{}")] + [(k, k, "{:.1f}") for k in keys],
                [{**n, **{k: n[k] / 2**20 for k in keys}} for n in needs])
    print_table(f"target step (T={getattr(args, 'positions', 1)}) of {args.preset}, random bf16", [
        ("cache", "cache", "{}"), ("bs", "bs", "{}"), ("ctx", "ctx", "{}"), ("step_ms", "ms/step", "{:.3f}"),
        ("tokens_per_s", "tok/s", "{:.0f}"), ("bound_ms", "bound_ms", "{:.3f}"),
        ("step/bound", "step/bound", "{:.2f}"), ("jit_leaves", "jit_leaves", "{}")], rows)
    return {"preset": args.preset, "rows": rows, "bytes": needs, "weight_bytes": weights}


# ---- verify: the target step of a speculative round (k + 1 positions) ------------------------------------------------


def verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, default="E4B")
    p.add_argument("--bs", type=sizes, default=[1, 16])
    p.add_argument("--ctx", type=sizes, default=[4096], help="positions in the cache after the step")
    p.add_argument("-k", type=positive, default=3, help="drafts verified per step (the step runs k + 1 positions)")
    p.add_argument("--chunk", type=positive, default=256, help="prefill chunk: the pool's max_step_tokens")


def run_verify(args) -> dict:
    """One verify step (k + 1 positions per row) over the paged cache, against the HBM bound (the bytes of a decode
    step: weights once, K/V once)."""
    args.positions, args.cache, args.unstacked = args.k + 1, "paged", False
    return run_decode(args)


# ---- e2e: the engine end to end --------------------------------------------------------------------------------------


def e2e_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, default="E4B")
    p.add_argument("--bs", type=sizes, default=[1, 4, 16], help="requests running together (one bucket each)")
    p.add_argument("--modes", default="off,eager,bucketed", help="draft modes to compare")
    p.add_argument("-k", type=positive, default=3)
    p.add_argument("--prompt-len", type=positive, default=1024)
    p.add_argument("--new-tokens", type=positive, default=64)
    p.add_argument("--chunk", type=positive, default=256, help="prefill chunk")
    p.add_argument("--model", help="target checkpoint folder (HF layout) instead of the preset's random weights")
    p.add_argument("--assistant", help="assistant checkpoint folder (with --model)")
    p.add_argument("--prompts", help="with --model: a .jsonl of prompt_ids; row i of a batch takes prompt i (cycled)")
    p.add_argument("--stop-at-eos", action="store_true", help="stop requests at EOS (default: exactly --new-tokens)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default) or fp32 (e.g. for CPU figures)")


def e2e_pair(args):
    """(label, cfg, params, acfg, aparams, prompts(bs)) for the e2e bench: a checkpoint pair or the random preset."""
    from jaxspec.model.weights import compute_dtype

    dtype = compute_dtype(args.dtype)
    if args.model:
        from jaxspec.generate import read_prompts
        from jaxspec.model.weights import load_assistant, load_target

        if not (args.assistant and args.prompts):
            raise ConfigError("--model needs --assistant and --prompts (a .jsonl of prompt_ids)")
        cfg, params = load_target(args.model, dtype)
        acfg, aparams = load_assistant(args.assistant, dtype)
        ids = [p for p, _ in read_prompts(argparse.Namespace(prompt=[], prompts=args.prompts), None)]
        if not ids:
            raise ConfigError(f"no prompts in {args.prompts}")
        args.prompt_len = max(len(p) for p in ids)
        return os.path.basename(os.path.normpath(args.model)), cfg, params, acfg, aparams, \
            lambda bs: [ids[i % len(ids)] for i in range(bs)]
    cfg = target_preset(args.preset)
    acfg = drafter_preset(args.preset, cfg)
    params = random_target_params(cfg, args.seed, dtype=dtype)
    aparams = random_assistant_params(acfg, args.seed + 1, dtype=dtype)
    rng = np.random.default_rng(args.seed)
    return f"{args.preset} random pair", cfg, params, acfg, aparams, \
        lambda bs: [rng.integers(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(bs)]


def run_e2e(args) -> dict:
    """Decode tokens/s, accept length and the per-round time split of the engine (a random preset pair or
    checkpoint folders)."""
    label, cfg, params, acfg, aparams, make_prompts = e2e_pair(args)
    max_context = args.prompt_len + args.new_tokens + args.k + 2
    rows = []
    for bs in args.bs:
        prompts = make_prompts(bs)
        for mode in args.modes.split(","):
            engine = Engine(cfg, params, acfg=acfg, aparams=aparams, k=args.k, draft_mode=mode, buckets=(bs,),
                            max_running=bs, page_size=args.page_size, max_context=max_context,
                            prefill_chunk=args.chunk)
            engine.warmup()
            sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=not args.stop_at_eos)
            requests = [Request(prompt_ids=p, params=sp) for p in prompts]
            profile = args.profile_dir if (mode == "bucketed" and bs == args.bs[0]) else None
            engine.generate(requests, profile_dir=profile)
            s = engine.summary(requests)
            rounds = max(s["rounds"], 1)
            split = {f"{k}_ms_per_round": v / rounds * 1e3 for k, v in s["round_split_s"].items() if k != "prefill"}
            rows.append({"bs": bs, "mode": mode, "k": engine.k, "decode_tokens_per_s": s["decode_tokens_per_s"],
                         "mean_accept_length": s["mean_accept_length"], "rounds": s["rounds"],
                         "acceptance_per_position": s["acceptance_per_position"],
                         "generated_tokens": s["generated_tokens"],
                         "ttft_ms_mean": s["ttft_ms_mean"], **split})
            print(f"e2e bs {bs} {mode}: {s['decode_tokens_per_s']:.1f} tok/s, accept {s['mean_accept_length']:.2f}")
            args.write_partial({"preset": args.preset if not args.model else None, "model": label, "rows": rows})
            del engine
            gc.collect()
    print_table(f"engine end to end, {label}, prompt {args.prompt_len}, {args.new_tokens} new "
                f"tokens (decode tokens/s = sum(predicted_n) / sum(predicted_ms))", [
                    ("bs", "bs", "{}"), ("mode", "mode", "{}"), ("decode_tokens_per_s", "tok/s", "{:.1f}"),
                    ("mean_accept_length", "accept", "{:.2f}"), ("draft_ms_per_round", "draft_ms", "{:.3f}"),
                    ("verify_ms_per_round", "verify_ms", "{:.3f}"),
                    ("verify_dispatch_ms_per_round", "verify_launch_ms", "{:.3f}"),
                    ("host_ms_per_round", "host_ms", "{:.3f}")],
                rows)
    return {"preset": args.preset if not args.model else None, "model": label, "rows": rows}


# ---- trace: summarise a profiler trace -----------------------------------------------------------------------------


def trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="a --profile-dir of generate or `bench e2e` (its newest *.xplane.pb is read)")
    p.add_argument("--top", type=positive, default=15, help="kernels to list")
    p.add_argument("--rounds", type=positive, help="rounds in the trace (default: the calls of the verify "
                   "module; the e2e JSON's `rounds` of the profiled run)")


def run_trace(args) -> dict:
    """The top device kernels and XLA modules of a profiler trace, per round (one round = one verify module)."""
    import glob
    from collections import defaultdict

    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(args.dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise ConfigError(f"no *.xplane.pb under {args.dir}")
    data = ProfileData.from_file(files[-1])
    kernels, modules = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            table = modules if line.name == "XLA Modules" else kernels if line.name.startswith("Stream") else None
            if table is None:
                continue
            for ev in line.events:
                entry = table[ev.name]
                entry[0] += 1
                entry[1] += ev.duration_ns / 1e3
    rounds = args.rounds or max((n for name, (n, _) in modules.items() if "verify" in name), default=0)
    if not rounds:  # the trace has no module line: totals, unless --rounds says how many rounds it holds
        print("note: no XLA module line in the trace: figures are totals (pass --rounds N for per-round)")
        rounds = 1
    total = sum(t for _, t in kernels.values()) or 1.0
    launches = sum(n for n, _ in kernels.values()) / rounds
    krows = [{"kernel": name[:90], "calls": n, "us_per_round": t / rounds, "share": t / total}
             for name, (n, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]]
    mrows = [{"module": name[:90], "calls": n, "us_per_round": t / rounds}
             for name, (n, t) in sorted(modules.items(), key=lambda kv: -kv[1][1])]
    print_table(f"XLA modules of {files[-1]} ({rounds} rounds)",
                [("module", "module", "{}"), ("calls", "calls", "{}"), ("us_per_round", "us/round", "{:.1f}")], mrows)
    print_table(f"top {args.top} device kernels (all kernels: {total / rounds:.1f} us/round in {launches:.0f} "
                f"launches/round)",
                [("kernel", "kernel", "{}"), ("calls", "calls", "{}"), ("us_per_round", "us/round", "{:.1f}"),
                 ("share", "share", "{:.1%}")], krows)
    return {"trace": files[-1], "rounds": rounds, "kernel_us_per_round": total / rounds,
            "kernel_launches_per_round": launches, "modules": mrows,
            "kernels": krows}


# ---- memory -------------------------------------------------------------------------------------------------------


def memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, default="E4B")
    p.add_argument("--ctx", type=sizes, default=[4096, 32768, 131072])
    p.add_argument("-k", type=positive, default=3, help="draft steps: a verify step writes k + 1 positions")
    p.add_argument("--chunk", type=positive, default=256, help="prefill chunk")


def run_memory(args) -> dict:
    """KV bytes per request (bf16) with the SWA pool vs every non-shared layer keeping all positions."""
    cfg = target_preset(args.preset)
    P, W = args.page_size, cfg.sliding_window
    per_position = {t: len(cfg.kv_layers[t]) * cfg.type_kv_heads(t) * cfg.type_head_dim(t) * 2
                    * jnp.dtype(DTYPE).itemsize for t in LAYER_TYPES}
    rows = []
    for ctx in args.ctx:
        pages = -(-ctx // P)
        without = pages * P * (per_position[FULL] + per_position[SLIDING])
        for step_name, step in ((f"verify {args.k + 1}", args.k + 1), (f"chunk {args.chunk}", args.chunk)):
            swa_pages = min(pages, swa_pages_bound_for(page_size=P, swa_keep=W + 1, max_step_tokens=step))
            full, sliding = pages * P * per_position[FULL], swa_pages * P * per_position[SLIDING]
            rows.append({"ctx": ctx, "step": step_name, "max_step_tokens": step, "swa_pages": swa_pages,
                         "full_bytes": full, "sliding_bytes": sliding, "with_swa_bytes": full + sliding,
                         "without_swa_bytes": without, "without/with": without / (full + sliding)})
    mib = lambda k: (k, k.replace("_bytes", "_MiB"), "{:.1f}")  # noqa: E731
    print_table(f"KV bytes per request, {args.preset} (bf16, page {P}, W {W}): SWA pool vs all positions in every "
                "non-shared layer", [("ctx", "ctx", "{}"), ("step", "step", "{}"), ("swa_pages", "swa_pages", "{}"),
                                     mib("full_bytes"), mib("sliding_bytes"), mib("with_swa_bytes"),
                                     mib("without_swa_bytes"), ("without/with", "without/with", "{:.2f}")],
                [{**r, **{k: r[k] / 2**20 for k in r if k.endswith("_bytes")}} for r in rows])
    return {"preset": args.preset, "per_position_bytes": per_position, "rows": rows}


# ---- command line -------------------------------------------------------------------------------------------------

# name -> (add its options, run it)
SUBCOMMANDS = {
    "kernels": (kernels_args, run_kernels),
    "propose": (propose_args, run_propose),
    "decode": (decode_args, run_decode),
    "verify": (verify_args, run_verify),
    "e2e": (e2e_args, run_e2e),
    "memory": (memory_args, run_memory),
    "trace": (trace_args, run_trace),
}


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def sizes(text: str) -> list[int]:
    """'1,16,64' or '4K,128K' (K = 1024) -> a list of positive ints."""
    try:
        out = [int(s[:-1]) * 1024 if s[-1] in "kK" else int(s) for s in text.split(",")]
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected sizes such as 1,16,64 or 4K,32K, got {text!r}") from None
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--iters", type=positive, default=100, help="timed calls per figure (>= 50 for results)")
    common.add_argument("--json", help="where to write the results (default bench/results/<subcommand>-<time>.json)")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--page-size", type=positive, default=16)
    common.add_argument("--profile-dir", help="write a jax profiler trace here: propose / decode / verify trace 20 "
                        "calls of the first bucketed or paged figure (`python -m jaxspec.bench trace DIR --rounds "
                        "20`), e2e the first bs's bucketed run (`... trace DIR`); set XLA_FLAGS=--xla_enable_command_"
                        "buffers_during_profiling=true to keep the CUDA graphs as production runs them")
    common.add_argument("--hbm-bw", type=float, default=HBM_BYTES_PER_S, help="HBM bytes/s of the bound")
    parser = argparse.ArgumentParser(prog="python -m jaxspec.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="subcommand", required=True)
    for name, (add_args, run) in SUBCOMMANDS.items():
        add_args(sub.add_parser(name, parents=[common], help=run.__doc__.split("\n")[0]))
    return parser


def main(argv=None) -> dict:
    """Run one subcommand, print its tables, write its JSON; returns what was written."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    _, run = SUBCOMMANDS[args.subcommand]
    command = shlex.join([os.path.basename(sys.executable), "-m", "jaxspec.bench", *argv])
    path = args.json or os.path.join(
        "bench", "results", f"{args.subcommand}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def write(result: dict, partial: bool = False) -> dict:
        record = {"subcommand": args.subcommand, "command": command, **environment(), "iters": args.iters,
                  "hbm_bytes_per_s": args.hbm_bw, **({"partial": True} if partial else {}), **result}
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        return record

    args.write_partial = lambda result: write(result, partial=True)  # long runs save each row as it lands
    try:
        result = run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    record = write(result)
    print(f"\nwrote {path}")
    return record


if __name__ == "__main__":
    main()

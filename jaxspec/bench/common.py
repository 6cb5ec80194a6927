"""What every `jaxspec.bench` subcommand measures with: timing, tables, the result JSON and random device state.

Latency is the median over --iters calls of the wall time of `fn(...)` + `jax.block_until_ready`, after one warm-up
call (compile) on each of the input sets the calls rotate through, so that a small working set is not served from
L2. Timings never belong in tests.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxspec.config import CLIENT_ENV, PRESETS, SWITCHES, ConfigError, TargetConfig
from jaxspec.paged_kv.cache import LayerKV, PagedKVCache
from jaxspec.paged_kv.pool import swa_pages_bound_for

DTYPE = jnp.bfloat16
HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
NUM_SETS = 3  # input sets the timed calls rotate through
SLACK_PAGES = 8
ROTATE_ROWS_UP_TO = 16  # batches up to this size read disjoint requests per input set (their K/V could sit in L2)

# "tiny": E4B's structure (PLE, KV sharing, both layer types, centroid drafter head) at sizes a CPU compiles in
# seconds; the others are the public sizes. `jaxspec.config.bench_pair(name)` gives a preset's (target, drafter).
PRESET_NAMES = ("tiny", *PRESETS)


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


def median_back_to_back_us(call, iters: int, num_sets: int = NUM_SETS, calls: int = 8) -> float:
    """Median wall time in µs a call of `calls` calls issued back to back, waiting only for the last (a call's
    inputs chain through the state `call` keeps, the K/V cache, as the engine's overlapped calls do): the host
    dispatches each call while the device runs the one before, so the figure is the device's pace, not a call's
    dispatch plus its sync (`median_us`). `iters` groups, after one warm-up call per set."""
    for i in range(num_sets):
        jax.block_until_ready(call(i))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        outs = [call(n % num_sets) for n in range(calls)]
        jax.block_until_ready(outs[-1])
        times.append((time.perf_counter() - t0) / calls)  # the others ran before it (one stream; some donated)
    return float(np.median(times)) * 1e6


def median_dispatch_us(call, iters: int, num_sets: int = NUM_SETS) -> float:
    """Median host time in µs until `call(i)` returns (the launch; the result is waited for outside the timing)."""
    times = []
    for n in range(iters):
        t0 = time.perf_counter()
        out = call(n % num_sets)
        times.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return float(np.median(times)) * 1e6


def profile_calls(args, call, label: str, calls: int = 20) -> dict:
    """With --profile-dir: record `calls` more calls of the first figure asked for into a profiler trace (once per
    run; summarise with `python -m jaxspec.bench trace DIR --rounds {calls}`), and return their figures per call for
    the traced row (`trace.call_figures`: kernels, copies, kernel µs; None where the trace holds no device kernels, as
    on the CPU); {} when nothing was traced. Call it once every figure of the row is timed: on the H200 calls timed
    after a trace can run slower (session 20: the same propose 570.0 µs timed before a trace, 821.9 after one, in one
    call), so rows timed later say so (`after_trace`)."""
    from jaxspec.bench import trace  # it imports this module

    if not getattr(args, "profile_dir", None) or getattr(args, "profiled", None):
        return {}
    jax.block_until_ready(call(0))
    jax.profiler.start_trace(args.profile_dir)
    for n in range(calls):
        jax.block_until_ready(call(n % NUM_SETS))
    jax.profiler.stop_trace()
    args.profiled = label
    print(f"profiled {calls} calls of {label} into {args.profile_dir}")
    try:
        figures = trace.call_figures(trace.newest_trace(args.profile_dir), calls)
    except ConfigError as e:
        print(f"note: {e}")
        return {"traced_calls": calls, **dict.fromkeys(trace.CALL_FIGURES)}
    print(f"trace: {figures['traced_kernels_per_call']:.1f} kernels a call "
          f"({figures['traced_kernel_us_per_call']:.1f} us), {figures['traced_copies_per_call']:.1f} copies")
    if figures["traced_span_us_per_call"] is not None:
        between = figures["traced_idle_between_calls_us"]
        print(f"trace: a call spans {figures['traced_span_us_per_call']:.1f} us on the device, "
              f"{figures['traced_idle_in_call_us']:.1f} us of it without a kernel; "
              f"{'-' if between is None else f'{between:.1f}'} us idle between calls")
    return figures


def after_trace(args) -> bool:
    """Whether this run traced calls already (`profile_calls`): a figure timed now may be slower than untraced."""
    return bool(getattr(args, "profiled", None))


@jax.jit
def dispatch_floor(*args):
    """The cheapest call on a figure's own arguments: the dispatch + sync cost that every figure of its row includes
    (on a virtualised host tens of µs, more than a small kernel runs)."""
    return min(args, key=lambda a: a.size) + 1


def ratio(a, b):
    return None if a is None or b is None else a / b


def print_table(title: str, columns, rows) -> None:
    """columns: (key, header, format); a None value prints as '-'."""
    cells = [["-" if r.get(k) is None else fmt.format(r[k]) for k, _, fmt in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_note(kv) -> str:
    """K/V bytes held and, where the backend reports it, device memory in use and its peak."""
    note = f"K/V arrays {gib(sum(a.nbytes for a in jax.tree.leaves(kv)))}"
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_in_use" in stats:
        note += f"; device in use {gib(stats['bytes_in_use'])}, peak {gib(stats.get('peak_bytes_in_use', 0))}"
    return note


def environment() -> dict:
    device = jax.devices()[0]
    return {"jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__, "backend": jax.default_backend(),
            "device_kind": device.device_kind, "device_count": jax.device_count(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "switches": {name: os.environ[name] for name in SWITCHES if name in os.environ},
            "client_env": {name: os.environ[name] for name in CLIENT_ENV if name in os.environ}}


def command_line(argv) -> str:
    """How a result was made, as one shell line (goals.py re-reads it: keep `-m jaxspec.bench` in it)."""
    return shlex.join([os.path.basename(sys.executable), "-m", "jaxspec.bench", *argv])


class ResultFile:
    """The JSON of one run (--json; default bench/results/<subcommand>-<time>.json): the command line, the
    environment and the result, rewritten as rows land so that a long run that dies keeps what it measured."""

    def __init__(self, args):
        self.args = args
        self.path = args.json or os.path.join(
            "bench", "results", f"{args.subcommand}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)

    def write(self, result: dict, partial: bool = False) -> dict:
        args = self.args
        record = {"subcommand": args.subcommand, "command": args.command, **environment(), "iters": args.iters,
                  "hbm_bytes_per_s": args.hbm_bw, **({"partial": True} if partial else {}), **result}
        with open(self.path, "w") as f:
            json.dump(record, f, indent=1)
        return record


# ---- random state on the device --------------------------------------------------------------------------------------


@functools.partial(jax.jit, donate_argnums=0)
def _fill_layer(stack, key, layer):
    return stack.at[layer].set(jax.random.normal(key, stack.shape[1:], stack.dtype))


def randomize(kv: dict, seed: int) -> None:
    """Random values in every K/V stack [L, ...] of `kv` ({type: LayerKV}), in place, one layer at a time (a 64 x
    32K E4B cache has 17 GB stacks: drawing a whole one at once would need that much again)."""
    key = jax.random.PRNGKey(seed)
    for n, t in enumerate(sorted(kv)):
        stacks = {}
        for m, (name, stack) in enumerate(sorted(vars(kv[t]).items())):
            for layer in range(stack.shape[0]):
                stack = _fill_layer(stack, jax.random.fold_in(key, 1000 * (2 * n + m) + layer), layer)
            stacks[name] = stack
        kv[t] = LayerKV(**stacks)


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
    randomize(cache.kv, seed)
    return cache, rids


def request_groups(bs_list) -> int:
    """Requests to allocate: the largest batch, or three disjoint groups of the largest batch that may fit in L2."""
    small = [b for b in bs_list if b <= ROTATE_ROWS_UP_TO]
    return max(max(bs_list), NUM_SETS * max(small, default=0))


# ---- argument types ----------------------------------------------------------------------------------------------


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def names_from(allowed: tuple[str, ...]):
    """An argument type: a comma-separated list of names, each one of `allowed`, in the order given."""
    def parse(text: str) -> list[str]:
        words = text.split(",")
        if not words or not set(words) <= set(allowed):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed)}, got {text!r}")
        return words
    return parse


def sizes(text: str) -> list[int]:
    """'1,16,64' or '4K,128K' (K = 1024) -> a list of positive ints."""
    try:
        out = [int(s[:-1]) * 1024 if s[-1] in "kK" else int(s) for s in text.split(",")]
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected sizes such as 1,16,64 or 4K,32K, got {text!r}") from None
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return out

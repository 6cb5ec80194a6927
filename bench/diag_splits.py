"""Diagnosis (issues #14/#17): how many pieces should a row's keys be cut into (their partials merged by a second
kernel), at the 270M pair's shapes?

One jitted program applies `paged_attention_rows` L times in a chain (each layer's output is the next one's query, so
the launches run one after another inside one graph, as in a decode step), for each piece count of --splits (0: the
default rule, `default_splits`; 1: one kernel, nothing to merge). Reported: µs a layer per (width, live keys,
queries), and the largest difference from the one-piece output. Shapes: head_dim 256, one kv head, four query heads
(Gemma 3 270M and its drafter), one row; --head-dim / --kv-heads / --group for others (E4B's global layers: 512, 2,
4). --tunings adds the default piece count with other kernel knobs (block_k, num_warps, num_stages, and optionally
the pieces' granule and the real rows only: bk64w8st1g32r), --real-rows the default with only the real query rows'
partials stored and merged (`paged_attention_rows(real_rows=...)`) against all of them, in one process. (Until
session 37 it also ran the merge inside the attention kernel and the pipelined key walk, since removed: commit
a536233 has them.)

    python bench/diag_splits.py --splits 1,2,4,8,16,0 --json OUT.json
    python bench/diag_splits.py --head-dim 512 --kv-heads 2 --cases 4096:4096 --tq 1,4 --splits 0 --real-rows \
        --tunings bk16w4st1,bk32w4st1,bk16w8st2 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.pallas.paged_attention import (default_block_k, default_splits, paged_attention_rows, query_rows,
                                            row_ranges)

def median_us(run, inputs, iters: int) -> float:
    """Median wall time of a call in µs, the result waited for."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*inputs))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def chain(layers: int, num_splits, **kw):
    """kw: `paged_attention_rows`' knobs (block_k, num_warps, num_stages, real_rows)."""
    @jax.jit
    def run(q_rows, k, v, idx, kv_start, row_lo, row_hi, span):
        for _ in range(layers):
            q_rows = paged_attention_rows(q_rows, k, v, idx, kv_start, row_lo, row_hi, span,
                                          scale=q_rows.shape[-1] ** -0.5, num_splits=num_splits,
                                          **kw)  # one Triton compile for every layer
        return q_rows
    return run


def tunings(text: str) -> list[tuple[str, dict]]:
    """Kernel knobs, e.g. bk16w4st1,bk64w8st1g32r: block_k, num_warps, num_stages, then optionally g<granule> (pieces
    cut at multiples of it) and r (only the real query rows' partials); "" for none. [(token, knobs)]; the
    `real_rows` count is filled in per shape (True here)."""
    out = []
    for token in filter(None, text.split(",")):
        m = re.fullmatch(r"bk(\d+)w(\d+)st(\d+)(?:g(\d+))?(r)?", token)
        if m is None:
            raise argparse.ArgumentTypeError(f"expected tokens like bk16w4st1 or bk64w8st1g32r (block_k, num_warps, "
                                             f"num_stages, [g granule], [r: real rows]), got {token!r}")
        kw = dict(block_k=int(m[1]), num_warps=int(m[2]), num_stages=int(m[3]))
        if m[4]:
            kw["granule"] = int(m[4])
        if m[5]:
            kw["real_rows"] = True
        out.append((token, kw))
    return out


def cases(text: str) -> list[tuple[int, int]]:
    """width:live pairs, e.g. 512:200,4096:1024 (live keys at most the width)."""
    try:
        pairs = [tuple(int(x) for x in case.split(":")) for case in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(c) != 2 or not 0 < c[1] <= c[0] for c in pairs):
        raise argparse.ArgumentTypeError(f"expected width:live pairs with 0 < live <= width, got {text!r}")
    return pairs


def sizes(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers, e.g. 1,5; got {text!r}")
    return values


def counts(text: str) -> list[int]:
    """Piece counts, e.g. 1,2,4,0 (0: the default rule); "" for none."""
    try:
        values = [int(x) for x in text.split(",")] if text else []
    except ValueError:
        values = [-1]
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 0 (0: the default rule), e.g. 1,2,0; got {text!r}")
    return values


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=positive, default=16)
    p.add_argument("--iters", type=positive, default=200)
    p.add_argument("--cases", type=cases, default="512:200,512:512,4096:200,4096:1024,4096:4096",
                   help="width:live pairs")
    p.add_argument("--tq", type=sizes, default="1,5", help="queries per row")
    p.add_argument("--splits", type=counts, default="1,0", help="piece counts, a column each (0: the default rule)")
    p.add_argument("--wide-splits", type=counts, default="", help="piece counts also run with 64-key blocks (the default for "
                   "head_dim 256 is 32), with the merge kernel")
    p.add_argument("--tunings", type=tunings, default="", help="the default piece count with other kernel knobs, a "
                   "column each: bk<block_k>w<num_warps>st<num_stages>[g<granule>][r], e.g. bk16w4st1,bk64w8st1g32r "
                   "(r: only the real rows' partials)")
    p.add_argument("--real-rows", action="store_true", help="also the default piece count with only the real query "
                   "rows' partials stored and merged (real_rows = tq x group); the other columns store every row's")
    p.add_argument("--head-dim", type=positive, default=256)
    p.add_argument("--kv-heads", type=positive, default=1)
    p.add_argument("--group", type=positive, default=4, help="query heads a kv head")
    p.add_argument("--json")
    args = p.parse_args(argv)
    D, KVH, G = args.head_dim, args.kv_heads, args.group
    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(0)
    slots = 8192
    k = jax.random.normal(key, (slots, KVH, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), (slots, KVH, D), jnp.bfloat16)
    rows = []
    for width, live in args.cases:
        idx = jnp.asarray(rng.permutation(slots)[:width][None].astype(np.int32))
        kv_start = jnp.zeros(1, jnp.int32)
        for tq in args.tq:
            block_q, padded = query_rows(tq, G, D, None)
            q_lo = jnp.zeros((1, tq), jnp.int32)
            q_hi = (live - tq + jnp.arange(tq, dtype=jnp.int32))[None]
            row_lo, row_hi, span = row_ranges(kv_start, q_lo, q_hi, G, padded, width)
            q = jax.random.normal(jax.random.fold_in(key, 2), (1, KVH, padded, D), jnp.bfloat16)
            inputs = (q, k, v, idx, kv_start, row_lo, row_hi, span)
            default = default_splits(1, KVH, padded // block_q, width, default_block_k(D))
            row = {"width": width, "live": live, "tq": tq, "layers": args.layers, "default_splits": default,
                   "head_dim": D, "kv_heads": KVH, "group": G}
            ref = np.asarray(chain(args.layers, 1)(*inputs), np.float32)
            variants = [(x, {}, "kernel") for x in args.splits]
            variants += [(x, dict(block_k=64), "bk64_kernel") for x in args.wide_splits]
            variants += [(0, {**kw, **({"real_rows": tq * G} if kw.get("real_rows") else {})}, f"{token}_kernel")
                         for token, kw in args.tunings]
            if args.real_rows:
                variants.append((0, dict(real_rows=tq * G), "real_rows_kernel"))
            diff = 0.0
            for splits, kw, tag in variants:
                run = chain(args.layers, splits or None, **kw)
                diff = max(diff, float(np.max(np.abs(np.asarray(run(*inputs), np.float32) - ref))))
                row[f"s{splits or 'default'}_{tag}_us_per_layer"] = median_us(run, inputs, args.iters) / args.layers
            row["max_abs_diff"] = diff
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python bench/diag_splits.py " + " ".join(sys.argv[1:]),
                       "device_kind": jax.devices()[0].device_kind,
                       "jax_version": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

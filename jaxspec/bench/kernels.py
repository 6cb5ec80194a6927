"""`bench kernels`: the two Pallas kernels of the decode path against what they replace.

gather_kv_indices (the live window's K/V slots of each row) vs a whole-row translation of the page table, and
paged_attention vs paged_attention_ref (an XLA gather + attention), against the HBM bound of the K/V it reads.
"""

from __future__ import annotations

import argparse
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.common import DTYPE, NUM_SETS, dispatch_floor, median_us, positive, print_table, sizes
from jaxspec.config import ConfigError
from jaxspec.paged_kv.metadata import round_width
from jaxspec.paged_kv.pool import swa_pages_bound_for
from jaxspec.pallas.kv_indices import gather_kv_indices
from jaxspec.pallas.paged_attention import paged_attention, paged_attention_ref

ATTN_HEADS, ATTN_KV_HEADS = 8, 2  # E4B: 8 query heads over 2 KV heads in both layer types


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


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=("gather", "attention", "all"), default="all")
    p.add_argument("--bs", type=sizes, help="batch sizes (default: gather 1,64; attention 1,16,64)")
    p.add_argument("--table", type=sizes, default=[4096, 131072], help="gather: page-table row length in positions")
    p.add_argument("--window", type=positive, default=512, help="gather: sliding window W (W + 1 live entries)")
    p.add_argument("--ctx", type=sizes, default=[4096, 32768], help="attention: cached keys per row")
    p.add_argument("--head-dim", type=sizes, default=[256, 512], help="attention: head_dim (8 q heads, 2 kv heads)")
    p.add_argument("--tq", type=sizes, default=[1, 4], help="attention: queries per row (1 decode/draft, k+1 verify)")
    p.add_argument("--knobs", type=knob_list, default=[], help="attention: the kernel also timed with these knobs, a "
                   "column each, e.g. bk32w8st1,bk16w4st2s8: block_k, num_warps, num_stages, then optionally s<pieces "
                   "of each row's keys> (default: the kernel's own rule)")


KNOB_RE = re.compile(r"bk(\d+)w(\d+)st(\d+)(?:s(\d+))?")


def knob_list(text: str) -> list[tuple[str, dict]]:
    """'bk32w8st1,bk16w4st2s8' -> [(token, paged_attention's knobs)]: block_k, num_warps, num_stages and optionally
    num_splits (s<n>); block_k and the piece count are checked by the kernel itself."""
    out = []
    for token in text.split(","):
        m = KNOB_RE.fullmatch(token)
        if not m:
            raise argparse.ArgumentTypeError(f"knobs look like bk32w8st1 or bk16w4st2s8, got {token!r}")
        block_k, warps, stages, splits = m.groups()
        knobs = {"block_k": int(block_k), "num_warps": int(warps), "num_stages": int(stages)}
        if splits:
            knobs["num_splits"] = int(splits)
        out.append((token, knobs))
    return out


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
                    def call(fn, i, kv=(k_cache, v_cache, indices)):  # one input set's call of fn
                        return fn(qs[i], kv[0], kv[1], kv[2][i], kv_start, q_lo, q_hi)

                    for name, fn in (("floor_us", dispatch_floor), ("kernel_us", paged_attention), ("ref_us", ref)):
                        row[name] = median_us(functools.partial(call, fn), args.iters)
                    for token, knobs in args.knobs:  # the same call with other knobs: its time and its output
                        fn = functools.partial(paged_attention, **knobs)
                        row[f"{token}_us"] = median_us(functools.partial(call, fn), args.iters)
                        row[f"{token}_max_abs_diff"] = float(jnp.max(jnp.abs(
                            call(fn, 0).astype(jnp.float32) - call(paged_attention, 0).astype(jnp.float32))))
                    row["ref/kernel"] = row["ref_us"] / row["kernel_us"]
                    row["kernel/bound"] = row["kernel_us"] / row["bound_us"]
                    row["ref/bound"] = row["ref_us"] / row["bound_us"]
                    rows.append(row)
                    print(f"attention d {d} bs {bs} ctx {ctx} tq {tq}: {row['kernel_us']:.1f} vs "
                          f"{row['ref_us']:.1f} µs" + "".join(f"; {t} {row[t + '_us']:.1f}" for t, _ in args.knobs))
                del k_cache, v_cache, indices
    print_table(f"paged_attention ({ATTN_HEADS} q / {ATTN_KV_HEADS} kv heads, all cached keys, bf16) vs XLA gather + "
                f"attention; HBM bound = K/V bytes / {args.hbm_bw:.3g} B/s", [
                    ("head_dim", "d", "{}"), ("bs", "bs", "{}"), ("ctx", "ctx", "{}"), ("tq", "tq", "{}"),
                    ("floor_us", "floor_us", "{:.1f}"), ("kernel_us", "kernel_us", "{:.1f}"),
                    ("ref_us", "ref_us", "{:.1f}"), ("ref/kernel", "ref/kernel", "{:.2f}"),
                    ("bound_us", "bound_us", "{:.1f}"), ("kernel/bound", "kernel/bound", "{:.2f}"),
                    ("ref/bound", "ref/bound", "{:.2f}")], rows)
    return rows


def run(args) -> dict:
    """gather_kv_indices vs whole-row translation; paged_attention vs paged_attention_ref (XLA gather + attention)."""
    rng = np.random.default_rng(args.seed)
    return {"gather": gather_rows(args, rng) if args.part in ("gather", "all") else [],
            "attention": attention_rows(args, rng) if args.part in ("attention", "all") else []}

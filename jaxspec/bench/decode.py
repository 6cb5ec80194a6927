"""`bench decode` and `bench verify`: one target step over the cache against the HBM bound.

decode: one position per row (T = 1) over the dense cache and the paged cache (Pallas kernels). verify: the step of a
speculative round, k + 1 positions per row over the paged cache. The bound is the bytes the step must read once
(every weight, the K/V of every layer) over the HBM bandwidth; a row's `step/bound` is how far the step is from it.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import staging
from jaxspec.bench.common import (DTYPE, NUM_SETS, PRESET_NAMES, after_trace, gib, median_back_to_back_us, median_us,
                                  memory_note, names_from, paged_cache, positive, print_table, profile_calls,
                                  randomize, sizes)
from jaxspec.config import LAYER_TYPES, SLIDING, TargetConfig, bench_pair
from jaxspec.model import gemma4
from jaxspec.model.weights import random_target_params
from jaxspec.paged_kv.metadata import PageTables, step_metadata


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "staged"), donate_argnums=(1,))
def paged_decode_step(params, kv, pages: PageTables, tokens, cached_len, num_new, *, cfg, spec, staged=False):
    """One target step over the paged cache (Pallas kernels) -> (fp32 logits of the last position [B, V], kv).
    staged: the step's per-call inputs (tokens, lengths, page table) copied into one buffer of its own first
    (`jaxspec.staging`, as the engine's programs do unless JAXSPEC_STAGE_INPUTS=0)."""
    words = None
    if staged:
        (tokens, cached_len, num_new), pages, words = staging.stage_step((tokens, cached_len, num_new), pages)
    meta = step_metadata(cfg, spec, pages, cached_len, num_new, tokens.shape[1], use_kernels=True)
    hidden, kv = gemma4.paged_forward(params, cfg, kv, meta, tokens, use_kernels=True)
    return staging.hold(gemma4.logits(params, cfg, hidden[:, -1]), words), kv


@functools.partial(jax.jit, static_argnames=("cfg", "spec"), donate_argnums=(1, 2), keep_unused=True)
def paged_decode_step_into(params, kv, logits_out, pages: PageTables, tokens, cached_len, num_new, *, cfg, spec):
    """paged_decode_step writing its logits into the donated buffer of the last call's (`--cache paged-stable`)."""
    del logits_out  # its buffer holds this call's logits (jax aliases the donated input to the output of its shape)
    return paged_decode_step(params, kv, pages, tokens, cached_len, num_new, cfg=cfg, spec=spec)


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


CACHES = ("dense", "paged", "paged-stable", "paged-staged")


def step_args(p: argparse.ArgumentParser) -> None:
    """The options decode and verify share."""
    p.add_argument("--preset", choices=PRESET_NAMES, default="E4B")
    p.add_argument("--bs", type=sizes, default=[1, 16])
    p.add_argument("--ctx", type=sizes, default=[4096], help="positions in the cache after the step")
    p.add_argument("--chunk", type=positive, default=256, help="prefill chunk: the pool's max_step_tokens")


def add_args(p: argparse.ArgumentParser) -> None:
    step_args(p)
    p.add_argument("--cache", type=names_from(CACHES + ("both",)), default="both",
                   help="dense, paged (the Pallas kernels), paged-stable (the paged step as the engine calls its "
                   "programs: its inputs the same device buffers every call, its output written into the buffer "
                   "its last call returned, so that XLA need not re-record the CUDA graph's nodes for moved "
                   "buffers), paged-staged (paged, called as paged is, its per-call inputs copied into one buffer "
                   "of the step's own first, as paged does unless JAXSPEC_STAGE_INPUTS=0); both = dense,paged")
    p.add_argument("--unstacked", action="store_true", help="also time the paged step with per-layer weight leaves "
                   "(one array per layer instead of one stack per layer group)")


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


def paged_decode(params, cfg: TargetConfig, bs: int, ctx: int, tokens, args, stable: bool = False,
                 staged: bool = False):
    """The same step over a paged cache through the Pallas kernels: each request holds ctx - T positions and the
    step writes the last T (T = 1: decode; T = k + 1: a verify step). stable: every call reads the first token set
    and writes its logits into the buffer the call before returned (donated). staged: paged_decode_step's `staged`."""
    T = tokens[0].shape[1]
    cache, rids = paged_cache(cfg, bs, ctx - T, max_context=ctx, page_size=args.page_size,
                              max_step_tokens=max(args.chunk, T), seed=args.seed)
    for rid in rids:
        cache.pool.prepare(rid, ctx - T, ctx)
    pages = PageTables(page_table=jnp.asarray(cache.pool.page_table(rids)), swa_of_full=cache.swa_of_full)
    cached_len, num_new = jnp.full(bs, ctx - T, jnp.int32), jnp.full(bs, T, jnp.int32)
    box = [cache.kv, jnp.zeros((bs, cfg.vocab_size), jnp.float32) if stable else None]

    def call(i):
        if stable:
            box[1], box[0] = paged_decode_step_into(params, box[0], box[1], pages, tokens[0], cached_len, num_new,
                                                    cfg=cfg, spec=cache.spec)
            return box[1]
        logits, box[0] = paged_decode_step(params, box[0], pages, tokens[i], cached_len, num_new, cfg=cfg,
                                           spec=cache.spec, staged=staged)
        return logits

    leaves = len(jax.tree.leaves((params, box[0], pages, tokens[0], cached_len, num_new)))
    return call, leaves, memory_note(box[0])


def run(args) -> dict:
    """One target decode step (T=1): dense cache vs paged cache (Pallas kernels), against the HBM bound."""
    cfg = bench_pair(args.preset)[0]
    params = gemma4.stored_params(random_target_params(cfg, args.seed, dtype=DTYPE))  # as the engine keeps them
    weights = sum(a.nbytes for a in jax.tree.leaves(params))
    print(f"{args.preset}: weights {gib(weights)} in {len(jax.tree.leaves(params))} leaves")
    rng = np.random.default_rng(args.seed)
    modes = tuple(m for c in args.cache for m in (("dense", "paged") if c == "both" else (c,)))
    if args.unstacked:
        modes += ("paged-unstacked",)
        unstacked = dict(params, layers={g: {n: tuple(a[i] for i in range(a.shape[0])) for n, a in w.items()}
                                         for g, w in params["layers"].items()})
    rows, needs, first = [], [], {}
    staged_env = staging.enabled()  # paged follows the switch, as the engine's programs do
    for ctx in args.ctx:
        for bs in args.bs:
            need = decode_bytes(cfg, params, bs, ctx)
            needs.append({"bs": bs, "ctx": ctx, **need})
            T = getattr(args, "positions", 1)
            tokens = [jnp.asarray(rng.integers(0, cfg.vocab_size, (bs, T)), jnp.int32) for _ in range(NUM_SETS)]
            traced, traced_row = None, None
            for mode in modes:
                if mode == "dense":
                    call, leaves, note = dense_decode(params, cfg, bs, ctx, tokens, args.seed)
                elif mode in ("paged", "paged-stable", "paged-staged"):
                    call, leaves, note = paged_decode(params, cfg, bs, ctx, tokens, args,
                                                      stable=mode == "paged-stable",
                                                      staged=mode == "paged-staged" or (mode == "paged" and staged_env))
                else:
                    call, leaves, note = paged_decode(unstacked, cfg, bs, ctx, tokens, args)
                step_us = median_us(call, args.iters, num_sets=1 if mode == "paged-stable" else NUM_SETS)
                # the same step issued back to back (the engine's overlapped calls): the device's pace
                chained_us = median_back_to_back_us(call, max(1, args.iters // 8),
                                                    num_sets=1 if mode == "paged-stable" else NUM_SETS)
                same = None
                if mode in ("paged", "paged-stable", "paged-staged"):  # logits of the first token set, bit for bit
                    logits = np.asarray(call(0))
                    first.setdefault((bs, ctx), logits)
                    same = bool(np.array_equal(first[(bs, ctx)], logits))
                bound_us = need["total"] / args.hbm_bw * 1e6
                rows.append({"cache": mode, "bs": bs, "ctx": ctx, "positions": T, "step_ms": step_us / 1e3,
                             "tokens_per_s": bs / step_us * 1e6, "bound_ms": bound_us / 1e3,
                             "step/bound": step_us / bound_us, "back_to_back_step_ms": chained_us / 1e3,
                             "back_to_back/bound": chained_us / bound_us, "jit_leaves": leaves, "memory": note,
                             "same_logits_as_first_paged": same, "after_trace": after_trace(args)})
                if mode == "paged":  # traced once every mode of this shape is timed (common.profile_calls)
                    traced, traced_row = call, rows[-1]
                print(f"step of {T} position(s), {mode} bs {bs} ctx {ctx}: {step_us / 1e3:.3f} ms "
                      f"(back to back {chained_us / 1e3:.3f} ms); {note}")
                del call  # this figure's K/V (GiBs at bs 16) goes before the next figure allocates its own
            if traced is not None:
                traced_row.update(profile_calls(args, traced, f"paged step of {T} position(s), bs {bs} ctx {ctx}"))
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


def add_verify_args(p: argparse.ArgumentParser) -> None:
    step_args(p)
    p.add_argument("-k", type=positive, default=3, help="drafts verified per step (the step runs k + 1 positions)")
    p.add_argument("--cache", type=names_from(("paged", "paged-stable", "paged-staged")), default="paged",
                   help="paged, paged-stable, paged-staged: as decode's --cache")


def run_verify(args) -> dict:
    """One verify step (k + 1 positions per row) over the paged cache, against the HBM bound (the bytes of a decode
    step: weights once, K/V once)."""
    args.positions, args.unstacked = args.k + 1, False
    return run(args)

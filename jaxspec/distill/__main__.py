"""`python -m jaxspec.distill`: train a `gemma4_assistant` drafter for a frozen target on the target's own greedy
(and, with --sampled-copies, sampled) continuations, with exactly the objective the drafter is used with (DESIGN.md
§3; the method: `jaxspec.distill`).

Outputs: the HF assistant folder (--out, bf16, loads with `load_assistant`), its packed form for shipping
(`jaxspec.model.packed`, --packed-out) and distill.json (hyperparameters, data sizes, final metrics).
Bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import sys
import time

import jax
import numpy as np

from jaxspec import corpus
from jaxspec.cli import Parser, run_cli
from jaxspec.config import ConfigError, TargetConfig, check_pair
from jaxspec.distill.data import (build_dataset, draft_targets, greedy_continuations, kept_vocabulary,
                                  load_continuations, sampled_continuations, save_continuations)
from jaxspec.distill.export import export_params, kept_view, save_hf_folder, write_report
from jaxspec.distill.objective import vocab_head
from jaxspec.distill.train import TrainConfig, TrainContext, checkpoint_vocabulary, evaluate, init_params, train
from jaxspec.model.hf import assistant_config_from_dict, assistant_hf_config
from jaxspec.model.packed import pack_assistant
from jaxspec.model.weights import compute_dtype, load_target


def parse_args(argv=None):
    p = Parser(prog="python -m jaxspec.distill", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="target checkpoint folder (HF layout)")
    p.add_argument("--out", required=True, help="HF assistant folder to write")
    p.add_argument("--packed-out", default=None, help="packed form for shipping (default OUT/packed)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", default=None, help="prompt_ids JSONL (python -m jaxspec.corpus); no tokenizer")
    src.add_argument("--corpus", choices=("mixed", "pydoc"), default=None,
                     help="built-in corpus: mixed (the default: every source of `python -m jaxspec.corpus`) or pydoc "
                          "alone; needs the model folder's tokenizer")
    p.add_argument("--max-per-source", type=int, default=4000, help="with --corpus mixed: prompts per source")
    p.add_argument("--heldout-out", default=None, help="with --corpus: write the held-out prompts as text lines")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64, help="with --corpus: tokens per prompt")
    p.add_argument("--stride", type=int, default=None, help="with --corpus: tokens between prompts (default len/2)")
    p.add_argument("--num-prompts", type=int, default=4096, help="at most this many training prompts")
    p.add_argument("--num-heldout", type=int, default=256, help="at most this many held-out prompts")
    p.add_argument("--steps", type=int, default=20000, help="at most this many optimiser steps")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--k", type=int, default=3, help="draft steps trained (num_speculative_tokens)")
    p.add_argument("--keep-vocab", type=int, default=16384, help="tokens with a trainable embedding row")
    p.add_argument("--assistant-hidden", type=int, default=256)
    p.add_argument("--assistant-layers", type=int, default=4)
    p.add_argument("--assistant-heads", type=int, default=4)
    p.add_argument("--assistant-intermediate", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gen-batch", type=int, default=256, help="sequences per target forward while building data")
    p.add_argument("--ckpt-dir", default=None, help="orbax checkpoints of the training state (resumed if present)")
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=500, help="held-out evaluation every N steps (0: at the end)")
    p.add_argument("--patience", type=int, default=3, help="stop after this many evaluations without a better "
                   "held-out accept length (early stopping; 0: run every step); the best evaluation's weights are kept")
    p.add_argument("--time-limit", type=float, default=None, help="stop training (and keep the best evaluation) "
                   "once the run has taken this many seconds")
    p.add_argument("--dtype", default=None, help="forward dtype bf16 or fp32 (default: bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--continuations", default=None, help="a file of the target's greedy continuations (.npz): rows "
                   "found there are not generated again, new rows are added to it batch by batch")
    p.add_argument("--sampled-copies", type=int, default=0, help="also train on this many continuations of every "
                   "training prompt sampled from the target at --temperature (more varied text than the greedy one "
                   "alone; generated each run, never saved to --continuations); held-out stays greedy")
    p.add_argument("--temperature", type=float, default=1.0, help="the sampled continuations' temperature (> 0)")
    p.add_argument("--data-only", action="store_true", help="generate the continuations into --continuations and "
                   "stop (with --time-limit: no new batch after it); a later run with the same file trains on them")
    return p.parse_args(argv)


def _check_args(args) -> None:
    for name in ("new_tokens", "steps", "batch", "k", "keep_vocab", "gen_batch", "ckpt_every", "num_prompts",
                 "num_heldout"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.new_tokens < args.k + 1:
        raise ConfigError(f"--new-tokens {args.new_tokens} leaves no position with {args.k} draft targets "
                          f"(needs >= k + 1 = {args.k + 1})")
    if args.lr <= 0 or args.warmup < 0 or args.weight_decay < 0 or args.clip <= 0 or args.eval_every < 0:
        raise ConfigError("--lr and --clip must be > 0; --warmup, --weight-decay and --eval-every >= 0")
    if args.patience < 0 or args.max_per_source < 0 or (args.time_limit is not None and not args.time_limit > 0):
        raise ConfigError("--patience and --max-per-source must be >= 0 and --time-limit > 0")
    if args.sampled_copies < 0 or not args.temperature > 0:
        raise ConfigError(f"--sampled-copies must be >= 0 and --temperature > 0, got {args.sampled_copies} and "
                          f"{args.temperature}")
    if args.data_only and args.sampled_copies:
        raise ConfigError("--data-only saves greedy continuations only; sampled ones are generated by the run that "
                          "trains (drop --sampled-copies here, give it to that run)")
    if args.data_only and not args.continuations:
        raise ConfigError("--data-only writes the continuations to a file: give --continuations FILE")
    if args.heldout_out and args.prompts:
        raise ConfigError("--heldout-out writes corpus prompts as text; it needs --corpus, not --prompts")


def _prompts(args, cfg: TargetConfig) -> tuple[list, list, str, dict]:
    """(train, held-out) prompt ids, subsampled deterministically, a description of where they come from and
    {split: {source: prompts}}."""
    if args.prompts:
        rows, source = corpus.read_prompt_ids(args.prompts), args.prompts
    else:
        tokenizer = corpus.load_tokenizer_or_fail(args.model)
        names = ["pydoc"] if args.corpus == "pydoc" else list(corpus.SOURCES)
        rows = corpus.corpus_rows(tokenizer, names, args.prompt_len, args.stride or max(1, args.prompt_len // 2),
                                  args.max_per_source or None)
        source = f"jaxspec.corpus {','.join(names)} (prompt_len {args.prompt_len})"
        if args.heldout_out:
            corpus.write_heldout_text(args.heldout_out, tokenizer, rows)
    train_rows, held_rows = corpus.split_rows(rows)
    train_ids, held_ids = [r["prompt_ids"] for r in train_rows], [r["prompt_ids"] for r in held_rows]
    train_src, held_src = [r.get("source") or "?" for r in train_rows], [r.get("source") or "?" for r in held_rows]
    if not train_ids or not held_ids:
        raise ConfigError(f"{source}: needs both training and held-out prompts "
                          f"(got {len(train_ids)} and {len(held_ids)})")
    rng = np.random.default_rng(args.seed)
    train_pick = sorted(rng.permutation(len(train_ids))[: args.num_prompts])
    held_pick = sorted(rng.permutation(len(held_ids))[: args.num_heldout])
    counts = {"train": collections.Counter(train_src[i] for i in train_pick),
              "heldout": collections.Counter(held_src[i] for i in held_pick)}
    train_ids, held_ids = [train_ids[i] for i in train_pick], [held_ids[i] for i in held_pick]
    for ids in train_ids + held_ids:
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]} outside the vocabulary (0..{cfg.vocab_size - 1})")
        if len(ids) + args.new_tokens > cfg.max_position_embeddings:
            raise ConfigError(f"a prompt of {len(ids)} tokens + {args.new_tokens} new tokens exceeds the context of "
                              f"{cfg.max_position_embeddings}")
    return train_ids, held_ids, source, {split: dict(sorted(c.items())) for split, c in counts.items()}


def target_fingerprint(model_dir: str, cfg: TargetConfig, dtype_name: str) -> str:
    """What a saved continuation depends on: the target's config, its weight files (names and sizes) and the dtype."""
    h = hashlib.sha256(repr(cfg).encode())
    for f in sorted(os.listdir(model_dir)):
        if f.endswith((".safetensors", ".json")):
            h.update(f"{f}:{os.path.getsize(os.path.join(model_dir, f))};".encode())
    return f"{h.hexdigest()[:16]}-{dtype_name}"


def _continuations(args, cfg, tparams, dtype_name, *prompt_sets, deadline=None):
    """[(int32[N, new_tokens], bool[N] filled)] for each prompt set, in order: read from and added to
    --continuations where given; generated up to `deadline` (every row without one)."""
    if not args.continuations:
        return [greedy_continuations(tparams, cfg, ids, args.new_tokens, args.gen_batch) for ids in prompt_sets]
    key = target_fingerprint(args.model, cfg, dtype_name)
    known = load_continuations(args.continuations, key, args.new_tokens)
    t0, before = time.perf_counter(), len(known)

    def save():
        save_continuations(args.continuations, key, args.new_tokens, known)
        if not args.quiet:
            print(f"{len(known) - before} new continuations ({len(known)} in the file) after "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)

    return [greedy_continuations(tparams, cfg, ids, args.new_tokens, args.gen_batch, known=known, deadline=deadline,
                                 on_batch=save) for ids in prompt_sets]


def run(args) -> int:
    started = time.monotonic()
    _check_args(args)
    if args.continuations and os.path.isdir(args.continuations):
        raise ConfigError(f"--continuations {args.continuations} is a folder; give a file")
    dtype_name = args.dtype or ("fp32" if jax.default_backend() == "cpu" else "bf16")
    dtype = compute_dtype(dtype_name)
    cfg, tparams = load_target(args.model, dtype)
    config = assistant_hf_config(cfg, hidden_size=args.assistant_hidden, num_layers=args.assistant_layers,
                                 num_heads=args.assistant_heads, intermediate_size=args.assistant_intermediate)
    acfg = assistant_config_from_dict(config)
    check_pair(cfg, acfg)
    train_ids, held_ids, source, per_source = _prompts(args, cfg)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))  # noqa: E731
    log(f"target {args.model} ({cfg.model_type}); {len(train_ids)} train / {len(held_ids)} held-out prompts "
        f"from {source}; {jax.default_backend()} {dtype_name}")

    t0 = time.perf_counter()
    deadline = started + args.time_limit if args.data_only and args.time_limit else None
    conts = _continuations(args, cfg, tparams, dtype_name, held_ids, train_ids, deadline=deadline)
    if args.data_only:
        (held_c, held_done), (train_c, train_done) = conts
        print(f"continuations of {train_done.sum()} / {len(train_ids)} train and {held_done.sum()} / {len(held_ids)} "
              f"held-out prompts ({args.new_tokens} tokens each) in {args.continuations}; "
              f"{time.perf_counter() - t0:.1f} s")
        return 0
    (held_c, _), (train_c, _) = conts
    greedy_prompts = len(train_ids)
    if args.sampled_copies:
        sampled = [sampled_continuations(tparams, cfg, train_ids, args.new_tokens, args.gen_batch,
                                         temperature=args.temperature, seed=args.seed, copy=c)
                   for c in range(args.sampled_copies)]
        train_ids = train_ids * (1 + args.sampled_copies)
        train_c = np.concatenate([train_c, *sampled])
        log(f"{args.sampled_copies} sampled continuation(s) of every training prompt at temperature "
            f"{args.temperature}: {len(train_ids)} training sequences")
    types = tuple(sorted(set(acfg.text.layer_types)))
    train_data = build_dataset(tparams, cfg, train_ids, args.new_tokens, types, args.gen_batch, continuations=train_c)
    held_data = build_dataset(tparams, cfg, held_ids, args.new_tokens, types, args.gen_batch, continuations=held_c)
    jax.block_until_ready(held_data)
    t_data = time.perf_counter() - t0
    log(f"data: {len(train_ids) + len(held_ids)} sequences of up to {train_data['tokens'].shape[1]} tokens in "
        f"{t_data:.1f} s")

    targets = draft_targets(train_data)
    if not len(targets):
        raise ConfigError("the training continuations have no draft targets (every one ends at once with EOS)")
    if args.ckpt_dir:
        kept_ids = checkpoint_vocabulary(args.ckpt_dir, {"assistant": config, "k": args.k,
                                                         "keep_vocab": args.keep_vocab}, targets, cfg.vocab_size)
    else:
        kept_ids = kept_vocabulary(targets, args.keep_vocab, cfg.vocab_size)
    tc = TrainConfig(k=args.k, steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup,
                     weight_decay=args.weight_decay, clip=args.clip, seed=args.seed, dtype=dtype_name)
    ctx = TrainContext(acfg=acfg, tc=tc, num_queries=args.new_tokens - 1, head=vocab_head(kept_ids, cfg.vocab_size),
                       target_embed=tparams["embed"])
    log(f"{len(kept_ids)} kept tokens cover {np.isin(targets, kept_ids).mean():.4f} of the training targets")

    t0 = time.perf_counter()
    deadline = None if args.time_limit is None else started + args.time_limit
    params, resumed, stopping = train(init_params(acfg, len(kept_ids), args.seed), ctx, train_data,
                                      ckpt_dir=args.ckpt_dir, ckpt_every=args.ckpt_every, eval_data=held_data,
                                      eval_every=args.eval_every, patience=args.patience, deadline=deadline,
                                      progress=not args.quiet)
    t_train = time.perf_counter() - t0

    aparams = export_params(params, kept_ids, cfg.vocab_size)
    save_hf_folder(args.out, cfg, config, acfg, aparams, args.k)
    final = kept_view(aparams, kept_ids)  # metrics of the saved (bf16-rounded) weights
    sample = {n: a[: held_data["tokens"].shape[0]] for n, a in train_data.items()}
    train_m = evaluate(final, ctx, sample)
    held_m = evaluate(final, ctx, held_data)
    report = {
        "target": os.path.abspath(args.model), "target_model_type": cfg.model_type, "k": args.k,
        "assistant": {"hidden_size": acfg.hidden_size, "num_layers": acfg.text.num_layers,
                      "num_heads": acfg.text.num_heads, "intermediate_size": acfg.text.intermediate_size,
                      "layer_types": list(acfg.text.layer_types), "sliding_window": acfg.text.sliding_window},
        "vocab": {"size": cfg.vocab_size, "keep_vocab": args.keep_vocab, "kept": int(len(kept_ids)),
                  "kept_target_coverage": float(np.isin(targets, kept_ids).mean())},
        "data": {"source": source, "per_source": per_source, "train_prompts": greedy_prompts,
                 "sampled_copies": args.sampled_copies,
                 "sampled_temperature": args.temperature if args.sampled_copies else None,
                 "train_sequences": len(train_ids),
                 "heldout_prompts": len(held_ids),
                 "new_tokens": args.new_tokens, "prompt_lengths": sorted({len(p) for p in train_ids + held_ids}),
                 "train_draft_targets": int(len(targets))},
        "train": dataclasses.asdict(tc) | {"master_dtype": "fp32", "resumed_from_step": resumed,
                                           "saved_dtype": "bf16", "eval_every": args.eval_every,
                                           "patience": args.patience, "time_limit_s": args.time_limit},
        "early_stopping": stopping,
        "final": {"train_sample": train_m, "heldout": held_m,
                  "expected_accept_length_heldout": held_m["expected_accept_length"]},
        "seconds": {"data": round(t_data, 1), "train": round(t_train, 1)},
    }
    write_report(args.out, report)
    packed_out = args.packed_out or os.path.join(args.out, "packed")
    files = pack_assistant(args.out, packed_out)
    acc = " ".join(f"{a:.3f}" for a in held_m["accuracy_per_step"])
    print(f"held-out loss {held_m['loss']:.4f}, accuracy per step {acc}, expected accept length "
          f"{held_m['expected_accept_length']:.2f} (per position {held_m['accept_length_per_position']:.2f}); "
          f"train sample loss {train_m['loss']:.4f}")
    print(f"assistant -> {args.out}; packed ({len(files)} files) -> {packed_out}")
    return 0


def main(argv=None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

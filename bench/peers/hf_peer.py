#!/usr/bin/env python3
"""transformers peer of `python -m jaxspec.bench e2e` (issue #6): Gemma4ForCausalLM + Gemma4AssistantForCausalLM.

Both models are built from the same presets jaxspec benchmarks (jaxspec/config.py: PRESETS and `assistant_preset`)
with random weights, directly on the device in bf16 (`with torch.device(dev): Model._from_config(cfg, dtype=...)`).
At bs 1, for every prompt length in --ctx, it measures (wall time with a device sync before and after each call, after
one warm-up generate per mode and length):

  prefill      generate(max_new_tokens=1): prompt forward + first token (plain, and with the assistant attached)
  plain        generate(max_new_tokens=N, min_new_tokens=N, do_sample=False)
  assisted     the same with assistant_model=asst; k = asst.generation_config.num_assistant_tokens (transformers reads
               k from there: a num_assistant_tokens= argument of generate() is ignored by the Gemma 4 MTP generator)
  draft loop   SinglePositionMultiTokenCandidateGenerator.get_candidates per round (synced before and after; the
               prefill iteration, which drafts nothing, is left out): median and mean over the assisted run's rounds

tokens/s are reported with prefill (N / t_N) and without it, as jaxspec's e2e does (decode = tokens after the first,
(N - 1) / (t_N - t_1)). With random weights the drafts are almost never accepted (accept length ~1); the assisted
output must equal the plain one (greedy), which is checked and recorded.

    python bench/peers/hf_peer.py --device cuda --preset E4B --ctx 1024,4096 --new-tokens 64 --json OUT.json
    python bench/peers/hf_peer.py --device cpu --tiny --ctx 32,64 --new-tokens 16 --json /tmp/hf.json   # smoke test

The JSON is rewritten after every measurement, so a run cut by a time limit keeps what it finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time

import torch
import transformers
from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM,
                          Gemma4TextConfig)
from transformers.generation import candidate_generator as cg

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from jaxspec.config import FULL, PRESETS, SLIDING, TargetConfig, bench_pair  # noqa: E402  (no jax import)



def presets(name: str, tiny: bool):
    return bench_pair("tiny" if tiny else name)  # jaxspec.bench's presets (jaxspec.config imports no jax)


def text_kwargs(c: TargetConfig) -> dict:
    """jaxspec TargetConfig -> Gemma4TextConfig keyword arguments."""
    kw = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, global_head_dim=c.global_head_dim, layer_types=list(c.layer_types),
        sliding_window=c.sliding_window, rms_norm_eps=c.rms_norm_eps,
        final_logit_softcapping=c.final_logit_softcapping, max_position_embeddings=c.max_position_embeddings,
        hidden_size_per_layer_input=c.hidden_size_per_layer_input,
        vocab_size_per_layer_input=c.vocab_size_per_layer_input, num_kv_shared_layers=c.num_kv_shared_layers,
        use_double_wide_mlp=c.use_double_wide_mlp, attention_k_eq_v=c.attention_k_eq_v,
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": c.rope_sliding.theta},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": c.rope_full.partial_factor,
                   "rope_theta": c.rope_full.theta}},
        tie_word_embeddings=True, pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids))
    if c.attention_k_eq_v:
        kw["num_global_key_value_heads"] = c.num_global_kv_heads
    if c.enable_moe_block:
        kw.update(enable_moe_block=True, num_experts=c.num_experts, top_k_experts=c.top_k_experts,
                  moe_intermediate_size=c.moe_intermediate_size)
    return kw


def build(cfg, acfg, device: str, dtype, attn: str, k: int, seed: int):
    torch.manual_seed(seed)
    tcfg = Gemma4TextConfig(**text_kwargs(cfg), attn_implementation=attn)
    a_cfg = Gemma4AssistantConfig(
        text_config=text_kwargs(acfg.text), backbone_hidden_size=acfg.backbone_hidden_size,
        use_ordered_embeddings=acfg.use_ordered_embeddings, num_centroids=acfg.num_centroids,
        centroid_intermediate_top_k=acfg.centroid_top_k, tie_word_embeddings=True, attn_implementation=attn)
    with torch.device(device):
        target = Gemma4ForCausalLM._from_config(tcfg, dtype=dtype).eval()
        asst = Gemma4AssistantForCausalLM._from_config(a_cfg, dtype=dtype).eval()
    if acfg.use_ordered_embeddings:  # initialised to zeros: every centroid would select token 0
        with torch.no_grad():
            te = asst.masked_embedding.token_ordering
            te.copy_(torch.randperm(te.numel(), device=te.device).view_as(te))
    # the MTP generator reads k from here (default None crashes); keep it constant
    asst.generation_config.num_assistant_tokens = k
    asst.generation_config.num_assistant_tokens_schedule = "constant"
    return target, asst


class DraftTimer:
    """Wraps SinglePositionMultiTokenCandidateGenerator.get_candidates with device syncs; times the rounds that
    drafted."""

    def __init__(self, sync):
        self.sync, self.times, self.orig = sync, [], cg.SinglePositionMultiTokenCandidateGenerator.get_candidates

    def __enter__(self):
        orig, timer = self.orig, self

        def timed(gen, *a, **kw):
            timer.sync()
            t0 = time.perf_counter()
            out = orig(gen, *a, **kw)
            timer.sync()
            if out[1] is not None:  # the prefill iteration and the last (k <= 0) return no drafts
                timer.times.append(time.perf_counter() - t0)
            return out

        cg.SinglePositionMultiTokenCandidateGenerator.get_candidates = timed
        self.times = []
        return self

    def __exit__(self, *exc):
        cg.SinglePositionMultiTokenCandidateGenerator.get_candidates = self.orig


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--preset", default="E4B", choices=tuple(PRESETS))
    p.add_argument("--tiny", action="store_true", help="jaxspec.bench's tiny preset (CPU smoke test)")
    p.add_argument("--ctx", default="1024,4096", help="prompt lengths (comma-separated; K = 1024)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=3, help="drafts per round (num_assistant_tokens)")
    p.add_argument("--repeats", type=int, default=1, help="timed generate calls per figure (median)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--attn", default="sdpa", help="attn_implementation of both models")
    p.add_argument("--modes", default="plain,assisted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="peer-hf.json")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    ctxs = [int(s[:-1]) * 1024 if s[-1] in "kK" else int(s) for s in args.ctx.split(",")]
    modes = args.modes.split(",")
    N = args.new_tokens
    if N < 2:
        p.error("--new-tokens must be >= 2 (decode tokens/s leaves the first token out)")
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    cfg, acfg = presets(args.preset, args.tiny)
    t0 = time.perf_counter()
    target, asst = build(cfg, acfg, args.device, dtype, args.attn, args.k, args.seed)
    sync()
    build_s = time.perf_counter() - t0
    n_params = sum(x.numel() for x in target.parameters())
    print(f"built {'tiny' if args.tiny else args.preset} target ({n_params / 1e9:.2f} B params) + assistant "
          f"({sum(x.numel() for x in asst.parameters()) / 1e6:.1f} M) on {dev} in {build_s:.1f} s", flush=True)

    record = {
        "peer": "transformers", "command": shlex.join(["python", "bench/peers/hf_peer.py", *argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "preset": "tiny" if args.tiny else args.preset, "dtype": args.dtype, "attn_implementation": args.attn,
        "bs": 1, "k": args.k, "new_tokens": N, "build_s": build_s, "target_params": n_params,
        "assisted_generate_args": "generate(input_ids, attention_mask=..., assistant_model=asst, do_sample=False, "
                                  "max_new_tokens=N, min_new_tokens=N); asst.generation_config."
                                  f"num_assistant_tokens={args.k} (schedule 'constant')",
        "rows": []}

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)

    def generate(ids, n, **kw):
        sync()
        t = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=cfg.pad_token_id, **kw)
        sync()
        return time.perf_counter() - t, out

    def timed(ids, n, repeats, **kw):
        runs = [generate(ids, n, **kw) for _ in range(repeats)]
        return statistics.median(r[0] for r in runs), runs[-1][1]

    gen = torch.Generator().manual_seed(args.seed)
    for P in ctxs:
        ids = torch.randint(3, cfg.vocab_size, (1, P), generator=gen).to(dev)
        row = {"ctx": P, "new_tokens": N}
        record["rows"].append(row)
        plain_out = None
        if "plain" in modes:
            generate(ids, min(4, N))  # warm-up
            row["prefill_s"], _ = timed(ids, 1, max(args.repeats, 3))
            row["plain_s"], plain_out = timed(ids, N, args.repeats)
            row["plain_generated"] = plain_out.shape[1] - P
            row["plain_tokens_per_s_incl_prefill"] = N / row["plain_s"]
            row["plain_decode_tokens_per_s"] = (N - 1) / (row["plain_s"] - row["prefill_s"])
            print(f"ctx {P} plain: prefill {row['prefill_s'] * 1e3:.1f} ms, {N} tokens in {row['plain_s']:.3f} s: "
                  f"{row['plain_decode_tokens_per_s']:.2f} tok/s decode, "
                  f"{row['plain_tokens_per_s_incl_prefill']:.2f} with prefill", flush=True)
            save()
        if "assisted" in modes:
            generate(ids, min(2 + 2 * args.k, N), assistant_model=asst)  # warm-up (several rounds)
            row["assisted_prefill_s"], _ = timed(ids, 1, max(args.repeats, 3), assistant_model=asst)
            with DraftTimer(sync) as dt:
                row["assisted_s"], out = timed(ids, N, args.repeats, assistant_model=asst)
            rounds = len(dt.times) // args.repeats
            draft = dt.times[-rounds:] if rounds else []  # the last timed run's rounds
            row.update({
                "assisted_generated": out.shape[1] - P,
                "assisted_tokens_per_s_incl_prefill": N / row["assisted_s"],
                "assisted_decode_tokens_per_s": (N - 1) / (row["assisted_s"] - row["assisted_prefill_s"]),
                "rounds": rounds,
                "mean_accept_length": (N - 1) / rounds if rounds else None,
                "draft_ms_per_round_median": statistics.median(draft) * 1e3 if draft else None,
                "draft_ms_per_round_mean": statistics.fmean(draft) * 1e3 if draft else None,
                "draft_ms_per_round_min": min(draft) * 1e3 if draft else None,
                "round_ms": (row["assisted_s"] - row["assisted_prefill_s"]) / rounds * 1e3 if rounds else None,
                "assisted_equals_plain": None if plain_out is None else bool(torch.equal(out, plain_out)),
            })
            print(f"ctx {P} assisted (k={args.k}): {row['assisted_decode_tokens_per_s']:.2f} tok/s decode, "
                  f"{row['assisted_tokens_per_s_incl_prefill']:.2f} with prefill; {rounds} rounds, draft loop "
                  f"{row['draft_ms_per_round_median']:.2f} ms/round (median), round {row['round_ms']:.2f} ms; "
                  f"same tokens as plain: {row['assisted_equals_plain']}", flush=True)
            save()
    save()
    print(f"wrote {args.json}")
    return record


if __name__ == "__main__":
    main()

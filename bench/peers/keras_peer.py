#!/usr/bin/env python3
"""keras-hub peer of `python -m jaxspec.bench e2e` (issue #6): Gemma4CausalLM + Gemma4AssistantCausalLM on JAX.

Both backbones (`keras_hub.models.Gemma4Backbone`) are built from the same presets jaxspec benchmarks
(jaxspec/config.py: PRESETS and `assistant_preset`) with keras' random initialisers, in bf16; the target task is
`Gemma4CausalLM(backbone=..., preprocessor=None)` (greedy sampler), the drafter
`Gemma4AssistantCausalLM(backbone=..., backbone_hidden_size=..., num_centroids=..., centroid_intermediate_top_k=...,
use_ordered_embeddings=..., num_speculative_tokens=k)`. keras-hub compiles the whole generate loop (prefill + a
while loop over a dense [B, L, 2, max_length, kv_heads, max_head_dim] cache) into one jitted function per input
shape; with `assistant_model=` the loop body is draft k steps + verify k + 1 positions (SpeculativeSampler).

With preprocessor=None, generate's max_length is ignored: the output length is the width of `token_ids`, so the
inputs are a prompt of P random ids padded with zeros to P + N, padding_mask True on the prompt:

    lm.generate({"token_ids": ids, "padding_mask": mask}, max_length=P + N, stop_token_ids=None)          # plain
    lm.generate({...}, max_length=P + N, stop_token_ids=None, assistant_model=asst)                        # assisted

Each (width, mode) is compiled by a warm-up call first; then the median of --repeats timed calls (wall time of
generate, which returns numpy, so it includes the device sync). tokens/s with prefill = N / t(P, N). Decode-only
tokens/s by differencing at the SAME width (so no second compile): keras-hub's prefill runs over the whole width
P + N whatever the prompt length, and every decode step attends the whole dense cache, so a run whose prompt is
P + N - M long (M new tokens, --diff-new-tokens M, 0 < M < N) costs the same prefill and N - M fewer decode steps:
decode tokens/s = (N - M) / (t(P, N) - t(P + N - M, M)). With random weights drafts are almost never accepted; the
assisted output must equal the plain one (greedy), which is checked and recorded.

    KERAS_BACKEND=jax python bench/peers/keras_peer.py --preset E4B --ctx 1024,4096 --new-tokens 64 --json OUT.json
    KERAS_BACKEND=jax JAX_PLATFORMS=cpu python bench/peers/keras_peer.py --tiny --ctx 32,64 --new-tokens 16 \
        --json /tmp/keras.json                                                                      # smoke test

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

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from jaxspec.config import FULL, PRESETS, TargetConfig, bench_pair  # noqa: E402



def presets(name: str, tiny: bool):
    return bench_pair("tiny" if tiny else name)  # jaxspec.bench's presets (jaxspec.config imports no jax)


def backbone_kwargs(c: TargetConfig, dtype: str) -> dict:
    """jaxspec TargetConfig -> Gemma4Backbone keyword arguments (as keras-hub's HF converter maps a config.json)."""
    fulls = [i for i, t in enumerate(c.layer_types) if t == FULL]
    return dict(
        vocabulary_size=c.vocab_size, image_size=None, num_layers=c.num_layers, num_query_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, hidden_dim=c.hidden_size, intermediate_dim=c.intermediate_size,
        head_dim=c.head_dim, global_head_dim=c.global_head_dim, attention_logit_soft_cap=None,
        final_logit_soft_cap=c.final_logit_softcapping, use_sliding_window_attention=c.sliding_window > 0,
        sliding_window_size=c.sliding_window,
        sliding_window_pattern=fulls[1] - fulls[0] if len(fulls) > 1 else 6, layer_types=list(c.layer_types),
        layer_norm_epsilon=c.rms_norm_eps, num_kv_shared_layers=c.num_kv_shared_layers,
        num_global_key_value_heads=c.num_global_kv_heads if c.attention_k_eq_v else None,
        hidden_size_per_layer_input=c.hidden_size_per_layer_input,
        vocab_size_per_layer_input=c.vocab_size_per_layer_input or None,
        global_rope_wavelength=c.rope_full.theta, local_rope_wavelength=c.rope_sliding.theta,
        global_rope_partial_rotary_factor=c.rope_full.partial_factor, use_double_wide_mlp=c.use_double_wide_mlp,
        enable_moe_block=c.enable_moe_block, num_experts=c.num_experts or None,
        expert_intermediate_dim=c.moe_intermediate_size or None, num_experts_per_token=c.top_k_experts or 8,
        dtype=dtype)


def build(cfg, acfg, k: int, dtype: str, seed: int):
    keras.utils.set_random_seed(seed)
    target = keras_hub.models.Gemma4CausalLM(
        backbone=keras_hub.models.Gemma4Backbone(**backbone_kwargs(cfg, dtype)), preprocessor=None)
    target.compile(sampler="greedy")  # the default too; greedy acceptance needs a GreedySampler on the target
    asst = keras_hub.models.Gemma4AssistantCausalLM(
        backbone=keras_hub.models.Gemma4Backbone(**backbone_kwargs(acfg.text, dtype)),
        backbone_hidden_size=acfg.backbone_hidden_size, num_centroids=acfg.num_centroids,
        centroid_intermediate_top_k=acfg.centroid_top_k, use_ordered_embeddings=acfg.use_ordered_embeddings,
        num_speculative_tokens=k)
    if acfg.use_ordered_embeddings:  # initialised to zeros: every centroid would select token 0
        perm = np.random.default_rng(seed).permutation(acfg.vocab_size).astype(np.float32)
        asst.token_ordering.assign(perm)
    return target, asst


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="E4B", choices=tuple(PRESETS))
    p.add_argument("--tiny", action="store_true", help="jaxspec.bench's tiny preset (CPU smoke test)")
    p.add_argument("--ctx", default="1024,4096", help="prompt lengths (comma-separated; K = 1024)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--diff-new-tokens", type=int, default=None,
                   help="also run a prompt of P + N - M with M new tokens at the same width (no recompile) for decode "
                        "tokens/s by differencing (default N // 4; 0: off)")
    p.add_argument("-k", type=int, default=3, help="num_speculative_tokens of the assistant")
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls per figure (median)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", default="plain,assisted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="peer-keras.json")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if keras.config.backend() != "jax":
        p.error(f"needs KERAS_BACKEND=jax, got {keras.config.backend()}")
    ctxs = [int(s[:-1]) * 1024 if s[-1] in "kK" else int(s) for s in args.ctx.split(",")]
    modes = args.modes.split(",")
    N = args.new_tokens
    M = N // 4 if args.diff_new_tokens is None else args.diff_new_tokens
    if M and not 0 < M < N:
        p.error("--diff-new-tokens must be between 0 and --new-tokens")

    cfg, acfg = presets(args.preset, args.tiny)
    t0 = time.perf_counter()
    target, asst = build(cfg, acfg, args.k, args.dtype, args.seed)
    jax.block_until_ready([v.value for v in target.weights + asst.weights])
    build_s = time.perf_counter() - t0
    n_params = target.count_params()
    print(f"built {'tiny' if args.tiny else args.preset} target ({n_params / 1e9:.2f} B params) + assistant "
          f"({asst.count_params() / 1e6:.1f} M) on {jax.devices()[0]} in {build_s:.1f} s", flush=True)

    record = {
        "peer": "keras-hub", "command": shlex.join(["python", "bench/peers/keras_peer.py", *argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "versions": {"keras_hub": keras_hub.__version__, "keras": keras.__version__, "jax": jax.__version__},
        "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
        "preset": "tiny" if args.tiny else args.preset, "dtype": args.dtype, "bs": 1, "k": args.k,
        "new_tokens": N, "diff_new_tokens": M, "build_s": build_s, "target_params": n_params,
        "assisted_generate_args": "generate({'token_ids': [1, P+N] (prompt, then 0), 'padding_mask': prompt}, "
                                  "max_length=P+N, stop_token_ids=None, assistant_model=asst); "
                                  f"Gemma4AssistantCausalLM(..., num_speculative_tokens={args.k})",
        "rows": []}

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)

    def inputs(prompt, width):
        ids = np.zeros((1, width), np.int32)
        ids[0, : prompt.size] = prompt
        mask = np.zeros((1, width), bool)
        mask[0, : prompt.size] = True
        return {"token_ids": ids, "padding_mask": mask}

    def run(prompt, width, mode, compile_first=True):
        """(first call s or None, median s, output ids) of generate over `width` positions."""
        kw = {"assistant_model": asst} if mode == "assisted" else {}
        first = None
        if compile_first:
            t = time.perf_counter()
            target.generate(inputs(prompt, width), max_length=width, stop_token_ids=None, **kw)
            first = time.perf_counter() - t
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = target.generate(inputs(prompt, width), max_length=width, stop_token_ids=None, **kw)
            times.append(time.perf_counter() - t)
        return first, statistics.median(times), np.asarray(out["token_ids"])

    rng = np.random.default_rng(args.seed)
    for P in ctxs:
        prompt = rng.integers(3, cfg.vocab_size, P + N).astype(np.int32)  # [:P] is the prompt; [:P+N-M] the long one
        row = {"ctx": P, "new_tokens": N, "width": P + N}
        record["rows"].append(row)
        outs = {}
        for mode in modes:
            first, t, outs[mode] = run(prompt[:P], P + N, mode)
            row[f"{mode}_compile_s"] = first - t
            row[f"{mode}_s"] = t
            row[f"{mode}_tokens_per_s_incl_prefill"] = N / t
            print(f"ctx {P} {mode}: {N} tokens in {t:.3f} s (prefill included): {N / t:.1f} tok/s; first call "
                  f"{first:.1f} s", flush=True)
            save()
            if M:
                _, tm, _ = run(prompt[: P + N - M], P + N, mode, compile_first=False)
                row["short_prompt"], row["short_new_tokens"] = P + N - M, M
                row[f"{mode}_s_short"] = tm
                row[f"{mode}_decode_tokens_per_s"] = (N - M) / (t - tm) if t > tm else None
                print(f"ctx {P} {mode}: prompt {P + N - M}, {M} tokens in {tm:.3f} s -> decode "
                      f"{(N - M) / (t - tm) if t > tm else float('nan'):.1f} tok/s", flush=True)
                save()
        if "plain" in outs and "assisted" in outs:
            row["assisted_equals_plain"] = bool(np.array_equal(outs["plain"], outs["assisted"]))
            print(f"ctx {P}: assisted output equals plain: {row['assisted_equals_plain']}", flush=True)
            save()
    save()
    print(f"wrote {args.json}")
    return record


if __name__ == "__main__":
    main()

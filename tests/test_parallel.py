"""Tensor parallelism (`--tensor-parallel-size`, `jaxspec.parallel`) on 4 forced CPU devices: greedy output at TP 2
and 4 equals transformers' greedy continuations of the oracle checkpoints (a PLE model with 2 KV heads, so TP 4
replicates its K/V, and a MoE model), with preemption under a small pool; the compiled round program holds the
all-reduces of a split model and gathers no split weight; `generate --tp 2` writes the same tokens. With the Pallas
kernels (interpreted), run per device, a pair whose drafts are often accepted gives at TP 2 (K/V split by head) and
TP 4 (K/V whole on each device) the tokens and the accept lengths of round after round of TP 1: the drafts too are
the same.

The device count is fixed when jax starts, so the runs happen in one subprocess."""

import json
import os
import subprocess
import sys

import pytest

from conftest import golden_path

SCRIPT = r"""
import collections, json, re, sys
import jax
from conftest import golden_path, load_reference
from jaxspec import parallel
from jaxspec.engine import Engine, Request, SamplingParams
from jaxspec.model.weights import load_assistant, load_target

assert len(jax.devices()) == 4
for case, tp, pages, rounds in (("e2b", 2, 24, 1), ("e2b", 4, None, 2), ("moe", 2, None, 1), ("moe", 4, 24, 2)):
    cfg, params = load_target(golden_path(case, "target"), "fp32")
    acfg, aparams = load_assistant(golden_path(case, "assistant"), "fp32")
    ref = load_reference(case)
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, draft_mode="bucketed", buckets=(4,), max_running=4,
                 page_size=4, max_context=64, prefill_chunk=8, num_pages=pages, rounds_per_call=rounds,
                 tensor_parallel_size=tp)
    prompts = [ref[f"greedy_prompt_{i}"][0].tolist() for i in range(4)]
    want = [ref[f"greedy_out_{i}"][0, len(prompts[i]):].tolist() for i in range(4)]
    reqs = [Request(prompt_ids=p, params=SamplingParams(max_new_tokens=len(w), ignore_eos=True))
            for p, w in zip(prompts, want)]
    eng.generate(reqs)
    hlo = eng.runner.executables[("decode", 4, False)].as_text()
    ops = collections.Counter(re.findall(r"= \S+ (all-reduce|all-gather)\(", hlo))
    shardings = parallel.target_shardings(params, cfg, eng.mesh)
    split = {"[" + ",".join(map(str, a.shape)) + "]" for a, s in
             zip(jax.tree.leaves(params), jax.tree.leaves(shardings, is_leaf=lambda x: hasattr(x, "spec")))
             if any(s.spec)}
    gathered = set(re.findall(r"= [a-z0-9]+(\[[0-9,]*\])\S* all-gather\(", hlo))
    kv_split = [bool(any(a.sharding.spec)) for a in jax.tree.leaves(eng.cache.kv)]
    print(json.dumps({"case": case, "tp": tp, "equal": [r.output_ids == w for r, w in zip(reqs, want)],
                      "preemptions": eng.summary(reqs)["preemptions"], "layers": cfg.num_layers, "rounds": rounds,
                      "all_reduce": ops["all-reduce"], "split_weights": len(split),
                      "weights_gathered": sorted(gathered & split), "kv_split": kv_split}))

# the kernels per device: 4 query heads, 2 K/V heads (the drafter's queries as many as the target's)
import numpy as np
from conftest import tiny_vocab_pair
cfg, params, acfg, aparams = tiny_vocab_pair(heads=4, kv_heads=2)
rng = np.random.default_rng(7)
prompts = [rng.integers(0, 6, int(n)).tolist() for n in rng.integers(2, 20, 8)]
for tp in (1, 2, 4):
    eng = Engine(cfg, params, acfg=acfg, aparams=aparams, k=3, draft_mode="bucketed", buckets=(4,), max_running=4,
                 page_size=4, max_context=64, prefill_chunk=8, tensor_parallel_size=tp, use_kernels=True)
    reqs = [Request(prompt_ids=p, params=SamplingParams(max_new_tokens=24, ignore_eos=True)) for p in prompts]
    eng.generate(reqs)
    print(json.dumps({"kernels_tp": tp, "outputs": [r.output_ids for r in reqs],
                      "accept_lengths": [r.accept_lengths for r in reqs],
                      "kv_split": [bool(any(a.sharding.spec)) for a in jax.tree.leaves(eng.cache.kv)] if tp > 1 else []}))
"""


def devices_flag(n: int) -> str:
    """n forced CPU devices, on top of this process's XLA flags (conftest's compile speed-up among them)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    env = {**os.environ, "XLA_FLAGS": devices_flag(4), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_kernels_per_device_give_tp_1s_tokens_and_drafts(runs):
    one, two, four = [r for r in runs if "kernels_tp" in r]
    assert (one["kernels_tp"], two["kernels_tp"], four["kernels_tp"]) == (1, 2, 4)
    assert all(two["kv_split"]) and not any(four["kv_split"])  # both ways the kernel meets the K/V
    rounds = [n for lengths in one["accept_lengths"] for n in lengths]
    assert sum(n > 1 for n in rounds) >= 20  # rounds that accepted drafts: the drafter's attention is checked
    for r in (two, four):
        assert r["outputs"] == one["outputs"] and r["accept_lengths"] == one["accept_lengths"]


def test_greedy_at_tp_2_and_4_equals_transformers(runs):
    runs = [r for r in runs if "case" in r]
    assert [(r["case"], r["tp"]) for r in runs] == [("e2b", 2), ("e2b", 4), ("moe", 2), ("moe", 4)]
    for r in runs:
        assert r["equal"] == [True] * 4, r
    assert runs[0]["preemptions"] > 0 and runs[3]["preemptions"] > 0  # the small pools preempted


def test_the_split_program_reduces_and_gathers_no_weight(runs):
    runs = [r for r in runs if "case" in r]
    for r in runs:
        assert r["split_weights"] >= 6  # q / o / gate_up / down per group, the embedding, ...
        # the all-reduces after the attention output and MLP down projections (XLA combines some), and no more: a
        # split on the wrong axis (o_proj by rows, gate_up or down by their input) costs 53-61 a round in the e2b
        # program. The program holds its R rounds one after another (XLA may combine across them): per round.
        assert r["layers"] <= r["all_reduce"] / r["rounds"] <= 4 * r["layers"], r
        assert r["weights_gathered"] == [], r
    e2b2, e2b4 = runs[0], runs[1]
    assert all(e2b2["kv_split"]) and not any(e2b4["kv_split"])  # 2 KV heads: split at TP 2, replicated at TP 4


def test_generate_tp_2_writes_the_transformers_tokens(tmp_path):
    import numpy as np

    ref = np.load(golden_path("e2b", "reference.npz"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": ref[f"greedy_prompt_{i}"][0].tolist()}) + "\n"
                               for i in range(2)))
    n = min(ref[f"greedy_out_{i}"].shape[1] - ref[f"greedy_prompt_{i}"].shape[1] for i in range(2))
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "XLA_FLAGS": devices_flag(2), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxspec.generate", "--model", golden_path("e2b", "target"), "--assistant",
           golden_path("e2b", "assistant"), "--prompts", str(prompts), "--max-new-tokens", str(n), "--ignore-eos",
           "--draft-bs", "2", "--max-running-requests", "2", "--max-context", "64", "--tp", "2", "--quiet",
           "--no-compile-cache", "--output", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for i, r in enumerate(rows):
        p = ref[f"greedy_prompt_{i}"].shape[1]
        assert r["output_ids"] == ref[f"greedy_out_{i}"][0, p: p + n].tolist()


def test_tp_beyond_the_devices_or_with_the_fused_draft_is_one_clear_error():
    from jaxspec.config import ConfigError
    from jaxspec.engine import Engine
    from jaxspec.model.weights import load_target

    cfg, params = load_target(golden_path("e2b", "target"), "fp32")
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2 needs 2 devices"):
        Engine(cfg, params, draft_mode="off", buckets=(1,), max_running=1, page_size=4, max_context=64,
               tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="fused drafter kernels do not run split over devices"):
        Engine(cfg, params, draft_mode="off", buckets=(1,), max_running=1, page_size=4, max_context=64,
               tensor_parallel_size=2, use_kernels=True, fused_draft=True)

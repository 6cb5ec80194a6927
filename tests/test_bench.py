"""Smoke test of `python -m jaxspec.bench` on the CPU: every subcommand runs on tiny shapes and writes the rows and
keys it promises. No timing is asserted: figures come from the GPU, never from tests."""

import json
import os

import numpy as np
import pytest

from jaxspec import bench
from jaxspec.bench import trace
from jaxspec.config import TINY

pytestmark = [pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:builtin type event_stats has no __module__:DeprecationWarning")]


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
            "--tq", "1,4", "--knobs", "bk16w4st1s4")
    assert [(g["bs"], g["table"], g["live"]) for g in r["gather"]] == [(2, 64, 9)]
    assert {"kernel_us", "whole_row_us", "whole/kernel"} <= set(r["gather"][0])
    assert [(a["head_dim"], a["bs"], a["ctx"], a["tq"]) for a in r["attention"]] == [(16, 2, 40, 1), (16, 2, 40, 4)]
    for a in r["attention"]:
        assert a["kv_bytes"] == 2 * 40 * 2 * 16 * 2 * 2  # bs * ctx * kv heads * d * (K, V) * bf16
        assert {"kernel_us", "ref_us", "bound_us", "ref/kernel", "kernel/bound", "ref/bound", "bk16w4st1s4_us"} <= set(a)
        assert a["bk16w4st1s4_max_abs_diff"] < 0.05  # four pieces merged: the same attention as the default's two


def test_propose(tmp_path):
    r = run(tmp_path, "propose", "--preset", "tiny", "--bs", "2", "--ctx", "40", "-k", "2", "--variants",
            "bucketed,stable,pinned,fused,unfused_stable,eager")
    assert [(p["ctx"], p["bs"], p["k"]) for p in r["rows"]] == [(40, 2, 2)]
    p = r["rows"][0]
    assert {"bucketed_us", "fused_us", "eager_us", "eager/bucketed", "fused/bucketed", "no_cmd/bucketed",
            "stable/unfused_stable"} <= set(p)
    assert p["unfused_stable_us"] > 0 and p["unfused_us"] is None  # timed as listed, the rest not
    # the stable variant (inputs on the device, outputs into donated buffers) drafts what bucketed drafts
    assert p["stable_us"] > 0 and p["stable_same_drafts"] == 1.0
    # and so does the pinned one (its input written into pinned host arrays)
    assert p["pinned_us"] > 0 and p["pinned_same_drafts"] == 1.0
    assert p["no_cmd_buffer_us"] is None  # command buffers exist on GPUs only
    # the bucketed drafts equal the eager reference's on the same inputs (bf16 here; tests/test_drafter.py measures 0
    # of 64 bf16 trajectories differing on the CPU and on the H200)
    assert p["same_drafts"] == 1.0
    assert p["memory"].startswith("K/V arrays")


def test_decode(tmp_path):
    r = run(tmp_path, "decode", "--preset", "tiny", "--bs", "2", "--ctx", "24", "--profile-dir", str(tmp_path / "p"))
    assert [(d["cache"], d["bs"], d["ctx"]) for d in r["rows"]] == [("dense", 2, 24), ("paged", 2, 24)]
    # the paged row is traced (its figures None on the CPU), both timed before the trace
    assert [(d["after_trace"], d.get("traced_calls")) for d in r["rows"]] == [(False, None), (False, 20)]
    for d in r["rows"]:
        assert {"step_ms", "tokens_per_s", "bound_ms", "step/bound"} <= set(d) and d["jit_leaves"] > 50
        assert d["back_to_back/bound"] == pytest.approx(d["back_to_back_step_ms"] / d["bound_ms"])
    (need,) = r["bytes"]
    parts = ("lm_head", "ple_rows", "globals", "layers", "kv_sliding", "kv_full")
    assert need["total"] == sum(need[k] for k in parts)
    cfg = TINY
    assert need["lm_head"] == cfg.vocab_size * cfg.hidden_size * 2
    # 4 sliding layers read W = 8 positions, 2 full layers all 24, each of 2 rows: 2 KV heads, K and V in bf16
    assert need["kv_sliding"] == 4 * 2 * 8 * 2 * cfg.head_dim * 2 * 2
    assert need["kv_full"] == 2 * 2 * 24 * 2 * cfg.global_head_dim * 2 * 2


def test_back_to_back_time_waits_for_each_groups_last_call_only(monkeypatch):
    """`common.median_back_to_back_us` (decode and verify rows' `back_to_back_step_ms`): after one warm-up call per
    input set, each group issues `calls` calls rotating through the sets before it waits, for the last one only,
    and its figure is the group's wall time over its calls; the median of the groups (a scripted clock)."""
    from jaxspec.bench import common

    clock = iter([0.0, 0.008, 1.0, 1.016, 2.0, 2.012])  # three groups of 8 calls: 1, 2 and 1.5 ms a call
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))
    issued, waited = [], []
    monkeypatch.setattr(common.jax, "block_until_ready", lambda x: waited.append(x) or x)
    figure = common.median_back_to_back_us(lambda i: issued.append(i) or len(issued), iters=3, num_sets=2, calls=8)
    assert figure == pytest.approx(1500.0)
    assert issued == [0, 1] + [0, 1] * 4 * 3
    # the warm-ups' outputs, then each group's last call's output (the clock stops after it)
    assert waited == [1, 2, 10, 18, 26]


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


@pytest.mark.parametrize("argv", [["kernels", "--bs", "1,x"], ["kernels", "--knobs", "bk32w4"],
                                  ["propose", "--variants", "bucketed,split"],
                                  ["e2e", "--modes", "off,bucketed-foo"], ["verify", "--cache", "paged,dense"],
                                  ["decode", "--cache", "paged,stable"]])
def test_bad_lists_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    assert argv[-1] in capsys.readouterr().err  # the error names what was given


def test_verify(tmp_path):
    r = run(tmp_path, "verify", "--preset", "tiny", "--bs", "2", "--ctx", "24", "-k", "3", "--cache",
            "paged,paged-stable")
    assert [(d["cache"], d["bs"], d["ctx"], d["positions"]) for d in r["rows"]] == [("paged", 2, 24, 4),
                                                                                  ("paged-stable", 2, 24, 4)]
    assert {"step_ms", "bound_ms", "step/bound"} <= set(r["rows"][0])
    # the step writing its logits into the donated buffer of its last call computes the same logits, bit for bit
    assert r["rows"][1]["same_logits_as_first_paged"] is True


def test_e2e(tmp_path):
    r = run(tmp_path, "e2e", "--preset", "tiny", "--bs", "2", "--modes", "off,bucketed", "--prompt-len", "12",
            "--new-tokens", "6", "--chunk", "8", "--page-size", "4")
    assert [(e["bs"], e["mode"], e["k"]) for e in r["rows"]] == [(2, "off", 0), (2, "bucketed", 3)]
    for e in r["rows"]:
        assert e["decode_tokens_per_s"] > 0
        # plain decoding commits one token a round; a speculative round 1..k+1 with one acceptance rate per position
        assert len(e["acceptance_per_position"]) == e["k"]
        assert e["mean_accept_length"] == 1.0 if e["k"] == 0 else 1.0 <= e["mean_accept_length"] <= e["k"] + 1
        assert {"launch_ms_per_round", "wait_ms_per_round", "host_ms_per_round", "calls"} <= set(e)


def test_e2e_fused_modes_force_the_drafter_step(tmp_path):
    """bucketed-fused / bucketed-unfused: the bucketed engine with EngineConfig.fused_draft True / False; bucketed
    keeps the default (None: the fused kernels up to FUSED_MAX_BUCKET)."""
    from jaxspec.bench import build_parser, e2e

    args = build_parser().parse_args(["e2e", "--preset", "tiny", "--bs", "1", "--prompt-len", "8", "--new-tokens",
                                      "2", "--chunk", "8", "--page-size", "4"])
    _, pair, _ = e2e.e2e_pair(args)
    got = {mode: e2e.make_engine(pair, 1, mode, 2, args).config for mode in ("bucketed", "bucketed-fused",
                                                                             "bucketed-unfused")}
    assert {m: (c.draft_mode, c.fused_draft) for m, c in got.items()} == {
        "bucketed": ("bucketed", None), "bucketed-fused": ("bucketed", True), "bucketed-unfused": ("bucketed", False)}


def test_e2e_max_context(tmp_path, capsys):
    """--max-context sizes the engine as a server's would be; one too small for the prompts is one line, exit 2."""
    argv = ["e2e", "--preset", "tiny", "--bs", "1", "--modes", "off", "--prompt-len", "12", "--new-tokens", "4",
            "--chunk", "8", "--page-size", "4"]
    r = run(tmp_path, *argv, "--max-context", "96")
    assert r["max_context"] == 96 and [e["generated_tokens"] for e in r["rows"]] == [4]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--max-context", "8", "--json", str(tmp_path / "small.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "does not fit the context of 8" in err and "\n" not in err


def test_e2e_profile_then_trace_summary(tmp_path, capsys):
    """The profiled e2e row carries the trace's figures, None on the CPU (its trace has no device kernels); `trace`
    on that CPU trace, or on a folder without one, says so in one line and exits 2. The summary of a trace with
    device kernels: test_trace_summary_of_a_gpu_trace."""
    prof = str(tmp_path / "prof")
    r = run(tmp_path, "e2e", "--preset", "tiny", "--bs", "1", "--modes", "off,bucketed", "--prompt-len", "8",
            "--new-tokens", "4", "--chunk", "8", "--page-size", "4", "--profile-dir", prof)
    assert [row["mode"] for row in r["rows"]] == ["off", "bucketed"]  # plain and speculative rows, each traced
    for i, row in enumerate(r["rows"]):
        assert row["gpu_busy_fraction"] is None and row["round_gap_us"] is None
        assert os.path.isdir(os.path.join(prof, f"row-{i}"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run(tmp_path, "trace", os.path.join(prof, "row-1"))
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "no device kernels" in line
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


def test_e2e_requests_rounds_per_call_overlap(tmp_path, monkeypatch):
    """--requests N runs N prompts with at most bs at once; each --rounds-per-call x --overlap pair is a row, they
    reach the Engine as keywords only when given, and each row records what the engine ran with."""
    from jaxspec.bench import e2e
    from jaxspec.engine import Engine

    seen = []

    class Recording(Engine):
        def __init__(self, *args, **kwargs):
            seen.append((kwargs.get("rounds_per_call"), kwargs.get("overlap"), kwargs["max_running"]))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(e2e, "Engine", Recording)
    r = run(tmp_path, "e2e", "--preset", "tiny", "--bs", "2", "--requests", "3", "--modes", "off",
            "--rounds-per-call", "1,2", "--overlap", "off", "--prompt-len", "12", "--new-tokens", "6", "--chunk", "8",
            "--page-size", "4")
    assert seen == [(1, False, 2), (2, False, 2)]
    assert [(e["rounds_per_call"], e["overlap"], e["requests"]) for e in r["rows"]] == [(1, False, 3), (2, False, 3)]
    assert all(e["generated_tokens"] == 3 * 6 and "throughput_tokens_per_s" in e for e in r["rows"])
    assert r["prompt_len"] == 12 and r["new_tokens"] == 6


def test_interval_arithmetic_against_a_per_ns_count():
    """union / busy_fraction / idle_after on random integer intervals against counting covered nanoseconds."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        intervals = [(int(s), int(s + d)) for s, d in zip(rng.integers(0, 100, rng.integers(1, 8)),
                                                            rng.integers(1, 30, 8))]
        covered = np.zeros(140, bool)
        for s, e in intervals:
            covered[s:e] = True
        merged = trace.union(intervals)
        assert all(a[1] < b[0] for a, b in zip(merged, merged[1:]))  # sorted, disjoint, not touching
        assert sum(e - s for s, e in merged) == covered.sum()
        wall = max(e for _, e in intervals) - min(s for s, _ in intervals)
        assert trace.busy_fraction(intervals) == pytest.approx(covered.sum() / wall)
        times = rng.integers(0, 140, 6).tolist()
        expected = [0 if covered[t] else int(np.argmax(covered[t:])) for t in times if covered[t:].any()]
        assert trace.idle_after(merged, times) == expected
    assert trace.busy_fraction([]) is None


def test_module_executions():
    """Kernels of one module in a row are one execution, split where its first kernel comes again (a program
    launched twice back to back) or where the module changes; kernels without a module (copies) belong to none."""
    K = trace.Event
    kernels = [K("a", "jit_round", 0, 1), K("copy", "", 1, 2), K("b", "jit_round", 2, 3), K("a", "jit_round", 3, 4),
               K("b", "jit_round", 4, 6), K("x", "jit_draft", 7, 8), K("a", "jit_round", 9, 10)]
    assert trace.module_executions(kernels) == [K("jit_round", "jit_round", 0, 3), K("jit_round", "jit_round", 3, 6),
                                                K("jit_draft", "jit_draft", 7, 8), K("jit_round", "jit_round", 9, 10)]
    assert [trace.is_round_module(n) for n in ("jit_verify_step(7)", "jit_round_program", "jit_draft_bucket",
                                               "jit_prefill_step")] == [True, True, False, False]


def write_gpu_trace(directory, kernels) -> str:
    """A hand-made GPU profiler trace (an XSpace, serialised as jax writes it): one /device:GPU:0 plane whose
    `Stream #s` lines hold `kernels` [(stream, name, hlo_module, start_ns, end_ns)], as the raw traces of the H200
    runs do (no `XLA Modules` line; the module is a kernel stat, with program_id 7)."""
    from jax.profiler import ProfileData

    names = sorted({k[1] for k in kernels} | {k[2] for k in kernels})
    meta = {name: i + 1 for i, name in enumerate(names)}
    lines = []
    for stream in sorted({k[0] for k in kernels}):
        events = "".join(
            f"events {{ metadata_id: {meta[name]} offset_ps: {start * 1000} duration_ps: {(end - start) * 1000} "
            + (f"stats {{ metadata_id: 1001 ref_value: {meta[module]} }} stats {{ metadata_id: 1002 int64_value: 7 }} "
               if module else "") + "} "
            for s, name, module, start, end in kernels if s == stream)
        lines.append(f'lines {{ id: {stream} name: "Stream #{stream}(Kernel)" timestamp_ns: 0 {events}}}')
    text = ('planes { id: 1 name: "/device:GPU:0" ' + " ".join(lines)
            + "".join(f' event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in meta.items())
            + "".join(f' stat_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in meta.items())
            + ' stat_metadata { key: 1001 value { id: 1001 name: "hlo_module" } }'
            + ' stat_metadata { key: 1002 value { id: 1002 name: "program_id" } } }')
    path = directory / "plugins" / "profile" / "1" / "gpu.xplane.pb"
    path.parent.mkdir(parents=True)
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace(text))
    return str(path)


def test_trace_summary_of_a_gpu_trace(tmp_path):
    """Three rounds 1000 ns apart, each a draft (0-200 ns) then a verify (250-700 ns) on stream 1 and a copy
    (300-400 ns) on stream 2 under the verify: busy 650 of every 1000 ns but the last round's 300 idle ns, which the
    wall time (first kernel start to last kernel end) leaves out; 300 ns idle after each round but the last."""
    kernels = []
    for base in (0, 1000, 2000):
        kernels += [(1, "d1", "jit_draft_bucket", base, base + 100), (1, "d2", "jit_draft_bucket", base + 100,
                                                                       base + 200),
                    (1, "v1", "jit_verify_step", base + 250, base + 500),
                    (1, "v2", "jit_verify_step", base + 500, base + 700), (2, "copy", "", base + 300, base + 400)]
    prof = tmp_path / "prof"
    path = write_gpu_trace(prof, kernels)
    r = run(tmp_path, "trace", str(prof))
    assert r["trace"].startswith(str(prof)) and r["trace"].endswith(".xplane.pb") and r["trace"] == path
    assert isinstance(r["kernels"], list) and isinstance(r["modules"], list)
    assert r["rounds"] == 3
    assert r["gpu_busy_fraction"] == pytest.approx(3 * 650 / 2700)
    assert r["decode_wall_us"] == pytest.approx(2.7) and r["round_gap_us"] == pytest.approx(0.3)
    assert r["kernel_launches_per_round"] == 5 and r["module_executions_per_round"] == 2
    assert {m["module"]: (m["calls"], m["us_per_round"]) for m in r["modules"]} == {
        "jit_verify_step(7)": (3, pytest.approx(0.45)), "jit_draft_bucket(7)": (3, pytest.approx(0.2))}
    assert r["kernel_us_per_round"] == pytest.approx(0.2 + 0.45 + 0.1)
    assert run(tmp_path, "trace", str(prof), "--rounds", "6")["kernel_launches_per_round"] == 2.5


def test_call_figures_of_a_gpu_trace(tmp_path):
    """`trace.call_figures` (what `bench propose / verify / decode --profile-dir` put in the traced row): two calls,
    each three kernels (1 + 2 + 3 ns, the third after a 1-ns gap) and a host copy and a memset beside them: 3 kernels
    a call (the graph's nodes), 2 copies, 6 ns of kernels; a call spans 7 ns (10 to 17), 1 ns of it idle; 93 ns
    between the first call's last kernel (17) and the second's first (110). A third call, of another program, makes
    the executions outnumber the calls: no span figures then."""
    from jaxspec.bench import trace

    kernels = []
    for base in (0, 100):
        kernels += [(1, "MemcpyH2D", "", base, base + 5), (1, "fusion_1", "jit_propose", base + 10, base + 11),
                    (1, "draft_q_proj", "jit_propose", base + 11, base + 13),
                    (2, "Memset", "", base + 12, base + 13), (1, "fusion_2", "jit_propose", base + 14, base + 17)]
    f = trace.call_figures(write_gpu_trace(tmp_path / "prof", kernels), 2)
    assert f == {"traced_calls": 2, "traced_kernels_per_call": 3.0, "traced_copies_per_call": 2.0,
                 "traced_kernel_us_per_call": pytest.approx(0.006), "traced_span_us_per_call": pytest.approx(0.007),
                 "traced_idle_in_call_us": pytest.approx(0.001), "traced_idle_between_calls_us": pytest.approx(0.093)}
    g = trace.call_figures(write_gpu_trace(tmp_path / "prof2", kernels + [(1, "other", "jit_x", 300, 301)]), 2)
    assert g["traced_kernels_per_call"] == 3.5
    assert g["traced_span_us_per_call"] is g["traced_idle_in_call_us"] is g["traced_idle_between_calls_us"] is None


def test_profiled_rows_carry_their_trace_and_later_rows_say_so(tmp_path):
    """`propose` with --profile-dir: the first shape's row of the traced variant carries the trace's figures per call
    (None on the CPU: no device kernels), and every row timed after the trace says so (`after_trace`: `bench goals`
    never takes such a figure for a timing goal). decode's traced row: test_decode."""
    prof = str(tmp_path / "prof")
    r = run(tmp_path, "propose", "--preset", "tiny", "--bs", "1,2", "--ctx", "40", "-k", "2", "--variants",
            "bucketed", "--profile-dir", prof)
    first, second = r["rows"]
    assert (first["after_trace"], first["traced_variant"], first["traced_calls"]) == (False, "bucketed", 20)
    assert first["traced_kernels_per_call"] is None  # the CPU's trace
    assert second["after_trace"] is True and "traced_variant" not in second


HLO = """HloModule jit_decode_rounds, entry_computation_layout={()}

%fused_pad.3 (param_0.1: bf16[1,20,256]) -> bf16[1,32,256] {
  %param_0.1 = bf16[1,20,256]{2,1,0} parameter(0)
  ROOT %pad.1 = bf16[1,32,256]{2,1,0} pad(%param_0.1, %c), padding=0_0x0_12x0_0
}

ENTRY %main.9 (p: bf16[1,20,256]) -> f32[5] {
  %loop_pad_fusion.3 = bf16[1,32,256]{2,1,0} fusion(%p), kind=kLoop, calls=%fused_pad.3, metadata={op_name="jit(decode_rounds)/jit(paged_attention)/pad" scheduling_name="loop_pad_fusion.3"}
  %input_reduce_fusion.8 = f32[5]{0} fusion(%loop_pad_fusion.3), kind=kInput, metadata={op_name="jit(decode_rounds)/reduce_sum" deduplicated_name="input_reduce_fusion.5" scheduling_name="input_reduce_fusion.8"}
  ROOT %t = f32[5]{0} copy(%input_reduce_fusion.8)
}
"""


def test_trace_names_kernels_from_the_hlo(tmp_path, capsys):
    """`trace --hlo` gives each listed kernel the shape and jax op of the HLO instruction it was emitted from, by the
    instruction's name or the name of the kernel it shares (`deduplicated_name`), from a plain or an .xz dump; a
    kernel the HLO does not name (a Pallas call) gets none; a missing or unreadable file is one line and exit 2."""
    import lzma

    prof = tmp_path / "prof"
    write_gpu_trace(prof, [(1, "loop_pad_fusion_3", "jit_decode_rounds", 0, 300),
                           (1, "input_reduce_fusion_5", "jit_decode_rounds", 300, 500),
                           (1, "paged_attention", "jit_decode_rounds", 500, 600)])
    (tmp_path / "hlo.txt").write_text(HLO)
    with lzma.open(tmp_path / "hlo.txt.xz", "wt") as f:
        f.write(HLO)
    for name in ("hlo.txt", "hlo.txt.xz"):
        r = run(tmp_path, "trace", str(prof), "--hlo", str(tmp_path / name))
        assert [(k["kernel"], k["shape"], k["op"]) for k in r["kernels"]] == [
            ("loop_pad_fusion_3", "bf16[1,32,256]{2,1,0}", "jit(decode_rounds)/jit(paged_attention)/pad"),
            ("input_reduce_fusion_5", "f32[5]{0}", "jit(decode_rounds)/reduce_sum"),
            ("paged_attention", "", "")]
    assert "jit(decode_rounds)/reduce_sum" in capsys.readouterr().out
    (tmp_path / "bad.xz").write_bytes(b"not xz")
    for missing in ("nothing.txt", "bad.xz"):
        with pytest.raises(SystemExit) as e:
            run(tmp_path, "trace", str(prof), "--hlo", str(tmp_path / missing))
        assert e.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error: --hlo:"), line


def _bench_script(name: str):
    """A script of bench/ (not a package) imported as a module."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv", [["--phases", "3"], ["--phases", "2,x"], ["--phases", "0"], ["--blocks", "0"]])
def test_diag_grid_barrier_bad_input_is_one_line(argv, capsys):
    """bench/diag_grid_barrier.py: odd, non-numeric or zero round counts and an empty grid are one line, exit 2, before
    anything compiles; its XLA baseline's rounds give numpy's (the result the barrier kernel is checked against)."""
    import jax

    diag = _bench_script("diag_grid_barrier")
    assert diag.main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1 and out.err.startswith("error: --")
    x = np.random.default_rng(1).standard_normal((5, diag.ROW)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(diag.xla_chain(4))(x)), diag.expected(x, 4))


def _diag_splits():
    return _bench_script("diag_splits")


def test_diag_splits_variants_equal_one_piece(tmp_path):
    """bench/diag_splits.py (the piece-count diagnosis): every variant (pieces, 64-key blocks, other kernel knobs,
    only the real rows' partials) gives the one-piece kernel's output on its chain of layers, within bf16 rounding,
    and writes a column each."""
    path = tmp_path / "splits.json"
    _diag_splits().main(["--layers", "2", "--iters", "1", "--cases", "128:60", "--tq", "1", "--splits", "1,2",
                         "--wide-splits", "2", "--tunings", "bk16w4st2,bk32w4st2g16r", "--real-rows", "--kv-heads", "2",
                         "--json", str(path)])
    (row,) = json.loads(path.read_text())["rows"]
    assert {k for k in row if k.endswith("_us_per_layer")} == {
        "s1_kernel_us_per_layer", "s2_kernel_us_per_layer", "s2_bk64_kernel_us_per_layer",
        "sdefault_bk16w4st2_kernel_us_per_layer", "sdefault_bk32w4st2g16r_kernel_us_per_layer",
        "sdefault_real_rows_kernel_us_per_layer"}
    assert row["max_abs_diff"] < 0.05  # bf16 values of order 1 after two layers


@pytest.mark.parametrize("argv", [["--splits", "1,-2"], ["--wide-splits", "x"], ["--tunings", "bk16"],
                                  ["--tunings", "bk32w4st2x"]])
def test_diag_splits_bad_lists_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _diag_splits().main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert argv[-1] in err[-1]  # the last line (after usage) names what was given


def _diag_cluster():
    return _bench_script("diag_cluster")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_diag_cluster_kernel_equals_the_chain_and_its_race_shows(capsys):
    """bench/diag_cluster.py (a chain of dependent products in one Mosaic GPU cluster kernel): lowered for CUDA and
    run in Mosaic GPU's interpreter (blocks, shared memory and barriers simulated on the CPU), each config and form
    equals the jnp chain; without its cluster barriers a block reads the next input before the others stored their
    slices, and the check fails (in at least one of its two forms: the interpreter's threads race, so which form
    reads early varies run to run; CI once saw only the prefetch form fail, so it gets up to three tries)."""
    diag = _diag_cluster()
    assert diag.check([(2, 128), (4, 256)], [1, 2]) == 0
    out = capsys.readouterr().out
    assert out.count(" ok") == 8 and "MISMATCH" not in out
    assert any(diag.check([(4, 256)], [2], sync=False) > 0 for _ in range(3))  # a race: up to three tries to show
    assert "MISMATCH" in capsys.readouterr().out


def test_diag_cluster_repeated_chains_its_calls():
    """The device-time form: R calls in one program, each call's output the next one's input (so none is elided),
    equal to the calls made one by one."""
    import numpy as np

    diag = _diag_cluster()
    x, w = diag.inputs(128, 2)
    want = x
    for _ in range(3):
        want = diag.xla_chain(want, w)
    np.testing.assert_array_equal(np.asarray(diag.repeated(diag.xla_chain, 3)(x, w)), np.asarray(want))
    assert not np.array_equal(np.asarray(want), np.asarray(diag.xla_chain(x, w)))


@pytest.mark.parametrize("argv", [["--configs", "4:100"], ["--layers", "0"], ["--configs", "x"],
                                  ["--repeats", "1"]])
def test_diag_cluster_bad_lists_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _diag_cluster().main(argv)
    assert e.value.code == 2
    assert argv[-1] in capsys.readouterr().err.strip().splitlines()[-1]

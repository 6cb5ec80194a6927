"""`bench goals`: goals.json, each project goal read from the newest result file that measured it.

goals.json is built from the result files (bench/results/*.json, written by the other subcommands) by this command,
never by hand, so that every figure in it names the file and the command line it came from. A goal says which files
qualify (their subcommand, model and settings, and the fields of a row), which row field is its value, and the target
that value must meet. The newest qualifying file (by its date, then its mtime) decides; a goal that no file measured
has value, met and source null. Goals are H200 figures (DESIGN.md §8): files from other devices never qualify.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import io
import json
import math
import os
import shlex
from dataclasses import dataclass

from jaxspec.bench.common import print_table
from jaxspec import config
from jaxspec.config import ConfigError

DEVICE = "H200"  # in the device_kind of every file that counts ("NVIDIA H200")
ROW_SETTINGS = ("bs", "mode", "k", "ctx", "cache", "positions", "requests", "rounds_per_call", "overlap")


def is_270m(label) -> bool:
    """The 270M pair's runs: their model label is the checkpoint folder's name (gemma-3-270m-q4_k_m by default)."""
    return "270m" in str(label or "").lower()


@dataclass(frozen=True)
class Goal:
    """`where` maps a field to the value it must have (or a test of it) in a row seen with its file's settings, the
    subcommand included. The value is `field` of the best such row (a file may hold a selection several times, e.g.
    once per rounds_per_call); with `over`, divided by `field` of the best row where `over` replaces those fields."""

    name: str
    target: float
    better: str  # "higher" or "lower"
    issue: int
    where: dict
    field: str
    over: dict | None = None


E4B_1K = {"subcommand": "e2e", "preset": "E4B", "prompt_len": 1024, "tp": 1}  # one device (older files: --tp's default)
E4B_4K = {"preset": "E4B", "ctx": 4096, "after_trace": lambda v: not v}  # timed before any trace of its run
PAIR_270M = {"subcommand": "e2e", "model": is_270m, "bs": 1, "tp": 1}

GOALS = (
    Goal("e2e_e4b_bs1_1k_plain_tok_s", 190, "higher", 13, {**E4B_1K, "bs": 1, "mode": "off"}, "decode_tokens_per_s"),
    Goal("e2e_e4b_bs1_1k_gpu_busy_fraction", 0.9, "higher", 13, {**E4B_1K, "bs": 1, "mode": "bucketed"},
         "gpu_busy_fraction"),
    Goal("e2e_270m_bs1_plain_tok_s", 830, "higher", 13, {**PAIR_270M, "mode": "off"}, "decode_tokens_per_s"),
    Goal("e2e_270m_bs1_spec_over_plain", 1.8, "higher", 13, {**PAIR_270M, "mode": "bucketed"}, "decode_tokens_per_s",
         over={"mode": "off"}),
    Goal("e2e_e4b_bs16_1k_spec_tok_s_per_request", 112.2, "higher", 13, {**E4B_1K, "bs": 16, "mode": "bucketed"},
         "decode_tokens_per_s"),
    Goal("propose_e4b_bs1_4k_us", 200, "lower", 14, {"subcommand": "propose", **E4B_4K, "bs": 1}, "bucketed_us"),
    # the CUDA graph's nodes a bs-1 propose, from a trace of the shipped program (`bench propose --profile-dir`)
    Goal("propose_e4b_bs1_4k_graph_kernels", 50, "lower", 14, {"subcommand": "propose", **E4B_4K, "bs": 1,
                                                                "traced_variant": "bucketed"}, "traced_kernels_per_call"),
    Goal("propose_e4b_bs64_4k_us", 3276, "lower", 14, {"subcommand": "propose", **E4B_4K, "bs": 64}, "bucketed_us"),
    Goal("verify_e4b_bs1_4k_over_bound", 1.5, "lower", 14, {"subcommand": "verify", **E4B_4K, "bs": 1,
                                                            "cache": "paged"}, "step/bound"),
    Goal("verify_e4b_bs16_4k_over_bound", 3.03, "lower", 14, {"subcommand": "verify", **E4B_4K, "bs": 16,
                                                              "cache": "paged"}, "step/bound"),
    Goal("decode_e4b_bs1_4k_over_bound", 1.5, "lower", 14, {"subcommand": "decode", **E4B_4K, "bs": 1,
                                                            "cache": "paged"}, "step/bound"),
    Goal("e2e_270m_bs1_accept_length", 2.8, "higher", 17, {**PAIR_270M, "mode": "bucketed", "k": 3},
         "mean_accept_length"),
    Goal("e2e_270m_bs1_spec_over_plain", 2.5, "higher", 17, {**PAIR_270M, "mode": "bucketed"}, "decode_tokens_per_s",
         over={"mode": "off"}),
)


# ---- reading result files ------------------------------------------------------------------------------------------


def command_options(command: str) -> dict:
    """The options of a result's command line as this package's parser reads them, defaults included: older files
    do not record every setting (e2e's prompt length) at their top level. {} for a line it cannot read."""
    from jaxspec.bench import build_parser  # the package imports this module first

    words = shlex.split(command or "")
    if "jaxspec.bench" not in words:
        return {}
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            options, _ = build_parser().parse_known_args(words[words.index("jaxspec.bench") + 1:])
        except SystemExit:
            return {}
    return vars(options)


def settings(record: dict) -> dict:
    """What a result was measured with: its command's options, overridden by the file's own top-level fields."""
    return {**command_options(record.get("command")),
            **{k: v for k, v in record.items() if not isinstance(v, (list, dict))}}


def timestamp(date) -> float:
    try:
        return datetime.datetime.fromisoformat(date).timestamp()
    except (TypeError, ValueError):
        return -math.inf


# XLA flags that change only what a trace shows, never what production runs
NEUTRAL_XLA_FLAGS = {"--xla_enable_command_buffers_during_profiling=true"}


# the environment switches (jaxspec.config.SWITCHES) as a GPU run ships: anything else is an experiment
SHIPPED_SWITCHES = {"JAXSPEC_PRIME": "1", "JAXSPEC_GC_FREEZE": "1", "JAXSPEC_UNROLL_ROUNDS": "1",
                    "JAXSPEC_ATTN_GATHER_Q": "1", "JAXSPEC_FUSE_QKV": "1", "JAXSPEC_FUSED_NORMS": "1",
                    "JAXSPEC_JOINT_QK_NORM": "1", "JAXSPEC_QKV_KERNEL": None, "JAXSPEC_STAGE_INPUTS": "1",
                    "JAXSPEC_PINNED_INPUTS": "1", "JAXSPEC_SHARED_Q_IN_ATTENTION": "1",
                    "JAXSPEC_QKV_IN_ATTENTION": "1", "JAXSPEC_VERIFY_IN_ATTENTION": "1"}
# None: shipped unset only (JAXSPEC_QKV_KERNEL's default, on in one-position steps, is neither "0" nor "1")
# switches removed with their code, as older result files record them: the value of the form that stayed shipped
RETIRED_SWITCHES = dict(config.RETIRED_SWITCHES)


# jaxlib's environment as shipped (`config.CLIENT_ENV`; unset means this): the stream-executor GPU client
SHIPPED_CLIENT_ENV = {"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "0"}


def switch_matters(name: str, record: dict) -> bool:
    """Whether `name` changes what `record` ran: JAXSPEC_UNROLL_ROUNDS only where a row decoded R > 1 rounds a call
    (with R 1 both settings build the same program)."""
    if name == "JAXSPEC_UNROLL_ROUNDS":
        rows = [row for row in record.get("rows") or [] if isinstance(row, dict)]
        return any(number(row.get("rounds_per_call")) and row["rounds_per_call"] > 1 for row in rows)
    return True


def experiment(path: str, record: dict) -> bool:
    """A run that is not the shipped configuration: other XLA flags than NEUTRAL_XLA_FLAGS, an environment switch
    set otherwise than SHIPPED_SWITCHES where it changes what ran, jaxlib's client environment otherwise than
    SHIPPED_CLIENT_ENV, an opt-in mode that is off by default
    (`--batch-invariant`), or a file named as an experiment (e.g. a change that was measured and reverted). Goals
    never come from one."""
    flags = set(str(record.get("xla_flags") or "").split())
    environment = {**(record.get("switches") or {}), **(record.get("client_env") or {})}
    shipped = {**SHIPPED_SWITCHES, **RETIRED_SWITCHES, **SHIPPED_CLIENT_ENV}
    return (bool(flags - NEUTRAL_XLA_FLAGS) or "experiment" in os.path.basename(path)
            or bool(record.get("batch_invariant"))
            or any(shipped.get(name) != value and switch_matters(name, record) for name, value in environment.items()))


def results(directory: str) -> list[tuple[str, dict]]:
    """(path, record) of every result file in `directory`, newest first (by its date, then its mtime)."""
    if not os.path.isdir(directory):
        raise ConfigError(f"no result folder {directory}")
    found = []
    for path in glob.glob(os.path.join(directory, "*.json")):
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "subcommand" in record and not experiment(path, record):
            found.append((path, record))
    return sorted(found, key=lambda pr: (timestamp(pr[1].get("date")), os.path.getmtime(pr[0])), reverse=True)


# ---- measuring a goal ----------------------------------------------------------------------------------------------


def matches(row: dict, where: dict) -> bool:
    return all(want(row.get(k)) if callable(want) else row.get(k) == want for k, want in where.items())


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def timed_after_trace(record: dict, row: dict, first: dict) -> bool:
    """Whether `row` was timed after its run traced calls (`common.after_trace`; such figures can be slower). Files
    older than that field say so by their command: a run with --profile-dir traced its first shape (bs, ctx) once it
    was timed, so every row of another shape came after the trace."""
    if "after_trace" in row:
        return bool(row["after_trace"])
    traced = "--profile-dir" in str(record.get("command") or "")
    return traced and (row.get("bs"), row.get("ctx")) != (first.get("bs"), first.get("ctx"))


def measure(goal: Goal, record: dict):
    """(value, the settings the row(s) it came from record) of `goal` in one result file, or None if it has no
    such rows. A ratio takes both sides at their best."""
    seen = settings(record)
    rows = [row for row in record.get("rows") or [] if isinstance(row, dict)]
    rows = [{**row, "after_trace": timed_after_trace(record, row, rows[0])} for row in rows]
    pick = max if goal.better == "higher" else min

    def best(where):
        found = [r for r in rows if matches({**seen, **r}, where) and number(r.get(goal.field))]
        return pick(found, key=lambda r: r[goal.field]) if found else None

    def named(row):
        return {k: row[k] for k in ROW_SETTINGS if row.get(k) is not None}

    top = best(goal.where)
    if top is None:
        return None
    if goal.over is None:
        return top[goal.field], named(top)
    bottom = best({**goal.where, **goal.over})
    if bottom is None or not bottom[goal.field]:
        return None
    return top[goal.field] / bottom[goal.field], [named(top), named(bottom)]


def evaluate(goal: Goal, found: list[tuple[str, dict]]) -> dict:
    """The goals.json entry of `goal` from the newest of `found` (newest first) that measured it."""
    entry = {"name": goal.name, "value": None, "target": goal.target, "better": goal.better, "met": None,
             "source": None, "command": None, "issue": goal.issue}
    for path, record in found:
        measured = measure(goal, record) if DEVICE in str(record.get("device_kind", "")) else None
        if measured is not None:
            value, row = measured
            met = value >= goal.target if goal.better == "higher" else value <= goal.target
            return {**entry, "value": value, "met": met, "source": path, "command": record.get("command"), "row": row}
    return entry


# ---- the subcommand ------------------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", default=os.path.join("bench", "results"), help="folder of result files")
    p.add_argument("--out", default=os.path.join("bench", "results", "goals.json"), help="where to write goals.json")


def run(args) -> dict:
    """goals.json from the result files: each goal's value, target and whether it is met, with its source file."""
    found = results(args.results)
    document = {"command": args.command, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "goals": [evaluate(goal, found) for goal in GOALS]}
    print_table(f"goals from {len(found)} result files in {args.results}", [
        ("issue", "issue", "{}"), ("name", "goal", "{}"), ("value", "value", "{:.6g}"), ("better", "better", "{}"),
        ("target", "target", "{:.6g}"), ("met", "met", "{}"), ("source", "source", "{}")],
        [{**g, "source": g["source"] and os.path.basename(g["source"])} for g in document["goals"]])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(document, f, indent=1)
    print(f"\nwrote {args.out}")
    return document

"""`bench trace DIR`: where the device's time goes in a profiler trace of the decode phase.

generate and `bench e2e` start tracing (--profile-dir) at the first decode round, so every device kernel of their
traces belongs to the decode phase. Reported per round: the top kernels, the XLA modules, kernel launches and XLA
module executions (graph launches); for the whole trace: the GPU-busy fraction (the union of the kernel intervals
over the wall time from the first kernel's start to the last kernel's end; kernels on several streams overlap, so
their durations do not add up to busy time) and the median idle gap between a round's last kernel and the next one.
Times are in ns, as `jax.profiler.ProfileEvent.start_ns` / `end_ns` give them.

With --hlo (XLA's optimized HLO of the traced program, `--xla_dump_to`'s *after_optimizations.txt, plain or .xz),
each listed kernel also gets the shape and the jax op (`op_name` metadata) of the fusion it was emitted from: a trace
names kernels by their fusion (`input_reduce_fusion_501`: the HLO's `input_reduce_fusion.501`), not by what they do.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import lzma
import os
import re
from collections import defaultdict
from typing import NamedTuple

import numpy as np

from jaxspec.bench.common import positive, print_table
from jaxspec.config import ConfigError


class Event(NamedTuple):
    """A device kernel, or one execution of an XLA module (then `name` and `module` are both the module's name)."""

    name: str
    module: str  # the XLA module it ran in; "" where the trace does not say (copies)
    start: float  # ns
    end: float  # ns


class NoDeviceKernels(ConfigError):
    """The trace holds no device kernels: a CPU trace has no /device: planes."""


def is_round_module(name: str) -> bool:
    """Whether an XLA module ends a round: the engine's verify program (`jit_verify_step`) or a program that runs
    whole rounds on the device (`round` in its name, DESIGN.md §9). The drafter's and prefill's programs do not."""
    name = name.lower()
    return "verify" in name or "round" in name


# ---- interval arithmetic -------------------------------------------------------------------------------------------


def union(intervals) -> list[tuple[float, float]]:
    """The time covered by (start, end) intervals as sorted, disjoint intervals (touching ones merge)."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def busy_fraction(intervals) -> float | None:
    """Covered time over the wall time from the first start to the last end; None without intervals."""
    merged = union(intervals)
    if not merged:
        return None
    wall = merged[-1][1] - merged[0][0]
    return sum(end - start for start, end in merged) / wall if wall > 0 else 1.0


def idle_after(merged, times) -> list[float]:
    """For each time t (a round's end), how long the device idles from t until the next kernel starts: 0 while a
    kernel still runs past t; nothing for a t after the last kernel. `merged` is the union() of the kernels."""
    starts = [start for start, _ in merged]
    gaps = []
    for t in times:
        i = bisect.bisect_right(starts, t) - 1  # the covered interval starting at or before t
        if i >= 0 and merged[i][1] > t:
            gaps.append(0.0)
        elif i + 1 < len(merged):
            gaps.append(merged[i + 1][0] - t)
    return gaps


def module_executions(kernels) -> list[Event]:
    """XLA module executions derived from the kernels' module names, for a trace without an `XLA Modules` line
    (jax's raw GPU traces have none: xprof derives it later, the same way). Time-ordered kernels of one module form
    one execution; a new one starts where the module changes or where the execution's first kernel comes again (one
    program launched twice back to back, as rounds in flight or R rounds per call do)."""
    executions, opening = [], None
    for k in sorted((k for k in kernels if k.module), key=lambda k: k.start):
        if executions and k.module == executions[-1].module and k.name != opening:
            executions[-1] = executions[-1]._replace(end=max(executions[-1].end, k.end))
        else:
            executions.append(Event(k.module, k.module, k.start, k.end))
            opening = k.name
    return executions


# ---- reading a trace -----------------------------------------------------------------------------------------------


def newest_trace(directory: str) -> str:
    files = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise ConfigError(f"no *.xplane.pb under {directory}")
    return files[-1]


def device_events(path: str) -> tuple[list[Event], list[Event]]:
    """(kernels, module executions) of the /device: planes. Kernels are the events of the `Stream` lines (kernels and
    copies; their module from the `hlo_module` and `program_id` stats); executions are the events of an `XLA Modules`
    line, or derived from the kernels where the trace has none."""
    from jax.profiler import ProfileData

    kernels, executions = [], []
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name == "XLA Modules":
                executions += [Event(ev.name, ev.name, ev.start_ns, ev.end_ns) for ev in line.events]
            elif line.name.startswith("Stream"):
                for ev in line.events:
                    stats = dict(ev.stats)
                    module = str(stats.get("hlo_module") or "")
                    if module and stats.get("program_id") is not None:
                        module = f"{module}({stats['program_id']})"
                    kernels.append(Event(ev.name, module, ev.start_ns, ev.end_ns))
    return kernels, sorted(executions, key=lambda e: e.start) or module_executions(kernels)


def totals(events) -> dict[str, list]:
    """name -> [calls, total µs]."""
    out = defaultdict(lambda: [0, 0.0])
    for ev in events:
        out[ev.name][0] += 1
        out[ev.name][1] += (ev.end - ev.start) / 1e3
    return out


def summarise(path: str, rounds: int | None = None, top: int = 15) -> dict:
    """The figures of one trace. Rounds are the executions of the round modules unless `rounds` (--rounds, e.g. the
    e2e row's engine count) says how many the trace holds; rounds 0: none found, per-round figures are totals."""
    kernels, executions = device_events(path)
    if not kernels:
        raise NoDeviceKernels(f"no device kernels in {path} (a CPU trace has no /device: planes; profile on a GPU)")
    round_ends = sorted(e.end for e in executions if is_round_module(e.name))
    rounds = rounds or len(round_ends)
    per = max(rounds, 1)
    merged = union((k.start, k.end) for k in kernels)
    gaps = idle_after(merged, round_ends)
    kernel_totals, module_totals = totals(kernels), totals(executions)
    total_us = sum(t for _, t in kernel_totals.values())
    return {"trace": path, "rounds": rounds, "kernel_us_per_round": total_us / per,
            "kernel_launches_per_round": len(kernels) / per,
            "module_executions_per_round": len(executions) / per if executions else None,
            "gpu_busy_fraction": busy_fraction(merged), "decode_wall_us": (merged[-1][1] - merged[0][0]) / 1e3,
            "round_gap_us": float(np.median(gaps)) / 1e3 if gaps else None,
            "modules": [{"module": name[:90], "calls": n, "us_per_round": t / per}
                        for name, (n, t) in sorted(module_totals.items(), key=lambda kv: -kv[1][1])],
            "kernels": [{"kernel": name[:90], "calls": n, "us_per_round": t / per, "share": t / (total_us or 1.0)}
                        for name, (n, t) in sorted(kernel_totals.items(), key=lambda kv: -kv[1][1])[:top]]}


# what a Stream line holds besides kernels: host<->device copies and memsets (outside the CUDA graph of a call)
COPY_EVENT = re.compile(r"^Mem(cpy|set)")
CALL_FIGURES = ("traced_kernels_per_call", "traced_copies_per_call", "traced_kernel_us_per_call",
                "traced_span_us_per_call", "traced_idle_in_call_us", "traced_idle_between_calls_us")  # call_figures'


def call_figures(path: str, calls: int) -> dict:
    """Per call, from a trace of `calls` calls of one program and nothing else (`common.profile_calls`): its kernels
    (the CUDA graph's nodes, with XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true keeping the graph as
    production runs it), the copies and memsets beside them, and the kernels' µs; then where the device idles: a
    call's span (its first kernel's start to its last kernel's end, the calls told apart as `module_executions` does),
    the time inside that span no kernel runs (the graph's own gaps between nodes) and the mean time between one
    call's last kernel and the next call's first (the host's launch and wait, where calls are timed one at a time).
    The span figures are None where the kernels do not split into `calls` executions."""
    kernels, _ = device_events(path)
    if not kernels:
        raise NoDeviceKernels(f"no device kernels in {path} (a CPU trace has no /device: planes; profile on a GPU)")
    launched = [k for k in kernels if not COPY_EVENT.match(k.name)]
    figures = (len(launched), len(kernels) - len(launched), sum(k.end - k.start for k in launched) / 1e3)
    out = {"traced_calls": calls, **{name: value / calls for name, value in zip(CALL_FIGURES, figures)}}
    executions = module_executions(launched)
    spans = idle = between = None
    if len(executions) == calls:
        spans = sum(e.end - e.start for e in executions) / 1e3 / calls
        starts, of_call = [e.start for e in executions], defaultdict(list)
        for k in launched:  # each kernel to the call whose span it starts in
            of_call[bisect.bisect_right(starts, k.start) - 1].append((k.start, k.end))
        busy = sum(end - start for ks in of_call.values() for start, end in union(ks))
        idle = spans - busy / 1e3 / calls
        between = (sum(b.start - a.end for a, b in zip(executions, executions[1:])) / 1e3 / (calls - 1)
                   if calls > 1 else None)
    return {**out, "traced_span_us_per_call": spans, "traced_idle_in_call_us": idle,
            "traced_idle_between_calls_us": between}


# one HLO instruction: `%name = shape opcode(...)`, then its metadata (op_name, deduplicated_name)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_DEDUPLICATED = re.compile(r'deduplicated_name="([^"]*)"')


def hlo_kernels(text: str) -> dict[str, tuple[str, str]]:
    """{kernel name as a trace gives it: (shape, jax op)} of every instruction in an HLO module's text. A kernel is
    named after its instruction with '.' as '_'; instructions that share one kernel (`deduplicated_name`) map to
    the first of them. Nested computations' instructions are included (a trace names only emitted ones)."""
    found: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        op = _OP_NAME.search(line)
        entry = (m.group(2), op.group(1) if op else "")
        dedup = _DEDUPLICATED.search(line)
        for name in (m.group(1), dedup.group(1) if dedup else None):
            if name:
                found.setdefault(name.replace(".", "_"), entry)
    return found


def read_hlo(path: str) -> str:
    if not os.path.isfile(path):
        raise ConfigError(f"--hlo: no file {path}")
    try:
        with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as f:
            return f.read()
    except (OSError, lzma.LZMAError, UnicodeDecodeError) as e:
        raise ConfigError(f"--hlo: cannot read {path}: {e}") from e


def annotate(kernels: list[dict], names: dict[str, tuple[str, str]]) -> list[dict]:
    """The summary's kernel rows with the shape and op of the fusion each came from ("" where the HLO has no
    instruction of that name: custom calls such as Pallas kernels, copies)."""
    return [dict(k, **dict(zip(("shape", "op"), names.get(k["kernel"], ("", ""))))) for k in kernels]


# ---- the subcommand ------------------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="a --profile-dir of generate or `bench e2e` (its newest *.xplane.pb is read)")
    p.add_argument("--top", type=positive, default=15, help="kernels to list")
    p.add_argument("--rounds", type=positive, help="rounds in the trace (default: the executions of the verify / "
                   "round modules; the e2e JSON's `rounds` of the profiled run)")
    p.add_argument("--hlo", help="XLA's optimized HLO of the traced program (*after_optimizations.txt, or .xz): "
                   "name each kernel's shape and jax op")


def optional(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def run(args) -> dict:
    """The top device kernels and XLA modules of a profiler trace per round, its GPU-busy fraction and round gaps."""
    names = hlo_kernels(read_hlo(args.hlo)) if args.hlo else None
    s = summarise(newest_trace(args.dir), args.rounds, args.top)
    if names is not None:
        s["kernels"] = annotate(s["kernels"], names)
    if not s["rounds"]:
        print("note: no verify / round module found in the trace: figures are totals (pass --rounds N for per-round)")
    print_table(f"XLA modules of {s['trace']} ({s['rounds']} rounds)",
                [("module", "module", "{}"), ("calls", "calls", "{}"), ("us_per_round", "us/round", "{:.1f}")],
                s["modules"])
    print_table(f"top {args.top} device kernels (all kernels: {s['kernel_us_per_round']:.1f} us/round in "
                f"{s['kernel_launches_per_round']:.0f} launches/round)",
                [("kernel", "kernel", "{}"), ("calls", "calls", "{}"), ("us_per_round", "us/round", "{:.1f}"),
                 ("share", "share", "{:.1%}")]
                + ([("shape", "shape", "{:.32}"), ("op", "op", "{:.70}")] if names is not None else []), s["kernels"])
    print(f"\nGPU busy {s['gpu_busy_fraction']:.1%} of the {s['decode_wall_us']:.0f} us from the first kernel to the "
          f"last; idle after a round: median {optional(s['round_gap_us'], '{:.1f}')} us; "
          f"{optional(s['module_executions_per_round'], '{:.1f}')} XLA module executions (graph launches) per round")
    return s

"""`bench trace DIR`: the device kernels and XLA modules of a profiler trace, per round."""

from __future__ import annotations

import argparse
import os

from jaxspec.bench.common import positive, print_table
from jaxspec.config import ConfigError


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="a --profile-dir of generate or `bench e2e` (its newest *.xplane.pb is read)")
    p.add_argument("--top", type=positive, default=15, help="kernels to list")
    p.add_argument("--rounds", type=positive, help="rounds in the trace (default: the calls of the verify "
                   "module; the e2e JSON's `rounds` of the profiled run)")


def run(args) -> dict:
    """The top device kernels and XLA modules of a profiler trace, per round (one round = one verify module)."""
    import glob
    from collections import defaultdict

    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(args.dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise ConfigError(f"no *.xplane.pb under {args.dir}")
    data = ProfileData.from_file(files[-1])
    kernels, modules = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            table = modules if line.name == "XLA Modules" else kernels if line.name.startswith("Stream") else None
            if table is None:
                continue
            for ev in line.events:
                entry = table[ev.name]
                entry[0] += 1
                entry[1] += ev.duration_ns / 1e3
    rounds = args.rounds or max((n for name, (n, _) in modules.items() if "verify" in name), default=0)
    if not rounds:  # the trace has no module line: totals, unless --rounds says how many rounds it holds
        print("note: no XLA module line in the trace: figures are totals (pass --rounds N for per-round)")
        rounds = 1
    total = sum(t for _, t in kernels.values()) or 1.0
    launches = sum(n for n, _ in kernels.values()) / rounds
    krows = [{"kernel": name[:90], "calls": n, "us_per_round": t / rounds, "share": t / total}
             for name, (n, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]]
    mrows = [{"module": name[:90], "calls": n, "us_per_round": t / rounds}
             for name, (n, t) in sorted(modules.items(), key=lambda kv: -kv[1][1])]
    print_table(f"XLA modules of {files[-1]} ({rounds} rounds)",
                [("module", "module", "{}"), ("calls", "calls", "{}"), ("us_per_round", "us/round", "{:.1f}")], mrows)
    print_table(f"top {args.top} device kernels (all kernels: {total / rounds:.1f} us/round in {launches:.0f} "
                f"launches/round)",
                [("kernel", "kernel", "{}"), ("calls", "calls", "{}"), ("us_per_round", "us/round", "{:.1f}"),
                 ("share", "share", "{:.1%}")], krows)
    return {"trace": files[-1], "rounds": rounds, "kernel_us_per_round": total / rounds,
            "kernel_launches_per_round": launches, "modules": mrows,
            "kernels": krows}

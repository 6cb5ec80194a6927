"""`python -m jaxspec.bench SUBCOMMAND`: GPU figures with random bf16 weights at the public sizes (DESIGN.md §8).

    kernels   gather_kv_indices vs a whole-row translation; paged_attention vs its XLA reference
    propose   the bucketed drafter (command buffers on and off) vs the eager drafter
    decode    one target decode step over the dense and the paged cache, against the HBM bound
    verify    one verify step (k + 1 positions) over the paged cache, against the HBM bound
    e2e       the engine end to end: tokens/s, accept length, the round's time split
    serve     the OpenAI server under N concurrent streaming clients: throughput, TTFT, inter-token latency
    trace     summarise a profiler trace: kernels and modules per round, GPU-busy fraction, gaps between rounds
    graph     kernel launches per call of propose / verify / decode, counted in XLA's optimized HLO (no GPU needed)
    memory    KV bytes per request with and without the SWA pool (arithmetic only)
    goals     goals.json: each project goal from the newest result file that measured it

Each subcommand but goals prints fixed-width tables and writes JSON (--json; default
bench/results/<subcommand>-<time>.json) with the jax version, the device, the date and the command line; goals reads
those files and writes goals.json (--out).

The parser and `main` live here rather than in __main__.py: `python -m` runs __main__ as a fresh module, and the
package importing it first would load it twice.
"""

from __future__ import annotations

import argparse
import sys

from jaxspec.bench import decode, e2e, goals, graph, kernels, memory, propose, serve, trace
from jaxspec.bench.common import HBM_BYTES_PER_S, ResultFile, command_line, positive
from jaxspec.config import ConfigError

# name -> (add its options, run it); each run returns the result its JSON records
SUBCOMMANDS = {
    "kernels": (kernels.add_args, kernels.run),
    "propose": (propose.add_args, propose.run),
    "decode": (decode.add_args, decode.run),
    "verify": (decode.add_verify_args, decode.run_verify),
    "e2e": (e2e.add_args, e2e.run),
    "memory": (memory.add_args, memory.run),
    "trace": (trace.add_args, trace.run),
    "graph": (graph.add_args, graph.run),
    "serve": (serve.add_args, serve.run),
}
# the same for subcommands that read result files and write their own output, without the measuring options
REPORTS = {"goals": (goals.add_args, goals.run)}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--iters", type=positive, default=100, help="timed calls per figure (>= 50 for results)")
    common.add_argument("--json", help="where to write the results (default bench/results/<subcommand>-<time>.json)")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--page-size", type=positive, default=16)
    common.add_argument("--profile-dir", help="write a jax profiler trace here: propose / decode / verify trace 20 "
                        "calls of the first bucketed or paged figure (`python -m jaxspec.bench trace DIR --rounds "
                        "20`), e2e each bucketed and plain run of the first bs into DIR/row-N (`... trace DIR/row-N`, and "
                        "its row gets gpu_busy_fraction and round_gap_us); set XLA_FLAGS=--xla_enable_command_"
                        "buffers_during_profiling=true to keep the CUDA graphs as production runs them")
    common.add_argument("--hbm-bw", type=float, default=HBM_BYTES_PER_S, help="HBM bytes/s of the bound")
    parser = argparse.ArgumentParser(prog="python -m jaxspec.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="subcommand", required=True)
    for name, (add_args, run) in SUBCOMMANDS.items():
        add_args(sub.add_parser(name, parents=[common], help=run.__doc__.split("\n")[0]))
    for name, (add_args, run) in REPORTS.items():
        add_args(sub.add_parser(name, help=run.__doc__.split("\n")[0]))
    return parser


def run_or_exit(run, args) -> dict:
    """run(args), with a ConfigError printed as one line and turned into exit status 2."""
    try:
        return run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv=None) -> dict:
    """Run one subcommand, print its tables, write its JSON; returns what was written."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = command_line(argv)
    if args.subcommand in REPORTS:
        return run_or_exit(REPORTS[args.subcommand][1], args)
    out = ResultFile(args)
    args.write_partial = lambda result: out.write(result, partial=True)  # long runs save each row as it lands
    record = out.write(run_or_exit(SUBCOMMANDS[args.subcommand][1], args))
    print(f"\nwrote {out.path}")
    return record

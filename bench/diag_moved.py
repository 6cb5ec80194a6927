"""Which CUDA-graph nodes XLA re-records before a launch when given buffers move, read off a compile's dump.

Before each launch of a command buffer XLA re-records every node (kernel) that touches a buffer allocation whose
address changed since the last launch (`CommandExecutor::RecordUpdate`, xla/backends/gpu/runtime/command_executor.cc:
a command is skipped only when none of its allocations is among the updated ones), ~2.5 us of host time a node on the
H200 (BENCHMARKS.md session 20). An allocation is a parameter, an output, or the program's one preallocated temp
buffer, and XLA's buffer assignment places temporaries inside output allocations whenever their lifetimes allow, so a
moved output moves every kernel that touches one of its temporaries too. This script maps each kernel of the entry
computation (fusions, custom calls, scatters, copies) to the allocations it reads and writes, from the files
`--xla_dump_to` writes (`*after_optimizations.txt` and `*after_optimizations-buffer-assignment.txt`; a GPU compile's,
or one for an H200 described to XLA: `bench graph` on a CPU-only machine), and counts the kernels touching a set.

    XLA_FLAGS="--xla_dump_to=/tmp/d --xla_dump_hlo_module_re=.*paged_decode_step.*" \\
        python -m jaxspec.bench graph --programs verify --bs 1
    python bench/diag_moved.py /tmp/d tokens=p53 logits=31

A set is `name=` a comma list of allocation indices or `pN` (the allocation of entry parameter N). Without sets it
reports the standard ones: the small integer and bool parameters not aliased to an output (the per-call inputs,
and any integer weights), the outputs that are not parameters, and the temp buffer.
"""

from __future__ import annotations

import glob
import os
import re

from jaxspec.cli import Parser, run_cli
from jaxspec.config import ConfigError

# instructions that run as a kernel (a GPU program's are fusions, custom calls, scatters, copies; a CPU compile's may
# also leave a concatenate or an update unfused)
LAUNCHES = ("fusion", "custom-call", "scatter", "copy", "sort", "concatenate", "dynamic-update-slice")


def read_dump(directory: str, module: str = "") -> tuple[str, str]:
    """(optimized HLO text, buffer assignment text) of the one module in `directory` whose name matches `module`."""
    found = [p for p in glob.glob(os.path.join(directory, "*after_optimizations-buffer-assignment.txt"))
             if re.search(module, os.path.basename(p))]
    if len(found) != 1:
        hint = " (a program loaded from jax's persistent compile cache writes no dump: compile it with the cache " \
            "off, e.g. JAX_COMPILATION_CACHE_DIR unset)" if not found else ""
        raise ConfigError(f"expected one buffer assignment matching {module!r} in {directory}, found {len(found)}"
                          + hint)
    hlo = found[0].replace("-buffer-assignment.txt", ".txt")
    with open(hlo) as f, open(found[0]) as g:
        return f.read(), g.read()


def allocations(assignment: str) -> tuple[dict[int, tuple[int, str]], dict[tuple[str, str], int]]:
    """({index: (size, description)}, {(instruction, shape index): allocation index})."""
    kinds, where, current = {}, {}, None
    for line in assignment.splitlines():
        m = re.match(r"allocation (\d+): size (\d+), (.*)", line)
        if m:
            current = int(m.group(1))
            kinds[current] = (int(m.group(2)), m.group(3))
            continue
        m = re.match(r" value: <\d+ (\S+?)(\{[\d,]*\})? @\d+>", line)
        if m and current is not None:
            where[(m.group(1), m.group(2) or "{}")] = current
        if line.startswith("Total bytes"):
            break
    return kinds, where


def kernel_allocations(hlo: str, where: dict) -> list[tuple[str, set[int]]]:
    """Each launching instruction of the entry computation, in order, with the allocations it touches."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}\n")]
    insts, order = {}, []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .+? ([\w-]+)\((.*?)\)(, .*)?$", line)
        if not m:
            continue
        index = re.search(r"index=(\d+)", line)
        insts[m.group(1)] = (m.group(2), re.findall(r"%([\w.\-]+)", m.group(3)), index and index.group(1))
        order.append(m.group(1))

    def of(name, shape_index="{}"):
        op, operands, index = insts.get(name, (None, [], None))
        if op == "get-tuple-element":
            return of(operands[0], "{%s}" % index)
        if op == "bitcast":
            return of(operands[0], shape_index)
        found = {where[k] for k in ((name, shape_index), (name, "{}")) if k in where}
        return found or {a for (n, _), a in where.items() if n == name}  # a tuple: all its elements

    out = []
    for name in order:
        op, operands, _ = insts[name]
        if op in LAUNCHES:
            out.append((name, of(name).union(*(of(o) for o in operands))))
    return out


def standard_sets(kinds: dict) -> dict[str, set[int]]:
    params = {a for a, (_, k) in kinds.items() if "parameter" in k}
    small = {a for a in params if kinds[a][0] <= 1 << 18 and re.search(r"\|(s32|u32|pred)\[", kinds[a][1])
             and "maybe-live-out" not in kinds[a][1]}
    outputs = {a for a, (_, k) in kinds.items() if "maybe-live-out" in k and a not in params
               and "output shape is |(" not in k}  # a tuple's allocation holds only its pointers
    temps = {a for a, (_, k) in kinds.items() if "temp" in k}
    return {"int parameters": small, "outputs": outputs, "both": small | outputs, "temp": temps}


def parse_set(spec: str, kinds: dict) -> tuple[str, set[int]]:
    name, sep, items = spec.partition("=")
    if not (name and sep and re.fullmatch(r"p?\d+(,p?\d+)*", items)):
        raise ConfigError(f"a set is NAME=ALLOC,pN,... (allocation indices, pN for entry parameter N), got {spec!r}")
    chosen = set()
    for item in items.split(","):
        if item.startswith("p"):
            found = {a for a, (_, k) in kinds.items() if re.search(rf"parameter {int(item[1:])},", k)}
            if not found:
                raise ConfigError(f"{spec!r}: the program has no entry parameter {item[1:]}")
            chosen |= found
        elif int(item) not in kinds:
            raise ConfigError(f"{spec!r}: the buffer assignment has no allocation {item}")
        else:
            chosen.add(int(item))
    return name, chosen


def count(kernels: list[tuple[str, set[int]]], moved: set[int]) -> int:
    return sum(1 for _, touched in kernels if touched & moved)


def main(argv=None) -> int:
    """Bad input (no dump, a malformed or unknown set) is one line on stderr and exit status 2."""
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("dump", help="the --xla_dump_to directory")
    p.add_argument("sets", nargs="*", help="name=ALLOC,pN,... (default: int parameters, outputs, both, temp)")
    p.add_argument("--module", default="", help="a regex picking the module when the dump holds several")
    args = p.parse_args(argv)
    return run_cli(report, args)


def report(args) -> int:
    hlo, assignment = read_dump(args.dump, args.module)
    kinds, where = allocations(assignment)
    kernels = kernel_allocations(hlo, where)
    sets = dict(parse_set(s, kinds) for s in args.sets) if args.sets else standard_sets(kinds)
    print(f"{len(kernels)} kernels")
    for name, moved in sets.items():
        print(f"{name} (allocations {sorted(moved)}): {count(kernels, moved)} kernels re-recorded when they move")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

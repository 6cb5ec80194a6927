"""`bench graph`: how many kernels a program launches, counted in XLA's optimized HLO — on an H200, or for one
without it.

Issue #14's goals are launch counts as much as times: every kernel costs ~1 µs on the H200 even when it does nothing,
and the verify step launches ~800 of them. `bench trace` counts them in a profile of a GPU run; this counts them in
the compiled program, so that a change to the programs can be measured on a CPU-only machine. On a GPU backend the
program is compiled for the device; elsewhere for an H200 described to XLA (`H200_TARGET`, a GpuTargetConfigProto:
XLA's deviceless ahead-of-time compilation through `jax.experimental.topologies`), which needs the CUDA plugin
installed beside the CPU jaxlib (`pip install 'jax[cuda13]==0.11.2'`, ~4 GB) and no GPU. Without a device XLA
cannot autotune, so its GEMMs take its heuristic tilings: their split-K reduction kernels may differ from a device
compile's (the `gemm` and `dot fusions` columns); everything else is the same program.

Counted: every instruction of the entry computation that XLA runs as a kernel (fusions, Pallas and library custom
calls, scatters, copies...), calls inlined and while bodies times their known trip count; parameters, constants,
tuples and bitcasts launch nothing. The programs are those the goals measure, at the goals' shapes: `propose` (the
bucketed drafter's program for one bucket, BucketedDrafter as the engine builds it), `verify` (k + 1 positions per
row) and `decode` (1 position) over the paged cache (`bench verify` / `bench decode`'s step), and `round`: the
engine's decode program of R speculative rounds (draft, verify, accept; `Programs.decode_rounds` compiled as the
engine's Runner compiles it), what a served request's decoding launches.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import re
import time
import types

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jaxspec import staging
from jaxspec.bench.common import DTYPE, PRESET_NAMES, names_from, positive, print_table, sizes
from jaxspec.config import FULL, AssistantConfig, ConfigError, TargetConfig, bench_pair
from jaxspec.paged_kv.cache import LayerKV
from jaxspec.paged_kv.metadata import CacheSpec, PageTables

PROGRAMS = ("propose", "verify", "decode", "round")

# An H200 SXM as XLA's GPU compiler sees one (stream_executor.GpuTargetConfigProto, text format): Hopper sm_90 with
# 132 SMs, 228 KiB of shared memory an SM (227 KiB a block opted in), 50 MiB of L2, 141 GB of HBM3e at 4.8 TB/s.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200"
"""

# HLO instructions that launch nothing (views, bookkeeping) and the second half of async pairs
NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
             "replica-id", "opt-barrier", "add-dependency", "domain"}


# ---- counting ------------------------------------------------------------------------------------------------------


def parse_hlo(text: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """An HLO module's text -> ({computation: [(opcode, line)]}, the entry computation's name)."""
    comps, current, entry = {}, None, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            inst = re.match(r"\s+(?:ROOT )?%[\w.\-]+ = .*?\s([a-z][a-z0-9\-]*)\(", line)
            if inst:
                comps[current].append((inst.group(1), line))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _kind_and_name(op: str, line: str) -> tuple[str, str]:
    """(kind, name) of a kernel: kind gemm / pallas / fusion / custom-call / the opcode; name the jax op it was
    emitted from (`op_name` metadata's last part), a Pallas kernel's own name."""
    op_name = re.search(r'op_name="([^"]+)"', line)
    parts = re.sub(r"\[[^\]]*\]", "", op_name.group(1)).split("/") if op_name else ["?"]
    name = parts[-1]
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', line).group(1)
        if target == "__gpu$xla.gpu.triton":
            return "pallas", parts[-2] if name == "pallas_call" and len(parts) > 1 else name
        return ("gemm" if "gemm" in target or "matmul" in target else "custom-call"), name
    if op == "fusion":
        kind = re.search(r'"kind":"(\w+)"', line)
        gemm = kind and "gemm" in kind.group(1) or re.search(r"calls=%\S*gemm", line)
        return ("gemm" if gemm else "fusion"), name
    return op, name


def launch_order(text: str) -> tuple[list[tuple[str, str, str, int]], list[str]]:
    """The kernels a run of the module launches, in launch order: [(kind, name, output shape, times)] (times: how
    often that launch repeats in place, a while body's kernels once per trip), and notes on what could not be
    followed exactly (a while loop without a known trip count, followed once; a conditional, its largest branch)."""
    comps, entry = parse_hlo(text)
    notes: list[str] = []

    def walk(name: str, times: int) -> list[tuple[str, str, str, int]]:
        out = []
        for op, line in comps[name]:
            if op in NO_KERNEL or op.endswith("-done"):
                continue
            if op == "call":
                out += walk(re.search(r"to_apply=%([\w.\-]+)", line).group(1), times)
            elif op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                if trips is None:
                    notes.append("a while loop without a known trip count: its body counted once")
                out += walk(re.search(r"body=%([\w.\-]+)", line).group(1), times * (int(trips.group(1)) if trips
                                                                                    else 1))
            elif op == "conditional":
                branches = re.findall(r"%([\w.\-]+)", re.search(r"(branch_computations=\{[^}]*\}|true_computation="
                                                                 r"%[\w.\-]+, false_computation=%[\w.\-]+)",
                                                                 line).group(1))
                out += max((walk(branch, times) for branch in branches), key=lambda o: sum(t for *_, t in o))
                notes.append("a conditional: its largest branch counted")
            else:
                shape = re.match(r"\s+(?:ROOT )?%[\w.\-]+ = (.*?) [a-z][a-z0-9\-]*\(", line)
                out.append((*_kind_and_name(op, line), shape.group(1) if shape else "?", times))
        return out

    order = walk(entry, 1)
    return order, sorted(set(notes))


def count_launches(text: str) -> tuple[collections.Counter, list[str]]:
    """Kernels a run of the module launches: Counter {(kind, name): n}, and notes on what could not be counted
    exactly (a while loop without a known trip count, counted once; a conditional, counted as its largest
    branch)."""
    order, notes = launch_order(text)
    counter = collections.Counter()
    for kind, name, _, times in order:
        counter[(kind, name)] += times
    return counter, notes


# ---- the programs, abstract and placed on the target ---------------------------------------------------------------


def target_device():
    """(the device to compile for, whether it is described rather than present): the first GPU where jax has one,
    else an H200 described to XLA (the CUDA plugin installed, no GPU needed)."""
    if jax.default_backend() == "gpu":
        return jax.devices()[0], False
    from jax.experimental import topologies
    try:
        topology = topologies.get_topology_desc("h200", "cuda", target_config=H200_TARGET, topology="1x1x1")
    except (NotImplementedError, RuntimeError) as e:
        raise ConfigError("bench graph without a GPU compiles for an H200 through the CUDA plugin, which is not "
                          "installed or did not load: pip install 'jax[cuda13]==0.11.2' (no driver needed; "
                          f"{str(e)[:120]})") from e
    return topology.devices[0], True


def placed(tree, sharding):
    """ShapeDtypeStructs of a pytree of shapes, each with `sharding` (None: jax places them by default)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def abstract_state(cfg: TargetConfig, acfg: AssistantConfig, batch: int, ctx: int, page_size: int = 16,
                   sharding=None):
    """Shapes of what the programs read, at `batch` requests of up to `ctx` positions: (cache spec, target params,
    drafter params, the K/V stacks {type: LayerKV}, page tables), every leaf a ShapeDtypeStruct with `sharding`."""
    from jaxspec.model.weights import random_assistant_params, random_target_params

    spec = CacheSpec(page_size=page_size, num_full_pages=batch * -(-ctx // page_size) + 8,
                     num_swa_pages=batch * (-(-cfg.sliding_window // page_size) + 8) + 8,
                     max_pages_per_request=-(-ctx // page_size))
    target = jax.eval_shape(functools.partial(random_target_params, cfg, 0, DTYPE))
    assistant = jax.eval_shape(functools.partial(random_assistant_params, acfg, 0, DTYPE))
    kv = {}
    for t, layers in cfg.kv_layers.items():
        if layers:
            pages = spec.num_full_pages if t == FULL else spec.num_swa_pages
            shape = (len(layers), pages * page_size, cfg.type_kv_heads(t), cfg.type_head_dim(t))
            kv[t] = LayerKV(k=jax.ShapeDtypeStruct(shape, DTYPE), v=jax.ShapeDtypeStruct(shape, DTYPE))
    pages = PageTables(page_table=jax.ShapeDtypeStruct((batch, spec.max_pages_per_request), jnp.int32),
                       swa_of_full=jax.ShapeDtypeStruct((spec.num_full_pages,), jnp.int32))
    return spec, *(placed(tree, sharding) for tree in (target, assistant, kv, pages))


def compiled_text(program: str, preset: str, bs: int, ctx: int, k: int, page_size: int, device,
                  rounds: int = 1) -> str:
    """XLA's optimized HLO of one program, compiled for `device` (rounds: the round program's R)."""
    from jaxspec.aot import lower_ahead, matmul_precision
    from jaxspec.bench.decode import paged_decode_step
    from jaxspec.draft.bucketed import DRAFT_COMPILER_OPTIONS, BucketedDrafter
    from jaxspec.engine.programs import DecodeState, Programs, Weights
    from jaxspec.model import gemma4

    cfg, acfg = bench_pair(preset)
    staged = staging.enabled()  # as the engine's programs and BucketedDrafter take it
    sharding = SingleDeviceSharding(device)
    spec, target, assistant, kv, pages = abstract_state(cfg, acfg, bs, ctx, page_size, sharding)
    if program == "propose":
        # pinned inputs as on a GPU (`staging.pinned_enabled`), whatever backend compiles
        drafter = BucketedDrafter(assistant, acfg, target["embed"], cfg, k, buckets=(bs,), seed_slots=bs + 1,
                                  pinned_inputs=staged and staging.pinned_enabled("gpu"))
        drafter.cache, drafter.device = types.SimpleNamespace(kv=kv, spec=spec, swa_of_full=pages.swa_of_full), device
        drafter.compile()  # what attach() compiles, against the abstract cache
        return drafter.executables[bs].as_text()
    params = placed(jax.eval_shape(gemma4.stored_params, target), sharding)  # as the engine keeps them
    vec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)  # noqa: E731
    if program == "round":
        programs = Programs(cfg=cfg, acfg=acfg, spec=spec, k=k, draft_mode="bucketed", use_kernels=True,
                            eos=tuple(cfg.eos_token_ids), stage_inputs=staged)
        state = placed(jax.eval_shape(lambda: DecodeState.empty(bs + 1, cfg.hidden_size, DTYPE)), sharding)
        lowered = lower_ahead(programs.decode_rounds(rounds, False), Weights(target=params, assistant=assistant),
                              kv, state, vec(bs), pages, donate_argnames=("kv", "state"),
                              compiler_options=DRAFT_COMPILER_OPTIONS, precision=matmul_precision(DTYPE))
        return lowered.compile().as_text()
    T = k + 1 if program == "verify" else 1
    lowered = paged_decode_step.trace(params, kv, pages, vec(bs, T), vec(bs), vec(bs), cfg=cfg, spec=spec,
                                      staged=staged).lower()
    return lowered.compile().as_text()


# ---- the subcommand ------------------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, default="E4B")
    p.add_argument("--programs", type=names_from(PROGRAMS), default=list(PROGRAMS),
                   help="propose (the bucketed drafter), verify (k + 1 positions), decode (1 position), round (the "
                   "engine's decode program: R rounds of draft, verify, accept)")
    p.add_argument("--bs", type=sizes, help="batch sizes (default: the goals': propose 1,64, verify 1,16, decode 1)")
    p.add_argument("--ctx", type=positive, default=4096, help="positions per request")
    p.add_argument("-k", type=positive, default=3, help="draft steps (propose) / drafts verified (verify)")
    p.add_argument("--rounds", type=positive, default=1, help="R of the round program (rounds per call)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per program, by jax op (0: none)")
    p.add_argument("--sequence", type=int, default=0,
                   help="also list each program's first N kernels in launch order (kind, jax op, output)")
    p.add_argument("--hlo-dir", help="also write each program's optimized HLO here")


GOAL_SIZES = {"propose": [1, 64], "verify": [1, 16], "decode": [1], "round": [1]}


def run(args) -> dict:
    """Kernel launches of the propose / verify / decode programs, counted in XLA's optimized HLO for an H200."""
    # before jax first looks for backends: the CUDA plugin's check of the CUDA libraries' versions needs a driver,
    # which a CPU-only machine lacks (the plugin only compiles there); on a GPU it is a diagnostic jax can skip
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    device, described = target_device()
    print(f"compiling for {device.device_kind}{' (described to XLA, no device)' if described else ''}")
    rows = []
    for program in args.programs:
        for bs in args.bs or GOAL_SIZES[program]:
            t0 = time.perf_counter()
            with jax.default_device(device) if described else contextlib.nullcontext():
                text = compiled_text(program, args.preset, bs, args.ctx, args.k, args.page_size, device,
                                     args.rounds)
            seconds = time.perf_counter() - t0
            if args.hlo_dir:
                os.makedirs(args.hlo_dir, exist_ok=True)
                with open(os.path.join(args.hlo_dir, f"{program}-bs{bs}.hlo.txt"), "w") as f:
                    f.write(text)
            counter, notes = count_launches(text)
            if args.sequence:
                order, _ = launch_order(text)
                print(f"{program} bs {bs}: the first {args.sequence} kernels in launch order")
                for kind, name, shape, times in order[:args.sequence]:
                    print(f"  {kind:7s} {name:24s} {shape[:70]}{f'  (x {times})' if times > 1 else ''}")
            kinds = collections.Counter()
            for (kind, _), n in counter.items():
                kinds[kind] += n
            # products XLA emits as plain fusions: split-K reductions after a GEMM, and one-row products (GEMVs)
            dot_fusions = sum(n for (kind, name), n in counter.items() if kind == "fusion" and name == "dot_general")
            row = {"program": program, "bs": bs, "ctx": args.ctx, "k": args.k,
                   "rounds": args.rounds if program == "round" else None, "launches": sum(counter.values()),
                   "gemm": kinds["gemm"], "dot_fusions": dot_fusions, "pallas": kinds["pallas"],
                   "other_fusions": kinds["fusion"] - dot_fusions,
                   "other": sum(kinds.values()) - kinds["gemm"] - kinds["pallas"] - kinds["fusion"],
                   "kinds": dict(kinds), "compile_s": seconds, "notes": notes,
                   "by_op": [[kind, name, n] for (kind, name), n in counter.most_common()]}
            rows.append(row)
            print(f"{program} bs {bs}: {row['launches']} launches ({seconds:.0f} s to compile)")
            if args.top:
                print_table(f"{program} bs {bs}: kernels by jax op", [
                    ("n", "launches", "{}"), ("kind", "kind", "{}"), ("name", "jax op / kernel", "{}")],
                    [{"n": n, "kind": kind, "name": name} for kind, name, n in row["by_op"][:args.top]])
    print_table(f"kernel launches per call, {args.preset}, ctx {args.ctx}, k {args.k}, compiled for "
                f"{device.device_kind}{' (no device: heuristic GEMM tilings)' if described else ''}", [
                    ("program", "program", "{}"), ("bs", "bs", "{}"), ("launches", "launches", "{}"),
                    ("gemm", "gemm", "{}"), ("dot_fusions", "dot fusions", "{}"), ("pallas", "pallas", "{}"),
                    ("other_fusions", "fusions", "{}"), ("other", "other", "{}"),
                    ("compile_s", "compile_s", "{:.0f}")], rows)
    return {"preset": args.preset, "target": device.device_kind, "described": described, "rows": rows}

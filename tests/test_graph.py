"""`bench graph` on the CPU: its launch count against programs whose kernel counts are known by construction, and its
abstract programs against the ones the engine and `bench verify` build from real arrays. (Its compile for an H200
without one needs the CUDA plugin, which the CPU suite does not install: there it must fail with one clear line.)"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import bench, staging
from jaxspec.bench import common, graph
from jaxspec.bench.decode import paged_decode_step
from jaxspec.config import bench_pair
from jaxspec.draft.bucketed import BucketedDrafter
from jaxspec.engine import Engine
from jaxspec.model import gemma4
from jaxspec.model.weights import random_assistant_params, random_target_params
from jaxspec.paged_kv.metadata import PageTables


def launches(fn, *args) -> int:
    return sum(graph.count_launches(jax.jit(fn).lower(*args).compile().as_text())[0].values())


def _body(c, _):
    return jnp.tanh(c @ c) / jnp.sum(jnp.abs(c), axis=-1, keepdims=True), None


@pytest.mark.parametrize("short, long", [(3, 6), (2, 7)])
def test_a_loop_counts_its_body_per_trip_as_the_unrolled_program_does(short, long):
    """A scan's kernels grow with its length exactly as the unrolled program's do: the counter multiplies the while
    body by its trip count (the loop's own counter kernels stay constant). Counting the body once makes the left
    side 0."""
    x = jnp.ones((32, 32))
    scan = lambda n: (lambda x: jax.lax.scan(_body, x, None, length=n)[0])  # noqa: E731
    unrolled = lambda n: (lambda x: jax.lax.scan(_body, x, None, length=n, unroll=True)[0])  # noqa: E731
    per_trip = launches(unrolled(long), x) - launches(unrolled(short), x)
    assert per_trip >= long - short  # at least one kernel a trip
    assert launches(scan(long), x) - launches(scan(short), x) == per_trip


def test_launch_order_lists_what_is_counted_in_order():
    """The launch order (`bench graph --sequence`) holds every counted launch, in the program's order: a scan's body
    repeated per trip stands once with its trip count, and a program of two dependent products and a reduction lists
    its products before the reduction that reads them."""
    x = jnp.ones((32, 32))
    text = jax.jit(lambda x: jax.lax.scan(_body, x, None, length=5)[0]).lower(x).compile().as_text()
    order, _ = graph.launch_order(text)
    counter, _ = graph.count_launches(text)
    assert sum(t for *_, t in order) == sum(counter.values())
    assert any(t == 5 for *_, t in order)  # the body's kernels, once a trip
    text = jax.jit(lambda a, b: jnp.sum(jnp.tanh(a @ b) @ b, axis=0)).lower(x, x).compile().as_text()
    names = [name for _, name, _, _ in graph.launch_order(text)[0]]
    reduce_at = max(i for i, n in enumerate(names) if n.startswith("reduce"))
    assert names.count("dot_general") >= 1 and names.index("dot_general") < reduce_at, names


def test_a_conditional_counts_its_largest_branch():
    """lax.cond: the kernels of the branch with more of them, as the program run on that branch launches, plus what is
    outside; each branch alone compiled as its own program gives the reference."""
    x = jnp.ones((32, 32))
    small = lambda x: x + 1  # noqa: E731
    large = lambda x: jnp.tanh(jnp.tanh(x @ x) @ x) / jnp.sum(x)  # noqa: E731
    cond = lambda p, x: jax.lax.cond(p > 0, large, small, x)  # noqa: E731
    text = jax.jit(cond).lower(jnp.int32(1), x).compile().as_text()
    counter, notes = graph.count_launches(text)
    assert notes == ["a conditional: its largest branch counted"]
    assert launches(large, x) <= sum(counter.values()) <= launches(large, x) + 2  # + the predicate's kernel(s)
    assert sum(counter.values()) > launches(small, x) + 2


@pytest.fixture(scope="module")
def tiny_real():
    """The tiny preset's propose, verify and round programs compiled from real arrays, as the engine and `bench
    verify` build them (bs 2, ctx 40, k 2, page 8; the engine with the kernels, as on a GPU)."""
    cfg, acfg = bench_pair("tiny")
    bs, ctx, k, page = 2, 40, 2, 8
    cache, rids = common.paged_cache(cfg, bs, ctx - k - 1, max_context=ctx, page_size=page, max_step_tokens=16,
                                     seed=0)
    target = random_target_params(cfg, 0, dtype=common.DTYPE)
    drafter = BucketedDrafter(random_assistant_params(acfg, 0, dtype=common.DTYPE), acfg, target["embed"], cfg, k,
                              buckets=(bs,), seed_slots=bs + 1,
                              pinned_inputs=staging.pinned_enabled("gpu"))  # as a GPU builds it, as `bench graph`
    drafter.attach(cache)
    pages = PageTables(page_table=jnp.asarray(cache.pool.page_table(rids)), swa_of_full=cache.swa_of_full)
    vec = jnp.zeros(bs, jnp.int32)
    verify = paged_decode_step.lower(gemma4.stored_params(target), cache.kv, pages, jnp.zeros((bs, k + 1), jnp.int32),
                                     vec, vec, cfg=cfg, spec=cache.spec,
                                     staged=staging.enabled()).compile()  # as `bench verify`'s paged step
    engine = Engine(cfg, target, acfg=acfg, aparams=drafter.aparams, k=k, draft_mode="bucketed", buckets=(bs,),
                    max_running=bs, page_size=page, max_context=ctx, use_kernels=True)
    engine.warmup(prime=False)
    return {"propose": drafter.executables[bs].as_text(), "verify": verify.as_text(),
            "round": engine.runner.executables[("decode", bs, False)].as_text(), "shape": (bs, ctx, k, page)}


@pytest.mark.parametrize("program", ["propose", "verify", "round"])
def test_abstract_programs_are_the_real_ones(tiny_real, program):
    """What `bench graph` compiles from shapes alone launches, kernel for kernel, what the real program does (the round:
    the engine's own decode program, R 1)."""
    bs, ctx, k, page = tiny_real["shape"]
    text = graph.compiled_text(program, "tiny", bs, ctx, k, page, jax.devices()[0])
    ours, real = graph.count_launches(text)[0], graph.count_launches(tiny_real[program])[0]
    assert sum(ours.values()) == sum(real.values())
    # on the CPU the kernels are the interpreter's loops, whose copies XLA's buffer assignment may attribute to
    # another op of the same loop (the round: 32 of ~4 900 copies); every other kernel is the same
    no_copies = lambda c: {key: n for key, n in c.items() if key[0] != "copy"}  # noqa: E731
    assert no_copies(ours) == no_copies(real)


def test_another_program_counts_differently(tiny_real):
    """The comparison above can fail: verifying k + 1 = 4 positions instead of 3 is another program."""
    bs, ctx, k, page = tiny_real["shape"]
    text = graph.compiled_text("verify", "tiny", bs, ctx, k + 1, page, jax.devices()[0])
    assert graph.count_launches(text)[0] != graph.count_launches(tiny_real["verify"])[0]


def cuda_plugin_installed() -> bool:
    return importlib.util.find_spec("jax_plugins") is not None and \
        importlib.util.find_spec("jax_plugins.xla_cuda13") is not None


@pytest.mark.skipif(cuda_plugin_installed(),
                    reason="the CUDA plugin is installed here: bench graph compiles for an H200 instead")
def test_without_a_gpu_or_the_plugin_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["graph", "--programs", "propose", "--bs", "1", "--json", "/dev/null"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: bench graph without a GPU") and "jax[cuda13]" in err[0]


def test_parse_hlo_names_the_entry():
    text = jax.jit(lambda x: x * 2).lower(np.ones(3, np.float32)).compile().as_text()
    comps, entry = graph.parse_hlo(text)
    assert entry in comps and comps[entry]
    with pytest.raises(ValueError):
        graph.parse_hlo("HloModule m\n")

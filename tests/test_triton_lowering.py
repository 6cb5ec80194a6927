"""Every Pallas kernel lowers to Triton for an H200, checked on the CPU: the programs are exported for the `cuda`
platform with jax.export, which runs the Pallas -> Triton IR lowering in Python (no GPU needed; compiling the Triton
IR to PTX happens on the GPU lane, bench/h200.sh). An unsupported op, a non-power-of-two block or a bad index in a
kernel fails here, before any device time is spent. The drafter programs are lowered at the public shapes (E4B's
drafter, and the default pair's: one KV head, four query heads per KV head), and the fused step's launches counted.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import gpu_info, pallas_call_registration

from jaxspec.bench import graph
from jaxspec.config import FULL, PRESETS, SLIDING, assistant_preset, bench_pair
from jaxspec.draft.bucketed import draft
from jaxspec.engine.programs import DecodeState, Programs, Weights
from jaxspec.pallas import draft_layer as dl

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

PAGE, CONTEXT = 16, 4096


@pytest.fixture(autouse=True)
def as_if_on_an_h200(monkeypatch):
    """Lower for an H200: Pallas asks the device for its compute capability, and the kernels choose Triton over the
    interpreter by the default backend."""
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
    with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        yield


def lower_for_cuda(fn, *args) -> collections.Counter:
    """The Triton kernels (by name) of fn lowered for CUDA."""
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    text = exported.mlir_module()
    calls = re.findall(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?name = "([A-Za-z0-9_]+)"', text)
    return collections.Counter(calls)


def abstract_state(cfg, acfg, batch):
    return graph.abstract_state(cfg, acfg, batch, CONTEXT, PAGE)


def default_pair_shapes():
    """The default pair's geometry (Gemma 3 270M: hidden 640, 4 heads on 1 KV head of 256; its drafter) with the
    E4B preset's switches: only the drafter's shapes matter here."""
    cfg = dataclasses.replace(
        PRESETS["E4B"], hidden_size=640, num_heads=4, num_kv_heads=1, num_global_kv_heads=1, global_head_dim=256,
        num_layers=18, layer_types=((SLIDING,) * 5 + (FULL,)) * 3, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, num_kv_shared_layers=0, intermediate_size=2048)
    return cfg, assistant_preset(cfg, ordered=False)


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("pair", ["E4B", "default"])
def test_fused_draft_lowers_to_triton(pair, batch):
    """k = 3 draft steps: per step the pre projection, per layer q / attention (+ merge) / o / up / down, the final
    projection; two index walks for the whole propose. Nothing else of the step is a Pallas kernel."""
    cfg, acfg = bench_pair("E4B") if pair == "E4B" else default_pair_shapes()
    spec, target, assistant, kv, pages = abstract_state(cfg, acfg, batch)
    k, L = 3, acfg.text.num_layers
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    seed = jax.ShapeDtypeStruct((batch, cfg.hidden_size), jnp.bfloat16)
    fn = functools.partial(draft, acfg=acfg, target=cfg, spec=spec, k=k, use_kernels=True, fused=True)
    kernels = lower_for_cuda(fn, assistant, target["embed"], kv, pages, vec, vec, seed)
    per_layer = ("draft_q_proj", "paged_attention", "draft_o_proj", "draft_mlp_up", "draft_mlp_down")
    for name in per_layer:
        assert kernels[name] == k * L, (name, kernels)
    assert kernels["draft_pre_projection"] == kernels["draft_final_projection"] == k
    assert kernels["gather_kv_indices"] == 2  # one window walk per layer type, shared by all steps and layers
    assert kernels["paged_attention_merge"] <= k * L
    assert set(kernels) <= {*per_layer, "paged_attention_merge", "draft_pre_projection", "draft_final_projection",
                            "gather_kv_indices"}


@pytest.fixture
def triton_modules(monkeypatch):
    """The Triton IR (text) of every Pallas kernel lowered while the fixture is active, by kernel name."""
    from jax._src.pallas.triton import lowering

    modules = collections.defaultdict(list)
    lower = lowering.lower_jaxpr_to_triton_module

    def recording(*args, **kwargs):
        result = lower(*args, **kwargs)
        text = result.module.operation.get_asm()
        modules[re.search(r"tt\.func public @([A-Za-z0-9_]+)", text).group(1)].append(text)
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", recording)
    return modules


def loads_around_first_reduction(text: str) -> tuple[int, list[str]]:
    """A Triton kernel's loads split at its first reduction, in program order: the elements of the tensors loaded
    before it, and the lines of the loads after it, less those Pallas makes of an output block right before storing
    it (`ref[...] = v` is a swap: a load, then a store to the same pointer, the loaded value unused)."""
    lines = text.splitlines()
    stored = {m.group(1) for m in (re.search(r"tt\.store (%[\w#]+),", line) for line in lines) if m}
    before, after, seen = 0, [], False
    for line in lines:
        seen = seen or '"tt.reduce"' in line
        load = re.search(r"= tt\.load (%[\w#]+) .*: (?:tensor<([0-9x]+)x)?!tt\.ptr", line)
        if load and not seen and load.group(2):
            before += math.prod(int(n) for n in load.group(2).split("x"))
        elif load and seen and load.group(1) not in stored:
            after.append(line.strip())
    return before, after


def test_fused_draft_kernels_load_their_weights_at_once(triton_modules):
    """Each of the fused drafter step's products issues all its weight loads before anything that depends on a load:
    no loop, and the elements loaded before the kernel's first reduction (its prologue's norm, or the product itself)
    cover the program's whole weight block; at batch 1 every other load (the rows it normalises or adds, the norm
    weights, the token's embedding chunks) comes before that reduction too. A chunk loop, or a load issued after a
    reduction has made the program wait, puts one memory round trip after another into the kernel (session 20's
    trace: the o projection 4.9 µs, XLA's 1.8)."""
    cfg, acfg = bench_pair("E4B")
    spec, target, assistant, kv, pages = abstract_state(cfg, acfg, 1)
    vec = jax.ShapeDtypeStruct((1,), jnp.int32)
    seed = jax.ShapeDtypeStruct((1, cfg.hidden_size), jnp.bfloat16)
    lower_for_cuda(functools.partial(draft, acfg=acfg, target=cfg, spec=spec, k=1, use_kernels=True, fused=True),
                   assistant, target["embed"], kv, pages, vec, vec, seed)
    t = acfg.text
    H, Ht, I, NH = t.hidden_size, cfg.hidden_size, t.intermediate_size, t.num_heads
    o_in = sorted({NH * t.type_head_dim(x) for x in t.layer_types})
    block = {"draft_pre_projection": [dl.PROGRAM_ROWS * 2 * Ht], "draft_q_proj": [dl.Q_ROWS * H],
             "draft_o_proj": [dl.PROGRAM_ROWS * k for k in o_in], "draft_mlp_up": [2 * dl.UP_ROWS * H],
             "draft_mlp_down": [dl.PROGRAM_ROWS * I], "draft_final_projection": [dl.FINAL_ROWS * H]}
    assert set(block) <= set(triton_modules), sorted(triton_modules)
    for name, weights in block.items():
        texts = triton_modules[name]
        loaded = []  # elements before the first reduction, a kernel each (the o kernels: both layer types)
        for text in texts:
            assert "scf.for" not in text and "scf.while" not in text, f"{name}: a loop in the kernel"
            before, after = loads_around_first_reduction(text)
            assert not after, (name, after)
            loaded.append(before)
        assert min(loaded) >= min(weights) and max(loaded) >= max(weights), (name, loaded, weights)


def test_decode_round_lowers_to_triton():
    """The engine's round program (draft, verify, accept) for the E4B pair at bs 4: every kernel of it lowers (each
    distinct jitted kernel appears once in the exported text, so only presence is checked)."""
    cfg, acfg = bench_pair("E4B")
    batch, k = 4, 3
    spec, target, assistant, kv, pages = abstract_state(cfg, acfg, batch)
    programs = Programs(cfg=cfg, acfg=acfg, spec=spec, k=k, draft_mode="bucketed", use_kernels=True, eos=(1,),
                        fused_draft=True)
    state = jax.eval_shape(lambda: DecodeState.empty(batch + 1, cfg.hidden_size, jnp.bfloat16))
    slot = jax.ShapeDtypeStruct((batch,), jnp.int32)
    kernels = lower_for_cuda(programs.decode_rounds(1, False), Weights(target=target, assistant=assistant), kv, state,
                             slot, pages)
    assert kernels["draft_q_proj"] == k * acfg.text.num_layers
    assert {"paged_attention", "paged_attention_merge", "gather_kv_indices"} <= set(kernels)

"""The q/k/v kernel (`qkv_cache.qkv_cache`: the heads' norms, RoPE and the K/V write in one launch) against its jnp
reference (`qkv_cache_ref`, the ops the step ran before), interpreted on the CPU, compiled by Triton on the GPU lane.

The kernel rounds where the reference rounds; it sums a head's squares in another order, so a head's scale can differ
in its last fp32 bit and a value rounded after it by one ulp of the dtype. Rows of the stacks the step does not
write must come back bit for bit.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import Rope
from jaxspec.model.layers import rope_tables
from jaxspec.pallas import qkv_cache as qc
from jaxspec.pallas.row_norms import Vec

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

CPU = jax.default_backend() == "cpu"
EPS = 1e-6
NH, KVH, D, L, S = 4, 2, 32, 3, 40


def operands(dtype, has_v, B=2, T=3, seed=0, padding=True):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    width = (NH + KVH * (2 if has_v else 1)) * D
    out = (jax.random.normal(k[0], (B, T, width)) * 3).astype(dtype)
    q_norm = Vec(1 + jax.random.normal(k[1], (3, D), jnp.float32), (2,))  # rows of stacks, read in place
    k_norm = Vec(1 + jax.random.normal(k[2], (3, D), jnp.float32), (1,))
    k_stack = jax.random.normal(k[3], (L, S, KVH, D)).astype(dtype)
    v_stack = jax.random.normal(k[4], (L, S, KVH, D)).astype(dtype)
    slots = jax.random.permutation(k[5], jnp.arange(1, S, dtype=jnp.int32))[: B * T].reshape(B, T)
    if padding:
        slots = slots.at[1, T - 1].set(0)  # a padding position
    positions = jnp.arange(B * T, dtype=jnp.int32).reshape(B, T) * 7 + 100
    rope = Rope(theta=10_000.0, partial_factor=0.5)  # a zero tail: those dims unrotated
    cos, sin = rope_tables(positions, rope, D, jnp.float32)
    return out, q_norm, k_norm, cos, sin, k_stack, v_stack, slots


def run(fn, ops, layer, has_v, v_norm):
    out, qn, kn, cos, sin, ks, vs, slots = ops
    call = lambda out, cos, sin, ks, vs, slots, qs, ks_n: fn(  # noqa: E731
        out, Vec(qs, qn.index), Vec(ks_n, kn.index), cos, sin, ks, vs, layer, slots, num_heads=NH, has_v=has_v,
        v_norm=v_norm, eps=EPS)
    return jax.jit(call)(out, cos, sin, ks, vs, slots, qn.stack, kn.stack)


def tolerance(dtype, want) -> dict:
    """assert_allclose's tolerance: a relative ulp of the dtype, and for bf16 an absolute one ulp at the compared
    values' largest magnitude. A rotated value is x1·cos − x2·sin of two normed values rounded to the dtype, so when
    they cancel, one ulp of difference in x1 or x2 (the head's scale in another fp32 summation order) is far more than
    an ulp of the small result: on the H200 one value of 768 came out 0.1670 against 0.1729 (session 29's GPU lane)."""
    if dtype == jnp.bfloat16:
        return dict(rtol=2**-7, atol=2**-7 * max(float(np.max(np.abs(want))), 1.0))
    return dict(rtol=2e-6, atol=2e-6 * 8)


def check(got, want, dtype, slots, layer):
    q, k_stack, v_stack = (np.asarray(x, np.float32) for x in got)
    wq, wk, wv = (np.asarray(x, np.float32) for x in want)
    np.testing.assert_allclose(q, wq, **tolerance(dtype, wq))
    written = np.zeros((L, S), bool)
    written[layer, np.asarray(slots).reshape(-1)] = True
    written[:, 0] = False  # slot 0: padding, never written
    for g, w in ((k_stack, wk), (v_stack, wv)):
        np.testing.assert_allclose(g[written], w[written], **tolerance(dtype, w[written]))
        np.testing.assert_array_equal(g[~written], w[~written])  # untouched rows: the same bits


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("has_v,v_norm", [(True, True), (False, True), (True, False)],
                         ids=["v", "k_eq_v", "no_v_norm"])
def test_qkv_cache_matches_reference(dtype, has_v, v_norm):
    ops = operands(dtype, has_v)
    assert qc.supported(ops[0], ops[5])
    got = run(qc.qkv_cache, ops, 1, has_v, v_norm)
    check(got, run(qc.qkv_cache_ref, ops, 1, has_v, v_norm), dtype, ops[7], 1)


def test_qkv_cache_rows_do_not_depend_on_the_others():
    """One program a row: row (0, 1)'s q and K/V are the same bits alone and among the others (batch invariance)."""
    ops = operands(jnp.bfloat16, True, padding=False)
    together = run(qc.qkv_cache, ops, 2, True, True)
    out, qn, kn, cos, sin, ks, vs, slots = ops
    alone = run(qc.qkv_cache, (out[:1, 1:2], qn, kn, cos[:1, 1:2], sin[:1, 1:2], ks, vs, slots[:1, 1:2]), 2, True,
                True)
    np.testing.assert_array_equal(np.asarray(alone[0], np.float32), np.asarray(together[0][:1, 1:2], np.float32))
    s = int(slots[0, 1])
    for a, t in zip(alone[1:], together[1:]):
        np.testing.assert_array_equal(np.asarray(a[2, s], np.float32), np.asarray(t[2, s], np.float32))


@pytest.mark.parametrize("broken", ["rope_sign", "slot", "padding", "norm_index"])
def test_qkv_cache_comparison_has_teeth(broken, monkeypatch):
    """Broken variants fail the comparison above: RoPE's rotation the other way, every K/V row written one slot
    further, a padding row written to slot 0 anyway, q's norm read from another row of its stack."""
    ops = operands(jnp.bfloat16, True)
    out, qn, kn, cos, sin, ks, vs, slots = ops
    if broken == "norm_index":
        ops = (out, Vec(qn.stack, (0,)), kn, cos, sin, ks, vs, slots)
        want = run(qc.qkv_cache_ref, operands(jnp.bfloat16, True), 1, True, True)
    elif broken == "rope_sign":
        ops = (out, qn, kn, cos, -sin, ks, vs, slots)
        want = run(qc.qkv_cache_ref, operands(jnp.bfloat16, True), 1, True, True)
    elif broken == "slot":
        ops = (out, qn, kn, cos, sin, ks, vs, jnp.where(slots == 0, 0, slots % (S - 1) + 1))
        want = run(qc.qkv_cache_ref, operands(jnp.bfloat16, True), 1, True, True)
    else:
        monkeypatch.setattr(qc.pl, "when", lambda cond: (lambda body: body()))
        want = run(qc.qkv_cache_ref, ops, 1, True, True)
    got = run(qc.qkv_cache, ops, 1, True, True)
    with pytest.raises(AssertionError):
        check(got, want, jnp.bfloat16, slots, 1)


def run_q(fn, ops, qn_index=None):
    out, qn, kn, cos, sin, ks, vs, slots = ops
    q = out[..., : NH * D]  # a KV-shared layer's q projection
    index = qn.index if qn_index is None else qn_index
    return jax.jit(lambda q, cos, sin, stack: fn(q, Vec(stack, index), cos, sin, eps=EPS))(q, cos, sin, qn.stack)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_q_rope_matches_reference(dtype):
    """A KV-shared layer's q: `q_rope` against `q_rope_ref` (gemma4.qkv's norm and rotation of a layer without K/V)."""
    ops = operands(dtype, True)
    got, want = (np.asarray(x, np.float32) for x in (run_q(qc.q_rope, ops), run_q(qc.q_rope_ref, ops)))
    np.testing.assert_allclose(got, want, **tolerance(dtype, want))
    # and the same q as the q/k/v kernel's for the same heads and weights
    np.testing.assert_array_equal(np.asarray(run(qc.qkv_cache, ops, 1, True, True)[0], np.float32), got)


@pytest.mark.parametrize("broken", ["rope_sign", "norm_index"])
def test_q_rope_comparison_has_teeth(broken):
    ops = operands(jnp.bfloat16, True)
    want = np.asarray(run_q(qc.q_rope_ref, ops), np.float32)
    if broken == "rope_sign":
        out, qn, kn, cos, sin, ks, vs, slots = ops
        got = run_q(qc.q_rope, (out, qn, kn, cos, -sin, ks, vs, slots))
    else:
        got = run_q(qc.q_rope, ops, qn_index=(0,))
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, **tolerance(jnp.bfloat16, want))


def test_qkv_cache_falls_back_outside_its_shapes():
    """A head dim whose halves are not power-of-two vectors of >= 16 runs the reference."""
    out = jnp.zeros((1, 1, (NH + 2 * KVH) * 24), jnp.float32)
    assert not qc.supported(out, jnp.zeros((1, 4, KVH, 24), jnp.float32))


@pytest.mark.skipif(not CPU, reason="on GPU the tests above compile the real kernel")
def test_qkv_cache_lowers_to_one_triton_call(monkeypatch):
    """E4B's sliding layer shapes (bf16, 8 q heads on 2 K/V heads of 256, 4 rows, a 20-layer stack) lower to one
    Triton kernel, the stacks aliased (no copy of a stack); a shared full layer's q (8 heads of 512) to one too."""
    from jax._src.pallas.triton import pallas_call_registration

    fake_h200 = types.SimpleNamespace(get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90))
    monkeypatch.setattr(pallas_call_registration, "gpu_info_lib", fake_h200)
    spec = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    text = jax.jit(lambda o, qn, kn, c, s, ks, vs, sl: qc.qkv_cache(
        o, Vec(qn, (3,)), Vec(kn, (3,)), c, s, ks, vs, 3, sl, num_heads=8, has_v=True, v_norm=True, eps=EPS,
        interpret=False)).trace(
        spec((1, 4, 12 * 256), bf), spec((20, 256), jnp.float32), spec((20, 256), jnp.float32),
        spec((1, 4, 256), jnp.float32), spec((1, 4, 256), jnp.float32), spec((20, 768, 2, 256), bf),
        spec((20, 768, 2, 256), bf), spec((1, 4), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "output_operand_aliases" in text
    assert "stablehlo.slice" not in text and "dynamic_slice" not in text  # the norm rows read in place
    text = jax.jit(lambda q, qn, c, s: qc.q_rope(q, Vec(qn, (2,)), c, s, eps=EPS, interpret=False)).trace(
        spec((1, 4, 8 * 512), bf), spec((3, 512), jnp.float32), spec((1, 4, 512), jnp.float32),
        spec((1, 4, 512), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.slice" not in text

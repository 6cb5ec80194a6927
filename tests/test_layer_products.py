"""The layer products kernel (`layer_products.stream_product`: a target layer's product with the residual and norm
before it and the activation after it) against its jnp reference (`stream_product_ref`: the ops `decoder_layer` runs
without it), interpreted on the CPU, compiled by Triton on the GPU lane. (The engine with it against transformers'
greedy: tests/test_rounds.py::test_layer_products_engine_equals_transformers_greedy.)

The kernel rounds where the reference rounds; the two sum a row's squares and a product's terms in different orders,
so a value may differ by one bf16 step (fp32: the last bits).
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import check_outputs
from jaxspec.config import ConfigError, layer_product_sites
from jaxspec.pallas import layer_products, row_norms
from jaxspec.pallas.layer_products import Residual, stream_product, stream_product_ref
from jaxspec.pallas.row_norms import Vec

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

CPU = jax.default_backend() == "cpu"
EPS = 1e-6
L = 5  # layers in the stacks: every vector and weight is read at an index other than 0


def operands(dtype, rows, K, N, seed=0):
    """x (the stream), y (a product's output: large), a [L, 4, K] norm stack, a [L, K] PLE norm stack, a [L] scalar
    stack, a [L, 2N, K] weight stack (gate rows then up rows) and a [L, 1, rows, N] PLE input stack, all different, so
    that anything read at the wrong index shows."""
    k = jax.random.split(jax.random.PRNGKey(seed), 7)
    x = jax.random.normal(k[0], (1, rows, K)).astype(dtype)
    y = (jax.random.normal(k[1], (1, rows, K)) * 30).astype(dtype)
    norms = 1 + jax.random.normal(k[2], (L, 4, K), jnp.float32)
    ple_norm = 1 + jax.random.normal(k[3], (L, K), jnp.float32)
    scalars = jax.random.uniform(k[4], (L,), jnp.float32, 0.2, 2).astype(dtype)
    w = (jax.random.normal(k[5], (L, 2 * N, K)) * K**-0.5).astype(dtype)
    ple = jax.random.normal(k[6], (L, 1, rows, N)).astype(dtype)
    return x, y, norms, ple_norm, scalars, w, ple


# The five uses `decoder_layer` makes of the kernel: (stream, norm, weight, epilogue, mul) from the operands
SITES = {
    # the first layer's q/k/v product: the embedding's rows, normed by the input norm
    "qkv_first": lambda x, y, n, pn, s, w, p: (x, Vec(n, (2, 0)), Vec(w, (2,)), None, None),
    # a later layer's: the previous layer's end ((x + norm(p)·n_ple)·s) rebuilt, then normed
    "qkv": lambda x, y, n, pn, s, w, p: (Residual(x, y, Vec(pn, (3,)), Vec(s, (3,))), Vec(n, (4, 0)), Vec(w, (4,)),
                                         None, None),
    # o or down: the rows as they are
    "o": lambda x, y, n, pn, s, w, p: (x, None, Vec(w, (1,)), None, None),
    # gate/up: the post-attention residual and the MLP's input norm before, gelu(gate) * up after
    "mlp": lambda x, y, n, pn, s, w, p: (Residual(x, y, Vec(n, (3, 1))), Vec(n, (3, 2)), Vec(w, (3,)), "gelu_pair",
                                         None),
    # the PLE gate: the post-MLP residual (not normed) before, gelu(gate) * ple_i after
    "ple": lambda x, y, n, pn, s, w, p: (Residual(x, y, Vec(n, (1, 3))), None, Vec(w[:, :w.shape[1] // 2], (2,)),
                                         "gelu_mul", Vec(p, (3,))),
}


# The reference's compile: without XLA's dot strength reduction, which on the GPU turns a one-row product into a
# multiply and a reduction whose multiply runs in bf16, rounding each term of the sum to bf16 before the fp32 sum
# (the kernel, like transformers' cuBLAS products, keeps each term exact). With it the 1-row bf16 cases differed by a
# few bf16 ulps (4 of the 5 sites failed on the H100, session 34's GPU lane; session 26's first four failures on the
# H200 were these). The pass does not run on the CPU. (Since then `layers.linear`, which the reference calls, writes
# such one-row products out with fp32 terms on the GPU itself; the option keeps the reference exact whatever path.)
REFERENCE_OPTIONS = {"xla_disable_hlo_passes": "dot-strength-reduction"}


@functools.lru_cache(maxsize=None)
def _runner(site, kernel, form):
    """One jitted function of the operands a (site, kernel or reference, form): calls on operands of the same shapes
    reuse its compile."""
    def f(*ops):
        stream, norm, w, epilogue, mul = SITES[site](*ops)
        if not kernel:
            return stream_product_ref(stream, norm, w, eps=EPS, epilogue=epilogue, mul=mul)
        return stream_product(stream, norm, w, eps=EPS, epilogue=epilogue, mul=mul,
                              config=layer_products.Config(form=form))
    return jax.jit(f, compiler_options=None if kernel else REFERENCE_OPTIONS)


def run(site, ops, kernel=True, form="dot", fresh=False):
    """The site on these operands; fresh: traced anew (a test that patches the kernel's module)."""
    return (_runner.__wrapped__ if fresh else _runner)(site, kernel, form)(*ops)


def check(got, want, dtype):
    check_outputs(got, want, dtype, bf16_atol=2**-10, fp32_tol=2e-5)


@pytest.mark.parametrize("site", list(SITES))
@pytest.mark.parametrize("rows,K,N,dtype,form", [
    (1, 640, 256, jnp.bfloat16, "dot"), (4, 640, 256, jnp.bfloat16, "dot"), (4, 640, 256, jnp.float32, "dot"),
    (16, 128, 64, jnp.bfloat16, "dot"), (4, 2560, 32, jnp.bfloat16, "dot"),
    (4, 640, 256, jnp.bfloat16, "bsum"), (16, 128, 64, jnp.float32, "bsum")],
    ids=["1x640-bf16", "4x640-bf16", "4x640-fp32", "16x128-bf16", "4x2560-bf16", "4x640-bf16-bsum",
         "16x128-fp32-bsum"])
def test_stream_product_matches_reference(site, dtype, rows, K, N, form):
    """270M's width (640) and E4B's (2560), 1 to 16 rows (a decode step, a verify step of 4 positions, bs 4 × 4),
    bf16 and fp32, both forms of the product (`tt.dot` over a 16-row tile, sums across threads)."""
    ops = operands(dtype, rows, K, N)
    stream, _, w, epilogue, _ = SITES[site](*ops)
    assert layer_products.supported(stream, w, epilogue)
    check(run(site, ops, form=form), run(site, ops, kernel=False), dtype)


def test_fp32_products_are_fp32():
    """`--dtype fp32` means fp32: the kernel's fp32 product matches an fp64 product of the same values to fp32's
    precision (TF32 would be off by ~1e-3)."""
    ops = operands(jnp.float32, 4, 640, 256, seed=3)
    got, _ = run("o", ops)  # the dot form: `tt.dot` at IEEE fp32
    x, w = np.asarray(ops[0], np.float64), np.asarray(ops[5][1, :512], np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", layer_products.FORMS)
def test_rows_do_not_depend_on_the_others(form):
    """Every row runs the same code whatever the row count: a row's results are the same bits alone and among 15
    others (batch invariance), at every site. (Interpreted on the CPU, XLA's vectorised tanh may differ by an fp32
    step in another vector lane, which gelu's 1 + tanh near -1 magnifies: there the activations may differ by that
    much; compiled by Triton, not at all.)"""
    ops16 = operands(jnp.bfloat16, 16, 640, 64, seed=1)
    for site in SITES:
        together = run(site, ops16, form=form)
        for r in (0, 11):
            alone_ops = tuple(a[:, r:r + 1] if a.ndim == 3 and a.shape[1] == 16 else a for a in ops16)
            alone_ops = alone_ops[:6] + (ops16[6][:, :, r:r + 1],)
            alone = run(site, alone_ops, form=form)
            for j, (a, t) in enumerate(zip(alone, together)):
                if t is None:
                    continue
                a, t = np.asarray(a, np.float32), np.asarray(t[:, r:r + 1], np.float32)
                if CPU and j == 0 and SITES[site](*ops16)[3] is not None:
                    np.testing.assert_allclose(a, t, rtol=2**-8, atol=2**-20 * np.abs(t).max(), err_msg=site)
                else:
                    np.testing.assert_array_equal(a, t, err_msg=site)


def test_falls_back_outside_its_shapes(monkeypatch):
    """Rows not a power of two, more than MAX_ROWS (prefill chunks) and fp64 (the oracle tests) run the reference."""
    for rows, dtype in [(3, jnp.float32), (layer_products.MAX_ROWS * 2, jnp.float32), (4, jnp.float64)]:
        x = jax.ShapeDtypeStruct((1, rows, 64), dtype)
        w = Vec(jax.ShapeDtypeStruct((L, 32, 64), dtype), (1,))
        assert not layer_products.supported(x, w)
    calls = []
    monkeypatch.setattr(layer_products, "pallas_call", lambda *a, real=layer_products.pallas_call, **kw:
                        calls.append(kw) or real(*a, **kw))
    ops = operands(jnp.float32, 3, 64, 32)
    for g, w in zip(run("qkv", ops, fresh=True), run("qkv", ops, kernel=False)):
        np.testing.assert_array_equal(g, w)  # the very same function
    assert not calls


@pytest.mark.parametrize("broken", ["norm_index", "scalar_index", "up_half"])
def test_comparison_has_teeth(broken, monkeypatch):
    """Broken variants fail the comparison above: a norm vector read at its layer's first row (a BlockSpec index
    map that drops the vector's index), the scalar of layer 0 for every layer, the up half of gate/up read at the
    gate's rows."""
    if broken == "norm_index":
        monkeypatch.setattr(layer_products, "_vec_spec", lambda v, H: row_norms.pl.BlockSpec(
            (*(None,) * len(v.index), H), lambda r, idx=tuple(v.index[:-1]) + (0,) * bool(v.index): (*idx, 0)))
        site = "qkv"
    elif broken == "scalar_index":
        monkeypatch.setattr(layer_products, "_scalar_spec", lambda v: row_norms.pl.BlockSpec((1,), lambda r: (0,)))
        site = "qkv"
    else:
        real = layer_products._weight_spec
        monkeypatch.setattr(layer_products, "_weight_spec", lambda w, bn, K, shift: real(w, bn, K, 0))
        site = "mlp"
    ops = operands(jnp.bfloat16, 4, 640, 256)
    with pytest.raises(AssertionError):
        check(run(site, ops, fresh=True), run(site, ops, kernel=False), jnp.bfloat16)


def test_sites_from_the_environment(monkeypatch):
    """JAXSPEC_LAYER_PRODUCT_SITES names the sites (all when unset); an unknown or empty name list is one clear
    error."""
    monkeypatch.delenv("JAXSPEC_LAYER_PRODUCT_SITES", raising=False)
    assert layer_product_sites() == frozenset(layer_products.SITES)
    monkeypatch.setenv("JAXSPEC_LAYER_PRODUCT_SITES", "mlp, ple")
    assert layer_product_sites() == {"mlp", "ple"}
    for bad in ("mlp,gate", ",", ""):
        monkeypatch.setenv("JAXSPEC_LAYER_PRODUCT_SITES", bad)
        with pytest.raises(ConfigError, match="JAXSPEC_LAYER_PRODUCT_SITES"):
            layer_product_sites()


@pytest.mark.skipif(not CPU, reason="on GPU the tests above compile the real kernel")
def test_lowers_to_one_triton_call(monkeypatch):
    """E4B's shapes (bf16, 4 rows; stacked weights, norms, scalars and PLE inputs read in place) lower to one Triton
    kernel a site and nothing else: no slice or copy of a stack beside it."""
    from jax._src.pallas.triton import pallas_call_registration

    fake_h200 = types.SimpleNamespace(get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90))
    monkeypatch.setattr(pallas_call_registration, "gpu_info_lib", fake_h200)
    spec = jax.ShapeDtypeStruct
    rows = spec((1, 4, 2560), jnp.bfloat16)
    norms, scalars, ple = spec((20, 4, 2560), jnp.float32), spec((20,), jnp.bfloat16), spec((42, 1, 4, 256),
                                                                                           jnp.bfloat16)
    cases = {
        "qkv": (lambda x, y, n, s, w: stream_product(Residual(x, y, Vec(n, (3, 3)), Vec(s, (3,))), Vec(n, (4, 0)),
                                                     Vec(w, (4,)), eps=EPS, interpret=False),
                spec((20, 3072, 2560), jnp.bfloat16)),
        "mlp": (lambda x, y, n, s, w: stream_product(Residual(x, y, Vec(n, (3, 1))), Vec(n, (3, 2)), Vec(w, (3,)),
                                                     eps=EPS, epilogue="gelu_pair", interpret=False),
                spec((20, 20480, 2560), jnp.bfloat16)),
    }
    for name, (f, w) in cases.items():
        text = jax.jit(f).trace(rows, rows, norms, scalars, w).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1, name
        assert "stablehlo.slice" not in text and "dynamic_slice" not in text, name
    text = jax.jit(lambda x, y, n, w, p: stream_product(
        Residual(x, y, Vec(n, (3, 3))), None, Vec(w, (7,)), eps=EPS, epilogue="gelu_mul", mul=Vec(p, (7,)),
        interpret=False)).trace(rows, rows, norms, spec((20, 256, 2560), jnp.bfloat16), ple).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.slice" not in text and "dynamic_slice" not in text

"""The small products' kernel (`gemv.gemv`) against its jnp reference (`gemv_ref`: `linear`, what the layers ran
before it), interpreted on the CPU, compiled by Triton on the GPU lane.

Both sum a row's K products in fp32 and round once; the kernel sums by column chunks, the reference in XLA's order:
bf16 outputs within one bf16 ulp, fp32 ones to a few fp32 ulps of the sum's magnitude (true fp32 on both sides: the
reference jitted at `highest` precision, as the engine runs fp32).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas import gemv as gemv_mod
from jaxspec.pallas.gemv import gemv, gemv_ref
from jaxspec.pallas.row_norms import Vec

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

# (N, K): E4B's q/k/v stack, o, PLE gate and PLE projection; 270M's q/k/v; a tiny one
SHAPES = [(3072, 2560), (2560, 2048), (256, 2560), (2560, 256), (1536, 640), (64, 32)]


def operands(dtype, rows, N, K, seed=0):
    """x [1, rows, K] and a stack of 3 different [N, K] weights (a weight read at the wrong index shows)."""
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    x = jax.random.normal(k[0], (1, rows, K)).astype(dtype)
    w = (jax.random.normal(k[1], (3, N, K)) * K**-0.5).astype(dtype)
    return x, w


def check(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = np.abs(want).max()
    if dtype == jnp.bfloat16:
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-8 * scale)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


def reference(x, w, idx):
    with jax.default_matmul_precision("highest"):
        return jax.jit(lambda x, s: gemv_ref(x, Vec(s, idx)))(x, w)


# Every shape at 1 row (decode at bs 1), 4 (a verify of k 3 at bs 1) and 16, bf16 and fp32; on the CPU, where the
# interpreter runs the programs one by one, every shape at 4 rows in bf16, and the smaller ones also at 1 row in fp32
# and 16 rows in bf16
CASES = [(n, k, dtype, rows) for n, k in SHAPES for dtype in (jnp.bfloat16, jnp.float32) for rows in (1, 4, 16)
         if jax.default_backend() != "cpu" or (dtype, rows) == (jnp.bfloat16, 4)
         or (n * k < 2**20 and (dtype, rows) in ((jnp.float32, 1), (jnp.bfloat16, 16)))]


@pytest.mark.parametrize("N,K,dtype,rows", CASES,
                         ids=[f"{n}x{k}-{jnp.dtype(d).name}-{r}" for n, k, d, r in CASES])
def test_gemv_matches_reference(N, K, dtype, rows):
    """The weight read from the middle of its stack."""
    x, w = operands(dtype, rows, N, K)
    assert gemv_mod.supported(x, Vec(w, (1,)))
    got = jax.jit(lambda x, s: gemv(x, Vec(s, (1,))))(x, w)
    assert got.shape == (1, rows, N) and got.dtype == dtype
    check(got, reference(x, w, (1,)), dtype)


def test_gemv_rows_do_not_depend_on_the_others():
    """One program sums a weight row's K for every row alike: a row's result is the same bits in 1 row or 16."""
    x, w = operands(jnp.bfloat16, 16, 1536, 640, seed=1)
    run = jax.jit(lambda x, s: gemv(x, Vec(s, (2,))))
    together = np.asarray(run(x, w), np.float32)
    for r in (0, 11):
        np.testing.assert_array_equal(np.asarray(run(x[:, r:r + 1], w), np.float32), together[:, r:r + 1])


def test_gemv_falls_back_outside_its_shapes():
    """3 rows (not a power of two), 32 rows, a weight in another dtype, K or N not in chunks of 16: the reference."""
    w = Vec(jax.ShapeDtypeStruct((2, 64, 32), jnp.bfloat16), (0,))
    for shape, dtype in [((1, 3, 32), jnp.bfloat16), ((2, 16, 32), jnp.bfloat16), ((1, 4, 32), jnp.float32)]:
        assert not gemv_mod.supported(jax.ShapeDtypeStruct(shape, dtype), w)
    assert not gemv_mod.supported(jax.ShapeDtypeStruct((1, 4, 24), jnp.bfloat16),
                                  Vec(jax.ShapeDtypeStruct((2, 64, 24), jnp.bfloat16), (0,)))
    assert not gemv_mod.supported(jax.ShapeDtypeStruct((1, 4, 32), jnp.bfloat16),
                                  Vec(jax.ShapeDtypeStruct((2, 24, 32), jnp.bfloat16), (0,)))
    x, ws = operands(jnp.float32, 3, 64, 32)
    np.testing.assert_array_equal(gemv(x, Vec(ws, (1,))), gemv_ref(x, Vec(ws, (1,))))  # the very same function


@pytest.mark.parametrize("broken", ["stack_index", "weight_block"])
def test_gemv_comparison_has_teeth(broken, monkeypatch):
    """Broken variants fail the comparison above: the weight read at the stack's first entry (an index map that
    drops the static index), every program reading the first block of weight rows."""
    real = gemv_mod.pl.BlockSpec

    def spec(shape, index_map):
        if len(shape) != 3:
            return real(shape, index_map)
        if broken == "stack_index":
            return real(shape, lambda n: (0, *index_map(n)[1:]))
        return real(shape, lambda n: (index_map(n)[0], 0, 0))

    monkeypatch.setattr(gemv_mod.pl, "BlockSpec", spec)
    x, w = operands(jnp.bfloat16, 4, 256, 2560)
    got = jax.jit(lambda x, s: gemv(x, Vec(s, (1,))))(x, w)
    monkeypatch.undo()
    with pytest.raises(AssertionError):
        check(got, reference(x, w, (1,)), jnp.bfloat16)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on GPU the tests above compile the real kernel")
def test_gemv_lowers_to_one_triton_call(monkeypatch):
    """E4B's q/k/v product (bf16, 4 rows, 3072 x 2560, read from a stack of 21) lowers to one Triton kernel and no
    slice or copy of the stack beside it (the dot cut's padded rows are sliced off its [16, N] output: that slice
    only)."""
    from jax._src.pallas.triton import pallas_call_registration

    fake_h200 = types.SimpleNamespace(get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90))
    monkeypatch.setattr(pallas_call_registration, "gpu_info_lib", fake_h200)
    spec = jax.ShapeDtypeStruct
    text = jax.jit(lambda x, s: gemv(x, Vec(s, (3,)), interpret=False)).trace(
        spec((1, 4, 2560), jnp.bfloat16), spec((21, 3072, 2560), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    slices = [line for line in text.splitlines() if "slice" in line]
    assert "dynamic_slice" not in text and all("2560" not in line for line in slices), slices

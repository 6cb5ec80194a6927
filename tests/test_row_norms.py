"""The residual stream's norms kernel (`row_norms.add_norm`) against its jnp reference (`add_norm_ref`, the ops
`decoder_layer` ran before the kernel), interpreted on the CPU, compiled by Triton on the GPU lane.

The kernel rounds where the reference rounds; the two sum a row's squares in different orders, so a row's scale can
differ in its last fp32 bit, and a value rounded to bf16 after it by one bf16 ulp (fp32: the last bits).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import check_outputs
from jaxspec.pallas import row_norms
from jaxspec.pallas.row_norms import Vec, add_norm, add_norm_ref

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

CPU = jax.default_backend() == "cpu"
EPS = 1e-6


def operands(dtype, rows, H, seed=0):
    """y (a product's output: large), x (the stream), a [5, 4, H] norm stack, a lone [H] norm (the final norm) and
    a [5] scalar stack, all different, so that a vector or scalar read at the wrong index shows."""
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    y = (jax.random.normal(k[0], (rows, H)) * 30).astype(dtype).reshape(1, rows, H)
    x = jax.random.normal(k[1], (rows, H)).astype(dtype).reshape(1, rows, H)
    norms = 1 + jax.random.normal(k[2], (5, 4, H), jnp.float32)
    final = 1 + jax.random.normal(k[3], (H,), jnp.float32)
    scalars = jax.random.uniform(k[4], (5,), jnp.float32, 0.2, 2).astype(dtype)
    return y, x, norms, final, scalars


# (w_y, w_h, scalar) as the three call sites of `decoder_layer` use them: after the o projection (no scalar), the
# layer's end (the next layer's input norm or the final norm, and the layer scalar), before the PLE branch (no h)
SITES = {
    "post_attention": lambda n, f, s: (Vec(n, (2, 1)), Vec(n, (2, 2)), None),
    "layer_end": lambda n, f, s: (Vec(n, (3, 3)), Vec(n, (4, 0)), Vec(s, (3,))),
    "final": lambda n, f, s: (Vec(n, (4, 3)), Vec(f), Vec(s, (4,))),
    "before_ple": lambda n, f, s: (Vec(n, (1, 3)), None, None),
}


def check(got, want, dtype):
    check_outputs(got, want, dtype, bf16_atol=2**-11, fp32_tol=2e-6, same_shapes=False)


@pytest.mark.parametrize("site", list(SITES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,H", [(1, 2560), (4, 2560), (5, 640), (80, 64)], ids=["1x2560", "4x2560", "5x640",
                                                                                    "80x64"])
def test_add_norm_matches_reference(site, dtype, rows, H):
    """Gemma 4 E4B's width (2560: five 512-column chunks), 270M's (640), a tiny one; 1 to 80 rows (bs 16 × 5)."""
    y, x, norms, final, scalars = operands(dtype, rows, H)
    args = SITES[site](norms, final, scalars)
    assert row_norms.supported(y, x)
    got = jax.jit(lambda y, x: add_norm(y, x, *args, EPS))(y, x)
    check(got, jax.jit(lambda y, x: add_norm_ref(y, x, *args, EPS))(y, x), dtype)


def test_add_norm_rows_do_not_depend_on_the_others():
    """One program a row: a row's result is the same bits alone and among 63 others (batch invariance)."""
    y, x, norms, final, scalars = operands(jnp.bfloat16, 64, 2560, seed=1)
    args = SITES["layer_end"](norms, final, scalars)
    run = jax.jit(lambda y, x: add_norm(y, x, *args, EPS))
    together = run(y, x)
    for r in (0, 37):
        alone = run(y[:, r:r + 1], x[:, r:r + 1])
        for a, t in zip(alone, together):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(t[:, r:r + 1], np.float32))


def test_add_norm_falls_back_outside_its_shapes():
    """More than MAX_ROWS rows (prefill chunks), fp64 (the oracle tests) and odd widths run the reference."""
    for shape, dtype in [((1, row_norms.MAX_ROWS + 1, 64), jnp.float32), ((1, 4, 64), jnp.float64),
                         ((1, 4, 24), jnp.float32)]:
        y = x = jax.ShapeDtypeStruct(shape, dtype)
        assert not row_norms.supported(y, x)
    y, x, norms, final, scalars = operands(jnp.float32, row_norms.MAX_ROWS + 1, 64)
    args = SITES["layer_end"](norms, final, scalars)
    for g, w in zip(add_norm(y, x, *args, EPS), add_norm_ref(y, x, *args, EPS)):
        np.testing.assert_array_equal(g, w)  # the very same function


@pytest.mark.parametrize("broken", ["norm_index", "scalar_index"])
def test_add_norm_comparison_has_teeth(broken, monkeypatch):
    """Broken variants fail the comparison above: a norm vector read at the stack's first row of its layer (a
    BlockSpec index map that drops the vector's index), the scalar of layer 0 for every layer."""
    if broken == "norm_index":
        monkeypatch.setattr(row_norms, "_vec_spec", lambda v, H: row_norms.pl.BlockSpec(
            (*(None,) * len(v.index), H), lambda r, idx=tuple(v.index[:-1]) + (0,) * bool(v.index): (*idx, 0)))
    else:
        monkeypatch.setattr(row_norms, "_scalar_spec", lambda v: row_norms.pl.BlockSpec((1,), lambda r: (0,)))
    y, x, norms, final, scalars = operands(jnp.bfloat16, 4, 640)
    args = SITES["layer_end"](norms, final, scalars)
    got = jax.jit(lambda y, x: add_norm(y, x, *args, EPS))(y, x)
    with pytest.raises(AssertionError):
        check(got, jax.jit(lambda y, x: add_norm_ref(y, x, *args, EPS))(y, x), jnp.bfloat16)


@pytest.mark.skipif(not CPU, reason="on GPU the tests above compile the real kernel")
def test_add_norm_lowers_to_one_triton_call(monkeypatch):
    """E4B's shapes (bf16, 2560 wide, 4 and 128 rows, stacked weights read in place) lower to one Triton kernel and
    nothing else: no slice or copy of a weight stack beside it."""
    from jax._src.pallas.triton import pallas_call_registration

    fake_h200 = types.SimpleNamespace(get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90))
    monkeypatch.setattr(pallas_call_registration, "gpu_info_lib", fake_h200)
    spec = jax.ShapeDtypeStruct
    for rows in (4, 128):
        text = jax.jit(lambda y, x, n, s: add_norm(y, x, Vec(n, (3, 3)), Vec(n, (4, 0)), Vec(s, (3,)), EPS,
                                                   interpret=False)).trace(
            spec((1, rows, 2560), jnp.bfloat16), spec((1, rows, 2560), jnp.bfloat16),
            spec((21, 4, 2560), jnp.float32), spec((21,), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
        assert "stablehlo.slice" not in text and "dynamic_slice" not in text

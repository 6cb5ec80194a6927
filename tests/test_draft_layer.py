"""The drafter's fused step kernels (`jaxspec.pallas.draft_layer`) against their jnp references (CPU: interpreter; GPU:
Triton), each on random inputs of two row blocks, and each comparison shown to fail on a deliberately broken call.

The composition (a whole draft equal to the eager reference path's, every batch size) is in tests/test_drafter.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import Rope, rope_inv_freq
from jaxspec.paged_kv.metadata import round_width
from jaxspec.pallas.paged_attention import paged_attention_rows, row_ranges
from jaxspec.pallas import draft_layer as dl
from jaxspec.pallas.paged_attention import query_rows

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

B, H, NH, I, L = 32, 32, 4, 64, 3  # two row blocks of 16; three layers stacked
EPS = 1e-6
TOL = 1e-5 if jax.default_backend() == "cpu" else 2e-5


def exact(fn):
    """A reference jitted with true fp32 matmuls (the GPU's default would be TF32)."""
    import inspect

    names = ("layer", "num_kv_heads", "rows_per_kv_head", "eps", "num_heads", "head_dim")
    jitted = jax.jit(fn, static_argnames=[n for n in names if n in inspect.signature(fn).parameters])

    def call(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return jitted(*args, **kwargs)

    return call


def rand(rng, *shape, scale=1.0):
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)


def norms(rng):
    return jnp.asarray(1.0 + 0.2 * rng.normal(size=(L, 4, H)), jnp.float32)


def close(got, want):
    got, want = (np.asarray(x, np.float64) for x in (got, want))
    return np.max(np.abs(got - want)) <= TOL * max(1.0, np.max(np.abs(want)))


def assert_close(got, want, what):
    err = np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)))
    assert close(got, want), f"{what}: max |kernel - reference| = {err:.3g}"


# ---- each kernel --------------------------------------------------------------------------------------------------


def pre_case(rng, Ht=80, V=300):
    return (jnp.asarray(rng.integers(0, V, B), jnp.int32), rand(rng, B, Ht), rand(rng, V, Ht),
            rand(rng, H, 2 * Ht, scale=(2 * Ht) ** -0.5)), {}


def q_case(rng, D=16, KVH=2, chained=True):
    _, R = query_rows(1, NH // KVH, D)
    stream = (rand(rng, B, H), rand(rng, B, H)) if chained else rand(rng, B, H)
    prev = (norms(rng), 2, jnp.asarray(0.5 + rng.random(L), jnp.float32)) if chained else None
    args = (stream, norms(rng), 1, rand(rng, L, NH * D, H, scale=H ** -0.5))
    return args, dict(head_dim=D, num_kv_heads=KVH, rows_per_kv_head=R, eps=EPS, prev=prev)


def o_case(rng, D=16, KVH=2):
    _, R = query_rows(1, NH // KVH, D)
    return (rand(rng, B, KVH, R, D), rand(rng, L, H, NH * D, scale=(NH * D) ** -0.5), 2), dict(num_heads=NH)


def up_case(rng):
    return (rand(rng, B, H), rand(rng, B, H), norms(rng), rand(rng, L, 2 * I, H, scale=H ** -0.5), 0), dict(eps=EPS)


def down_case(rng):
    return (rand(rng, B, I), rand(rng, L, H, I, scale=I ** -0.5), 1), {}


def final_case(rng, Ht=80):
    return (rand(rng, B, H), rand(rng, B, H), norms(rng), 2, jnp.asarray(0.5 + rng.random(L), jnp.float32),
            jnp.asarray(1 + 0.2 * rng.normal(size=H), jnp.float32), rand(rng, Ht, H, scale=H ** -0.5)), dict(eps=EPS)


CASES = {
    "pre_projection": (dl.pre_projection, dl.pre_projection_ref, pre_case),
    "q_proj_first": (dl.q_proj, dl.q_proj_ref, functools.partial(q_case, chained=False)),
    "q_proj_chained": (dl.q_proj, dl.q_proj_ref, q_case),
    "q_proj_d32_one_kv_head": (dl.q_proj, dl.q_proj_ref, functools.partial(q_case, D=32, KVH=1)),
    "o_proj": (dl.o_proj, dl.o_proj_ref, o_case),
    "o_proj_one_kv_head": (dl.o_proj, dl.o_proj_ref, functools.partial(o_case, KVH=1)),
    "mlp_up": (dl.mlp_up, dl.mlp_up_ref, up_case),
    "mlp_down": (dl.mlp_down, dl.mlp_down_ref, down_case),
    "final_projection": (dl.final_projection, dl.final_projection_ref, final_case),
}


def outputs(x):
    return [np.asarray(a) for a in (x if isinstance(x, (tuple, list)) else (x,))]


@pytest.mark.parametrize("name", CASES)
def test_kernel_equals_reference(name):
    kernel, ref, case = CASES[name]
    rng = np.random.default_rng(len(name))
    args, kw = case(rng)
    got, want = outputs(kernel(*args, **kw)), outputs(exact(ref)(*args, **kw))
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, n, g.shape, w.shape, g.dtype, w.dtype)
        if name.startswith("q_proj") and n < 2:  # rows G.. of each kv head are left unwritten
            G = NH // kw["num_kv_heads"]
            g, w = g[:, :, :G], w[:, :, :G]
        assert np.all(np.isfinite(g)), (name, n)
        assert_close(g, w, f"{name} output {n}")


@pytest.mark.parametrize("name", ["pre_projection", "q_proj_chained", "mlp_up", "final_projection"])
def test_kernel_bf16_within_rounding(name):
    """bf16 weights and activations: the kernel rounds where the reference rounds, so the two differ by summation
    order only (a few bf16 steps at most, never a misplaced rounding that would grow through the layers)."""
    kernel, ref, case = CASES[name]
    rng = np.random.default_rng(7)
    args, kw = case(rng)
    def to_bf16(a):
        return a.astype(jnp.bfloat16) if getattr(a, "dtype", None) == jnp.float32 and a.ndim >= 2 else a

    args = jax.tree.map(to_bf16, args)
    kw = {k: jax.tree.map(to_bf16, v) for k, v in kw.items()}
    for g, w in zip(outputs(kernel(*args, **kw)), outputs(ref(*args, **kw))):
        if name.startswith("q_proj") and g.ndim == 4:
            g, w = g[:, :, :2], w[:, :, :2]
        g, w = g.astype(np.float32), w.astype(np.float32)
        assert g.dtype == w.dtype
        rel = np.max(np.abs(g - w)) / np.max(np.abs(w))
        assert rel < 2e-2, (name, rel)


# ---- sensitivity: each comparison fails on a broken call ------------------------------------------------------------


def _break(name, args, kw):
    """One plausible bug per kernel: a wrong layer of a stack, the RoPE partner's sign, the previous layer's
    residual skipped, gate and up swapped, ..."""
    args = list(args)
    if name == "pre_projection":
        args[0] = (args[0] + 1) % args[2].shape[0]  # the next token's embedding
    elif name == "q_proj_chained":
        kw = {**kw, "prev": (kw["prev"][0], 1, kw["prev"][2])}  # the previous layer's norm from the wrong layer
    elif name == "q_proj_first":
        args[2] = 2  # the wrong layer of the stack
    elif name == "o_proj":
        args[0] = args[0][:, ::-1]  # kv heads swapped
    elif name == "mlp_up":
        args[3] = jnp.concatenate([args[3][:, I:], args[3][:, :I]], axis=1)  # gate and up swapped
    elif name == "mlp_down":
        args[2] = 0
    elif name == "final_projection":
        args[1] = jnp.zeros_like(args[1])  # the last layer's MLP output dropped (a layer_scalar is normed away here)
    return args, kw


@pytest.mark.parametrize("name", ["pre_projection", "q_proj_first", "q_proj_chained", "o_proj", "mlp_up",
                                  "mlp_down", "final_projection"])
def test_comparison_catches_a_broken_call(name):
    kernel, ref, case = CASES[name]
    rng = np.random.default_rng(len(name))
    args, kw = case(rng)
    want = outputs(exact(ref)(*args, **kw))
    bargs, bkw = _break(name, args, kw)
    got = outputs(kernel(*bargs, **bkw))
    if name.startswith("q_proj"):
        G = NH // kw["num_kv_heads"]
        for n in (0, 1):
            got[n], want[n] = got[n][:, :, :G], want[n][:, :, :G]
    assert not all(close(g, w) for g, w in zip(got, want)), f"{name}: the broken call still matched"


# ---- the attention kernel's query prologue (q-norm and RoPE of q_proj's output) -------------------------------------


@pytest.mark.parametrize("D,partial", [(16, 1.0), (32, 0.25)])
@pytest.mark.parametrize("broken", [False, True])
def test_attention_prologue_equals_norm_rope_then_attention(D, partial, broken):
    """paged_attention_rows(rope=...) on q_proj's raw output equals the attention of the reference's normed and
    rotated queries; with the RoPE partner's columns unshifted (a broken q_swap) it does not."""
    rng = np.random.default_rng(D)
    KVH, S, Bm = 2, 64, 5  # 5 live rows of 8 query rows
    G = NH // KVH
    _, R = query_rows(1, G, D)
    q = rand(rng, 8, KVH, R, D)
    q_swap = q if broken else jnp.roll(q, -(D // 2), axis=-1)
    q_norm = jnp.asarray(1 + 0.2 * rng.normal(size=(L, D)), jnp.float32)
    inv = jnp.asarray(rope_inv_freq(Rope(theta=10_000.0, partial_factor=partial), D, np.float32))
    cached = jnp.asarray(rng.integers(1, S, 8), jnp.int32)
    cos, sin = dl.rope_tables(cached, inv)
    k_cache, v_cache = rand(rng, 3, S + 8, KVH, D), rand(rng, 3, S + 8, KVH, D)
    width = round_width(S)
    read = jnp.asarray(np.pad(rng.permutation(S + 8)[:S], (0, width - S))[None].repeat(Bm, 0), jnp.int32)
    kv_start = jnp.zeros(Bm, jnp.int32)
    q_lo, q_hi = kv_start[:, None], (cached[:Bm] - 1)[:, None]
    masks = row_ranges(kv_start, q_lo, q_hi, G, R, width)
    got = paged_attention_rows(q, k_cache, v_cache, read, kv_start, *masks, layer=1,
                               rope=(q_swap, q_norm, 2, cos, sin, EPS))
    normed = exact(dl.norm_rope_ref)(q, q_norm, 2, cos, sin, EPS)
    want = paged_attention_rows(normed, k_cache, v_cache, read, kv_start, *masks, layer=1)
    assert got.shape == (8, KVH, R, D)
    g, w = np.asarray(got)[:Bm, :, :G], np.asarray(want)[:Bm, :, :G]
    assert close(g, w) != broken, np.max(np.abs(g - w))

"""Pallas (Triton) kernel of a decoder layer's step between its q/k/v product and its attention, and its jnp reference
(`qkv_cache_ref`: `gemma4.joint_qkv`'s math and the paged cache's K/V scatter, as the step ran them before).

A non-shared Gemma 4 layer norms its q, k and v heads (q_norm, k_norm, the weightless v-norm), rotates q and k (RoPE)
and writes K and V into the paged cache at the step's slots. XLA runs that as three to five kernels a layer: the
heads' norm (one Triton fusion at 4 rows; a reduction and an elementwise kernel at 1 row), q's RoPE, and one scatter
each for K and V with k's RoPE inside (`python -m jaxspec.bench graph`, BENCHMARKS.md session 24). Here one program
per token row does all of it: the row's heads loaded once, each head as its two RoPE halves (pairs i and i + D/2), so
the rotation needs no permuted copy; q stored for the attention kernel; K and V stored in place into the layer's
stack (the stacks are aliased to the outputs, as the scatter updated them in place), a padding row (slot 0) storing
nothing, as the scatter drops it. A KV-shared layer's q alone (norm and RoPE, two kernels of XLA's) is `q_rope`, the
same program without K and V. Values are rounded to the activations' dtype where the reference rounds them (the
norm's output, the rotation's); the norm sums a head's squares in another order than `jnp.mean`, so a head's scale
can differ in its last fp32 bit and a value rounded after it by one ulp of the dtype. A row never reads another row.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxspec.model.layers import joint_heads, rms_norm, rotate
from jaxspec.pallas.draft_layer import _interpret
from jaxspec.pallas.row_norms import Vec

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)

pallas_call = pl.pallas_call  # (a module name, so that tests can watch the kernel's calls)


def split_heads(out, num_heads: int, head_dim: int, has_v: bool):
    """The fused q/k/v product's output [B, T, (NH + KVH (+ KVH)) D] as heads [B, T, heads, D], and KVH."""
    B, T, _ = out.shape
    heads = out.reshape(B, T, -1, head_dim)
    return heads, (heads.shape[2] - num_heads) // (2 if has_v else 1)


def write_rows(stack, layer: int, slots, rows):
    """stack [L, S, KVH, D] with rows [B, T, KVH, D] written at stack[layer, slots] (slots int32 [B, T]). Padding
    positions (slot 0, the dummy page) are dropped, not written: every index left is unique, so the scatter needs no
    atomics. Written to slot 0, a 256-position prefill chunk's padding serialised on one address: 15-20 ms a layer for
    a bucket-8 chunk on the H200 (BENCHMARKS.md session 9)."""
    B, T = slots.shape
    index = jnp.where(slots == 0, stack.shape[1], slots).reshape(-1)
    return stack.at[layer, index].set(rows.reshape(B * T, *rows.shape[2:]), mode="drop", unique_indices=True)


def qkv_cache_ref(out, q_norm: Vec, k_norm: Vec, cos, sin, k_stack, v_stack, layer: int, slots, *, num_heads: int,
                  has_v: bool, v_norm: bool, eps: float):
    """out: the product [B, T, (NH + KVH (+ KVH)) D]; q_norm, k_norm: fp32 [D] vectors (`Vec`: a row of a stack,
    read in place by the kernel); cos, sin: fp32 [B, T, D] (`layers.rope_tables`); k_stack, v_stack: [L, S, KVH, D];
    slots: int32 [B, T] (0: padding, not written). Returns (q [B, T, NH, D] normed and rotated, k_stack, v_stack with
    the rows' K (normed, rotated) and V (normed where v_norm; the raw K projection where not has_v) written at layer
    `layer`): `layers.joint_heads`, then `write_rows`, as the step ran them before."""
    q, k, v = joint_heads(out, q_norm.get(), k_norm.get(), cos, sin, num_heads=num_heads, head_dim=k_stack.shape[-1],
                          has_v=has_v, v_norm=v_norm, eps=eps)
    return q, write_rows(k_stack, layer, slots, k), write_rows(v_stack, layer, slots, v)


def _rounding(dtype):
    return lambda v: v.astype(dtype).astype(jnp.float32)  # where the reference materialises a value


def _norm(a, b, w, *, D: int, eps: float, dtype):
    """A head's halves normed (rsqrt of the mean square over both), times w's halves (None: weightless), rounded."""
    r = lax.rsqrt((jnp.sum(a * a) + jnp.sum(b * b)) / D + eps)
    a, b = a * r, b * r
    if w is not None:
        a, b = a * w[0], b * w[1]
    rnd = _rounding(dtype)
    return rnd(a), rnd(b)


def _rope(a, b, cos, sin, dtype):
    """rotate-half on a head's halves: (a, b) -> (a cos - b sin, b cos + a sin), rounded to dtype."""
    return (a * cos[0] - b * sin[0]).astype(dtype), (b * cos[1] + a * sin[1]).astype(dtype)


def _row(out_ref, qn_ref, cos_ref, sin_ref, q_ref, m, heads: int, qn_index: tuple):
    """Program m's loads, every one issued before any result is needed: the row's `heads` heads as halves (fp32), q's
    norm weight, the row's cos and sin; and the halves' slices."""
    half = q_ref.shape[-1] // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    f32 = jnp.float32
    cos = (cos_ref[m, lo], cos_ref[m, hi])
    sin = (sin_ref[m, lo], sin_ref[m, hi])
    rows = [(out_ref[m, j, lo].astype(f32), out_ref[m, j, hi].astype(f32)) for j in range(heads)]
    qn = (qn_ref[(*qn_index, lo)].astype(f32), qn_ref[(*qn_index, hi)].astype(f32))
    return rows, qn, cos, sin, lo, hi


def _store_q(q_ref, m, rows, qn, cos, sin, lo, hi, *, num_heads: int, eps: float):
    D, dtype = q_ref.shape[-1], q_ref.dtype
    for j in range(num_heads):
        a, b = _rope(*_norm(*rows[j], qn, D=D, eps=eps, dtype=dtype), cos, sin, dtype)
        q_ref[m, j, lo] = a
        q_ref[m, j, hi] = b


def _kernel(out_ref, qn_ref, kn_ref, cos_ref, sin_ref, slot_ref, _k_in, _v_in, q_ref, k_ref, v_ref, *,
            num_heads: int, kv_heads: int, has_v: bool, v_norm: bool, eps: float, layer: int, qn_index: tuple,
            kn_index: tuple):
    m = pl.program_id(0)
    D, dtype = q_ref.shape[-1], q_ref.dtype
    rows, qn, cos, sin, lo, hi = _row(out_ref, qn_ref, cos_ref, sin_ref, q_ref, m,
                                      num_heads + kv_heads * (2 if has_v else 1), qn_index)
    kn = (kn_ref[(*kn_index, lo)].astype(jnp.float32), kn_ref[(*kn_index, hi)].astype(jnp.float32))
    _store_q(q_ref, m, rows, qn, cos, sin, lo, hi, num_heads=num_heads, eps=eps)
    slot = slot_ref[m]

    @pl.when(slot != 0)  # a padding row writes nothing (the scatter drops it)
    def _():
        for h in range(kv_heads):
            a, b = _rope(*_norm(*rows[num_heads + h], kn, D=D, eps=eps, dtype=dtype), cos, sin, dtype)
            k_ref[layer, slot, h, lo] = a
            k_ref[layer, slot, h, hi] = b
            va, vb = rows[num_heads + kv_heads + h] if has_v else rows[num_heads + h]
            if v_norm:
                va, vb = _norm(va, vb, None, D=D, eps=eps, dtype=dtype)
            v_ref[layer, slot, h, lo] = va.astype(dtype)
            v_ref[layer, slot, h, hi] = vb.astype(dtype)


def _q_kernel(out_ref, qn_ref, cos_ref, sin_ref, q_ref, *, num_heads: int, eps: float, qn_index: tuple):
    m = pl.program_id(0)
    rows, qn, cos, sin, lo, hi = _row(out_ref, qn_ref, cos_ref, sin_ref, q_ref, m, num_heads, qn_index)
    _store_q(q_ref, m, rows, qn, cos, sin, lo, hi, num_heads=num_heads, eps=eps)


def supported(out, k_stack) -> bool:
    """Whether the kernel takes this layer: a head dim whose halves are power-of-two vectors of >= 16."""
    half = k_stack.shape[-1] // 2
    return k_stack.shape[-1] % 2 == 0 and half >= 16 and half & (half - 1) == 0 and out.dtype == k_stack.dtype


def qkv_cache(out, q_norm: Vec, k_norm: Vec, cos, sin, k_stack, v_stack, layer: int, slots, *, num_heads: int,
              has_v: bool, v_norm: bool, eps: float, interpret: bool | None = None):
    """`qkv_cache_ref` in one kernel launch (one program per token row) where `supported`; the reference otherwise.
    interpret: None runs the interpreter on CPU backends and compiles with Triton elsewhere."""
    if not supported(out, k_stack):
        return qkv_cache_ref(out, q_norm, k_norm, cos, sin, k_stack, v_stack, layer, slots, num_heads=num_heads,
                             has_v=has_v, v_norm=v_norm, eps=eps)
    B, T, _ = out.shape
    D = k_stack.shape[-1]
    heads, KVH = split_heads(out, num_heads, D, has_v)
    M = B * T
    operands = [heads.reshape(M, heads.shape[2], D), q_norm.stack, k_norm.stack,
                cos.reshape(M, D).astype(jnp.float32), sin.reshape(M, D).astype(jnp.float32),
                slots.reshape(M).astype(jnp.int32), k_stack, v_stack]
    whole = lambda x: pl.BlockSpec(x.shape, lambda m: (0,) * x.ndim)  # noqa: E731  (indexed in the kernel)
    q_shape = jax.ShapeDtypeStruct((M, num_heads, D), out.dtype)
    kernel = functools.partial(_kernel, num_heads=num_heads, kv_heads=KVH, has_v=has_v, v_norm=v_norm,
                               eps=float(eps), layer=int(layer), qn_index=tuple(q_norm.index),
                               kn_index=tuple(k_norm.index))
    q, k_stack, v_stack = pallas_call(
        kernel, grid=(M,), in_specs=[whole(x) for x in operands],
        out_specs=[whole(q_shape), whole(k_stack), whole(v_stack)],
        out_shape=[q_shape, jax.ShapeDtypeStruct(k_stack.shape, k_stack.dtype),
                   jax.ShapeDtypeStruct(v_stack.shape, v_stack.dtype)],
        input_output_aliases={6: 1, 7: 2},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=_interpret(interpret), name="qkv_cache",
    )(*operands)
    return q.reshape(B, T, num_heads, D), k_stack, v_stack


def q_rope_ref(q, q_norm: Vec, cos, sin, *, eps: float):
    """A KV-shared layer's q projection [B, T, NH D] -> [B, T, NH, D]: each head normed (q_norm) and rotated, as
    `gemma4.qkv` does it for a layer without K and V."""
    B, T, _ = q.shape
    D = cos.shape[-1]
    return rotate(rms_norm(q.reshape(B, T, -1, D), q_norm.get(), eps), cos[:, :, None, :], sin[:, :, None, :])


def q_rope(q, q_norm: Vec, cos, sin, *, eps: float, interpret: bool | None = None):
    """`q_rope_ref` in one kernel launch (one program per token row) where the head dim's halves are power-of-two
    vectors of >= 16; the reference otherwise (XLA runs it as two kernels: the norm and the rotation)."""
    B, T, _ = q.shape
    D = cos.shape[-1]
    half = D // 2
    if D % 2 or half < 16 or half & (half - 1):
        return q_rope_ref(q, q_norm, cos, sin, eps=eps)
    M, NH = B * T, q.shape[-1] // D
    operands = [q.reshape(M, NH, D), q_norm.stack, cos.reshape(M, D).astype(jnp.float32),
                sin.reshape(M, D).astype(jnp.float32)]
    whole = lambda x: pl.BlockSpec(x.shape, lambda m: (0,) * x.ndim)  # noqa: E731
    q_shape = jax.ShapeDtypeStruct((M, NH, D), q.dtype)
    out = pallas_call(
        functools.partial(_q_kernel, num_heads=NH, eps=float(eps), qn_index=tuple(q_norm.index)),
        grid=(M,), in_specs=[whole(x) for x in operands], out_specs=whole(q_shape), out_shape=q_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), interpret=_interpret(interpret),
        name="q_rope",
    )(*operands)
    return out.reshape(B, T, NH, D)

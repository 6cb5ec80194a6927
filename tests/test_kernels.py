"""Pallas kernels vs their jnp references (CPU: interpreter; GPU: the same tests compile real Triton kernels).

Batches mix rows of every interesting cached length (0, 1, W-1, W, W+1, many pages, exactly `width` live entries) and a
padded row (ends == starts, empty query range); pages are distinct per row as a real allocator hands them out, and the
sliding layers read through a random full -> SWA page mapping. Isolation: every slot that no live entry references
holds NaN (so do the dead entries of kv_indices), and the kernel must still match the reference on clean data.
"""

from __future__ import annotations

import functools
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas.kv_indices import gather_kv_indices, gather_kv_indices_ref
from jaxspec.pallas.qkv_cache import q_rope_ref, qkv_cache_ref
from jaxspec.pallas.row_norms import Vec
from jaxspec.pallas.paged_attention import (paged_attention, paged_attention_blocked, paged_attention_qkv,
                                            paged_attention_ref,
                                            paged_attention_rows, query_rows, row_ranges, default_block_k,
                                            default_splits, walk_knobs)

# The kernel modules silence this at import, but pytest resets warning filters for each test.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")



def exact_reference(fn, *static):
    """The reference jitted (one XLA program per shape, not op-by-op dispatch) with true fp32 matmuls: on GPU, XLA's
    default precision would run fp32 einsums in TF32, far outside the 1e-5 tolerance."""
    jitted = jax.jit(fn, static_argnames=static)

    def call(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return jitted(*args, **kwargs)

    return call


gather_kv_indices_ref = exact_reference(gather_kv_indices_ref, "width", "page_size")
paged_attention_ref = exact_reference(paged_attention_ref, "scale")

PAGE = 4
WINDOW = 8  # a sliding-layer query at position p sees p - WINDOW .. p (WINDOW + 1 keys)
BLOCK = 8  # gather block of the attention tests
CACHED = (0, 1, WINDOW - 1, WINDOW, WINDOW + 1, 40)


def make_batch(rng, *, cached, tq, window, translate, block=BLOCK):
    """Page tables, windows and query ranges of a mixed batch; the last row is padding.

    Row b holds keys 0 .. cached[b] + tq - 1 (the tq new tokens are written before attention, as in verify); query t
    sits at cached[b] + t. window None: a full layer. The width is the longest live window rounded up to `block`.
    """
    B = len(cached) + 1
    ctx = [c + tq for c in cached]
    max_pages = -(-max(ctx + [window or 0]) // PAGE) + 2
    num_full_pages = sum(-(-n // PAGE) for n in ctx) + 6
    free = list(rng.permutation(np.arange(1, num_full_pages)))
    page_table = np.zeros((B, max_pages), np.int32)
    starts = np.zeros(B, np.int32)
    ends = np.zeros(B, np.int32)
    q_lo = np.zeros((B, tq), np.int32)
    q_hi = np.full((B, tq), -1, np.int32)  # padding row: no query sees anything
    for b, c in enumerate(cached):
        for p in range(-(-(c + tq) // PAGE)):
            page_table[b, p] = free.pop()
        q_hi[b] = c + np.arange(tq)
        q_lo[b] = 0 if window is None else np.maximum(q_hi[b] - window, 0)
        starts[b], ends[b] = q_lo[b, 0], c + tq
    swa_of_full = None
    num_pages = num_full_pages
    if translate:
        window_pages = sorted({page_table[b, p] for b in range(B) if ends[b] > starts[b]
                               for p in range(starts[b] // PAGE, (ends[b] - 1) // PAGE + 1)})
        num_pages = len(window_pages) + 3
        # Pages out of every window keep stale SWA ids (possibly another row's): they must never be read.
        swa_of_full = rng.integers(1, num_pages, num_full_pages).astype(np.int32)
        swa_of_full[window_pages] = rng.permutation(np.arange(1, num_pages))[: len(window_pages)]
        swa_of_full[0] = 0
    width = -(-int((ends - starts).max()) // block) * block
    return types.SimpleNamespace(
        page_table=jnp.asarray(page_table), starts=jnp.asarray(starts), ends=jnp.asarray(ends),
        swa_of_full=None if swa_of_full is None else jnp.asarray(swa_of_full), q_lo=jnp.asarray(q_lo),
        q_hi=jnp.asarray(q_hi), width=width, num_slots=num_pages * PAGE,
    )


def live_mask(batch):
    return np.arange(batch.width)[None, :] < np.asarray(batch.ends - batch.starts)[:, None]


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "sliding"])
@pytest.mark.parametrize("translate", [False, True], ids=["direct", "swa"])
def test_gather_kv_indices_matches_reference(window, translate):
    # block 4: the longest rows (40 + 4 full, 8 + 4 sliding) fill the width exactly.
    batch = make_batch(np.random.default_rng(0), cached=CACHED, tq=4, window=window, translate=translate, block=4)
    args = (batch.page_table, batch.starts, batch.ends, batch.swa_of_full)
    got = gather_kv_indices(*args, width=batch.width, page_size=PAGE, block=4, num_splits=3)
    want = gather_kv_indices_ref(*args, width=batch.width, page_size=PAGE)
    live = live_mask(batch)
    assert live[:, 0].sum() < len(live) and live.all(axis=1).any()  # a padded row and a row of exactly `width`
    np.testing.assert_array_equal(np.asarray(got)[live], np.asarray(want)[live])


def test_gather_kv_indices_needs_width_multiple_of_block():
    batch = make_batch(np.random.default_rng(0), cached=(3,), tq=1, window=None, translate=False, block=4)
    with pytest.raises(ValueError, match="dividing width"):
        gather_kv_indices(batch.page_table, batch.starts, batch.ends, None, width=12, page_size=PAGE, block=8)


def attention_inputs(rng, batch, *, kvh, g, tq, d, dtype):
    """Clean and poisoned K/V pools, q, and kv_indices whose dead entries point at random (poisoned) slots."""
    indices = gather_kv_indices(batch.page_table, batch.starts, batch.ends, batch.swa_of_full, width=batch.width,
                                page_size=PAGE, block=BLOCK, num_splits=2)
    live = live_mask(batch)
    indices = np.where(live, np.asarray(indices), rng.integers(0, batch.num_slots, live.shape)).astype(np.int32)
    k = rng.standard_normal((batch.num_slots, kvh, d)).astype(np.float32)
    v = rng.standard_normal((batch.num_slots, kvh, d)).astype(np.float32)
    unread = np.ones(batch.num_slots, bool)
    unread[indices[live]] = False
    assert unread[0] and unread.sum() > 3
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[unread], v_bad[unread] = np.nan, np.nan
    q = rng.standard_normal((len(live), tq, kvh * g, d)).astype(np.float32)
    q, k, v, k_bad, v_bad = (jnp.asarray(a, dtype) for a in (q, k, v, k_bad, v_bad))
    return types.SimpleNamespace(q=q, k=k, v=v, k_bad=k_bad, v_bad=v_bad, indices=jnp.asarray(indices))


ATTENTION_CASES = [
    # g, tq, d, dtype, window, cached, tuning
    (1, 1, 16, jnp.float32, None, CACHED, dict(num_splits=1)),
    (2, 4, 16, jnp.float32, WINDOW, CACHED, dict(num_splits=3)),
    (4, 1, 16, jnp.float32, WINDOW, CACHED, dict(num_splits=2)),
    (4, 4, 16, jnp.float32, None, CACHED, dict(num_splits=2)),
    (8, 4, 16, jnp.float32, None, (WINDOW + 1, 37), dict(num_splits=2, block_q=16)),  # 32 rows: 2 row blocks
    (2, 4, 256, jnp.bfloat16, WINDOW, (1, WINDOW + 1), dict(num_splits=2)),
    (2, 1, 512, jnp.float32, None, (WINDOW, 21), dict(num_splits=2)),
]


def assert_matches_reference(g, tq, d, dtype, window, cached, tuning, block_k=16, **kw):
    """One case of ATTENTION_CASES (a mixed batch, poisoned pools, blocks of 16 keys unless block_k) through
    `paged_attention` with the options kw (over the case's tuning), against the exact reference on the clean pools.
    Returns the kernel's output (fp32)."""
    rng = np.random.default_rng(0)
    batch = make_batch(rng, cached=cached, tq=tq, window=window, translate=window is not None)
    x = attention_inputs(rng, batch, kvh=2, g=g, tq=tq, d=d, dtype=dtype)
    got = paged_attention(x.q, x.k_bad, x.v_bad, x.indices, batch.starts, batch.q_lo, batch.q_hi, scale=0.3,
                          block_k=block_k, **{**tuning, **kw})
    want = paged_attention_ref(x.q, x.k, x.v, x.indices, batch.starts, batch.q_lo, batch.q_hi, scale=0.3)
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_array_equal(got[-1], 0.0)  # padded row: no query sees a key
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    return got


@pytest.mark.parametrize("gather_q", [False, True], ids=["q-rows", "q-gathered"])
@pytest.mark.parametrize("case", ATTENTION_CASES,
                         ids=[f"g{c[0]}-tq{c[1]}-d{c[2]}-{jnp.dtype(c[3]).name}-{'swa' if c[4] else 'full'}"
                              f"-s{c[6]['num_splits']}{'-bq' if 'block_q' in c[6] else ''}" for c in ATTENTION_CASES])
def test_paged_attention_matches_reference(case, gather_q):
    """gather_q: the kernels read their query rows from q as it is (two kv heads, so rows of a kv head are not
    contiguous in q) instead of a transposed, padded copy, and write their output rows in that layout (padding rows
    write nothing: the real rows they repeat must survive)."""
    assert_matches_reference(*case, gather_q=gather_q)


@pytest.mark.parametrize("case", [1, 3], ids=["g2-tq4-swa-s3", "g4-tq4-full-s2"])
def test_fixed_splits_match_reference(case):
    """fixed_splits (the engine's batch-invariant mode): pieces at fixed entries of the index list and blocks at
    multiples of block_k, not following the live span, on the poisoned pools of the mixed batch: still the
    reference's attention."""
    assert_matches_reference(*ATTENTION_CASES[case], gather_q=True, fixed_splits=True)


@pytest.mark.parametrize("case", [1, 3, 6], ids=["g2-tq4-swa", "g4-tq4-full", "g2-tq1-d512-full"])
def test_granule_pieces_match_reference(case):
    """granule 16 under 32-key blocks: pieces of the live span end inside a block (the keys past a piece's end are
    its neighbour's), on the poisoned pools of the mixed batch: still the reference's attention."""
    assert_matches_reference(*ATTENTION_CASES[case], gather_q=True, block_k=32, granule=16, num_splits=4)


@pytest.mark.parametrize("case", [5, 6], ids=["g2-tq4-d256-bf16-swa", "g2-tq1-d512-full"])
def test_long_walk_knobs_match_reference(case):
    """`walk_knobs`' long-walk form (4 warps, K / V a block ahead: 2 stages) at the head dims it changes, on the
    poisoned pools of the mixed batch: the reference's attention; on a GPU also the short-walk form's output, bit
    for bit in bf16 (neither knob moves a block's keys), within fp32's rounding in fp32 (the H100 gave 1-ulp
    differences in 31% of the d-512 case's elements, max 4.8e-7: the warps' share of each product differs,
    session 44). In Pallas' interpreter the knobs do nothing: this test is the GPU lane's."""
    long = assert_matches_reference(*ATTENTION_CASES[case], gather_q=True, block_k=32, num_warps=4, num_stages=2)
    if jax.default_backend() == "gpu":
        short = assert_matches_reference(*ATTENTION_CASES[case], gather_q=True, block_k=32, num_warps=8,
                                         num_stages=1 if ATTENTION_CASES[case][2] >= 512 else 2)
        if ATTENTION_CASES[case][3] == jnp.bfloat16:
            np.testing.assert_array_equal(long, short)
        else:
            np.testing.assert_allclose(long, short, rtol=1e-6, atol=1e-6)


def test_walk_knobs_leave_the_bs1_steps_as_tuned():
    """Which of E4B's attention calls take the long-walk form (`walk_knobs`), from the real geometry (each layer
    type's kv_indices width at 4K and `default_splits`): every call of a bs-1 step (decode, verify, the drafter's
    propose) keeps the form it was tuned and timed with; the drafter's bs-64 propose (both layer types) and the
    target's bs-16 verify over its global layers' 4K keys walk long."""
    from jaxspec.config import FULL, PRESETS, SLIDING
    from jaxspec.paged_kv.metadata import round_width

    cfg = PRESETS["E4B"]

    def knobs(bs: int, tq: int, group: int, layer_type: str, keep: int, new_kv: bool = False, itemsize: int = 2):
        d = cfg.type_head_dim(layer_type)
        width = round_width(4096 if layer_type == FULL else keep + tq)
        block_q, rows = query_rows(tq, group, d)
        splits = default_splits(bs, cfg.type_kv_heads(layer_type), rows // block_q, width, default_block_k(d))
        return walk_knobs(d, width, splits, new_kv, itemsize)

    target_g, drafter_g = cfg.num_heads // cfg.num_kv_heads, 4 // cfg.num_kv_heads
    for layer_type, short in ((SLIDING, (8, 2)), (FULL, (8, 1))):
        for tq in (1, 4):  # the target's decode and verify steps
            assert knobs(1, tq, target_g, layer_type, cfg.sliding_window - 1) == short
        assert knobs(1, 1, drafter_g, layer_type, cfg.sliding_window + 1) == short  # the bs-1 propose
        assert knobs(64, 1, drafter_g, layer_type, cfg.sliding_window + 1) == (4, 2)  # the bs-64 propose
    assert knobs(16, 4, target_g, FULL, 0) == (4, 2)  # the KV-shared global layers'
    # the non-shared ones' in-kernel q/k/v step walks long with 8 warps; at bs 1 it keeps the tuned form
    assert knobs(16, 4, target_g, FULL, 0, new_kv=True) == (8, 2)
    # in fp32 (--dtype fp32) two stages of its K / V blocks overflow shared memory at head_dim 512: one stage
    assert knobs(16, 4, target_g, FULL, 0, new_kv=True, itemsize=4) == (8, 1)
    assert knobs(16, 4, target_g, FULL, 0, itemsize=4) == (4, 2)  # the KV-shared layers' walk fits (GPU lane)
    for layer_type, short in ((SLIDING, (8, 2)), (FULL, (8, 1))):
        assert knobs(1, 4, target_g, layer_type, cfg.sliding_window - 1, new_kv=True) == short


@pytest.mark.parametrize("dtype, form", [(jnp.bfloat16, (8, 2)), (jnp.float32, (8, 1))], ids=["bf16", "fp32"])
def test_qkv_in_the_attention_kernel_long_walk_matches_reference(monkeypatch, dtype, form):
    """The in-kernel q/k/v step (`paged_attention_qkv`) in `walk_knobs`' long-walk form, forced by its thresholds
    (these short tables never reach 256 keys a piece), at head_dim 512: in bf16 it differs from the tuned form (8
    warps, 2 stages against 1; at 256 and below they are the same), in fp32 it keeps 1 stage (2 asked 295 040 bytes
    of shared memory on the H100, session 45's GPU lane): test_qkv_in_the_attention_kernel_matches_reference's
    checks. On a GPU this is the bs-16 verify's non-shared global layers' kernel; the interpreter ignores the
    knobs."""
    i = 3  # g2-d512-s2-no-vnorm
    import jaxspec.pallas.paged_attention as pa

    monkeypatch.setattr(pa, "LONG_WALK_PIECES", 64)
    monkeypatch.setattr(pa, "LONG_WALK_KEYS", 0)
    asked = []
    monkeypatch.setattr(pa, "walk_knobs", lambda *a, real=pa.walk_knobs: asked.append(real(*a)) or asked[-1])
    paged_attention_qkv.clear_cache()  # jitted: a trace of these shapes in the tuned form would be reused
    try:
        case, _, has_v, v_norm = QKV_CASES[i]
        test_qkv_in_the_attention_kernel_matches_reference(case, dtype, has_v, v_norm)
    finally:
        paged_attention_qkv.clear_cache()
    assert set(asked) == {form} and ATTENTION_CASES[QKV_CASES[i][0]][2] == 512, (asked, QKV_CASES[i])


def shared_q_case(case: int, seed: int = 3):
    """A case of ATTENTION_CASES with a KV-shared layer's raw q projection [B, tq, NH D], a q-norm stack [3, D]
    read at (1,), and each query's cos / sin fp32 [B, tq, D]: (batch, inputs, q_raw, q_norm, cos, sin)."""
    g, tq, d, dtype, window, cached, tuning = ATTENTION_CASES[case]
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, cached=cached, tq=tq, window=window, translate=window is not None)
    x = attention_inputs(rng, batch, kvh=2, g=g, tq=tq, d=d, dtype=dtype)
    B = x.q.shape[0]
    q_raw = jnp.asarray(3 * rng.standard_normal((B, tq, 2 * g * d)), dtype)
    q_norm = jnp.asarray(rng.standard_normal((3, d)), jnp.float32)
    angles = rng.uniform(-np.pi, np.pi, (B, tq, d))
    return batch, x, q_raw, q_norm, jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


@pytest.mark.parametrize("case", [0, 2, 6, 3, 5],
                         ids=["g1-d16-s1", "g4-d16-swa-s2", "g2-d512-s2", "g4-tq4-d16-s2", "g2-tq4-d256-swa-bf16"])
def test_shared_q_norm_rope_in_the_kernel_matches_reference(case):
    """A KV-shared layer's q normed and rotated inside the attention kernel (`rope_eps`: q's rotate-half partner
    gathered from q itself; with several queries a row, each row's own RoPE tables) against `q_rope_ref` then the
    reference attention, on the poisoned pools."""
    batch, x, q_raw, q_norm, cos, sin = shared_q_case(case)
    tuning, dtype = ATTENTION_CASES[case][6], ATTENTION_CASES[case][3]
    got = paged_attention(q_raw.reshape(*x.q.shape), x.k_bad, x.v_bad, x.indices, batch.starts, batch.q_lo,
                          batch.q_hi, scale=0.3, block_k=16, gather_q=True, q_norm=q_norm, q_norm_index=(1,),
                          cos=cos, sin=sin, rope_eps=1e-6, **tuning)
    q = q_rope_ref(q_raw, Vec(q_norm, (1,)), cos, sin, eps=1e-6)
    want = paged_attention_ref(q, x.k, x.v, x.indices, batch.starts, batch.q_lo, batch.q_hi, scale=0.3)
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.isfinite(got).all()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    return got


QKV_CASES = [  # case of ATTENTION_CASES, dtype, has_v, v_norm
    (0, jnp.float32, True, True), (2, jnp.bfloat16, True, True), (2, jnp.float32, False, True),
    (6, jnp.float32, True, False), (1, jnp.float32, True, True), (4, jnp.float32, False, True),
    (5, jnp.bfloat16, True, True),
]


@pytest.mark.parametrize("case, dtype, has_v, v_norm", QKV_CASES,
                         ids=["g1-d16-s1", "g4-d16-swa-s2-bf16", "g4-d16-swa-s2-k-eq-v", "g2-d512-s2-no-vnorm",
                              "g2-tq4-d16-swa-s3", "g8-tq4-d16-2blocks-k-eq-v", "g2-tq4-d256-swa-bf16"])
def test_qkv_in_the_attention_kernel_matches_reference(case, dtype, has_v, v_norm):
    """A non-shared layer's step in one attention kernel (`paged_attention_qkv`: q, k, v normed, q and k rotated,
    K and V written at the write slots and attended; one position a row, or a verify's four, each query seeing the
    step's earlier keys) against `qkv_cache_ref` then the reference attention, on a layer stack whose other layer and
    unread slots are NaN and whose write slots hold NaN before the step (the key walk must take the step's own K and
    V, not the pool's). The stacks come back with the reference's K and V at the write slots and every other entry as
    it was; the padding row writes nothing. The walk scores the step's keys apart from the blocks' K and adds
    their values after it."""
    g, tq, d, _, window, cached, tuning = ATTENTION_CASES[case]
    rng = np.random.default_rng(5)
    batch = make_batch(rng, cached=cached, tq=tq, window=window, translate=window is not None)
    x = attention_inputs(rng, batch, kvh=2, g=g, tq=tq, d=d, dtype=dtype)
    B, NH = x.q.shape[0], 2 * g
    heads = jnp.asarray(3 * rng.standard_normal((B, tq, NH + 2 * (2 if has_v else 1), d)), dtype)
    norms = jnp.asarray(rng.standard_normal((2, 3, d)), jnp.float32)  # q's at (0, 1), k's at (1, 2)
    angles = rng.uniform(-np.pi, np.pi, (B, tq, d))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    entry = np.asarray(batch.q_hi) - np.asarray(batch.starts)[:, None]  # [B, tq]
    slots = np.where(entry >= 0, np.asarray(x.indices)[np.arange(B)[:, None], np.maximum(entry, 0)], 0)
    slots = slots.astype(np.int32)
    assert (slots[-1] == 0).all() and (slots[:-1] > 0).all()  # the padding row writes nothing
    written = slots[:-1].reshape(-1)
    nan = jnp.full((1, *x.k.shape), jnp.nan, dtype)
    k_bad = jnp.concatenate([nan, x.k_bad[None]]).at[1, written].set(jnp.nan)  # layer 1; layer 0 NaN
    v_bad = jnp.concatenate([nan, x.v_bad[None]]).at[1, written].set(jnp.nan)
    slots = jnp.asarray(slots)
    got, k_got, v_got = paged_attention_qkv(
        heads, k_bad, v_bad, x.indices, batch.starts, batch.q_lo, batch.q_hi, slots, norms, norms, cos, sin,
        num_heads=NH, layer=1, scale=0.3, q_norm_index=(0, 1), k_norm_index=(1, 2), has_v=has_v, v_norm=v_norm,
        eps=1e-6, num_splits=tuning.get("num_splits"))
    clean = (jnp.stack([x.k, x.k]), jnp.stack([x.v, x.v]))
    q, k_want, v_want = qkv_cache_ref(heads.reshape(B, tq, -1), Vec(norms, (0, 1)), Vec(norms, (1, 2)), cos, sin,
                                      *clean, 1, slots, num_heads=NH, has_v=has_v, v_norm=v_norm, eps=1e-6)
    want = paged_attention_ref(q, k_want, v_want, x.indices, batch.starts, batch.q_lo, batch.q_hi, scale=0.3, layer=1)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    s = written
    for stack, written, before in ((k_got, k_want, k_bad), (v_got, v_want, v_bad)):
        stack, written = np.asarray(stack.astype(jnp.float32)), np.asarray(written.astype(jnp.float32))
        np.testing.assert_allclose(stack[1, s], written[1, s], rtol=tol, atol=tol)
        untouched = np.asarray(before.astype(jnp.float32)).copy()
        untouched[1, s] = stack[1, s]
        np.testing.assert_array_equal(stack, untouched)  # nothing else written (NaN where it was NaN)


@pytest.mark.parametrize("real_rows", [None, "queries"], ids=["all-rows", "real-rows"])
@pytest.mark.parametrize("splits", [1, 2], ids=["s1", "s2"])
def test_row_layout_pads_with_zeros(splits, real_rows):
    """`paged_attention_rows` on queries in the row layout (the drafter's fused step calls it so): Tq * G = 8 real
    rows padded to 16, q's padding rows NaN. The real rows are the reference's attention, the padding rows exactly 0,
    whether the kernels are told which rows are real (`real_rows`: their partials neither stored nor merged) or not."""
    g, tq, d, dtype, window, cached, _ = ATTENTION_CASES[1]
    rng = np.random.default_rng(2)
    batch = make_batch(rng, cached=cached, tq=tq, window=window, translate=True)
    x = attention_inputs(rng, batch, kvh=2, g=g, tq=tq, d=d, dtype=dtype)
    B, rows = x.q.shape[0], tq * g
    block_q, padded = query_rows(tq, g, d)
    assert padded > rows
    q_rows = x.q.reshape(B, tq, 2, g, d).transpose(0, 2, 1, 3, 4).reshape(B, 2, rows, d)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded - rows), (0, 0)), constant_values=jnp.nan)
    masks = row_ranges(batch.starts, batch.q_lo, batch.q_hi, g, padded, x.indices.shape[1])
    got = paged_attention_rows(q_rows, x.k_bad, x.v_bad, x.indices, batch.starts, *masks, scale=0.3, block_k=16,
                               block_q=block_q, num_splits=splits, real_rows=rows if real_rows else None)
    got = np.asarray(got)
    np.testing.assert_array_equal(got[:, :, rows:], 0.0)
    want = np.asarray(paged_attention_ref(x.q, x.k, x.v, x.indices, batch.starts, batch.q_lo, batch.q_hi, scale=0.3))
    want = want.reshape(B, tq, 2, g, d).transpose(0, 2, 1, 3, 4).reshape(B, 2, rows, d)
    np.testing.assert_allclose(got[:, :, :rows], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 40], ids=["full", "sliding"])
def test_fixed_splits_make_a_row_independent_of_the_others(window):
    """Batch invariance of the kernel: with kv_start 0 and fixed_splits, a query at position p gives bit for bit the
    same output alone in a step of P = 4 positions (the rest padding, as plain decoding runs in the engine's
    batch-invariant mode) as at place j of a verify of positions p - j .. p - j + 3 (the others real queries,
    other key ranges). Without fixed_splits the pieces follow the step's live span and rows differ (the broken
    variant: 3 of 60 full-layer rows, where only the span's end moves, and 60 of 60 sliding rows here, fp32, on
    the CPU). Two pieces, as the interpreter takes by default: on the H200 the default count at this width cuts
    the full layer's span into one-block pieces either way, and the broken variant passed there."""
    rng = np.random.default_rng(0)
    D, G, P, W, slots = 32, 2, 4, 256, 300
    k = jnp.asarray(rng.standard_normal((slots, 1, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((slots, 1, D)), jnp.float32)
    indices = jnp.asarray(rng.permutation(slots)[:W][None], jnp.int32)
    kv_start = jnp.zeros((1,), jnp.int32)

    def ranges(pos):  # q_lo, q_hi of queries at `pos` (-1: padding)
        pos = np.asarray(pos)
        lo = np.zeros_like(pos) if window is None else pos - window + 1
        return jnp.asarray(lo[None], jnp.int32), jnp.asarray(pos[None], jnp.int32)

    def rows_equal(fixed):
        same = []
        for p, j in itertools.product(range(60, 200, 7), range(1, P)):
            q = jnp.asarray(rng.standard_normal((1, P, G, D)), jnp.float32)
            alone = q.at[:, 1:].set(jnp.asarray(rng.standard_normal((1, P - 1, G, D)), jnp.float32))
            lo, hi = ranges([p] + [-1] * (P - 1))
            a = paged_attention(alone, k, v, indices, kv_start, lo, hi, block_k=16, num_splits=2,
                                gather_q=True, fixed_splits=fixed)
            verify = jnp.asarray(rng.standard_normal((1, P, G, D)), jnp.float32).at[:, j].set(q[:, 0])
            b = paged_attention(verify, k, v, indices, kv_start, *ranges(np.arange(p - j, p - j + P)), block_k=16,
                                num_splits=2, gather_q=True, fixed_splits=fixed)
            same.append(np.array_equal(np.asarray(a[:, 0]), np.asarray(b[:, j])))
        return same

    assert all(rows_equal(True))
    assert not all(rows_equal(False))  # the comparison has teeth


BLOCKED_CASES = [  # g, tq, d, dtype, window, cached, block: several key blocks, queries longer than the kernel's
    (1, 1, 16, jnp.float32, None, CACHED, 8),
    (2, 4, 16, jnp.float32, WINDOW, CACHED, 4),
    (4, 24, 16, jnp.float32, None, (0, 3, 17, 40), 16),  # a prefill-like chunk: causal inside it
    (2, 24, 16, jnp.float32, WINDOW, (0, 3, 17, 40), 8),
    (2, 4, 256, jnp.bfloat16, None, CACHED, 16),
    (2, 4, 16, jnp.float32, None, CACHED, 1024),  # one block wider than the table
]


@pytest.mark.parametrize("g,tq,d,dtype,window,cached,block", BLOCKED_CASES,
                         ids=[f"g{c[0]}-tq{c[1]}-d{c[2]}-{jnp.dtype(c[3]).name}-{'swa' if c[4] else 'full'}-b{c[6]}"
                              for c in BLOCKED_CASES])
def test_blocked_attention_matches_reference(g, tq, d, dtype, window, cached, block):
    """The XLA path over blocks of live keys (online softmax, early stop) against the whole-width reference; slots no
    query sees hold NaN and must not leak."""
    rng = np.random.default_rng(2)
    batch = make_batch(rng, cached=cached, tq=tq, window=window, translate=window is not None)
    x = attention_inputs(rng, batch, kvh=2, g=g, tq=tq, d=d, dtype=dtype)
    blocked = jax.jit(functools.partial(paged_attention_blocked, scale=0.3, block=block))
    got = blocked(x.q, x.k_bad, x.v_bad, x.indices, batch.starts, batch.q_lo, batch.q_hi)
    want = paged_attention_ref(x.q, x.k, x.v, x.indices, batch.starts, batch.q_lo, batch.q_hi, scale=0.3)
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[-1], 0.0)  # padded row: no query sees a key
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    return got


def test_blocked_attention_comparison_has_teeth(monkeypatch):
    """Without the running-max rescale of earlier blocks (alpha = 1), several blocks no longer give the reference."""
    g, tq, d, dtype, window, cached, block = BLOCKED_CASES[2]
    rng = np.random.default_rng(2)
    batch = make_batch(rng, cached=cached, tq=tq, window=window, translate=False)
    x = attention_inputs(rng, batch, kvh=2, g=g, tq=tq, d=d, dtype=dtype)
    want = np.asarray(paged_attention_ref(x.q, x.k, x.v, x.indices, batch.starts, batch.q_lo, batch.q_hi, scale=3.0))
    real_exp = jnp.exp
    monkeypatch.setattr(jnp, "exp", lambda a: jnp.where(jnp.isneginf(a) | (a < -1e30), real_exp(a), 1.0)
                        if a.ndim == 4 else real_exp(a))  # alpha [B, KVH, G, T] stuck at 1 once a key was seen
    got = np.asarray(paged_attention_blocked(x.q, x.k, x.v, x.indices, batch.starts, batch.q_lo, batch.q_hi,
                                             scale=3.0, block=block))
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


def test_comparison_has_teeth():
    """An off-by-one window start, or indices gathered without the SWA translation, must fail the comparison."""
    g, tq, d, dtype, window, cached, tuning = ATTENTION_CASES[1]
    rng = np.random.default_rng(1)
    batch = make_batch(rng, cached=cached, tq=tq, window=window, translate=True)
    x = attention_inputs(rng, batch, kvh=2, g=g, tq=tq, d=d, dtype=dtype)
    # Untranslated indices are full-pool slots: size the pool so that they stay in bounds on a GPU too.
    extra = batch.swa_of_full.shape[0] * PAGE
    k = jnp.concatenate([x.k, jnp.asarray(rng.standard_normal((extra, 2, d)), dtype)])
    v = jnp.concatenate([x.v, jnp.asarray(rng.standard_normal((extra, 2, d)), dtype)])
    untranslated = gather_kv_indices(batch.page_table, batch.starts, batch.ends, None, width=batch.width,
                                     page_size=PAGE, block=BLOCK, num_splits=2)
    want = np.asarray(paged_attention_ref(x.q, k, v, x.indices, batch.starts, batch.q_lo, batch.q_hi, scale=0.3))

    def run(indices, kv_start):
        return np.asarray(paged_attention(x.q, k, v, indices, kv_start, batch.q_lo, batch.q_hi, scale=0.3,
                                          block_k=16, **tuning))

    np.testing.assert_allclose(run(x.indices, batch.starts), want, rtol=1e-5, atol=1e-5)
    for wrong in (run(x.indices, batch.starts + 1), run(untranslated, batch.starts)):
        with pytest.raises(AssertionError):
            np.testing.assert_allclose(wrong, want, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on GPU the tests above compile the real kernels")
def test_kernels_lower_to_triton_ir(monkeypatch):
    """Gemma-sized shapes (bf16, head_dim 256/512, 128 query rows, 128K-wide tables) lower to Triton IR.

    Checks the Pallas -> Triton lowering (power-of-two blocks, loops, gathers, dots), not Triton's own compiler.
    """
    from jax._src.pallas.triton import pallas_call_registration

    fake_h200 = types.SimpleNamespace(get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90))
    monkeypatch.setattr(pallas_call_registration, "gpu_info_lib", fake_h200)
    spec = jax.ShapeDtypeStruct

    def lower(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    for (B, tq, kvh, g, d, width, splits), gather_q in itertools.product(
            [(4, 8, 1, 16, 512, 4096, None), (8, 1, 2, 4, 256, 1056, None), (2, 4, 2, 2, 16, 64, 2),
             (1, 4, 2, 4, 256, 640, 1)], (False, True)):
        dtype = jnp.float32 if d == 16 else jnp.bfloat16
        text = lower(
            lambda *a, splits=splits, gather_q=gather_q: paged_attention(*a, num_splits=splits, interpret=False,
                                                                         gather_q=gather_q),
            spec((B, tq, kvh * g, d), dtype), spec((4096, kvh, d), dtype), spec((4096, kvh, d), dtype),
            spec((B, width), jnp.int32), spec((B,), jnp.int32), spec((B, tq), jnp.int32), spec((B, tq), jnp.int32),
        )
        assert text.count("__gpu$xla.gpu.triton") == (1 if splits == 1 else 2)  # attention (+ the split merge)
        # gather_q: q goes in and the output comes out in q's own layout, no transposed, padded copy before the
        # kernels and no un-padding slice after them; the row layout needs both
        padded = query_rows(tq, g, d)[1] > tq * g
        copies = ("stablehlo.transpose" in text, "stablehlo.slice" in text)
        assert copies == ((False, False) if gather_q else (True, padded)), (B, tq, kvh, g, d, gather_q)
    # a global layer's shape in 64-key blocks whose pieces are cut at 32 keys (bench/diag_splits.py's g32 columns)
    text = lower(lambda *a: paged_attention(*a, block_k=64, granule=32, interpret=False, gather_q=True),
                 spec((1, 1, 8, 512), jnp.bfloat16), spec((4096, 2, 512), jnp.bfloat16),
                 spec((4096, 2, 512), jnp.bfloat16), spec((1, 4096), jnp.int32), spec((1,), jnp.int32),
                 spec((1, 1), jnp.int32), spec((1, 1), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 2
    # a KV-shared layer's q normed and rotated in the attention kernel (E4B's sliding and global head dims; a
    # decode step's one position a row and a verify's four)
    for d, tq in itertools.product((256, 512), (1, 4)):
        text = lower(lambda q, k, v, i, s, lo, hi, qn, c, sn: paged_attention(
                         q, k, v, i, s, lo, hi, interpret=False, gather_q=True, q_norm=qn, q_norm_index=(3,), cos=c,
                         sin=sn, rope_eps=1e-6),
                     spec((2, tq, 8, d), jnp.bfloat16), spec((4096, 2, d), jnp.bfloat16),
                     spec((4096, 2, d), jnp.bfloat16), spec((2, 640), jnp.int32), spec((2,), jnp.int32),
                     spec((2, tq), jnp.int32), spec((2, tq), jnp.int32), spec((7, d), jnp.float32),
                     spec((2, tq, d), jnp.float32), spec((2, tq, d), jnp.float32))
        assert text.count("__gpu$xla.gpu.triton") == 2, (d, tq)
    # a non-shared layer's norms, RoPE and K/V write in the attention kernel (E4B's sliding layer, its global
    # layer without a V projection; one position a row and four): the stacks aliased, no scatter beside the kernels
    for (d, has_v), tq in itertools.product(((256, True), (512, False)), (1, 4)):
        text = lower(lambda hd, k, v, i, s, lo, hi, sl, qn, kn, c, sn, has_v=has_v: paged_attention_qkv(
                         hd, k, v, i, s, lo, hi, sl, qn, kn, c, sn, num_heads=8, layer=1, scale=1.0,
                         q_norm_index=(3,), k_norm_index=(4,), has_v=has_v, v_norm=True, eps=1e-6, interpret=False),
                     spec((2, tq, 8 + (4 if has_v else 2), d), jnp.bfloat16), spec((3, 4096, 2, d), jnp.bfloat16),
                     spec((3, 4096, 2, d), jnp.bfloat16), spec((2, 640), jnp.int32), spec((2,), jnp.int32),
                     spec((2, tq), jnp.int32), spec((2, tq), jnp.int32), spec((2, tq), jnp.int32),
                     spec((7, d), jnp.float32), spec((7, d), jnp.float32), spec((2, tq, d), jnp.float32),
                     spec((2, tq, d), jnp.float32))
        assert text.count("__gpu$xla.gpu.triton") == 2 and "scatter" not in text, (d, tq)
    for swa in (None, spec((4096,), jnp.int32)):
        text = lower(
            lambda t, s, e, m: gather_kv_indices(t, s, e, m, width=131072, page_size=16, interpret=False),
            spec((4, 8192), jnp.int32), spec((4,), jnp.int32), spec((4,), jnp.int32), swa,
        )
        assert "__gpu$xla.gpu.triton" in text

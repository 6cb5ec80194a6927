"""The paged target (prefill chunks, decode, verify over the paged cache with an SWA pool) against the dense target.

float64 on the XLA attention path: equal within 1e-9 (paging, SWA translation and masking are exact). fp32 on the
Pallas kernels: token for token equal and within 1e-4 in logits (the fp32 noise floor of these random networks:
chunked vs one-pass computation alone moves the MoE model's logits by ~2e-5).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import golden_path, owned_full_pages, owned_swa_pages, swa_pages_of
from jaxspec.config import FULL
from jaxspec.model import gemma4
from jaxspec.model.weights import load_target
from jaxspec.paged_kv.cache import LayerKV, PagedKVCache
from jaxspec.paged_kv.metadata import PageTables, step_metadata

PAGE = 4


@functools.partial(jax.jit, static_argnums=(1, 2), static_argnames=("use_kernels",), donate_argnums=(3,))
def paged_step(params, cfg, spec, kv, pages, tokens, cached_len, num_new, use_kernels=True):
    meta = step_metadata(cfg, spec, pages, cached_len, num_new, tokens.shape[1], use_kernels=use_kernels)
    hidden, kv = gemma4.paged_forward(params, cfg, kv, meta, tokens, use_kernels=use_kernels)
    return gemma4.logits(params, cfg, hidden), kv


def poison_slots(cache, t, slots, value, layers=slice(None)):
    stack = cache.kv[t]
    cache.kv[t] = LayerKV(k=stack.k.at[layers, slots].set(jnp.asarray(value, stack.k.dtype)),
                          v=stack.v.at[layers, slots].set(jnp.asarray(value, stack.v.dtype)))


def fill_free_pages(cache, value):
    """Overwrite every page no live request owns (dummy page included) with `value`."""
    for t in cache.kv:
        owned = owned_full_pages(cache.pool) if t == FULL else owned_swa_pages(cache.pool)
        n = cache.spec.num_full_pages if t == FULL else cache.spec.num_swa_pages
        free = np.setdiff1d(np.arange(n), list(owned))
        poison_slots(cache, t, (free[:, None] * cache.spec.page_size + np.arange(cache.spec.page_size)).reshape(-1),
                     value)


def run_rows(cache, params, rows, T, *, use_kernels=True, bucket=None):
    """rows: list of (rid, tokens, start) or None (a padded row). Returns logits [B, T, V] as numpy."""
    B = bucket or len(rows)
    rows = list(rows) + [None] * (B - len(rows))
    tokens = np.zeros((B, T), np.int32)
    start = np.zeros(B, np.int32)
    n = np.zeros(B, np.int32)
    for b, row in enumerate(rows):
        if row is None:
            continue
        rid, toks, s = row
        assert cache.pool.prepare(rid, s, s + len(toks))
        tokens[b, : len(toks)] = toks
        start[b], n[b] = s, len(toks)
    pages = PageTables(page_table=jnp.asarray(cache.pool.page_table([r[0] if r else None for r in rows])),
                       swa_of_full=cache.swa_of_full)
    logits, cache.kv = paged_step(params, cache.cfg, cache.spec, cache.kv, pages, jnp.asarray(tokens),
                                  jnp.asarray(start), jnp.asarray(n), use_kernels=use_kernels)
    return np.asarray(logits)


def dense_logits(cfg, params, ids):
    dtype = params["embed"].dtype
    cache = gemma4.init_dense_cache(cfg, 1, len(ids), dtype)
    logits, _, _ = gemma4.dense_forward_jit(params, cfg, jnp.asarray(ids, jnp.int32)[None], 0, cache)
    return np.asarray(logits[0])


@pytest.fixture(scope="module", params=["e2b", "moe", "gemma3"])
def model(request):
    return load_target(golden_path(request.param, "target"), "fp32")


def make_cache(cfg, num_full_pages=64, num_swa_pages=40, max_context=64, max_step=8, dtype=jnp.float32):
    return PagedKVCache(cfg, page_size=PAGE, num_full_pages=num_full_pages, num_swa_pages=num_swa_pages,
                        max_context=max_context, max_step_tokens=max_step, dtype=dtype)


def scenario(cache, params, cfg, seqs, *, use_kernels=True, poison=None):
    """Chunked prefill of rows of different lengths, decode steps, and a verify step whose rejected tail is
    overwritten by the next step. Returns {rid: logits per position} for comparison with the dense target."""
    got = {rid: {} for rid in seqs}
    for rid in seqs:
        cache.pool.add(rid)
    pos = {rid: 0 for rid in seqs}
    prompt = {rid: len(s) - 6 for rid, s in seqs.items()}

    def record(rid, s, logits):
        for j, row in enumerate(logits):
            got[rid][s + j] = row

    # chunked prefill, 8 positions per step, rows of different lengths in one batch (+ one padded row)
    while any(pos[r] < prompt[r] for r in seqs):
        if poison is not None:
            fill_free_pages(cache, poison)
        rows = []
        for rid in seqs:
            if pos[rid] < prompt[rid]:
                toks = seqs[rid][pos[rid]: min(prompt[rid], pos[rid] + 8)]
                rows.append((rid, toks, pos[rid]))
        out = run_rows(cache, params, rows, 8, use_kernels=use_kernels, bucket=len(seqs) + 1)
        for b, (rid, toks, s) in enumerate(rows):
            record(rid, s, out[b, : len(toks)])
            pos[rid] += len(toks)
    # two decode steps
    for _ in range(2):
        rows = [(rid, seqs[rid][pos[rid]: pos[rid] + 1], pos[rid]) for rid in seqs]
        out = run_rows(cache, params, rows, 1, use_kernels=use_kernels)
        for b, (rid, toks, s) in enumerate(rows):
            record(rid, s, out[b, :1])
            pos[rid] += 1
    # verify of 4 positions whose last 3 hold wrong "drafts"; only the first is kept
    rows = [(rid, [seqs[rid][pos[rid]], 7, 8, 9], pos[rid]) for rid in seqs]
    out = run_rows(cache, params, rows, 4, use_kernels=use_kernels)
    for b, (rid, toks, s) in enumerate(rows):
        record(rid, s, out[b, :1])
        pos[rid] += 1
    # a verify that overwrites the rejected positions with the true tokens
    rows = [(rid, seqs[rid][pos[rid]: pos[rid] + 3], pos[rid]) for rid in seqs]
    out = run_rows(cache, params, rows, 4, use_kernels=use_kernels)
    for b, (rid, toks, s) in enumerate(rows):
        record(rid, s, out[b, :3])
    return got


def sequences(cfg, seed=0):
    rng = np.random.default_rng(seed)
    W = cfg.sliding_window
    lengths = [6 + 3, W + 6, W + 7, 3 * W + 9]  # prompts of 3, W, W+1 and 3W+3 tokens, then 6 more
    return {f"r{i}": rng.integers(3, cfg.vocab_size, n).tolist() for i, n in enumerate(lengths)}


def compare(cfg, params, seqs, got, tol=1e-4):
    for rid, ids in seqs.items():
        ref = dense_logits(cfg, params, ids)
        positions = sorted(got[rid])
        assert positions == list(range(len(ids))), rid
        mine = np.stack([got[rid][p] for p in positions])
        np.testing.assert_allclose(mine, ref, atol=tol, rtol=0, err_msg=rid)
        assert (mine.argmax(-1) == ref.argmax(-1)).all()


def check_paged_equals_dense(cfg, params, use_kernels, tol, dtype):
    cache = make_cache(cfg, dtype=dtype)
    seqs = sequences(cfg)
    got = scenario(cache, params, cfg, seqs, use_kernels=use_kernels)
    compare(cfg, params, seqs, got, tol)
    for rid in seqs:
        assert swa_pages_of(cache.pool, rid) <= cache.pool.swa_pages_bound
        cache.pool.free(rid)
    assert cache.pool.num_free_full == cache.spec.num_full_pages - 1
    assert cache.pool.num_free_swa == cache.spec.num_swa_pages - 1


def test_paged_equals_dense_pallas_fp32(model):
    cfg, params = model
    check_paged_equals_dense(cfg, params, True, 1e-4, jnp.float32)


@pytest.mark.parametrize("case", ["e2b", "moe", "gemma3"])
def test_paged_equals_dense_float64(case):
    with jax.enable_x64(True):
        cfg, params = load_target(golden_path(case, "target"), jnp.float64)
        check_paged_equals_dense(cfg, params, False, 1e-9, jnp.float64)


@pytest.mark.parametrize("poison", [np.nan, 1e4])
def test_free_pages_poisoned_outputs_unchanged(model, poison):
    """Every page no live request owns (and the dummy page) holds NaN or garbage before each step."""
    cfg, params = model
    cache = make_cache(cfg)
    seqs = sequences(cfg, seed=1)
    got = scenario(cache, params, cfg, seqs, poison=poison)
    compare(cfg, params, seqs, got)


def test_requests_cannot_read_each_other():
    """Two requests with the same tokens: poisoning every page of one leaves the other's outputs unchanged."""
    cfg, params = load_target(golden_path("e2b", "target"), "fp32")
    cache = make_cache(cfg)
    ids = np.random.default_rng(3).integers(3, cfg.vocab_size, 20).tolist()
    for rid in ("a", "b"):
        cache.pool.add(rid)
    run_rows(cache, params, [("a", ids[:8], 0), ("b", ids[:8], 0)], 8)
    run_rows(cache, params, [("a", ids[8:16], 8), ("b", ids[8:16], 8)], 8)
    # poison b's pages (full and SWA) and decode a
    pt = cache.pool.page_table(["b"])[0]
    full_b = [p for p in pt if p]
    swa_b = [int(cache.pool.swa_of_full[p]) for p in full_b if cache.pool.swa_of_full[p]]
    for t, pages in (("full_attention", full_b), ("sliding_attention", swa_b)):
        poison_slots(cache, t, (np.asarray(pages)[:, None] * PAGE + np.arange(PAGE)).reshape(-1), jnp.nan)
    out = run_rows(cache, params, [("a", ids[16:17], 16)], 1)
    np.testing.assert_allclose(out[0, 0], dense_logits(cfg, params, ids[:17])[16], atol=1e-5, rtol=0)

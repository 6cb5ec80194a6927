"""Pallas (Triton) kernel: flash-decoding attention over KV rows gathered by slot index, and its jnp reference
(`paged_attention_ref`, the same call; the kernel's test oracle), and `paged_attention_blocked`, the same call in
plain XLA over blocks of live keys (the path for prefill chunks).

Used for decode (Tq=1), verify (Tq=k+1) and the drafter (Tq=1, reads only).

Layout: the Tq queries and the G query heads of one kv head are folded into the rows of one query block (row
r = t * G + g), so a program reads each K/V row once for all of them. Each batch row's live key range
`[first, last)`, the keys that some query may see, is cut into `num_splits` pieces whose size follows the row's live
length; program (b, kv_head, row_block, split) walks its piece in blocks of `block_k` keys with a dynamic loop bound,
so the work scales with live keys, never with `width`. It keeps a running max / sum / accumulator in fp32. With one
split the program normalises and writes the output itself; with several, a second small kernel (one program per
query block) merges the splits by log-sum-exp — two launches per call, where a jnp epilogue took four or five.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxspec.model.attention import attention
from jaxspec.pallas import interpret_by_default

# jax 0.11 lowers pallas_call on GPU to Triton and warns that this backend is deprecated; it is the one we target.
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)

_MIN_DOT = 16  # tt.dot needs M, N, K >= 16
# positions a row whose K and V the attention kernel computes and writes itself (`paged_attention_qkv`: each is its
# own few loads and a select a key block, unrolled; a verify step has k + 1)
MAX_NEW_KV_QUERIES = 8


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _swap_perm(D: int):
    """int32[D]: column j's rotate-half partner, (j + D/2) % D."""
    return (lax.iota(jnp.int32, D) + D // 2) % D


def _rope_operands(qs_ref, qn_ref, cos_ref, sin_ref):
    """The loads `_norm_rope` needs (q_swap, the q-norm weight and its rotate-half permutation, cos, sin), issued at
    the kernel's start with q's, before anything waits on the live span: a load issued after such a wait costs the
    program one more memory round trip."""
    perm = _swap_perm(qn_ref.shape[0])
    return qs_ref[...], qn_ref[...], qn_ref[perm], cos_ref[...], sin_ref[...]


def _gathered_rope_operands(q_ref, qn_ref, cos_ref, sin_ref, b, r, t, qn_index: tuple):
    """`_rope_operands` for q read in its own layout (`gather_q`): q's rotate-half partner gathered from q itself
    (rows r, columns (j + D/2) % D) instead of a stored copy, the q-norm weight read at qn_index of its stack.
    cos_ref, sin_ref [B, Tq, D]: with one query a row its tables [D]; with more, each row's query's (t: int32[rows],
    the query of each row) as [rows, D]."""
    D = q_ref.shape[-1]
    perm = _swap_perm(D)
    shape = (r.shape[0], D)
    q_swap = q_ref[b, jnp.broadcast_to(r[:, None], shape), jnp.broadcast_to(perm[None, :], shape)]
    if cos_ref.shape[1] == 1:
        cos, sin = cos_ref[b, 0, :], sin_ref[b, 0, :]
    else:
        rows, cols = jnp.broadcast_to(t[:, None], shape), jnp.broadcast_to(lax.iota(jnp.int32, D)[None, :], shape)
        cos, sin = cos_ref[b, rows, cols], sin_ref[b, rows, cols]
    return q_swap, qn_ref[(*qn_index, slice(None))], qn_ref[(*qn_index, perm)], cos, sin


def _norm_rope(q, q_swap, q_norm, q_norm_swap, cos, sin, eps):
    """The query prologue of the drafter's fused step: per-row RMSNorm times the q-norm weight, then RoPE, rounded
    where `decoder_layer` rounds. q, q_swap: [rows, D] in the compute dtype, q_swap[:, j] = q[:, (j + D/2) % D] (the
    rotate-half partner, stored so by the q projection); q_norm [D] and q_norm_swap (its entries in q_swap's order);
    cos, sin: fp32 [D] of the rows' position, or [rows, D] each row's."""
    dtype = q.dtype
    D = q.shape[1]
    qf, qs = q.astype(jnp.float32), q_swap.astype(jnp.float32)
    r = lax.rsqrt(jnp.mean(qf * qf, axis=1, keepdims=True) + eps)
    qn = (qf * r * q_norm[None, :]).astype(dtype).astype(jnp.float32)
    qsn = (qs * r * q_norm_swap[None, :]).astype(dtype).astype(jnp.float32)
    sign = jnp.where(lax.iota(jnp.int32, D) < D // 2, -1.0, 1.0).astype(jnp.float32)
    if cos.ndim == 1:
        cos, sin = cos[None, :], sin[None, :]
    return (qn * cos + sign[None, :] * qsn * sin).astype(dtype)


def _new_kv_operands(heads_ref, kn_ref, b, h, t: int, new_kv: tuple):
    """The loads of `_new_kv` for kv head h of row b's query t: ((its raw K, K's rotate-half partner, the k-norm
    weight and its partner), the raw V: the K projection again where the layer has none), from the q/k/v product's
    heads [B, Tq (NH + KVH (+ KVH)), D] (`_attention_kernel`'s new_kv)."""
    num_heads, has_v, _, kn_index, per_query = new_kv[:5]
    D = heads_ref.shape[-1]
    kv_heads = (per_query - num_heads) // (2 if has_v else 1)
    perm = _swap_perm(D)
    k = t * per_query + num_heads + h
    k_raw, k_swap = heads_ref[b, k, :], heads_ref[b, k, perm]
    v_raw = heads_ref[b, k + kv_heads, :] if has_v else k_raw
    return (k_raw, k_swap, kn_ref[(*kn_index, slice(None))], kn_ref[(*kn_index, perm)]), v_raw


def _new_kv(k_raw, k_swap, k_norm, k_norm_swap, v_raw, cos, sin, eps, *, v_norm: bool, dtype):
    """A step's new K [D] (normed with k_norm, rotated) and V [D] (normed without a weight where v_norm), rounded to
    the pool's dtype where `qkv_cache` rounds them: `_norm_rope` on one row, then V's weightless norm."""
    k = _norm_rope(k_raw[None, :], k_swap[None, :], k_norm, k_norm_swap, cos, sin, eps)[0].astype(dtype)
    if not v_norm:
        return k, v_raw.astype(dtype)
    vf = v_raw.astype(jnp.float32)
    return k, (vf * lax.rsqrt(jnp.mean(vf * vf) + eps)).astype(dtype)


def _piece(split, first, last, *, num_splits: int, block_k: int, fixed_chunk: int | None, granule: int | None = None):
    """[lo, hi): the entries of kv_indices that piece `split` of a row walks, given the row's live span [first, last);
    lo >= hi: an empty piece. Pieces that follow the span are a multiple of `granule` keys (default block_k): with a
    smaller granule a piece may end inside a block, whose keys past hi are masked."""
    if fixed_chunk is None:  # pieces follow the live span: few keys, many programs
        granule = granule or block_k
        chunk = pl.cdiv(pl.cdiv(last - first, num_splits), granule) * granule
        lo = first + split * chunk
        return lo, jnp.minimum(lo + chunk, last)
    # pieces and blocks at fixed entries (kv_start 0: absolute positions); entries before `first` are masked
    return jnp.maximum(split * fixed_chunk, (first // block_k) * block_k), jnp.minimum((split + 1) * fixed_chunk, last)


def _attention_kernel(*refs, scale: float, block_k: int, num_splits: int, layer: int | None, rope_eps=None,
                      gather_q=None, fixed_chunk: int | None = None, real_rows: int | None = None,
                      granule: int | None = None, rope_index: tuple | None = None, new_kv: tuple | None = None):
    """Program (b, h, row_block, split): unnormalised attention of one query block over one piece of live keys
    (num_splits == 1: the normalised output, in o_ref's dtype; a row that saw no key gets 0).

    span_ref: int32[B, 2] live key range [first, last) per row (indices into kv_indices)
    row_lo_ref, row_hi_ref: int32[block_q] absolute position range each query row may see
    q_ref: [block_q, D]; k_ref, v_ref: [num_slots, KVH, D], or [L, num_slots, KVH, D] read at `layer`
    o_ref: fp32[block_q, D] accumulator, m_ref / l_ref: fp32[block_q] running max / sum (max -inf: no key seen)
    With rope_eps, q_ref holds raw projections normed and rotated here (`_norm_rope`): qs_ref, qn_ref [D], cos_ref
    and sin_ref [D] follow it.
    With gather_q = (rows, NH, G), q_ref is the whole q [Bq, Tq * NH, D] in its own layout and the program
    gathers its rows r = t * G + g (query t, head h * G + g) itself: no transposed, padded copy of q before the
    call. Padding rows (r >= rows) re-read the last row; their masks let them see no key. With num_splits == 1
    o_ref is then the whole output in that layout too, and the program stores its real rows there (`_store_rows`).
    With fixed_chunk (keys, a multiple of block_k), split s walks entries [s * fixed_chunk, (s + 1) * fixed_chunk)
    of kv_indices in blocks that start at multiples of block_k, whatever the live span: which keys a program and a
    block hold, and so a row's sums, do not depend on the other rows of the call (batch invariance).
    With real_rows (the query rows per kv head that are not padding of the power-of-two block, Tq * G), the partials
    of rows past it are not stored (`_real_rows`): the merge does not read them either.
    With granule (< block_k), pieces are cut at multiples of granule keys, not of block_k (`_piece`).
    With gather_q and rope_eps, q_ref holds the raw projections in q's own layout and no q_swap follows it: qn_ref
    (the q-norm stack, read at rope_index), cos_ref and sin_ref ([B, Tq, D]: each query's) do
    (`_gathered_rope_operands`).
    With new_kv = (NH, has_v, v_norm, k_norm_index, heads a query) (gather_q, rope_eps): q_ref is a non-shared
    layer's whole q/k/v product as heads [B, Tq (NH + KVH (+ KVH)), D]; kn_ref (the k-norm stack) and slot_ref
    (int32[B, Tq], each query's write slot; 0: padding) follow sin_ref, and the K / V stacks' aliased outputs k_out,
    v_out follow the others. Each program norms and rotates its kv head's new K of each query (and norms V) as
    `qkv_cache` does (`_new_kv`); the key walk takes them in place of what the pool holds at their write slots, and
    program (b, h, 0, 0) stores them there. The walk keeps the step's keys apart: it leaves each block's K as loaded
    (no select between the loads and the product, so K need not pass through registers), the scores at the write
    slots' entries are replaced by the queries' scores of the step's keys (computed once), V there is masked to 0
    with the keys no query sees, and each step key's value is added after the walk with the weight the online
    softmax gave it. (Three other forms were measured on the GPU and removed: the step's keys swapped into every K /
    V block the walk meets, `JAXSPEC_STEP_KEYS_APART=0` until session 47 (commit 51c8dbd has it), the bs-16
    verify's kernels 5.8% slower, the bs-1 steps' 0.3-0.7%; and in session 37 (commit a536233 has them) the splits
    merged in this kernel by the last program of a query block to finish, after an atomic count, E4B's verify step
    15% slower, session 15; the key walk software-pipelined by hand, no walk faster and long ones up to 19% slower,
    session 16.)
    """
    if new_kv is not None:
        (span_ref, kv_start_ref, kv_indices_ref, row_lo_ref, row_hi_ref, q_ref, qn_ref, cos_ref, sin_ref, kn_ref,
         slot_ref, k_ref, v_ref, o_ref, *ml_refs, k_out, v_out) = refs
    elif rope_eps is None:
        span_ref, kv_start_ref, kv_indices_ref, row_lo_ref, row_hi_ref, q_ref, k_ref, v_ref, o_ref, *ml_refs = refs
    elif gather_q is not None:
        (span_ref, kv_start_ref, kv_indices_ref, row_lo_ref, row_hi_ref, q_ref, qn_ref, cos_ref, sin_ref,
         k_ref, v_ref, o_ref, *ml_refs) = refs
    else:
        (span_ref, kv_start_ref, kv_indices_ref, row_lo_ref, row_hi_ref, q_ref, qs_ref, qn_ref, cos_ref, sin_ref,
         k_ref, v_ref, o_ref, *ml_refs) = refs
    b = pl.program_id(0)
    h = pl.program_id(1)
    split = pl.program_id(3)
    width = kv_indices_ref.shape[1]
    if gather_q is None:
        block_q, head_dim = q_ref.shape
        q = q_ref[...]
    else:
        block_q, head_dim = row_lo_ref.shape[0], q_ref.shape[-1]
        r, own = _own_rows(gather_q, h, block_q)  # q's layout: the output's rows
        r_in = r if new_kv is None else _own_rows(gather_q, h, block_q, stride=new_kv[4])[0]  # q/k/v's
        q = q_ref[b, r_in, :]  # [block_q, D]
    if rope_eps is None:
        rope = None
    elif gather_q is None:
        rope = _rope_operands(qs_ref, qn_ref, cos_ref, sin_ref)
    else:
        rope = _gathered_rope_operands(q_ref, qn_ref, cos_ref, sin_ref, b, r_in, _query_of_rows(gather_q, block_q),
                                       rope_index)

    if new_kv is not None:  # loads issued with q's: each query's raw K / V, write slot and RoPE tables
        num_queries = gather_q[0] // gather_q[2]
        fresh = []
        for t in range(num_queries):
            tables = (rope[3], rope[4]) if num_queries == 1 else (cos_ref[b, t, :], sin_ref[b, t, :])
            fresh.append((*_new_kv_operands(q_ref, kn_ref, b, h, t, new_kv), tables, slot_ref[b, t]))
    first = span_ref[b, 0]
    last = span_ref[b, 1]
    kv_start = kv_start_ref[b]
    lo, hi = _piece(split, first, last, num_splits=num_splits, block_k=block_k, fixed_chunk=fixed_chunk,
                    granule=granule)
    num_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), block_k)

    if rope_eps is not None:
        q = _norm_rope(q, *rope, rope_eps)
    new = []  # (K [D], V [D], write slot) of each query of the row
    for k_operands, v_raw, (cos, sin), slot in fresh if new_kv is not None else ():
        k_new, v_new = _new_kv(*k_operands, v_raw, cos, sin, rope_eps, v_norm=new_kv[2], dtype=k_out.dtype)
        new.append((k_new, v_new, slot))

        @pl.when((slot != 0) & (pl.program_id(2) == 0) & (split == 0))
        def _():  # one program a row and kv head stores them (what it stores, no program reads)
            k_out[layer, slot, h, :] = k_new
            v_out[layer, slot, h, :] = v_new
    row_lo = row_lo_ref[...][:, None]  # [block_q, 1]
    row_hi = row_hi_ref[...][:, None]

    def keys(j):  # block j's entries and masks (no loads): (i, valid, key_live)
        i = lo + j * block_k + lax.iota(jnp.int32, block_k)  # [block_k] entries of kv_indices
        pos = (kv_start + i)[None, :]
        valid = (pos >= row_lo) & (pos <= row_hi) & (i < hi)[None, :]  # [block_q, block_k]
        key_live = jnp.max(valid.astype(jnp.int32), axis=0) > 0  # [block_k]: some query sees the key
        return i, valid, key_live

    def slots_of(block):
        # Entries no query sees are never dereferenced (they may be unwritten); slot 0 is always in bounds.
        i, _, key_live = block
        return jnp.where(key_live, kv_indices_ref[b, jnp.minimum(i, width - 1)], 0)

    def rows_of(slots):
        if layer is None:
            return k_ref[slots, h, :], v_ref[slots, h, :]  # [block_k, D] each
        return k_ref[layer, slots, h, :], v_ref[layer, slots, h, :]

    def attend(block, k, v, acc, m_prev, l_prev, apart=()):
        """One block of the online softmax: (acc, m, l) and, for `apart`, (correction, p). apart: (hit [block_k],
        score [block_q]) of each step key kept apart from the block's K and V: its entries' scores replaced by its
        own, V there 0."""
        _, valid, key_live = block
        live = functools.reduce(lambda a, hit_score: a & ~hit_score[0], apart, key_live)
        v = jnp.where(live[:, None], v, jnp.zeros((), v.dtype))  # 0 * NaN would leak through P.V
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32) * scale
        for hit, score in apart:  # the pool's entry there is stale (or unwritten): the step key's score
            s = jnp.where(hit[None, :], score[:, None], s)
        s = jnp.where(valid, s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        correction = jnp.exp(m_prev - m_safe)
        p = jnp.where(valid, jnp.exp(s - m_safe[:, None]), 0.0)
        l_next = correction * l_prev + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
        return (correction[:, None] * acc + pv, m_next, l_next), (correction, p)

    def body(j, carry):
        block = keys(j)
        return attend(block, *rows_of(slots_of(block)), *carry)[0]

    init = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    if new:  # the step's own keys (not yet in the pool) apart: each block's K straight to the product
        scores = [jnp.sum(q.astype(jnp.float32) * k_new.astype(jnp.float32)[None, :], axis=1) * scale
                  for k_new, _, _ in new]  # [block_q] each: the queries' scores of the step's keys

        def apart(j, carry):
            block = keys(j)
            slots = slots_of(block)
            hits = [(slots == slot) & (slot != 0) for _, _, slot in new]  # [block_k] each
            walked, (correction, p) = attend(block, *rows_of(slots), *carry[:3], apart=tuple(zip(hits, scores)))
            weights = [correction * w + jnp.sum(jnp.where(hit[None, :], p, 0.0), axis=1)
                       for hit, w in zip(hits, carry[3:])]  # each step key's share, corrected as acc is
            return (*walked, *weights)

        acc, m, l, *weights = lax.fori_loop(0, num_blocks, apart, (*init, *[init[2]] * len(new)))
        for (_, v_new, _), w in zip(new, weights):  # each step key's value, weighted as the walk weighed it
            acc = acc + w[:, None] * v_new.astype(jnp.float32)[None, :]
    else:
        acc, m, l = lax.fori_loop(0, num_blocks, body, init)
    if not ml_refs:
        out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
        if gather_q is None:
            o_ref[...] = out
        else:  # straight into q's layout; padding rows write nothing
            _store_rows(o_ref, b, r, own, lax.iota(jnp.int32, head_dim), out)
        return
    m_ref, l_ref = ml_refs
    real = _real_rows(real_rows, block_q)
    if real is None:
        o_ref[...] = acc
    else:
        pltriton.store(o_ref, acc, mask=jnp.broadcast_to(real[:, None], acc.shape))
    m_ref[...] = m
    l_ref[...] = l


def _merge_weights(m, l):
    """Log-sum-exp weights of S pieces' partials: (w fp32[S, rows], the denominator [rows], 1 where no piece saw a
    key). A piece that saw no key has m = -inf and weight 0."""
    m_all = jnp.max(m, axis=0, keepdims=True)  # [1, rows]
    w = jnp.exp(m - jnp.where(m_all == -jnp.inf, 0.0, m_all))
    denom = jnp.sum(w * l, axis=0)
    return w, jnp.where(denom > 0, denom, 1.0)


def _block_rows(block_q: int):
    """int32[block_q]: the layout rows of program (., ., row_block, .)'s query block (its kernel's and its merge's)."""
    return pl.program_id(2) * block_q + lax.iota(jnp.int32, block_q)


def _real_rows(real_rows: int | None, block_q: int):
    """bool[block_q]: which rows of the program's query block are real (r < real_rows), or None when every row is.
    A decode step's Tq * G rows fill few of the block's rows (E4B: 4 of 16): their partials are all a split kernel
    stores and all its merge reads (the padding rows' fp32 partials were 3/4 of those bytes)."""
    return None if real_rows is None else _block_rows(block_q) < real_rows


def _own_rows(gather_q, h, block_q: int, stride: int | None = None):
    """q's own layout [Bq, Tq * NH, D] (`gather_q` = (rows, NH, G)): the q rows of program (., h, row_block, .)'s
    block_q layout rows r = t * G + g (query t, head h * G + g), and which of them are real (`_real_rows`); padding
    rows re-read the last real row. stride: the heads a query holds where it is not NH (a q/k/v product's
    [Bq, Tq * (NH + KVH (+ KVH)), D], whose q heads come first in each query's)."""
    rows, num_heads, group = gather_q
    r = _block_rows(block_q)
    own = r < rows
    r = jnp.minimum(r, rows - 1)
    return (r // group) * (stride or num_heads) + h * group + r % group, own


def _query_of_rows(gather_q, block_q: int):
    """int32[block_q]: the query t of each layout row of the program's block (padding rows: the last query's)."""
    rows, _, group = gather_q
    return jnp.minimum(_block_rows(block_q), rows - 1) // group


def _store_rows(ref, b, rows, own, cols, value):
    """ref[b, rows[i], cols[j]] = value[i, j] where own[i]: a masked scatter of [len(rows), len(cols)] (index arrays
    on both axes, which the interpreter's discharge of a masked store takes as well as Triton). Rows not owned are
    sent past the end: Triton's mask skips them, and the interpreter, which writes a masked store as a scatter of the
    old values, drops them instead of letting them race the real row they repeat."""
    shape = value.shape
    rows = jnp.where(own, rows, ref.shape[1])
    pltriton.store(ref.at[b, jnp.broadcast_to(rows[:, None], shape), jnp.broadcast_to(cols[None, :], shape)], value,
                   mask=jnp.broadcast_to(own[:, None], shape))


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, gather_q=None, real_rows: int | None = None):
    """Program (b, h, row_block, d_block): log-sum-exp merge of the splits' partials, all splits at once in registers
    (no loop: a loop over splits would pay one global-load latency per split). A split that saw no key has m = -inf
    and weight 0; a row that no split saw comes out as 0.

    o_ref: fp32[S, block_q, block_d]; m_ref, l_ref: fp32[S, block_q]; out_ref: [block_q, block_d] in the output dtype,
    or with gather_q (`_own_rows`) the whole output [Bq, Tq * NH, D] in q's layout, written at this program's rows
    and columns. With real_rows (`_attention_kernel`'s), rows past it are read as 0 (never stored: not read).
    """
    w, denom = _merge_weights(m_ref[...], l_ref[...])  # [S, block_q], [block_q]
    real = _real_rows(real_rows, m_ref.shape[1])
    if real is None:
        o = o_ref[...]
    else:
        o = pltriton.load(o_ref, mask=jnp.broadcast_to(real[None, :, None], o_ref.shape), other=0.0)
    acc = jnp.sum(w[:, :, None] * o, axis=0)  # [block_q, block_d]
    out = (acc / denom[:, None]).astype(out_ref.dtype)
    if gather_q is None:
        out_ref[...] = out
        return
    block_q, block_d = out.shape
    r, own = _own_rows(gather_q, pl.program_id(1), block_q)
    _store_rows(out_ref, pl.program_id(0), r, own, pl.program_id(3) * block_d + lax.iota(jnp.int32, block_d), out)


def _live_span(kv_start, q_lo, q_hi, width: int):
    """int32[B, 2]: the kv_indices range [first, last) holding every key that some query of the row may see."""
    nonempty = q_lo <= q_hi  # [B, Tq]
    any_query = jnp.any(nonempty, axis=1)
    lo = jnp.min(jnp.where(nonempty, q_lo, jnp.iinfo(jnp.int32).max), axis=1)
    hi = jnp.max(jnp.where(nonempty, q_hi, jnp.iinfo(jnp.int32).min), axis=1)
    first = jnp.where(any_query, jnp.clip(lo - kv_start, 0, width), 0)
    last = jnp.where(any_query, jnp.clip(hi - kv_start + 1, first, width), first)
    return jnp.stack([first, last], axis=1).astype(jnp.int32)


def query_rows(num_queries: int, group: int, head_dim: int, block_q: int | None = None) -> tuple[int, int]:
    """(block_q, padded rows per kv head) of the row layout: the Tq queries x G heads of one kv head as rows
    r = t * G + g, in blocks of block_q rows (a power of two >= 16; default: an fp32 accumulator of at most 16K)."""
    rows = num_queries * group
    if block_q is None:
        block_q = max(_MIN_DOT, 16384 // head_dim)
    block_q = min(block_q, max(_MIN_DOT, _next_pow2(rows)))
    return block_q, pl.cdiv(rows, block_q) * block_q


def default_splits(rows: int, kv_heads: int, row_blocks: int, width: int, block_k: int) -> int:
    """Pieces of each row's live range on a GPU: about two programs per SM of an H200 (132), at most 64 pieces per
    row and no more than the width has blocks of keys (a sliding window's table is narrow). (The CPU interpreter
    runs programs one after another: there `paged_attention_rows` takes a couple of pieces.)"""
    per_row = _next_pow2(max(1, 264 // (rows * kv_heads * row_blocks)))
    return max(1, min(64, per_row, _next_pow2(pl.cdiv(width, block_k))))


def default_block_k(head_dim: int) -> int:
    """Keys a block of the kernel's walk holds by default: 64, or 32 past head_dim 128 (K and V tiles of 32 KB each
    at 512)."""
    return 64 if head_dim <= 128 else 32


# `walk_knobs`' long-walk form: at most this many pieces a row (a call of many rows), each of up to this many keys
LONG_WALK_PIECES, LONG_WALK_KEYS = 8, 256


def walk_knobs(head_dim: int, width: int, num_splits: int, new_kv: bool = False, itemsize: int = 2) -> tuple[int, int]:
    """(num_warps, num_stages) of the attention kernel by default. A call of many rows cuts each row into few pieces
    (`default_splits`: the drafter's bs-64 propose 2, the target's bs-16 verify over 4K keys 8), so each program
    walks long: where a row has at most LONG_WALK_PIECES pieces and a piece may hold LONG_WALK_KEYS keys or more
    (width / pieces), it walks with 4 warps and each block's K / V copied while the block before it is attended
    (2 stages). The many short pieces of a bs-1 step keep the form they were tuned with: 4 warps at head_dim <= 128,
    else 8, and 1 stage at 512 (whose walk waits for each block's loads). Measured on an H100 (session 43, `bench kernels --knobs`, E4B's shapes): the
    global layer's 4K keys at bs 64 968 -> 588 us, at bs 16 293 -> 201 (1 query) and 310 -> 190 (4); a sliding
    layer's 512 at bs 64 185 -> 133; the drafter's bs-64 propose 3 264 -> 2 413 us. Neither knob changes which keys
    a block holds: in bf16 the output was the same bit for bit in every shape timed; in fp32 at head_dim 512 it
    differs by an ulp at most (the warps' share of each product moves; the GPU lane, session 44).
    new_kv (`paged_attention_qkv`'s in-kernel q/k/v step) walks long with 8 warps: with the step's own keys swapped
    into each K / V block (the form before session 47), the bs-16 verify's non-shared global layers took 249 us a
    call tuned (8 warps, 1 stage), 308 with 4 warps and 2 stages, 226 with 8 and 2; the step's kernels 7 420 / 7 662
    / 7 329 us (the H100, two traced runs each side by side, session 44); with them apart (the walk now) 136-137 us a
    call with 8 and 2 (session 45). Its 2 stages hold two blocks of K / V in shared memory: in fp32
    (itemsize 4) at head_dim 512 that asked 295 040 bytes of the H100's 232 448 (the GPU lane, session 45), so there
    it keeps 1 stage (the tuned form, which runs in fp32)."""
    if num_splits <= LONG_WALK_PIECES and width >= LONG_WALK_KEYS * num_splits:
        return (8, 2 if itemsize * head_dim <= 1024 else 1) if new_kv else (4, 2)
    return (4 if head_dim <= 128 else 8), (1 if head_dim >= 512 else 2)


def merge_block_d(head_dim: int, num_splits: int, block_q: int, tiles: int) -> int:
    """Columns of the output per merge program: all splits of a [block_q, block_d] tile in at most 16K fp32
    registers' worth, and cut further (to 16 columns at least) until the `tiles` query blocks' columns make about
    one program per SM of an H200 (132): a bs-1 decode step's merge has 2 query blocks (E4B), and a sliding layer's
    (32 splits) took 16 programs of 32 columns, reading its partials at a few SMs' share of the bandwidth."""
    block_d = max(1, min(head_dim, 16384 // (num_splits * block_q)))
    return min(block_d, max(min(16, head_dim), head_dim // _next_pow2(pl.cdiv(132, tiles))))


def row_ranges(kv_start, q_lo, q_hi, group: int, padded_rows: int, width: int):
    """The row layout's masks from a step's query ranges: row_lo, row_hi int32[B, R] (padding rows see nothing) and
    the live span int32[B, 2] of kv_indices. Computed once per step and shared by every layer of a type."""
    pad = padded_rows - q_lo.shape[1] * group
    row_lo = jnp.pad(jnp.repeat(q_lo.astype(jnp.int32), group, axis=1), ((0, 0), (0, pad)), constant_values=1)
    row_hi = jnp.pad(jnp.repeat(q_hi.astype(jnp.int32), group, axis=1), ((0, 0), (0, pad)), constant_values=0)
    span = _live_span(kv_start.astype(jnp.int32), q_lo.astype(jnp.int32), q_hi.astype(jnp.int32), width)
    return row_lo, row_hi, span


@functools.partial(
    jax.jit,
    static_argnames=("scale", "layer", "block_k", "block_q", "num_splits", "num_warps", "num_stages", "interpret",
                     "gather_q", "fixed_splits", "granule", "q_norm_index", "rope_eps"),
)
def paged_attention(q, k_cache, v_cache, kv_indices, kv_start, q_lo, q_hi, *, scale: float = 1.0,
                    layer: int | None = None,
                    block_k: int | None = None, block_q: int | None = None, num_splits: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None, interpret: bool | None = None,
                    gather_q: bool = False, fixed_splits: bool = False, granule: int | None = None,
                    q_norm=None, q_norm_index: tuple = (), cos=None, sin=None, rope_eps: float | None = None):
    """Attention of q over the keys listed in `kv_indices` (kernel of `paged_attention_ref`).

    q: [B, Tq, NH, D]; k_cache, v_cache: [num_slots, KVH, D]; NH = G * KVH; D a power of two >= 16. With `layer`,
    k_cache / v_cache are a layer stack [L, num_slots, KVH, D] read at that layer (no slice copy of the stack).
    kv_indices: int32[B, width]: key i of row b sits in slot kv_indices[b, i], position kv_start[b] + i.
    q_lo, q_hi: int32[B, Tq]: query t may attend the keys whose position p satisfies q_lo <= p <= q_hi.
    Only entries i in [min_t q_lo - kv_start, max_t q_hi - kv_start] (clipped to the width) are read, and of those
    only the ones some query may see are dereferenced.
    block_k: keys per step (power of two >= 16); block_q: query rows per program (power of two >= 16; Tq * G rows
    are split over ceil(Tq * G / block_q) programs, each re-reading the keys); num_splits: pieces of the live range,
    rounded up to a power of two (default: enough programs to fill the GPU at small batch, ~264 in all, at most 64
    per row); 1 normalises in the one kernel, more add a merge kernel.
    interpret: None runs the interpreter on CPU backends and compiles with Triton elsewhere.
    gather_q: the kernels read their query rows from q as it is and write their output rows in that layout (no
    transposed, padded copy of q before the call, no un-padding copy after it; the engine's default,
    JAXSPEC_ATTN_GATHER_Q=0 turns it off).
    fixed_splits: the pieces are fixed ranges of kv_indices entries (width / num_splits each, in blocks at multiples
    of block_k) instead of following the live span, so that a query row's output does not depend on the other rows
    of the call; with kv_start 0 for every row, a row's result is then a function of its own position and keys
    (the engine's batch-invariant mode, `EngineConfig.batch_invariant`).
    granule: `paged_attention_rows`' (pieces cut at multiples of it, not of block_k).
    rope_eps (with gather_q): q holds a KV-shared layer's raw q projection, normed (q_norm[q_norm_index], a
    weight vector of a stack) and rotated (cos, sin: [B, Tq, D]) in the attention kernel, as `qkv_cache.q_rope_ref`
    does it: one launch fewer than `q_rope` and then this kernel (XLA's q norm and rotation: two).
    Returns [B, Tq, NH, D] in q.dtype.
    """
    B, Tq, NH, D = q.shape
    KVH = k_cache.shape[-2]
    if NH % KVH:
        raise ValueError(f"query heads ({NH}) must be a multiple of kv heads ({KVH})")
    G = NH // KVH
    rows = Tq * G
    block_q, padded_rows = query_rows(Tq, G, D, block_q)
    # Rows r = t * G + g; padding rows see no key (lo > hi) and come out as 0.
    if gather_q:  # the kernel gathers the rows from q [B, Tq * NH, D] (a free reshape)
        q_rows = q.reshape(B, Tq * NH, D)
    else:
        q_rows = q.reshape(B, Tq, KVH, G, D).transpose(0, 2, 1, 3, 4).reshape(B, KVH, rows, D)
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))  # [B, KVH, R, D]
    row_lo, row_hi, span = row_ranges(kv_start, q_lo, q_hi, G, padded_rows, kv_indices.shape[1])
    rope = None
    if rope_eps is not None:
        if not gather_q:
            raise ValueError("the kernel's q norm and RoPE take gather_q")
        rope = (None, q_norm, q_norm_index, cos.reshape(B, Tq, D), sin.reshape(B, Tq, D), rope_eps)
    out = paged_attention_rows(q_rows, k_cache, v_cache, kv_indices, kv_start, row_lo, row_hi, span, scale=scale,
                               layer=layer, block_k=block_k, block_q=block_q, num_splits=num_splits,
                               num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                               gather_q=(rows, NH, G) if gather_q else None, fixed_splits=fixed_splits,
                               real_rows=rows, granule=granule, rope=rope)
    if gather_q:  # written in q's layout: no un-padding copy after the call either
        out = out.reshape(B, Tq, NH, D)
    else:
        out = out[:, :, :rows].reshape(B, KVH, Tq, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Tq, NH, D)
    return out


@functools.partial(jax.jit, static_argnames=("num_heads", "layer", "scale", "q_norm_index", "k_norm_index",
                                             "has_v", "v_norm", "eps", "interpret", "num_splits"))
def paged_attention_qkv(heads, k_stack, v_stack, kv_indices, kv_start, q_lo, q_hi, slots, q_norm, k_norm, cos, sin,
                        *, num_heads: int, layer: int, scale: float, q_norm_index: tuple, k_norm_index: tuple,
                        has_v: bool, v_norm: bool, eps: float, interpret: bool | None = None,
                        num_splits: int | None = None):
    """A non-shared layer's step from its q/k/v product to its attention in one kernel (with the split merge after
    it): what `qkv_cache.qkv_cache` (q, k, v normed, q and k rotated, K and V written at `slots`) then
    `paged_attention` (gather_q) compute, `qkv_cache`'s launch (or XLA's norm and RoPE fusions and K/V scatters)
    saved.

    heads: the product as heads [B, T, NH + KVH (+ KVH), D] (`qkv_cache.split_heads`; T <= MAX_NEW_KV_QUERIES
    positions a row); k_stack, v_stack: the layer stacks [L, S, KVH, D] (`layer`); slots int32[B, T] (0: a padding
    position, nothing written); q_norm, k_norm: weight stacks read at their indices; cos, sin [B, T, D]. Returns
    (attention [B, T, NH, D], k_stack, v_stack)."""
    B, T, per_query, D = heads.shape
    KVH = k_stack.shape[-2]
    if not 1 <= T <= MAX_NEW_KV_QUERIES:
        raise ValueError(f"paged_attention_qkv takes 1 to {MAX_NEW_KV_QUERIES} positions a row, not {T}")
    G = num_heads // KVH
    block_q, padded_rows = query_rows(T, G, D)
    row_lo, row_hi, span = row_ranges(kv_start, q_lo, q_hi, G, padded_rows, kv_indices.shape[1])
    rope = (None, q_norm, q_norm_index, cos.reshape(B, T, D), sin.reshape(B, T, D), eps)
    out, k_stack, v_stack = paged_attention_rows(
        heads.reshape(B, T * per_query, D), k_stack, v_stack, kv_indices, kv_start, row_lo, row_hi, span,
        scale=scale, layer=layer, block_q=block_q, num_splits=num_splits, interpret=interpret,
        gather_q=(T * G, num_heads, G), real_rows=T * G, rope=rope,
        new_kv=(k_norm, k_norm_index, slots.reshape(B, T), has_v, v_norm))
    return out.reshape(B, T, num_heads, D), k_stack, v_stack


def paged_attention_rows(q_rows, k_cache, v_cache, kv_indices, kv_start, row_lo, row_hi, span, *, scale: float = 1.0,
                         layer: int | None = None, block_k: int | None = None, block_q: int | None = None,
                         num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                         interpret: bool | None = None, rope=None, gather_q=None, fixed_splits: bool = False,
                         real_rows: int | None = None, granule: int | None = None, new_kv=None):
    """`paged_attention` on queries already in the row layout (`query_rows`, `row_ranges`): q_rows [Bq, KVH, R, D],
    row_lo / row_hi int32[B, R], span int32[B, 2], B <= Bq: the first B rows are attended (more query rows may be
    padding of their producer; those output rows are left unwritten). Returns [Bq, KVH, R, D] in q_rows.dtype
    (padding query rows of a batch row: 0). Callers that produce and consume this layout themselves (the drafter's
    fused step) skip the transposes around it.

    rope: (q_swap [Bq, KVH, R, D], q_norm stack [L, D], its layer, cos, sin fp32 [Bq, D], eps) for raw projections
    in q_rows, normed and rotated in the kernel (`_norm_rope`). With gather_q, (None, q_norm stack, its index (a
    tuple), cos, sin, eps): the kernel gathers q's rotate-half partner from q itself.
    gather_q: (Tq * G, NH, G) when q_rows is the queries as they are, [Bq, Tq * NH, D] (`paged_attention`'s
    gather_q); the kernel gathers each program's rows, and the result comes back in that layout too,
    [Bq, Tq * NH, D] (the last kernel stores each row where its query sits; padding rows store nothing).
    fixed_splits: `paged_attention`'s.
    real_rows: how many of the R rows are queries (Tq * G; the rest pad the block to a power of two; default: all,
    or gather_q's Tq * G): with several splits only those rows' partials are stored and merged. A padding row's
    output is 0 either way.
    granule: pieces of the live span are cut at multiples of this many keys (a power of two, 16 to block_k; default
    block_k): with block_k 64 and granule 32 a short span still makes as many pieces as 32-key blocks would, while a
    long one walks one 64-key block a piece where 32-key blocks walk two, one after the other (a diagnosis knob,
    `bench/diag_splits.py`; not fixed_splits').
    new_kv: (k_norm stack, its index (a tuple), slots int32[B, Tq], has_v, v_norm), with gather_q and its rope:
    q_rows is a non-shared layer's whole q/k/v product as heads [Bq, Tq (NH + KVH (+ KVH)), D] (`qkv_cache`'s
    input), k_cache / v_cache the layer stacks (`layer`); the kernel writes the step's K and V at the slots as
    `qkv_cache` would and attends over them. Returns (out, k_cache, v_cache) then."""
    if new_kv is not None and (gather_q is None or rope is None or layer is None
                               or gather_q[0] // gather_q[2] > MAX_NEW_KV_QUERIES):
        raise ValueError(f"new_kv takes gather_q with its rope, a layer stack and at most {MAX_NEW_KV_QUERIES} "
                         "queries a row")
    if gather_q is None:
        Bq, KVH, padded_rows, D = q_rows.shape
    else:
        if rope is not None and rope[0] is not None:
            raise ValueError("gather_q reads q as it is: it takes no q_swap (rope[0] None: gathered from q)")
        (Bq, _, D), KVH, padded_rows = q_rows.shape, k_cache.shape[-2], row_lo.shape[1]
    B = kv_indices.shape[0]
    width = kv_indices.shape[1]
    if B > Bq or row_lo.shape != (B, padded_rows) or span.shape != (B, 2):
        raise ValueError(f"metadata rows {B}, row masks {row_lo.shape}, span {span.shape} do not fit the queries' "
                         f"{Bq} rows x {padded_rows}")  # a program past them would read out of bounds
    if block_k is None:
        block_k = default_block_k(D)
    if block_q is None:
        block_q = min(max(_MIN_DOT, 16384 // D), padded_rows)
    for name, size in (("head_dim", D), ("block_k", block_k), ("block_q", block_q), ("granule", granule or block_k)):
        if size & (size - 1) or size < _MIN_DOT:
            raise ValueError(f"{name} ({size}) must be a power of two >= {_MIN_DOT}")
    if granule is not None and granule > block_k:
        raise ValueError(f"granule ({granule}) must be at most block_k ({block_k})")
    if interpret is None:
        interpret = interpret_by_default()
    row_blocks = padded_rows // block_q
    if num_splits is None:
        num_splits = 2 if interpret else default_splits(B, KVH, row_blocks, width, block_k)
    num_splits = _next_pow2(num_splits)  # the merge kernel holds the splits in one power-of-two block
    warps, stages = walk_knobs(D, width, num_splits, new_kv is not None, jnp.dtype(k_cache.dtype).itemsize)
    num_warps = warps if num_warps is None else num_warps
    num_stages = stages if num_stages is None else num_stages

    fixed_chunk = pl.cdiv(pl.cdiv(width, num_splits), block_k) * block_k if fixed_splits else None
    if gather_q is not None:
        real_rows = gather_q[0]
    if real_rows is not None and real_rows >= padded_rows:
        real_rows = None  # no padding: no masks
    if new_kv is not None:  # q, K (and V) heads of each query: q_rows holds the step's whole q/k/v product
        heads_a_query = q_rows.shape[1] // (gather_q[0] // gather_q[2])
    kernel = functools.partial(_attention_kernel, scale=scale, block_k=block_k, num_splits=num_splits, layer=layer,
                               rope_eps=None if rope is None else rope[5], gather_q=gather_q, fixed_chunk=fixed_chunk,
                               real_rows=real_rows, granule=None if granule == block_k else granule,
                               rope_index=tuple(rope[2]) if rope is not None and gather_q is not None else None,
                               new_kv=None if new_kv is None else (gather_q[1], new_kv[3], new_kv[4],
                                                                   tuple(new_kv[1]), heads_a_query))

    def whole(shape):  # read by slot or row index inside the kernel
        return pl.BlockSpec(shape, lambda b, h, r, s: (0,) * len(shape))

    rows_spec = pl.BlockSpec((None, block_q), lambda b, h, r, s: (b, r))
    in_specs = [
        whole(span.shape),
        whole(kv_start.shape),
        whole(kv_indices.shape),
        rows_spec,
        rows_spec,
        pl.BlockSpec((None, None, block_q, D), lambda b, h, r, s: (b, h, r, 0)) if gather_q is None
        else whole(q_rows.shape),
        whole(k_cache.shape),
        whole(v_cache.shape),
    ]
    args = [span, kv_start.astype(jnp.int32), kv_indices.astype(jnp.int32), row_lo, row_hi, q_rows, k_cache, v_cache]
    if rope is not None and gather_q is not None:  # q_norm, cos and sin read whole (at b and the index)
        _, q_norm, _, cos, sin, _ = rope
        in_specs[6:6] = [whole(q_norm.shape), whole(cos.shape), whole(sin.shape)]
        args[6:6] = [q_norm, cos.astype(jnp.float32), sin.astype(jnp.float32)]
    elif rope is not None:
        q_swap, q_norm, q_norm_layer, cos, sin, _ = rope
        row = pl.BlockSpec((None, D), lambda b, h, r, s: (b, 0))
        in_specs[6:6] = [in_specs[5], pl.BlockSpec((None, D), lambda b, h, r, s: (q_norm_layer, 0)), row, row]
        args[6:6] = [q_swap, q_norm, cos, sin]
    kv_specs, kv_shapes = [], []
    if new_kv is not None:  # the k-norm stack and the write slots; the K / V stacks come back written
        k_norm, _, slots = new_kv[:3]
        in_specs[9:9] = [whole(k_norm.shape), whole((B, slots.shape[1]))]
        args[9:9] = [k_norm, slots[:B].astype(jnp.int32)]
        kv_specs = [whole(k_cache.shape), whole(v_cache.shape)]
        kv_shapes = [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                     jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if gather_q is None:
        out_shape = jax.ShapeDtypeStruct((Bq, KVH, padded_rows, D), q_rows.dtype)
    else:  # q's own layout, written row by row (`_own_rows`): Tq * NH rows (q_rows may hold K and V heads too)
        out_shape = jax.ShapeDtypeStruct((Bq, gather_q[0] // gather_q[2] * gather_q[1], D), q_rows.dtype)
    out_spec = (pl.BlockSpec((None, None, block_q, D), lambda b, h, r, s: (b, h, r, 0)) if gather_q is None
                else whole(out_shape.shape))
    if num_splits == 1:  # the program normalises: no partials, no merge
        outs = pl.pallas_call(
            kernel,
            grid=(B, KVH, row_blocks, 1),
            in_specs=in_specs,
            out_specs=[out_spec, *kv_specs],
            out_shape=[out_shape, *kv_shapes],
            input_output_aliases={len(args) - 2: 1, len(args) - 1: 2} if new_kv is not None else {},
            compiler_params=params,
            interpret=interpret,
            name="paged_attention",
        )(*args)
        return outs[0] if new_kv is None else tuple(outs)
    o, m, l, *kv_out = pl.pallas_call(
        kernel,
        grid=(B, KVH, row_blocks, num_splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, block_q, D), lambda b, h, r, s: (b, h, s, r, 0)),
            pl.BlockSpec((None, None, None, block_q), lambda b, h, r, s: (b, h, s, r)),
            pl.BlockSpec((None, None, None, block_q), lambda b, h, r, s: (b, h, s, r)),
            *kv_specs,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, KVH, num_splits, padded_rows, D), jnp.float32),
            jax.ShapeDtypeStruct((B, KVH, num_splits, padded_rows), jnp.float32),
            jax.ShapeDtypeStruct((B, KVH, num_splits, padded_rows), jnp.float32),
            *kv_shapes,
        ],
        input_output_aliases={len(args) - 2: 3, len(args) - 1: 4} if new_kv is not None else {},
        compiler_params=params,
        interpret=interpret,
        name="paged_attention",
    )(*args)
    block_d = merge_block_d(D, num_splits, block_q, B * KVH * row_blocks)
    split_rows = pl.BlockSpec((None, None, num_splits, block_q), lambda b, h, r, d: (b, h, 0, r))
    out = pl.pallas_call(
        functools.partial(_merge_kernel, gather_q=gather_q, real_rows=real_rows),
        grid=(B, KVH, row_blocks, D // block_d),
        in_specs=[pl.BlockSpec((None, None, num_splits, block_q, block_d), lambda b, h, r, d: (b, h, 0, r, d)),
                  split_rows, split_rows],
        out_specs=pl.BlockSpec((None, None, block_q, block_d), lambda b, h, r, d: (b, h, r, d)) if gather_q is None
        else pl.BlockSpec(out_shape.shape, lambda b, h, r, d: (0, 0, 0)),
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_attention_merge",
    )(o, m, l)
    return out if new_kv is None else (out, *kv_out)


def paged_attention_ref(q, k_cache, v_cache, kv_indices, kv_start, q_lo, q_hi, *, scale: float = 1.0,
                        layer: int | None = None):
    """The reference of `paged_attention` (same arguments; it has no tuning knobs): an XLA gather of every listed
    slot, then dense masked attention. k_cache / v_cache: [num_slots, KVH, D], or a stack [L, num_slots, KVH, D] read
    at `layer`. Returns [B, Tq, NH, D] in q.dtype.
    """
    if layer is not None:
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    width = kv_indices.shape[1]
    pos = kv_start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, W]
    valid = (pos[:, None, :] >= q_lo[:, :, None]) & (pos[:, None, :] <= q_hi[:, :, None])
    idx = jnp.where(jnp.any(valid, axis=1), kv_indices, 0)  # slots no query sees are never dereferenced
    return attention(q, k_cache[idx], v_cache[idx], valid, scale=scale)


BLOCK_KEYS = 512  # keys per step of `paged_attention_blocked`


@functools.partial(jax.jit, static_argnames=("scale", "layer", "block"))
def paged_attention_blocked(q, k_cache, v_cache, kv_indices, kv_start, q_lo, q_hi, *, scale: float = 1.0,
                            layer: int | None = None, block: int = BLOCK_KEYS):
    """`paged_attention_ref`'s result (same arguments) without reading the whole `kv_indices` width: a device loop
    over blocks of `block` key columns that stops after the last column any query of the call may see, with an
    online softmax in fp32 (running max, sum and accumulator, as the kernel keeps them). Its cost follows the live
    context, not the width (a full-attention layer's width is the whole max_context): this is the XLA path for
    prefill chunks. With one block it computes exactly what the reference does. Jitted, so that a caller outside a
    compiled program (op by op) gets one cached program per shape, not a loop traced anew at each call."""
    if layer is not None:
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    B, T, NH, D = q.shape
    KVH = k_cache.shape[-2]
    G = NH // KVH
    W = kv_indices.shape[1]
    blk = min(block, W)
    kv_indices = jnp.pad(kv_indices, ((0, 0), (0, -W % blk)))
    # key columns the call needs: up to the last position a query sees (q_hi; -1 on padded queries)
    need = jnp.max(jnp.max(q_hi, axis=1) - kv_start + 1)
    num_blocks = jnp.clip(-(-need // blk), 0, kv_indices.shape[1] // blk)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    qg = q.reshape(B, T, KVH, G, D)

    def body(j, carry):
        m, l, o = carry  # [B, KVH, G, T], [B, KVH, G, T], [B, KVH, G, T, D]
        idx = lax.dynamic_slice_in_dim(kv_indices, j * blk, blk, axis=1)
        pos = kv_start[:, None] + j * blk + jnp.arange(blk, dtype=jnp.int32)[None, :]
        valid = (pos[:, None, :] >= q_lo[:, :, None]) & (pos[:, None, :] <= q_hi[:, :, None])  # [B, T, blk]
        live = jnp.any(valid, axis=1)
        idx = jnp.where(live, idx, 0)  # slots no query sees are never dereferenced
        k = k_cache[idx]
        v = jnp.where(live[:, :, None, None], v_cache[idx], jnp.zeros((), v_cache.dtype))
        mask = valid[:, None, None, :, :]
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=acc) * scale
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.exp(m - m_safe)  # 0 while nothing was seen (m = -inf)
        o = o * alpha[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=acc)
        return m_new, l * alpha + jnp.sum(p, axis=-1), o

    m0 = jnp.full((B, KVH, G, T), -jnp.inf, acc)
    _, l, o = lax.fori_loop(0, num_blocks, body, (m0, jnp.zeros_like(m0), jnp.zeros((B, KVH, G, T, D), acc)))
    o = o / jnp.where(l > 0, l, 1.0)[..., None]  # a query with no valid key returns 0
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, NH, D).astype(q.dtype)

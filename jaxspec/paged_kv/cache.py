"""Device side of the paged KV cache: K/V stacks of every non-shared layer, the device copy of the full→SWA table,
and the attention that the target forward (`jaxspec.model.gemma4.forward`) and the drafter run over them.

Layout: `kv[type]` holds `k` and `v` of shape `[L_type, num_pages * page_size, KVH, d]` (one stack per attention type,
pages flattened to slots). Full-attention layers live in the full pool, sliding layers in the SWA pool; a position's
sliding-layer slot is found through `swa_of_full` inside `gather_kv_indices`. Stacks start as zeros and are written by
scatters into donated buffers; padded rows' writes (to the dummy page 0) are dropped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec.config import FULL, TargetConfig, env_switch
from jaxspec.model.layers import acc_dtype, rope_tables
from jaxspec.paged_kv.metadata import CacheSpec, StepMetadata
from jaxspec.paged_kv.pool import PagePool
from jaxspec.pallas.qkv_cache import q_rope, qkv_cache, supported, write_rows
from jaxspec.pallas.row_norms import Vec
from jaxspec.pallas.paged_attention import (MAX_NEW_KV_QUERIES, paged_attention, paged_attention_blocked,
                                            paged_attention_qkv, paged_attention_ref, paged_attention_rows,
                                            query_rows, row_ranges)

MAX_KERNEL_QUERIES = 16  # q_len above this (prefill chunks) uses the XLA path (paged_attention_blocked)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerKV:
    """K and V of every non-shared layer of one attention type, stacked."""

    k: jax.Array  # [L_type, num_slots, KVH, d]
    v: jax.Array  # [L_type, num_slots, KVH, d]


def init_kv(cfg: TargetConfig, spec: CacheSpec, dtype) -> dict[str, LayerKV]:
    kv = {}
    for t, layers in cfg.kv_layers.items():
        if not layers:
            continue
        pages = spec.num_full_pages if t == FULL else spec.num_swa_pages
        shape = (len(layers), pages * spec.page_size, cfg.type_kv_heads(t), cfg.type_head_dim(t))
        kv[t] = LayerKV(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    return kv


class PagedKVCache:
    """Owns the host allocator (`pool`), the device K/V (`kv`) and the device copy of the full→SWA table."""

    def __init__(self, cfg: TargetConfig, *, page_size: int = 16, num_full_pages: int, num_swa_pages: int,
                 max_context: int, max_step_tokens: int, dtype=jnp.float32, mesh=None):
        """mesh: split the K/V pools by KV head over it (`jaxspec.parallel`); uploads are replicated on it."""
        self.cfg = cfg
        self.dtype = dtype
        self.max_step_tokens = max_step_tokens
        self.mesh = mesh
        # where host arrays go: the default device, or replicated over the mesh (made once, not per upload)
        self.upload_sharding = None
        if mesh is not None:
            from jaxspec.parallel import replicated

            self.upload_sharding = replicated(mesh)
        self._build(page_size, num_full_pages, num_swa_pages, max_context)

    def _build(self, page_size, num_full_pages, num_swa_pages, max_context):
        self.spec = CacheSpec(page_size=page_size, num_full_pages=num_full_pages, num_swa_pages=num_swa_pages,
                              max_pages_per_request=-(-max_context // page_size))
        self.pool = PagePool(page_size=page_size, num_full_pages=num_full_pages, num_swa_pages=num_swa_pages,
                             max_pages_per_request=self.spec.max_pages_per_request,
                             swa_keep=self.cfg.sliding_window + 1, max_step_tokens=self.max_step_tokens)
        self.kv = init_kv(self.cfg, self.spec, self.dtype)
        if self.mesh is not None:
            from jaxspec.parallel import kv_shardings

            self.kv = jax.device_put(self.kv, kv_shardings(self.kv, self.mesh))
        self._swa_version = -1
        self._swa_device = None

    @property
    def swa_of_full(self):
        """Device copy of the pool's full→SWA table, re-uploaded only when the pool changed it."""
        if self._swa_version != self.pool.version:
            self._swa_device = jax.device_put(self.pool.swa_of_full, self.upload_sharding)  # a transfer, not a trace
            self._swa_version = self.pool.version
        return self._swa_device

    def rebuild(self, *, page_size=None, num_full_pages=None, num_swa_pages=None, max_context=None):
        """Re-create the pool and the K/V with new sizes (no request may be live). Programs compiled for the old spec
        must be compiled again by their owners (the engine, a drafter)."""
        if self.pool.requests:
            raise ValueError("rebuild needs an empty pool: preempt or finish the live requests first")
        s = self.spec
        self._build(page_size or s.page_size, num_full_pages or s.num_full_pages, num_swa_pages or s.num_swa_pages,
                    max_context or s.max_context)


def _attention_fn(use_kernels: bool, num_queries: int):
    """Up to MAX_KERNEL_QUERIES queries a row (decode, verify, the drafter): the kernel, or without kernels the
    whole-width reference (on the CPU at the default 4096 context the blocked loop decoded no faster: 38-45 against
    40-43 tok/s over two runs each). Prefill chunks: `paged_attention_blocked`, whose cost follows the live context
    (a bucket-8 prefill of 64-token prompts on the CPU: 6.1 s against 23.6 s at a 32768 context)."""
    if num_queries > MAX_KERNEL_QUERIES:
        return paged_attention_blocked
    return paged_attention if use_kernels else paged_attention_ref


def _attend_fn(use_kernels: bool, num_queries: int, mesh, num_heads: int, kv_heads: int, layer: int, *,
               fixed_splits: bool = False, **kw):
    """`_attention_fn`'s choice called as attn(q, k, v, read, kv_start, q_lo, q_hi); on a mesh the kernel runs per
    device (`jaxspec.parallel.per_device_attention`), or the reference where the heads do not split evenly.
    fixed_splits: the kernel's (the reference has no splits: its whole-width sums are fixed by the index list).
    The kernel's splits are merged by a second kernel: the attention kernel merging them itself made E4B's bs-1
    verify step 15% slower on the H200 (4.715 -> 5.412 ms, 41 launches fewer; BENCHMARKS.md session 15), its last
    piece reading all the pieces' partials alone, and was removed in session 37 (JAXSPEC_ATTN_MERGED), as was the
    key walk software-pipelined by hand (JAXSPEC_ATTN_PREFETCH: no faster, session 16)."""
    attn = _attention_fn(use_kernels, num_queries)
    if attn is paged_attention:  # the kernel's options: q's own layout in and out (default), fixed key pieces
        kw = {**kw, "gather_q": env_switch("JAXSPEC_ATTN_GATHER_Q") is not False, "fixed_splits": fixed_splits}
    if mesh is not None and attn is paged_attention:
        from jaxspec.parallel import per_device_attention

        split = per_device_attention(mesh, functools.partial(attn, **kw), num_heads, kv_heads, layer)
        if split is not None:
            return split
        attn = paged_attention_ref  # which takes none of the kernel's options
        kw = {name: value for name, value in kw.items() if name not in ("gather_q", "fixed_splits")}
    return functools.partial(attn, layer=layer, **kw)


def qkv_kernel_on(meta: StepMetadata) -> bool:
    """Whether a kernel step runs `qkv_cache` / `q_rope` (a layer's q/k/v norms, RoPE and K/V write as one kernel):
    JAXSPEC_QKV_KERNEL=1 every step, =0 none; unset, the one-position steps (plain decoding) outside the
    batch-invariant mode, where a verify step must compute each position as a decode step does. By default the
    steps `in_attention_on` names (one position, and a verify's few) run this work inside the attention kernel
    instead (`qkv_attend`, `shared_q` below; `qkv_into_cache` then serves only the layers it refuses). Measured: E4B's
    bs-1 decode step -2.7% on the H100 (six runs side by side, session 31), -1.7% on the H200 (one run, session 29);
    the bs-1 verify step tied on the H200 (session 29) and ran 3.6% slower on the H100 (session 31)."""
    switch = env_switch("JAXSPEC_QKV_KERNEL")
    if switch is not None:
        return switch
    return meta.positions.shape[1] == 1 and not meta.invariant


def in_attention_on(meta: StepMetadata, kernels: bool) -> bool:
    """Whether a step's q norm and RoPE (a KV-shared layer's, `shared_q`) and a non-shared layer's q/k/v step with
    its K/V write (`qkv_attend`) may run inside the attention kernel (each under its own switch): the kernels on one
    device with q read in its own layout (JAXSPEC_ATTN_GATHER_Q), and one position a row where `qkv_kernel_on` says
    so, or a verify step's 2 to MAX_NEW_KV_QUERIES positions outside the batch-invariant mode (there a verify step
    computes each position as the decode step does; JAXSPEC_VERIFY_IN_ATTENTION=0: never). E4B's bs-1 verify step:
    806 -> 693 launches on the H100, its kernels' time a step -1.4% and its device span -1.0% (session 42)."""
    if not kernels or env_switch("JAXSPEC_ATTN_GATHER_Q") is False:
        return False
    T = meta.positions.shape[1]
    if T == 1:
        return qkv_kernel_on(meta)
    return T <= MAX_NEW_KV_QUERIES and not meta.invariant and env_switch("JAXSPEC_VERIFY_IN_ATTENTION") is not False


def paged_attend(cfg: TargetConfig, meta: StepMetadata, *, use_kernels: bool, mesh=None):
    """An `Attend` over the paged cache: scatter the new K/V to the write slots, attend over the read window. mesh:
    the tensor-parallel mesh (`jaxspec.parallel`), where the kernels run per device."""
    def attend(kv, i, q, k, v):
        t, layer = cfg.kv_slot(i)
        m = meta.layers[t]
        if k is not None:  # padding positions dropped (`write_rows`)
            stack = kv[t]
            kv = {**kv, t: LayerKV(k=write_rows(stack.k, layer, m.write, k), v=write_rows(stack.v, layer, m.write, v))}
        attn = _attend_fn(use_kernels, q.shape[1], mesh, q.shape[2], kv[t].k.shape[2], layer, scale=cfg.query_scale,
                          fixed_splits=meta.invariant)
        return attn(q, kv[t].k, kv[t].v, m.read, m.kv_start, m.q_lo, m.q_hi), kv

    def tables(i, positions, dtype):  # layer i's RoPE cos, sin [B, T, D] in dtype's accumulation type
        return rope_tables(positions, cfg.rope(cfg.layer_types[i]), cfg.layer_head_dim(i), acc_dtype(dtype))

    if use_kernels and mesh is None and qkv_kernel_on(meta):
        def qkv_into_cache(kv, i, out, q_norm: Vec, k_norm: Vec, positions):
            """A non-shared layer's fused q/k/v product `out` [B, T, (NH + KVH (+ KVH)) D] -> (q normed and rotated,
            kv with the step's K and V written): `qkv_cache`, one kernel for what `gemma4.joint_qkv` and the scatter
            above run as several (`qkv_kernel_on`; then `attend` is called with k = v = None)."""
            t, layer = cfg.kv_slot(i)
            stack = kv[t]
            cos, sin = tables(i, positions, out.dtype)
            q, k, v = qkv_cache(out, q_norm, k_norm, cos, sin, stack.k, stack.v, layer, meta.layers[t].write,
                                num_heads=cfg.num_heads, has_v=cfg.has_v_proj(i), v_norm=cfg.use_v_norm,
                                eps=cfg.rms_norm_eps)
            return q, {**kv, t: LayerKV(k=k, v=v)}

        def q_only(i, q, q_norm: Vec, positions):
            """A KV-shared layer's q projection [B, T, NH D] -> q normed and rotated: `q_rope`, one kernel."""
            cos, sin = tables(i, positions, q.dtype)
            return q_rope(q, q_norm, cos, sin, eps=cfg.rms_norm_eps)

        attend.qkv_into_cache, attend.q_rope = qkv_into_cache, q_only
    if not in_attention_on(meta, use_kernels and mesh is None):
        return attend
    T = meta.positions.shape[1]
    if env_switch("JAXSPEC_SHARED_Q_IN_ATTENTION") is not False:
        def shared_q(kv, i, q, q_norm: Vec, positions):
            """A KV-shared layer's q projection [B, T, NH D] -> (its attention [B, T, NH, D], kv): q normed and
            rotated inside the attention kernel (`paged_attention`'s rope_eps), one launch fewer a layer than
            `q_only` then `attend` (E4B: 18 a decode step), two fewer than XLA's norm and rotation.
            JAXSPEC_SHARED_Q_IN_ATTENTION=0: q_only (or XLA's), then attend."""
            t, layer = cfg.kv_slot(i)
            m = meta.layers[t]
            q = q.reshape(q.shape[0], T, -1, cfg.layer_head_dim(i))
            attn = _attend_fn(True, T, None, q.shape[2], kv[t].k.shape[2], layer, scale=cfg.query_scale,
                              fixed_splits=meta.invariant)  # the kernel, gather_q on (`in_attention_on`)
            cos, sin = tables(i, positions, q.dtype)
            return attn(q, kv[t].k, kv[t].v, m.read, m.kv_start, m.q_lo, m.q_hi, q_norm=q_norm.stack,
                        q_norm_index=tuple(q_norm.index), cos=cos, sin=sin, rope_eps=cfg.rms_norm_eps), kv

        attend.shared_q = shared_q
    if env_switch("JAXSPEC_QKV_IN_ATTENTION") is not False and not meta.invariant:
        def qkv_attend(kv, i, out, q_norm: Vec, k_norm: Vec, positions):
            """A non-shared layer's q/k/v product [B, T, (NH + KVH (+ KVH)) D] -> (its attention [B, T, NH, D], kv
            with the step's K and V written): the norms, RoPE and K/V write inside the attention kernel
            (`paged_attention_qkv`), one launch fewer a layer than `qkv_into_cache` then `attend` (E4B: 24 a decode
            step; its kernels' time a step 0.9% lower on the H100, session 41), and in a verify step XLA's norm and
            RoPE fusions and two scatters fewer. JAXSPEC_QKV_IN_ATTENTION=0: qkv_into_cache (or XLA's), then attend.
            None where the kernel does not take the layer (`qkv_cache.supported`)."""
            t, layer = cfg.kv_slot(i)
            m, stack = meta.layers[t], kv[t]
            if not supported(out, stack.k):
                return None
            cos, sin = tables(i, positions, out.dtype)
            heads = out.reshape(out.shape[0], T, -1, cfg.layer_head_dim(i))
            a, k, v = paged_attention_qkv(
                heads, stack.k, stack.v, m.read, m.kv_start, m.q_lo, m.q_hi, m.write, q_norm.stack,
                k_norm.stack, cos, sin, num_heads=cfg.num_heads, layer=layer, scale=cfg.query_scale,
                q_norm_index=tuple(q_norm.index), k_norm_index=tuple(k_norm.index),
                has_v=cfg.has_v_proj(i), v_norm=cfg.use_v_norm, eps=cfg.rms_norm_eps)
            return a, {**kv, t: LayerKV(k=k, v=v)}

        attend.qkv_attend = qkv_attend
    return attend


def draft_attend(cfg: TargetConfig, layer_types, meta: dict, *, use_kernels: bool = True, mesh=None):
    """An `Attend` for drafter layer i (type layer_types[i]): Q-only attention over the target store layer of that
    type. meta: {type: AttentionMetadata} (`draft_metadata`). mesh: as `paged_attend`'s (the drafter's query heads
    then split as the target's K/V heads do)."""
    store = {t: len(cfg.kv_layers[t]) - 1 for t in cfg.kv_layers if cfg.kv_layers[t]}

    def attend(kv, i, q, k, v):
        t = layer_types[i]
        m = meta[t]
        attn = _attend_fn(use_kernels, q.shape[1], mesh, q.shape[2], kv[t].k.shape[2], store[t])
        return attn(q, kv[t].k, kv[t].v, m.read, m.kv_start, m.q_lo, m.q_hi), kv

    return attend


def draft_attend_rows(cfg: TargetConfig, text: TargetConfig, meta: dict):
    """The fused drafter's attention (`jaxspec.model.assistant.fused_draft_hidden`): attend_rows(kv, i, q, rope) for
    drafter layer i (config `text`) over the target store layer of its type, queries and output in the kernel's row
    layout, q's norm and RoPE in the kernel (rope: `paged_attention_rows`'). meta: {type: AttentionMetadata}
    (`draft_metadata`) of the live rows (the queries may have more: padding, left unattended); the row masks are
    built once per type."""
    store = {t: len(cfg.kv_layers[t]) - 1 for t in cfg.kv_layers if cfg.kv_layers[t]}
    masks = {}

    def attend_rows(kv, i, q, rope):
        t = text.layer_types[i]
        m = meta[t]
        G = text.num_heads // text.layer_kv_heads(i)
        block_q, rows = query_rows(1, G, text.layer_head_dim(i))
        if (t, G, rows) not in masks:
            masks[t, G, rows] = row_ranges(m.kv_start, m.q_lo, m.q_hi, G, rows, m.read.shape[1])
        row_lo, row_hi, span = masks[t, G, rows]
        return paged_attention_rows(q, kv[t].k, kv[t].v, m.read, m.kv_start, row_lo, row_hi, span, layer=store[t],
                                    block_q=block_q, rope=rope, real_rows=G)

    return attend_rows

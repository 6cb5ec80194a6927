"""Device side of the paged KV cache: K/V arrays of every non-shared layer, the full→SWA table, and the attention
that the target forward (`jaxspec.model.gemma4.forward`) runs over them.

Layout: `arrays['{type}_k']` is `[L_type, num_pages * page_size, KVH, d]` (one stack per attention type, pages
flattened to slots). Full-attention layers live in the full pool, sliding layers in the SWA pool; a position's
sliding-layer slot is found through `swa_of_full` inside `gather_kv_indices`. Arrays start as zeros and are written
by scatters into donated buffers; padded rows write to the dummy page 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import FULL, SLIDING, TargetConfig
from jaxspec.paged_kv.pool import PagePool
from jaxspec.pallas.kv_indices import gather_kv_indices
from jaxspec.pallas.paged_attention import paged_attention
from jaxspec.pallas.reference import gather_kv_indices_ref, paged_attention_ref

WIDTH_MULTIPLE = 128  # index-list widths are padded to this (a multiple of every kernel block size)
MAX_KERNEL_QUERIES = 16  # q_len above this (prefill chunks) uses the XLA gather + dense attention path


def round_width(n: int) -> int:
    return -(-max(n, 1) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """Static shape of a paged cache; jitted functions are compiled per spec."""

    page_size: int
    num_full_pages: int
    num_swa_pages: int
    max_pages_per_request: int

    @property
    def max_context(self) -> int:
        return self.max_pages_per_request * self.page_size


def init_arrays(cfg: TargetConfig, spec: CacheSpec, dtype) -> dict:
    arrays = {}
    for t, layers in cfg.kv_layers.items():
        if not layers:
            continue
        pages = spec.num_full_pages if t == FULL else spec.num_swa_pages
        shape = (len(layers), pages * spec.page_size, cfg.type_kv_heads(t), cfg.type_head_dim(t))
        arrays[f"{t}_k"] = jnp.zeros(shape, dtype)
        arrays[f"{t}_v"] = jnp.zeros(shape, dtype)
    return arrays


class PagedKVCache:
    """Owns the host allocator (`pool`), the device arrays and the device copy of the full→SWA table."""

    def __init__(self, cfg: TargetConfig, *, page_size: int = 16, num_full_pages: int, num_swa_pages: int,
                 max_context: int, max_step_tokens: int, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.max_step_tokens = max_step_tokens
        self._on_rebuild = []
        self._build(page_size, num_full_pages, num_swa_pages, max_context)

    def _build(self, page_size, num_full_pages, num_swa_pages, max_context):
        self.spec = CacheSpec(page_size=page_size, num_full_pages=num_full_pages, num_swa_pages=num_swa_pages,
                              max_pages_per_request=-(-max_context // page_size))
        self.pool = PagePool(page_size=page_size, num_full_pages=num_full_pages, num_swa_pages=num_swa_pages,
                             max_pages_per_request=self.spec.max_pages_per_request,
                             swa_keep=self.cfg.sliding_window + 1, max_step_tokens=self.max_step_tokens)
        self.arrays = init_arrays(self.cfg, self.spec, self.dtype)
        self._swa_version = -1
        self._swa_device = None

    @property
    def swa_of_full(self):
        """Device copy of the pool's full→SWA table, re-uploaded only when the pool changed it."""
        if self._swa_version != self.pool.version:
            self._swa_device = jax.device_put(self.pool.swa_of_full)  # a transfer, never a trace
            self._swa_version = self.pool.version
        return self._swa_device

    def on_rebuild(self, callback) -> None:
        """Register a callback run after `rebuild` (the bucketed drafter re-compiles its buckets there)."""
        self._on_rebuild.append(callback)

    def rebuild(self, *, page_size=None, num_full_pages=None, num_swa_pages=None, max_context=None):
        """Re-create the pool and the arrays with new sizes (no request may be live)."""
        if self.pool.requests:
            raise ValueError("rebuild needs an empty pool: preempt or finish the live requests first")
        s = self.spec
        self._build(page_size or s.page_size, num_full_pages or s.num_full_pages, num_swa_pages or s.num_swa_pages,
                    max_context or s.max_context)
        for cb in self._on_rebuild:
            cb(self)

    def fill_free_pages(self, value) -> None:
        """Test aid: overwrite every page no live request owns (dummy page included) with `value`."""
        for t in self.cfg.kv_layers:
            if f"{t}_k" not in self.arrays:
                continue
            owned = self.pool.owned_full_pages() if t == FULL else self.pool.owned_swa_pages()
            n = self.spec.num_full_pages if t == FULL else self.spec.num_swa_pages
            free = np.ones(n, bool)
            free[list(owned)] = False
            slot_free = jnp.asarray(np.repeat(free, self.spec.page_size))[None, :, None, None]
            for kv in "kv":
                a = self.arrays[f"{t}_{kv}"]
                self.arrays[f"{t}_{kv}"] = jnp.where(slot_free, jnp.asarray(value, a.dtype), a)


# ---- metadata and attention over the paged cache (pure, traced inside the jitted steps) ---------------------------


def window_start(layer_type: str, start, keep: int):
    """First position read for `layer_type` by a step whose first new position is `start`: sliding layers read the
    last `keep` positions before it (the target W - 1, the drafter W + 1), full layers everything."""
    if layer_type == SLIDING:
        return jnp.maximum(start - keep, 0)
    return jnp.zeros_like(start)


def step_metadata(cfg: TargetConfig, spec: CacheSpec, page_table, swa_of_full, start, num_tokens, T: int,
                  *, use_kernels: bool):
    """Everything the layers of one target step need, computed once for all layers.

    page_table: int32[B, max_pages]; start, num_tokens: int32[B] (row b writes positions start..start+n-1; rows with
    n < T are padded, n = 0 is an empty row). Returns per attention type: write slots [B, T] (padding -> slot 0),
    the read index list, its first position, and per query the visible range [q_lo, q_hi].
    """
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    real = jnp.arange(T)[None, :] < num_tokens[:, None]
    end = start + num_tokens
    gather = gather_kv_indices if use_kernels else gather_kv_indices_ref
    meta = {"positions": positions}
    for t in cfg.kv_layers:
        if not cfg.kv_layers[t]:
            continue
        swa = swa_of_full if t == SLIDING else None
        keep = cfg.sliding_window - 1
        kv_start = window_start(t, start, keep)
        width = round_width(spec.max_context if t == FULL else keep + T)
        meta[t] = {
            "write": gather_kv_indices_ref(page_table, start, end, swa, width=T, page_size=spec.page_size),
            "read": gather(page_table, kv_start, end, swa, width=width, page_size=spec.page_size),
            "kv_start": kv_start,
            "q_hi": jnp.where(real, positions, -1),
            "q_lo": positions - cfg.sliding_window + 1 if t == SLIDING else jnp.zeros_like(positions),
        }
    return meta


def paged_attend(cfg: TargetConfig, meta, *, use_kernels: bool):
    """An `Attend` over the paged cache: scatter the new K/V to the write slots, attend over the read window."""

    def attend(arrays, i, q, k, v):
        t, slot = cfg.kv_slot(i)
        m = meta[t]
        if k is not None:
            arrays = dict(arrays)
            B, T = m["write"].shape
            for name, val in ((f"{t}_k", k), (f"{t}_v", v)):
                arrays[name] = arrays[name].at[slot, m["write"].reshape(-1)].set(val.reshape(B * T, *val.shape[2:]))
        k_all, v_all = arrays[f"{t}_k"], arrays[f"{t}_v"]
        if use_kernels and q.shape[1] <= MAX_KERNEL_QUERIES:
            out = paged_attention(q, k_all, v_all, m["read"], m["kv_start"], m["q_lo"], m["q_hi"],
                                  scale=cfg.query_scale, layer=slot)
        else:
            out = paged_attention_ref(q, k_all[slot], v_all[slot], m["read"], m["kv_start"], m["q_lo"], m["q_hi"],
                                      scale=cfg.query_scale)
        return out, arrays

    return attend


# ---- the drafter's read-only view: one window per attention type, shared by all k steps --------------------------


def draft_window_width(cfg: TargetConfig, spec: CacheSpec, layer_type: str, window: int) -> int:
    return round_width(spec.max_context if layer_type == FULL else window + 1)


def draft_metadata(cfg: TargetConfig, spec: CacheSpec, page_table, swa_of_full, cached_len, window: int,
                   layer_types, *, use_kernels: bool = True):
    """Index lists of the drafter's windows (device side, live entries only, SWA translation in the same kernel).

    cached_len: int32[B] (0 for padded rows: they see no key). Returns {type: {read, kv_start, q_lo, q_hi}}.
    """
    gather = gather_kv_indices if use_kernels else gather_kv_indices_ref
    meta = {}
    for t in sorted(set(layer_types)):
        kv_start = window_start(t, cached_len, window + 1)  # transformers' assistant mask: the last W + 1
        meta[t] = {
            "read": gather(page_table, kv_start, cached_len, swa_of_full if t == SLIDING else None,
                           width=draft_window_width(cfg, spec, t, window), page_size=spec.page_size),
            "kv_start": kv_start,
            "q_lo": kv_start[:, None],
            "q_hi": (cached_len - 1)[:, None],
        }
    return meta


def draft_attend(cfg: TargetConfig, layer_types, meta, *, use_kernels: bool = True):
    """An `Attend` for drafter layer i (type layer_types[i]): Q-only attention over the target store layer."""
    store = {t: len(cfg.kv_layers[t]) - 1 for t in cfg.kv_layers if cfg.kv_layers[t]}

    def attend(arrays, i, q, k, v):
        t = layer_types[i]
        m, slot = meta[t], store[t]
        k_all, v_all = arrays[f"{t}_k"], arrays[f"{t}_v"]
        if use_kernels:
            out = paged_attention(q, k_all, v_all, m["read"], m["kv_start"], m["q_lo"], m["q_hi"], layer=slot)
        else:
            out = paged_attention_ref(q, k_all[slot], v_all[slot], m["read"], m["kv_start"], m["q_lo"], m["q_hi"])
        return out, arrays

    return attend

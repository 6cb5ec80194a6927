"""Typed inputs of attention over the paged cache: the page tables, and per attention type the index list a step
reads, the slots it writes and the positions each query may see. Built on the device, inside the compiled programs,
from the page tables and `cached_len` (the drafter's eager reference builds the same structure on the host).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec.config import FULL, SLIDING, TargetConfig
from jaxspec.pallas.kv_indices import gather_kv_indices, gather_kv_indices_ref

WIDTH_MULTIPLE = 128  # index-list widths are padded to this (a multiple of every kernel block size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """Static shape of a paged cache; programs are compiled per spec."""

    page_size: int
    num_full_pages: int
    num_swa_pages: int
    max_pages_per_request: int

    @property
    def max_context(self) -> int:
        return self.max_pages_per_request * self.page_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTables:
    """Where a batch's K/V lives: logical page j of row b is full-pool page `page_table[b, j]`; a sliding layer finds
    it in SWA page `swa_of_full[page_table[b, j]]`."""

    page_table: jax.Array  # i32[B, max_pages]   0: the dummy page
    swa_of_full: jax.Array  # i32[num_full_pages] 0: not resident in the SWA pool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """One attention type's view of the cache for one step; every layer of the type shares it."""

    read: jax.Array  # i32[B, W]   slot of key i, whose position is kv_start + i (entries past the live ones: masked)
    kv_start: jax.Array  # i32[B]  position of key 0
    q_lo: jax.Array  # i32[B, T]   query t sees the keys at positions q_lo..q_hi
    q_hi: jax.Array  # i32[B, T]   (q_hi < q_lo: a padded query that sees nothing)
    write: jax.Array | None = None  # i32[B, T] slot of each new position's K/V (padding: 0, dropped); None: read only


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """Everything the layers of one target step need, computed once for all layers."""

    positions: jax.Array  # i32[B, T]
    layers: dict  # {attention type: AttentionMetadata}
    # batch-invariant attention (`step_metadata(invariant=True)`): the kernels split the keys at fixed entries
    invariant: bool = dataclasses.field(default=False, metadata=dict(static=True))


def round_width(n: int) -> int:
    return -(-max(n, 1) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE


def window_start(layer_type: str, cached_len, keep: int):
    """First position read for `layer_type` by a step whose first new position is `cached_len`: sliding layers read
    the last `keep` positions before it (the target W - 1, the drafter W + 1), full layers everything."""
    if layer_type == SLIDING:
        return jnp.maximum(cached_len - keep, 0)
    return jnp.zeros_like(cached_len)


def _gather(use_kernels: bool, mesh):
    """The index kernel (per device on a tensor-parallel mesh: `jaxspec.parallel.per_device`) or its reference."""
    if not use_kernels:
        return gather_kv_indices_ref
    if mesh is None:
        return gather_kv_indices
    from jaxspec.parallel import per_device

    def gather(page_table, kv_start, kv_end, swa_of_full, **kw):
        return per_device(mesh, functools.partial(gather_kv_indices, **kw))(page_table, kv_start, kv_end, swa_of_full)

    return gather


def step_metadata(cfg: TargetConfig, spec: CacheSpec, pages: PageTables, cached_len, num_new, num_tokens: int, *,
                  use_kernels: bool, mesh=None, invariant: bool = False) -> StepMetadata:
    """Metadata of a target step in which row b writes positions cached_len[b] .. cached_len[b] + num_new[b] - 1.

    cached_len, num_new: i32[B]; rows with num_new < num_tokens are padded (num_new = 0: an empty row). mesh: the
    tensor-parallel mesh, where the kernels run per device. invariant: every layer type's index list starts at
    position 0 and spans max_context (a sliding layer's too, its window kept by the query masks), so key i is
    position i in every row and every step, and the kernels cut the keys at fixed entries (`paged_attention`'s
    fixed_splits): a query's attention is then a function of its own position and keys, not of the step's other
    rows or positions (the engine's batch-invariant mode).
    """
    T = num_tokens
    positions = cached_len[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    real = jnp.arange(T)[None, :] < num_new[:, None]
    end = cached_len + num_new
    gather = _gather(use_kernels, mesh)
    P = spec.page_size
    layers = {}
    for t, kv_layers in cfg.kv_layers.items():
        if not kv_layers:
            continue
        swa = pages.swa_of_full if t == SLIDING else None
        keep = cfg.sliding_window - 1
        kv_start = jnp.zeros_like(cached_len) if invariant else window_start(t, cached_len, keep)
        width = round_width(spec.max_context if t == FULL or invariant else keep + T)
        layers[t] = AttentionMetadata(
            write=gather_kv_indices_ref(pages.page_table, cached_len, end, swa, width=T, page_size=P),
            read=gather(pages.page_table, kv_start, end, swa, width=width, page_size=P),
            kv_start=kv_start,
            q_hi=jnp.where(real, positions, -1),
            q_lo=positions - cfg.sliding_window + 1 if t == SLIDING else jnp.zeros_like(positions),
        )
    return StepMetadata(positions=positions, layers=layers, invariant=invariant)


def draft_window_width(spec: CacheSpec, layer_type: str, window: int) -> int:
    return round_width(spec.max_context if layer_type == FULL else window + 1)


def draft_metadata(spec: CacheSpec, pages: PageTables, cached_len, window: int, layer_types, *,
                   use_kernels: bool = True, mesh=None) -> dict:
    """The drafter's windows, one per attention type, shared by all k steps (device side, live entries only, the SWA
    translation in the same kernel): full layers read [0, cached_len), sliding layers the last window + 1 positions
    (transformers' assistant mask keeps the last W + 1).

    cached_len: i32[B] (0 for padded rows: they see no key). Returns {type: AttentionMetadata} (read only).
    """
    gather = _gather(use_kernels, mesh)
    meta = {}
    for t in sorted(set(layer_types)):
        kv_start = window_start(t, cached_len, window + 1)
        meta[t] = AttentionMetadata(
            read=gather(pages.page_table, kv_start, cached_len, pages.swa_of_full if t == SLIDING else None,
                        width=draft_window_width(spec, t, window), page_size=spec.page_size),
            kv_start=kv_start,
            q_lo=kv_start[:, None],
            q_hi=(cached_len - 1)[:, None],
        )
    return meta

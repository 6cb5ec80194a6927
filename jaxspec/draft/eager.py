"""EagerDrafter: the reference draft path. Obviously right, not fast.

Op by op (no jit around the step), metadata built on the host with numpy (walk each page-table row, translate the
whole row to SWA pages), attention by the jnp reference, and a Python loop over the k steps. It calls the same model
function as the bucketed path (`jaxspec.model.assistant.propose`).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.aot import matmul_precision
from jaxspec.config import SLIDING, AssistantConfig, TargetConfig
from jaxspec.model.assistant import propose
from jaxspec.paged_kv.cache import PagedKVCache, draft_attend
from jaxspec.paged_kv.metadata import AttentionMetadata, draft_window_width


def host_draft_metadata(cache: PagedKVCache, page_table: np.ndarray, cached_len: np.ndarray, window: int,
                        layer_types) -> dict:
    """The drafter's index lists, built on the host: positions [kv_start, cached_len) of each row -> slots."""
    P = cache.spec.page_size
    swa_of_full = cache.pool.swa_of_full
    meta = {}
    for t in sorted(set(layer_types)):
        width = draft_window_width(cache.spec, t, window)
        read = np.zeros((len(cached_len), width), np.int32)
        kv_start = np.zeros(len(cached_len), np.int32)
        for b, c in enumerate(cached_len):
            pages = page_table[b]
            if t == SLIDING:
                pages = swa_of_full[pages]  # the whole row, as the seed's first version did
                kv_start[b] = max(0, c - window - 1)
            pos = np.arange(kv_start[b], c)
            read[b, : len(pos)] = pages[pos // P] * P + pos % P
        meta[t] = AttentionMetadata(read=jnp.asarray(read), kv_start=jnp.asarray(kv_start),
                                    q_lo=jnp.asarray(kv_start[:, None]),
                                    q_hi=jnp.asarray((cached_len - 1)[:, None], jnp.int32))
    return meta


class EagerDrafter:
    """propose(...) -> (drafts int32[B, k], last h_next [B, H_target]) as numpy."""

    def __init__(self, aparams, acfg: AssistantConfig, target_embed, cfg: TargetConfig, k: int):
        self.aparams, self.acfg, self.target_embed, self.cfg, self.k = aparams, acfg, target_embed, cfg, k
        self.cache: PagedKVCache | None = None

    def attach(self, cache: PagedKVCache) -> None:
        self.cache = cache

    def propose(self, page_table, cached_len, pending_token, seed_table, slot):
        """seed_table: [slots, H_target] (device); slot: the row of each request in it."""
        cached_len = np.asarray(cached_len, np.int32)
        types = self.acfg.text.layer_types
        meta = host_draft_metadata(self.cache, np.asarray(page_table), cached_len, self.acfg.text.sliding_window,
                                   types)
        attend = draft_attend(self.cfg, types, meta, use_kernels=False)
        seeds = jnp.asarray(seed_table)[jnp.asarray(slot)]
        precision = matmul_precision(self.target_embed.dtype)
        with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
            drafts, h = propose(self.aparams, self.acfg, self.target_embed, jnp.asarray(pending_token, jnp.int32),
                                seeds, jnp.asarray(cached_len), attend, self.cache.kv, k=self.k)
        return np.asarray(drafts), np.asarray(h)

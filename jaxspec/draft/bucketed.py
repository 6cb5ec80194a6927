"""BucketedDrafter: the fast draft path, one compiled executable per batch-size bucket.

Per call only the page-table rows, `cached_len`, the pending tokens and the seed rows move host -> device, into
bucket-shaped buffers. Inside the one executable: the page-table walk and the SWA translation (`gather_kv_indices`,
live entries only), all k steps unrolled over one shared window with one metadata set, the paged attention, the head
and the argmax. On a GPU XLA captures the whole executable as one command buffer (CUDA graph).

Weights are arguments, never baked-in constants. All buckets are compiled ahead of time on `attach` and again after
the cache's `rebuild`; calls run under `jax.no_tracing`, so an accidental recompile raises instead of stalling.
Padded rows use the dummy page and cached_len 0 (they see no key); their drafts are discarded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import AssistantConfig, TargetConfig
from jaxspec.model.assistant import propose
from jaxspec.paged_kv.cache import CacheSpec, PagedKVCache, draft_attend, draft_metadata

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# XLA may keep bf16 intermediates in fp32 inside a fusion ("excess precision"); the eager reference runs op by op and
# rounds every op's output to bf16. On the H200 that difference alone moved bf16 drafts beyond the seed's rule
# (tests/test_drafter.py::test_bf16_drafts_follow_the_seed_rule); without it the two paths gave identical bf16 drafts.
# So the buckets round where the model function says to round, exactly like the reference.
DRAFT_COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def _draft_program(cfg: TargetConfig, acfg: AssistantConfig, spec: CacheSpec, k: int, use_kernels: bool):
    types = acfg.text.layer_types

    def draft_bucket(aparams, target_embed, arrays, swa_of_full, page_table, cached_len, pending, seed_table,
                     seed_rows):
        meta = draft_metadata(cfg, spec, page_table, swa_of_full, cached_len, acfg.text.sliding_window, types,
                              use_kernels=use_kernels)
        attend = draft_attend(cfg, types, meta, use_kernels=use_kernels)
        return propose(aparams, acfg, target_embed, pending, seed_table[seed_rows], cached_len, attend, arrays, k)

    return draft_bucket


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class BucketedDrafter:
    """propose_bucket(...) -> device (drafts int32[bucket, k], last h_next [bucket, H_target])."""

    def __init__(self, aparams, acfg: AssistantConfig, target_embed, cfg: TargetConfig, k: int, *,
                 buckets=DEFAULT_BUCKETS, seed_slots: int | None = None, use_kernels: bool = True,
                 compiler_options: dict | None = None):
        buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"draft buckets must be positive batch sizes, got {buckets}")
        self.aparams, self.acfg, self.target_embed, self.cfg, self.k = aparams, acfg, target_embed, cfg, k
        self.buckets = buckets
        self.seed_slots = seed_slots or buckets[-1] + 1
        self.use_kernels = use_kernels
        # e.g. {"xla_gpu_enable_command_buffer": ""} to measure what the graphs buy; on top of DRAFT_COMPILER_OPTIONS
        self.compiler_options = {**DRAFT_COMPILER_OPTIONS, **(compiler_options or {})}
        self.cache: PagedKVCache | None = None
        self.executables: dict[int, object] = {}
        self.compiles = 0  # how many times the buckets were (re)built: attach + each rebuild

    def attach(self, cache: PagedKVCache) -> None:
        self.cache = cache
        cache.on_rebuild(lambda _: self.compile())
        self.compile()

    def compile(self) -> None:
        """Compile every bucket against the cache's current shapes (ahead of time, off the serving path)."""
        cache = self.cache
        fn = jax.jit(_draft_program(self.cfg, self.acfg, cache.spec, self.k, self.use_kernels),
                     compiler_options=self.compiler_options)
        Ht = self.acfg.backbone_hidden_size
        statics = (jax.tree.map(_abstract, self.aparams), _abstract(self.target_embed),
                   jax.tree.map(_abstract, cache.arrays), _abstract(cache.swa_of_full))
        self.executables = {}
        for b in self.buckets:
            i32 = jnp.int32
            self.executables[b] = fn.lower(
                *statics,
                jax.ShapeDtypeStruct((b, cache.spec.max_pages_per_request), i32),
                jax.ShapeDtypeStruct((b,), i32), jax.ShapeDtypeStruct((b,), i32),
                jax.ShapeDtypeStruct((self.seed_slots, Ht), self.target_embed.dtype),
                jax.ShapeDtypeStruct((b,), i32),
            ).compile()
        self.compiles += 1

    def bucket_for(self, n: int) -> int:
        return next((b for b in self.buckets if b >= n), self.buckets[-1])

    def chunks(self, n: int):
        """Row ranges [lo, hi) and their bucket: batches above the largest bucket are split into bucket-sized chunks."""
        out, lo = [], 0
        while lo < n:
            hi = min(n, lo + self.buckets[-1])
            out.append((lo, hi, self.bucket_for(hi - lo)))
            lo = hi
        return out

    def propose_bucket(self, bucket: int, page_table, cached_len, pending, seed_table, seed_rows):
        """Inputs already padded to `bucket` rows (host numpy; seed_table on the device). No tracing happens here."""
        with jax.no_tracing(True):
            return self.executables[bucket](self.aparams, self.target_embed, self.cache.arrays,
                                            self.cache.swa_of_full, page_table, cached_len, pending, seed_table,
                                            seed_rows)

    def propose(self, page_table, cached_len, pending, seed_table, seed_rows):
        """Any batch size: pad to buckets (chunked above the largest), return numpy (drafts [B, k], h_next [B, Ht])."""
        page_table = np.asarray(page_table, np.int32)
        n = page_table.shape[0]
        drafts, hs = [], []
        for lo, hi, b in self.chunks(n):
            pad = b - (hi - lo)
            d, h = self.propose_bucket(
                b,
                np.pad(page_table[lo:hi], ((0, pad), (0, 0))),
                np.pad(np.asarray(cached_len, np.int32)[lo:hi], (0, pad)),
                np.pad(np.asarray(pending, np.int32)[lo:hi], (0, pad)),
                seed_table,
                np.pad(np.asarray(seed_rows, np.int32)[lo:hi], (0, pad)),
            )
            drafts.append(np.asarray(d)[: hi - lo])
            hs.append(np.asarray(h)[: hi - lo])
        return np.concatenate(drafts), np.concatenate(hs)

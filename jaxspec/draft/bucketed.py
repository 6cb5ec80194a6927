"""BucketedDrafter: the fast draft path, one compiled executable per batch-size bucket.

`draft` is the whole propose as one pure function: the page-table walk and the SWA translation (`gather_kv_indices`,
live entries only), all k steps unrolled over one shared window with one metadata set, the paged attention, the head
and the argmax. The engine's round program calls it inside its own executable; `BucketedDrafter` compiles it alone,
per bucket, for callers that want drafts by themselves (benchmarks, tests). On a GPU XLA captures an executable as one
command buffer (CUDA graph).

Weights are arguments, never baked-in constants. Buckets are compiled ahead of time (`compile`, called by `attach`;
call it again after the cache's `rebuild`); calls run under `jax.no_tracing`, so an accidental recompile raises
instead of stalling. Padded rows use the dummy page and cached_len 0 (they see no key); their drafts are discarded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.aot import compile_ahead, matmul_precision
from jaxspec.config import AssistantConfig, TargetConfig
from jaxspec.model.assistant import fused_supported, propose, propose_fused
from jaxspec.model.gemma4 import layer_ops
from jaxspec.paged_kv.cache import PagedKVCache, draft_attend, draft_attend_rows
from jaxspec.paged_kv.metadata import CacheSpec, PageTables, draft_metadata
from jaxspec import staging

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# The fused drafter kernels (`propose_fused`: a few weight-streaming kernels a step instead of XLA's ~70) win at the
# smallest buckets and lose from bs 8 up. On the H200 (BENCHMARKS.md session 22; E4B's drafter, k 3, 4K, inputs on
# the device; fused against the jnp step, pairs of runs in opposite order): bs 1 494 / 622 against 600 / 656 µs
# (kernel time 328 µs in 110 launches against 391 µs in 209), bs 2 754 / 732 against 870 / 827 µs; bs 4 level
# (976 / 1029 / 1001 against 1003 / 993 / 993 µs); bs 8 1319 / 1300 against 1008 / 1132 µs, bs 16 2313 against
# 1370 µs and bs 64 5423 against 3092 µs (likely their products: broadcast and sum, no tensor-core tiles, so their
# work grows with the rows). So by default (fused=None) the buckets up to this size draft through them, larger ones
# through the jnp step.
FUSED_MAX_BUCKET = 2


def use_fused(fused: bool | None, bucket: int) -> bool:
    """Whether a bucket drafts through the fused kernels: fused True (every bucket), False (none), None (the default:
    buckets up to FUSED_MAX_BUCKET). Only with kernels, on one device, where the drafter's shapes allow."""
    return bucket <= FUSED_MAX_BUCKET if fused is None else bool(fused)

# XLA may keep bf16 intermediates in fp32 inside a fusion ("excess precision"); the eager reference runs op by op and
# rounds every op's output to bf16. On the H200 that difference alone moved bf16 drafts beyond the seed's rule
# (tests/test_drafter.py::test_bf16_drafts_follow_the_seed_rule); without it the two paths gave identical bf16 drafts.
# So programs that draft round where the model function says to round, exactly like the reference.
DRAFT_COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def draft(aparams, target_embed, kv, pages: PageTables, cached_len, pending_token, seed_hidden, *,
          acfg: AssistantConfig, target: TargetConfig, spec: CacheSpec, k: int, use_kernels: bool,
          fused: bool | None = None, mesh=None):
    """k draft steps for a batch. cached_len, pending_token: i32[B]; seed_hidden: [B, H_target]. With kernels, the
    step is the jnp step with the attention kernel or, as `use_fused(fused, B)` says (by default for buckets up to
    FUSED_MAX_BUCKET) and where the drafter's shapes allow, the fused kernels' step (`propose_fused`).

    Returns (drafts i32[B, k], the last h_next [B, H_target]).
    """
    types = acfg.text.layer_types
    meta = draft_metadata(spec, pages, cached_len, acfg.text.sliding_window, types, use_kernels=use_kernels, mesh=mesh)
    if use_kernels and use_fused(fused, pending_token.shape[0]) and fused_supported(acfg) and mesh is None:
        attend = draft_attend_rows(target, acfg.text, meta)
        return propose_fused(aparams, acfg, target_embed, pending_token, seed_hidden, cached_len,
                             lambda i, q, rope: attend(kv, i, q, rope), k=k)
    attend = draft_attend(target, types, meta, use_kernels=use_kernels, mesh=mesh)
    return propose(aparams, acfg, target_embed, pending_token, seed_hidden, cached_len, attend, kv, k=k,
                   ops=layer_ops(use_kernels, mesh))


def chunks(n: int, buckets: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Row ranges [lo, hi) and their bucket: n rows in chunks of at most the largest bucket, each padded up to the
    smallest bucket that holds it."""
    out, lo = [], 0
    while lo < n:
        hi = min(n, lo + buckets[-1])
        out.append((lo, hi, next(b for b in buckets if b >= hi - lo)))
        lo = hi
    return out


class BucketedDrafter:
    """propose_bucket(...) -> device (drafts int32[bucket, k], last h_next [bucket, H_target]).

    donate_outputs: each bucket writes its outputs into the buffers its previous call returned (donated), so that
    on a GPU no output of the command buffer is a fresh allocation. XLA's buffer assignment may place temporaries in
    an output's allocation; a fresh output then moves them every call and XLA re-records every graph node that
    touches them before launching (BENCHMARKS.md session 10: 140 of the bs-1 propose's 207, ~300 µs of host time a
    call). With it, what `propose_bucket` returned is valid only until that bucket's next call (the engine's round
    programs donate their state the same way).

    stage_inputs: the per-call inputs (page table, cached lengths, pending tokens, seed rows) travel as one int32
    array (packed on the host: one host -> device copy a call instead of four) that the program copies into one buffer
    of its own before anything reads them, and the outputs' buffers are made at the program's start (`jaxspec.staging`),
    so that fresh inputs each call move one graph node instead of most of them, and a moved output only the kernels
    writing it; None: `$JAXSPEC_STAGE_INPUTS` (on unless 0).

    pinned_inputs (with stage_inputs, without donate_outputs, one device with a pinned host memory): the packed input
    is written by the host into a persistent pinned host array (`staging.PinnedRing`, two a bucket) that the program
    copies to the device itself, instead of a PJRT transfer a call (device inputs: copied to pinned host memory
    first). None: `staging.pinned_enabled()` (on a GPU unless JAXSPEC_PINNED_INPUTS=0)."""

    def __init__(self, aparams, acfg: AssistantConfig, target_embed, cfg: TargetConfig, k: int, *,
                 buckets=DEFAULT_BUCKETS, seed_slots: int | None = None, use_kernels: bool = True,
                 fused: bool | None = None, compiler_options: dict | None = None, donate_outputs: bool = False,
                 stage_inputs: bool | None = None, pinned_inputs: bool | None = None):
        buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"draft buckets must be positive batch sizes, got {buckets}")
        self.aparams, self.acfg, self.target_embed, self.cfg, self.k = aparams, acfg, target_embed, cfg, k
        self.buckets = buckets
        self.seed_slots = seed_slots or buckets[-1] + 1
        self.use_kernels, self.fused, self.donate_outputs = use_kernels, fused, donate_outputs
        self.stage_inputs = staging.enabled() if stage_inputs is None else stage_inputs
        pinned = staging.pinned_enabled() if pinned_inputs is None else pinned_inputs
        # as asked; `attach` keeps it only for a cache on one device with a pinned host memory
        self.pinned_asked = self.pinned_inputs = bool(pinned) and self.stage_inputs and not donate_outputs
        self.rings: dict[int, staging.PinnedRing] = {}  # with pinned_inputs: each bucket's pinned input arrays
        self.device = None  # the one device of the cache, where pinned_inputs applies
        self.outputs: dict[int, tuple] = {}  # with donate_outputs: each bucket's last outputs, donated to its next call
        # e.g. {"xla_gpu_enable_command_buffer": ""} to measure what the graphs buy; on top of DRAFT_COMPILER_OPTIONS
        self.compiler_options = {**DRAFT_COMPILER_OPTIONS, **(compiler_options or {})}
        self.cache: PagedKVCache | None = None
        self.executables: dict[int, object] = {}
        self.compiles = 0  # how many times the buckets were (re)built

    def attach(self, cache: PagedKVCache) -> None:
        self.cache = cache
        devices = {d for leaf in jax.tree.leaves(cache.kv) for d in leaf.devices()}
        self.device = devices.pop() if len(devices) == 1 else None
        self.pinned_inputs = self.pinned_asked and self.device is not None and staging.pinned_supported(self.device)
        self.compile()

    def _program(self, aparams, target_embed, kv, pages: PageTables, cached_len, pending_token, seed_table, slot,
                 drafts_out=None, h_out=None):
        # drafts_out, h_out: with donate_outputs, the last call's outputs, donated (their values unused): jax aliases
        # each to the output of its shape, so the outputs keep their addresses from call to call
        words = None
        if self.stage_inputs:  # outputs pinned too, unless they are the donated buffers (stable already)
            B = cached_len.shape[0]
            outs = None if drafts_out is not None else (
                jax.ShapeDtypeStruct((B, self.k), jnp.int32),
                jax.ShapeDtypeStruct((B, self.acfg.backbone_hidden_size), target_embed.dtype))
            (cached_len, pending_token, slot), pages, words = staging.stage_step(
                (cached_len, pending_token, slot), pages, outputs=outs)
        out = draft(aparams, target_embed, kv, pages, cached_len, pending_token, seed_table[slot], acfg=self.acfg,
                    target=self.cfg, spec=self.cache.spec, k=self.k, use_kernels=self.use_kernels, fused=self.fused)
        return staging.hold(out, words)

    def _packed_program(self, aparams, target_embed, kv, swa_of_full, packed, seed_table, drafts_out=None,
                        h_out=None):
        """_program with its per-call inputs in one int32 array: the page table's rows, cached_len, pending_token,
        slot (`pack`)."""
        P = self.cache.spec.max_pages_per_request
        B = packed.shape[0] // (P + 3)
        table, cached_len, pending_token, slot = (packed[:B * P].reshape(B, P), packed[B * P:B * P + B],
                                                  packed[B * P + B:B * P + 2 * B], packed[B * P + 2 * B:])
        pages = PageTables(page_table=table, swa_of_full=swa_of_full)
        return self._program(aparams, target_embed, kv, pages, cached_len, pending_token, seed_table, slot,
                             drafts_out, h_out)

    def _pinned_program(self, aparams, target_embed, kv, swa_of_full, packed, seed_table):
        """_packed_program with `packed` in pinned host memory, copied to the device first."""
        return self._packed_program(aparams, target_embed, kv, swa_of_full, staging.to_device(packed, self.device),
                                    seed_table)

    @staticmethod
    def pack(page_table, cached_len, pending_token, slot):
        """The packed program's one input: on the host for host arrays (one transfer), else on the device."""
        parts = (page_table, cached_len, pending_token, slot)
        if any(isinstance(a, jax.Array) for a in parts):
            return jnp.concatenate([jnp.asarray(a, jnp.int32).reshape(-1) for a in parts])
        return np.concatenate([np.asarray(a, np.int32).reshape(-1) for a in parts])

    def compile(self) -> None:
        """Compile every bucket against the cache's current shapes (ahead of time, off the serving path)."""
        cache, i32 = self.cache, jnp.int32
        seed_table = jax.ShapeDtypeStruct((self.seed_slots, self.acfg.backbone_hidden_size), self.target_embed.dtype)
        self.executables, self.outputs, self.rings = {}, {}, {}
        for b in self.buckets:
            vec = jax.ShapeDtypeStruct((b,), i32)
            pages = PageTables(page_table=jax.ShapeDtypeStruct((b, cache.spec.max_pages_per_request), i32),
                               swa_of_full=cache.swa_of_full)
            outs = (jax.ShapeDtypeStruct((b, self.k), i32),
                    jax.ShapeDtypeStruct((b, self.acfg.backbone_hidden_size), self.target_embed.dtype))
            previous = outs if self.donate_outputs else ()
            packed_shape = (b * (cache.spec.max_pages_per_request + 3),)  # `pack`'s one int32 vector
            if self.pinned_inputs:  # (the bucket's PinnedRing is made at its first call)
                packed = jax.ShapeDtypeStruct(packed_shape, i32, sharding=staging.pinned_sharding(self.device))
                fn, args = self._pinned_program, (cache.kv, cache.swa_of_full, packed, seed_table)
            elif self.stage_inputs:
                packed = jax.ShapeDtypeStruct(packed_shape, i32)
                fn, args = self._packed_program, (cache.kv, cache.swa_of_full, packed, seed_table)
            else:
                fn, args = self._program, (cache.kv, pages, vec, vec, seed_table, vec)
            self.executables[b] = compile_ahead(fn, self.aparams, self.target_embed, *args, *previous,
                                                compiler_options=self.compiler_options,
                                                donate_argnames=("drafts_out", "h_out") if previous else (),
                                                keep_unused=bool(previous),
                                                precision=matmul_precision(self.target_embed.dtype))
            if previous:
                self.outputs[b] = tuple(jnp.zeros(o.shape, o.dtype) for o in outs)
        self.compiles += 1

    def propose_bucket(self, bucket: int, page_table, cached_len, pending_token, seed_table, slot):
        """Inputs already padded to `bucket` rows (host numpy; seed_table [slots, H_target] on the device, `slot` the
        row of each request in it). No tracing happens here (but in `pack` for device inputs of a staged drafter)."""
        if self.pinned_inputs:
            packed = self.pack(page_table, cached_len, pending_token, slot)
            if bucket not in self.rings:
                self.rings[bucket] = staging.PinnedRing(packed.shape, np.int32, self.device)
            ring = self.rings[bucket]
            on_host = not isinstance(packed, jax.Array)
            # device inputs: one copy to pinned host memory in the device's stream order (no host sync)
            packed = ring.write(packed) if on_host else jax.device_put(packed, ring.sharding)
            with jax.no_tracing(True):
                out = self.executables[bucket](self.aparams, self.target_embed, self.cache.kv,
                                               self.cache.swa_of_full, packed, seed_table)
            if on_host:
                ring.used_by(out)
            return out
        if self.stage_inputs:
            packed = self.pack(page_table, cached_len, pending_token, slot)
            with jax.no_tracing(True):
                out = self.executables[bucket](self.aparams, self.target_embed, self.cache.kv,
                                               self.cache.swa_of_full, packed, seed_table,
                                               *self.outputs.get(bucket, ()))
            if self.donate_outputs:
                self.outputs[bucket] = out
            return out
        with jax.no_tracing(True):
            pages = PageTables(page_table=page_table, swa_of_full=self.cache.swa_of_full)
            out = self.executables[bucket](self.aparams, self.target_embed, self.cache.kv, pages, cached_len,
                                           pending_token, seed_table, slot, *self.outputs.get(bucket, ()))
            if self.donate_outputs:
                self.outputs[bucket] = out
            return out

    def propose(self, page_table, cached_len, pending_token, seed_table, slot):
        """Any batch size: pad to buckets (chunked above the largest), return numpy (drafts [B, k], h_next [B, Ht])."""
        page_table = np.asarray(page_table, np.int32)
        rows = lambda a, lo, hi, pad: np.pad(np.asarray(a, np.int32)[lo:hi], (0, pad))  # noqa: E731
        drafts, hs = [], []
        for lo, hi, b in chunks(page_table.shape[0], self.buckets):
            pad = b - (hi - lo)
            d, h = self.propose_bucket(b, np.pad(page_table[lo:hi], ((0, pad), (0, 0))), rows(cached_len, lo, hi, pad),
                                       rows(pending_token, lo, hi, pad), seed_table, rows(slot, lo, hi, pad))
            drafts.append(np.asarray(d)[: hi - lo])
            hs.append(np.asarray(h)[: hi - lo])
        return np.concatenate(drafts), np.concatenate(hs)

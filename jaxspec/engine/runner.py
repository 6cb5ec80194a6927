"""The runner: owns the device side of the engine (weights, K/V, the decode state) and the compiled programs, one
per (program, batch bucket, greedy/sampled), all compiled ahead of time through `jaxspec.aot`.

Host -> device traffic per decode call is the slot list and the page tables, and each is uploaded again only when it
changed (a request's allocation grows by a page every page_size positions); the round state never leaves the device.
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.aot import compile_all, lower_ahead, matmul_precision
from jaxspec.cache import compile_cache_hits
from jaxspec.draft.bucketed import DRAFT_COMPILER_OPTIONS
from jaxspec.engine.config import EngineConfig
from jaxspec.engine.programs import DecodeState, PrefillBatch, Programs, Weights
from jaxspec.engine.request import Request
from jaxspec.paged_kv.cache import PagedKVCache
from jaxspec.paged_kv.metadata import PageTables
from jaxspec.sampling import SamplingMetadata

UPLOAD_CACHE = 16  # device page tables kept for reuse (one per recent batch composition)


def fetch(x: jax.Array) -> np.ndarray:
    """An explicit device -> host transfer (the only kind the engine makes)."""
    with jax.transfer_guard_device_to_host("allow"):
        return jax.device_get(x)


class _CompileProgress:
    """`compiling N programs (...)...`, a bar on stderr, then how long it took and what came from the compile cache."""

    def __init__(self, total: int, what: str):
        from tqdm import tqdm

        print(f"compiling {total} programs ({what})...", file=sys.stderr, flush=True)
        self.bar = tqdm(total=total, desc="compiling", unit="program", file=sys.stderr)
        self.total, self.cached, self.start = total, 0, time.perf_counter()

    def update(self) -> None:
        self.bar.update(1)

    def close(self, cached: int) -> None:
        self.bar.close()
        self.cached = min(cached, self.total)
        seconds = time.perf_counter() - self.start
        if self.cached == self.total:
            line = f"loaded {self.total} programs from the compile cache in {seconds:.1f} s"
        else:
            line = f"compiled {self.total} programs in {seconds:.1f} s" + (
                f" ({self.cached} loaded from the compile cache)" if self.cached else "")
        print(line, file=sys.stderr, flush=True)


class Runner:
    def __init__(self, config: EngineConfig, programs: Programs, weights: Weights, cache: PagedKVCache):
        self.config, self.programs, self.weights, self.cache = config, programs, weights, cache
        cfg = programs.cfg
        self.state = DecodeState.empty(config.max_running + 1, cfg.hidden_size, weights.target["embed"].dtype)
        if cache.mesh is not None:
            self.state = jax.device_put(self.state, cache.upload_sharding)
        self.executables: dict[tuple, object] = {}
        self.compiled_variants: set[bool] = set()
        self._uploads: dict[tuple, tuple[np.ndarray, jax.Array]] = {}
        self._primed: set[tuple] = set()  # programs run once (`prime`)

    @property
    def programs_compiled(self) -> int:
        return len(self.executables)

    # ---- compiling -------------------------------------------------------------------------------------------------

    def compile(self, sample: bool, progress: bool = False) -> None:
        """Compile prefill and decode programs for every bucket (greedy, or the sampled variants). progress: say on
        stderr what is compiled, with a progress bar, and how many programs the persistent compile cache held."""
        if sample in self.compiled_variants:
            return
        c, spec, i32 = self.config, self.cache.spec, jnp.int32
        programs = {}
        for b in c.buckets:
            vec = lambda dt=i32: jax.ShapeDtypeStruct((b,), dt)  # noqa: E731
            pages = PageTables(page_table=jax.ShapeDtypeStruct((b, spec.max_pages_per_request), i32),
                               swa_of_full=self.cache.swa_of_full)
            smeta = SamplingMetadata(temperature=vec(jnp.float32), top_k=vec(), top_p=vec(jnp.float32), seed=vec())
            batch = PrefillBatch(tokens=jax.ShapeDtypeStruct((b, c.prefill_chunk), i32), cached_len=vec(),
                                 num_new=vec(), slot=vec(), last=vec(jnp.bool_), pending_token=vec(),
                                 num_generated=vec(), max_new_tokens=vec(), ignore_eos=vec(jnp.bool_), sampling=smeta)
            programs[("prefill", b, sample)] = (self.programs.prefill(sample),
                                                (self.weights, self.cache.kv, self.state, batch, pages))
            drafts = (jax.ShapeDtypeStruct((b, c.k), i32),) if c.draft_mode == "eager" else ()
            programs[("decode", b, sample)] = (self.programs.decode_rounds(c.rounds_per_call, sample),
                                               (self.weights, self.cache.kv, self.state, vec(), pages, *drafts))
        buckets = f"{len(c.buckets)} bucket" + "s" * (len(c.buckets) > 1)
        bar = _CompileProgress(len(programs), f"prefill {buckets}, decode {buckets}, "
                                              f"{'sampled' if sample else 'greedy'}") if progress else None
        precision = matmul_precision(self.weights.target["embed"].dtype)
        hits = compile_cache_hits()
        split = {}
        if self.cache.mesh is not None:  # the donated K/V and state come back sharded as they went in
            rep = self.cache.upload_sharding
            split = {"in_sharding": rep, "out_shardings": (jax.tree.map(lambda a: a.sharding, self.cache.kv),
                                                            jax.tree.map(lambda a: a.sharding, self.state), rep)}
        lowerings = {key: functools.partial(lower_ahead, fn, *args, donate_argnames=("kv", "state"),
                                            compiler_options=DRAFT_COMPILER_OPTIONS,  # rounding where the model says
                                            precision=precision, **split)
                     for key, (fn, args) in programs.items()}
        self.executables.update(compile_all(lowerings, on_done=bar and (lambda key: bar.update())))
        if bar:
            bar.close(cached=compile_cache_hits() - hits)
        self.compiled_variants.add(sample)

    def prime(self) -> None:
        """Run every compiled program once, on padding rows only, and wait for it, so that a program's one-time costs
        on its first execution (on a GPU, loading its kernels) fall before serving, not on the first request of each
        bucket, as vLLM's warm-up runs do. (Session 9 measured no gain from it: the server's stalls, the same with it
        and without, came from the K/V scatter, fixed since; it was not measured again alone.) Padding rows write
        nothing a real row reads (their K/V writes are dropped, their decode-state row is slot 0): tested bit for
        bit in the middle of serving."""
        for key in list(self.executables):
            if key in self._primed:
                continue
            kind, bucket, sample = key
            if kind == "prefill":
                self.prefill([], bucket, sample)
            else:
                drafts = jax.device_put(np.zeros((bucket, self.config.k), np.int32), self.cache.upload_sharding) \
                    if self.config.draft_mode == "eager" else None
                fetch(self.decode([], bucket, drafts, sample))
            self._primed.add(key)

    def rebuild(self) -> None:
        """After the cache's rebuild (new shapes): forget the old programs and compile the same variants again."""
        variants, primed = set(self.compiled_variants), bool(self._primed)
        self.executables, self.compiled_variants, self._uploads, self._primed = {}, set(), {}, set()
        for sample in sorted(variants):
            self.compile(sample)
        if primed:
            self.prime()

    # ---- calling ---------------------------------------------------------------------------------------------------

    def inputs(self, requests: list[Request | None]) -> tuple[jax.Array, PageTables]:
        """The batch's slots and page tables on the device, uploaded again only when they changed."""
        key = tuple(id(r) for r in requests)
        slot = np.asarray([r.slot if r else 0 for r in requests], np.int32)
        table = self.cache.pool.page_table(requests)
        hit = self._uploads.get(key)
        if hit is None or not (np.array_equal(hit[0], table) and np.array_equal(hit[1], slot)):
            if len(self._uploads) >= UPLOAD_CACHE:
                self._uploads.pop(next(iter(self._uploads)))
            hit = self._uploads[key] = (table, slot, *jax.device_put((slot, table), self.cache.upload_sharding))
        return hit[2], PageTables(page_table=hit[3], swa_of_full=self.cache.swa_of_full)

    def prefill(self, rows: list[tuple[Request, int, int]], bucket: int, sample: bool | None = None) -> np.ndarray:
        """Run one chunk (positions [start, end) of each request); returns the chosen token per row (host). sample:
        the program variant (default: sampled if any row samples)."""
        c, B = self.config, bucket
        tokens = np.zeros((B, c.prefill_chunk), np.int32)
        cols = {name: np.zeros(B, np.int32) for name in
                ("cached_len", "num_new", "slot", "pending_token", "num_generated", "max_new_tokens")}
        last, ignore_eos = np.zeros(B, bool), np.zeros(B, bool)
        for b, (r, s, e) in enumerate(rows):
            tokens[b, : e - s] = r.tokens[s:e]
            recomputed = bool(r.output_ids)
            for name, value in (("cached_len", s), ("num_new", e - s), ("slot", r.slot),
                                ("pending_token", r.tokens[-1] if recomputed else -1),
                                ("num_generated", len(r.output_ids) if recomputed else 1),
                                ("max_new_tokens", r.params.max_new_tokens)):
                cols[name][b] = value
            last[b], ignore_eos[b] = e == r.prefill_end, r.params.ignore_eos
        requests = [r for r, _, _ in rows]
        batch = jax.device_put(PrefillBatch(tokens=tokens, last=last, ignore_eos=ignore_eos,
                                            sampling=SamplingMetadata.build([r.params for r in requests], B), **cols),
                               self.cache.upload_sharding)
        if sample is None:
            sample = any(r.params.temperature > 0 for r in requests)
        _, pages = self.inputs(requests + [None] * (B - len(rows)))
        self.cache.kv, self.state, token = self.executables[("prefill", B, sample)](
            self.weights, self.cache.kv, self.state, batch, pages)
        return fetch(token)  # the chunk's one device -> host transfer: each row's chosen token

    @staticmethod
    def read(out: jax.Array) -> np.ndarray:
        """The one device -> host transfer of a decode call: its committed tokens and counts (blocks until ready).
        Every other transfer in a step is an explicit upload of changed inputs or a prefill's tokens (tests run
        steps under `jax.transfer_guard("disallow")`)."""
        return fetch(out)

    def decode(self, requests: list[Request], bucket: int, drafts=None, sample: bool | None = None) -> jax.Array:
        """Launch one decode call (rounds_per_call rounds); returns its output on the device, not waited for:
        i32[bucket, R, k + 2], per round the committed tokens and (last) their count. sample: as `prefill`'s."""
        slot, pages = self.inputs(requests + [None] * (bucket - len(requests)))
        if sample is None:
            sample = any(r.params.temperature > 0 for r in requests)
        extra = () if drafts is None else (drafts,)
        self.cache.kv, self.state, out = self.executables[("decode", bucket, sample)](
            self.weights, self.cache.kv, self.state, slot, pages, *extra)
        return out

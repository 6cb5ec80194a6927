"""The speculative decoding engine: a request queue, continuous batching, chunked prefill, and rounds of
propose (k drafts) -> verify (k+1 positions over the paged cache) -> accept (DESIGN.md §3).

Per round and batch chunk the host does one device->host transfer (the committed tokens and accept counts); the
draft ids stay on the device between propose and verify, and the seed hiddens live in a device table indexed by
request slot. Every device step is compiled ahead of time per batch bucket and runs under `jax.no_tracing`.
When the page pool runs out, the most recently admitted request is preempted (its pages freed) and later
recomputed from its committed tokens: requests wait, they are never dropped or truncated.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sampling
from jaxspec.config import AssistantConfig, ConfigError, TargetConfig, check_pair
from jaxspec.draft.bucketed import DEFAULT_BUCKETS, BucketedDrafter
from jaxspec.draft.eager import EagerDrafter
from jaxspec.model import gemma4
from jaxspec.paged_kv.cache import PagedKVCache
from jaxspec.paged_kv.pool import swa_pages_bound_for

DRAFT_MODES = ("bucketed", "eager", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclasses.dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams = SamplingParams()
    index: int = 0  # input order
    tokens: list[int] = dataclasses.field(default_factory=list)  # committed: prompt + generated
    output_ids: list[int] = dataclasses.field(default_factory=list)
    accept_lengths: list[int] = dataclasses.field(default_factory=list)  # tokens committed per decode round
    cached_len: int = 0  # positions whose K/V the target wrote and kept
    slot: int = 0  # row of the seed-hidden table (0: none)
    finish_reason: str | None = None
    text: str | None = None
    t_first: float | None = None
    t_done: float | None = None
    preemptions: int = 0

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def prefill_end(self) -> int:
        """Positions the target must have processed before decode rounds: the whole prompt for a new request; all
        but the pending (last committed) token for a recomputed one."""
        return len(self.tokens) - (1 if self.output_ids else 0)

    @property
    def decoding(self) -> bool:
        return self.cached_len == self.prefill_end and bool(self.output_ids)


@dataclasses.dataclass
class Stats:
    rounds: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    verify_dispatch_s: float = 0.0  # part of verify_s: host time until the verify call returns (launch, no wait)
    host_s: float = 0.0
    prefill_s: float = 0.0


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class Engine:
    def __init__(self, cfg: TargetConfig, params, *, acfg: AssistantConfig | None = None, aparams=None,
                 k: int = 3, draft_mode: str = "bucketed", buckets=DEFAULT_BUCKETS, max_running: int = 16,
                 page_size: int = 16, num_pages: int | None = None, num_swa_pages: int | None = None,
                 max_context: int | None = None, prefill_chunk: int = 256, use_kernels: bool | None = None,
                 tokenizer=None, eos_token_ids=None):
        if draft_mode not in DRAFT_MODES:
            raise ConfigError(f"unknown draft mode {draft_mode!r} (expected one of {', '.join(DRAFT_MODES)})")
        if draft_mode != "off" and acfg is None:
            raise ConfigError(f"--draft-mode {draft_mode} needs an assistant (--assistant DIR)")
        if draft_mode != "off":
            check_pair(cfg, acfg)
            if acfg.text.sliding_window > cfg.sliding_window:
                raise ConfigError(f"assistant sliding_window {acfg.text.sliding_window} exceeds the target's "
                                  f"{cfg.sliding_window}: the SWA pool keeps only the target's window")
        if k < 1 and draft_mode != "off":
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {k}")
        buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not buckets or buckets[0] < 1:
            raise ConfigError(f"batch buckets must be positive integers, got {buckets}")
        # buckets above the first one that holds every running request would never be used: skip their compiles
        buckets = tuple(b for b in buckets if b < max_running) + tuple(b for b in buckets if b >= max_running)[:1]
        if max_running < 1:
            raise ConfigError(f"max_running_requests must be >= 1, got {max_running}")
        self.cfg, self.params = cfg, params
        self.k = k if draft_mode != "off" else 0
        self.draft_mode = draft_mode
        self.buckets = buckets
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.tokenizer = tokenizer
        self.eos = set(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.use_kernels = jax.default_backend() != "cpu" if use_kernels is None else use_kernels
        dtype = params["embed"].dtype
        max_context = max_context or min(cfg.max_position_embeddings, 4096)
        pages_per_request = -(-max_context // page_size)
        num_pages = num_pages or max_running * pages_per_request + 1
        step_tokens = max(prefill_chunk, self.k + 1)
        swa_bound = swa_pages_bound_for(page_size=page_size, swa_keep=cfg.sliding_window + 1,
                                        max_step_tokens=step_tokens)
        num_swa_pages = num_swa_pages or max_running * swa_bound + 1
        if num_pages - 1 < pages_per_request:
            raise ConfigError(f"--kv-pages {num_pages} cannot hold one request of {max_context} positions "
                              f"({pages_per_request} pages of {page_size} + the dummy page)")
        try:
            self.cache = PagedKVCache(cfg, page_size=page_size, num_full_pages=num_pages, num_swa_pages=num_swa_pages,
                                      max_context=max_context, max_step_tokens=step_tokens, dtype=dtype)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.max_context = self.cache.spec.max_context
        self.seed_table = jnp.zeros((max_running + 1, cfg.hidden_size), dtype)
        self.drafter = None
        if draft_mode == "bucketed":
            self.drafter = BucketedDrafter(aparams, acfg, params["embed"], cfg, self.k, buckets=buckets,
                                           seed_slots=max_running + 1, use_kernels=self.use_kernels)
        elif draft_mode == "eager":
            self.drafter = EagerDrafter(aparams, acfg, params["embed"], cfg, self.k)
        self._verify, self._prefill = {}, {}
        self._sampling_compiled = set()
        if self.drafter is not None:
            self.drafter.attach(self.cache)
        self.stats = Stats()

    # ---- compiled steps ------------------------------------------------------------------------------------------

    def _verify_program(self, sample: bool):
        cfg, spec, k, use_kernels = self.cfg, self.cache.spec, self.k, self.use_kernels

        def verify_step(params, arrays, swa_of_full, page_table, pending, drafts, start, active, seed_table, rows,
                        temperature, top_k, top_p, seeds):
            tokens = jnp.concatenate([pending[:, None], drafts], axis=1)  # [B, k+1]
            num = jnp.where(active, k + 1, 0)
            hidden, arrays = gemma4.paged_forward(params, cfg, spec, arrays, page_table, swa_of_full, tokens, start,
                                                  num, use_kernels=use_kernels)
            logits = gemma4.logits(params, cfg, hidden)  # [B, k+1, V]
            if sample:
                keys = sampling.row_keys(seeds, start, salt=1)
                n, committed = sampling.accept(logits, drafts, temperature, top_k, top_p, keys)
            else:
                n, committed = sampling.accept_greedy(logits, drafts)
            seed = jnp.take_along_axis(hidden, n[:, None, None], axis=1)[:, 0]  # target hidden of row n
            seed_table = seed_table.at[jnp.where(active, rows, 0)].set(seed)
            return jnp.concatenate([committed, n[:, None]], axis=1), arrays, seed_table

        return verify_step

    def _prefill_program(self, sample: bool):
        cfg, spec, use_kernels = self.cfg, self.cache.spec, self.use_kernels

        def prefill_step(params, arrays, swa_of_full, page_table, tokens, start, num, last, seed_table, rows,
                         temperature, top_k, top_p, seeds):
            hidden, arrays = gemma4.paged_forward(params, cfg, spec, arrays, page_table, swa_of_full, tokens, start,
                                                  num, use_kernels=use_kernels)
            h_last = jnp.take_along_axis(hidden, jnp.maximum(num - 1, 0)[:, None, None], axis=1)[:, 0]  # [B, H]
            logits = gemma4.logits(params, cfg, h_last)
            if sample:
                token = sampling.choose(logits, temperature, top_k, top_p,
                                        sampling.row_keys(seeds, start + num, salt=0))
            else:
                token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            seed_table = seed_table.at[jnp.where(last, rows, 0)].set(h_last)
            return token, arrays, seed_table

        return prefill_step

    def _compile(self, kind: str, bucket: int, sample: bool):
        """AOT-compile one step for one batch bucket (never on the serving path: `warmup` calls this)."""
        spec, i32, f32 = self.cache.spec, jnp.int32, jnp.float32
        statics = (jax.tree.map(_abstract, self.params), jax.tree.map(_abstract, self.cache.arrays),
                   _abstract(self.cache.swa_of_full), jax.ShapeDtypeStruct((bucket, spec.max_pages_per_request), i32))
        vec = lambda dt=i32: jax.ShapeDtypeStruct((bucket,), dt)  # noqa: E731
        sampling_args = (vec(f32), vec(), vec(f32), vec())
        if kind == "verify":
            fn = jax.jit(self._verify_program(sample), donate_argnums=(1, 8))
            args = (vec(), jax.ShapeDtypeStruct((bucket, self.k), i32), vec(), vec(jnp.bool_),
                    _abstract(self.seed_table), vec(), *sampling_args)
        else:
            fn = jax.jit(self._prefill_program(sample), donate_argnums=(1, 8))
            args = (jax.ShapeDtypeStruct((bucket, self.prefill_chunk), i32), vec(), vec(), vec(jnp.bool_),
                    _abstract(self.seed_table), vec(), *sampling_args)
        return fn.lower(*statics, *args).compile()

    def warmup(self, sample: bool = False) -> None:
        """Compile every step for every bucket (greedy, and the sampling variants when `sample`)."""
        variants = [False] + ([True] if sample else [])
        for s in variants:
            if s in self._sampling_compiled:
                continue
            for b in self.buckets:
                self._verify[(b, s)] = self._compile("verify", b, s)
                self._prefill[(b, s)] = self._compile("prefill", b, s)
            self._sampling_compiled.add(s)

    def rebuild(self, **sizes) -> None:
        """Re-create the cache with new sizes (no request may be running); the drafter re-compiles its buckets."""
        self.cache.rebuild(**sizes)
        self.max_context = self.cache.spec.max_context
        compiled = set(self._sampling_compiled)
        self._sampling_compiled.clear()
        self._verify, self._prefill = {}, {}
        for s in compiled:
            self.warmup(s)

    # ---- serving ---------------------------------------------------------------------------------------------------

    def validate(self, req: Request) -> None:
        if not req.prompt_ids:
            raise ConfigError(f"request {req.index}: empty prompt")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ConfigError(f"request {req.index}: token id {bad[0]} outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        if len(req.prompt_ids) + self.k + 2 > self.max_context:
            raise ConfigError(f"request {req.index}: prompt of {len(req.prompt_ids)} tokens does not fit the context "
                              f"of {self.max_context} (with {self.k + 1} verify positions and one new token)")
        if req.params.max_new_tokens < 1:
            raise ConfigError(f"request {req.index}: max_new_tokens must be >= 1")

    def generate(self, requests: list[Request], on_progress: Callable[[int], None] | None = None,
                 profile_dir: str | None = None) -> list[Request]:
        """Run all requests to completion; returns them in input order (their fields filled in)."""
        for i, r in enumerate(requests):
            r.index = i
            self.validate(r)
        self.warmup(sample=any(r.params.temperature > 0 for r in requests))
        self.stats = Stats()
        waiting, running = deque(requests), []
        free_slots = list(range(self.max_running, 0, -1))
        self.t_start = time.perf_counter()
        tracing = False
        # Eager drafting runs op by op (it traces small ops by design); every other path must not trace here.
        with jax.no_tracing(self.draft_mode != "eager"):
            while waiting or running:
                while waiting and len(running) < self.max_running:
                    r = waiting.popleft()
                    self.cache.pool.add(r)
                    r.slot = free_slots.pop()
                    running.append(r)
                if profile_dir and not tracing and any(r.decoding for r in running):
                    jax.profiler.start_trace(profile_dir)
                    tracing = True
                self._prefill_step([r for r in running if not r.decoding], running, waiting, free_slots)
                done = self._decode_round([r for r in running if r.decoding and not r.finish_reason], running,
                                          waiting, free_slots)
                for r in done:
                    self._release(r, running, free_slots)
                    if on_progress:
                        on_progress(1)
        if tracing:
            jax.profiler.stop_trace()
        return requests

    def _release(self, r, running, free_slots) -> None:
        """Take r off the running list and give back its pages and its seed-table slot."""
        running.remove(r)
        self.cache.pool.free(r)
        free_slots.append(r.slot)

    def _preempt(self, running, waiting, free_slots, keep) -> bool:
        """Free the most recently admitted running request other than `keep`; it will be recomputed."""
        victims = [r for r in running if r is not keep]
        if not victims:
            return False
        v = victims[-1]
        self._release(v, running, free_slots)
        v.slot, v.cached_len = 0, 0
        v.preemptions += 1
        waiting.appendleft(v)
        return True

    def _prepare(self, r, start, end, running, waiting, free_slots) -> bool:
        while not self.cache.pool.prepare(r, start, end):
            if not self._preempt(running, waiting, free_slots, keep=r):
                raise RuntimeError("the page pool cannot hold a single request; the engine's size check failed")
        return r in running

    def _batches(self, rows):
        """Split rows into chunks of at most the largest bucket, each padded to its bucket."""
        out, lo = [], 0
        while lo < len(rows):
            chunk = rows[lo: lo + self.buckets[-1]]
            out.append((chunk, next(b for b in self.buckets if b >= len(chunk))))
            lo += len(chunk)
        return out

    def _sampling_arrays(self, rows, bucket):
        pad = bucket - len(rows)
        p = [r.params for r in rows]
        arr = lambda xs, dt: np.pad(np.asarray(xs, dt), (0, pad))  # noqa: E731
        return (arr([x.temperature for x in p], np.float32), arr([x.top_k for x in p], np.int32),
                arr([x.top_p for x in p], np.float32), arr([x.seed for x in p], np.int32))

    def _prefill_step(self, rows, running, waiting, free_slots) -> None:
        if not rows:
            return
        t0 = time.perf_counter()
        plan = []
        for r in rows:
            s = r.cached_len
            e = min(r.prefill_end, s + self.prefill_chunk)
            if r in running and self._prepare(r, s, e, running, waiting, free_slots):
                plan.append((r, s, e))
        plan = [(r, s, e) for r, s, e in plan if r in running]  # a later prepare may have preempted an earlier row
        for chunk, bucket in self._batches(plan):
            B, T = bucket, self.prefill_chunk
            tokens = np.zeros((B, T), np.int32)
            start, num = np.zeros(B, np.int32), np.zeros(B, np.int32)
            last, slots = np.zeros(B, bool), np.zeros(B, np.int32)
            for b, (r, s, e) in enumerate(chunk):
                tokens[b, : e - s] = r.tokens[s:e]
                start[b], num[b], last[b], slots[b] = s, e - s, e == r.prefill_end, r.slot
            rs = [r for r, _, _ in chunk]
            sample = any(r.params.temperature > 0 for r in rs)
            pt = self.cache.pool.page_table(rs + [None] * (B - len(rs)))
            token, self.cache.arrays, self.seed_table = self._prefill[(B, sample)](
                self.params, self.cache.arrays, self.cache.swa_of_full, pt, tokens, start, num, last,
                self.seed_table, slots, *self._sampling_arrays(rs, B))
            token = np.asarray(token)
            now = time.perf_counter()
            for b, (r, s, e) in enumerate(chunk):
                r.cached_len = e
                if last[b] and not r.output_ids:  # a new request's first token
                    r.t_first = now
                    self._commit(r, [int(token[b])], now)
        self.stats.prefill_s += time.perf_counter() - t0

    def _decode_round(self, rows, running, waiting, free_slots) -> list[Request]:
        """One round for the decoding rows; returns every running request that has finished (in prefill too)."""
        t0 = time.perf_counter()
        k = self.k
        ready = [r for r in rows if r in running and self._prepare(r, r.cached_len, r.cached_len + k + 1, running,
                                                                      waiting, free_slots)]
        ready = [r for r in ready if r in running]
        for chunk, B in self._batches(ready):
            pad = B - len(chunk)
            pt = self.cache.pool.page_table(chunk + [None] * pad)
            start = np.pad(np.asarray([r.cached_len for r in chunk], np.int32), (0, pad))
            pending = np.pad(np.asarray([r.tokens[-1] for r in chunk], np.int32), (0, pad))
            slots = np.pad(np.asarray([r.slot for r in chunk], np.int32), (0, pad))
            active = np.arange(B) < len(chunk)
            t1 = time.perf_counter()
            if self.draft_mode == "bucketed":
                drafts, _ = self.drafter.propose_bucket(B, pt, start, pending, self.seed_table, slots)
            elif self.draft_mode == "eager":
                drafts = self.drafter.propose(pt, start, pending, self.seed_table, slots)[0]
            else:
                drafts = np.zeros((B, 0), np.int32)
            t2 = time.perf_counter()
            sample = any(r.params.temperature > 0 for r in chunk)
            out, self.cache.arrays, self.seed_table = self._verify[(B, sample)](
                self.params, self.cache.arrays, self.cache.swa_of_full, pt, pending, drafts, start, active,
                self.seed_table, slots, *self._sampling_arrays(chunk, B))
            self.stats.verify_dispatch_s += time.perf_counter() - t2
            out = np.asarray(out)  # the round's one device -> host transfer
            t3 = time.perf_counter()
            for b, r in enumerate(chunk):
                n = int(out[b, -1])
                r.cached_len += n + 1
                before = len(r.output_ids)
                self._commit(r, [int(t) for t in out[b, : n + 1]], t3)
                r.accept_lengths.append(len(r.output_ids) - before)  # committed: a stop can cut the last round
            self.stats.draft_s += t2 - t1
            self.stats.verify_s += t3 - t2
            self.stats.host_s += (t1 - t0) + (time.perf_counter() - t3)
            t0 = time.perf_counter()
            self.stats.rounds += 1
        return [r for r in running if r.finish_reason]

    def _stop_seen(self, r: Request) -> bool:
        """Whether the output now holds a stop string. A new match ends in the last token, so it lies in the text of
        the last 4 * len(stop) + 8 tokens (a token is at least one byte, a character at most four): decode only that
        tail, and confirm a tail hit on the whole output (a tail's first characters may decode differently). Host work
        per token stays bounded instead of growing with the output."""
        tail = 4 * max(len(s) for s in r.params.stop) + 8
        if not any(s in self.tokenizer.decode(r.output_ids[-tail:]) for s in r.params.stop):
            return False
        text = self.tokenizer.decode(r.output_ids)
        return any(s in text for s in r.params.stop)

    def _commit(self, r: Request, new_tokens, now) -> None:
        """Append committed tokens one by one, stopping at EOS, a stop string, max_new_tokens or the context."""
        for t in new_tokens:
            r.tokens.append(t)
            r.output_ids.append(t)
            if not r.params.ignore_eos and t in self.eos:
                r.finish_reason = "stop"
            elif len(r.output_ids) >= r.params.max_new_tokens:
                r.finish_reason = "length"
            elif r.params.stop and self.tokenizer is not None and self._stop_seen(r):
                r.finish_reason = "stop"
            if r.finish_reason:
                break
        if not r.finish_reason and len(r.tokens) + self.k + 1 > self.max_context:
            r.finish_reason = "length"  # no room for another round
        if r.finish_reason:
            r.t_done = now
            if self.tokenizer is not None:
                r.text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
                for s in r.params.stop:
                    if s in r.text:
                        r.text = r.text[: r.text.index(s)]

    # ---- figures ---------------------------------------------------------------------------------------------------

    def summary(self, requests: list[Request]) -> dict:
        """decode tokens/s = sum(predicted_n) / sum(predicted_ms) * 1000, accept lengths, TTFT."""
        rows = [request_record(r, self) for r in requests]
        n = sum(x["predicted_n"] for x in rows)
        ms = sum(x["predicted_ms"] for x in rows)
        lengths = [a for r in requests for a in r.accept_lengths]
        per_pos = [float(np.mean([a - 1 >= j for a in lengths])) if lengths else 0.0 for j in range(1, self.k + 1)]
        ttft = [x["ttft_ms"] for x in rows]
        return {
            "requests": len(requests),
            "generated_tokens": sum(len(r.output_ids) for r in requests),
            "decode_tokens_per_s": n / ms * 1000 if ms > 0 else 0.0,
            "mean_accept_length": float(np.mean(lengths)) if lengths else 0.0,
            "acceptance_per_position": per_pos,
            "ttft_ms_mean": float(np.mean(ttft)) if ttft else 0.0,
            "ttft_ms_median": float(np.median(ttft)) if ttft else 0.0,
            "rounds": self.stats.rounds,
            # draft: host time to launch the draft executable (its drafts stay on the device, no wait); verify: from
            # there to the round's results on the host (launch, the GPU finishing draft + verify, the transfer), of
            # which verify_dispatch is the launch alone; host: scheduling and committing
            "round_split_s": {"draft": self.stats.draft_s, "verify": self.stats.verify_s,
                              "verify_dispatch": self.stats.verify_dispatch_s, "host": self.stats.host_s,
                              "prefill": self.stats.prefill_s},
            "preemptions": sum(r.preemptions for r in requests),
        }


def request_record(r: Request, engine: Engine) -> dict:
    """One JSONL line: the fields of `--output`."""
    decode_n = max(len(r.output_ids) - 1, 0)  # tokens after the first (which comes from prefill)
    decode_ms = (r.t_done - r.t_first) * 1000 if r.t_first is not None and r.t_done is not None else 0.0
    rec = {
        "index": r.index,
        "prompt_ids": list(r.prompt_ids),
        "output_ids": list(r.output_ids),
        "predicted_n": decode_n,
        "predicted_ms": decode_ms,
        "accept_lengths": list(r.accept_lengths),
        "finish_reason": r.finish_reason,
        "ttft_ms": (r.t_first - engine.t_start) * 1000 if r.t_first is not None else None,
    }
    if r.text is not None:
        rec["text"] = r.text
    return rec

"""The engine loop: `add_request`, `step`, `has_work`; `generate` is a loop over `step`.

One step: admit waiting requests, run one prefill chunk for those still prefilling, launch one decode call (R
speculative rounds on the device) for every decoding request, and commit the results of the previous call (with
overlap; of this call without). The host never reads a round's result before it can launch the next one, and it
commits a call's tokens (EOS, stop strings, lengths, records) while the device runs the next call.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import numbers
import time
from typing import Callable

import jax
import numpy as np

from jaxspec import staging
from jaxspec.config import AssistantConfig, ConfigError, TargetConfig, check_pair, env_switch
from jaxspec.draft.eager import EagerDrafter
from jaxspec.engine.config import EngineConfig
from jaxspec.engine.programs import Programs, Weights
from jaxspec.engine.request import Request, request_record
from jaxspec.engine.runner import Runner
from jaxspec.engine.scheduler import Scheduler
from jaxspec.engine.stopping import Stopping
from jaxspec.model.gemma4 import stored_params
from jaxspec.paged_kv.cache import PagedKVCache
from jaxspec.paged_kv.pool import swa_pages_bound_for

INT32 = np.iinfo(np.int32)  # the device dtype of seeds and top_k


@dataclasses.dataclass
class Stats:
    rounds: int = 0  # speculative rounds run on the device (a call runs up to rounds_per_call)
    calls: int = 0  # decode calls
    draft_s: float = 0.0  # eager mode: host time of the reference drafter
    launch_s: float = 0.0  # host time to reserve pages and launch decode calls (no waiting)
    wait_s: float = 0.0  # host time blocked on a call's results
    host_s: float = 0.0  # host time committing results (stops, records)
    prefill_s: float = 0.0
    prefill_calls: int = 0
    decode_start: float | None = None  # the first decode launch
    decode_end: float | None = None  # the last results read


def freeze_heap() -> None:
    """Collect once, then move every object alive now (the loaded model, jax's and XLA's compile-time objects) into
    the garbage collector's permanent generation (`gc.freeze`), so that its full collections stop walking them (one
    over a compiled server's heap took 250-300 ms on the CPU). The entry points call it after compiling, as vLLM's
    engine does after start-up. Objects frozen by an earlier call are thawed and collected first, so that an
    engine dropped since (its device buffers too) is freed. JAXSPEC_GC_FREEZE=0 turns it off (to compare)."""
    if env_switch("JAXSPEC_GC_FREEZE") is not False:
        gc.unfreeze()
        gc.collect()
        gc.freeze()


class Engine:
    def __init__(self, cfg: TargetConfig, params, *, acfg: AssistantConfig | None = None, aparams=None,
                 tokenizer=None, config: EngineConfig | None = None, **options):
        """options: the fields of EngineConfig (k, draft_mode, buckets, max_running, ...), when no config is given."""
        c = config or EngineConfig(**options)
        if c.draft_mode != "off":
            if acfg is None:
                raise ConfigError(f"--draft-mode {c.draft_mode} needs an assistant (--assistant DIR)")
            check_pair(cfg, acfg)
            if acfg.text.sliding_window > cfg.sliding_window:
                raise ConfigError(f"assistant sliding_window {acfg.text.sliding_window} exceeds the target's "
                                  f"{cfg.sliding_window}: the SWA pool keeps only the target's window")
        self.cfg, self.config, self.tokenizer, self.k = cfg, c, tokenizer, c.k
        self.mesh = None
        params = stored_params(params, c.tensor_parallel_size)
        if c.tensor_parallel_size > 1:  # the target split over devices, the assistant replicated (jaxspec.parallel)
            from jaxspec import parallel

            self.mesh = parallel.make_mesh(c.tensor_parallel_size)
            params = parallel.place(params, parallel.target_shardings(params, cfg, self.mesh))
            if aparams is not None:
                aparams = parallel.place(aparams, parallel.assistant_shardings(aparams, acfg, self.mesh))
        default_kernels = jax.default_backend() != "cpu" and self.mesh is None
        self.use_kernels = default_kernels if c.use_kernels is None else c.use_kernels
        self.cache = self._make_cache(params["embed"].dtype)
        self.max_context = self.cache.spec.max_context
        eos = tuple(cfg.eos_token_ids if c.eos_token_ids is None else c.eos_token_ids)
        programs = Programs(cfg=cfg, acfg=acfg, spec=self.cache.spec, k=c.k, draft_mode=c.draft_mode,
                            use_kernels=self.use_kernels, eos=eos, fused_draft=c.fused_draft, mesh=self.mesh,
                            unroll_rounds=env_switch("JAXSPEC_UNROLL_ROUNDS") is not False,
                            invariant_positions=c.batch_invariant, stage_inputs=staging.enabled())
        weights = Weights(target=params, assistant=aparams if c.draft_mode == "bucketed" else None)
        self.runner = Runner(c, programs, weights, self.cache)
        self.drafter = None
        if c.draft_mode == "eager":
            self.drafter = EagerDrafter(aparams, acfg, params["embed"], cfg, c.k)
            self.drafter.attach(self.cache)
        self.scheduler = Scheduler(self.cache.pool, max_running=c.max_running, buckets=c.buckets)
        self.stopping = Stopping(eos=set(eos), tokenizer=tokenizer, k=c.k, max_context=self.max_context)
        self.stats = Stats()
        self._in_flight: list[tuple[list[Request], jax.Array]] = []
        self._updated: dict[int, Request] = {}

    def _make_cache(self, dtype) -> PagedKVCache:
        c, cfg = self.config, self.cfg
        max_context = c.context(cfg.max_position_embeddings)
        pages_per_request = c.pages_per_request(cfg.max_position_embeddings)
        num_pages = c.num_pages or c.max_running * pages_per_request + 1
        swa_bound = swa_pages_bound_for(page_size=c.page_size, swa_keep=cfg.sliding_window + 1,
                                        max_step_tokens=c.step_tokens)
        if c.max_context and c.max_context > cfg.max_position_embeddings:
            raise ConfigError(f"--max-context {c.max_context} exceeds the model's max_position_embeddings "
                              f"{cfg.max_position_embeddings}")
        if num_pages - 1 < pages_per_request:
            raise ConfigError(f"--kv-pages {num_pages} cannot hold one request of {max_context} positions "
                              f"({pages_per_request} pages of {c.page_size} + the dummy page)")
        try:
            return PagedKVCache(cfg, page_size=c.page_size, num_full_pages=num_pages,
                                num_swa_pages=c.num_swa_pages or c.max_running * swa_bound + 1,
                                max_context=max_context, max_step_tokens=c.step_tokens, dtype=dtype,
                                mesh=self.mesh)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    # ---- compiling -------------------------------------------------------------------------------------------------

    def warmup(self, sample: bool = False, progress: bool = False, prime: bool | None = None) -> None:
        """Compile every program for every bucket (greedy, and the sampling variants when `sample`); progress: a line
        and a bar on stderr. prime: then run each once on padding rows (`Runner.prime`); default: on a GPU, where a
        program's first execution loads its kernels (on the CPU it gains nothing and costs a prefill per bucket), or
        as JAXSPEC_PRIME=1/0 says (to compare)."""
        self.runner.compile(False, progress)
        if sample:
            self.runner.compile(True, progress)
        if prime is None:
            prime = env_switch("JAXSPEC_PRIME")
        if prime if prime is not None else jax.default_backend() != "cpu":
            self.runner.prime()

    def rebuild(self, **sizes) -> None:
        """Re-create the cache with new sizes (no request may be running) and compile the programs again."""
        self.cache.rebuild(**sizes)
        self.max_context = self.stopping.max_context = self.cache.spec.max_context
        self.runner.programs = dataclasses.replace(self.runner.programs, spec=self.cache.spec)
        self.runner.rebuild()

    # ---- serving ---------------------------------------------------------------------------------------------------

    def validate(self, req: Request) -> None:
        """A ConfigError naming the request (its index, input order) that the engine cannot run as asked."""
        if not req.prompt_ids:
            raise ConfigError(f"request {req.index}: empty prompt")
        # bool is an int in Python: a JSON true must not become token 1
        bad = [t for t in req.prompt_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise ConfigError(f"request {req.index}: token id {bad[0]!r} is not an integer")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ConfigError(f"request {req.index}: token id {bad[0]} outside the vocabulary "
                              f"(0..{self.cfg.vocab_size - 1})")
        p = req.params
        if not (math.isfinite(p.temperature) and p.temperature >= 0 and 0 < p.top_p <= 1 and p.top_k >= 0
                and INT32.min <= p.seed <= INT32.max and p.top_k <= INT32.max):
            raise ConfigError(f"request {req.index}: sampling parameters out of range (temperature finite >= 0, "
                              f"top_p in (0, 1], top_k >= 0, seed an int32): {p}")
        if len(req.prompt_ids) + self.k + 2 > self.max_context:
            raise ConfigError(f"request {req.index}: prompt of {len(req.prompt_ids)} tokens does not fit the context "
                              f"of {self.max_context} (with {self.k + 1} verify positions and one new token)")
        if req.params.max_new_tokens < 1:
            raise ConfigError(f"request {req.index}: max_new_tokens must be >= 1")

    def add_request(self, req: Request) -> Request:
        """Queue a request (validated; its sampling variant must be compiled: `warmup(sample=True)`)."""
        self.validate(req)
        if req.params.temperature > 0 and True not in self.runner.compiled_variants:
            raise ConfigError("sampled requests need warmup(sample=True) first")
        req.t_arrival = time.perf_counter()
        self.scheduler.add(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request (a client went away): it produces nothing more and its pages are freed."""
        if not req.finished:
            req.cancelled = True
            req.finish_reason = "abort"
            self.stopping.finish(req, time.perf_counter())
        self.scheduler.cancel(req)

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._in_flight)

    def step(self) -> list[Request]:
        """Admit, prefill, launch a decode call, commit the previous one. Returns the requests that gained tokens
        or finished in this step."""
        self._updated = {}
        # Eager drafting runs op by op (it traces small ops by design); every other path must not trace here.
        with jax.no_tracing(self.config.draft_mode != "eager"):
            self.scheduler.admit()
            self._prefill()
            calls = self._launch()
            if self.config.overlap:
                calls, self._in_flight = self._in_flight, calls
            self._collect(calls)
            self.scheduler.release_finished()
        return list(self._updated.values())

    def generate(self, requests: list[Request], on_finished: Callable[[Request], None] | None = None,
                 profile_dir: str | None = None) -> list[Request]:
        """Run all requests to completion; returns them in input order (their fields filled in). on_finished(r) is
        called as each one finishes."""
        for i, r in enumerate(requests):
            r.index = i
            self.validate(r)
        self.warmup(sample=any(r.params.temperature > 0 for r in requests))
        self.stats = Stats()
        for r in requests:
            self.add_request(r)
        tracing = False
        while self.has_work():
            if profile_dir and not tracing and any(r.decoding for r in self.scheduler.running):
                jax.profiler.start_trace(profile_dir)
                tracing = True
            for r in self.step():
                if r.finished and on_finished:
                    on_finished(r)
        if tracing:
            jax.profiler.stop_trace()
        return requests

    # ---- one step ----------------------------------------------------------------------------------------------------

    def _reserve(self, r: Request, span: Callable[[Request], tuple[int, int]]) -> bool:
        """Pages for r to write span(r) = [start, end). When the pool is short: first read the calls in flight (their
        finished requests free pages, and a victim must not be in a launched call), then preempt. False if r is
        gone meanwhile (finished by the results read, or preempted itself)."""
        while r in self.scheduler.running and not r.finished:
            if self.cache.pool.prepare(r, *span(r)):
                return True
            if self._in_flight:
                calls, self._in_flight = self._in_flight, []
                self._collect(calls)
            elif not self.scheduler.release_finished():
                victim = self.scheduler.victim(keep=r)
                if victim is None:
                    raise RuntimeError("the page pool cannot hold a single request; the engine's size check failed")
                self.scheduler.preempt(victim)
        return False

    def _prefill(self) -> None:
        chunk = self.config.prefill_chunk
        rows = [r for r in self.scheduler.running if not r.decoding and not r.finished]
        if not rows:
            return
        t0 = time.perf_counter()
        span = lambda r: (r.cached_len, min(r.prefill_end, r.cached_len + chunk))  # noqa: E731
        ready = [r for r in rows if self._reserve(r, span)]
        # a later reservation may have preempted an earlier row
        plan = [(r, *span(r)) for r in ready if r in self.scheduler.running]
        for rows, bucket in self.scheduler.chunks(plan):
            token = self.runner.prefill(rows, bucket)
            self.stats.prefill_calls += 1
            now = time.perf_counter()
            for b, (r, s, e) in enumerate(rows):
                r.cached_len = e
                if e == r.prefill_end and not r.output_ids:  # a new request's first token
                    r.t_first = now
                    self.stopping.commit(r, [int(token[b])], now)
                    self._updated[r.request_id] = r
        self.stats.prefill_s += time.perf_counter() - t0

    def _launch(self) -> list[tuple[list[Request], jax.Array]]:
        rows = [r for r in self.scheduler.running if r.decoding and not r.finished]
        if not rows:
            return []
        t0 = time.perf_counter()
        ahead = self.config.lookahead
        span = lambda r: (r.cached_len, min(r.cached_len + ahead, self.max_context))  # noqa: E731
        ready = [r for r in rows if self._reserve(r, span)]
        ready = [r for r in ready if r in self.scheduler.running and not r.finished]
        calls = []
        for chunk, bucket in self.scheduler.chunks(ready):
            drafts = self._eager_drafts(chunk, bucket) if self.drafter else None
            calls.append((chunk, self.runner.decode(chunk, bucket, drafts)))
            for r in chunk:
                r.in_flight += 1
        if self.stats.decode_start is None:
            self.stats.decode_start = t0
        self.stats.launch_s += time.perf_counter() - t0
        return calls

    def _eager_drafts(self, chunk: list[Request], bucket: int):
        """The reference drafter on the host's (exact: no overlap in eager mode) view of each row."""
        t0 = time.perf_counter()
        pad = bucket - len(chunk)
        col = lambda f: np.asarray([f(r) for r in chunk] + [0] * pad, np.int32)  # noqa: E731
        drafts, _ = self.drafter.propose(self.cache.pool.page_table(chunk + [None] * pad), col(lambda r: r.cached_len),
                                         col(lambda r: r.tokens[-1]), self.runner.state.seed_hidden,
                                         col(lambda r: r.slot))
        self.stats.draft_s += time.perf_counter() - t0
        return drafts

    def _collect(self, calls) -> None:
        """Read each call's results (its one device -> host transfer) and commit them, round by round."""
        k = self.k
        for chunk, out in calls:
            t0 = time.perf_counter()
            out = self.runner.read(out)  # [B, R, k + 2]
            now = time.perf_counter()
            self.stats.wait_s += now - t0
            counts = out[:, :, k + 1]
            self.stats.rounds += int(np.max(np.count_nonzero(counts[: len(chunk)], axis=1)))
            self.stats.calls += 1
            for b, r in enumerate(chunk):
                r.in_flight -= 1
                for i in range(counts.shape[1]):
                    if r.finished or not counts[b, i]:  # past a request's end: discarded
                        break
                    c = int(counts[b, i])
                    r.accept_lengths.append(self.stopping.commit(r, out[b, i, :c].tolist(), now))
                    r.cached_len += c
                    self._updated[r.request_id] = r
            self.stats.decode_end = time.perf_counter()
            self.stats.host_s += self.stats.decode_end - now

    # ---- figures ---------------------------------------------------------------------------------------------------

    def summary(self, requests: list[Request]) -> dict:
        """decode tokens/s = sum(predicted_n) / sum(predicted_ms) * 1000 (per request, averaged by tokens);
        throughput = sum(predicted_n) / the decode phase's wall time (all requests together)."""
        rows = [request_record(r) for r in requests]
        n = sum(x["predicted_n"] for x in rows)
        ms = sum(x["predicted_ms"] for x in rows)
        lengths = [a for r in requests for a in r.accept_lengths]
        per_pos = [float(np.mean([a - 1 >= j for a in lengths])) if lengths else 0.0 for j in range(1, self.k + 1)]
        ttft = [x["ttft_ms"] for x in rows if x["ttft_ms"] is not None]
        s = self.stats
        wall = (s.decode_end - s.decode_start) if s.decode_start is not None and s.decode_end else 0.0
        return {
            "requests": len(requests),
            "generated_tokens": sum(len(r.output_ids) for r in requests),
            "decode_tokens_per_s": n / ms * 1000 if ms > 0 else 0.0,
            "throughput_tokens_per_s": n / wall if wall > 0 else 0.0,
            "mean_accept_length": float(np.mean(lengths)) if lengths else 0.0,
            "acceptance_per_position": per_pos,
            "ttft_ms_mean": float(np.mean(ttft)) if ttft else 0.0,
            "ttft_ms_median": float(np.median(ttft)) if ttft else 0.0,
            "rounds": s.rounds,
            "calls": s.calls,
            "rounds_per_call": self.config.rounds_per_call,
            "overlap": self.config.overlap,
            "programs_compiled": self.runner.programs_compiled,
            # host time: launching decode calls (draft: the eager reference drafter, part of launch), blocked on
            # results (the device finishing), committing them, and prefill
            "round_split_s": {"draft": s.draft_s, "launch": s.launch_s, "wait": s.wait_s, "host": s.host_s,
                              "prefill": s.prefill_s},
            "preemptions": sum(r.preemptions for r in requests),
        }

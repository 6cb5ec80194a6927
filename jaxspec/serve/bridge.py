"""The engine thread: the one owner of the engine, between the asyncio server and the device.

It loops `engine.step()` while there is work, takes new requests and cancellations from a thread-safe inbox between
steps (blocking on it when idle), and hands each request's newly committed tokens to the event loop with
`loop.call_soon_threadsafe` (one call per step for all of them), so the event loop never waits on the device and
requests that arrive while others decode join at the next step (continuous batching; beyond
--max-running-requests the scheduler queues them). It also keeps the figures /metrics shows: where its time goes
(prefill, launch, waiting on results, commit) and the garbage collector's pauses. With JAXSPEC_STEP_LOG=FILE it
also appends one JSON line per step to FILE (its start, duration and phases, the requests running and waiting): the
timeline behind the /metrics totals, for finding a stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import json
import os
import queue
import sys
import threading
import time
import traceback

from jaxspec.config import ConfigError
from jaxspec.engine import Request
from jaxspec.serve.protocol import ApiError


@dataclasses.dataclass(frozen=True)
class Update:
    """What a request gained in one step."""

    tokens: list[int]  # newly committed token ids
    finish_reason: str | None = None  # set on the last update: "stop" or "length"
    text: str | None = None  # with finish_reason: the whole output text (stop strings cut), when there is a tokenizer
    error: ApiError | None = None  # the request failed; nothing follows


@dataclasses.dataclass
class _Live:
    req: Request
    sink: asyncio.Queue
    sent: int = 0  # output tokens handed over
    rounds_seen: int = 0  # accept_lengths entries counted into the metrics


def _deliver(updates: list[tuple[asyncio.Queue, Update]]) -> None:
    for sink, update in updates:
        sink.put_nowait(update)


STEP_BUCKETS = (0.001, 0.005, 0.02, 0.1, 0.25, 0.5, 1.0, float("inf"))  # seconds: the step-time histogram


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The engine's figures for /metrics, replaced whole after each step (one reference: a consistent view)."""

    running: int = 0
    waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    swa_pages_used: int = 0
    swa_pages_total: int = 0
    generated_tokens: int = 0
    accepted_tokens: int = 0  # tokens committed by decode rounds (the accept lengths' sum)
    decode_rounds: int = 0  # rounds seen per request (the accept lengths' count)
    device_rounds: int = 0  # speculative rounds the device ran (a round serves every running request)
    requests_finished: int = 0
    requests_failed: int = 0
    decode_calls: int = 0  # where the engine thread's time goes: calls made and seconds spent by phase
    prefill_calls: int = 0
    step_seconds: float = 0.0  # inside engine.step()
    step_buckets: tuple[int, ...] = (0,) * len(STEP_BUCKETS)  # steps that took <= STEP_BUCKETS[i] s (cumulative)
    prefill_seconds: float = 0.0
    launch_seconds: float = 0.0
    wait_seconds: float = 0.0  # blocked on a decode call's results
    commit_seconds: float = 0.0
    gc_collections: int = 0  # the garbage collector's collections (all generations) and their pauses
    gc_full_collections: int = 0
    gc_seconds: float = 0.0


class GcPauses:
    """Counts the process's garbage collections and their time (a `gc.callbacks` hook: they run under the GIL and
    stop every thread, the engine's included)."""

    def __init__(self):
        self.collections = self.full = 0
        self.seconds, self._t0 = 0.0, None
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.collections += 1
            self.full += info["generation"] == 2
            self._t0 = None

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self)


class EngineThread:
    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self.gc = GcPauses()
        self._step_s, self._step_counts = 0.0, [0] * len(STEP_BUCKETS)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}
        self._totals = {"generated_tokens": 0, "accepted_tokens": 0, "decode_rounds": 0, "requests_finished": 0,
                        "requests_failed": 0}
        self.snapshot = Snapshot()
        self._snap()
        self._thread = threading.Thread(target=self._run, name="jaxspec-engine", daemon=True)
        path = os.environ.get("JAXSPEC_STEP_LOG")
        self._log = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (closed by stop())

    # ---- called from the event loop ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req: Request) -> asyncio.Queue:
        """Queue req; its updates arrive on the returned queue (read it in the event loop)."""
        sink: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", req, sink))
        return sink

    def cancel(self, req: Request) -> None:
        """The client went away: the engine stops req and frees its pages (in the engine thread, between steps)."""
        self._inbox.put(("cancel", req, None))

    def stop(self) -> None:
        self._inbox.put(("stop", None, None))
        self._thread.join()
        self.gc.close()
        if self._log:
            self._log.close()

    # ---- the engine thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            # idle: sleep until a request comes; busy: take what has come and step
            block = not self.engine.has_work()
            while True:
                try:
                    kind, req, sink = self._inbox.get(block=block)
                except queue.Empty:
                    break
                block = False
                if kind == "stop":
                    return
                if kind == "add":
                    self._add(req, sink)
                else:
                    self._cancel(req)
            if self.engine.has_work():
                t0 = time.perf_counter()
                before = self._phases() if self._log else None
                try:
                    updated = self.engine.step()
                except Exception:
                    self._fail_all()
                    continue
                finally:
                    took = time.perf_counter() - t0
                    self._step_s += took
                    self._step_counts[next(i for i, le in enumerate(STEP_BUCKETS) if took <= le)] += 1
                    if self._log:
                        self._log_step(t0, took, before)
                self._publish(updated)
            self._snap()

    def _phases(self) -> dict:
        st = self.engine.stats
        return {"prefill_s": st.prefill_s, "launch_s": st.launch_s, "wait_s": st.wait_s, "commit_s": st.host_s,
                "prefill_calls": st.prefill_calls, "decode_calls": st.calls, "gc_s": self.gc.seconds}

    def _log_step(self, t0: float, took: float, before: dict) -> None:
        after, sch = self._phases(), self.engine.scheduler
        line = {"t": round(t0, 6), "step_s": round(took, 6),
                **{k: round(after[k] - before[k], 6) for k in after},
                "running": len(sch.running), "waiting": len(sch.waiting)}
        self._log.write(json.dumps(line) + "\n")

    def _add(self, req: Request, sink: asyncio.Queue) -> None:
        try:
            self.engine.add_request(req)
        except ConfigError as e:
            self._send(sink, Update([], error=ApiError(str(e))))
            return
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self._send(sink, Update([], error=ApiError(f"internal error: {e}", status=500, kind="internal_error")))
            return
        self._live[req.request_id] = _Live(req, sink)

    def _cancel(self, req: Request) -> None:
        if self._live.pop(req.request_id, None) is not None:
            self.engine.cancel(req)

    def _publish(self, updated: list[Request]) -> None:
        t, out = self._totals, []
        for r in updated:
            live = self._live.get(r.request_id)
            if live is None:
                continue
            new = r.output_ids[live.sent:]
            live.sent = len(r.output_ids)
            t["generated_tokens"] += len(new)
            t["accepted_tokens"] += sum(r.accept_lengths[live.rounds_seen:])
            t["decode_rounds"] += len(r.accept_lengths) - live.rounds_seen
            live.rounds_seen = len(r.accept_lengths)
            if r.finished:
                del self._live[r.request_id]
                t["requests_finished"] += 1
                out.append((live.sink, Update(new, r.finish_reason, r.text)))
            elif new:
                out.append((live.sink, Update(new)))
        if out:  # one wake-up of the event loop per step, however many requests gained tokens
            self.loop.call_soon_threadsafe(_deliver, out)

    def _fail_all(self) -> None:
        """A step raised: which request caused it is unknown, so every live one fails (500) and is cancelled; the
        thread goes on serving new requests."""
        traceback.print_exc(file=sys.stderr)
        error = ApiError("internal error in the engine step; the request was cancelled", status=500,
                         kind="internal_error")
        for live in list(self._live.values()):
            self._send(live.sink, Update([], error=error))
            self._totals["requests_failed"] += 1
            try:
                self.engine.cancel(live.req)
            except Exception:
                traceback.print_exc(file=sys.stderr)
        self._live.clear()

    def _send(self, sink: asyncio.Queue, update: Update) -> None:
        self.loop.call_soon_threadsafe(sink.put_nowait, update)

    def _snap(self) -> None:
        e = self.engine
        pool = e.cache.pool
        self.snapshot = Snapshot(
            running=len(e.scheduler.running), waiting=len(e.scheduler.waiting),
            kv_pages_used=pool.num_full_pages - 1 - pool.num_free_full, kv_pages_total=pool.num_full_pages - 1,
            swa_pages_used=pool.num_swa_pages - 1 - pool.num_free_swa, swa_pages_total=pool.num_swa_pages - 1,
            device_rounds=e.stats.rounds, decode_calls=e.stats.calls, prefill_calls=e.stats.prefill_calls,
            step_seconds=self._step_s, step_buckets=tuple(itertools.accumulate(self._step_counts)),
            prefill_seconds=e.stats.prefill_s, launch_seconds=e.stats.launch_s,
            wait_seconds=e.stats.wait_s, commit_seconds=e.stats.host_s, gc_collections=self.gc.collections,
            gc_full_collections=self.gc.full, gc_seconds=self.gc.seconds, **self._totals)

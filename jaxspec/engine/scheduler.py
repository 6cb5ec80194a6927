"""Who runs: the waiting queue, the running list (in admission order), the decode-state slots, preemption (vLLM's
recompute policy: the most recently admitted request gives its pages back and is later recomputed from its committed
tokens) and the one bucket chunker. Page reservation itself is the engine's (it may have to read results first)."""

from __future__ import annotations

from collections import deque

from jaxspec.draft.bucketed import chunks
from jaxspec.engine.request import Request
from jaxspec.paged_kv.pool import PagePool


class Scheduler:
    def __init__(self, pool: PagePool, *, max_running: int, buckets: tuple[int, ...]):
        self.pool, self.max_running, self.buckets = pool, max_running, buckets
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_running, 0, -1))  # slot 0 is the padding rows'

    def add(self, r: Request) -> None:
        self.waiting.append(r)

    def admit(self) -> None:
        """Waiting requests join while there is room (their pages come with their first step)."""
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting.popleft()
            self.pool.add(r)
            r.slot = self.free_slots.pop()
            self.running.append(r)

    def victim(self, keep: Request) -> Request | None:
        """The request to preempt so that `keep` can have pages: the most recently admitted other live one."""
        return next((r for r in reversed(self.running) if r is not keep and not r.finished), None)

    def preempt(self, r: Request) -> None:
        """Give r's pages and slot back; it waits at the front and is recomputed from its committed tokens."""
        self._release(r)
        r.cached_len = 0
        r.preemptions += 1
        self.waiting.appendleft(r)

    def release_finished(self) -> list[Request]:
        """Free every finished request that no launched call still uses (pages are freed one call late)."""
        done = [r for r in self.running if r.finished and not r.in_flight]
        for r in done:
            self._release(r)
        return done

    def cancel(self, r: Request) -> None:
        """Stop r wherever it is; a running request is freed once no launched call uses it."""
        if r in self.waiting:
            self.waiting.remove(r)

    def _release(self, r: Request) -> None:
        self.running.remove(r)
        self.pool.free(r)
        self.free_slots.append(r.slot)
        r.slot = 0

    def chunks(self, rows: list) -> list[tuple[list, int]]:
        """Rows in chunks of at most the largest bucket, each with the bucket it is padded to."""
        return [(rows[lo:hi], bucket) for lo, hi, bucket in chunks(len(rows), self.buckets)]

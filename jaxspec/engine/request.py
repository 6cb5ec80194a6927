"""A request: what the user asked for (`SamplingParams`, the prompt), what was committed, and its output record."""

from __future__ import annotations

import dataclasses
import itertools

_ids = itertools.count()


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
    request_id: int = dataclasses.field(default_factory=lambda: next(_ids))
    tokens: list[int] = dataclasses.field(default_factory=list)  # committed: prompt + generated
    output_ids: list[int] = dataclasses.field(default_factory=list)
    accept_lengths: list[int] = dataclasses.field(default_factory=list)  # tokens committed per decode round
    # positions whose K/V the target wrote and kept, as far as the host has read (the device may be ahead of it by
    # the rounds in flight)
    cached_len: int = 0
    slot: int = 0  # the request's row in the device decode state (0: none)
    in_flight: int = 0  # decode calls launched with this request whose results are not read yet
    finish_reason: str | None = None
    cancelled: bool = False
    text: str | None = None
    t_arrival: float | None = None
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def request_record(r: Request) -> dict:
    """One JSONL line: the fields of `--output` (ttft_ms counts from the request's arrival)."""
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
        "ttft_ms": (r.t_first - r.t_arrival) * 1000 if r.t_first is not None and r.t_arrival is not None else None,
    }
    if r.text is not None:
        rec["text"] = r.text
    return rec

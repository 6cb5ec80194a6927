"""EngineConfig: every engine option in one frozen dataclass, validated once."""

from __future__ import annotations

import dataclasses
import math

from jaxspec.config import ConfigError
from jaxspec.draft.bucketed import DEFAULT_BUCKETS

DRAFT_MODES = ("bucketed", "eager", "off")
MAX_INVARIANT_POSITIONS = 16  # a step of more positions takes the prefill's attention path (MAX_KERNEL_QUERIES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    k: int = 3  # drafts per round (num_speculative_tokens); 0 with draft_mode "off"
    draft_mode: str = "bucketed"  # bucketed (compiled, in the round program) | eager (the reference) | off
    buckets: tuple[int, ...] = DEFAULT_BUCKETS  # batch sizes compiled for prefill and decode (like --cuda-graph-bs)
    max_running: int = 16  # requests decoding together (more wait)
    page_size: int = 16
    num_pages: int | None = None  # full-pool pages (None: enough for max_running requests of max_context)
    num_swa_pages: int | None = None  # SWA-pool pages (None: enough for max_running windows)
    max_context: int | None = None  # positions a request may hold (None: the model's, at most 4096)
    prefill_chunk: int = 256
    use_kernels: bool | None = None  # Pallas kernels (None: on a GPU)
    # with kernels on one device, the drafter step through its fused kernels: True every bucket, False none, None
    # (default) the buckets up to jaxspec.draft.bucketed.FUSED_MAX_BUCKET (where they measured faster)
    fused_draft: bool | None = None
    rounds_per_call: int = 1  # speculative rounds per decode call (one after another in the program)
    overlap: bool = True  # launch the next decode call before reading the last one's results
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's
    tensor_parallel_size: int = 1  # devices the target is split over (`jaxspec.parallel`)
    # 0: off. P > 0: batch-invariant decoding: every decode / verify step computes P positions a request (k + 1
    # real, the rest padding) and the attention over keys split at fixed positions, so that a position's logits do
    # not depend on k, on speculation being on, or on the other positions of the step: greedy output with the
    # drafter then equals plain greedy output bit for bit with the same P (bf16 too). Costs plain decoding P rows.
    batch_invariant: int = 0

    def __post_init__(self):
        if self.draft_mode not in DRAFT_MODES:
            raise ConfigError(f"unknown draft mode {self.draft_mode!r} (expected one of {', '.join(DRAFT_MODES)})")
        if self.draft_mode != "off" and self.k < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {self.k}")
        for name in ("max_running", "page_size", "prefill_chunk", "rounds_per_call", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_pages", "num_swa_pages", "max_context"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        buckets = tuple(sorted(set(int(b) for b in self.buckets)))
        if not buckets or buckets[0] < 1:
            raise ConfigError(f"batch buckets must be positive integers, got {self.buckets}")
        # buckets above the first one that holds every running request would never be used: skip their compiles
        buckets = (tuple(b for b in buckets if b < self.max_running)
                   + tuple(b for b in buckets if b >= self.max_running)[:1])
        object.__setattr__(self, "buckets", buckets)
        if self.draft_mode == "off":
            object.__setattr__(self, "k", 0)
        if self.tensor_parallel_size > 1 and self.use_kernels and self.fused_draft:
            raise ConfigError("the fused drafter kernels do not run split over devices: use the default draft step "
                              "with --tensor-parallel-size > 1")
        if self.tensor_parallel_size > 1 and self.draft_mode == "eager":
            raise ConfigError("--draft-mode eager runs on one device: use bucketed with --tensor-parallel-size > 1")
        if self.batch_invariant < 0:
            raise ConfigError(f"batch_invariant must be 0 (off) or a number of positions >= 1, got "
                              f"{self.batch_invariant}")
        if self.batch_invariant and not self.k + 1 <= self.batch_invariant <= MAX_INVARIANT_POSITIONS:
            raise ConfigError(f"--batch-invariant {self.batch_invariant} must hold the k + 1 = {self.k + 1} positions "
                              f"of a round and be at most {MAX_INVARIANT_POSITIONS}")
        if self.draft_mode == "eager":  # the reference drafts on the host from the host's view of every request
            object.__setattr__(self, "rounds_per_call", 1)
            object.__setattr__(self, "overlap", False)

    @property
    def lookahead(self) -> int:
        """Positions a request may advance beyond what the host has read: the calls in flight times the positions a
        call can write. Pages are reserved this far ahead, so no allocation waits on an unseen result."""
        return (2 if self.overlap else 1) * self.rounds_per_call * (self.k + 1)

    @property
    def step_tokens(self) -> int:
        """The most positions one pool reservation spans (a prefill chunk, or the lookahead)."""
        return max(self.prefill_chunk, self.lookahead)

    def context(self, model_max: int) -> int:
        return self.max_context or min(model_max, 4096)

    def pages_per_request(self, model_max: int) -> int:
        return math.ceil(self.context(model_max) / self.page_size)

"""Host-side page allocator for one engine: the full pool, the sliding-window (SWA) pool, and the full→SWA table.

Full-attention layers keep every position of a request in the full pool. Sliding layers keep only what a step can
read or write in the SWA pool: the `swa_keep` positions before the step's start plus the step's own positions.
Logical page j of a request covers positions [j*page_size, (j+1)*page_size) in both pools, so the device finds a
position's sliding-layer K/V through the full page table and `swa_of_full`, one entry per full page.

Page 0 of each pool is a dummy that padded rows point at; it is never handed out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def swa_pages_bound_for(*, page_size: int, swa_keep: int, max_step_tokens: int) -> int:
    # A step's window spans at most swa_keep + max_step_tokens positions; unaligned, that touches one page more.
    return _ceil_div(swa_keep + max_step_tokens, page_size) + 1


@dataclasses.dataclass
class _Request:
    full_pages: list[int] = dataclasses.field(default_factory=list)  # full page of logical page j, j = 0, 1, ...
    swa_pages: dict[int, int] = dataclasses.field(default_factory=dict)  # logical page -> SWA page, resident only
    start: int = 0  # start of the last prepared step: released SWA pages are gone, so starts never move back


class PagePool:
    """Hands out full and SWA pages to requests and keeps `swa_of_full` (int32[num_full_pages]) up to date.

    `version` grows whenever `swa_of_full` changes, so the device copy is re-uploaded only when needed.
    """

    def __init__(
        self,
        *,
        page_size: int,
        num_full_pages: int,
        num_swa_pages: int,
        max_pages_per_request: int,
        swa_keep: int,
        max_step_tokens: int,
    ):
        if swa_keep < 0 or max_step_tokens < 1:
            raise ValueError(f"need swa_keep >= 0 and max_step_tokens >= 1, got {swa_keep} and {max_step_tokens}")
        self.swa_keep = swa_keep
        self.max_step_tokens = max_step_tokens
        self.version = 0
        self._build(
            page_size=page_size,
            num_full_pages=num_full_pages,
            num_swa_pages=num_swa_pages,
            max_pages_per_request=max_pages_per_request,
        )

    def _build(self, *, page_size: int, num_full_pages: int, num_swa_pages: int, max_pages_per_request: int) -> None:
        if page_size < 1 or max_pages_per_request < 1:
            raise ValueError(
                f"a request must hold at least one position: page_size={page_size}, "
                f"max_pages_per_request={max_pages_per_request}"
            )
        if num_full_pages < 2:
            raise ValueError(f"the full pool needs a page besides the dummy, got num_full_pages={num_full_pages}")
        bound = swa_pages_bound_for(page_size=page_size, swa_keep=self.swa_keep, max_step_tokens=self.max_step_tokens)
        if num_swa_pages - 1 < bound:
            raise ValueError(
                f"the SWA pool ({num_swa_pages} pages, one a dummy) cannot hold one request's window of "
                f"{bound} pages (swa_keep={self.swa_keep}, max_step_tokens={self.max_step_tokens}, "
                f"page_size={page_size})"
            )
        self.page_size = page_size
        self.num_full_pages = num_full_pages
        self.num_swa_pages = num_swa_pages
        self.max_pages_per_request = max_pages_per_request
        # Stacks: a fresh pool hands out pages 1, 2, 3, ...; a freed page is the next one handed out.
        self._free_full = list(range(num_full_pages - 1, 0, -1))
        self._free_swa = list(range(num_swa_pages - 1, 0, -1))
        self._requests: dict[Hashable, _Request] = {}
        self.swa_of_full = np.zeros(num_full_pages, np.int32)  # [num_full_pages] SWA page of full page f, 0 if none

    def rebuild(
        self,
        *,
        num_full_pages: int | None = None,
        num_swa_pages: int | None = None,
        page_size: int | None = None,
        max_pages_per_request: int | None = None,
    ) -> None:
        """Re-creates both pools with new sizes (None keeps the current one); every request must be freed first."""
        if self._requests:
            raise ValueError(f"cannot rebuild the page pool with {len(self._requests)} live requests")
        self._build(
            page_size=self.page_size if page_size is None else page_size,
            num_full_pages=self.num_full_pages if num_full_pages is None else num_full_pages,
            num_swa_pages=self.num_swa_pages if num_swa_pages is None else num_swa_pages,
            max_pages_per_request=self.max_pages_per_request if max_pages_per_request is None else max_pages_per_request,
        )
        self.version += 1

    @property
    def swa_pages_bound(self) -> int:
        """The most SWA pages one request can ever hold."""
        return swa_pages_bound_for(page_size=self.page_size, swa_keep=self.swa_keep,
                                   max_step_tokens=self.max_step_tokens)

    @property
    def num_free_full(self) -> int:
        return len(self._free_full)

    @property
    def num_free_swa(self) -> int:
        return len(self._free_swa)

    @property
    def requests(self) -> tuple[Hashable, ...]:
        return tuple(self._requests)

    def add(self, rid: Hashable) -> None:
        if rid is None:
            raise ValueError("None marks a padding row in page_table; it cannot be a request id")
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already in the page pool")
        self._requests[rid] = _Request()

    def free(self, rid: Hashable) -> None:
        """Returns all pages of `rid` and forgets it; it may be added again and start from position 0."""
        request = self._requests.pop(rid)
        for j, swa_page in request.swa_pages.items():
            self.swa_of_full[request.full_pages[j]] = 0
            self._free_swa.append(swa_page)
        self._free_full.extend(reversed(request.full_pages))
        if request.swa_pages:
            self.version += 1

    def _plan(self, rid: Hashable, start: int, end: int) -> tuple[list[int], list[int], int]:
        """Checks a step writing [start, end) and returns (logical pages to release from the SWA pool, logical pages
        still missing an SWA page, number of new full pages)."""
        request = self._requests[rid]
        if not 0 <= start <= end:
            raise ValueError(f"bad step [{start}, {end}) for request {rid!r}")
        if end - start > self.max_step_tokens:
            raise ValueError(f"step [{start}, {end}) writes more than max_step_tokens={self.max_step_tokens}")
        capacity = self.max_pages_per_request * self.page_size
        if end > capacity:
            raise ValueError(f"step [{start}, {end}) goes past the {capacity} positions a request may hold")
        if start < request.start:
            raise ValueError(
                f"request {rid!r} moved back from start {request.start} to {start}; its earlier SWA pages are "
                "released (free and re-add it to start over)"
            )
        num_pages = _ceil_div(end, self.page_size)
        first_window_page = max(0, start - self.swa_keep) // self.page_size
        released = [j for j in request.swa_pages if j < first_window_page]
        missing = [j for j in range(first_window_page, num_pages) if j not in request.swa_pages]
        return released, missing, max(0, num_pages - len(request.full_pages))

    def can_prepare(self, rid: Hashable, start: int, end: int) -> bool:
        """Whether `prepare(rid, start, end)` would succeed now; changes nothing."""
        released, missing, new_full = self._plan(rid, start, end)
        return new_full <= len(self._free_full) and len(missing) <= len(self._free_swa) + len(released)

    def prepare(self, rid: Hashable, start: int, end: int) -> bool:
        """Before a step that reads the window and writes [start, end): full pages for [0, end), SWA pages for every
        logical page meeting [max(0, start - swa_keep), end), and SWA pages wholly below that window released.

        All or nothing: returns False, changing nothing, when the free lists cannot supply the pages.
        """
        released, missing, new_full = self._plan(rid, start, end)
        if new_full > len(self._free_full) or len(missing) > len(self._free_swa) + len(released):
            return False
        request = self._requests[rid]
        for _ in range(new_full):
            request.full_pages.append(self._free_full.pop())
        # Release first: a page that left every window may serve this very step.
        for j in released:
            self._free_swa.append(request.swa_pages.pop(j))
            self.swa_of_full[request.full_pages[j]] = 0
        for j in missing:
            request.swa_pages[j] = self._free_swa.pop()
            self.swa_of_full[request.full_pages[j]] = request.swa_pages[j]
        if released or missing:
            self.version += 1
        request.start = start
        return True

    def page_table(self, rids: Sequence[Hashable | None], width: int | None = None) -> np.ndarray:
        """Full-pool page ids of each request's logical pages, 0-padded: int32[len(rids), width].

        `width` defaults to max_pages_per_request; a None in `rids` gives an all-zero padding row.
        """
        width = self.max_pages_per_request if width is None else width
        table = np.zeros((len(rids), width), np.int32)
        for row, rid in enumerate(rids):
            if rid is None:
                continue
            pages = self._requests[rid].full_pages
            if len(pages) > width:
                raise ValueError(f"request {rid!r} holds {len(pages)} pages, more than the table width {width}")
            table[row, : len(pages)] = pages
        return table

"""KV pages on demand (I14): the controller owns the page pool, commands carry every page change.

A sequence holds ``ceil(tokens / page_size)`` pages, allocated as it grows rather than reserved
at full length up front, so ``max_batch x max_model_len`` may exceed the KV pool. The scheduler
admits a request only while enough pages stay free (a watermark keeps room for the running
requests' next pages), and when a running request needs a page that the pool no longer has, it
preempts the most recently admitted request: frees its pages and queues it again, to be
recomputed later from its prompt plus the tokens it already generated (vLLM's recompute
preemption; Kwon et al., "Efficient Memory Management for LLM Serving with PagedAttention",
SOSP 2023, section 4.5).

Every page id a rank writes through is chosen here, in the controller, and travels inside the
step command (`PageAssign`, `Retire.pages`, `Preempt.pages`); a worker keeps its own `PageMap`
only to check each change against its view -- a page handed out must be free, a freed page
must be the one the request holds, a decode row must hold the page its position writes -- and
poisons itself on a mismatch. A worker that picked pages from its own free list would agree with
its peers only as long as every rank's history is identical; and a page reused while a row of
the same step still reads or writes it corrupts another sequence's KV (SGLang #1394 and vLLM
#5493 show both shapes in real schedulers; see docs/design.md).
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Iterable
from itertools import repeat

from protocol.commands import Admit, DecodeRow, DecodeRows, PageAssign
from protocol.errors import PageError


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens (ceil division); 0 tokens need 0 pages."""
    return -(-tokens // page_size)


class PagePool:
    """The controller's page pool and per-request page tables.

    Free pages are handed out lowest id first, so a run is a pure function of its commands.

    Args:
        num_pages: pages available to sequences (the padding page is not among them).
        page_size: tokens per page.
        max_pages_per_seq: pages of one full-length sequence; a request is never given more.
        watermark_pages: pages admission leaves free for the running requests' growth.

    Raises:
        PageError: a non-positive size, or a watermark as large as the pool.
    """

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int,
                 watermark_pages: int = 0):
        if num_pages < 1 or page_size < 1 or max_pages_per_seq < 1:
            raise PageError(f"page pool of {num_pages} pages of {page_size} tokens, "
                            f"{max_pages_per_seq} per sequence: each must be at least 1")
        if not 0 <= watermark_pages < num_pages:
            raise PageError(f"watermark of {watermark_pages} pages must be in [0, {num_pages})")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.watermark_pages = watermark_pages
        # free pages: every page from ``_fresh`` up, plus the heap of pages released below it
        # (lowest id first either way; no list of every page is built for a large pool)
        self._fresh = 0
        self._released: list[int] = []
        self.tables: dict[int, list[int]] = {}

    @property
    def free_count(self) -> int:
        """Pages not held by any request."""
        return self.num_pages - self._fresh + len(self._released)

    def held(self, request_id: int) -> int:
        """Pages ``request_id`` holds (0 if none)."""
        return len(self.tables.get(request_id, ()))

    def growth(self, request_id: int, tokens: int) -> int:
        """Extra pages ``request_id`` needs to hold ``tokens`` tokens (0 if it already does)."""
        return max(0, pages_for(tokens, self.page_size) - self.held(request_id))

    def can_admit(self, tokens: int, running: int) -> bool:
        """Admission by free pages: a prompt of ``tokens`` tokens is admitted if its pages leave
        the watermark free; with no request ``running`` the watermark is waived, so a lone
        request that fits the pool always makes progress."""
        need = pages_for(tokens, self.page_size)
        reserve = self.watermark_pages if running else 0
        return need <= self.free_count - reserve

    def allocate(self, request_id: int, tokens: int) -> PageAssign | None:
        """Give ``request_id`` the pages it lacks to hold ``tokens`` tokens, lowest ids first.

        Returns the assignment (its ``slot`` is -1; the caller sets it), or None if none is needed.
        Raises:
            PageError: not enough free pages, or more than ``max_pages_per_seq``.
        """
        count = self.growth(request_id, tokens)
        if count == 0:
            return None
        table = self.tables.setdefault(request_id, [])
        if len(table) + count > self.max_pages_per_seq:
            raise PageError(f"request {request_id} needs {len(table) + count} pages for {tokens} "
                            f"tokens, above {self.max_pages_per_seq} per sequence")
        if count > self.free_count:
            raise PageError(f"request {request_id} needs {count} more pages, "
                            f"{self.free_count} are free")
        pages = tuple(self._take() for _ in range(count))
        first = len(table)
        table.extend(pages)
        return PageAssign(request_id=request_id, slot=-1, first_index=first, pages=pages)

    def release(self, request_id: int) -> tuple[int, ...]:
        """Free every page of ``request_id``; returns them in page-table order."""
        pages = tuple(self.tables.pop(request_id, ()))
        for page in pages:
            heapq.heappush(self._released, page)
        return pages

    def _take(self) -> int:
        """The lowest free page id, now held."""
        if self._released:
            return heapq.heappop(self._released)
        self._fresh += 1
        return self._fresh - 1

    def fingerprint(self) -> tuple:
        """Hashable view: sorted (request id, pages) pairs."""
        return tuple(sorted((r, tuple(p)) for r, p in self.tables.items()))


class PageMap:
    """A worker's copy of the page tables, changed only by the page changes a command carries.

    Every change is checked against this rank's view; a mismatch raises PageError, which poisons
    the worker (its pages no longer match the controller's, I14).

    Args:
        num_pages: pages in this rank's KV cache.
        page_size: tokens per page.
    """

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.owner: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}

    def fingerprint(self) -> tuple:
        """Hashable view: sorted (request id, pages) pairs."""
        return tuple(sorted((r, tuple(p)) for r, p in self.tables.items()))

    def assign(self, assign: PageAssign) -> None:
        """Append ``assign.pages`` to the request's table at ``assign.first_index``; each page
        must be in range and free in this rank's view."""
        table = self.tables.get(assign.request_id, [])
        if assign.first_index != len(table):
            raise PageError(f"pages {list(assign.pages)} for request {assign.request_id} at "
                            f"index {assign.first_index}, but it holds {len(table)} pages")
        for page in assign.pages:
            if not 0 <= page < self.num_pages:
                raise PageError(f"page {page} for request {assign.request_id} is outside "
                                f"[0, {self.num_pages})")
            if page in self.owner:
                raise PageError(f"page {page} given to request {assign.request_id} is still "
                                f"held by request {self.owner[page]}")
        if len(set(assign.pages)) != len(assign.pages):
            raise PageError(f"pages {list(assign.pages)} for request {assign.request_id} repeat")
        for page in assign.pages:
            self.owner[page] = assign.request_id
        self.tables[assign.request_id] = table + list(assign.pages)

    def release(self, request_id: int, pages: Iterable[int]) -> None:
        """Free the pages of ``request_id``; ``pages`` must be exactly the ones it holds."""
        pages = tuple(pages)
        held = tuple(self.tables.get(request_id, ()))
        if pages != held:
            raise PageError(f"release of pages {list(pages)} from request {request_id}, "
                            f"but it holds {list(held)}")
        for page in held:
            del self.owner[page]
        self.tables.pop(request_id, None)

    def check_admit(self, admit: Admit) -> None:
        """An admitted prompt must hold exactly the pages its tokens fill."""
        held = len(self.tables.get(admit.request_id, ()))
        need = pages_for(len(admit.prompt), self.page_size)
        if held != need:
            raise PageError(f"request {admit.request_id} is prefilled with {len(admit.prompt)} "
                            f"tokens but holds {held} pages ({need} needed)")

    def check_chunk(self, chunk) -> None:
        """A chunk (`protocol.commands.Chunk`) must leave its request holding exactly the
        pages of the tokens written so far: ``chunk.end`` of them."""
        held = len(self.tables.get(chunk.request_id, ()))
        need = pages_for(chunk.end, self.page_size)
        if held != need:
            raise PageError(f"chunk of request {chunk.request_id} writes positions "
                            f"{chunk.start}..{chunk.end - 1} but it holds {held} pages "
                            f"({need} needed)")

    def check_row(self, row: DecodeRow) -> None:
        """A decode row writes position ``row.position``: its request must hold that page."""
        held = len(self.tables.get(row.request_id, ()))
        if row.position // self.page_size >= held:
            raise PageError(f"decode row of request {row.request_id} writes position "
                            f"{row.position} (page index {row.position // self.page_size}), but "
                            f"it holds {held} pages")

    def check_rows(self, rows: DecodeRows) -> None:
        """Every decode row's request must hold the page its position writes (`check_row`
        for each), checked as C-level passes over the step's columns; the first row that
        fails is named."""
        try:
            held = map(len, map(self.tables.__getitem__, rows.request_ids))
            index = map(operator.floordiv, rows.positions, repeat(self.page_size))
            if all(map(operator.lt, index, held)):
                return
        except KeyError:  # a request with no page table: named below
            pass
        for row in rows:
            self.check_row(row)

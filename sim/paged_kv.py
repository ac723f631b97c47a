"""The modelled paged KV cache of one rank (I14): page cells, a page table per slot, and a write
version per page, and
the length of each slot's cached sequence (the engine's ``seq_lens``), which a prefill chunk
must continue (I19).

Storage is ``pages`` pages of ``page_size`` cells plus one padding page; a slot reaches storage
only through its page-table row, as the engine's decode kernel does: position p of the sequence
in slot s lives in cell ``p % page_size`` of page ``table[s][p // page_size]``, and a position
past the row's pages falls on the padding page (so a missing page assignment, a stale row or a
reused page changes what a row reads, and with it the modelled next token). Moving a slot moves
its row; the pages stay where they are. Every write bumps its page's version, so a reader queued
before a write can tell that the page changed under it.
"""

from __future__ import annotations

NEVER_WRITTEN = -1
"""A cell no kernel wrote."""


class PagedKV:
    """One KV-cache allocation of one rank, paged.

    Args:
        slots: slots including the scratch slot (whose row stays empty: padding rows write the
            padding page).
        pages: pages available to sequences; page ``pages`` is the padding page.
        page_size: cells (tokens) per page.
    """

    def __init__(self, slots: int, pages: int, page_size: int):
        self.slots, self.pages, self.page_size = slots, pages, page_size
        self.padding_page = pages
        self.cells: dict[int, list[int]] = {}
        self.versions: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # slot -> tokens its sequence caches (seq_lens)

    def page_of(self, slot: int, position: int) -> int:
        """The page that holds ``position`` of ``slot`` (the padding page past the row)."""
        row = self.tables.get(slot, ())
        index = position // self.page_size
        return row[index] if index < len(row) else self.padding_page

    def write(self, slot: int, position: int, token: int) -> None:
        """Write ``token`` at ``position`` of ``slot``, through its page table."""
        page = self.page_of(slot, position)
        cells = self.cells.get(page)
        if cells is None:  # not `setdefault`, which would build a page of cells at every write
            cells = self.cells[page] = [NEVER_WRITTEN] * self.page_size
        cells[position % self.page_size] = token
        self.versions[page] = self.versions.get(page, 0) + 1

    def read(self, slot: int, upto: int) -> tuple[int, ...]:
        """What an attention read of ``slot`` sees at positions 0..upto."""
        ps = self.page_size
        row = self.tables.get(slot, ())
        out: list[int] = []
        n = upto + 1
        for index in range(0, (n + ps - 1) // ps):  # page by page: `page_of` of each position
            page = row[index] if index < len(row) else self.padding_page
            cells = self.cells.get(page)
            take = min(ps, n - index * ps)
            out += cells[:take] if cells is not None else (NEVER_WRITTEN,) * take
        return tuple(out)

    def copy(self, src: int, dst: int) -> None:
        """Compaction: slot ``dst`` takes slot ``src``'s page-table row and length; ``src`` is
        left empty."""
        self.tables[dst] = self.tables.pop(src, [])
        self.lengths[dst] = self.lengths.pop(src, 0)

    def assign(self, slot: int, first_index: int, pages: tuple[int, ...]) -> None:
        """Write ``pages`` into ``slot``'s row from ``first_index`` on (the command's page ids)."""
        row = self.tables.setdefault(slot, [])
        del row[first_index:]
        row.extend([self.padding_page] * (first_index - len(row)))
        row.extend(pages)

    def clear(self, slot: int) -> None:
        """``slot``'s request left: its row is emptied (its pages went back to the pool)."""
        self.tables.pop(slot, None)
        self.lengths.pop(slot, None)

    def empty_like(self) -> "PagedKV":
        """A fresh, never-written cache of the same shape (empty page tables)."""
        return PagedKV(self.slots, self.pages, self.page_size)

    def version(self, page: int) -> int:
        """How many writes ``page`` has taken."""
        return self.versions.get(page, 0)

    def fingerprint(self) -> tuple:
        """Hashable contents: page cells and page-table rows."""
        return (tuple(sorted((p, tuple(c)) for p, c in self.cells.items())),
                tuple(sorted((s, tuple(r)) for s, r in self.tables.items())),
                tuple(sorted(self.lengths.items())))

"""Paged KV cache with a device-resident page table, sequence lengths and padding page/slot.

Layout (per rank, for this rank's kv heads only):
    k, v:        [num_layers, num_pages + 1, page_size, kv_heads, head_dim]; page `num_pages`
                 is the reserved padding page, never handed out.
    page_table:  int32 [max_slots + 2, max_pages_per_seq]; row `max_slots` is the padding
                 slot, row `max_slots + 1` the chunk slot (the sequence of a chunked prefill
                 between its chunks, `protocol.commands.Chunk`). Unused entries point at the
                 padding page, so any read is in bounds.
    seq_lens:    int32 [max_slots + 2]: tokens held by each slot (the padding slot holds 1).

Token at position p of the sequence in slot s is stored at page page_table[s, p // page_size],
row p % page_size. A decode slot is only a row of the page table: moving a slot copies its row
and length, the pages themselves stay where they are. Page ids are chosen by the controller as
sequences grow and arrive in commands (I2, I14); this class only applies them.
"""

from __future__ import annotations

from itertools import repeat

import torch


class KVCache:
    """The KV cache of one rank. All tensors live on `device` at fixed addresses.

    Args:
        num_layers, kv_heads, head_dim: model shape on this rank.
        num_pages: pages available to sequences (one more is allocated for padding).
        page_size: tokens per page.
        max_slots: decode slots (one more is allocated for padding rows).
        max_pages_per_seq: width of the page table, i.e. ceil(max context / page_size).
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int, max_slots: int, max_pages_per_seq: int, dtype: torch.dtype,
                 device="cpu"):
        self.num_pages, self.page_size = num_pages, page_size
        self.max_slots, self.max_pages_per_seq = max_slots, max_pages_per_seq
        self.padding_page, self.padding_slot = num_pages, max_slots
        self.chunk_slot = max_slots + 1
        shape = (num_layers, num_pages + 1, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_table = torch.full((max_slots + 2, max_pages_per_seq), self.padding_page,
                                     dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_slots + 2, dtype=torch.int32, device=device)
        self.seq_lens[self.padding_slot:self.padding_slot + 1].fill_(1)
        self._staged: tuple[list[int], list[int], list[int]] = ([], [], [])  # slot, index, page

    @property
    def nbytes(self) -> int:
        """Bytes held by K and V."""
        return 2 * self.k.numel() * self.k.element_size()

    def assign_pages(self, slot: int, first_index: int, page_ids: list[int]) -> None:
        """Set page_table[slot, first_index : first_index + len(page_ids)] = page_ids now
        (`stage_pages`, then `flush_pages`).

        Raises:
            ValueError: slot, index or page id out of range, or the padding page/slot used.
        """
        self.stage_pages(slot, first_index, page_ids)
        self.flush_pages()

    def stage_pages(self, slot: int, first_index: int, page_ids: list[int]) -> None:
        """Check a page-table write and hold it until `flush_pages`, which writes every staged
        entry in one host-to-device copy and one scatter: a step's page assignments (one per
        admission and per row crossing into a new page) cost one copy, not one each.
        `move_slot` and `clear_slot` flush first, so writes keep their order.

        Raises:
            ValueError: slot, index or page id out of range, or the padding page/slot used.
        """
        if not (0 <= slot < self.max_slots or slot == self.chunk_slot):
            raise ValueError(f"slot {slot} is neither a decode slot [0, {self.max_slots}) nor "
                             f"the chunk slot {self.chunk_slot}")
        if first_index < 0 or first_index + len(page_ids) > self.max_pages_per_seq:
            raise ValueError(f"page index {first_index}+{len(page_ids)} exceeds "
                             f"max_pages_per_seq {self.max_pages_per_seq}")
        if page_ids and not (0 <= min(page_ids) and max(page_ids) < self.num_pages):
            raise ValueError(f"page ids {list(page_ids)} out of range [0, {self.num_pages})")
        n = len(page_ids)
        self._staged[0].extend(repeat(slot, n))
        self._staged[1].extend(range(first_index, first_index + n))
        self._staged[2].extend(page_ids)

    def flush_pages(self) -> None:
        """Write the staged page-table entries (see `stage_pages`); nothing when none are."""
        if not self._staged[0]:
            return
        flat = torch.tensor(self._staged[0] + self._staged[1] + self._staged[2],
                            dtype=torch.int64)
        self._staged = ([], [], [])
        if self.page_table.is_cuda:  # pinned (cached by torch's host allocator), no host wait
            flat = flat.pin_memory().to(self.page_table.device, non_blocking=True)
        slots, index, pages = flat.view(3, -1)
        self.page_table[slots, index] = pages.to(torch.int32)

    # Slot moves and clears run between steps while the previous step may still be on the
    # device (overlapped scheduling), so each is a device op on views: `seq_lens[slot] = 0`
    # (a Python scalar stored through indexing) blocked the host until the stream drained, 1.8
    # ms a call on an H200 in workload W, and the GPU then idled while the next step was built.

    def move_slot(self, src: int, dst: int) -> None:
        """Move the sequence in slot `src` to slot `dst` (page-table row and length); `src` is
        left empty (padding page, length 0). Enqueued on the device; the host does not wait."""
        self.flush_pages()
        self.page_table[dst].copy_(self.page_table[src])
        self.seq_lens[dst:dst + 1].copy_(self.seq_lens[src:src + 1])
        self.clear_slot(src)

    def clear_slot(self, slot: int) -> None:
        """Forget slot `slot`'s pages (they went back to the controller's pool). Enqueued on the
        device; the host does not wait."""
        self.flush_pages()
        self.page_table[slot].fill_(self.padding_page)
        self.seq_lens[slot:slot + 1].zero_()

    def write(self, layer: int, slot_ids: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] of tokens at `positions` [T] of `slot_ids` [T].

        Device-only indexing: no host value is read, so this is safe inside a CUDA graph.
        """
        pos = positions.long()
        pages = self.page_table[slot_ids.long(), pos // self.page_size].long()
        flat = pages * self.page_size + pos % self.page_size
        kv_shape = (-1,) + tuple(self.k.shape[3:])
        self.k[layer].view(kv_shape).index_copy_(0, flat, k.to(self.k.dtype))
        self.v[layer].view(kv_shape).index_copy_(0, flat, v.to(self.v.dtype))

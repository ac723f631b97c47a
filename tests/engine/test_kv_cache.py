"""The paged KV cache: page table rows, padding page/slot, writes at (slot, position)."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache


def _cache():
    return KVCache(num_layers=2, kv_heads=2, head_dim=4, num_pages=6, page_size=16,
                   max_slots=3, max_pages_per_seq=2, dtype=torch.float32)


def test_padding_page_and_slot_are_reserved():
    kv = _cache()
    assert kv.k.shape == (2, 7, 16, 2, 4)
    assert kv.padding_page == 6 and kv.padding_slot == 3
    assert (kv.page_table == 6).all()
    assert kv.page_table.dtype == torch.int32 and kv.page_table.shape == (5, 2)
    assert int(kv.seq_lens[3]) == 1 and kv.chunk_slot == 4
    with pytest.raises(ValueError, match="page ids"):
        kv.assign_pages(0, 0, [6])
    with pytest.raises(ValueError, match="slot 3 is neither a decode slot"):
        kv.assign_pages(3, 0, [0])
    kv.assign_pages(4, 0, [5])  # the chunk slot holds pages between a prompt's chunks
    assert kv.page_table[4].tolist() == [5, 6]


def test_write_lands_on_the_page_of_the_position():
    kv = _cache()
    kv.assign_pages(1, 0, [4, 2])
    k = torch.arange(2 * 2 * 4, dtype=torch.float32).view(2, 2, 4)
    kv.write(1, torch.tensor([1, 1], dtype=torch.int32), torch.tensor([3, 17]), k, -k)
    assert torch.equal(kv.k[1, 4, 3], k[0]) and torch.equal(kv.k[1, 2, 1], k[1])
    assert torch.equal(kv.v[1, 2, 1], -k[1])
    assert kv.k[0].abs().sum() == 0  # other layer untouched


def test_move_slot_moves_row_and_length():
    kv = _cache()
    kv.assign_pages(2, 0, [5, 1])
    kv.seq_lens[2] = 20
    kv.move_slot(2, 0)
    assert kv.page_table[0].tolist() == [5, 1] and int(kv.seq_lens[0]) == 20
    assert kv.page_table[2].tolist() == [6, 6] and int(kv.seq_lens[2]) == 0


def test_staged_page_writes_land_at_the_flush_in_order_with_moves_and_clears():
    kv = _cache()
    kv.stage_pages(0, 0, [3])
    kv.stage_pages(1, 0, [4, 2])
    assert (kv.page_table == 6).all()  # nothing written before the flush
    kv.move_slot(1, 2)  # flushes first: the move carries slot 1's staged pages
    assert kv.page_table.tolist() == [[3, 6], [6, 6], [4, 2], [6, 6], [6, 6]]
    kv.stage_pages(0, 1, [5])
    kv.clear_slot(0)  # the staged write lands, then the clear empties the row
    assert kv.page_table[0].tolist() == [6, 6]
    kv.stage_pages(1, 1, [0])
    kv.flush_pages()
    kv.flush_pages()  # nothing staged: no change
    assert kv.page_table.tolist() == [[6, 6], [6, 0], [4, 2], [6, 6], [6, 6]]
    with pytest.raises(ValueError, match=r"page ids \[1, 9\] out of range \[0, 6\)"):
        kv.stage_pages(1, 0, [1, 9])
    with pytest.raises(ValueError, match="page index 1\\+2 exceeds max_pages_per_seq 2"):
        kv.stage_pages(1, 1, [1, 2])

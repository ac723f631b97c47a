"""engine.rendezvous: the store spawned ranks meet at is bound by the spawning process from
before the ranks start until they are gone, so no other process can take its port between."""

from __future__ import annotations

import datetime
import socket

import pytest

from engine.rendezvous import HeldStore, join_process_group


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.timeout(60)
def test_held_store_keeps_its_port_until_closed():
    store = HeldStore(10)
    port = store.address.port
    assert port > 0
    assert not _bindable(port)
    store.close()
    assert _bindable(port)


def _join_and_sum(rank: int, address, queue) -> None:
    import torch
    import torch.distributed as dist

    join_process_group("gloo", address, rank, 2, datetime.timedelta(seconds=30))
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    dist.destroy_process_group()
    queue.put((rank, float(x)))


@pytest.mark.timeout(120)
def test_two_ranks_join_through_a_held_store():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = HeldStore(30)
    procs = [ctx.Process(target=_join_and_sum, args=(r, store.address, queue), daemon=True)
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        store.close()
    assert got == {0: 3.0, 1: 3.0}


@pytest.mark.timeout(300)
def test_spawned_ranks_hold_their_store_while_running(tiny_dir, monkeypatch):
    """Spawned ranks without an init method of the caller's meet at a port the controller
    holds from before they start (the window the old free-port choice left open) until the
    LLM is closed."""
    import engine.ranks as ranks_mod
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    seen = []

    class Recording(HeldStore):
        def __init__(self, timeout_s):
            super().__init__(timeout_s)
            seen.append((self.address.port, _bindable(self.address.port)))

    monkeypatch.setattr(ranks_mod, "HeldStore", Recording)
    with LLM(tiny_dir, tensor_parallel_size=2, max_batch=2, max_model_len=32) as llm:
        (port, bindable_at_start), = seen
        assert not bindable_at_start
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].token_ids) == 2
        assert not _bindable(port)
    assert _bindable(port)

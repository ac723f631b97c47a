"""engine.rendezvous: the store spawned ranks meet at is bound by the spawning process from
before the ranks start until they are gone, so no other process can take its port between."""

from __future__ import annotations

import datetime
import socket

import pytest

from engine.ranks import reap
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
    store = HeldStore()
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
    store = HeldStore()
    procs = [ctx.Process(target=_join_and_sum, args=(r, store.address, queue), daemon=True)
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=90) for _ in procs)
    finally:
        reap(procs, timeout_s=30)
        store.close()
    assert got == {0: 3.0, 1: 3.0}


@pytest.mark.timeout(60, method="thread")  # a wait in C++ ignores signals
def test_a_rank_alone_gives_up_after_its_timeout():
    """A rank whose peers never join fails once its client's timeout passes, instead of
    waiting on the store for torch's default of 30 minutes; the test's timeout is what tells
    the two apart."""
    from torch.distributed import DistError

    store = HeldStore()
    try:  # without the client's timeout this waits past the test's own timeout
        with pytest.raises(DistError):
            join_process_group("gloo", store.address, 0, 2, datetime.timedelta(seconds=2))
    finally:
        store.close()


@pytest.mark.timeout(60, method="thread")  # a wait in C++ ignores signals
def test_an_unreachable_store_fails_within_its_timeout():
    """A rank whose store is gone fails once its client's connect timeout passes (about twice
    it: torch retries a failed connect), not after TCPStore's default of 5 minutes; the test's
    timeout is what tells the two apart."""
    from torch.distributed import DistError

    store = HeldStore()
    address = store.address
    store.close()
    with pytest.raises(DistError):  # without the client's timeout: 5 minutes, past the test's
        join_process_group("gloo", address, 0, 2, datetime.timedelta(seconds=2))


@pytest.fixture
def recorded_stores(monkeypatch):
    """Each HeldStore the ranks module makes: (port, whether the port was free at once)."""
    import engine.ranks as ranks_mod

    seen = []

    class Recording(HeldStore):
        def __init__(self):
            super().__init__()
            seen.append((self.address.port, _bindable(self.address.port)))

    monkeypatch.setattr(ranks_mod, "HeldStore", Recording)
    return seen


@pytest.mark.timeout(300)
def test_spawned_ranks_hold_their_store_while_running(tiny_dir, recorded_stores):
    """Spawned ranks without an init method of the caller's meet at a port the controller
    holds from before they start (the window the old free-port choice left open) until the
    LLM is closed."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    with LLM(tiny_dir, tensor_parallel_size=2, max_batch=2, max_model_len=32) as llm:
        (port, bindable_at_start), = recorded_stores
        assert not bindable_at_start
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].token_ids) == 2
        assert not _bindable(port)
    assert _bindable(port)


@pytest.mark.timeout(300)
def test_a_failed_run_releases_the_store(tiny_dir, recorded_stores):
    """The abort path (a rank killed mid-run) stops the store too."""
    from engine.errors import RankError
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    with pytest.raises(RankError):
        with LLM(tiny_dir, tensor_parallel_size=2, max_batch=2, max_model_len=32,
                 _fault=(1, 6, "kill")) as llm:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=20, ignore_eos=True))
    (port, _), = recorded_stores
    assert _bindable(port)


@pytest.mark.timeout(300)
def test_an_init_method_of_the_callers_is_used(tiny_dir, tmp_path, recorded_stores):
    """A config that names its own init method (here a file, free of ports) makes no store."""
    import dataclasses

    from engine.engine_config import EngineConfig
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    config = dataclasses.replace(
        EngineConfig.create(tiny_dir, tensor_parallel_size=2, max_batch=2, max_model_len=32),
        dist_init_method=f"file://{tmp_path / 'rendezvous'}")
    with LLM(config) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2
    assert recorded_stores == []

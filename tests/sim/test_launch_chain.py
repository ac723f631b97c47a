"""sim.launch_chain: PDL ordering of a kernel chain, searched exhaustively for stale reads."""

from __future__ import annotations

import pytest

from sim.launch_chain import AFTER_WAIT, AT_EXIT, BEFORE_WAIT, KernelSpec, check_chain


def k(name, before=(), after=(), writes=(), trigger=AFTER_WAIT, pdl=True):
    return KernelSpec(name, pdl, frozenset(before), frozenset(after), frozenset(writes), trigger)


def test_reading_the_previous_kernels_output_before_the_wait_is_stale():
    chain = [k("qkv", writes={"qkv"}), k("norm", before={"qkv"}, writes={"q"})]
    res = check_chain(chain)
    assert res.stale is not None
    assert (res.stale.reader, res.stale.writer, res.stale.buffer) == ("norm", "qkv", "qkv")
    # shortest: the writer starts and waits (its trigger), the reader starts
    assert res.stale.trace == ("start qkv", "wait qkv", "start norm")


def test_the_same_read_after_the_wait_is_never_stale_and_the_kernels_do_overlap():
    res = check_chain([k("qkv", writes={"qkv"}), k("norm", after={"qkv"}, writes={"q"})])
    assert res.stale is None
    assert res.overlapped, "the reader never started before the writer completed: vacuous"


def test_what_was_written_two_launches_back_may_be_read_before_the_wait():
    chain = [k("copy", writes={"positions"}, pdl=False), k("gemm", writes={"qkv"}),
             k("norm", before={"positions"}, after={"qkv"})]
    assert check_chain(chain).stale is None


def test_a_trigger_before_the_wait_lets_a_read_two_launches_back_go_stale():
    """The rule's second half: every kernel waits before it triggers. A middle kernel that
    triggers first lets its successor start while the kernel two back is still running."""
    chain = [k("copy", writes={"positions"}), k("gemm", writes={"qkv"}, trigger=BEFORE_WAIT),
             k("norm", before={"positions"}, after={"qkv"})]
    res = check_chain(chain)
    assert res.stale is not None and res.stale.writer == "copy"
    assert res.stale.trace == ("start copy", "wait copy", "start gemm", "start norm")


def test_a_kernel_without_pdl_or_without_a_trigger_overlaps_nothing():
    chain = [k("a", writes={"x"}), k("b", after={"x"}, pdl=False), k("c", writes={"y"}),
             k("d", after={"y"}, trigger=AT_EXIT), k("e", after={"y"})]
    res = check_chain(chain)
    assert res.stale is None
    # b waits for a's completion; c may overlap b; e starts only once d completes
    assert res.overlapped


def test_a_write_before_the_wait_to_what_the_previous_kernel_reads_is_early():
    chain = [k("attention", after={"q"}, writes={"out"}), k("next", before=(), writes={"x"}),
             KernelSpec("bad", True, writes_before_wait=frozenset({"out"}))]
    res = check_chain(chain[:1] + chain[2:])
    assert res.stale is not None and res.stale.early_write
    assert "bad writes out before attention, which uses it" in str(res.stale)
    assert check_chain(chain).stale is None  # two launches back: attention has completed


def test_bad_specs_and_chains_are_refused():
    with pytest.raises(ValueError, match="trigger 'later'"):
        k("a", trigger="later")
    with pytest.raises(ValueError, match="without PDL: it has no wait"):
        k("a", before={"x"}, pdl=False)
    with pytest.raises(ValueError, match="empty chain"):
        check_chain([])


def test_a_chain_without_pdl_never_overlaps_and_says_so():
    # `overlapped` is what makes a clean result mean something: a chain whose kernels each
    # wait for the one before to complete must report no overlap, or every chain would
    chain = [k("a", writes={"x"}, pdl=False), k("b", after={"x"}, pdl=False),
             k("c", after={"x"}, pdl=False)]
    res = check_chain(chain)
    assert res.stale is None and not res.overlapped


def test_only_a_write_conflicts_with_an_earlier_kernel_s_read():
    """Two kernels may read one buffer at once (no conflict); a kernel that writes before its
    wait what an unfinished earlier kernel reads is early (write after read)."""
    head = [k("copy", writes={"p"}, pdl=False), k("gemm", writes={"x"})]
    reads_twice = head + [k("a", before={"p"}, after={"x"}, writes={"y"}),
                          k("b", before={"p"}, after={"y"})]
    assert check_chain(reads_twice).stale is None
    overwrites = head + [k("a", before={"p"}, after={"x"}, writes={"y"}),
                         KernelSpec("b", True, writes_before_wait=frozenset({"p"}))]
    res = check_chain(overwrites)
    assert res.stale is not None and res.stale.early_write and res.stale.writer == "a"

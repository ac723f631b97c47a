"""The trace checkers flag each invariant on a hand-written trace, and pass a clean one."""

from protocol.trace import TraceEvent as E
from protocol.invariants import check_trace


def send(seq, what="Step", detail=""):
    return E("controller", "send", what, seq, None, detail)


def op(rank, what, seq, detail="", ok=True):
    return E(f"rank{rank}", "op", what, seq, rank, detail, ok)


def reply(rank, seq, ok=True):
    return E(f"rank{rank}", "reply", "Reply", seq, rank, "", ok)


def names(events, **kw):
    return [v.invariant for v in check_trace(events, **kw)]


def test_clean_trace_passes():
    events = [send(0, "Warmup"), op(0, "warmup_collective", 0, "81920"), op(0, "synchronize", 0),
              reply(0, 0), send(1, "Capture"), op(0, "record", 1, "decode@8"), op(0, "upload", 1, "decode@8"),
              op(0, "synchronize", 1), reply(0, 1), send(2, "Launch"), op(0, "launch", 2, "decode@8"),
              op(0, "synchronize", 2), reply(0, 2), send(3, "Teardown"), op(0, "free_graphs", 3),
              op(0, "destroy_communicator", 3), reply(0, 3)]
    assert names(events, allreduce_bytes=lambda b: b * 10240) == []


def test_each_violation_is_named():
    assert "I1" in names([send(0), op(0, "synchronize", 0), op(1, "synchronize", 0), reply(0, 0), send(1)])
    assert "I3" in names([send(0, "Step"), op(0, "record", 0, "decode@8")])
    assert "I4" in names([op(0, "upload", 0, "decode@8"), op(1, "launch", 0, "decode@8")])
    assert "I5" in names([op(0, "record", 0, "decode@8")], allreduce_bytes=lambda b: b)
    assert "I6" in names([send(0, "Step"), E("controller", "watchdog-fire", "watchdog")])
    assert "I9" in names([op(0, "allocate_kv", 0), op(0, "upload", 1, "decode@8")])
    assert "I10" in names([op(0, "record", 0, "decode@8"), op(0, "destroy_communicator", 1)])
    assert "I11" in names([op(0, "launch", 0, "decode@8"), reply(0, 0)])
    assert "I11" in names([op(0, "run_eager", 0), op(0, "read_tokens", 0)])
    assert "I11" in names([op(0, "enqueue_sample", 0), op(0, "read_tokens", 0)])
    assert "I11" not in names([op(0, "enqueue_sample", 0), op(0, "synchronize", 0),
                               op(0, "read_tokens", 0), reply(0, 0)])
    assert "I12" in names([send(0, "Step"), op(0, "launch", 0, "decode@8")])
    assert "I13" in names([send(0), reply(0, 0, ok=False), send(1, "Step")])


def test_failed_ops_are_ignored():
    assert names([op(0, "record", 0, "decode@8: out of memory", ok=False)],
                 allreduce_bytes=lambda b: b) == []


def test_i12_flags_a_replay_that_read_other_rows_than_its_steps():
    # a backend that reports what the replay read (`ReplayRows`): the step's rows, then the
    # rows the replay buffers held; they differ when prepare_replay did not write them
    from protocol.invariants import check_i12_replay_metadata

    def launch(data):
        return E("rank0", "op", "launch", 0, 0, "decode@2", True, 0.0, data)

    stale = [send(0, "Step"), op(0, "prepare_replay", 0), launch(("(0,5,7)", "(0,4,7)"))]
    violation = check_i12_replay_metadata(stale)
    assert violation.invariant == "I12" and "prepare_replay did not write them" in violation.text
    assert (violation.rank, violation.step) == (0, 0)
    fresh = [send(0, "Step"), op(0, "prepare_replay", 0), launch(("(0,5,7)", "(0,5,7)"))]
    assert check_i12_replay_metadata(fresh) is None


def test_i9_counts_only_graphs_measured_before_the_kv_cache_was_sized():
    # the capture after KV sizing records the graph again; that record is no reservation
    unmeasured = [op(0, "record", 0, "decode@4"), op(0, "allocate_kv", 1),
                  op(0, "record", 2, "decode@8"), op(0, "upload", 2, "decode@8")]
    assert names(unmeasured) == ["I9"]
    measured = [op(0, "record", 0, "decode@8"), op(0, "allocate_kv", 1),
                op(0, "record", 2, "decode@8"), op(0, "upload", 2, "decode@8")]
    assert names(measured) == []


def data_op(rank, what, seq, data):
    return E(f"rank{rank}", "op", what, seq, rank, "", True, 0.0, data)


def _overlapped(read_in_step_1=0, await_in_step_1=0, mark_step_0=True):
    """Two overlapped steps on rank 0: step 0 samples and marks; step 1 enqueues, marks,
    waits for step ``await_in_step_1`` and reads the tokens of step ``read_in_step_1``."""
    step0 = [op(0, "launch", 0, "decode@8"), op(0, "enqueue_sample", 0)]
    step0 += [op(0, "mark_step", 0)] if mark_step_0 else []
    return step0 + [
        reply(0, 0), op(0, "launch", 1, "decode@8"), op(0, "enqueue_sample", 1),
        op(0, "mark_step", 1), data_op(0, "await_step", 1, (await_in_step_1,)),
        data_op(0, "read_tokens", 1, (read_in_step_1,)), reply(0, 1)]


def test_overlapped_steps_may_reply_with_their_own_marked_work_in_flight():
    assert "I11" not in names(_overlapped())


def test_overlap_violations_of_i11_are_named():
    # reading the step in flight (its own tokens) before they are awaited
    assert "I11" in names(_overlapped(read_in_step_1=1))
    # work of step 0 never marked: the reply to step 0 leaves unmarked work in flight
    assert "I11" in names(_overlapped(mark_step_0=False))
    # waiting for an earlier step than the one read (-1: nothing) leaves step 0 in flight
    assert "I11" in names(_overlapped(await_in_step_1=-1))


def test_a_reply_that_skips_the_wait_for_the_previous_step_is_i11():
    # rank 1 marks step 0, then in step 1 enqueues and marks but never awaits step 0's mark
    events = [op(1, "launch", 0, "decode@8"), op(1, "mark_step", 0), reply(1, 0),
              op(1, "launch", 1, "decode@8"), op(1, "mark_step", 1), reply(1, 1)]
    assert "I11" in names(events)
    waited = events[:5] + [data_op(1, "await_step", 1, (0,)), reply(1, 1)]
    assert "I11" not in names(waited)


def test_an_i4_launch_before_its_own_upload_says_the_launch_uploads_implicitly():
    """A fresh user read "rank 0 launched ... before rank(s) [0, 1] had uploaded it" as
    confusing: rank 0 is among the ranks it launched before. The text now says why, and only
    where the launching rank is among them."""
    from protocol.invariants import check_i4_capture_barrier

    own = check_i4_capture_barrier([op(1, "upload", 0, "decode@8"), op(0, "launch", 0, "decode@8"),
                                    op(0, "upload", 0, "decode@8")])
    assert own.text.endswith("before rank(s) [0] had uploaded it (itself included: a first "
                             "launch without an upload uploads implicitly)")
    peer = check_i4_capture_barrier([op(0, "upload", 0, "decode@8"), op(0, "launch", 0, "decode@8"),
                                     op(1, "upload", 0, "decode@8")])
    assert peer.text.endswith("before rank(s) [1] had uploaded it")

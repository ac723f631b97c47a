"""What an engine author driving `Controller` directly may pass wrong (a fresh helper's trial of
the protocol as a library, 2026-12-07): each is one line naming the value, raised before any
state changes, and the run is left as it was where the caller, not a rank, erred."""

import math
import re
import sys
from pathlib import Path

import pytest

from protocol.commands import Reply
from protocol.config import ProtocolConfig
from protocol.controller import Broadcast, Controller
from protocol.errors import ConfigError, ReplyError
from protocol.requests import Request
from tests.protocol.driver import drive

CONFIG = ProtocolConfig(buckets=(1, 2), max_batch=2)


@pytest.mark.parametrize("fields, words", [
    (dict(request_id=None, prompt=(1,)), "request_id=None must be a non-negative integer"),
    (dict(request_id=True, prompt=(1,)), "request_id=True must be a non-negative integer"),
    (dict(request_id=-1, prompt=(1,)), "request_id=-1 must be"),
    (dict(request_id=1, prompt=[1, 2]), "request 1: prompt=[1, 2] must be a tuple of token ids"),
    (dict(request_id=1, prompt="ab"), "request 1: prompt='ab' must be a tuple"),
    (dict(request_id=1, prompt=None), "request 1: prompt=None must be a tuple"),
    (dict(request_id=1, prompt=(1, 2.5)), "request 1: prompt token id 2.5 must be a "
                                          "non-negative integer"),
    (dict(request_id=1, prompt=(1, None)), "request 1: prompt token id None must be"),
    (dict(request_id=1, prompt=(-3,)), "request 1: prompt token id -3 must be"),
    (dict(request_id=1, prompt=(True,)), "request 1: prompt token id True must be"),
    (dict(request_id=1, prompt=(1,), max_tokens=True), "request 1: max_tokens=True must be"),
    (dict(request_id=1, prompt=(1,), stop_token_ids=5), "request 1: stop_token_ids=5 must be "
                                                        "a frozenset of token ids"),
    (dict(request_id=1, prompt=(1,), stop_token_ids=frozenset({-1})),
     "request 1: stop token id -1 must be"),
    (dict(request_id=-10**5000, prompt=(1,)),
     "request_id=<an integer of about 5001 digits> must be"),
])
def test_a_request_of_the_wrong_shape_is_refused_where_it_is_made(fields, words):
    """A list prompt, a float or negative id, an int as the stop tokens: the controller took
    them and failed later inside a step (a TypeError at its command building), with request
    tables half updated, so the next step's command made the ranks abort."""
    with pytest.raises(ConfigError) as info:
        Request(**fields)
    assert str(info.value).startswith(words) and "\n" not in str(info.value), info.value


@pytest.mark.parametrize("fields, words", [
    (dict(step_timeout_s=math.nan), "step_timeout_s=nan must be a positive, finite number"),
    (dict(watchdog_timeout_s=math.nan), "watchdog_timeout_s=nan must be"),
    (dict(step_timeout_s=math.inf), "step_timeout_s=inf must be"),
    (dict(watchdog_timeout_s=True), "watchdog_timeout_s=True must be"),
    (dict(cuda_graphs="no"), "cuda_graphs='no' must be True or False"),
    (dict(cuda_graphs=None), "cuda_graphs=None must be True or False"),
    (dict(shape=None), "shape=None: expected a protocol.config.ModelShape"),
    (dict(shape="qwen"), "shape='qwen': expected a protocol.config.ModelShape"),
    (dict(memory_headroom_bytes=True), "memory_headroom_bytes=True must be a non-negative"),
])
def test_a_timeout_that_never_expires_or_a_graph_switch_of_text_is_refused(fields, words):
    """NaN compared false with every clock, so a missing reply was waited for for ever;
    cuda_graphs="no" read as on."""
    with pytest.raises(ConfigError) as info:
        ProtocolConfig(buckets=(1, 2), max_batch=2, **fields)
    assert str(info.value).startswith(words), info.value


def _outstanding() -> Controller:
    ctrl = Controller(CONFIG)
    action = ctrl.next_action()
    assert isinstance(action, Broadcast)
    return ctrl


@pytest.mark.parametrize("reply, words", [
    (None, "reply None is not a protocol.commands.Reply"),
    (Reply("0", 0), "reply rank='0' must be an integer"),
    (Reply(True, 0), "reply rank=True must be an integer"),
    (Reply(1.0, 0), "reply rank=1.0 must be an integer"),
    (Reply(1, "0"), "reply seq='0' must be an integer"),
    (Reply(1, 0, ok="no"), "reply from rank 1: ok='no' must be True or False"),
])
def test_a_reply_of_the_wrong_type_fails_the_run_with_one_line(reply, words):
    """`Reply("0", seq)` was a TypeError from a comparison and left the run alive, None an
    AttributeError; `Reply(True, seq)` counted as rank 1 and ok="no" as success."""
    ctrl = _outstanding()
    seq = ctrl.current.seq
    if isinstance(reply, Reply) and reply.seq == 0:
        reply = Reply(reply.rank, seq, reply.ok)
    with pytest.raises(ReplyError) as info:
        ctrl.on_reply(reply)
    assert str(info.value).startswith(words), info.value
    assert ctrl.phase == "failed"


@pytest.mark.parametrize("rank", [9, -1, "x", True])
def test_a_dead_rank_outside_the_world_is_the_caller_s_error_and_the_run_goes_on(rank):
    """on_rank_dead(9) in a world of two aborted the run, naming a rank that never existed."""
    ctrl = _outstanding()
    with pytest.raises(ConfigError, match=r"^on_rank_dead\(.*\): not a rank of world size 2$"):
        ctrl.on_rank_dead(rank)
    assert ctrl.phase == "startup" and ctrl.failure is None


def test_after_a_failed_run_submit_and_take_finished_say_the_run_failed():
    """submit said "submitted after shutdown" of a run that had failed, and take_finished said
    "has not finished" for ever of a request that never would."""
    ctrl, _, _, _, _ = drive(CONFIG, [Request(0, (1,), max_tokens=4)], fail=(0, "read_tokens"))
    assert ctrl.phase == "failed"
    with pytest.raises(ConfigError, match=r"^request 5 submitted after the run failed \("):
        ctrl.submit(Request(5, (1,)))
    with pytest.raises(ConfigError, match=r"^request 0 did not finish: the run failed \("):
        ctrl.take_finished(0)
    with pytest.raises(ConfigError, match=r"^submit\(\(1, 2\)\): expected a "):
        Controller(CONFIG).submit((1, 2))


@pytest.mark.parametrize("kwargs, words", [
    (dict(config=None), "config=None: expected a protocol.config.ProtocolConfig"),
    (dict(config=CONFIG, clock=5), "clock=5: expected a function returning seconds"),
    (dict(config=CONFIG, pages_per_seq=0), "pages_per_seq=0 must be a positive integer"),
    (dict(config=CONFIG, pages_per_seq="8"), "pages_per_seq='8' must be a positive integer"),
    (dict(config=ProtocolConfig(buckets=(1, 2), max_batch=2, max_kv_pages=3), pages_per_seq=4),
     "max_kv_pages=3 is below pages_per_seq=4: no sequence of full length fits"),
])
def test_a_controller_of_bad_arguments_is_refused_when_built(kwargs, words):
    """pages_per_seq=0 raised a PageError out of every later next_action (shutdown included),
    the phase stuck at startup; "8" was a TypeError inside the memory plan; a pool below one
    sequence was found only after the whole startup sweep."""
    with pytest.raises(ConfigError) as info:
        Controller(**kwargs)
    assert str(info.value).startswith(words), info.value


@pytest.mark.parametrize("bad, shown", [
    (None, "None"), (math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf"), (True, "True"),
    ("5", "'5'"),
])
def test_a_clock_reading_that_is_no_finite_number_is_named_and_changes_nothing(bad, shown):
    """A hostile user's trial: a clock that returned None part-way through raised a TypeError
    at the watchdog's deadline comparison, and one that returned NaN compared false with every
    deadline, so neither the startup watchdog nor the step timeout could fire and the run read
    "done". Every reading `next_action` takes is checked: a bad one is a ConfigError naming it,
    raised before any state changes, so the run goes on once the clock reads a number again."""
    from protocol.controller import Abort, Done, Idle
    from protocol.eligibility import GraphPlan
    from protocol.worker import Worker
    from tests.protocol.driver import FakeBackend, deliver

    reading = [0.0]
    ctrl = Controller(CONFIG, clock=lambda: reading[0])
    workers = [Worker(r, 2, GraphPlan.from_config(CONFIG), CONFIG.max_batch) for r in range(2)]
    backends = [FakeBackend(r, None, 10**12) for r in range(2)]
    pending = [Request(0, (1, 2), max_tokens=3)]
    refused_in = set()
    for call in range(1000):
        if call % 3 == 0:  # every third reading is the bad value, in startup and in serving
            reading[0] = bad
            state = (ctrl.phase, ctrl.seq, ctrl.current, dict(ctrl.replies),
                     ctrl.watchdog.deadline)
            with pytest.raises(ConfigError) as info:
                ctrl.next_action()
            assert str(info.value) == (f"clock() returned {shown}: expected a finite int or "
                                       "float of seconds (the clock passed to the controller)")
            assert (ctrl.phase, ctrl.seq, ctrl.current, dict(ctrl.replies),
                    ctrl.watchdog.deadline) == state
            refused_in.add(ctrl.phase)
            continue
        reading[0] = float(call)
        action = ctrl.next_action()
        if isinstance(action, (Done, Abort)):
            break
        if isinstance(action, Idle):
            if pending:
                ctrl.submit(pending.pop())
            else:
                ctrl.shutdown()
            continue
        deliver(ctrl, workers, backends, action.command)
    assert isinstance(action, Done) and refused_in >= {"startup", "serving"}
    assert len(ctrl.take_finished(0)) == 3


def test_the_watchdog_names_a_bad_clock_reading_and_keeps_its_state():
    from protocol.watchdog import Watchdog

    reading = [None]
    dog = Watchdog(lambda: reading[0], 5.0)
    with pytest.raises(ConfigError, match=r"^clock\(\) returned None: expected a finite"):
        dog.arm()
    assert not dog.armed
    reading[0] = 1  # an int is a reading too
    dog.arm()
    reading[0] = math.nan
    with pytest.raises(ConfigError, match=r"^clock\(\) returned nan: "):
        dog.check((1,))
    assert dog.deadline == 6.0


@pytest.mark.parametrize("args, words", [
    ((5, 2, "plan", 2), "Worker rank=5 must be in 0..1"),
    ((-1, 2, "plan", 2), "Worker rank=-1 must be in 0..1"),
    ((0, "2", "plan", 2), "Worker world_size='2' must be a positive integer"),
    ((0, 2, "plan", 0), "Worker capacity=0 must be a positive integer"),
    ((0, 2, None, 2), "Worker plan=None: expected a protocol.eligibility.GraphPlan"),
])
def test_a_worker_of_bad_arguments_is_refused_when_built(args, words):
    """Every one was accepted: a rank-5 worker was caught only by the controller, a capacity
    of 0 at the first admission."""
    from protocol.eligibility import GraphPlan
    from protocol.worker import Worker

    args = tuple(GraphPlan.from_config(CONFIG) if a == "plan" else a for a in args)
    with pytest.raises(ConfigError) as info:
        Worker(*args)
    assert str(info.value).startswith(words), info.value


@pytest.mark.parametrize("method, value", [("profile_memory", 8 << 30),
                                           ("profile_memory", (-5, "x")),
                                           ("graph_memory", None)])
def test_a_backend_memory_report_of_the_wrong_kind_is_the_rank_s_failed_reply(method, value):
    """A backend whose profile_memory returned an int (not a tuple), or graph_memory None: the
    worker's reply raised a TypeError out of run_command, no reply came and the worker was not
    poisoned, so the controller waited for its timeout. Now the rank replies with the failure,
    naming the method, and the run aborts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs" / "examples" /
                           "protocol"))
    from echo_engine import EchoBackend, serve

    def backend(rank):
        echo = EchoBackend()
        if rank == 1:
            setattr(echo, method, lambda *args: value)
        return echo

    with pytest.raises(RuntimeError, match=rf"^the run aborted: .*rank\(s\) 1: TypeError: "
                                           rf"Backend\.{method} returned "):
        serve(CONFIG, 1, [[Request(0, (1,))]], backend=backend)


def test_shown_cuts_a_value_at_its_limit_with_a_mark():
    """`protocol.errors.shown`, the one-line form of a bad value in the protocol's errors."""
    from protocol.errors import shown

    assert shown("x" * 58) == repr("x" * 58)  # 60 characters with its quotes: whole
    assert shown("x" * 59) == repr("x" * 59)[:57] + "..." and len(shown("x" * 59)) == 60
    assert shown([1,
                  2]) == "[1, 2]" and shown(10**5000) == "<an integer of about 5001 digits>"
    assert len(shown("y" * 200, 80)) == 80


@pytest.mark.parametrize("token", [1.5, True, "x", [3]])
def test_a_sampled_token_id_that_is_no_token_fails_the_run_naming_it(token):
    """Rank 0's reply tokens were checked for their count only: 1.5 and True were stored as
    the request's output and fed back to the ranks; "x" failed a step later inside a rank.
    NO_TOKEN (None) stays a request that could not be sampled."""
    from tests.protocol.driver import FakeBackend

    class Sampler(FakeBackend):
        def run(self, op):
            result = super().run(op)
            return (token,) * len(result) if op.name == "read_tokens" else result

    with pytest.raises(ReplyError, match=rf"^rank 0 reply to step \d+: sampled token id "
                                         rf"{re.escape(repr(token))} must be an integer "):
        drive(CONFIG, [Request(0, (1,), max_tokens=3)], backends=[Sampler(0), FakeBackend(1)])


def test_a_step_reply_of_no_token_ends_that_request_and_the_run_goes_on():
    from tests.protocol.driver import FakeBackend

    class NoToken(FakeBackend):
        def run(self, op):
            result = super().run(op)
            return (None,) + result[1:] if op.name == "read_tokens" and result else result

    ctrl, _, _, _, action = drive(CONFIG, [Request(0, (1,), max_tokens=3),
                                           Request(1, (2,), max_tokens=3)],
                                  backends=[NoToken(0), FakeBackend(1)])
    assert ctrl.phase == "done" and ctrl.failure is None


def test_a_step_reply_of_a_list_says_a_tuple_is_needed():
    from tests.protocol.driver import FakeBackend

    class Listing(FakeBackend):
        def run(self, op):
            result = super().run(op)
            return list(result) if op.name == "read_tokens" else result

    with pytest.raises(ReplyError, match=r"must carry 1 token ids in slot order \(its rows, "
                                         r"then admissions\), got \[7\], not a tuple$"):
        drive(CONFIG, [Request(0, (1,), max_tokens=3)], backends=[Listing(0), FakeBackend(1)])

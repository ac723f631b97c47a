"""The overridable hooks of `Controller` and `Worker` are checked where the protocol takes their
results (`protocol.errors.checked_hook_result`): a variant's subclass that returned the wrong
kind of value failed deep inside the protocol, naming no hook, or (warmup sizes "abc") was
reported as a broken invariant (a fresh variant author's findings)."""

import pytest

from protocol.config import ProtocolConfig
from protocol.controller import Controller, Done
from protocol.errors import checked_hook_result
from protocol.requests import Request
from protocol.worker import Worker
from tests.protocol.driver import drive

SMALL = dict(buckets=(1, 2, 4), max_batch=4)


def test_a_valid_result_passes_through_and_an_invalid_one_is_named_and_clipped():
    value = object()
    assert checked_hook_result(value, "Controller.x", True, "anything") is value
    with pytest.raises(TypeError) as info:
        checked_hook_result("y" * 78, "Controller.x", False, "a list")  # repr: 80 characters
    assert str(info.value) == f"Controller.x returned '{'y' * 78}'; expected a list"
    with pytest.raises(TypeError) as info:
        checked_hook_result("y" * 79, "Worker.x", False, "a list")  # repr: 81 characters
    assert str(info.value) == f"Worker.x returned '{'y' * 76}...; expected a list"


@pytest.mark.parametrize("cls, hook, returned, words", [
    (Controller, "startup_stages", "abc", "Controller.startup_stages returned 'abc'; expected a "
                                          "list of stage names"),
    (Controller, "warmup_sizes", {4096}, "Controller.warmup_sizes returned {4096}; expected a "
                                         "tuple of message sizes in bytes, each an int > 0"),
    (Controller, "warmup_sizes", (0,), "Controller.warmup_sizes returned (0,); expected"),
    (Controller, "warmup_sizes", ("a",), "Controller.warmup_sizes returned ('a',); expected"),
    (Controller, "measure_keys", None, "Controller.measure_keys returned None; expected a tuple "
                                       "of protocol.keys.GraphKey"),
    (Controller, "measure_keys", {1}, "Controller.measure_keys returned {1}; expected"),
    (Controller, "sweep_commands", "x", "Controller.sweep_commands returned 'x'; expected a "
                                        "protocol.commands.Command or None"),
    (Controller, "fit_memory", 12, "Controller.fit_memory returned 12; expected a "
                                   "protocol.memory.MemoryPlan"),
    (Worker, "forward_ops", None, "Worker.forward_ops returned None; expected a list of "
                                  "protocol.backend.Op"),
    (Worker, "forward_ops", "launch", "Worker.forward_ops returned 'launch'; expected a list"),
    (Worker, "apply_page_changes", {1}, "Worker.apply_page_changes returned {1}; expected a list"),
])
def test_a_hook_returning_the_wrong_kind_of_value_is_named(monkeypatch, cls, hook, returned,
                                                           words):
    monkeypatch.setattr(cls, hook, lambda self, *args: returned)
    with pytest.raises(TypeError) as info:
        drive(ProtocolConfig(**SMALL), [Request(0, (1, 2), max_tokens=3)])
    assert str(info.value).startswith(words), info.value


@pytest.mark.parametrize("sizes", [(1,), [1, 4096]])
def test_warmup_sizes_of_any_positive_byte_count_in_a_list_or_tuple_are_taken(monkeypatch, sizes):
    monkeypatch.setattr(Controller, "warmup_sizes", lambda self: sizes)
    ctrl, _, _, sent, action = drive(ProtocolConfig(**SMALL), [Request(0, (1, 2), max_tokens=3)])
    assert isinstance(action, Done) and sent[0].sizes == tuple(sizes)

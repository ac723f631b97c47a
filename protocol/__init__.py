"""The TP step protocol: pure Python, no torch, no threads, no I/O.

A sans-IO core in the style of h11: the `Controller` turns replies into the next command,
each `Worker` turns a command into an ordered list of backend operations and their results
into a reply. Whoever drives them -- the simulator (`sim/`) or the real engine (`engine/`) --
moves the bytes and runs the operations; neither re-implements a protocol decision.
"""

from protocol.buckets import DEFAULT_DECODE_BUCKETS, select_bucket
from protocol.commands import (
    AllocateKV,
    Capture,
    Command,
    Finalize,
    Launch,
    MeasureGraphs,
    PageAssign,
    Preempt,
    ProfileMemory,
    Reply,
    Step,
    Teardown,
    Warmup,
)
from protocol.config import ModelShape, ProtocolConfig
from protocol.controller import Controller
from protocol.eligibility import GraphPlan
from protocol.errors import (
    ConfigError,
    EligibilityError,
    PageError,
    ProtocolError,
    RankFailure,
    ReplyError,
    SlotError,
    StepLockViolation,
    WatchdogExpired,
)
from protocol.keys import GraphKey
from protocol.pages import PageMap, PagePool
from protocol.worker import Worker

__all__ = [
    "AllocateKV", "Capture", "Command", "ConfigError", "Controller", "DEFAULT_DECODE_BUCKETS",
    "EligibilityError", "Finalize", "GraphKey", "GraphPlan", "Launch", "MeasureGraphs",
    "ModelShape", "PageAssign", "PageError", "PageMap", "PagePool", "Preempt", "ProfileMemory", "ProtocolConfig", "ProtocolError", "RankFailure", "Reply",
    "ReplyError", "SlotError", "Step", "StepLockViolation", "Teardown", "Warmup",
    "WatchdogExpired", "Worker", "select_bucket",
]

"""`sim.headroom.HeadroomAfter`: the memory headroom drawn over a row's own per-run draw (the
short path's workload and ``short_context``), run by run, and a trace of such a run that
records both draws and replays."""

from __future__ import annotations

import pickle

import pytest

from sim.headroom import HeadroomAfter, HeadroomDraw, KINDS, largest_headroom, refusal_expected
from sim.scenario import ShortPathDraw, default_scenario, short_path_on


def test_the_short_path_row_draws_the_headroom_over_each_run_s_own_draw():
    """`HeadroomAfter(ShortPathDraw)`: run i has ShortPathDraw's run i (prompts, max_tokens,
    short_context) and a headroom drawn against that scenario's own bound (a short_context
    changes the graph plan); run 0 keeps the base's headroom. A one-scenario search takes the
    four headroom members over run 0, then ShortPathDraw's own members, not every pairing."""
    base = short_path_on(default_scenario(buckets=(1, 2, 4, 8), max_batch=6))
    draw = HeadroomAfter(ShortPathDraw)(base, 3)
    own = ShortPathDraw(base, 3)
    assert draw(0) == own(0)
    for i in range(1, 13):
        sc = draw(i)
        assert sc.workload == own(i).workload
        assert sc.config.short_context == own(i).config.short_context
        assert sc == HeadroomDraw(own(i), 3)(i)
        assert refusal_expected(sc) == (KINDS[i % len(KINDS)] == "over")
        if KINDS[i % len(KINDS)] == "exact":
            assert sc.config.memory_headroom_bytes == largest_headroom(sc)
    assert pickle.loads(pickle.dumps(draw))(5) == draw(5)
    members = draw.members()
    assert members[:4] == HeadroomDraw(own(0), 3).members()
    assert members[4:] == own.members()


SHORT_DROPPING_FILE = '''
from protocol.controller import Controller
from protocol.memory import plan_memory
from sim.headroom import HeadroomAfter
from sim.scenario import ShortPathDraw, short_path_on
from sim.variants import Variant


class Dropping(Controller):
    def fit_memory(self, reports, graph_bytes):
        cap = self.memory.batch_cap if self.memory else self.config.max_batch
        return plan_memory(reports, graph_bytes, self.plan.buckets, cap,
                           self.config.kv_page_bytes, self.pages_per_seq, 0,
                           self.config.max_kv_pages)


DROPPED = Variant(name="my-short-headroom-dropped", summary="drops the headroom",
                  source="a test", expected={"shared": "invariant:I9", "per-rank": "invariant:I9"},
                  controller_cls=Dropping, adjust=short_path_on,
                  draw=HeadroomAfter(ShortPathDraw))
'''


@pytest.mark.timeout(120)
def test_a_trace_of_a_run_drawn_twice_records_both_draws_and_replays(tmp_path, capsys):
    """A counterexample of a row that draws its workload and short_context and then its
    headroom records all of them, and `--replay` accepts them: the workload's fields are the
    row's own draw's, under the headroom draw (`sim.check._own_draw`); before, a replay read
    such a trace's prompt lengths as an edit of a variant that draws no workload."""
    import json

    from lockstep.cli import main

    path = tmp_path / "short_dropping.py"
    path.write_text(SHORT_DROPPING_FILE)
    out = tmp_path / "traces"
    assert main(["check", "--variant-file", str(path), "--variant", "my-short-headroom-dropped",
                 "--topology", "shared", "--buckets", "1,2,4,8", "--max-batch", "6",
                 "--schedules", "14", "--fault-schedules", "0", "--no-progress", "--jobs", "1",
                 "--trace-out", str(out)]) == 0
    data = json.loads((out / "my-short-headroom-dropped.shared.json").read_text())
    scenario = data["scenario"]
    assert scenario["memory_headroom_bytes"] > 0 and "prompt_lengths" in scenario
    assert scenario["short_context"] is not None
    capsys.readouterr()
    assert main(["check", "--replay", str(out / "my-short-headroom-dropped.shared.json"),
                 "--variant-file", str(path)]) == 0
    assert "==> invariant (I9)" in capsys.readouterr().out

"""`python -m engine.bench.host_overhead`: the CPU host-path benchmark runs the real step loop
with the forward stubbed, counts the decode steps it times, and refuses bad arguments."""

from __future__ import annotations

import json

import pytest


@pytest.mark.timeout(300)
def test_bench_times_every_decode_step_at_each_batch(tmp_path, capsys):
    from engine.bench.host_overhead import main

    out = tmp_path / "h.json"
    assert main(["--batch-sizes", "1,3", "--steps", "4", "--repeats", "2", "--json",
                 str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["rows"] for r in doc["results"]] == [1, 3]
    for r in doc["results"]:
        assert r["steps"] == 4 * 2  # every decode step of every run, pooled
        parts = sum(r[f"{k}_ms_median"] for k in ("controller", "forward", "sample", "other"))
        assert r["wall_ms_median"] > 0 and parts > 0
        assert r["wall_ms_p99"] >= r["wall_ms_median"]
    table = capsys.readouterr().out
    assert "model forward stubbed" in table and "\n    3      8 " in table


@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "0"], "--batch-sizes 0: expected 1..256"),
    (["--batch-sizes", "1,x"], "--batch-sizes '1,x': 'x' is not an integer"),
    (["--batch-sizes", "1,1"], "--batch-sizes '1,1': 1 is given twice"),
    (["--steps", "1"], "--steps 1: expected 2..1000000"),
    (["--repeats", "0"], "--repeats 0: expected 1..10000"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    from engine.bench.host_overhead import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("where, words", [("dir", "is a directory; give a file path"),
                                          ("missing/h.json", "missing' does not exist; create it first or "
                                                            "choose another --json")])
def test_json_path_is_checked_before_the_run(tmp_path, capsys, monkeypatch, where, words):
    """Old behaviour: the whole measurement ran first, then open() raised a traceback."""
    import engine.bench.host_overhead as host_overhead

    def no_run(*a, **k):
        raise AssertionError("the run started before --json was checked")

    monkeypatch.setattr(host_overhead, "build_llm", no_run)
    (tmp_path / "dir").mkdir()
    path = str(tmp_path / where)
    assert host_overhead.main(["--steps", "2", "--repeats", "1", "--json", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--json {path!r}" in err and words in err

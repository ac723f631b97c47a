"""`lockstep check` from the command line: bad input exits 2 with one line; outputs are real."""

import json
import subprocess
import sys

import pytest

from lockstep.cli import main


@pytest.mark.parametrize("argv,needle", [
    (["check", "--ranks", "0"], "--ranks: 0 must be at least 1"),
    (["check", "--buckets", "8,4"], "ascending"),
    (["check", "--buckets", "a,b"], "'a,b' is not a comma-separated"),
    (["check", "--schedules", "x"], "--schedules: 'x' is not an integer"),
    (["check", "--time-budget", "-1"], "--time-budget: -1 must be positive"),
    (["check", "--strategy", "magic"], "invalid choice: 'magic'"),
    (["check", "--topology", "ring"], "invalid choice: 'ring'"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv,needle", [
    (["check", "--variant", "nope"], "unknown variant 'nope'"),
    (["check", "--variant-file", "/nonexistent.py"], "does not exist"),
    (["check", "--max-batch", "300"], "max_batch=300 exceeds the largest bucket 256"),
    (["check", "--replay", "/nonexistent.json"], "does not exist"),
])
def test_bad_values_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_replay_of_non_trace_json_exits_2(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    assert main(["check", "--replay", str(path)]) == 2
    assert "not a lockstep trace" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_fused_sweep_check_reports_deadlock_and_writes_replayable_trace(tmp_path, capsys):
    out = tmp_path / "traces"
    code = main(["check", "--variant", "fused-sweep", "--schedules", "30", "--no-progress",
                 "--trace-out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "fused-sweep" in text and "deadlock" in text and "driver lock" in text
    trace = out / "fused-sweep.shared.json"
    assert trace.exists() and (out / "fused-sweep.shared.mmd").read_text().startswith("sequenceDiagram")
    assert main(["check", "--replay", str(trace)]) == 0
    assert "replayed" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_json_output_and_exit_1_on_mismatch(tmp_path, capsys):
    variant = tmp_path / "v.py"
    variant.write_text(
        "from sim.variants import Variant\n"
        "WRONG = Variant(name='claims-clean-but-is-fused', summary='s', source='test',\n"
        "    expected={'shared': 'clean', 'per-rank': 'clean'},\n"
        "    controller_cls=__import__('sim.variants', fromlist=['x']).FusedSweepController,\n"
        "    worker_cls=__import__('sim.variants', fromlist=['x']).FusedSweepWorker)\n")
    code = main(["check", "--variant-file", str(variant), "--variant", "claims-clean-but-is-fused",
                 "--topology", "shared", "--schedules", "20", "--fault-schedules", "0", "--json",
                 "--no-progress"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["ok"] is False
    assert data["rows"][0]["got"] == "deadlock"


@pytest.mark.timeout(300)
def test_default_check_exits_0_from_the_console_script():
    proc = subprocess.run([sys.executable, "-m", "lockstep", "check", "--schedules", "40",
                           "--fault-schedules", "40", "--no-progress"],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "OK: 32/32 verdicts as expected" in proc.stdout

"""`lockstep bench`: bad arguments give one line naming the value and exit 2 before any GPU
work; the report (table, JSON) is built correctly from measured numbers."""

from __future__ import annotations

import json

import pytest

from engine.bench.options import BenchArgError, BenchOptions, validate
from lockstep.cli import main


@pytest.mark.parametrize("argv, needle", [
    (["--preset", "tiny", "--batch-sizes", "1,x"], "'x' is not an integer"),
    (["--preset", "tiny", "--batch-sizes", "0"], "--batch-sizes: batch size 0"),
    (["--preset", "tiny", "--compare", "hf", "--hf-batch-sizes", "0"],
     "--hf-batch-sizes: batch size 0"),
    (["--preset", "tiny", "--batch-sizes", "1,300"], "batch size 300"),
    (["--preset", "tiny", "--context-lens", "0"], "--context-lens: context length 0"),
    (["--preset", "tiny", "--context-lens", "5000"], "--context-lens: context length 5000"),
    (["--preset", "tiny", "-tp", "3"], "--tensor-parallel-size 3"),
    (["--preset", "tiny", "-tp", "0"], "--tensor-parallel-size 0"),
    (["--preset", "tiny", "--steps", "0"], "--steps 0"),
    (["--preset", "tiny", "--warmup", "-1"], "--warmup -1"),
    # built on the host per point: 10**22 steps passed every check and failed with a
    # traceback after the weights were on the GPU (a fresh user's finding)
    (["--preset", "tiny", "--steps", str(10**19)], f"--steps {10**19}: expected 1..100000"),
    (["--preset", "tiny", "--warmup", "100001"], "--warmup 100001: expected 0..100000"),
    (["--preset", "tiny", "--no-graphs", "--no-eager"], "nothing to measure"),
    (["--preset", "tiny", "--compare", "hf", "--hf-batch-sizes", "9999"], "batch size 9999"),
    (["--preset", "tiny", "--json", "/nonexistent-dir/x.json"], "--json"),
    (["--preset", "tiny", "--json", "/tmp"], "is a directory"),
    # os.access says yes to root here; only a test write tells (a fresh user's finding)
    (["--preset", "tiny", "--json", "/proc/x.json"], "cannot write in directory '/proc'"),
    (["--preset", "tiny", "--json", "/sys/x.json"], "cannot write in directory '/sys'"),
    (["--preset", "tiny", "--workload", "throughput", "--json", "/proc/x.json"],
     "cannot write in directory '/proc'"),
    # empty strings are not defaults (a fresh user's finding: '' fell back to --batch-sizes,
    # and `--model ''` read '.')
    (["--preset", "tiny", "--compare", "hf", "--hf-batch-sizes", ""],
     "--hf-batch-sizes '': '' is not an integer"),
    (["--preset", "tiny", "--batch-sizes", ""], "--batch-sizes '': '' is not an integer"),
    (["--model", ""], "--model is empty; name the model directory"),
    (["--preset", "tiny", "--seed", "-1"], "outside [0, 2**64)"),
    (["--preset", "tiny", "--seed", str(2**64)], f"{2**64} is outside [0, 2**64)"),
    (["--model", "/nonexistent-model-dir"], "/nonexistent-model-dir"),
    (["--preset", "nope"], "nope"),
    (["--preset", "tiny", "--model", "x"], "not allowed with"),
])
def test_bad_argument_is_one_line_naming_it_and_exit_2(argv, needle, capsys, monkeypatch):
    import torch

    def boom(*a, **k):  # any GPU probe before validation would be a bug
        raise AssertionError("touched CUDA before the argument checks")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    argparse_refuses = needle in ("nope", "not allowed with") or "outside [0, 2**64)" in needle
    with pytest.raises(SystemExit) if argparse_refuses else _nullctx():
        rc = main(["bench", *argv])
        assert rc == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("under", ["afile/x.json", "afile/sub/x.json"])
def test_a_json_path_under_a_file_names_the_file_as_not_a_directory(under, tmp_path, capsys,
                                                                    monkeypatch):
    """Old behaviour: "directory '.../afile' does not exist or is not writable" of a regular
    file afile (a tester's finding); checked before anything touches the GPU."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available",
                        lambda: pytest.fail("touched CUDA before the argument checks"))
    (tmp_path / "afile").write_text("x")
    out = str(tmp_path / under)
    assert main(["bench", "--preset", "tiny", "--json", out]) == 2
    assert capsys.readouterr().err == (
        f"lockstep bench: error: --json {out!r}: {str(tmp_path / 'afile')!r} is not a "
        "directory; give a path in a directory\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_no_cuda_is_a_one_line_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a CUDA GPU" in err and len(err.splitlines()) == 1
    assert err.count("lockstep bench") == 1  # it read 'lockstep bench: error: lockstep bench needs'


@pytest.mark.parametrize("workload", ["decode", "throughput"])
def test_a_plot_without_matplotlib_is_refused_before_the_run(workload, capsys, monkeypatch):
    """Old behaviour (a fresh user's reading): `--plot x.png` without matplotlib said
    "no plot written" only after the whole benchmark."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["bench", "--preset", "tiny", "--workload", workload, "--plot", "x.png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("lockstep bench: error: --plot x.png: needs matplotlib, which is not "
                   "installed (pip install matplotlib)")


@pytest.mark.parametrize("json_path, plot", [("r.json", "r.png"), ("out.d/r", "out.d/r.png"),
                                              ("out.d/r.json", "out.d/r.png"),
                                              ("r.png", "r.png.png")])
def test_the_implied_plot_sits_beside_the_json_and_never_on_it(json_path, plot):
    """Old behaviour: the path was cut at its last dot, so `--json r.png` plotted over the
    JSON and `--json out.d/r` plotted to out.png, outside out.d."""
    from engine.cli_bench import implied_plot_path

    assert implied_plot_path(json_path) == plot


@pytest.mark.parametrize("workload", ["decode", "throughput"])
def test_a_plot_on_the_json_file_is_refused_before_the_run(workload, tmp_path, capsys,
                                                           monkeypatch):
    """Old behaviour: `--json r.json --plot r.json` wrote the JSON, then the plot over it."""
    import importlib.util

    import torch

    def boom(*a, **k):
        raise AssertionError("touched CUDA before the argument checks")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    real = importlib.util.find_spec  # as if matplotlib were installed
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "matplotlib" else real(name, *a))
    out = str(tmp_path / "r.json")
    assert main(["bench", "--preset", "tiny", "--workload", workload, "--json", out,
                 "--plot", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"lockstep bench: error: --plot {out!r} is the --json file too: the plot "
                   "would overwrite the JSON; give another --plot")


def test_model_dir_checks_read_its_config(tiny_dir):
    cfg = validate(BenchOptions(model=str(tiny_dir), batch_sizes=[1, 2]))
    assert cfg["num_attention_heads"] == 4
    with pytest.raises(BenchArgError, match="--tensor-parallel-size 4: num_key_value_heads"):
        validate(BenchOptions(model=str(tiny_dir), tensor_parallel_size=4))


def _fake_rank(rank=0):
    return {"rank": rank, "read_bandwidth_Bps": 4e12, "weight_bytes": 8_000_000_000,
            "capture": {"buckets": 36, "seconds": 0.5, "graph_memory_bytes": 100 * 2**20,
                        "device_free_drop_bytes": 120 * 2**20},
            "graph_source": "engine.graphs",
            "points": [{"batch": 1, "bucket": 1, "context": 128, "kv_bytes": 4_000_000_000,
                        "graphs": {"median_ms": 4.0, "p90_ms": 4.2, "min_ms": 3.9, "n": 10},
                        "eager": {"median_ms": 20.0, "p90_ms": 21.0, "min_ms": 19.0, "n": 10},
                        "graph_vs_eager_max_abs": 0.0, "logits_finite": True}]}


def test_report_floor_ratios_and_json(tmp_path):
    from engine.bench.report import build_document, format_table, write_json

    hf = [{"batch": 1, "context": 128, "compile_s": 40.0, "median_ms": 8.0, "p90_ms": 8.1,
           "min_ms": 7.9, "n": 10}]
    doc = build_document(BenchOptions(preset="qwen3-4b"), [_fake_rank()], hf, "lockstep bench")
    row = doc["rows"][0]
    assert row["floor_ms"] == pytest.approx(3.0)          # 12e9 bytes / 4e12 B/s
    assert row["graphs_x_floor"] == pytest.approx(4.0 / 3.0)
    assert row["graphs_over_eager"] == pytest.approx(0.2)
    assert row["hf_over_engine"] == pytest.approx(2.0)
    assert row["graphs_tokens_per_s"] == pytest.approx(250.0)
    table = format_table(doc)
    assert "captured 36 graphs of 36 buckets in 0.500 s" in table and "100 MiB" in table
    assert "WARNING" not in table and "short path" not in table
    path = tmp_path / "b.json"
    write_json(doc, str(path))
    assert json.loads(path.read_text())["rows"][0]["batch"] == 1


def test_report_names_the_points_that_replayed_the_short_path():
    from engine.bench.report import build_document, format_table

    rank = _fake_rank()
    rank["capture"]["graphs"] = 37
    rank["points"][0].update(graph="decode-short@1", short_fused=True)
    rank["points"].append(dict(rank["points"][0], batch=8, bucket=8, graph="decode@8"))
    rank["points"].append(dict(rank["points"][0], context=64, short_fused=False))
    rank["points"].append(dict(rank["points"][0], context=32, short_fused=False,
                               short_tail=True))
    table = format_table(build_document(BenchOptions(preset="qwen3-4b"), [rank], [], "b"))
    assert "captured 37 graphs of 36 buckets" in table
    lines = table.splitlines()
    assert "short path (attention fused into o_proj) replayed at: batch 1 ctx 128" in lines
    assert ("short path (no rope epilogue or unfused: the decode path's kernels) "
            "replayed at: batch 1 ctx 64") in lines
    assert "short path (attention in the QKV launch's tail) replayed at: batch 1 ctx 32" in lines


def test_report_warns_when_graph_logits_differ():
    from engine.bench.report import build_document, format_table

    rank = _fake_rank()
    rank["points"][0]["graph_vs_eager_max_abs"] = 3.0
    doc = build_document(BenchOptions(preset="qwen3-4b"), [rank], [], "lockstep bench")
    assert "WARNING: batch 1" in format_table(doc)


def test_report_prints_the_kernel_profile_of_each_point():
    from engine.bench.report import build_document, format_table

    rank = _fake_rank()
    rank["config"] = {"num_layers": 36}
    rank["points"][0]["profile"] = {
        "launches": 290.0, "device_ms": 3.1, "top": [],
        "gemms": [{"gemm": "down_proj", "shape": "2560 x 9728", "weight_bytes": 49807360,
                   "calls": 180, "us": 16.0, "GBps": 3112.96, "of_read_bandwidth": 0.778}]}
    table = format_table(build_document(BenchOptions(preset="qwen3-4b"), [rank], [],
                                        "lockstep bench"))
    assert "batch 1 ctx 128: 290 kernels per step (8.1 per layer over 36 layers)" in table
    assert "down_proj" in table and "77.8% of read bandwidth" in table
    assert "kernel profile" not in format_table(build_document(
        BenchOptions(preset="qwen3-4b"), [_fake_rank()], [], "lockstep bench"))


def test_bench_temperature_zero_says_greedy_already_runs(capsys):
    """The sampled pass needs a temperature > 0; the error says why 0 is not a greedy run."""
    from lockstep.cli import main

    assert main(["bench", "--preset", "tiny", "--workload", "throughput",
                 "--temperature", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("lockstep bench: error: --temperature 0: expected a finite number > 0 (the "
                   "sampled pass's; the greedy passes always run)")


@pytest.mark.parametrize("argv, needle", [
    (["--num-requests", "0"], "--num-requests 0"),
    (["--max-batch", "300"], "--max-batch 300"),
    (["--max-model-len", "1000"], "--max-model-len 1000"),
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens 0"),
    (["--temperature", "0"], "--temperature 0"),
    (["--top-p", "1.5"], "--top-p 1.5"),
])
@pytest.mark.parametrize("workload", ["throughput", "decode"])
def test_bad_throughput_argument_exits_2_before_cuda(argv, needle, workload, capsys,
                                                     monkeypatch):
    """With the decode workload too (found by a fresh user: `-n 0` or `--top-p 7` fell through
    to the GPU check there, as if accepted): there it is named as not applying."""
    import torch

    def boom(*a, **k):
        raise AssertionError("touched CUDA before the argument checks")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    rc = main(["bench", "--preset", "tiny", "--workload", workload, *argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    if workload == "decode":
        assert "applies to --workload throughput only" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--num-requests", "99999999"], "--num-requests 99999999: expected 1..65536"),
    # checked against the model, as --context-lens is (a fresh user's finding: it passed
    # every check before the GPU's)
    (["--max-model-len", "99999999"], "--max-model-len 99999999: the model holds at most 2048 "
                                      "tokens (max_position_embeddings 2048)"),
])
def test_throughput_bounds_are_checked_before_cuda(argv, message, capsys, monkeypatch):
    import torch

    def boom(*a, **k):
        raise AssertionError("touched CUDA before the argument checks")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    assert main(["bench", "--preset", "tiny", "--workload", "throughput", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"lockstep bench: error: {message}"


@pytest.mark.parametrize("argv, message", [
    (["--workload", "decode", "-n", "5"],
     "--num-requests 5 applies to --workload throughput only (this run is --workload decode)"),
    (["-n", "256"], "--num-requests 256 applies to --workload throughput only"),
    (["--temperature", "0.6"], "--temperature 0.6 applies to --workload throughput only"),
    (["--no-decode-overlap"], "--no-decode-overlap applies to --workload throughput only"),
    (["--workload", "throughput", "--steps", "5"],
     "--steps 5 applies to --workload decode only (this run is --workload throughput)"),
    (["--workload", "throughput", "--batch-sizes", "1,8"],
     "--batch-sizes '1,8' applies to --workload decode only"),
    (["--workload", "throughput", "--decode-gemm", "cublas"],
     "--decode-gemm 'cublas' applies to --workload decode only"),
    (["--workload", "throughput", "--no-profile"], "--no-profile applies to --workload decode"),
    (["--workload", "throughput", "--compare", "hf", "--hf-batch-sizes", "1"],
     "--hf-batch-sizes '1' applies to --workload decode only"),
    (["--hf-batch-sizes", "1,2"],
     "--hf-batch-sizes '1,2' applies with --compare hf only; add --compare hf or drop it"),
])
def test_a_flag_the_run_would_ignore_is_refused_before_cuda(argv, message, capsys,
                                                            monkeypatch):
    """Found by a fresh user: `--hf-batch-sizes` without `--compare hf`, and `-n` with
    `--workload decode`, were accepted and silently ignored."""
    import torch

    def boom(*a, **k):
        raise AssertionError("touched CUDA before the argument checks")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    assert main(["bench", "--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lockstep bench: error: {message}") and "\n" not in err, err


@pytest.mark.parametrize("argv", [
    ["--compare", "hf", "--hf-batch-sizes", "1", "--steps", "5", "--no-profile"],
    ["--workload", "throughput", "-n", "4", "--top-p", "0.9", "--no-decode-overlap"],
])
def test_flags_of_the_chosen_workload_pass_to_the_gpu_check(argv, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--preset", "tiny", *argv]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_an_output_that_fails_after_the_run_is_one_line(tmp_path, capsys):
    """The checks before the run cannot rule out every failure at its end (the directory removed
    meanwhile, a full disk): the final writes end in one line, not a traceback."""
    from engine.bench.options import BenchOptions
    from engine.cli_bench import _write_outputs

    gone = str(tmp_path / "gone" / "x.json")
    opts = BenchOptions(preset="tiny", json_path=gone)

    def write_doc(path):
        with open(path, "w") as f:
            f.write("{}")

    assert _write_outputs(opts, write_doc, lambda path: True) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"lockstep bench: error: --json {gone!r}: cannot write it: No such file or "
                   "directory"), err

    def full(path):
        raise OSError(28, "No space left on device")

    png = str(tmp_path / "x.png")
    assert _write_outputs(BenchOptions(preset="tiny", plot_path=png), write_doc, full) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"lockstep bench: error: --plot {png!r}: cannot write it: No space left on device"


def _broken_json(d):
    (d / "config.json").write_text("{bad")


def _no_config(d):
    (d / "notes.txt").write_text("not a model")


@pytest.mark.parametrize("make", [_no_config, _broken_json])
def test_a_bad_model_dir_is_named_as_generate_names_it(make, tmp_path, capsys):
    """Found by a fresh user: bench said "cannot read config.json (FileNotFoundError)" or
    "(JSONDecodeError)", with no detail, where generate names the file and the reason."""
    make(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1"]) == 2
    generate = capsys.readouterr().err.strip()
    assert main(["bench", "--model", str(tmp_path)]) == 2
    bench = capsys.readouterr().err.strip()
    assert generate.startswith("lockstep generate: error: ") and "\n" not in bench, bench
    assert bench == generate.replace("lockstep generate", "lockstep bench")


def test_throughput_tp_above_the_visible_gpus_is_one_line(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    rc = main(["bench", "--preset", "tiny", "--workload", "throughput", "-tp", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "--tensor-parallel-size 2: only 1 GPU(s) visible" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_workload_w_and_its_summary():
    from engine.bench.serving import Workload, format_table, percentile, phase_breakdown, summarize

    w = Workload.make(50, seed=0)
    assert w == Workload.make(50, seed=0) and w != Workload.make(50, seed=1)
    assert all(100 <= len(p) <= 1024 and max(p) < 10000 for p in w.prompts)
    assert max(max(p) for p in Workload.make(20, seed=0, vocab=512).prompts) < 512
    assert all(100 <= m <= 1024 for m in w.max_tokens)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    row = summarize("x", 2.0, 100, 300, [0.1, 0.3], [0.01, 0.03])
    assert row["output_tok_s"] == 150 and row["total_tok_s"] == 200
    assert row["ttft_p50_ms"] == pytest.approx(200) and row["tpot_p99_ms"] == pytest.approx(29.8)
    log = [("prefill", 0, 2, 0.010, 30, 0.001), ("decode", 2, 0, 0.004, 0, 0.0002),
           ("retire", 0, 0, 0.001, 0, 0.0005), ("decode", 2, 0, 0.006, 0, 0.0002)]
    dev = [{"rows": 0, "admits": 2, "prefill": 8.0, "decode": 0.0, "sample": 0.5},
           {"rows": 2, "admits": 0, "prefill": 0.0, "decode": 3.0, "sample": 0.5},
           {"rows": 2, "admits": 0, "prefill": 0.0, "decode": 3.0, "sample": 0.5}]
    ph = phase_breakdown(log, dev, 0.021)
    assert ph["decode_steps"] == 2 and ph["retire_steps"] == 1
    assert ph["prefill_s"] == pytest.approx(0.008) and ph["decode_s"] == pytest.approx(0.006)
    assert ph["host_s"] == pytest.approx(0.021 - 0.008 - 0.006 - 0.0015)
    assert ph["host_ms_per_decode_step"][2] == pytest.approx(1.5)
    row["phases"] = ph
    doc = {"n": 50, "seed": 0, "model": "m", "dtype": "bfloat16", "versions": {"gpu": "G"},
           "rows": [row], "ratios": {"a / b": 2.0}}
    table = format_table(doc)
    assert "150" in table and "prefill 0.01 s" in table and "a / b: 2.00x" in table


@pytest.mark.parametrize("argv, words", [
    (["--rows", "1,,2"], "--rows '1,,2': '' is not an integer"),
    (["--tp", "0"], "--tp 0: each must be >= 1"),
    (["--presets", "qwen3-4bb"], "unknown preset 'qwen3-4bb'"),
    (["--json", "/nonexistent-dir/x.json"], "--json '/nonexistent-dir/x.json': directory"),
    (["--table", "/"], "--table '/' is a directory"),
    (["--repeats", "0"], "--repeats 0: expected 1..1000"),
    (["--repeats", "1001"], "--repeats 1001: expected 1..1000"),
    (["--tp", ""], "--tp '': '' is not an integer (expected comma-separated integers, e.g. 1,2)"),
    (["--kinds", "both"], "--kinds 'both': expected gemm, rope or gemm,rope"),
    (["--layers", "down,up"], "--layers 'down,up': unknown layer 'up'; choose from qkv, o_proj"),
])
def test_gemm_sweep_checks_its_arguments_and_paths_before_the_run(argv, words, capsys):
    """Old behaviour: int() and PRESETS[...] tracebacks, and --json / --table opened only after
    the whole sweep (minutes of GPU time)."""
    from engine.bench.gemm_sweep import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gemm_sweep: error: ") and words in err


def test_gemm_sweep_layers_picks_the_shapes_it_times():
    from engine.bench.gemm_sweep import LAYERS, sweep_shapes

    every = sweep_shapes(["qwen3-4b"], [1], LAYERS)
    down = sweep_shapes(["qwen3-4b"], [1], ["down"])
    assert list(down.values()) == [["qwen3-4b tp1 down"]]
    assert list(down) == [(2560, 9728, False)] and set(down) < set(every) and len(every) == 4
    shared = sweep_shapes(["qwen3-4b", "qwen3-8b"], [1, 2], ["gate_up"])
    assert all(len(names) >= 1 for names in shared.values())
    assert sum(len(names) for names in shared.values()) == 4


def test_gemm_sweep_without_a_gpu_is_a_one_line_error(monkeypatch, capsys):
    import torch

    from engine.bench.gemm_sweep import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--presets", "qwen3-0.6b", "--tp", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gemm_sweep: error: needs a CUDA GPU")


def test_attention_sweep_checks_its_output_path_before_the_run(monkeypatch, capsys):
    """Old behaviour: the path was opened after every sweep had run."""
    import engine.bench.attention_sweep as sweep

    monkeypatch.setattr(sweep, "context_sweep", lambda: pytest.fail("the sweep ran first"))
    monkeypatch.setattr("sys.argv", ["attention_sweep", "/nonexistent-dir/a.json"])
    assert sweep.main() == 2
    assert "OUT.json '/nonexistent-dir/a.json': directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["a.json", "b.json"], "unrecognized arguments: b.json"),
    (["--context", "-x", "a.json"], "unrecognized arguments: -x"),
])
def test_attention_sweep_refuses_a_bad_argument_in_one_line(argv, message, monkeypatch, capsys):
    import engine.bench.attention_sweep as sweep

    monkeypatch.setattr(sweep, "context_sweep", lambda: pytest.fail("the sweep ran"))
    with pytest.raises(SystemExit) as exit_:
        sweep.main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"attention_sweep: error: {message}\n"


def test_attention_sweep_reads_context_anywhere_and_one_output_path(monkeypatch, tmp_path):
    """--context before or after OUT.json runs only the context sweep and writes the file."""
    import engine.bench.attention_sweep as sweep

    monkeypatch.setattr("engine.bench.options.cuda_missing", lambda tool: False)
    monkeypatch.setattr(sweep, "context_sweep", lambda: [{"context": 1}])
    monkeypatch.setattr(sweep, "decode_sweep", lambda: pytest.fail("--context was dropped"))
    out = tmp_path / "a.json"
    for argv in (["--context", str(out)], [str(out), "--context"]):
        out.unlink(missing_ok=True)
        assert sweep.main(argv) == 0
        assert json.loads(out.read_text()) == {"context": [{"context": 1}]}


@pytest.mark.parametrize("tool, argv, flag, first, last", [
    ("lockstep bench", ["--preset", "tiny"], "--steps", "0", "-2"),
    ("gemm_sweep", [], "--repeats", "0", "-5"),
    ("host_overhead", [], "--steps", "0", "1"),
    ("profile", ["--preset", "tiny"], "--batch", "0", "999"),
    ("sampler_passes", [], "--rows", "0", "-3"),
    ("step_tune", ["--preset", "qwen3-0.6b"], "--top", "0", "33"),
    ("tma_probe", [], "--repeats", "0", "-1"),
])
def test_a_repeated_option_keeps_its_last_value(tool, argv, flag, first, last, monkeypatch,
                                                capsys):
    """The rule of `engine.bench.options`: both values are out of range, and the error names
    the last one given, not the first (an appending or merging option would name neither)."""
    import importlib

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("reached the GPU"))
    argv = [*argv, flag, first, flag, last]
    if tool == "lockstep bench":
        run = lambda: main(["bench", *argv])  # noqa: E731
    else:
        run = lambda: importlib.import_module(f"engine.bench.{tool}").main(argv)  # noqa: E731
    assert run() == 2
    err = capsys.readouterr().err
    assert f"{flag} {last}" in err and f"{flag} {first}" not in err, err


def _no_cuda_commands():
    """(prefix of the error line, callable running the command) for every command that needs
    a CUDA GPU."""
    from engine.bench import attention_sweep, gemm_sweep, profile, step_tune, tma_probe

    return {
        "lockstep bench": lambda d: main(["bench", "--preset", "tiny"]),
        "lockstep bench throughput": lambda d: main(["bench", "--preset", "tiny",
                                                     "--workload", "throughput"]),
        "lockstep generate": lambda d: main(["generate", "--model", d, "--prompt-ids", "1,2",
                                             "--device", "cuda"]),
        "attention_sweep": lambda d: attention_sweep.main([]),
        "gemm_sweep": lambda d: gemm_sweep.main(["--presets", "qwen3-0.6b", "--tp", "1"]),
        "profile": lambda d: profile.main(["--preset", "tiny"]),
        "step_tune": lambda d: step_tune.main(["--preset", "qwen3-0.6b", "--rows", "1"]),
        "tma_probe": lambda d: tma_probe.main([]),
    }


@pytest.mark.parametrize("command", list(_no_cuda_commands()))
def test_no_cuda_gpu_is_one_line_in_one_wording(command, tiny_dir, monkeypatch, capsys):
    """Old behaviour: `lockstep bench` said "this command needs a CUDA GPU; ...", the bench
    tools "needs a CUDA GPU (...)", `lockstep generate --device cuda` "device = 'cuda' but
    ..." once the model was checked, and attention_sweep did not check: a traceback from its
    first CUDA tensor."""
    import torch

    from engine.errors import NO_CUDA_GPU

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _no_cuda_commands()[command](str(tiny_dir)) == 2
    err = capsys.readouterr().err
    prefix = command.removesuffix(" throughput")
    expected = "--device cuda " + NO_CUDA_GPU if "generate" in command else NO_CUDA_GPU
    assert err == f"{prefix}: error: {expected}\n", err


def test_engine_config_names_the_missing_gpu_in_the_same_words(tiny_dir, monkeypatch):
    import torch

    from engine.engine_config import EngineConfig
    from engine.errors import NO_CUDA_GPU, ParallelConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ParallelConfigError) as info:
        EngineConfig.create(str(tiny_dir), device="cuda")
    assert str(info.value) == f"device = 'cuda' {NO_CUDA_GPU}"


def test_max_positions_reads_the_config_once_and_names_a_bad_value():
    from engine.bench.options import BenchArgError, max_positions

    assert max_positions({"max_position_embeddings": 40960}) == 40960
    assert max_positions({}) == 0
    with pytest.raises(BenchArgError, match="max_position_embeddings 'x' in the model's config"):
        max_positions({"max_position_embeddings": "x"})


@pytest.mark.parametrize("argv, message", [
    (["--rows", "0"], "sampler_passes: error: --rows 0: expected 1..256"),
    (["--vocab", "-1"], "sampler_passes: error: --vocab -1: expected 1..1048576"),
    # past the documented bounds (an out-of-memory traceback once the logits were made before)
    (["--rows", "257"], "sampler_passes: error: --rows 257: expected 1..256"),
    (["--rows", "100000", "--vocab", "10000000"],
     "sampler_passes: error: --rows 100000: expected 1..256"),
    (["--vocab", "1048577"], "sampler_passes: error: --vocab 1048577: expected 1..1048576"),
    (["--scale", "nan"], "sampler_passes: error: --scale nan: expected a finite number"),
    # a fresh user's finding: 1e308 overflowed the float32 logits into inf and NaN passes
    (["--scale", "1e308", "--rows", "4", "--vocab", "100"],
     "sampler_passes: error: --scale 1e308: expected a finite number of at most 1e+30"),
    (["--scale=-1e31"], "sampler_passes: error: --scale -1e31: expected a finite number"),
    (["--top-p", "1.5"], "sampler_passes: error: top_p = 1.5, expected a number in (0, 1]"),
    (["--temperature", "-1"], "sampler_passes: error: temperature = -1.0, expected a finite"),
    (["--min-p", "2"], "sampler_passes: error: min_p = 2.0, expected a number in [0, 1]"),
    (["--top-k", "65", "--vocab", "64"], "sampler_passes: error: top_k = 65, expected at most"),
])
def test_sampler_passes_refuses_bad_settings_in_one_line(argv, message, monkeypatch, capsys):
    """Each bad value gets one error line naming it and exit status 2, before any logits are
    made (an argparse usage block or a traceback from inside the sampler before)."""
    from engine.bench import sampler_passes

    monkeypatch.setattr(sampler_passes, "count_passes",
                        lambda *a, **k: pytest.fail("counted with a bad setting"))
    assert sampler_passes.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_sampler_passes_takes_its_largest_rows_and_vocab(monkeypatch, capsys):
    """--rows 256 and --vocab 1048576, the bounds its help gives, reach the counter."""
    from engine.bench import sampler_passes

    help_text = " ".join(sampler_passes.build_parser().format_help().split())
    assert "(1..256; default 256)" in help_text and "(1..1048576; default 151936" in help_text
    counted = []

    def count(rows, vocab, *rest):
        counted.append((rows, vocab))
        return {"full": [], "partial": [], "launches": 0, "kernels": {}, "redrawn": 0}

    monkeypatch.setattr(sampler_passes, "count_passes", count)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as if triton were first imported after it
    assert sampler_passes.main(["--rows", "256", "--vocab", "1048576"]) == 0
    assert counted == [(256, 1 << 20)] and capsys.readouterr().err == ""


_SAMPLER_PASSES_QUIET = r"""
import warnings

import numpy as np

from engine.bench.sampler_passes import main

# row 8 (seed 8, output index 3) draws a uniform of 1.0 at vocabulary entry 95406: the
# interpreter takes log(0) there
assert main(["--rows", "9", "--vocab", "95407", "--top-p", "1"]) == 0
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    np.log(np.zeros(1, np.float32))
assert [str(w.message) for w in seen] == ["divide by zero encountered in log"], seen
print("ok")
"""


# a subprocess that imports torch and triton under the interpreter: 7 s on 2 idle cores, past
# 120 s once under a fresh user's load of a parallel `make test` and `lockstep check --matrix`
@pytest.mark.timeout(300)
def test_sampler_passes_prints_no_interpreter_warning_and_leaves_the_filters_as_they_were():
    """Old behaviour: a RuntimeWarning from triton/runtime/interpreter.py ("divide by zero
    encountered in log") above the counts. It is silenced around the sampling call only: the
    same warning raised afterwards still shows."""
    pytest.importorskip("triton")
    import torch

    from engine.sampling import philox_uniform, split_seed
    from engine.testing import run_in_triton_interpreter

    lo, hi = split_seed(8)  # the row the script relies on does draw the 1.0
    u = philox_uniform(torch.tensor([lo]), torch.tensor([hi]), torch.tensor([3]), 95407)
    assert float(u[0, 95406]) == 1.0
    res = run_in_triton_interpreter(_SAMPLER_PASSES_QUIET)
    assert res.returncode == 0 and res.stdout.endswith("ok\n"), res.stdout + res.stderr
    assert res.stderr == "", res.stderr


@pytest.mark.parametrize("tool, argv, message", [
    ("step_tune", ["--top", "abc"], "argument --top: 'abc' is not an integer"),
    ("step_tune", ["--preset", "qwen3-0.6b", "--model", "m"],
     "argument --model: not allowed with argument --preset"),
    ("sampler_passes", ["--top-k", "abc"], "argument --top-k: 'abc' is not an integer"),
    ("sampler_passes", ["--scale", "x"], "argument --scale: 'x' is not a number"),
    ("sampler_passes", ["--top", "5"], "ambiguous option: --top could match --top-p, --top-k"),
    ("gemm_sweep", ["--repeats", "abc"], "argument --repeats: 'abc' is not an integer"),
    ("gemm_sweep", ["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bench_tools_refuse_what_argparse_refuses_in_one_line(tool, argv, message, capsys):
    """Old behaviour: argparse's usage block (five to seven lines) above an error line headed
    "python -m engine.bench.TOOL: error:"; now the one line, headed as the tool's other
    errors are, with status 2 (`lockstep.cli.OneLineParser`, as `lockstep` refuses)."""
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"engine.bench.{tool}").main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"{tool}: error: {message}\n"


@pytest.mark.parametrize("tool", ["step_tune", "sampler_passes", "gemm_sweep"])
def test_bench_tools_help_still_prints_the_usage_and_exits_0(tool, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"engine.bench.{tool}").main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"usage: python -m engine.bench.{tool} ") and out.err == ""


@pytest.mark.parametrize("tool, argv, message", [
    ("profile", [], "the following arguments are required: --preset"),
    ("profile", ["--preset", "tiny", "--batch", "abc"], "argument --batch: 'abc' is not an integer"),
    ("profile", ["--preset", "tiny", "--bogus"], "unrecognized arguments: --bogus"),
    ("host_overhead", ["--steps", "abc"], "argument --steps: 'abc' is not an integer"),
    ("host_overhead", ["--bogus"], "unrecognized arguments: --bogus"),
    ("tma_probe", ["--bogus"], "unrecognized arguments: --bogus"),
])
def test_what_argparse_refuses_is_one_line_in_profile_host_overhead_and_tma_probe(
        tool, argv, message, capsys):
    """Found by a fresh user: these three printed argparse's 3-5 line usage block before the
    error, where every other tool prints one line."""
    import importlib

    module = importlib.import_module(f"engine.bench.{tool}")
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == f"{tool}: error: {message}\n", err


def test_the_throughput_workload_runs_at_the_largest_seed(tiny_dir):
    # request i's sampling seed is derived from --seed; at 2**64 - 1 the plain sum left the
    # seed range and every request after the first was refused (a reviewer's finding)
    from engine.bench.serving import Workload, run_engine
    from engine.llm import LLM

    work = Workload.make(2, seed=2**64 - 1, lo=4, hi=6, vocab=100)
    with LLM(tiny_dir, max_batch=2, max_model_len=32) as llm:
        row = run_engine(llm, work, "x", temperature=0.7, top_p=1.0, seed=2**64 - 1)
    assert row["output_tokens"] == sum(work.max_tokens)


def test_derived_seeds_wrap_into_the_seed_range():
    from engine.seeds import SEED_LIMIT, derived_seed

    assert derived_seed(5, 3) == 8 and derived_seed(SEED_LIMIT - 1, 1) == 0
    assert derived_seed((SEED_LIMIT - 1) * 1_000_003, 2) == (SEED_LIMIT - 1_000_003 + 2) % SEED_LIMIT


@pytest.mark.parametrize("text, needle", [
    ("9" * 5000, "99999999999999999999999999999... is outside [0, 2**64)"),
    ("-" + "9" * 5000, "-9999999999999999999999999999... is outside [0, 2**64)"),
    ("1_000", "'1_000' is not an integer"),
    ("\u0663", "is not an integer"),  # an Arabic-Indic digit: int() would take it
    ("x" * 100, "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxx...' is not an integer"),
    (" 7 ", None),
    ("+7", None),
    ("0" * 40 + "7", None),
    (str(2**64 - 1), None),
])
def test_a_seed_is_a_short_line_whatever_its_length(text, needle):
    # a 5,000-digit seed printed 5 KB and called itself "not an integer" (int() refuses it
    # past Python's digit limit); the line now shows 32 characters and says it is outside
    import argparse

    from engine.cli_args import seed

    if needle is None:
        assert seed(text) == int(text)
        return
    with pytest.raises(argparse.ArgumentTypeError) as e:
        seed(text)
    assert needle in str(e.value) and len(str(e.value)) < 80, str(e.value)


class _Device:
    total_memory = 80 * 2**30  # an H100's


@pytest.mark.parametrize("argv, words", [
    (["--preset", "qwen3-8b", "--batch-sizes", "256", "--context-lens", "40959"],
     "--context-lens 40959 needs a KV cache of 1440.0 GiB per GPU for 256 slots (the capture "
     "sweep's 256; --no-capture-sweep sizes it to the batch sizes), beside 15.3 GiB of weights: "
     "more than the GPU's 80.0 GiB"),
    (["--preset", "qwen3-0.6b", "--context-lens", "4096"], "needs a KV cache of 112.4 GiB"),
    (["--preset", "qwen3-0.6b", "--context-lens", "8192", "--no-capture-sweep", "--batch-sizes",
      "1,8,64,256", "-tp", "2"], "needs a KV cache of 112.2 GiB per GPU for 256 slots, beside"),
])
def test_a_kv_cache_past_the_gpu_is_refused_before_any_weights(argv, words, capsys,
                                                               monkeypatch):
    """Old behaviour: the weights were written and loaded, then the KV allocation raised an
    OutOfMemoryError traceback for K's 720 GiB (a hostile-input trial's finding, on an H100)."""
    import torch

    import engine.cli_bench
    from engine.bench import modeldir

    monkeypatch.setattr(engine.cli_bench, "_gpu_problem", lambda tp: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda rank: _Device)
    monkeypatch.setattr(modeldir, "write_random_model_fast", None)  # never reached
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lockstep bench: error: ") and words in err and "\n" not in err


def _parse(argv):
    """`lockstep bench` arguments as `engine.cli_bench.run` reads them."""
    import argparse

    import engine.cli_bench
    from engine.bench.flags import apply_workload_flags

    parser = argparse.ArgumentParser()
    engine.cli_bench.add_parser(parser.add_subparsers(), "bench")
    args = parser.parse_args(["bench", *argv])
    apply_workload_flags(args)
    return args


def test_the_fit_check_passes_the_runs_the_docs_make(monkeypatch):
    """The issue-14 reference runs, and 16k tokens of context at batch 1, fit an 80 GiB GPU."""
    import torch

    import engine.cli_bench
    from engine.bench.fits import check_fits

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda rank: _Device)
    for argv in (["--preset", "qwen3-4b", "--batch-sizes", "1,8,64,256"],
                 ["--preset", "qwen3-8b"],
                 ["--preset", "qwen3-4b", "--context-lens", "16384", "--batch-sizes", "1",
                  "--no-capture-sweep"]):
        args = _parse(argv)
        opts = engine.cli_bench.options_from_args(args)
        check_fits(engine.cli_bench._shape(opts), opts, _Device.total_memory)


class _SmallDevice:
    total_memory = 12 * 2**30


@pytest.mark.parametrize("argv, words", [
    (["--preset", "qwen3-8b"], "--preset qwen3-8b: 15.3 GiB of bfloat16 weights per GPU and one "
                               "sequence's KV cache at --max-model-len 2048 (0.3 GiB) need more "
                               "than the GPU's 12.0 GiB; use a smaller model or raise "
                               "--tensor-parallel-size"),
    (["--preset", "qwen3-4b", "--dtype", "float32"], "--preset qwen3-4b: 15.0 GiB of float32 "
                                                     "weights per GPU"),
])
def test_a_throughput_model_past_the_gpu_is_refused_before_any_weights(argv, words, capsys,
                                                                       monkeypatch):
    """Old behaviour: workload W wrote a preset's weights (16 GB for qwen3-8b) and loaded them
    before the engine's startup refused the memory plan."""
    import torch

    import engine.cli_bench
    from engine.bench import modeldir

    monkeypatch.setattr(engine.cli_bench, "_gpu_problem", lambda tp: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda rank: _SmallDevice)
    monkeypatch.setattr(modeldir, "write_random_model_fast", None)  # never reached
    assert main(["bench", "--workload", "throughput", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lockstep bench: error: ") and words in err and "\n" not in err, err


def test_the_serving_fit_check_passes_what_fits(monkeypatch):
    """The control: the documented workload-W runs fit an 80 GiB GPU, and 0.6B a 12 GiB one."""
    from engine.bench.fits import check_serving_fits
    from engine.presets import PRESETS

    for preset in ("qwen3-0.6b", "qwen3-4b", "qwen3-8b"):
        check_serving_fits(PRESETS[preset], 1, "bfloat16", 2048, _Device.total_memory, preset)
    check_serving_fits(PRESETS["qwen3-0.6b"], 1, "bfloat16", 40960, _SmallDevice.total_memory,
                       "qwen3-0.6b")


@pytest.mark.parametrize("error, status", [("refused", 2), ("rank", 1)])
def test_a_throughput_run_the_engine_refuses_or_that_fails_is_one_line(error, status, capsys,
                                                                       monkeypatch):
    import engine.cli_bench
    from engine.bench import serving
    from engine.errors import ParallelConfigError, RankError

    def fail(*args, **kwargs):
        if error == "refused":
            raise ParallelConfigError("startup refused: rank 0 has no bytes; raise "
                                      "gpu_memory_utilization")
        raise RankError(1, "process exited with code 9")

    import contextlib

    monkeypatch.setattr(engine.cli_bench, "_gpu_problem", lambda tp: None)
    monkeypatch.setattr(engine.cli_bench, "_smallest_gpu_bytes", lambda tp: 80 * 2**30)
    monkeypatch.setattr(engine.cli_bench, "_model_dir",
                        lambda opts: contextlib.nullcontext("/nonexistent"))
    monkeypatch.setattr(serving, "measure_throughput", fail)
    assert main(["bench", "--preset", "tiny", "--workload", "throughput", "-n", "4"]) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] in ("lockstep bench: error: startup refused: rank 0 has no bytes; raise "
                       "gpu_memory_utilization",
                       "lockstep bench: error: rank 1 failed: process exited with code 9")
    assert not any("Traceback" in line for line in err)

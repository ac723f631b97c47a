"""`lockstep bench`'s kernel profile (issue 14 item 4): the GEMM modules of the model are found
by name, each runs under its own profiler label while profiling (and only then), and the table
lines say kernels per step and per layer and each GEMM's bandwidth."""

from __future__ import annotations

import pytest
import torch

from engine.bench.kernel_profile import GEMM_MODULES, format_profile, gemm_modules, labelled_gemms
from engine.engine_config import EngineConfig
from engine.executor import RankExecutor
from engine.parallel import SINGLE
from protocol.commands import DecodeRow, Step


@pytest.fixture
def executor(tiny_dir):
    settings = EngineConfig.create(tiny_dir, max_batch=4, max_model_len=32, page_size=16)
    ex = RankExecutor(settings, SINGLE)
    ex.load_model()
    ex.allocate_kv(ex.pages_needed())
    ex.assign_pages_per_slot()
    return ex


def test_every_gemm_of_the_model_is_found_once_per_layer(executor):
    mods = gemm_modules(executor.model)
    layers = executor.cfg.num_layers
    assert list(mods) == list(GEMM_MODULES)
    assert [len(mods[n]) for n in GEMM_MODULES] == [layers] * 4 + [1]
    assert mods["qkv_proj"][0].weight.shape[1] == executor.cfg.hidden_size


@pytest.mark.timeout(120)
def test_each_gemm_call_runs_under_its_label_while_profiling_only(executor):
    from torch.profiler import ProfilerActivity, profile

    step = Step(seq=0, rows=tuple(DecodeRow(r, r, 7 + r, 3) for r in range(2)), bucket=2)

    def forward():
        executor.prepare_replay(step)
        executor._step = None
        return executor.decode_forward(2)

    plain = forward().clone()
    with labelled_gemms(executor.model), profile(activities=[ProfilerActivity.CPU]) as prof:
        labelled = forward().clone()
    counts = {}
    for e in prof.events():
        if e.name.startswith("gemm:"):
            counts[e.name] = counts.get(e.name, 0) + 1
    layers = executor.cfg.num_layers
    assert counts == {f"gemm:{n}": (1 if n == "lm_head" else layers) for n in GEMM_MODULES}
    assert torch.equal(plain, labelled)  # the labels change nothing computed
    assert all("forward" not in vars(m) for ms in gemm_modules(executor.model).values()
               for m in ms)  # unwrapped on exit


def test_profile_lines_give_kernels_per_step_and_layer_and_gemm_bandwidth():
    point = {"batch": 8, "context": 128, "profile": {
        "launches": 240.0, "device_ms": 1.5, "top": [],
        "gemms": [{"gemm": "gate_up_proj", "shape": "6144 x 1024", "weight_bytes": 12582912,
                   "calls": 140, "us": 4.0, "GBps": 3145.728, "of_read_bandwidth": 0.786}]}}
    lines = format_profile(point, 28)
    assert lines[0].startswith("batch 8 ctx 128: 240 kernels per step (8.6 per layer over 28")
    assert "gate_up_proj" in lines[1] and "6144 x 1024" in lines[1] and "12.58 MB" in lines[1]
    assert "3146 GB/s" in lines[1] and "78.6% of read bandwidth" in lines[1]
    assert "TFLOP/s" not in lines[1]
    # 2 x 8 rows x 6144 x 1024 FLOPs in 4 us: 25 TFLOP/s
    point["profile"]["gemms"][0]["TFLOPps"] = 2 * 8 * 6144 * 1024 / 4e-6 / 1e12
    assert format_profile(point, 28)[1].endswith("   25 TFLOP/s")


class _Kind:
    def __init__(self, name):
        self.name = name


class _Span:
    def __init__(self, start, end):
        self.start, self.end = start, end


class _Event:
    """The fields of a profiler FunctionEvent that `kernel_time_in_ranges` reads."""

    def __init__(self, name, device, start, end, device_time=0.0, device_time_total=0.0):
        self.name, self.device_type = name, _Kind(device)
        self.time_range = _Span(start, end)
        self.device_time, self.device_time_total = device_time, device_time_total


def test_a_gemm_range_counts_the_kernels_inside_it_on_the_device_not_its_gaps():
    from engine.bench.kernel_profile import kernel_time_in_ranges

    events = [
        _Event("gemm:gate_up_proj", "CPU", 0, 50, device_time_total=7.0),  # aten kernels only
        _Event("gemm:gate_up_proj", "CUDA", 100, 180),  # GPU range: the gemm, a gap, silu_mul
        _Event("nvjet_gemm", "CUDA", 100, 107, device_time=7.0),
        _Event("_silu_mul_kernel", "CUDA", 178, 180, device_time=2.0),
        _Event("_add_rms_norm_kernel", "CUDA", 181, 185, device_time=4.0),  # after the range
        _Event("gemm:down_proj", "CUDA", 190, 199),
        _Event("Memset (Device)", "CUDA", 190, 191, device_time=1.0),
        _Event("nvjet_gemm", "CUDA", 191, 199, device_time=8.0),
    ]
    assert kernel_time_in_ranges(events, "gemm:") == {"gate_up_proj": [9.0], "down_proj": [8.0]}
    cpu_only = [e for e in events if e.device_type.name == "CPU"]
    assert kernel_time_in_ranges(cpu_only, "gemm:") == {"gate_up_proj": [7.0]}


def test_step_timeline_splits_exposed_time_by_kernel():
    from engine.bench.kernel_profile import step_timeline

    # two steps: a (0-10), b overlaps a by 4 and ends at 15, c (15-16); then again from 100
    one = [("a", 0.0, 10.0), ("b", 6.0, 15.0), ("c", 15.0, 16.0)]
    two = [(n, s + 100, e + 100) for n, s, e in one]
    t = step_timeline(two + one, steps=2)
    assert t["span_us"] == 16.0 and t["launches"] == 3
    rows = {r["name"]: r for r in t["rows"]}
    assert [r["name"] for r in t["rows"]] == ["a", "b", "c"]
    assert rows["a"]["exposed_us"] == 10.0 and rows["b"]["exposed_us"] == 5.0
    assert rows["b"]["busy_us"] == 9.0 and rows["b"]["overlap_us"] == 4.0
    assert sum(r["exposed_us"] for r in t["rows"]) == t["span_us"]


def test_step_timeline_counts_a_kernel_nested_in_an_earlier_one_as_not_exposed():
    from engine.bench.kernel_profile import step_timeline

    # b runs inside a (a side stream); exposed times still add up to the span
    t = step_timeline([("a", 0.0, 10.0), ("b", 2.0, 5.0), ("c", 10.0, 11.0)], steps=1)
    rows = {r["name"]: r for r in t["rows"]}
    assert rows["b"]["exposed_us"] == 0.0 and rows["b"]["overlap_us"] == 3.0
    assert sum(r["exposed_us"] for r in t["rows"]) == t["span_us"] == 11.0


def test_step_timeline_refuses_steps_that_differ():
    import pytest

    from engine.bench.kernel_profile import step_timeline

    with pytest.raises(ValueError, match="do not split into 2"):
        step_timeline([("a", 0.0, 1.0)], steps=2)
    with pytest.raises(ValueError, match="step 1 launches other kernels"):
        step_timeline([("a", 0.0, 1.0), ("b", 2.0, 3.0)], steps=2)
    with pytest.raises(ValueError, match="steps = 0"):
        step_timeline([("a", 0.0, 1.0)], steps=0)


def test_layer_labels_number_the_calls_of_a_kernel_within_a_layer():
    from engine.bench.profile import layer_labels

    names = ["embed"] + ["gemm", "attn", "gemm"] * 3 + ["head"]
    assert layer_labels(names, num_layers=3) == (
        ["embed"] + ["gemm[0]", "attn", "gemm[1]"] * 3 + ["head"])


def test_replay_timeline_labels_each_layers_gemm_calls_apart_and_skips_non_kernels():
    import pytest

    from engine.bench.profile import replay_timeline

    # two replays of a 2-layer step: gemm, attn, gemm per layer; a memset beside each
    one = [("gemm", 0, 4), ("attn", 4, 5), ("gemm", 5, 8), ("gemm", 8, 12), ("attn", 12, 13),
           ("gemm", 13, 16)]
    events = [_Event(n, "CUDA", a + 100 * s, b + 100 * s) for s in (1, 0) for n, a, b in one]
    events += [_Event("Memset (Device)", "CUDA", 50, 51), _Event("gemm", "CPU", 0, 1)]
    t = replay_timeline(events, steps=2, num_layers=2)
    rows = {r["name"]: r for r in t["rows"]}
    assert t["launches"] == 6 and t["span_us"] == 16
    assert rows["gemm[0]"]["busy_us"] == 8 and rows["gemm[1]"]["busy_us"] == 6
    assert rows["attn"]["calls"] == 2
    with pytest.raises(ValueError, match="5 kernels over 2 replays: the profiler lost some"):
        replay_timeline(events[1:6], steps=2, num_layers=2)


def test_profile_refuses_bad_arguments_in_one_line_before_touching_a_gpu(capsys):
    import pytest

    from engine.bench import profile

    for argv, message in ((["--preset", "qwen9"], "--preset 'qwen9': choose from"),
                          (["--preset", "tiny", "--steps", "0"], "--steps 0: expected >= 1"),
                          (["--preset", "tiny", "--batch", "-2"], "--batch -2: expected 1..256"),
                          (["--preset", "tiny", "--batch", "257"], "--batch 257: expected 1..256")):
        assert profile.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit):
        profile.main(["--preset", "tiny", "--steps", "x"])  # argparse's own usage error


def test_profile_without_a_gpu_is_a_one_line_error(capsys, monkeypatch):
    import torch

    from engine.bench import profile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profile.main(["--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("profile: error: needs a CUDA GPU"), err


def test_launches_per_step_counts_the_kernels_of_each_call(monkeypatch):
    """`kernel_events` keeps device kernels only (no memcpy/memset, no CPU events) in order,
    and `launches_per_step` divides them by the calls (a fake profiler: no GPU here)."""
    import types

    from engine.bench import kernel_profile

    calls = []

    def event(name, device="CUDA", us=2.0):
        return types.SimpleNamespace(name=name, device_type=types.SimpleNamespace(name=device),
                                     device_time=us)

    class FakeProfile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [e for _ in calls for e in (event("gemm"), event("MemcpyHtoD"),
                                               event("attn", us=4.0), event("cpu op", "CPU"))]

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    names = [e.name for e in kernel_profile.kernel_events(lambda: calls.append(1), 2)]
    assert names == ["gemm", "attn", "gemm", "attn"]
    calls.clear()
    got = kernel_profile.launches_per_step(lambda: calls.append(1), steps=3)
    assert got["launches"] == 2 and got["device_ms"] == pytest.approx(6e-3)
    assert [name for name, _, _ in got["top"]] == ["attn", "gemm"]
    with pytest.raises(ValueError, match="steps = 0"):
        kernel_profile.launches_per_step(lambda: None, steps=0)

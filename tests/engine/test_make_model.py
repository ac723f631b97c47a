"""`lockstep make-model`: HF-layout directories that transformers and the engine both load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.model_dir import INIT_STD, build_config, tensor_shapes, write_model_dir
from engine.presets import PRESETS

REAL = {  # preset: (hidden, layers, q heads, kv heads, head_dim, intermediate, tied)
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, True),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, True),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728, True),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, False),
}


@pytest.mark.parametrize("preset", sorted(REAL))
def test_real_presets_have_the_qwen3_shapes(preset):
    c = build_config(preset, "bfloat16")
    got = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
           c.head_dim, c.intermediate_size, c.tie_word_embeddings)
    assert got == REAL[preset]
    assert c.vocab_size == 151936 and c.rms_norm_eps == 1e-6
    assert c.rope_parameters["rope_theta"] == 1e6
    assert c.architectures == ["Qwen3ForCausalLM"]


def test_cli_writes_a_dir_transformers_loads(tmp_path):
    from lockstep.cli import main
    from transformers import AutoModelForCausalLM

    assert main(["make-model", "--preset", "tiny", "--out", str(tmp_path), "--seed", "3",
                 "--dtype", "float32"]) == 0
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1, "tiny must be multi-shard so sharded loading is exercised"
    assert all((tmp_path / s).is_file() for s in shards)
    assert set(index["weight_map"]) == {n for n, _ in tensor_shapes(PRESETS["tiny"])}
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    w = model.model.layers[0].mlp.up_proj.weight.detach()
    assert 0.015 < float(w.std()) < 0.025
    assert abs(float(model.model.norm.weight.detach().mean()) - 1.0) < 0.1
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == PRESETS["tiny"]["eos_token_id"]


def test_seed_decides_weights_and_dtype_is_honoured(tmp_path):
    from safetensors.torch import load_file

    def first(d):
        name = "model.layers.0.self_attn.q_proj.weight"
        idx = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        return load_file(str(d / idx[name]))[name]

    a = first(write_model_dir("tiny", tmp_path / "a", seed=5, dtype="bfloat16"))
    b = first(write_model_dir("tiny", tmp_path / "b", seed=5, dtype="bfloat16",
                              shard_bytes=10**9))  # one shard: same values
    c = first(write_model_dir("tiny", tmp_path / "c", seed=6, dtype="bfloat16"))
    assert str(a.dtype) == "torch.bfloat16"
    assert (a == b).all() and not (a == c).all()


@pytest.mark.parametrize("seed", [2**62, 2**64 - 1])
def test_every_seed_in_the_range_writes_a_model(tmp_path, capsys, seed):
    """Old behaviour: --seed took [0, 2**63) while generate's took [0, 2**64); 2**64 - 1 was
    refused and 2**62 accepted but crashed (`manual_seed(seed * 1_000_003 + k)` overflowed)."""
    from lockstep.cli import main

    assert main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "m"),
                 "--seed", str(seed), "--dtype", "float32"]) == 0
    assert f"seed {seed}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "n"),
              "--seed", str(2**64)])
    assert info.value.code == 2 and f"{2**64} is outside [0, 2**64)" in capsys.readouterr().err


def test_seeds_that_fit_draw_the_weights_they_drew_before(tmp_path):
    """The per-tensor seed is taken modulo 2**64; below 2**64 // 1_000_003 nothing changes."""
    import torch
    from safetensors.torch import load_file

    seed = 2**64 // 1_000_003 - 1
    out = write_model_dir("tiny", tmp_path / "m", seed=seed, dtype="float32")
    shapes = tensor_shapes(PRESETS["tiny"])
    k, (name, shape) = next((k, s) for k, s in enumerate(shapes) if s[0].endswith("q_proj.weight"))
    g = torch.Generator().manual_seed(seed * 1_000_003 + k)  # no modulo: it fits
    want = INIT_STD * torch.randn(shape, generator=g)
    shard = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][name]
    assert torch.equal(load_file(str(out / shard))[name], want)


def test_cli_module_does_not_import_torch():
    code = ("import sys; from lockstep.cli import build_parser; build_parser(); "
            "bad = [m for m in ('torch', 'transformers', 'triton') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_preset_and_dtype_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'qwen9'"):
        write_model_dir("qwen9", tmp_path)
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        write_model_dir("tiny", tmp_path, dtype="int8")


@pytest.mark.parametrize("kind,needle", [("empty", "--out is empty"), ("file", "exists and is not a directory"),
                                         ("unwritable", "cannot be created")])
def test_bad_out_is_rejected_before_writing(tmp_path, capsys, monkeypatch, kind, needle):
    from lockstep.cli import main
    monkeypatch.chdir(tmp_path)
    if kind == "empty":
        out = ""
    elif kind == "file":
        out = str(tmp_path / "afile")
        (tmp_path / "afile").write_text("x")
    else:
        out = "/proc/lockstep-no-such"
    assert main(["make-model", "--preset", "tiny", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not list(tmp_path.glob("*.safetensors"))


@pytest.mark.parametrize("parent, words", [("a/b", "does not exist; create it first"),
                                           ("afile", "is not a directory; choose another --out")])
def test_out_under_a_missing_parent_is_refused_and_nothing_is_created(parent, words, tmp_path,
                                                                      capsys, monkeypatch):
    """`--out a/b/c` created a and a/b unasked (and a full disk then removed only c)."""
    import engine.model_dir

    from lockstep.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    monkeypatch.setattr(engine.model_dir, "write_model_dir",
                        lambda *a, **k: pytest.fail("wrote a model under a missing parent"))
    out = f"{parent}/c"
    assert main(["make-model", "--preset", "tiny", "--out", out]) == 2
    assert capsys.readouterr().err.strip() == (
        f"lockstep make-model: error: --out {out!r}: its parent {parent!r} {words}"
        + (" or choose another --out" if parent == "a/b" else ""))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_shards_are_world_readable_like_other_files(tmp_path):
    import os
    import stat
    from lockstep.cli import main
    assert main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "m")]) == 0
    umask = os.umask(0)
    os.umask(umask)
    for shard in (tmp_path / "m").glob("*.safetensors"):
        assert stat.S_IMODE(shard.stat().st_mode) == 0o666 & ~umask


def test_non_empty_out_needs_overwrite_and_seed_is_range_checked(tmp_path, capsys):
    from lockstep.cli import main
    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 0
    capsys.readouterr()
    config = (out / "config.json").read_text()
    # a model directory is not replaced by accident (a mistyped --out could be a real checkpoint)
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--seed", "4"]) == 2
    err = capsys.readouterr().err
    assert "already holds a model; pass --overwrite" in err and len(err.strip().splitlines()) == 1
    assert (out / "config.json").read_text() == config
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--overwrite"]) == 0
    assert "replacing the model directory" in capsys.readouterr().err
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):  # --overwrite replaces a model, nothing else
        assert main(["make-model", "--preset", "tiny", "--out", str(other), *extra]) == 2
        assert "holds no model (no config.json)" in capsys.readouterr().err
    assert [p.name for p in other.iterdir()] == ["todo.txt"]
    with pytest.raises(SystemExit) as info:
        main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "n"), "--seed", str(10**20)])
    assert info.value.code == 2 and "outside [0, 2**64)" in capsys.readouterr().err


@pytest.mark.parametrize("weight_map", [{"model.norm.weight": 5}, {"a": ["x"]}, [1], "x",
                                        pytest.param("deep", id="nested-100000-deep")])
def test_overwrite_replaces_a_model_whose_index_is_broken(tmp_path, capsys, weight_map):
    """Old behaviour: --overwrite over an index whose weight_map named a number (or a list)
    as a shard was a TypeError traceback, over one nested 100,000 deep a RecursionError
    traceback; such an index names no shard to remove."""
    from lockstep.cli import main

    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 0
    text = ("[" * 100_000 + "]" * 100_000 if weight_map == "deep"
            else json.dumps({"weight_map": weight_map}))
    (out / "model.safetensors.index.json").write_text(text)
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--overwrite"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {p.name for p in out.glob("*.safetensors")} == set(index["weight_map"].values())
    assert "Traceback" not in capsys.readouterr().err


def test_replacing_a_model_leaves_no_stale_shard(tmp_path, capsys):
    """float32 writes more shards than bfloat16; the second run must remove the extra ones
    (issue 13, item 9)."""
    from lockstep.cli import main

    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--dtype", "float32"]) == 0
    (out / "notes.txt").write_text("keep me")
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--overwrite"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {p.name for p in out.glob("*.safetensors")} == set(index["weight_map"].values())
    assert (out / "notes.txt").read_text() == "keep me"
    from engine.llm import LLM

    with LLM(out, max_model_len=32) as llm:
        assert llm.cfg.torch_dtype == "bfloat16"


def test_unwritable_out_is_one_line(tmp_path, capsys, monkeypatch):
    """An empty directory on a read-only mount (simulated: root may write anywhere else)."""
    import errno
    import tempfile

    from lockstep.cli import main

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    out = str(tmp_path / "m")
    assert main(["make-model", "--preset", "tiny", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--out {out!r} is not writable: Read-only file system" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("out", ["/", "/tmp", "/proc/self", "notes"])
def test_overwrite_never_writes_into_a_directory_that_holds_no_model(out, tmp_path, capsys,
                                                                     monkeypatch):
    """Found by a fresh user: `--out / --overwrite` (or /tmp) wrote the model's files into
    /, among the system's, with exit status 0."""
    import engine.model_dir

    from lockstep.cli import main

    monkeypatch.setattr(engine.model_dir, "write_model_dir",
                        lambda *a, **k: pytest.fail(f"wrote a model into {out}"))
    if out == "notes":
        out = str(tmp_path / "notes")
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "todo.txt").write_text("keep me")
    assert main(["make-model", "--preset", "tiny", "--out", out, "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"lockstep make-model: error: --out {out!r} is not empty and holds no model "
                   "(no config.json); choose a new or empty directory")


def test_write_failure_part_way_is_one_line(tmp_path, capsys, monkeypatch):
    import errno

    import safetensors.torch

    from lockstep.cli import main

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"lockstep make-model: error: writing {str(tmp_path / 'm')!r} failed: "
                       "No space left on device")
    assert not any("Traceback" in line for line in err)


def test_make_model_writes_a_byte_level_tokenizer(tmp_path):
    """Text prompts work offline (issue 13, item 15): every byte is a token, eos is special."""
    from transformers import AutoTokenizer

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    out = write_model_dir("tiny", tmp_path / "m", dtype="float32")
    tok = AutoTokenizer.from_pretrained(str(out))
    text = "héllo, wörld"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and max(ids) < PRESETS["tiny"]["vocab_size"]
    assert tok.decode(ids) == text
    assert tok.eos_token_id == PRESETS["tiny"]["eos_token_id"]
    with LLM(out, max_model_len=64) as llm:
        res, = llm.generate(text, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert res.error is None and res.prompt_token_ids == ids and isinstance(res.text, str)


def test_output_text_leaves_out_the_stop_token(tmp_path):
    """A fresh user's output ended in "<|im_end|>" (or the byte tokenizer's eos) where the
    stop token ended the request: the text leaves special tokens out, the ids keep them."""
    from transformers import AutoTokenizer

    from engine.llm import output_text

    tok = AutoTokenizer.from_pretrained(str(write_model_dir("tiny", tmp_path / "m",
                                                            dtype="float32")))
    ids = tok.encode("héllo") + [tok.eos_token_id]
    assert tok.decode(ids) != "héllo"
    assert output_text(tok, ids) == "héllo"


def test_a_disk_too_small_for_the_model_is_refused_before_writing(tmp_path, capsys, monkeypatch):
    """Old behaviour: `--preset qwen3-8b` on a small disk wrote shards until the disk was full
    (exit 1 after minutes); with --overwrite the model already there had been removed first."""
    import collections
    import shutil

    from lockstep.cli import main

    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 0
    before = sorted(p.name for p in out.iterdir())
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 10**9, 10**9))
    capsys.readouterr()
    assert main(["make-model", "--preset", "qwen3-8b", "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"lockstep make-model: error: --out {str(out)!r}: the qwen3-8b model "
                          "(bfloat16) needs 16.")
    assert "GB free" in err
    assert sorted(p.name for p in out.iterdir()) == before  # the old model is still there


@pytest.mark.parametrize("dtype, hint", [("bfloat16", "choose another --out or a smaller preset"),
                                         ("float32", "a smaller preset, or a 2-byte --dtype")])
def test_a_disk_too_small_leaves_no_new_directory_behind(tmp_path, capsys, monkeypatch, dtype,
                                                         hint):
    """Found by a fresh user: the refusal had already created the empty --out directory, and
    advised a 2-byte --dtype to a bfloat16 model."""
    import collections
    import shutil

    from lockstep.cli import main

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 10**6, 10**6))
    out = tmp_path / "new" / "m"
    (tmp_path / "new").mkdir()
    assert main(["make-model", "--preset", "qwen3-0.6b", "--out", str(out), "--dtype", dtype]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "GB free" in err and err.endswith(hint) and not out.exists()


def test_a_directory_left_by_an_interrupted_make_model_is_named_as_such(tmp_path, capsys):
    """Found by a fresh user: Ctrl-C during make-model left config and tokenizer files and no
    weights; make-model then said the directory "already holds a model" while generate said
    it holds no weights."""
    from lockstep.cli import main

    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 0
    for shard in out.glob("*.safetensors"):
        shard.unlink()
    capsys.readouterr()
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a config.json but no weights (an interrupted make-model?)" in err
    assert len(err.splitlines()) == 1
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--overwrite"]) == 0
    assert any(out.glob("*.safetensors"))


def _contents(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("error, status", [(OSError(28, "No space left on device"), 1),
                                           (KeyboardInterrupt(), 130)],
                         ids=["disk-full", "ctrl-c"])
def test_a_failure_part_way_leaves_the_model_being_replaced_intact(tmp_path, capsys,
                                                                   monkeypatch, error, status):
    """Found by a fresh user: --overwrite deleted the old model before writing the new one, so
    a run killed part-way left some shards and no index (neither model). The new model is
    written beside --out and moved in only when complete."""
    import safetensors.torch

    from lockstep.cli import main

    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--dtype", "float32"]) == 0
    (out / "notes.txt").write_text("keep me")
    before = _contents(out)
    save, calls = safetensors.torch.save_file, []

    def fail_at_the_third_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return save(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", fail_at_the_third_shard)
    capsys.readouterr()
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--overwrite",
                 "--seed", "7"]) == status
    assert len(calls) == 3
    assert _contents(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary directory left
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("obstacle", ["read-only parent", "another file system"])
def test_a_model_is_written_inside_out_where_it_cannot_be_moved_in_from_beside(
        tmp_path, monkeypatch, obstacle):
    """The temporary directory goes beside --out, but where its parent is read-only, or a
    rename from there into --out fails (--out a mount point: EXDEV), it goes inside --out, and
    leaves nothing behind either way."""
    import errno
    import os
    import tempfile
    from pathlib import Path

    out = tmp_path / "m"
    mkdtemp, rename, refused = tempfile.mkdtemp, os.rename, []

    def read_only_parent(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == tmp_path.resolve():
            refused.append(dir)
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return mkdtemp(*args, dir=dir, **kwargs)

    def across_file_systems(src, dst, *args, **kwargs):
        if Path(src).parent.parent == tmp_path.resolve() and Path(dst).parent == out.resolve():
            refused.append(src)
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))
        return rename(src, dst, *args, **kwargs)

    write_model_dir("tiny", out, dtype="float32")
    first = _contents(out)
    if obstacle == "read-only parent":
        monkeypatch.setattr(tempfile, "mkdtemp", read_only_parent)
    else:
        monkeypatch.setattr(os, "rename", across_file_systems)
    write_model_dir("tiny", out, seed=3, dtype="bfloat16")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {p.name for p in out.glob("*.safetensors")} == set(index["weight_map"].values())
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".safetensors")) == [
        "config.json", "generation_config.json", "model.safetensors.index.json",
        "tokenizer.json", "tokenizer_config.json"]
    assert _contents(out) != first and [p.name for p in tmp_path.iterdir()] == ["m"]
    assert refused, "the temporary directory was not tried beside --out"


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()  # until the test closes stdin
"""
"""A stand-in for a make-model writing its staging directory now: it holds the lock."""


@pytest.mark.timeout(120)
def test_staging_directories_of_killed_runs_are_removed_and_a_live_one_is_kept(tmp_path,
                                                                               capsys):
    """A make-model SIGKILLed part-way left its hidden staging directory (beside --out, or
    inside it where it could not go beside) behind for good: disk space never given back, and
    one inside a new --out made the next run refuse it as "not empty and holds no model"."""
    from engine.model_dir import STAGING_LOCK
    from lockstep.cli import main

    out = tmp_path / "m"
    out.mkdir()
    killed_beside = tmp_path / ".m.make-model-ab_d1234"  # a lock file no one holds
    killed_inside = out / ".make-model-efgh5678"  # killed before it made its lock file
    live = tmp_path / ".m.make-model-live0000"
    not_ours = [tmp_path / ".n.make-model-abcd1234", tmp_path / ".m.make-model-abcd12345",
                tmp_path / "m.make-model-abcd1234"]
    for d in (killed_beside, killed_inside, live, *not_ours):
        d.mkdir()
        (d / "model-00001-of-00002.safetensors").write_bytes(b"part")
    (killed_beside / STAGING_LOCK).touch()
    (tmp_path / ".m.make-model-file0000").write_text("a file, not a staging directory")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(live / STAGING_LOCK)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 0
    finally:
        holder.stdin.close()
        holder.wait()
    err = capsys.readouterr().err
    assert not killed_beside.exists() and not killed_inside.exists()
    for d in (killed_beside, killed_inside):
        assert f"removed {str(d.resolve())!r}, left by an earlier run" in err, err
    assert (live / "model-00001-of-00002.safetensors").read_bytes() == b"part"
    assert all((d / "model-00001-of-00002.safetensors").exists() for d in not_ours)
    assert (tmp_path / ".m.make-model-file0000").is_file()
    assert (out / "config.json").is_file() and any(out.glob("*.safetensors"))



def test_a_lock_file_that_is_a_link_creates_nothing_where_it_points(tmp_path):
    """The stale-directory sweep opened each lock file with O_CREAT and followed a link: a
    staging directory whose .make-model.lock linked elsewhere made that file (a reviewer's
    finding). It is opened without following now, and such a directory is kept."""
    from engine.model_dir import STAGING_LOCK, remove_stale_staging

    out = tmp_path / "m"
    out.mkdir()
    staging = tmp_path / ".m.make-model-link0000"
    staging.mkdir()
    target = tmp_path / "elsewhere" / "created"
    target.parent.mkdir()
    (staging / STAGING_LOCK).symlink_to(target)
    assert remove_stale_staging(out) == []
    assert not target.exists() and staging.is_dir()


KILLED_PART_WAY = """
import os, signal, sys
import safetensors.torch
from engine.model_dir import write_model_dir

save, calls = safetensors.torch.save_file, []

def save_then_die(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return save(*args, **kwargs)

safetensors.torch.save_file = save_then_die
write_model_dir("tiny", sys.argv[1], seed=5, dtype="float32")
"""


@pytest.mark.timeout(300)
def test_a_run_after_a_sigkill_removes_what_the_killed_run_was_writing(tmp_path):
    import os
    import signal

    out = tmp_path / "m"
    write_model_dir("tiny", out, dtype="float32")
    before = sorted(p.name for p in tmp_path.iterdir())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, "-c", KILLED_PART_WAY, str(out)], env=env,
                            capture_output=True, text=True, timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".m.make-model-")]
    assert len(left) == 1 and any(left[0].glob("*.safetensors")), left
    write_model_dir("tiny", out, seed=6, dtype="float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_staging_directory_whose_lock_is_held_is_not_written_into(tmp_path, monkeypatch):
    """The writer of a new staging directory that a run cleaning up has locked first (to remove
    it as stale) makes another instead of writing into one being removed."""
    import fcntl
    import os

    import engine.model_dir as model_dir

    made, held = [], []
    staging_dir = model_dir._staging_dir

    def locked_by_a_cleaner_first(out):
        staging = staging_dir(out)
        if not made:
            fd = os.open(staging / model_dir.STAGING_LOCK, os.O_RDWR | os.O_CREAT)
            fcntl.flock(fd, fcntl.LOCK_EX)
            held.append(fd)
        made.append(staging)
        return staging

    monkeypatch.setattr(model_dir, "_staging_dir", locked_by_a_cleaner_first)
    out = tmp_path / "m"
    try:
        write_model_dir("tiny", out, dtype="float32")
    finally:
        os.close(held[0])
    assert len(made) == 2 and not made[1].exists()
    assert [p.name for p in made[0].iterdir()] == [model_dir.STAGING_LOCK]  # nothing written
    assert (out / "config.json").is_file()


def test_a_non_utf8_out_is_one_line_and_nothing_is_created(tmp_path, capsys, monkeypatch):
    """Non-UTF-8 bytes in --out reach Python as lone surrogates: the tokenizers library raised
    a UnicodeEncodeError traceback after every shard was written, and left the directory."""
    from lockstep.cli import main

    monkeypatch.chdir(tmp_path)
    out = str(tmp_path / b"\xff\xfe".decode("utf-8", "surrogateescape"))
    assert main(["make-model", "--preset", "tiny", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"lockstep make-model: error: --out {out!r} is not valid UTF-8 text: "
                   f"'\\udcff\\udcfe' at character {len(str(tmp_path)) + 1}; the tokenizers "
                   "library writes tokenizer.json only to a UTF-8 path; choose another --out")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="is not valid UTF-8 text"):
        write_model_dir("tiny", out)
    assert list(tmp_path.iterdir()) == []

"""Fixtures of the engine's CPU tests: random-weight model directories written once per session,
and a guard that an argument is refused before any model is read."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """`tiny` preset (untied LM head), float32, seed 0."""
    from engine.model_dir import write_model_dir

    return write_model_dir("tiny", tmp_path_factory.mktemp("tiny"), seed=0, dtype="float32")


@pytest.fixture(scope="session")
def no_tokenizer_dir(tiny_dir, tmp_path_factory):
    """`tiny_dir` without its tokenizer files (a directory that takes token ids only)."""
    import shutil

    d = tmp_path_factory.mktemp("no_tok") / "m"
    shutil.copytree(tiny_dir, d, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    return d


@pytest.fixture(scope="session")
def mismatched_tokenizer_dir(tiny_dir, tmp_path_factory):
    """`tiny_dir` whose tokenizer encodes "h" as id 700, past the model's 512-token vocabulary
    (a tokenizer from another model beside these weights)."""
    import json
    import shutil

    d = tmp_path_factory.mktemp("bad_tok") / "m"
    shutil.copytree(tiny_dir, d)
    assert json.loads((d / "config.json").read_text())["vocab_size"] == 512
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["model"]["vocab"]["h"] = 700
    (d / "tokenizer.json").write_text(json.dumps(tok))
    return d


@pytest.fixture(scope="session")
def tiny_tied_dir(tmp_path_factory):
    """`tiny-tied` preset (tied embeddings, q width != hidden), float32, seed 1."""
    from engine.model_dir import write_model_dir

    return write_model_dir("tiny-tied", tmp_path_factory.mktemp("tiny_tied"), seed=1,
                           dtype="float32")


@pytest.fixture(scope="session")
def hf_model():
    """Loader of the HF transformers reference model (eager attention, float32), cached."""
    cache = {}

    def load(path):
        if path not in cache:
            from transformers import AutoModelForCausalLM

            cache[path] = AutoModelForCausalLM.from_pretrained(
                str(path), attn_implementation="eager", dtype="float32").eval()
        return cache[path]

    return load


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if the model is read or CUDA probed: the refusal must come first."""
    import torch

    import engine.config
    import engine.llm

    def loaded(*a, **k):
        raise AssertionError("read the model or probed CUDA before refusing the argument")

    monkeypatch.setattr(engine.llm, "LLM", loaded)
    monkeypatch.setattr(engine.config, "load_model_config", loaded)
    monkeypatch.setattr(torch.cuda, "is_available", loaded)

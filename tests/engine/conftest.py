"""Fixtures of the engine's CPU tests: random-weight model directories written once per session."""

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

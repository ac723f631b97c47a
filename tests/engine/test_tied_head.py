"""A config that ties the LM head to the embedding, over a checkpoint that stores a different
lm_head.weight: transformers loads both untied, so the engine does too (it used to tie them
and ignore the stored head, and its logits left the reference's without a word)."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import load_model_config
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.testing import hf_logits
from engine.weights import stored_head_differs

PROMPT = [5, 6, 7, 8, 100, 200, 300, 17, 42]


def _with_stored_head(src, dest, head):
    """A copy of the tied model `src` at `dest` whose checkpoint also holds `head(embedding)`
    as lm_head.weight."""
    shutil.copytree(src, dest)
    index_path = dest / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["model.embed_tokens.weight"]
    tensors = load_file(str(dest / shard))
    tensors["lm_head.weight"] = head(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(dest / shard), metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = shard
    index_path.write_text(json.dumps(index))
    return dest


@pytest.fixture(scope="module")
def distinct_head_dir(tiny_tied_dir, tmp_path_factory):
    g = torch.Generator().manual_seed(3)
    return _with_stored_head(tiny_tied_dir, tmp_path_factory.mktemp("distinct") / "m",
                             lambda e: torch.randn(e.shape, generator=g, dtype=e.dtype))


def test_a_distinct_stored_head_unties_the_config_once_with_one_line(distinct_head_dir, capsys):
    assert stored_head_differs(distinct_head_dir)
    assert load_model_config(distinct_head_dir).tie_word_embeddings is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stores a different lm_head.weight" in err
    load_model_config(distinct_head_dir)
    assert capsys.readouterr().err == ""      # said once per directory


def test_a_stored_head_equal_to_the_embedding_stays_tied(tiny_tied_dir, tmp_path, capsys):
    d = _with_stored_head(tiny_tied_dir, tmp_path / "m", lambda e: e.clone())
    assert not stored_head_differs(d)
    assert load_model_config(d).tie_word_embeddings is True
    assert not stored_head_differs(tiny_tied_dir)   # no stored head at all
    assert capsys.readouterr().err == ""


def test_a_second_load_reads_no_tensor_until_the_checkpoint_changes(tiny_tied_dir, tmp_path,
                                                                   monkeypatch):
    """Old behaviour: every `load_model_config` of a tied config over a stored head equal to
    the embedding read both tables in full again."""
    import safetensors

    d = _with_stored_head(tiny_tied_dir, tmp_path / "m", lambda e: e.clone())
    opened = []
    real = safetensors.safe_open

    def counting(path, *args, **kwargs):
        opened.append(os.path.basename(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting)
    assert load_model_config(d).tie_word_embeddings is True
    assert opened, "the first call compares the two tables"
    opened.clear()
    assert load_model_config(str(d) + "/.").tie_word_embeddings is True  # the same directory
    assert opened == []
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / index["weight_map"]["lm_head.weight"]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: compared again
    assert load_model_config(d).tie_word_embeddings is True
    assert opened
    opened.clear()
    time.sleep(0.05)  # past a coarse filesystem clock's tick: the rewrite gets a new mtime
    tensors = load_file(str(shard))
    equal_head = tensors["lm_head.weight"].clone()
    tensors["lm_head.weight"] = equal_head + 1  # the same size, other values
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert load_model_config(d).tie_word_embeddings is False
    assert opened
    opened.clear()
    # a copy that keeps times (cp -p, rsync -a) writes the equal head back, same size, and puts
    # the rewritten file's mtime back: still compared again
    before = shard.stat()
    tensors["lm_head.weight"] = equal_head
    save_file(tensors, str(shard) + ".new", metadata={"format": "pt"})
    os.replace(str(shard) + ".new", shard)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert shard.stat().st_size == before.st_size
    assert load_model_config(d).tie_word_embeddings is True
    assert opened


def test_the_engine_reads_the_stored_head_as_transformers_does(distinct_head_dir, hf_model):
    hf = hf_model(distinct_head_dir)
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)  # HF untied them
    llm = LLM(distinct_head_dir, max_batch=2, max_model_len=32)
    try:
        out, = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0,
                                                     ignore_eos=True, return_logits=True))
    finally:
        llm.shutdown()
    ref = hf_logits(hf, PROMPT + out.token_ids[:-1])[len(PROMPT) - 1:]
    rel = float((out.logits - ref).abs().max() / ref.abs().max())
    assert rel < 1e-4, rel

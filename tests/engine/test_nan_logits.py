"""A request whose logits are not finite ends with an error naming it; the engine keeps serving
the others (issue 13, item 3: NaN weights gave token_ids 0,0,0,0 with exit 0 under greedy, and a
RankError that shut the engine down under sampling)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling import SamplingParams


def _poison_lm_head(model, token):
    from safetensors.torch import load_file, save_file

    for shard in sorted(model.glob("*.safetensors")):
        tensors = load_file(shard)
        if "lm_head.weight" in tensors:
            tensors["lm_head.weight"][token] = float("nan")
            save_file(tensors, shard, metadata={"format": "pt"})
            return
    raise AssertionError("no lm_head.weight")


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory):
    from engine.model_dir import write_model_dir

    model = write_model_dir("tiny", tmp_path_factory.mktemp("nan") / "m", seed=0, dtype="float32")
    _poison_lm_head(model, 7)  # every logit row holds one NaN
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_non_finite_logits_fail_the_request_not_the_engine(nan_model, temperature):
    params = SamplingParams(max_tokens=4, temperature=temperature, ignore_eos=True, seed=1)
    with LLM(nan_model, max_batch=2, max_model_len=64) as llm:
        outs = llm.generate([[1, 2, 3], [4, 5]], params)
        assert [o.finish_reason for o in outs] == ["error", "error"]
        assert "request 1" in str(outs[1].error) and "not finite" in str(outs[1].error)
        assert outs[0].token_ids == []
        again = llm.generate([[1, 2]], params)  # still serving
        assert again[0].finish_reason == "error"


def test_generate_cli_names_non_finite_logits_and_exits_1(nan_model, capsys):
    from lockstep.cli import main

    code = main(["generate", "--model", str(nan_model), "--prompt-ids", "1,2,3",
                 "--max-tokens", "4", "--temperature", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("lockstep generate: error: request 0: ") and "not finite" in err[-1]
    assert "Traceback" not in "\n".join(err)

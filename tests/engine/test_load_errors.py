"""Every unusable model directory or parallel setting fails with a ValueError subclass naming the
bad value and the file, before any rank process starts."""

from __future__ import annotations

import json
import multiprocessing
import shutil

import pytest

from engine.config import check_parallel, load_model_config
from engine.errors import ModelDirError, ParallelConfigError
from engine.llm import LLM
from engine.weights import WeightIndex
from lockstep.args import one_line_repr


DEEP_JSON = "[" * 100_000 + "]" * 100_000
"""JSON nested deeper than Python's parser follows (a fresh user's finding: a RecursionError
traceback from every JSON file of a model directory)."""


@pytest.fixture
def model_copy(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    return d


def _edit_config(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


def _rejects(d, exc_type, *fragments, tp=1):
    """LLM(d) raises exc_type mentioning every fragment, and no rank process was started."""
    with pytest.raises(exc_type) as info:
        LLM(d, tensor_parallel_size=tp)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, (f, msg)
    assert multiprocessing.active_children() == []
    return msg


def test_errors_are_value_errors():
    assert issubclass(ModelDirError, ValueError) and issubclass(ParallelConfigError, ValueError)


def test_missing_directory(tmp_path):
    _rejects(tmp_path / "nope", ModelDirError, "nope", "does not exist")


def test_a_file_named_as_the_model_directory(tmp_path):
    """It said "does not exist or is not a directory" for a file (a fresh user's finding)."""
    (tmp_path / "README.md").write_text("not a model")
    msg = _rejects(tmp_path / "README.md", ModelDirError, "README.md", "is not a directory")
    assert "does not exist" not in msg


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    _rejects(model_copy, ModelDirError, "config.json", "missing")


def test_unsupported_architecture(model_copy):
    _edit_config(model_copy, architectures=["LlamaForCausalLM"], model_type="llama")
    _rejects(model_copy, ModelDirError, "config.json", "LlamaForCausalLM",
             "unsupported architecture")


def test_missing_shard(model_copy):
    idx = json.loads((model_copy / "model.safetensors.index.json").read_text())
    shard = sorted(set(idx["weight_map"].values()))[1]
    (model_copy / shard).unlink()
    _rejects(model_copy, ModelDirError, shard, "missing")


def test_a_shard_that_is_a_directory_is_named_so(model_copy):
    """It read "shard file is missing" of a directory there (a fresh user's finding)."""
    idx = json.loads((model_copy / "model.safetensors.index.json").read_text())
    shard = sorted(set(idx["weight_map"].values()))[1]
    (model_copy / shard).unlink()
    (model_copy / shard).mkdir()
    msg = _rejects(model_copy, ModelDirError, shard, "is a directory, not a file")
    assert "missing" not in msg


def _name_first_shard(d, shard_name) -> tuple[str, str, str]:
    """Point the index's first tensor at ``shard_name(shard)`` (its shard's old name given);
    returns (tensor name, old shard name, new shard name)."""
    path = d / "model.safetensors.index.json"
    idx = json.loads(path.read_text())
    name, shard = next(iter(idx["weight_map"].items()))
    idx["weight_map"][name] = new = shard_name(shard)
    path.write_text(json.dumps(idx))
    return name, shard, new


@pytest.mark.parametrize("outside", ["../{d}/{shard}", "{abs}", "", ".", "sub/../../{d}/{shard}"])
def test_a_shard_named_outside_the_model_directory_is_refused(model_copy, tmp_path, outside):
    """An index entry of "../m/model-00001-of-00005.safetensors" loaded from another
    directory without a word (a fresh user's finding): the index names files of its own
    directory, as the Hub writes it."""
    other = tmp_path / "other"
    shutil.copytree(model_copy, other)
    name, _, bad = _name_first_shard(
        model_copy, lambda shard: outside.format(d="other", shard=shard, abs=other / shard))
    _rejects(model_copy, ModelDirError, "model.safetensors.index.json", one_line_repr(bad, 120),
             one_line_repr(name), f"is not a file name inside {model_copy}")


@pytest.mark.parametrize("inside", ["./{shard}", "sub/../{shard}"])
def test_a_shard_name_that_stays_inside_the_directory_loads(model_copy, inside):
    """A reviewer's finding: "sub/../x" was refused as a name outside the directory."""
    (model_copy / "sub").mkdir()
    name, shard, _ = _name_first_shard(model_copy, lambda shard: inside.format(shard=shard))
    cfg = load_model_config(model_copy)
    assert WeightIndex(cfg).files[name].resolve() == (model_copy / shard).resolve()


def test_a_missing_shard_whose_name_breaks_the_line_is_one_line(model_copy):
    """The index's names reach the error: one with a line break made it two lines."""
    _name_first_shard(model_copy, lambda shard: "gone\nshard.safetensors")
    msg = _rejects(model_copy, ModelDirError, "shard file is missing")
    assert "\n" not in msg and "gone\\nshard" in msg, msg


@pytest.mark.parametrize("index", ["[]", '{"weight_map": []}', '{"weight_map": null}',
                                   '{"weight_map": {"model.norm.weight": 5}}', '{}'])
def test_an_index_without_a_weight_map_object_is_named(model_copy, index):
    """Old behaviour: an index of valid JSON but the wrong shape (a list, a map of numbers)
    was a TypeError or AttributeError traceback from `lockstep generate`."""
    (model_copy / "model.safetensors.index.json").write_text(index)
    _rejects(model_copy, ModelDirError, "model.safetensors.index.json: no \"weight_map\" "
             "object mapping tensor names to shard file names")


def test_tensor_missing_from_index(model_copy):
    path = model_copy / "model.safetensors.index.json"
    idx = json.loads(path.read_text())
    del idx["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    path.write_text(json.dumps(idx))
    _rejects(model_copy, ModelDirError, "model.layers.1.mlp.down_proj.weight", "missing")


def test_tensor_missing_from_a_single_file_names_that_file(model_copy):
    """No index, one model.safetensors without the model's tensors: the error names the file
    that is there, not an index that does not exist (found by a fresh user)."""
    import torch
    from safetensors.torch import save_file

    for f in model_copy.glob("*.safetensors*"):
        f.unlink()
    save_file({"unrelated": torch.zeros(2)}, str(model_copy / "model.safetensors"))
    msg = _rejects(model_copy, ModelDirError, "model.safetensors: tensor", "missing")
    assert "index.json" not in msg, msg


def test_wrong_tensor_shape(model_copy):
    import torch
    from safetensors.torch import load_file, save_file

    name = "model.layers.0.self_attn.k_proj.weight"
    idx = json.loads((model_copy / "model.safetensors.index.json").read_text())
    shard = model_copy / idx["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = torch.zeros(48, 64)
    save_file(tensors, str(shard))
    _rejects(model_copy, ModelDirError, name, "[48, 64]", "[32, 64]", shard.name)


def _retype_tensor(d, name, dtype):
    """Rewrite the shard of tensor `name` in model directory `d` with that tensor in `dtype`;
    returns the shard's path."""
    import torch
    from safetensors.torch import load_file, save_file

    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / idx["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = (tensors[name] * 100).to(getattr(torch, dtype))
    save_file(tensors, str(shard))
    return shard


@pytest.mark.parametrize("dtype, spelt", [("int32", "I32"), ("float64", "F64"),
                                          ("float8_e4m3fn", "F8_E4M3"), ("bool", "BOOL")])
def test_a_tensor_of_a_dtype_the_engine_does_not_load_is_named(model_copy, capsys, dtype,
                                                                spelt):
    """A fresh user's finding: an int32 tensor loaded silently (converted by the copy into the
    float parameters) and `lockstep generate` printed tokens; the shard header's dtype is now
    checked with its shape, before any rank starts."""
    from lockstep.cli import main

    name = "model.layers.0.self_attn.k_proj.weight"
    shard = _retype_tensor(model_copy, name, dtype)
    words = (f"{shard}: tensor {name!r} has dtype {spelt}; this engine loads weights stored "
             "as float32, bfloat16, float16 only")
    assert _rejects(model_copy, ModelDirError) == words
    assert main(["generate", "--model", str(model_copy), "--prompt-ids", "1",
                 "--max-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert "token_ids" not in out
    assert err == f"lockstep generate: error: {words}\n", err


def test_float_tensors_of_another_storage_dtype_than_the_config_load(model_copy):
    """A norm weight in bfloat16 within a float32 checkpoint is one of the storage dtypes:
    copied into the float32 parameter as before."""
    import torch

    _retype_tensor(model_copy, "model.norm.weight", "bfloat16")
    index = WeightIndex(load_model_config(model_copy))
    assert index.read("model.norm.weight").dtype == torch.bfloat16


def test_wrong_config_field_shapes_are_caught_against_weights(model_copy):
    _edit_config(model_copy, intermediate_size=96)
    _rejects(model_copy, ModelDirError, "mlp.gate_proj.weight", "[96, 64]")


@pytest.mark.parametrize("tp, field, value", [
    (3, "num_attention_heads", 4),
    (4, "num_key_value_heads", 2),
])
def test_heads_not_divisible_by_tp(tiny_dir, tp, field, value):
    _rejects(tiny_dir, ParallelConfigError, f"{field} = {value}",
             f"tensor_parallel_size = {tp}", "config.json", tp=tp)


def test_intermediate_and_vocab_not_divisible_by_tp(tiny_dir):
    cfg = load_model_config(tiny_dir)
    import dataclasses

    odd_inter = dataclasses.replace(cfg, intermediate_size=130, num_kv_heads=4)
    with pytest.raises(ParallelConfigError, match="intermediate_size = 130 .* = 4"):
        check_parallel(odd_inter, 4)
    odd_vocab = dataclasses.replace(cfg, vocab_size=511)
    with pytest.raises(ParallelConfigError, match="vocab_size = 511"):
        check_parallel(odd_vocab, 2)


def test_bad_tp_size_and_settings(tiny_dir):
    _rejects(tiny_dir, ParallelConfigError, "tensor_parallel_size = 0", tp=0)
    _rejects(tiny_dir, ParallelConfigError, "tensor_parallel_size = True", tp=True)
    with pytest.raises(ParallelConfigError, match="page_size = 24"):
        LLM(tiny_dir, page_size=24)
    with pytest.raises(ParallelConfigError, match="device = 'tpu'"):
        LLM(tiny_dir, device="tpu")
    with pytest.raises(ParallelConfigError, match="max_model_len = 999999"):
        LLM(tiny_dir, max_model_len=999999)


def test_weight_index_accepts_the_good_dir(tiny_dir):
    index = WeightIndex(load_model_config(tiny_dir))
    sl = index.read("model.embed_tokens.weight", 0, 256, 512)
    assert tuple(sl.shape) == (256, 64)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "intermediate_size",
                                   "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim"])
def test_missing_shape_field_is_named_not_a_tensor_mismatch(model_copy, field):
    """transformers fills in Qwen3 defaults for a missing field (issue 13, item 7; head_dim
    defaults to 128 whatever the hidden size)."""
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg[field]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    msg = _rejects(model_copy, ModelDirError, "config.json", f"{field} missing")
    assert "shape" not in msg.split("missing")[0]


@pytest.mark.parametrize("text", ["{'not json", "[]", "5",
                                  pytest.param(DEEP_JSON, id="nested-100000-deep")])
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_corrupt_tokenizer_is_a_model_dir_error_naming_the_files(model_copy, name, text):
    """A corrupt tokenizer file raised a bare JSONDecodeError naming no file (fresh user); one
    of JSON but not an object ([], 5) an AttributeError traceback, one nested 100,000 deep a
    RecursionError traceback."""
    if not (model_copy / name).is_file():
        pytest.skip(f"the tiny model has no {name}")
    (model_copy / name).write_text(text)
    msg = _rejects(model_copy, ModelDirError, "tokenizer", name, "cannot be read")
    assert "\n" not in msg


def _nest(d, name, key, depth):
    """Set ``key`` of the JSON object in ``d / name`` to arrays nested ``depth`` deep."""
    raw = json.loads((d / name).read_text())
    raw[key] = "NESTED"
    text = json.dumps(raw).replace('"NESTED"', "[" * depth + "]" * depth)
    (d / name).write_text(text)


@pytest.mark.parametrize("name, key, depth", [
    ("tokenizer.json", None, 100_000), ("tokenizer_config.json", None, 100_000),
    # past the tokenizers library's limit (128): a bare Exception traceback before
    ("tokenizer.json", "normalizer", 200),
    ("tokenizer_config.json", "deep", 2_000),
])
def test_a_tokenizer_file_nested_too_deeply_is_named_alone(model_copy, capsys, name, key,
                                                           depth):
    """Old behaviour: "maximum recursion depth exceeded while decoding a JSON array", naming
    tokenizer.json and tokenizer_config.json whichever was nested too deeply."""
    from lockstep.cli import main

    if key is None:
        (model_copy / name).write_text("[" * depth + "]" * depth)
    else:
        _nest(model_copy, name, key, depth)
        depth += 1  # inside the file's object
    msg = _rejects(model_copy, ModelDirError)
    assert msg == (f"{model_copy / name}: the tokenizer cannot be read: arrays or objects "
                   f"nested {depth} deep, too deeply to parse")
    capsys.readouterr()
    assert main(["generate", "--model", str(model_copy), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == f"lockstep generate: error: {msg}\n"


def test_a_tokenizer_json_the_tokenizers_library_refuses_is_one_line(model_copy, capsys):
    """Valid JSON that is not a tokenizer (a normalizer of []): the tokenizers library raises
    a bare Exception, which was a traceback."""
    from lockstep.cli import main

    raw = json.loads((model_copy / "tokenizer.json").read_text())
    raw["normalizer"] = []
    (model_copy / "tokenizer.json").write_text(json.dumps(raw))
    msg = _rejects(model_copy, ModelDirError, "tokenizer.json", "cannot be read: ")
    assert "\n" not in msg and "nested" not in msg
    capsys.readouterr()
    assert main(["generate", "--model", str(model_copy), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == f"lockstep generate: error: {msg}\n"


def test_nesting_depth_counts_brackets_outside_strings():
    from engine.config_json import nesting_depth

    assert nesting_depth('{"a": "[[{\\"[", "b": [[1], {}]}') == 3
    assert nesting_depth("5") == 0 and nesting_depth("[" * 100_000 + "]" * 100_000) == 100_000


def test_a_missing_tokenizer_json_is_named_with_the_whole_reason_on_one_line(model_copy):
    """Found by a fresh user: the message stopped mid-sentence ("... from one of: ")."""
    (model_copy / "tokenizer.json").unlink()
    msg = _rejects(model_copy, ModelDirError, "tokenizer_config.json",
                   "cannot be read (tokenizer.json is missing): ")
    assert "\n" not in msg and not msg.rstrip().endswith(":")
    assert "from one of:" not in msg or "(1)" in msg


@pytest.mark.parametrize("fields, named", [
    ({"rms_norm_eps": -0.5}, "rms_norm_eps = -0.5"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps = nan"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps = inf"),
    ({"rope_theta": 0.0, "rope_parameters": {"rope_theta": 0.0, "rope_type": "default"}},
     "rope_theta = 0.0"),
    ({"rope_theta": -5.0, "rope_parameters": {"rope_theta": -5.0, "rope_type": "default"}},
     "rope_theta = -5.0"),
    ({"rope_theta": float("nan"), "rope_parameters": {"rope_theta": float("nan"),
                                                      "rope_type": "default"}},
     "rope_theta = nan"),
    ({"max_position_embeddings": 0}, "max_position_embeddings = 0"),
    ({"max_position_embeddings": -4}, "max_position_embeddings = -4"),
    ({"rope_theta": -5.0, "rope_parameters": {"rope_theta": 1_000_000.0, "rope_type": "default"}},
     "rope_theta = -5.0 disagrees with rope_parameters.rope_theta = 1000000.0"),
])
def test_out_of_range_scalars_are_named_before_any_rank_starts(model_copy, fields, named):
    """Old behaviour: these passed the config check; the first token came out NaN ("512 of the
    512 logits ... are not finite") or every prompt was "longer than the max model length 0"."""
    _edit_config(model_copy, **fields)
    msg = _rejects(model_copy, ModelDirError, "config.json", named)
    assert "\n" not in msg


@pytest.mark.parametrize("text, named", [
    ('{"eos_token_id": "abc"}', "eos_token_id = 'abc': 'abc' is not a token id in [0, 512)"),
    ('{"eos_token_id": [2, "x"]}', "eos_token_id = [2, 'x']: 'x' is not a token id"),
    ('{"eos_token_id": 99999}', "eos_token_id = 99999: 99999 is not a token id in [0, 512)"),
    ('{"eos_token_id": -1}', "eos_token_id = -1: -1 is not a token id"),
    ('{"eos_token_id": true}', "eos_token_id = True: True is not a token id"),
    ("[]", "expected a JSON object, got list"),
])
def test_bad_eos_ids_in_generation_config_are_named(model_copy, text, named):
    """Old behaviour: "invalid literal for int() with base 10: 'abc'" (no file, no field), an
    AttributeError traceback for a list, and ids that can never be sampled (99999, 'x', True)
    accepted, so generation never stopped at end of sequence."""
    (model_copy / "generation_config.json").write_text(text)
    msg = _rejects(model_copy, ModelDirError, "generation_config.json", named)
    assert "\n" not in msg


@pytest.mark.parametrize("scaling", [{"type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 512},
                                     {"rope_type": "linear", "factor": 2.0}])
def test_rope_scaling_is_refused_not_ignored(model_copy, scaling):
    """Old behaviour: a config with YaRN or linear RoPE scaling loaded, and the engine computed
    plain RoPE: every position past the first was silently different from the model's."""
    _edit_config(model_copy, rope_scaling=scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    _rejects(model_copy, ModelDirError, "config.json", f"rope_type = {kind!r}", "only the default RoPE")


@pytest.mark.parametrize("fields, named", [
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"hidden_act": "not-an-activation"}, "hidden_act = 'not-an-activation'"),
    ({"attention_bias": True}, "attention_bias = True"),
    ({"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window = True"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "['sliding_attention']"),
    ({"dtype": "int8", "torch_dtype": "int8"}, "dtype = 'int8'"),
    ({"torch_dtype": "int4"}, "torch_dtype = 'int4'"),
    ({"dtype": "auto"}, "dtype = 'auto'"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}},
     "quantization_config (quant_method 'awq') asks for quantized weights"),
])
def test_settings_the_engine_does_not_implement_are_refused_not_ignored(model_copy, fields,
                                                                        named):
    """Old behaviour (found by a fresh user): each of these loaded and generated the same
    tokens as the unmodified model, silently computing a different model than the config
    names (a quantization_config, or a torch_dtype beside a float dtype, too)."""
    _edit_config(model_copy, **fields)
    msg = _rejects(model_copy, ModelDirError, "config.json", named)
    assert "\n" not in msg


@pytest.mark.parametrize("fields, message", [
    ({"vocab_size": 0}, "vocab_size = 0, expected a positive integer"),
    ({"head_dim": 0}, "head_dim = 0, expected a positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads = 0, expected a positive integer"),
    ({"hidden_size": 64.0}, "hidden_size = 64.0, expected a positive integer"),
    ({"head_dim": 7}, "head_dim = 7, expected an even number (RoPE rotates pairs"),
    ({"model_type": "llama"}, "model_type = 'llama', expected 'qwen3'"),
    ({"architectures": "Qwen3ForCausalLM"},
     "unsupported architecture: architectures = 'Qwen3ForCausalLM'"),
    ({"rms_norm_eps": 0}, "rms_norm_eps = 0 is an integer; expected a float such as 1e-06"),
    ({"rms_norm_eps": None}, "rms_norm_eps = None, expected a finite number > 0"),
    # a second fresh user's findings: eps 0.0 (the float the integer 0's advice asks for) ran,
    # and config.json's eos_token_id was not checked (generation_config.json's was)
    ({"rms_norm_eps": 0.0}, "rms_norm_eps = 0.0, expected a finite number > 0"),
    ({"eos_token_id": 100000}, "eos_token_id = 100000, expected a token id or a list of token "
                               "ids in [0, 512)"),
    ({"eos_token_id": -1}, "eos_token_id = -1, expected a token id"),
    ({"eos_token_id": [2, 9999]}, "eos_token_id = [2, 9999], expected a token id"),
    ({"eos_token_id": "2"}, "eos_token_id = '2', expected a token id"),
    ({"max_window_layers": "x"}, "max_window_layers = 'x', expected an int (transformers"),
    ({"num_hidden_layers": 5},
     "num_hidden_layers = 5 but layer_types lists 2 layers; expected one layer_types entry"),
    ({"layer_types": "full_attention"}, "layer_types = 'full_attention', expected a list"),
    ({"max_position_embeddings": 2048.0}, "max_position_embeddings = 2048.0, expected a "
                                          "positive integer"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings = 'yes', expected a bool"),
])
def test_a_broken_config_field_is_named_in_config_json(model_copy, fields, message):
    """Found by a fresh user: vocab_size 0 was reported as generation_config.json's eos id
    "not a token id in [0, 0)"; model_type 'llama' as "unsupported architecture
    ['Qwen3ForCausalLM'] ... runs ['Qwen3ForCausalLM'] only"; the rest as transformers'
    validator text ("expected float, got int", "must be equal to the number of
    `layer_types`"), or (head_dim 0) not at all."""
    _edit_config(model_copy, **fields)
    msg = _rejects(model_copy, ModelDirError, message)
    assert msg.startswith(f"{model_copy / 'config.json'}: ") and "\n" not in msg, msg
    assert "transformers.AutoConfig:" not in msg and "generation_config" not in msg, msg


@pytest.mark.parametrize("value", [None, [1], "abc", True, pytest.param(10**400, id="10**400")])
@pytest.mark.parametrize("where", ["rope_theta", "rope_parameters.rope_theta",
                                   "rope_theta beside rope_parameters without one"])
def test_a_rope_theta_that_is_not_a_number_is_named(model_copy, where, value):
    """Found by a fresh user: null or [1] was a TypeError traceback from float() in
    engine/config.py, "abc" the line "could not convert string to float: 'abc'" naming neither
    file nor field, and true ran as 1.0 (hidden_size: true was refused)."""
    cfg = json.loads((model_copy / "config.json").read_text())
    if where == "rope_parameters.rope_theta":
        del cfg["rope_theta"]
        cfg["rope_parameters"]["rope_theta"] = value
    else:
        cfg["rope_theta"] = value
        if where == "rope_theta":
            del cfg["rope_parameters"]
        else:
            del cfg["rope_parameters"]["rope_theta"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    field = "rope_parameters.rope_theta" if where.startswith("rope_parameters") else "rope_theta"
    msg = _rejects(model_copy, ModelDirError)
    assert msg == (f"{model_copy / 'config.json'}: {field} = {value!r}, expected a finite "
                   "number > 0 (the RoPE base; Qwen3 uses 1000000.0)")


def test_an_integer_rope_theta_is_accepted(model_copy):
    """Qwen3's own config.json writes "rope_theta": 1000000, an integer."""
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg["rope_theta"] = 1000000
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(model_copy).rope_theta == 1e6


def _deny_reading(monkeypatch, path):
    """Reading ``path`` raises PermissionError, as for a file of mode 000 (simulated: root
    reads it anyway, and these tests may run as root). `safe_open` reads in Rust, so it is
    made to fail with its own words for such a file ("No such file or directory: ...")."""
    import builtins
    import errno
    import pathlib

    import safetensors

    def denied():
        return PermissionError(errno.EACCES, "Permission denied", str(path))

    read_text, real_open, safe_open = pathlib.Path.read_text, builtins.open, safetensors.safe_open

    def fake_read_text(self, *args, **kwargs):
        if self == path:
            raise denied()
        return read_text(self, *args, **kwargs)

    def fake_open(file, *args, **kwargs):
        if isinstance(file, (str, pathlib.Path)) and pathlib.Path(file) == path:
            raise denied()
        return real_open(file, *args, **kwargs)

    def fake_safe_open(filename, *args, **kwargs):
        if pathlib.Path(filename) == path:
            raise safetensors.SafetensorError(f"No such file or directory: {path}")
        return safe_open(filename, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", fake_read_text)
    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(safetensors, "safe_open", fake_safe_open)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json",
                                  "model.safetensors.index.json", "a shard"])
def test_an_unreadable_model_file_is_named_with_the_os_reason(model_copy, monkeypatch, name):
    """Found by a fresh user (files of mode 000): config.json and generation_config.json were
    "not valid JSON: [Errno 13] Permission denied", a shard "unreadable safetensors shard (No
    such file or directory: ...)" though the file is there."""
    if name == "a shard":
        index = json.loads((model_copy / "model.safetensors.index.json").read_text())
        name = sorted(set(index["weight_map"].values()))[1]
    assert (model_copy / name).is_file()
    _deny_reading(monkeypatch, model_copy / name)
    msg = _rejects(model_copy, ModelDirError)
    assert msg == f"{model_copy / name}: cannot read: Permission denied"


def test_an_unreadable_single_model_safetensors_is_named_with_the_os_reason(model_copy,
                                                                           monkeypatch):
    import torch
    from safetensors.torch import save_file

    for f in model_copy.glob("*.safetensors*"):
        f.unlink()
    save_file({"unrelated": torch.zeros(2)}, str(model_copy / "model.safetensors"))
    _deny_reading(monkeypatch, model_copy / "model.safetensors")
    msg = _rejects(model_copy, ModelDirError)
    assert msg == f"{model_copy / 'model.safetensors'}: cannot read: Permission denied"


def test_a_model_directory_that_may_not_be_entered_is_one_line(model_copy, monkeypatch, capsys):
    """Found by a fresh user: a model directory of mode 700 owned by another user was a
    PermissionError traceback from check_before_load -> load_model_config. Simulated (root
    enters any directory): looking at any file inside it raises PermissionError."""
    import errno
    import pathlib

    from lockstep.cli import main

    stat = pathlib.Path.stat

    def fake_stat(self, *args, **kwargs):
        if self.parent == model_copy:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return stat(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "stat", fake_stat)
    msg = _rejects(model_copy, ModelDirError)
    assert msg == f"{model_copy / 'config.json'}: cannot read: Permission denied"
    capsys.readouterr()
    assert main(["generate", "--model", str(model_copy), "--prompt-ids", "1"]) == 2
    assert capsys.readouterr().err == f"lockstep generate: error: {msg}\n"


@pytest.mark.parametrize("name", ["config.json", "generation_config.json",
                                  "model.safetensors.index.json"])
@pytest.mark.parametrize("text", [DEEP_JSON, '{"a": ' * 100_000 + "1" + "}" * 100_000],
                         ids=["arrays", "objects"])
def test_json_nested_too_deeply_is_one_line_naming_the_file(model_copy, name, text):
    """Old behaviour: a RecursionError traceback from json.loads."""
    (model_copy / name).write_text(text)
    msg = _rejects(model_copy, ModelDirError)
    assert msg == (f"{model_copy / name}: not valid JSON: arrays or objects nested too deeply "
                   "to parse")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json",
                                  "model.safetensors.index.json"])
def test_a_json_file_that_is_not_utf8_is_named_with_its_byte(model_copy, name, capsys):
    """Old behaviour: "'utf-8' codec can't decode byte 0xff in position 6: invalid start
    byte", naming neither the file nor what was wrong with it."""
    from lockstep.cli import main

    (model_copy / name).write_bytes(b'{"a":"\xff"}')
    msg = _rejects(model_copy, ModelDirError)
    assert msg == (f"{model_copy / name}: not valid JSON: not UTF-8 text: byte 0xff at offset 6 "
                   "(invalid start byte)")
    assert main(["generate", "--model", str(model_copy), "--prompt-ids", "1"]) == 2
    assert capsys.readouterr().err == f"lockstep generate: error: {msg}\n"


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_file_that_is_not_utf8_is_named_alone(model_copy, name):
    """Old behaviour: both tokenizer files named, and Python's codec words for the reason."""
    (model_copy / name).write_bytes(b'{"a":"\xff"}')
    msg = _rejects(model_copy, ModelDirError)
    assert msg == (f"{model_copy / name}: the tokenizer cannot be read: not UTF-8 text: byte "
                   "0xff at offset 6 (invalid start byte)")


def _fifo(path):
    import os

    os.mkfifo(path)


def _link_to_dev_zero(path):
    path.symlink_to("/dev/zero")


@pytest.mark.timeout(60)  # opening a FIFO blocks: a regression hangs rather than fails
@pytest.mark.parametrize("name", ["config.json", "generation_config.json",
                                  "model.safetensors.index.json", "model.safetensors",
                                  "tokenizer.json", "tokenizer_config.json",
                                  "special_tokens_map.json"])
@pytest.mark.parametrize("make", [_fifo, _link_to_dev_zero], ids=["fifo", "link-to-dev-zero"])
def test_a_model_file_that_is_no_regular_file_is_named_so(model_copy, capsys, name, make):
    """A fresh user's finding: tokenizer.json as a FIFO read "tokenizer.json is missing", the
    index as one "no model.safetensors.index.json and no model.safetensors", and
    generation_config.json or tokenizer_config.json as one was passed over (exit 0)."""
    from lockstep.cli import main

    if name == "model.safetensors":  # read only where there is no index
        (model_copy / "model.safetensors.index.json").unlink()
    (model_copy / name).unlink(missing_ok=True)
    make(model_copy / name)
    kind = ("a FIFO" if make is _fifo else "a link to '/dev/zero', a character device")
    msg = _rejects(model_copy, ModelDirError)
    assert msg == f"{model_copy / name}: not a regular file ({kind})"
    assert main(["generate", "--model", str(model_copy), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == f"lockstep generate: error: {msg}\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", [_fifo, _link_to_dev_zero], ids=["fifo", "link-to-dev-zero"])
def test_a_shard_that_is_no_regular_file_is_named_so(model_copy, make):
    """It read "shard file is missing" of a link to /dev/zero (a fresh user's finding)."""
    idx = json.loads((model_copy / "model.safetensors.index.json").read_text())
    shard = sorted(set(idx["weight_map"].values()))[1]
    (model_copy / shard).unlink()
    make(model_copy / shard)
    kind = ("a FIFO" if make is _fifo else "a link to '/dev/zero', a character device")
    msg = _rejects(model_copy, ModelDirError)
    assert msg.startswith(f"{str(model_copy / shard)!r}: shard file is not a regular file "
                          f"({kind}) (named by the index for "), msg

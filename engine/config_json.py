"""Checks of config.json's raw fields, before `transformers.AutoConfig` reads the file.

transformers fills in Qwen3 defaults for missing fields, ignores keys it has no use for
(`quantization_config` on a Qwen3Config) and reports its own type and consistency checks in
its own words ("expected float, got int"); each field the engine depends on is checked here
first, so that the error names config.json, the field, its value and what is expected.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from engine.errors import ModelDirError, unreadable

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)

STORAGE_DTYPES = ("float32", "bfloat16", "float16")
"""Weight dtypes config.json may name: the loader reads floating-point tensors only."""

SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size")
"""config.json fields that set tensor shapes: transformers fills in Qwen3 defaults for missing
ones (head_dim 128 whatever the hidden size), which then surface as a confusing tensor-shape
mismatch, so each must be present."""


def load_json(path: Path):
    """The JSON value in ``path`` (a model directory's config, generation config or index).

    Raises:
        ModelDirError: unreadable (the OS's reason: "cannot read: Permission denied") or not
            valid JSON, naming the file; JSON nested deeper than Python's parser follows
            (``[[[...]]]`` 100,000 deep) counts as not valid: it was a RecursionError traceback.
            So does text that is not UTF-8 (JSON's one encoding, RFC 8259 8.1), named with
            the first bad byte and its offset: it was "'utf-8' codec can't decode byte 0xff
            in position 6", naming no file.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:  # it was "not valid JSON: [Errno 13] ...", though no JSON was read
        raise unreadable(path, exc) from None
    except UnicodeDecodeError as exc:
        raise ModelDirError(f"{path}: not valid JSON: {not_utf8(exc)}") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ModelDirError(f"{path}: not valid JSON: {exc}") from None
    except RecursionError:
        raise ModelDirError(f"{path}: not valid JSON: arrays or objects nested too deeply to "
                            "parse") from None


def not_utf8(exc: UnicodeDecodeError) -> str:
    """The words for a file that is not UTF-8 text, from the error decoding it: "not UTF-8
    text: byte 0xff at offset 6 (invalid start byte)"."""
    return (f"not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {exc.start} "
            f"({exc.reason})")


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
"""A JSON string, escapes included: the brackets inside one are not nesting."""


def nesting_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``text`` (0 for a bare
    scalar), found without recursing: how a file that a recursive parser gives up on (Python's
    json at about 1,000 levels, the tokenizers library at 128) is told apart from one refused
    for another reason, and named."""
    depth = deepest = 0
    for bracket in re.findall(r"[][{}]", _JSON_STRING.sub('""', text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path`` (a model directory's config or generation config).

    Raises:
        ModelDirError: unreadable, not valid JSON (`load_json`), or not an object, naming the
            file.
    """
    raw = load_json(path)
    if not isinstance(raw, dict):
        raise ModelDirError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def read_config_json(cfg_path: Path) -> dict:
    """The JSON object of ``cfg_path``, with every field the engine depends on checked.

    Raises:
        ModelDirError: not a JSON object; an architecture or model_type other than Qwen3's;
            quantized or non-float weights; a shape field missing or not a positive integer;
            an odd head_dim; layer_types of another length than num_hidden_layers; a
            max_position_embeddings, rms_norm_eps or rope_theta of the wrong type (a bool
            included) or out of range.
    """
    raw = read_json_object(cfg_path)
    _check_model_kind(raw, cfg_path)
    _check_weight_dtype(raw, cfg_path)
    _check_shapes(raw, cfg_path)
    _check_scalars(raw, cfg_path)
    return raw


def _check_model_kind(raw: dict, cfg_path: Path) -> None:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelDirError(f"{cfg_path}: unsupported architecture: architectures = {archs!r}; "
                            f"this engine runs {' or '.join(SUPPORTED_ARCHITECTURES)} only")
    if raw.get("model_type") != "qwen3":
        raise ModelDirError(f"{cfg_path}: model_type = {raw.get('model_type')!r}, expected "
                            "'qwen3' (the model_type of Qwen3ForCausalLM)")


def _check_weight_dtype(raw: dict, cfg_path: Path) -> None:
    quant = raw.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ModelDirError(f"{cfg_path}: quantization_config (quant_method {method!r}) asks "
                            "for quantized weights; this engine loads weights stored as "
                            f"{', '.join(STORAGE_DTYPES)} only")
    for field in ("dtype", "torch_dtype"):  # transformers keeps one of them, the other unseen
        value = raw.get(field)
        if value is not None and str(value).replace("torch.", "") not in STORAGE_DTYPES:
            raise ModelDirError(f"{cfg_path}: {field} = {value!r}; this engine loads weights "
                                f"stored as {', '.join(STORAGE_DTYPES)} only")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_shapes(raw: dict, cfg_path: Path) -> None:
    missing = [f for f in SHAPE_FIELDS if f not in raw]
    if missing:
        raise ModelDirError(f"{cfg_path}: {', '.join(missing)} missing; the weights' shapes "
                            "depend on it (transformers would silently use Qwen3 defaults)")
    for field in SHAPE_FIELDS:
        if not _positive_int(raw[field]):
            raise ModelDirError(f"{cfg_path}: {field} = {raw[field]!r}, expected a positive "
                                "integer")
    if raw["head_dim"] % 2:
        raise ModelDirError(f"{cfg_path}: head_dim = {raw['head_dim']}, expected an even number "
                            "(RoPE rotates pairs of dimensions; Qwen3 uses 128)")
    layers, kinds = raw["num_hidden_layers"], raw.get("layer_types")
    if kinds is not None and not isinstance(kinds, list):
        raise ModelDirError(f"{cfg_path}: layer_types = {kinds!r}, expected a list with one "
                            "entry per layer")
    if kinds is not None and len(kinds) != layers:
        raise ModelDirError(f"{cfg_path}: num_hidden_layers = {layers} but layer_types lists "
                            f"{len(kinds)} layers; expected one layer_types entry per layer")


def _finite_positive(value) -> bool:
    """A JSON number (not a bool: True is an int to Python) that is a finite float > 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        value = float(value)  # an integer of 400 digits overflows here
    except OverflowError:
        return False
    return math.isfinite(value) and value > 0


def _rope_theta_field(raw: dict) -> tuple[str, object] | None:
    """(field, value) of the RoPE base transformers 5 will use, as config.json spells it, or
    None where it names none (transformers then uses 10000.0). Its order
    (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`): the ``rope_theta`` of
    ``rope_scaling`` or else ``rope_parameters``, then the top-level ``rope_theta``; a null
    value is kept, not skipped."""
    name = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(name)
    if isinstance(params, dict) and "rope_theta" in params:
        return f"{name}.rope_theta", params["rope_theta"]
    if "rope_theta" in raw:
        return "rope_theta", raw["rope_theta"]
    return None


def _check_scalars(raw: dict, cfg_path: Path) -> None:
    """max_position_embeddings (0 positions would refuse every request as too long),
    rms_norm_eps (a negative or non-finite epsilon makes the first token NaN; transformers
    refuses an integer in its own words) and the rope_theta in use (the RoPE base is divided
    by and raised to a power: a non-positive or NaN one makes the first token NaN; null, a
    string or a list was a TypeError from float(); true ran as 1.0). A top-level rope_theta
    that disagrees with rope_parameters' is refused in `engine.config`."""
    if "max_position_embeddings" in raw and not _positive_int(raw["max_position_embeddings"]):
        raise ModelDirError(f"{cfg_path}: max_position_embeddings = "
                            f"{raw['max_position_embeddings']!r}, expected a positive integer "
                            "(the longest context in tokens)")
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, int) and not isinstance(eps, bool):
        raise ModelDirError(f"{cfg_path}: rms_norm_eps = {eps!r} is an integer; expected a "
                            "float such as 1e-06 (transformers reads only floats here)")
    if not isinstance(eps, float) or not (math.isfinite(eps) and eps > 0):
        raise ModelDirError(f"{cfg_path}: rms_norm_eps = {eps!r}, expected a finite number > 0 "
                            "(Qwen3 uses 1e-06; 0 makes an all-zero row's norm NaN)")
    theta = _rope_theta_field(raw)
    if theta is not None and not _finite_positive(theta[1]):
        raise ModelDirError(f"{cfg_path}: {theta[0]} = {theta[1]!r}, expected a finite number > 0 "
                            "(the RoPE base; Qwen3 uses 1000000.0)")
    eos = raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    if eos is not None and not all(_whole(i) and 0 <= i < raw["vocab_size"] for i in ids):
        raise ModelDirError(f"{cfg_path}: eos_token_id = {eos!r}, expected a token id or a list "
                            f"of token ids in [0, {raw['vocab_size']})")

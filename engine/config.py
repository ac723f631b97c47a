"""Model and parallel configuration of the engine, validated before any rank starts.

`load_model_config` reads a Hugging Face Qwen3 directory's config.json through
`transformers.AutoConfig`; `check_parallel` rejects tensor-parallel sizes the model cannot be
split at. Both raise subclasses of ValueError whose message names the bad value and the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.config_json import read_config_json, read_json_object
from engine.errors import ModelDirError, ParallelConfigError, refuse_not_regular, unreadable


@dataclass(frozen=True)
class ModelConfig:
    """The Qwen3 dense hyper-parameters the engine uses (whole model, not per rank).

    Sizes are element counts; `rope_theta` is the RoPE base; `max_position` is the longest
    context (tokens) the config allows.
    """

    model_dir: str
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    torch_dtype: str
    eos_token_ids: tuple[int, ...]

    @property
    def config_path(self) -> Path:
        return Path(self.model_dir) / "config.json"


def _same_top_level_theta(theta, cfg_path: Path | None) -> None:
    """Raises ModelDirError when config.json also holds a top-level rope_theta (the older
    layout) that disagrees with rope_parameters' (which transformers 5 and this engine use):
    one of the two files' authors meant the other value."""
    if cfg_path is None:
        return
    import json

    try:
        top = json.loads(Path(cfg_path).read_text()).get("rope_theta")
    except (OSError, ValueError, AttributeError):
        return  # unreadable here means the config load itself reported it
    if top is not None and top != theta and not (top != top and theta != theta):
        raise ModelDirError(f"{cfg_path}: rope_theta = {top!r} disagrees with "
                            f"rope_parameters.rope_theta = {theta!r}; keep one")


def _rope_theta(hf, cfg_path: Path | None = None) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    if kind != "default":  # the model's RoPE is the plain one; any other would be ignored
        raise ModelDirError(f"{cfg_path or 'config.json'}: rope_type = {kind!r} (rope_scaling / "
                            "rope_parameters); this engine implements only the default RoPE, "
                            "and would silently compute the wrong positions")
    if isinstance(params, dict) and "rope_theta" in params:
        _same_top_level_theta(params["rope_theta"], cfg_path)
        return float(params["rope_theta"])
    theta = getattr(hf, "rope_theta", None)
    if theta is None:
        raise ModelDirError(f"{cfg_path or 'config.json'}: names no rope_theta")
    return float(theta)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and check `model_dir/config.json` (and generation_config.json when present).

    Of generation_config.json only ``eos_token_id`` is read (`_eos_ids`). Its sampling fields
    (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ...) are ignored, and so
    not checked: a request samples only as its `engine.sampling.SamplingParams` says (in
    `lockstep generate`, its flags: greedy by default), never as the model directory suggests.

    Raises:
        ModelDirError: the directory or config.json is missing or unreadable (the OS's reason:
            a directory the user may not enter was a PermissionError traceback), config.json or
            generation_config.json is there but no regular file (`engine.errors.refuse_not_regular`:
            a FIFO would block the read; one for generation_config.json was passed over),
            either is not valid JSON, the architecture
            is not Qwen3ForCausalLM, a field is missing, of the wrong type or out of range
            (`engine.config_json`, before transformers reads the file), or a setting asks for
            arithmetic this engine does not implement (quantized weights, `_check_features`).
    """
    d = Path(model_dir)
    cfg_path = d / "config.json"
    try:
        if not d.is_dir():
            raise ModelDirError(f"model directory {str(d)!r} "
                                + ("is not a directory" if d.exists() else "does not exist"))
        refuse_not_regular(cfg_path)
        if not cfg_path.is_file():
            raise ModelDirError(f"{cfg_path}: missing (is {str(d)!r} a Hugging Face model dir?)")
    except OSError as exc:  # pathlib raises where a directory on the path may not be entered
        raise unreadable(exc.filename or cfg_path, exc) from None
    read_config_json(cfg_path)
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(d))
    except Exception as exc:  # transformers raises several unrelated types here
        raise ModelDirError(f"{cfg_path}: {_transformers_reason(exc)}") from exc
    _check_features(hf, cfg_path)
    eos = _eos_ids(d, hf)
    cfg = ModelConfig(
        model_dir=str(d), hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
        num_q_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim, intermediate_size=hf.intermediate_size, vocab_size=hf.vocab_size,
        tie_word_embeddings=bool(hf.tie_word_embeddings), rope_theta=_rope_theta(hf, cfg_path),
        rms_norm_eps=float(hf.rms_norm_eps), max_position=int(hf.max_position_embeddings),
        torch_dtype=str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
                        or "bfloat16").replace("torch.", ""),
        eos_token_ids=eos,
    )
    if cfg.num_q_heads % cfg.num_kv_heads:
        raise ModelDirError(f"{cfg_path}: num_attention_heads {cfg.num_q_heads} is not a "
                            f"multiple of num_key_value_heads {cfg.num_kv_heads}")
    return _untie_a_distinct_stored_head(cfg, cfg_path)


_UNTIE_WARNED: set[str] = set()


def _untie_a_distinct_stored_head(cfg: ModelConfig, cfg_path: Path) -> ModelConfig:
    """`cfg` untied where its config ties the LM head to the embedding but the checkpoint
    stores a different `lm_head.weight` (`engine.weights.stored_head_differs`), as
    transformers loads it; one line on stderr says so, once per directory."""
    import sys
    from dataclasses import replace

    from engine.weights import stored_head_differs

    if not cfg.tie_word_embeddings or not stored_head_differs(cfg.model_dir):
        return cfg
    if cfg.model_dir not in _UNTIE_WARNED:
        _UNTIE_WARNED.add(cfg.model_dir)
        print(f"lockstep: {cfg_path} ties the LM head to the embedding, but the checkpoint "
              "stores a different lm_head.weight: using it untied, as transformers does",
              file=sys.stderr)
    return replace(cfg, tie_word_embeddings=False)


def _transformers_reason(exc: Exception) -> str:
    """transformers' error as one line; its type-check wording ("Validation error for field
    'x': TypeError: Field 'x' expected bool, got str (value: 'yes')") as ``x = 'yes', expected
    a bool``."""
    import re

    text = " ".join(str(exc).split())
    m = re.search(r"Field '(\w+)' expected (\w+), got \w+ \(value: ([^)]*)\)", text)
    if m:
        article = "an" if m[2][:1] in "aeiou" else "a"
        return f"{m[1]} = {m[3]}, expected {article} {m[2]} (transformers.AutoConfig refuses it)"
    return f"cannot be read by transformers.AutoConfig: {text}"


def _check_features(hf, cfg_path: Path) -> None:
    """Refuse config.json settings that change the model's arithmetic in ways this engine does
    not implement (it would load and compute a different model, silently): an activation
    other than SiLU, attention biases, sliding-window layers. RoPE scaling is refused by
    `_rope_theta`, quantized or non-float weights by `engine.config_json`.

    Raises:
        ModelDirError: naming the field and its value.
    """
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ModelDirError(f"{cfg_path}: hidden_act = {act!r}; this engine implements Qwen3's "
                            "SwiGLU MLP ('silu') only")
    if getattr(hf, "attention_bias", False):
        raise ModelDirError(f"{cfg_path}: attention_bias = {hf.attention_bias!r}; this engine's "
                            "attention projections have no bias (Qwen3: false)")
    if getattr(hf, "use_sliding_window", False):
        raise ModelDirError(f"{cfg_path}: use_sliding_window = {hf.use_sliding_window!r}; this "
                            "engine implements full attention only (Qwen3: false)")
    kinds = sorted({k for k in (getattr(hf, "layer_types", None) or ()) if k != "full_attention"})
    if kinds:
        raise ModelDirError(f"{cfg_path}: layer_types holds {kinds}; this engine implements "
                            "'full_attention' layers only")


def _eos_ids(d: Path, hf) -> tuple[int, ...]:
    """The end-of-sequence ids: generation_config.json's ``eos_token_id`` when it has one, else
    config.json's; each must be a token id of the vocabulary (one that can never be sampled
    would make ``ignore_eos=False`` silently the same as True). The file's other fields are
    not read (`load_model_config`)."""
    raw, where = None, d / "config.json"
    gen = d / "generation_config.json"
    refuse_not_regular(gen)  # a FIFO was silently passed over
    if gen.is_file():
        raw, where = read_json_object(gen).get("eos_token_id"), gen
    if raw is None:
        raw, where = getattr(hf, "eos_token_id", None), d / "config.json"
    if raw is None:
        return ()
    ids = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    vocab = getattr(hf, "vocab_size", None)
    for t in ids:
        if (not isinstance(t, int) or isinstance(t, bool) or t < 0
                or (isinstance(vocab, int) and t >= vocab)):
            raise ModelDirError(f"{where}: eos_token_id = {raw!r}: {t!r} is not a token id in "
                                f"[0, {vocab}) (an integer, or a list of them)")
    return tuple(ids)


def check_parallel(cfg: ModelConfig, world_size: int) -> None:
    """Check that every tensor-parallel split of `cfg` is exact at `world_size` ranks.

    Column-parallel QKV splits q and kv heads, gate_up and down split the intermediate size,
    the vocab-parallel embedding and LM head split the vocabulary.

    Raises:
        ParallelConfigError: world_size < 1, or one of those sizes is not divisible by it.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ParallelConfigError(f"tensor_parallel_size = {world_size!r}, expected an integer >= 1")
    where = cfg.config_path
    for name, value in (("num_attention_heads", cfg.num_q_heads),
                        ("num_key_value_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size),
                        ("vocab_size", cfg.vocab_size)):
        if value % world_size:
            raise ParallelConfigError(
                f"{where}: {name} = {value} is not divisible by tensor_parallel_size = "
                f"{world_size}; choose a tensor-parallel size that divides it")

"""Model and parallel configuration of the engine, validated before any rank starts.

`load_model_config` reads a Hugging Face Qwen3 directory's config.json through
`transformers.AutoConfig`; `check_parallel` rejects tensor-parallel sizes the model cannot be
split at. Both raise subclasses of ValueError whose message names the bad value and the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelDirError, ParallelConfigError

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


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
        raise ModelDirError("config.json names no rope_theta")
    return float(theta)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and check `model_dir/config.json` (and generation_config.json when present).

    Raises:
        ModelDirError: the directory or config.json is missing or unreadable, the architecture
            is not Qwen3ForCausalLM, a field is missing or out of range, or a setting asks for
            arithmetic this engine does not implement (`_check_features`).
    """
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelDirError(f"model directory {str(d)!r} does not exist or is not a directory")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelDirError(f"{cfg_path}: missing (is {str(d)!r} a Hugging Face model dir?)")
    _require_shape_fields(cfg_path)
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(d))
    except Exception as exc:  # transformers raises several unrelated types here
        one_line = " ".join(str(exc).split())
        raise ModelDirError(f"{cfg_path}: cannot be read by transformers.AutoConfig: "
                            f"{one_line}") from exc
    archs = tuple(getattr(hf, "architectures", None) or ())
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs) or hf.model_type != "qwen3":
        raise ModelDirError(
            f"{cfg_path}: unsupported architecture {list(archs) or None} (model_type "
            f"{hf.model_type!r}); this engine runs {list(SUPPORTED_ARCHITECTURES)} only")
    _check_features(hf, cfg_path)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    eos = _eos_ids(d, hf)
    cfg = ModelConfig(
        model_dir=str(d), hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
        num_q_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
        head_dim=head_dim, intermediate_size=hf.intermediate_size, vocab_size=hf.vocab_size,
        tie_word_embeddings=bool(hf.tie_word_embeddings), rope_theta=_rope_theta(hf, cfg_path),
        rms_norm_eps=float(hf.rms_norm_eps), max_position=int(hf.max_position_embeddings),
        torch_dtype=str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
                        or "bfloat16").replace("torch.", ""),
        eos_token_ids=eos,
    )
    for field in ("hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size"):
        v = getattr(cfg, field)
        if not isinstance(v, int) or v <= 0:
            raise ModelDirError(f"{cfg_path}: {field} = {v!r}, expected a positive integer")
    _check_scalars(cfg, cfg_path)
    if cfg.num_q_heads % cfg.num_kv_heads:
        raise ModelDirError(f"{cfg_path}: num_attention_heads {cfg.num_q_heads} is not a "
                            f"multiple of num_key_value_heads {cfg.num_kv_heads}")
    return cfg


STORAGE_DTYPES = ("float32", "bfloat16", "float16")
"""Weight dtypes config.json may name: the loader reads floating-point tensors only."""


def _check_features(hf, cfg_path: Path) -> None:
    """Refuse config.json settings that change the model's arithmetic in ways this engine does
    not implement (it would load and compute a different model, silently): an activation
    other than SiLU, attention biases, sliding-window layers, or weights stored as anything
    but a float dtype (quantized checkpoints). RoPE scaling is refused by `_rope_theta`.

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
    dtype = str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
                or "bfloat16").replace("torch.", "")
    if dtype not in STORAGE_DTYPES:
        raise ModelDirError(f"{cfg_path}: dtype = {dtype!r}; this engine loads weights stored as "
                            f"{', '.join(STORAGE_DTYPES)} only")


def _check_scalars(cfg: ModelConfig, cfg_path: Path) -> None:
    """The non-shape numbers a forward pass divides by or raises to a power: each must be in
    range here, or the first token comes out NaN (a non-positive or NaN RoPE base, a negative or
    non-finite norm epsilon) or every request is refused as too long (no positions)."""
    import math

    theta, eps, positions = cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position
    if not (math.isfinite(theta) and theta > 0):
        raise ModelDirError(f"{cfg_path}: rope_theta = {theta!r}, expected a finite number > 0 "
                            "(the RoPE base; Qwen3 uses 1000000.0)")
    if not (math.isfinite(eps) and eps >= 0):
        raise ModelDirError(f"{cfg_path}: rms_norm_eps = {eps!r}, expected a finite number >= 0 "
                            "(Qwen3 uses 1e-06)")
    if positions <= 0:
        raise ModelDirError(f"{cfg_path}: max_position_embeddings = {positions!r}, expected a "
                            "positive integer (the longest context in tokens)")


SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size")
"""config.json fields that set tensor shapes: transformers fills in Qwen3 defaults for missing
ones, which then surface as a confusing tensor-shape mismatch, so each must be present."""


def _require_shape_fields(cfg_path: Path) -> None:
    import json

    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"{cfg_path}: not valid JSON: {exc}") from None
    missing = [f for f in SHAPE_FIELDS if not isinstance(raw, dict) or f not in raw]
    if missing:
        raise ModelDirError(f"{cfg_path}: {', '.join(missing)} missing; the weights' shapes "
                            "depend on it (transformers would silently use Qwen3 defaults)")


def _eos_ids(d: Path, hf) -> tuple[int, ...]:
    """The end-of-sequence ids: generation_config.json's ``eos_token_id`` when it has one, else
    config.json's; each must be a token id of the vocabulary (one that can never be sampled
    would make ``ignore_eos=False`` silently the same as True)."""
    import json

    raw, where = None, d / "config.json"
    gen = d / "generation_config.json"
    if gen.is_file():
        try:
            data = json.loads(gen.read_text())
        except (OSError, ValueError) as exc:
            raise ModelDirError(f"{gen}: not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ModelDirError(f"{gen}: expected a JSON object, got {type(data).__name__}")
        raw, where = data.get("eos_token_id"), gen
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
    if not isinstance(world_size, int) or world_size < 1:
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

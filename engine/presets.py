"""Named Qwen3 dense configurations: the real shapes of the public checkpoints, and `tiny`.

Pure Python (no torch, no transformers) so that the CLI can list the choices at startup.
The real shapes are those of the Qwen/Qwen3-*B config.json files on the Hugging Face Hub.
"""

from __future__ import annotations

# Shared by every real Qwen3 dense checkpoint.
_COMMON = dict(
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    head_dim=128,
    num_key_value_heads=8,
    vocab_size=151936,
    bos_token_id=151643,
    eos_token_id=151645,
)

PRESETS: dict[str, dict] = {
    "qwen3-0.6b": dict(_COMMON, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_COMMON, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       intermediate_size=6144, tie_word_embeddings=True),
    "qwen3-4b": dict(_COMMON, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     intermediate_size=9728, tie_word_embeddings=True),
    "qwen3-8b": dict(_COMMON, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     intermediate_size=12288, tie_word_embeddings=False),
    # Small enough for CPU tests in well under a second per forward; every dimension that TP
    # splits (q heads 4, kv heads 2, intermediate 128, vocab 512) divides by 2. Untied, so the
    # separate LM head path is exercised.
    "tiny": dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
                 hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # Tied embeddings and q width (8 x 16 = 128) != hidden (64), like the real 0.6B/4B.
    "tiny-tied": dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
                      hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      vocab_size=512, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2),
}

# Shard size limit when writing a model directory, in bytes. Peak host memory while writing is
# about one shard plus one float32 tensor, so 2 GiB keeps qwen3-8b under ~5 GiB; the Hub uses
# ~4-5 GB shards, which loaders handle the same way.
# tiny presets use a small limit so that multi-shard loading is exercised in CPU tests.
SHARD_BYTES = {"tiny": 64 * 1024, "tiny-tied": 64 * 1024}
DEFAULT_SHARD_BYTES = 2 * 1024**3

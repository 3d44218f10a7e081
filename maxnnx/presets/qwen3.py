"""Qwen3 dense presets: per-head q/k RMSNorm, no biases, head_dim 128, 40k context."""

from maxnnx.config import ModelConfig, RopeConfig


def _qwen3(d_model: int, num_layers: int, num_heads: int, mlp_dim: int,
           tie_word_embeddings: bool = False) -> ModelConfig:
  """A Qwen3 config (8 kv heads, 151936-token vocab, rope theta 1e6)."""
  return ModelConfig(family='qwen3', vocab_size=151_936, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=8, head_dim=128, mlp_dim=mlp_dim,
                     max_position_embeddings=40_960, norm_eps=1e-6, qk_norm='head',
                     tie_word_embeddings=tie_word_embeddings,
                     rope=RopeConfig(theta=1_000_000.0))


def qwen3_0_6b() -> ModelConfig:
  """Qwen3 0.6B."""
  return _qwen3(1024, 28, 16, 3072, tie_word_embeddings=True)


def qwen3_1_7b() -> ModelConfig:
  """Qwen3 1.7B."""
  return _qwen3(2048, 28, 16, 6144, tie_word_embeddings=True)


def qwen3_4b() -> ModelConfig:
  """Qwen3 4B."""
  return _qwen3(2560, 36, 32, 9728, tie_word_embeddings=True)


def qwen3_8b() -> ModelConfig:
  """Qwen3 8B."""
  return _qwen3(4096, 36, 32, 12_288)


def qwen3_14b() -> ModelConfig:
  """Qwen3 14B."""
  return _qwen3(5120, 40, 40, 17_408)


def qwen3_32b() -> ModelConfig:
  """Qwen3 32B."""
  return _qwen3(5120, 64, 64, 25_600)

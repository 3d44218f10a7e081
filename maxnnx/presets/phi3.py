"""Phi-3 presets."""

from maxnnx.config import ModelConfig, RopeConfig


def phi3_mini() -> ModelConfig:
  """Phi-3-mini (3.8B), the 4k-context model (Phi-3-mini-4k-instruct).

  Its ``config.json`` sets a 2047-token sliding window on every layer; the
  128k variant differs only in LongRoPE scaling and ``max_position_embeddings``.
  """
  return ModelConfig(family='phi3', vocab_size=32_064, d_model=3072, num_layers=32, num_heads=32,
                     num_kv_heads=32, mlp_dim=8192, max_position_embeddings=4096, norm_eps=1e-5,
                     sliding_window=2047, rope=RopeConfig(theta=10_000.0))

"""Mistral presets."""

from maxnnx.config import ModelConfig, RopeConfig


def mistral_7b() -> ModelConfig:
  """Mistral 7B, v0.2 layout (as Mistral-7B-Instruct-v0.2).

  v0.2 dropped v0.1's 4096-token sliding window and raised rope theta from 1e4
  to 1e6 for a 32k context. The vocabulary is v0.1/v0.2's 32000 tokens; v0.3
  is the same network with 32768 (``get_preset('mistral-7b', vocab_size=32768)``).
  """
  return ModelConfig(family='mistral', vocab_size=32_000, d_model=4096, num_layers=32,
                     num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14_336,
                     max_position_embeddings=32_768, norm_eps=1e-5,
                     rope=RopeConfig(theta=1_000_000.0))

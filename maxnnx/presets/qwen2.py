"""Qwen2.5 presets (base models): Llama with q/k/v biases, rope theta 1e6.

Numbers follow the base checkpoints' ``config.json`` (the Instruct variants
differ only in ``max_position_embeddings`` = 32768 and, for 14B+, ``norm_eps``
= 1e-6). ``use_sliding_window`` is false in every release, so no window is set.
"""

from maxnnx.config import ModelConfig, RopeConfig


def _qwen2_5(vocab_size: int, d_model: int, num_layers: int, num_heads: int, num_kv_heads: int,
             mlp_dim: int, max_position_embeddings: int, norm_eps: float = 1e-6,
             tie_word_embeddings: bool = False) -> ModelConfig:
  """A Qwen2.5 config (head_dim is d_model // num_heads: 64 for 0.5B, else 128)."""
  return ModelConfig(family='qwen2', vocab_size=vocab_size, d_model=d_model,
                     num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     mlp_dim=mlp_dim, max_position_embeddings=max_position_embeddings,
                     norm_eps=norm_eps,
                     qkv_bias=True, tie_word_embeddings=tie_word_embeddings,
                     rope=RopeConfig(theta=1_000_000.0))


def qwen2_5_0_5b() -> ModelConfig:
  """Qwen2.5 0.5B."""
  return _qwen2_5(151_936, 896, 24, 14, 2, 4864, 32_768, tie_word_embeddings=True)


def qwen2_5_1_5b() -> ModelConfig:
  """Qwen2.5 1.5B."""
  return _qwen2_5(151_936, 1536, 28, 12, 2, 8960, 131_072, tie_word_embeddings=True)


def qwen2_5_3b() -> ModelConfig:
  """Qwen2.5 3B."""
  return _qwen2_5(151_936, 2048, 36, 16, 2, 11_008, 32_768, tie_word_embeddings=True)


def qwen2_5_7b() -> ModelConfig:
  """Qwen2.5 7B."""
  return _qwen2_5(152_064, 3584, 28, 28, 4, 18_944, 131_072)


def qwen2_5_14b() -> ModelConfig:
  """Qwen2.5 14B."""
  return _qwen2_5(152_064, 5120, 48, 40, 8, 13_824, 131_072, norm_eps=1e-5)


def qwen2_5_32b() -> ModelConfig:
  """Qwen2.5 32B."""
  return _qwen2_5(152_064, 5120, 64, 40, 8, 27_648, 131_072, norm_eps=1e-5)


def qwen2_5_72b() -> ModelConfig:
  """Qwen2.5 72B."""
  return _qwen2_5(152_064, 8192, 80, 64, 8, 29_568, 131_072, norm_eps=1e-5)

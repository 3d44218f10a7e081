"""Llama 2, 3, 3.1 and 3.3 presets, plus ``tiny`` for tests and tutorials.

Numbers follow the ``config.json`` files of the ``meta-llama`` Hugging Face repos.
"""

from maxnnx.config import ModelConfig, RopeConfig

# Llama 3.1/3.3: 8k pre-training context stretched 16x with band-wise rope scaling.
LLAMA3_1_ROPE = RopeConfig(theta=500_000.0, scaling='llama3', factor=8.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_position_embeddings=8192)


def _llama2(d_model: int, num_layers: int, num_heads: int, num_kv_heads: int,
            mlp_dim: int) -> ModelConfig:
  """A Llama 2 config: 32k vocab, 4k context, rope theta 1e4."""
  return ModelConfig(family='llama', vocab_size=32_000, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, mlp_dim=mlp_dim,
                     max_position_embeddings=4096, norm_eps=1e-5, rope=RopeConfig(theta=10_000.0))


def _llama3(d_model: int, num_layers: int, num_heads: int, mlp_dim: int,
            long_context: bool = False) -> ModelConfig:
  """A Llama 3 config (8 kv heads, 128k vocab); ``long_context`` gives 3.1's 128k rope."""
  rope = LLAMA3_1_ROPE if long_context else RopeConfig(theta=500_000.0)
  return ModelConfig(family='llama', vocab_size=128_256, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=8, mlp_dim=mlp_dim,
                     max_position_embeddings=131_072 if long_context else 8192, norm_eps=1e-5,
                     rope=rope)


def tiny() -> ModelConfig:
  """A tiny Llama-style model that trains on a laptop CPU in seconds."""
  return ModelConfig(family='llama', vocab_size=512, d_model=128, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=32, mlp_dim=384, max_position_embeddings=512,
                     norm_eps=1e-5, rope=RopeConfig(theta=10_000.0))


def llama2_7b() -> ModelConfig:
  """Llama 2 7B."""
  return _llama2(4096, 32, 32, 32, 11_008)


def llama2_13b() -> ModelConfig:
  """Llama 2 13B."""
  return _llama2(5120, 40, 40, 40, 13_824)


def llama2_70b() -> ModelConfig:
  """Llama 2 70B."""
  return _llama2(8192, 80, 64, 8, 28_672)


def llama3_8b() -> ModelConfig:
  """Llama 3 8B."""
  return _llama3(4096, 32, 32, 14_336)


def llama3_70b() -> ModelConfig:
  """Llama 3 70B."""
  return _llama3(8192, 80, 64, 28_672)


def llama3_1_8b() -> ModelConfig:
  """Llama 3.1 8B."""
  return _llama3(4096, 32, 32, 14_336, long_context=True)


def llama3_1_70b() -> ModelConfig:
  """Llama 3.1 70B."""
  return _llama3(8192, 80, 64, 28_672, long_context=True)


def llama3_1_405b() -> ModelConfig:
  """Llama 3.1 405B."""
  return _llama3(16_384, 126, 128, 53_248, long_context=True)


def llama3_3_70b() -> ModelConfig:
  """Llama 3.3 70B."""
  return _llama3(8192, 80, 64, 28_672, long_context=True)

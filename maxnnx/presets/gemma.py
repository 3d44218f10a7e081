"""Gemma (first generation) presets: GeGLU, ``1 + w`` norms, scaled and tied embeddings."""

from maxnnx.config import ModelConfig, RopeConfig

GEMMA_VOCAB = 256_000


def gemma_common() -> dict:
  """Fields every Gemma generation shares."""
  return dict(norm_eps=1e-6, norm_scale_offset=1.0, scale_embeddings=True,
              mlp_activation='gelu_tanh', tie_word_embeddings=True)


def _gemma(d_model: int, num_layers: int, num_heads: int, num_kv_heads: int,
           mlp_dim: int) -> ModelConfig:
  """A Gemma config: head_dim 256, 8k context, rope theta 1e4."""
  return ModelConfig(family='gemma', vocab_size=GEMMA_VOCAB, d_model=d_model,
                     num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=256, mlp_dim=mlp_dim, max_position_embeddings=8192,
                     rope=RopeConfig(theta=10_000.0), **gemma_common())


def gemma_2b() -> ModelConfig:
  """Gemma 2B (multi-query attention)."""
  return _gemma(2048, 18, 8, 1, 16_384)


def gemma_7b() -> ModelConfig:
  """Gemma 7B."""
  return _gemma(3072, 28, 16, 16, 24_576)

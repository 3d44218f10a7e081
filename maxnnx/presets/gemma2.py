"""Gemma 2 presets: sandwich norms, soft-caps, local/global layers alternating."""

from maxnnx.config import ModelConfig, RopeConfig
from maxnnx.presets.gemma import GEMMA_VOCAB, gemma_common


def _gemma2(d_model: int, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
            mlp_dim: int, query_pre_attn_scalar: int) -> ModelConfig:
  """A Gemma 2 config; even layers (from 0) use the 4096-token sliding window."""
  layer_types = tuple('sliding' if i % 2 == 0 else 'full' for i in range(num_layers))
  return ModelConfig(family='gemma2', vocab_size=GEMMA_VOCAB, d_model=d_model,
                     num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, mlp_dim=mlp_dim, max_position_embeddings=8192,
                     post_norm=True, query_scale=query_pre_attn_scalar**-0.5,
                     attn_logit_softcap=50.0, final_logit_softcap=30.0, sliding_window=4096,
                     layer_types=layer_types, rope=RopeConfig(theta=10_000.0), **gemma_common())


def gemma2_2b() -> ModelConfig:
  """Gemma 2 2B."""
  return _gemma2(2304, 26, 8, 4, 256, 9216, 256)


def gemma2_9b() -> ModelConfig:
  """Gemma 2 9B."""
  return _gemma2(3584, 42, 16, 8, 256, 14_336, 256)


def gemma2_27b() -> ModelConfig:
  """Gemma 2 27B (queries scaled by (d_model / num_heads) ** -0.5 = 144 ** -0.5)."""
  return _gemma2(4608, 46, 32, 16, 128, 36_864, 144)

"""Gemma 3 (text) presets: per-head q/k norms, 5 local : 1 global layers.

The 4B/12B/27B numbers are the language model of the multimodal checkpoints
(``text_config``); their 262208-token vocabulary includes the image tokens.
"""

from maxnnx.config import ModelConfig, RopeConfig
from maxnnx.presets.gemma import gemma_common

LOCAL_ROPE = RopeConfig(theta=10_000.0)
GLOBAL_ROPE_LONG = RopeConfig(theta=1_000_000.0, scaling='linear', factor=8.0)


def _gemma3(vocab_size: int, d_model: int, num_layers: int, num_heads: int, num_kv_heads: int,
            head_dim: int, mlp_dim: int, query_pre_attn_scalar: int, sliding_window: int,
            max_position_embeddings: int, rope: RopeConfig) -> ModelConfig:
  """A Gemma 3 config; layer ``i`` is global iff ``(i + 1) % 6 == 0``."""
  layer_types = tuple('full' if (i + 1) % 6 == 0 else 'sliding' for i in range(num_layers))
  return ModelConfig(family='gemma3', vocab_size=vocab_size, d_model=d_model,
                     num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, mlp_dim=mlp_dim,
                     max_position_embeddings=max_position_embeddings, post_norm=True,
                     qk_norm='head', query_scale=query_pre_attn_scalar**-0.5,
                     sliding_window=sliding_window, layer_types=layer_types, rope=rope,
                     local_rope=LOCAL_ROPE, **gemma_common())


def gemma3_1b() -> ModelConfig:
  """Gemma 3 1B (text only, 32k context, unscaled global rope)."""
  return _gemma3(262_144, 1152, 26, 4, 1, 256, 6912, 256, 512, 32_768,
                 RopeConfig(theta=1_000_000.0))


def gemma3_4b() -> ModelConfig:
  """Gemma 3 4B (language model)."""
  return _gemma3(262_208, 2560, 34, 8, 4, 256, 10_240, 256, 1024, 131_072, GLOBAL_ROPE_LONG)


def gemma3_12b() -> ModelConfig:
  """Gemma 3 12B (language model)."""
  return _gemma3(262_208, 3840, 48, 16, 8, 256, 15_360, 256, 1024, 131_072, GLOBAL_ROPE_LONG)


def gemma3_27b() -> ModelConfig:
  """Gemma 3 27B (language model; queries scaled by 168 ** -0.5)."""
  return _gemma3(262_208, 5376, 62, 32, 16, 128, 21_504, 168, 1024, 131_072, GLOBAL_ROPE_LONG)

"""Qwen2 / Qwen2.5: Llama with q/k/v biases and optional sliding windows on upper layers.

Preset numbers follow the base checkpoints' ``config.json`` (the Instruct variants
differ only in ``max_position_embeddings`` = 32768 and, for 14B+, ``norm_eps``
= 1e-6). ``use_sliding_window`` is false in every release, so no window is set.
"""

from typing import Any

from maxnnx.config import AttentionConfig, ModelConfig, RopeConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf, layer_types_to_hf
from maxnnx.models.registry import FamilySpec

# -- Hugging Face mapping ----------------------------------------------------------------------


def sliding_layers(hf: HFConfig, **attention: Any) -> dict:
  """``attention`` (the other :class:`AttentionConfig` fields) with the sliding window, and
  ``layer_types``, as Qwen configs define them: windows only when ``use_sliding_window``,
  on layers from ``max_window_layers`` up."""
  window = hf.get('sliding_window') if hf.get('use_sliding_window', False) else None
  if window is None:
    return {'attention': AttentionConfig(**attention)}
  layer_types = hf.layer_types() or tuple(
      'sliding' if i >= hf.get('max_window_layers', 0) else 'full'
      for i in range(hf.require('num_hidden_layers')))
  return {'attention': AttentionConfig(**attention, sliding_window=window),
          'layer_types': layer_types}


def sliding_layers_to_hf(cfg: ModelConfig) -> dict:
  has_window = 'sliding' in cfg.resolved_layer_types
  return {'use_sliding_window': has_window, 'sliding_window': cfg.attention.sliding_window,
          'max_window_layers': cfg.num_layers, 'layer_types': layer_types_to_hf(cfg)}


def config_from_hf(hf: HFConfig) -> ModelConfig:
  return ModelConfig(family='qwen2', **hf.common_fields(), **sliding_layers(hf, qkv_bias=True))


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'qwen2', 'Qwen2ForCausalLM'), **sliding_layers_to_hf(cfg)}


# -- Presets -----------------------------------------------------------------------------------


def _qwen2_5(vocab_size: int, d_model: int, num_layers: int, num_heads: int, num_kv_heads: int,
             mlp_dim: int, max_position_embeddings: int, norm_eps: float = 1e-6,
             tie_word_embeddings: bool = False) -> ModelConfig:
  """A Qwen2.5 config (head_dim is d_model // num_heads: 64 for 0.5B, else 128)."""
  return SPEC.config(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, mlp_dim=mlp_dim,
                     max_position_embeddings=max_position_embeddings, norm_eps=norm_eps,
                     tie_word_embeddings=tie_word_embeddings,
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
  """Qwen2.5 7B (7.62B parameters)."""
  return _qwen2_5(152_064, 3584, 28, 28, 4, 18_944, 131_072)


def qwen2_5_14b() -> ModelConfig:
  """Qwen2.5 14B."""
  return _qwen2_5(152_064, 5120, 48, 40, 8, 13_824, 131_072, norm_eps=1e-5)


def qwen2_5_32b() -> ModelConfig:
  """Qwen2.5 32B."""
  return _qwen2_5(152_064, 5120, 64, 40, 8, 27_648, 131_072, norm_eps=1e-5)


def qwen2_5_72b() -> ModelConfig:
  """Qwen2.5 72B (72.7B parameters)."""
  return _qwen2_5(152_064, 8192, 80, 64, 8, 29_568, 131_072, norm_eps=1e-5)


SPEC = FamilySpec(
    name='qwen2',
    description='Llama with q/k/v biases (and sliding windows on upper layers when enabled).',
    hf=Family('qwen2', ('qwen2',), 'Qwen2ForCausalLM', config_from_hf, config_to_hf,
              defaults={'max_position_embeddings': 32768}),
    differences={'attention': {'qkv_bias': True}},
    presets={'qwen2.5-0.5b': qwen2_5_0_5b, 'qwen2.5-1.5b': qwen2_5_1_5b,
             'qwen2.5-3b': qwen2_5_3b, 'qwen2.5-7b': qwen2_5_7b, 'qwen2.5-14b': qwen2_5_14b,
             'qwen2.5-32b': qwen2_5_32b, 'qwen2.5-72b': qwen2_5_72b},
    chat_template='chatml')

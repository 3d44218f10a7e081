"""Qwen2 / Qwen2.5: Llama with q/k/v biases and optional sliding windows on upper layers."""

from maxnnx.config import ModelConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf, layer_types_to_hf


def sliding_layers(hf: HFConfig) -> dict:
  """``sliding_window``/``layer_types`` as Qwen configs define them: windows
  only when ``use_sliding_window``, on layers from ``max_window_layers`` up."""
  window = hf.get('sliding_window') if hf.get('use_sliding_window', False) else None
  if window is None:
    return {}
  layer_types = hf.layer_types() or tuple(
      'sliding' if i >= hf.get('max_window_layers', 0) else 'full'
      for i in range(hf.require('num_hidden_layers')))
  return {'sliding_window': window, 'layer_types': layer_types}


def sliding_layers_to_hf(cfg: ModelConfig) -> dict:
  has_window = 'sliding' in cfg.resolved_layer_types
  return {'use_sliding_window': has_window, 'sliding_window': cfg.sliding_window,
          'max_window_layers': cfg.num_layers, 'layer_types': layer_types_to_hf(cfg)}


def config_from_hf(hf: HFConfig) -> ModelConfig:
  return ModelConfig(family='qwen2', **hf.common_fields(), qkv_bias=True, **sliding_layers(hf))


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'qwen2', 'Qwen2ForCausalLM'), **sliding_layers_to_hf(cfg)}


FAMILY = Family('qwen2', ('qwen2',), 'Qwen2ForCausalLM', config_from_hf, config_to_hf,
                defaults={'max_position_embeddings': 32768})

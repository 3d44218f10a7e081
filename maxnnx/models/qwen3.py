"""Qwen3: Qwen2 without q/k/v biases, plus per-head RMSNorm on queries and keys."""

from maxnnx.config import ModelConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf
from maxnnx.models.qwen2 import sliding_layers, sliding_layers_to_hf


def config_from_hf(hf: HFConfig) -> ModelConfig:
  bias = bool(hf.get('attention_bias', False))
  return ModelConfig(family='qwen3', **hf.common_fields(), qkv_bias=bias, out_bias=bias,
                     qk_norm='head', **sliding_layers(hf))


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'qwen3', 'Qwen3ForCausalLM'), **sliding_layers_to_hf(cfg),
          'attention_bias': cfg.qkv_bias}


FAMILY = Family('qwen3', ('qwen3',), 'Qwen3ForCausalLM', config_from_hf, config_to_hf,
                defaults={'max_position_embeddings': 32768})

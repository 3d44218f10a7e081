"""Mistral: Llama with an optional sliding window on every layer."""

from maxnnx.config import ModelConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf


def config_from_hf(hf: HFConfig) -> ModelConfig:
  return ModelConfig(family='mistral', **hf.common_fields(),
                     sliding_window=hf.get('sliding_window'))


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'mistral', 'MistralForCausalLM'),
          'sliding_window': cfg.sliding_window}


FAMILY = Family('mistral', ('mistral',), 'MistralForCausalLM', config_from_hf, config_to_hf,
                defaults={'max_position_embeddings': 131072})

"""Llama 2, 3, 3.1 and 3.3: pre-norm, SwiGLU, GQA, rotary (llama3 scaling in 3.1+).

Every other dense family is this architecture plus a handful of config fields.
"""

from maxnnx.config import ModelConfig
from maxnnx.models.hf import Family, HFConfig, PretrainedError, common_to_hf


def config_from_hf(hf: HFConfig) -> ModelConfig:
  bias = bool(hf.get('attention_bias', False))
  return ModelConfig(family='llama', **hf.common_fields(), qkv_bias=bias, out_bias=bias,
                     mlp_bias=bool(hf.get('mlp_bias', False)))


def config_to_hf(cfg: ModelConfig) -> dict:
  if cfg.qkv_bias != cfg.out_bias:
    raise PretrainedError('Llama has one attention_bias for q/k/v/o; this config sets '
                          f'qkv_bias={cfg.qkv_bias} and out_bias={cfg.out_bias}.')
  return {**common_to_hf(cfg, 'llama', 'LlamaForCausalLM'), 'attention_bias': cfg.qkv_bias,
          'mlp_bias': cfg.mlp_bias}


FAMILY = Family('llama', ('llama',), 'LlamaForCausalLM', config_from_hf, config_to_hf,
                defaults={'rms_norm_eps': 1e-6, 'max_position_embeddings': 2048})

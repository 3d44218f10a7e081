"""OLMo 2: norms after each sub-block only, RMSNorm over the whole q and k projections."""

from maxnnx.config import ModelConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf


def config_from_hf(hf: HFConfig) -> ModelConfig:
  bias = bool(hf.get('attention_bias', False))
  return ModelConfig(family='olmo2', **hf.common_fields(), pre_norm=False, post_norm=True,
                     qk_norm='projection', qkv_bias=bias, out_bias=bias)


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'olmo2', 'Olmo2ForCausalLM'), 'attention_bias': cfg.qkv_bias}


FAMILY = Family('olmo2', ('olmo2',), 'Olmo2ForCausalLM', config_from_hf, config_to_hf,
                defaults={'rms_norm_eps': 1e-5, 'max_position_embeddings': 2048},
                module_names={'attn_post_norm': 'post_attention_layernorm',
                              'mlp_post_norm': 'post_feedforward_layernorm'})

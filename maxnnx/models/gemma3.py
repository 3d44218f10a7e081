"""Gemma 3 (text): Gemma 2's block with per-head q/k norms, no soft-caps by
default, 5 local : 1 global layers, and a separate rotary base for local layers."""

from maxnnx.config import ModelConfig
from maxnnx.models.gemma import GEMMA_DEFAULTS, gemma_fields
from maxnnx.models.gemma2 import SANDWICH_NORM_NAMES, sandwich_fields, sandwich_to_hf
from maxnnx.models.hf import Family, HFConfig, rope_to_hf


def config_from_hf(hf: HFConfig) -> ModelConfig:
  fields = gemma_fields(hf)
  fields['rope'] = hf.rope('full_attention')
  if 'rope_parameters' in hf.data and 'sliding_attention' in hf.data['rope_parameters']:
    local_rope = hf.rope('sliding_attention')
  else:  # older configs: rope_local_base_freq, never scaled
    local_rope = fields['rope'].replace(theta=float(hf.get('rope_local_base_freq', 10_000.0)),
                                        scaling='none', factor=None)
  return ModelConfig(family='gemma3', **fields, **sandwich_fields(hf, 6), qk_norm='head',
                     local_rope=local_rope)


def config_to_hf(cfg: ModelConfig) -> dict:
  out = sandwich_to_hf(cfg, 'gemma3_text', 'Gemma3ForCausalLM')
  out['rope_parameters'] = {'full_attention': rope_to_hf(cfg.rope),
                            'sliding_attention': rope_to_hf(cfg.local_rope or cfg.rope)}
  return out


FAMILY = Family('gemma3', ('gemma3_text',), 'Gemma3ForCausalLM', config_from_hf, config_to_hf,
                defaults={**GEMMA_DEFAULTS, 'sliding_window': 4096, 'rope_theta': 1_000_000.0,
                          'query_pre_attn_scalar': 256, 'max_position_embeddings': 131072},
                module_names=SANDWICH_NORM_NAMES)

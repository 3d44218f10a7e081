"""Gemma: GeGLU, ``1 + w`` RMSNorms, embeddings scaled by sqrt(d_model), tied output.

Gemma 2 and 3 build on :func:`gemma_fields`.
"""

from maxnnx.config import ModelConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf

GEMMA_DEFAULTS = {'tie_word_embeddings': True, 'max_position_embeddings': 8192,
                  'hidden_activation': 'gelu_pytorch_tanh'}


def gemma_fields(hf: HFConfig) -> dict:
  """Fields shared by every Gemma generation."""
  fields = hf.common_fields()
  # Early Gemma configs say hidden_act "gelu" but the models use the tanh approximation.
  if hf.data.get('hidden_activation') is None:
    fields['mlp_activation'] = 'gelu_tanh'
  return dict(fields, norm_scale_offset=1.0, scale_embeddings=True,
              qkv_bias=bool(hf.get('attention_bias', False)),
              out_bias=bool(hf.get('attention_bias', False)))


def gemma_to_hf(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
  out = common_to_hf(cfg, model_type, architecture)
  out['hidden_activation'] = out.pop('hidden_act')
  out['attention_bias'] = cfg.qkv_bias
  return out


def config_from_hf(hf: HFConfig) -> ModelConfig:
  return ModelConfig(family='gemma', **gemma_fields(hf))


def config_to_hf(cfg: ModelConfig) -> dict:
  out = gemma_to_hf(cfg, 'gemma', 'GemmaForCausalLM')
  out['hidden_act'] = out['hidden_activation']
  return out


FAMILY = Family('gemma', ('gemma',), 'GemmaForCausalLM', config_from_hf, config_to_hf,
                defaults=GEMMA_DEFAULTS)

"""Gemma 2: Gemma plus pre- and post-norms, alternating local/global attention,
attention and final logit soft-capping, and ``query_pre_attn_scalar``."""

from maxnnx.config import ModelConfig
from maxnnx.models.gemma import GEMMA_DEFAULTS, gemma_fields, gemma_to_hf
from maxnnx.models.hf import Family, HFConfig, PretrainedError, layer_types_to_hf

# Gemma 2/3 call the norm after attention "post_attention_layernorm", the name
# Llama uses for the norm before the MLP.
SANDWICH_NORM_NAMES = {'attn_post_norm': 'post_attention_layernorm',
                       'mlp_pre_norm': 'pre_feedforward_layernorm',
                       'mlp_post_norm': 'post_feedforward_layernorm'}


def sandwich_fields(hf: HFConfig, default_pattern: int) -> dict:
  """Norm placement, soft-caps, query scale and local/global layer pattern."""
  num_layers = hf.require('num_hidden_layers')
  pattern = hf.get('sliding_window_pattern', default_pattern)
  layer_types = hf.layer_types() or tuple(
      'sliding' if (i + 1) % pattern else 'full' for i in range(num_layers))
  scalar = hf.get('query_pre_attn_scalar')
  return dict(post_norm=True, attn_logit_softcap=hf.get('attn_logit_softcapping'),
              final_logit_softcap=hf.get('final_logit_softcapping'),
              query_scale=float(scalar)**-0.5 if scalar else None,
              sliding_window=hf.require('sliding_window'), layer_types=layer_types)


def sandwich_to_hf(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
  scalar = cfg.resolved_query_scale**-2
  if abs(scalar - round(scalar)) > 1e-6:
    raise PretrainedError(f'{model_type} needs an integer query_pre_attn_scalar; query_scale '
                          f'{cfg.resolved_query_scale} gives {scalar}.')
  return {**gemma_to_hf(cfg, model_type, architecture),
          'attn_logit_softcapping': cfg.attn_logit_softcap,
          'final_logit_softcapping': cfg.final_logit_softcap,
          'query_pre_attn_scalar': round(cfg.resolved_query_scale**-2),
          'sliding_window': cfg.sliding_window, 'layer_types': layer_types_to_hf(cfg)}


def config_from_hf(hf: HFConfig) -> ModelConfig:
  return ModelConfig(family='gemma2', **gemma_fields(hf), **sandwich_fields(hf, 2))


def config_to_hf(cfg: ModelConfig) -> dict:
  return sandwich_to_hf(cfg, 'gemma2', 'Gemma2ForCausalLM')


FAMILY = Family('gemma2', ('gemma2',), 'Gemma2ForCausalLM', config_from_hf, config_to_hf,
                defaults={**GEMMA_DEFAULTS, 'attn_logit_softcapping': None,
                          'final_logit_softcapping': None, 'sliding_window': 4096},
                module_names=SANDWICH_NORM_NAMES)

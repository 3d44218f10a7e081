"""Gemma 2: Gemma plus pre- and post-norms, alternating local/global attention,
attention and final logit soft-capping, and ``query_pre_attn_scalar``."""

from maxnnx.config import ModelConfig, RopeConfig
from maxnnx.models import gemma
from maxnnx.models.gemma import GEMMA_DEFAULTS, GEMMA_VOCAB, gemma_fields, gemma_to_hf
from maxnnx.models.hf import Family, HFConfig, PretrainedError, layer_types_to_hf
from maxnnx.models.registry import FamilySpec, merge

# -- Hugging Face mapping ----------------------------------------------------------------------

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
  return dict(post_norm=True, final_logit_softcap=hf.get('final_logit_softcapping'),
              attention={'logit_softcap': hf.get('attn_logit_softcapping'),
                         'query_scale': float(scalar)**-0.5 if scalar else None,
                         'sliding_window': hf.require('sliding_window')},
              layer_types=layer_types)


def sandwich_to_hf(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
  scalar = cfg.resolved_query_scale**-2
  if abs(scalar - round(scalar)) > 1e-6:
    raise PretrainedError(f'{model_type} needs an integer query_pre_attn_scalar; query scale '
                          f'{cfg.resolved_query_scale} gives {scalar}.')
  return {**gemma_to_hf(cfg, model_type, architecture),
          'attn_logit_softcapping': cfg.attention.logit_softcap,
          'final_logit_softcapping': cfg.final_logit_softcap,
          'query_pre_attn_scalar': round(cfg.resolved_query_scale**-2),
          'sliding_window': cfg.attention.sliding_window, 'layer_types': layer_types_to_hf(cfg)}


def config_from_hf(hf: HFConfig) -> ModelConfig:
  return ModelConfig(family='gemma2', **merge(gemma_fields(hf), sandwich_fields(hf, 2)))


def config_to_hf(cfg: ModelConfig) -> dict:
  return sandwich_to_hf(cfg, 'gemma2', 'Gemma2ForCausalLM')


# -- Presets -----------------------------------------------------------------------------------


def _gemma2(d_model: int, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
            mlp_dim: int, query_pre_attn_scalar: int) -> ModelConfig:
  """A Gemma 2 config; even layers (from 0) use the 4096-token sliding window."""
  layer_types = tuple('sliding' if i % 2 == 0 else 'full' for i in range(num_layers))
  return SPEC.config(vocab_size=GEMMA_VOCAB, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     mlp_dim=mlp_dim, max_position_embeddings=8192,
                     attention={'query_scale': query_pre_attn_scalar**-0.5},
                     layer_types=layer_types,
                     rope=RopeConfig(theta=10_000.0))


def gemma2_2b() -> ModelConfig:
  """Gemma 2 2B (2.61B parameters)."""
  return _gemma2(2304, 26, 8, 4, 256, 9216, 256)


def gemma2_9b() -> ModelConfig:
  """Gemma 2 9B (9.24B parameters)."""
  return _gemma2(3584, 42, 16, 8, 256, 14_336, 256)


def gemma2_27b() -> ModelConfig:
  """Gemma 2 27B (27.2B parameters; queries scaled by (d_model / num_heads) ** -0.5 =
  144 ** -0.5)."""
  return _gemma2(4608, 46, 32, 16, 128, 36_864, 144)


SPEC = FamilySpec(
    name='gemma2',
    description='Gemma with norms before and after each sub-block, soft-capped attention and '
                'output logits, and sliding-window layers alternating with global ones.',
    hf=Family('gemma2', ('gemma2',), 'Gemma2ForCausalLM', config_from_hf, config_to_hf,
              defaults={**GEMMA_DEFAULTS, 'attn_logit_softcapping': None,
                        'final_logit_softcapping': None, 'sliding_window': 4096},
              module_names=SANDWICH_NORM_NAMES),
    differences={**gemma.DIFFERENCES, 'post_norm': True, 'final_logit_softcap': 30.0,
                 'attention': {'logit_softcap': 50.0, 'sliding_window': 4096}},
    presets={'gemma2-2b': gemma2_2b, 'gemma2-9b': gemma2_9b, 'gemma2-27b': gemma2_27b},
    chat_template='gemma')

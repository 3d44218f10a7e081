"""Gemma: GeGLU, ``1 + w`` RMSNorms, embeddings scaled by sqrt(d_model), tied output.

Gemma 2 and 3 build on :data:`DIFFERENCES` and :func:`gemma_fields`.
"""

from maxnnx.config import ModelConfig, RopeConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf
from maxnnx.models.registry import FamilySpec

# What every Gemma generation changes in Llama.
DIFFERENCES = {'norm_scale_offset': 1.0, 'scale_embeddings': True, 'mlp_activation': 'gelu_tanh',
               'tie_word_embeddings': True}
GEMMA_VOCAB = 256_000

# -- Hugging Face mapping ----------------------------------------------------------------------

GEMMA_DEFAULTS = {'tie_word_embeddings': True, 'max_position_embeddings': 8192,
                  'hidden_activation': 'gelu_pytorch_tanh'}


def gemma_fields(hf: HFConfig) -> dict:
  """Fields shared by every Gemma generation."""
  fields = hf.common_fields()
  # Early Gemma configs say hidden_act "gelu" but the models use the tanh approximation.
  if hf.data.get('hidden_activation') is None:
    fields['mlp_activation'] = 'gelu_tanh'
  bias = bool(hf.get('attention_bias', False))
  return dict(fields, norm_scale_offset=1.0, scale_embeddings=True,
              attention={'qkv_bias': bias, 'out_bias': bias})


def gemma_to_hf(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
  out = common_to_hf(cfg, model_type, architecture)
  out['hidden_activation'] = out.pop('hidden_act')
  out['attention_bias'] = cfg.attention.qkv_bias
  return out


def config_from_hf(hf: HFConfig) -> ModelConfig:
  return ModelConfig(family='gemma', **gemma_fields(hf))


def config_to_hf(cfg: ModelConfig) -> dict:
  out = gemma_to_hf(cfg, 'gemma', 'GemmaForCausalLM')
  out['hidden_act'] = out['hidden_activation']
  return out


# -- Presets -----------------------------------------------------------------------------------


def _gemma(d_model: int, num_layers: int, num_heads: int, num_kv_heads: int,
           mlp_dim: int) -> ModelConfig:
  """A Gemma config: head_dim 256, 8k context, rope theta 1e4."""
  return SPEC.config(vocab_size=GEMMA_VOCAB, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=256,
                     mlp_dim=mlp_dim, max_position_embeddings=8192,
                     rope=RopeConfig(theta=10_000.0))


def gemma_2b() -> ModelConfig:
  """Gemma 2B (multi-query attention; 2.51B parameters)."""
  return _gemma(2048, 18, 8, 1, 16_384)


def gemma_7b() -> ModelConfig:
  """Gemma 7B (8.54B parameters)."""
  return _gemma(3072, 28, 16, 16, 24_576)


SPEC = FamilySpec(
    name='gemma',
    description='Llama with GeGLU, `1 + w` RMSNorms, embeddings scaled by sqrt(d_model) and '
                'a tied output head.',
    hf=Family('gemma', ('gemma',), 'GemmaForCausalLM', config_from_hf, config_to_hf,
              defaults=GEMMA_DEFAULTS),
    differences=DIFFERENCES,
    presets={'gemma-2b': gemma_2b, 'gemma-7b': gemma_7b},
    chat_template='gemma')

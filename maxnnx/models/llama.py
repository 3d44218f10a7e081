"""Llama 2, 3, 3.1 and 3.3: pre-norm, SwiGLU, GQA, rotary (llama3 scaling in 3.1+).

The baseline: :class:`ModelConfig`'s defaults are this architecture, so Llama declares
no differences and every other family is Llama plus its ``differences``. Preset numbers
follow the ``config.json`` files of the ``meta-llama`` Hugging Face repos; ``tiny`` is a
Llama small enough to train on a laptop CPU in seconds.
"""

from maxnnx.config import AttentionConfig, ModelConfig, RopeConfig
from maxnnx.models.hf import Family, HFConfig, PretrainedError, common_to_hf
from maxnnx.models.registry import FamilySpec

# -- Hugging Face mapping ----------------------------------------------------------------------


def config_from_hf(hf: HFConfig) -> ModelConfig:
  bias = bool(hf.get('attention_bias', False))
  return ModelConfig(family='llama', **hf.common_fields(),
                     attention=AttentionConfig(qkv_bias=bias, out_bias=bias),
                     mlp_bias=bool(hf.get('mlp_bias', False)))


def config_to_hf(cfg: ModelConfig) -> dict:
  if cfg.attention.qkv_bias != cfg.attention.out_bias:
    raise PretrainedError('Llama has one attention_bias for q/k/v/o; this config sets '
                          f'attention.qkv_bias={cfg.attention.qkv_bias} and '
                          f'attention.out_bias={cfg.attention.out_bias}.')
  return {**common_to_hf(cfg, 'llama', 'LlamaForCausalLM'),
          'attention_bias': cfg.attention.qkv_bias, 'mlp_bias': cfg.mlp_bias}


# -- Presets -----------------------------------------------------------------------------------

# Llama 3.1/3.3: 8k pre-training context stretched 16x with band-wise rope scaling.
LLAMA3_1_ROPE = RopeConfig(theta=500_000.0, scaling='llama3', factor=8.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_position_embeddings=8192)


def _llama2(d_model: int, num_layers: int, num_heads: int, num_kv_heads: int,
            mlp_dim: int) -> ModelConfig:
  """A Llama 2 config: 32k vocab, 4k context, rope theta 1e4."""
  return SPEC.config(vocab_size=32_000, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, mlp_dim=mlp_dim,
                     max_position_embeddings=4096, norm_eps=1e-5, rope=RopeConfig(theta=10_000.0))


def _llama3(d_model: int, num_layers: int, num_heads: int, mlp_dim: int,
            long_context: bool = False) -> ModelConfig:
  """A Llama 3 config (8 kv heads, 128k vocab); ``long_context`` gives 3.1's 128k rope."""
  rope = LLAMA3_1_ROPE if long_context else RopeConfig(theta=500_000.0)
  return SPEC.config(vocab_size=128_256, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=8, mlp_dim=mlp_dim,
                     max_position_embeddings=131_072 if long_context else 8192, norm_eps=1e-5,
                     rope=rope)


def tiny() -> ModelConfig:
  """A tiny Llama-style model that trains on a laptop CPU in seconds."""
  return SPEC.config(vocab_size=512, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=32, mlp_dim=384, max_position_embeddings=512, norm_eps=1e-5,
                     rope=RopeConfig(theta=10_000.0))


def llama2_7b() -> ModelConfig:
  """Llama 2 7B (6.74B parameters)."""
  return _llama2(4096, 32, 32, 32, 11_008)


def llama2_13b() -> ModelConfig:
  """Llama 2 13B (13.0B parameters)."""
  return _llama2(5120, 40, 40, 40, 13_824)


def llama2_70b() -> ModelConfig:
  """Llama 2 70B."""
  return _llama2(8192, 80, 64, 8, 28_672)


def llama3_8b() -> ModelConfig:
  """Llama 3 8B (8.03B parameters)."""
  return _llama3(4096, 32, 32, 14_336)


def llama3_70b() -> ModelConfig:
  """Llama 3 70B (70.55B parameters)."""
  return _llama3(8192, 80, 64, 28_672)


def llama3_1_8b() -> ModelConfig:
  """Llama 3.1 8B."""
  return _llama3(4096, 32, 32, 14_336, long_context=True)


def llama3_1_70b() -> ModelConfig:
  """Llama 3.1 70B."""
  return _llama3(8192, 80, 64, 28_672, long_context=True)


def llama3_1_405b() -> ModelConfig:
  """Llama 3.1 405B (405.9B parameters)."""
  return _llama3(16_384, 126, 128, 53_248, long_context=True)


def llama3_3_70b() -> ModelConfig:
  """Llama 3.3 70B."""
  return _llama3(8192, 80, 64, 28_672, long_context=True)


SPEC = FamilySpec(
    name='llama',
    description='The baseline: pre-norm RMSNorm, SwiGLU, grouped-query attention, rotary.',
    hf=Family('llama', ('llama',), 'LlamaForCausalLM', config_from_hf, config_to_hf,
              defaults={'rms_norm_eps': 1e-6, 'max_position_embeddings': 2048}),
    differences={},
    presets={'tiny': tiny, 'llama2-7b': llama2_7b, 'llama2-13b': llama2_13b,
             'llama2-70b': llama2_70b, 'llama3-8b': llama3_8b, 'llama3-70b': llama3_70b,
             'llama3.1-8b': llama3_1_8b, 'llama3.1-70b': llama3_1_70b,
             'llama3.1-405b': llama3_1_405b, 'llama3.3-70b': llama3_3_70b})

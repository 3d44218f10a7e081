"""OLMo 2: norms after each sub-block only, RMSNorm over the whole q and k projections."""

from maxnnx.config import AttentionConfig, ModelConfig, RopeConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf
from maxnnx.models.registry import FamilySpec


def config_from_hf(hf: HFConfig) -> ModelConfig:
  bias = bool(hf.get('attention_bias', False))
  return ModelConfig(family='olmo2', **hf.common_fields(), pre_norm=False, post_norm=True,
                     attention=AttentionConfig(qk_norm='projection', qkv_bias=bias,
                                               out_bias=bias))


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'olmo2', 'Olmo2ForCausalLM'),
          'attention_bias': cfg.attention.qkv_bias}


def olmo2_7b() -> ModelConfig:
  """OLMo 2 7B (OLMo-2-1124-7B, 7.30B parameters)."""
  return SPEC.config(vocab_size=100_352, d_model=4096, num_layers=32, num_heads=32,
                     num_kv_heads=32, mlp_dim=11_008, max_position_embeddings=4096,
                     norm_eps=1e-6, rope=RopeConfig(theta=500_000.0))


SPEC = FamilySpec(
    name='olmo2',
    description='Llama with norms after each sub-block instead of before, and RMSNorm over '
                'the whole q and k projections.',
    hf=Family('olmo2', ('olmo2',), 'Olmo2ForCausalLM', config_from_hf, config_to_hf,
              defaults={'rms_norm_eps': 1e-5, 'max_position_embeddings': 2048},
              module_names={'attn_post_norm': 'post_attention_layernorm',
                            'mlp_post_norm': 'post_feedforward_layernorm'}),
    differences={'pre_norm': False, 'post_norm': True,
                 'attention': {'qk_norm': 'projection'}},
    presets={'olmo2-7b': olmo2_7b})

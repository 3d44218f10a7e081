"""Mistral: Llama with an optional sliding window on every layer."""

from maxnnx.config import AttentionConfig, ModelConfig, RopeConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf
from maxnnx.models.registry import FamilySpec


def config_from_hf(hf: HFConfig) -> ModelConfig:
  return ModelConfig(family='mistral', **hf.common_fields(),
                     attention=AttentionConfig(sliding_window=hf.get('sliding_window')))


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'mistral', 'MistralForCausalLM'),
          'sliding_window': cfg.attention.sliding_window}


def mistral_7b() -> ModelConfig:
  """Mistral 7B (7.24B parameters), v0.2 layout (as Mistral-7B-Instruct-v0.2).

  v0.2 dropped v0.1's 4096-token sliding window and raised rope theta from 1e4
  to 1e6 for a 32k context. The vocabulary is v0.1/v0.2's 32000 tokens; v0.3
  is the same network with 32768 (``get_preset('mistral-7b', vocab_size=32768)``).
  """
  return SPEC.config(vocab_size=32_000, d_model=4096, num_layers=32, num_heads=32,
                     num_kv_heads=8, head_dim=128, mlp_dim=14_336,
                     max_position_embeddings=32_768, norm_eps=1e-5,
                     rope=RopeConfig(theta=1_000_000.0))


SPEC = FamilySpec(
    name='mistral',
    description='Llama with an optional sliding window on every layer (none since v0.2).',
    hf=Family('mistral', ('mistral',), 'MistralForCausalLM', config_from_hf, config_to_hf,
              defaults={'max_position_embeddings': 131072}),
    differences={},
    presets={'mistral-7b': mistral_7b})

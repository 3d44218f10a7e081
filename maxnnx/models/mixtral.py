"""Mixtral: Mistral attention with every MLP replaced by 8 SwiGLU experts, top-2 routing.

The router's softmax top-2 weights are renormalised. Hub tensors live under
``block_sparse_moe`` with experts named ``w1`` (gate), ``w3`` (up) and ``w2`` (down).
"""

from maxnnx.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf
from maxnnx.models.moe_hf import expert_hooks
from maxnnx.models.registry import FamilySpec


def config_from_hf(hf: HFConfig) -> ModelConfig:
  return ModelConfig(family='mixtral', **hf.common_fields(),
                     attention=AttentionConfig(sliding_window=hf.get('sliding_window')),
                     moe=MoEConfig(num_experts=hf.require('num_local_experts'),
                                   num_experts_per_tok=hf.get('num_experts_per_tok', 2)))


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'mixtral', 'MixtralForCausalLM'),
          'sliding_window': cfg.attention.sliding_window, 'num_local_experts': cfg.moe.num_experts,
          'num_experts_per_tok': cfg.moe.num_experts_per_tok,
          'router_aux_loss_coef': 0.001}  # a training setting (TrainConfig): HF's default


unfuse, fuse = expert_hooks('block_sparse_moe',
                            {'gate_proj': 'w1', 'up_proj': 'w3', 'down_proj': 'w2'})


# -- Presets -----------------------------------------------------------------------------------


def tiny_moe() -> ModelConfig:
  """A tiny Mixtral-style model (8 experts, top-2) for tests and tutorials on a CPU."""
  return SPEC.config(vocab_size=512, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=32, mlp_dim=128, max_position_embeddings=512, norm_eps=1e-5,
                     rope=RopeConfig(theta=10_000.0))


def _mixtral(vocab_size: int, d_model: int, num_layers: int, num_heads: int, mlp_dim: int,
             max_position_embeddings: int) -> ModelConfig:
  return SPEC.config(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=8, mlp_dim=mlp_dim,
                     max_position_embeddings=max_position_embeddings, norm_eps=1e-5,
                     rope=RopeConfig(theta=1_000_000.0))


def mixtral_8x7b() -> ModelConfig:
  """Mixtral 8x7B (v0.1): 46.7B parameters, 12.9B active."""
  return _mixtral(32_000, 4096, 32, 32, 14_336, 32_768)


def mixtral_8x22b() -> ModelConfig:
  """Mixtral 8x22B (v0.1): 141B parameters, 39B active."""
  return _mixtral(32_768, 6144, 56, 48, 16_384, 65_536)


SPEC = FamilySpec(
    name='mixtral',
    description='Mistral with every MLP replaced by 8 SwiGLU experts, softmax top-2 routing.',
    hf=Family('mixtral', ('mixtral',), 'MixtralForCausalLM', config_from_hf, config_to_hf,
              defaults={'rms_norm_eps': 1e-5, 'max_position_embeddings': 131_072,
                        'rope_theta': 1e6},
              module_names={'mlp': 'block_sparse_moe', 'router': 'gate'},
              unfuse=unfuse, fuse=fuse),
    differences={'moe': {'num_experts': 8}},
    presets={'tiny-moe': tiny_moe, 'mixtral-8x7b': mixtral_8x7b,
             'mixtral-8x22b': mixtral_8x22b})

"""Mixtral: Mistral attention with every MLP replaced by 8 SwiGLU experts, top-2 routing.

The router's softmax top-2 weights are renormalised. Hub tensors live under
``block_sparse_moe`` with experts named ``w1`` (gate), ``w3`` (up) and ``w2`` (down).
"""

from maxnnx.config import ModelConfig, MoEConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf
from maxnnx.models.moe_hf import expert_hooks


def config_from_hf(hf: HFConfig) -> ModelConfig:
  return ModelConfig(family='mixtral', **hf.common_fields(),
                     sliding_window=hf.get('sliding_window'),
                     moe=MoEConfig(num_experts=hf.require('num_local_experts'),
                                   num_experts_per_tok=hf.get('num_experts_per_tok', 2)))


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'mixtral', 'MixtralForCausalLM'),
          'sliding_window': cfg.sliding_window, 'num_local_experts': cfg.moe.num_experts,
          'num_experts_per_tok': cfg.moe.num_experts_per_tok,
          'router_aux_loss_coef': 0.001}  # a training setting (TrainConfig): HF's default


unfuse, fuse = expert_hooks('block_sparse_moe',
                            {'gate_proj': 'w1', 'up_proj': 'w3', 'down_proj': 'w2'})

FAMILY = Family('mixtral', ('mixtral',), 'MixtralForCausalLM', config_from_hf, config_to_hf,
                defaults={'rms_norm_eps': 1e-5, 'max_position_embeddings': 131_072,
                          'rope_theta': 1e6},
                module_names={'mlp': 'block_sparse_moe', 'router': 'gate'},
                unfuse=unfuse, fuse=fuse)

"""Qwen3-MoE: Qwen3 attention (per-head q/k norms) with softmax top-k routed experts.

``norm_topk_prob`` says whether the top-k weights are renormalised; there are no
shared experts. Layers listed in ``mlp_only_layers`` (or skipped by
``decoder_sparse_step``) keep a dense MLP of width ``intermediate_size``.
"""

from maxnnx.config import ModelConfig, MoEConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf
from maxnnx.models.moe_hf import expert_hooks, moe_layout
from maxnnx.models.qwen2 import sliding_layers, sliding_layers_to_hf


def config_from_hf(hf: HFConfig) -> ModelConfig:
  bias = bool(hf.get('attention_bias', False))
  # transformers 5 writes num_local_experts; Hub configs say num_experts.
  experts = hf.get('num_local_experts') or hf.require('num_experts')
  step, dense = hf.get('decoder_sparse_step', 1), set(hf.get('mlp_only_layers') or ())
  is_moe = [i not in dense and (i + 1) % step == 0
            for i in range(hf.require('num_hidden_layers'))]
  return ModelConfig(family='qwen3_moe', **hf.common_fields(), qkv_bias=bias, out_bias=bias,
                     qk_norm='head', **sliding_layers(hf),
                     moe=MoEConfig(num_experts=experts,
                                   num_experts_per_tok=hf.get('num_experts_per_tok', 8),
                                   mlp_dim=hf.require('moe_intermediate_size'),
                                   router_norm_topk=bool(hf.get('norm_topk_prob', False)),
                                   **moe_layout(is_moe, hf.path)))


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'qwen3_moe', 'Qwen3MoeForCausalLM'), **sliding_layers_to_hf(cfg),
          'attention_bias': cfg.qkv_bias, 'num_local_experts': cfg.moe.num_experts,
          'num_experts_per_tok': cfg.moe.num_experts_per_tok,
          'moe_intermediate_size': cfg.resolved_moe_mlp_dim,
          'norm_topk_prob': cfg.moe.router_norm_topk, 'decoder_sparse_step': 1,
          'mlp_only_layers': [i for i, m in enumerate(cfg.moe_layers) if not m],
          'router_aux_loss_coef': 0.001}  # a training setting (TrainConfig): HF's default


unfuse, fuse = expert_hooks('mlp')

FAMILY = Family('qwen3_moe', ('qwen3_moe',), 'Qwen3MoeForCausalLM', config_from_hf,
                config_to_hf, defaults={'max_position_embeddings': 32768},
                module_names={'router': 'gate'}, unfuse=unfuse, fuse=fuse)

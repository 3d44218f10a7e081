"""Qwen3-MoE: Qwen3 attention (per-head q/k norms) with softmax top-k routed experts.

``norm_topk_prob`` says whether the top-k weights are renormalised; there are no
shared experts. Layers listed in ``mlp_only_layers`` (or skipped by
``decoder_sparse_step``) keep a dense MLP of width ``intermediate_size``.
"""

from maxnnx.config import ModelConfig, MoEConfig, RopeConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf
from maxnnx.models.moe_hf import expert_hooks, moe_layout
from maxnnx.models.qwen2 import sliding_layers, sliding_layers_to_hf
from maxnnx.models.registry import FamilySpec


def config_from_hf(hf: HFConfig) -> ModelConfig:
  bias = bool(hf.get('attention_bias', False))
  # transformers 5 writes num_local_experts; Hub configs say num_experts.
  experts = hf.get('num_local_experts') or hf.require('num_experts')
  step, dense = hf.get('decoder_sparse_step', 1), set(hf.get('mlp_only_layers') or ())
  is_moe = [i not in dense and (i + 1) % step == 0
            for i in range(hf.require('num_hidden_layers'))]
  return ModelConfig(family='qwen3_moe', **hf.common_fields(),
                     **sliding_layers(hf, qkv_bias=bias, out_bias=bias, qk_norm='head'),
                     moe=MoEConfig(num_experts=experts,
                                   num_experts_per_tok=hf.get('num_experts_per_tok', 8),
                                   mlp_dim=hf.require('moe_intermediate_size'),
                                   router_norm_topk=bool(hf.get('norm_topk_prob', False)),
                                   **moe_layout(is_moe, hf.path)))


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'qwen3_moe', 'Qwen3MoeForCausalLM'), **sliding_layers_to_hf(cfg),
          'attention_bias': cfg.attention.qkv_bias, 'num_local_experts': cfg.moe.num_experts,
          'num_experts_per_tok': cfg.moe.num_experts_per_tok,
          'moe_intermediate_size': cfg.resolved_moe_mlp_dim,
          'norm_topk_prob': cfg.moe.router_norm_topk, 'decoder_sparse_step': 1,
          'mlp_only_layers': [i for i, m in enumerate(cfg.moe_layers) if not m],
          'router_aux_loss_coef': 0.001}  # a training setting (TrainConfig): HF's default


unfuse, fuse = expert_hooks('mlp')


# -- Presets -----------------------------------------------------------------------------------


def _qwen3_moe(d_model: int, num_layers: int, num_heads: int, moe_mlp_dim: int,
               mlp_dim: int) -> ModelConfig:
  return SPEC.config(vocab_size=151_936, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=4, head_dim=128, mlp_dim=mlp_dim,
                     max_position_embeddings=40_960, norm_eps=1e-6,
                     rope=RopeConfig(theta=1_000_000.0),
                     moe={'num_experts': 128, 'mlp_dim': moe_mlp_dim})


def qwen3_30b_a3b() -> ModelConfig:
  """Qwen3-30B-A3B: 30.5B parameters, 3.3B active (128 experts, top-8)."""
  return _qwen3_moe(2048, 48, 32, 768, 6144)


def qwen3_235b_a22b() -> ModelConfig:
  """Qwen3-235B-A22B: 235B parameters, 22B active (128 experts, top-8)."""
  return _qwen3_moe(4096, 94, 64, 1536, 12_288)


def qwen3_480b_a35b() -> ModelConfig:
  """Qwen3-Coder-480B-A35B: 480B parameters, 35B active (160 experts, top-8; 8 kv heads,
  a 262,144-token context, rope theta 1e7)."""
  return _qwen3_moe(6144, 62, 96, 2560, 8192).replace(
      num_kv_heads=8, max_position_embeddings=262_144, rope=RopeConfig(theta=10_000_000.0),
      moe={'num_experts': 160, 'num_experts_per_tok': 8, 'mlp_dim': 2560})


SPEC = FamilySpec(
    name='qwen3_moe',
    description='Qwen3 with every MLP replaced by softmax top-8 of its routed experts (128; '
                '160 in the 480B).',
    hf=Family('qwen3_moe', ('qwen3_moe',), 'Qwen3MoeForCausalLM', config_from_hf,
              config_to_hf, defaults={'max_position_embeddings': 32768},
              module_names={'router': 'gate'}, unfuse=unfuse, fuse=fuse),
    differences={'attention': {'qk_norm': 'head'}, 'moe': {'num_experts_per_tok': 8}},
    presets={'qwen3-30b-a3b': qwen3_30b_a3b, 'qwen3-235b-a22b': qwen3_235b_a22b,
             'qwen3-480b-a35b': qwen3_480b_a35b},
    chat_template='chatml')

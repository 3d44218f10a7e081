"""Qwen3-Next: Gated DeltaNet linear-attention layers, 1 gated full-attention layer in 4, and
top-10 of 512 experts plus a sigmoid-gated shared expert.

What it changes in Llama, as :class:`ModelConfig` fields:

* ``layer_types``: three ``linear`` layers (:class:`~maxnnx.layers.gated_deltanet.GatedDeltaNet`,
  shaped by ``linear_attn``) then one ``full`` layer, repeated;
* full attention has per-head q/k norms, rotates a quarter of ``head_dim``
  (``rope.partial_rotary_factor=0.25``) and gates its output per head
  (``attention.output_gate``);
* every norm is Gemma-style ``(1 + w)`` (``norm_scale_offset=1``), except the gated
  norm inside the linear layers;
* MoE: softmax top-10 of 512 experts, renormalised, plus a shared expert whose
  output is scaled by ``sigmoid(x . w)`` (``moe.shared_expert_gate``).

Checkpoint layout: linear layers live under ``linear_attn`` (our ``attn``, renamed by
the hooks), full ones under ``self_attn``; experts one ``Linear`` each, as Qwen3-MoE.
The hybrid stack runs unscanned (``scan_layers=False``). The serving engine gives each
request a state slot in the linear layers (and pages in the full ones), without prefix
caching.
"""

import re

from maxnnx.config import AttentionConfig, LinearAttentionConfig, ModelConfig, MoEConfig, RopeConfig
from maxnnx.models.hf import (
  Family,
  HFConfig,
  TensorDict,
  common_to_hf,
  layer_types_to_hf,
)
from maxnnx.models.moe_hf import expert_hooks, moe_layout
from maxnnx.models.registry import FamilySpec

FULL_EVERY = 4  # transformers' full_attention_interval default


def config_from_hf(hf: HFConfig) -> ModelConfig:
  num_layers = hf.require('num_hidden_layers')
  every = hf.get('full_attention_interval', FULL_EVERY)
  layer_types = hf.layer_types() or tuple(
      'linear' if (i + 1) % every else 'full' for i in range(num_layers))
  step, dense = hf.get('decoder_sparse_step', 1), set(hf.get('mlp_only_layers') or ())
  experts = hf.get('num_experts', 512)
  is_moe = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
  expert_dim = hf.get('moe_intermediate_size', 512)
  shared_dim = hf.get('shared_expert_intermediate_size', 512)
  bias = bool(hf.get('attention_bias', False))
  return ModelConfig(
      family='qwen3_next', **hf.common_fields(), norm_scale_offset=1.0,
      attention=AttentionConfig(qkv_bias=bias, out_bias=bias, qk_norm='head', output_gate=True),
      layer_types=layer_types,
      linear_attn=LinearAttentionConfig(
          num_key_heads=hf.get('linear_num_key_heads', 16),
          num_value_heads=hf.get('linear_num_value_heads', 32),
          key_head_dim=hf.get('linear_key_head_dim', 128),
          value_head_dim=hf.get('linear_value_head_dim', 128),
          conv_kernel_size=hf.get('linear_conv_kernel_dim', 4)),
      moe=MoEConfig(num_experts=experts if any(is_moe) else 0,
                    num_experts_per_tok=hf.get('num_experts_per_tok', 10),
                    mlp_dim=expert_dim, **_shared_expert(shared_dim, expert_dim),
                    shared_expert_gate=True,
                    router_norm_topk=bool(hf.get('norm_topk_prob', True)),
                    **moe_layout(is_moe, hf.path)))


def _shared_expert(shared_dim: int, expert_dim: int) -> dict:
  """MoEConfig fields of a shared expert ``shared_dim`` wide: a count of routed-expert widths
  when it is a multiple of them (as the presets say it), else its own width."""
  if shared_dim % expert_dim == 0:
    return {'num_shared_experts': shared_dim // expert_dim}
  return {'num_shared_experts': 1, 'shared_mlp_dim': shared_dim}


def config_to_hf(cfg: ModelConfig) -> dict:
  la, moe = cfg.linear_attn, cfg.moe
  return {**common_to_hf(cfg, 'qwen3_next', 'Qwen3NextForCausalLM'),
          'layer_types': layer_types_to_hf(cfg), 'attention_bias': cfg.attention.qkv_bias,
          'linear_num_key_heads': la.num_key_heads, 'linear_num_value_heads': la.num_value_heads,
          'linear_key_head_dim': la.key_head_dim, 'linear_value_head_dim': la.value_head_dim,
          'linear_conv_kernel_dim': la.conv_kernel_size,
          'num_experts': moe.num_experts, 'num_experts_per_tok': moe.num_experts_per_tok,
          'moe_intermediate_size': cfg.resolved_moe_mlp_dim,
          'shared_expert_intermediate_size': cfg.resolved_shared_mlp_dim,
          'norm_topk_prob': moe.router_norm_topk, 'decoder_sparse_step': 1,
          'mlp_only_layers': [i for i, m in enumerate(cfg.moe_layers) if not m],
          'router_aux_loss_coef': 0.001}  # a training setting (TrainConfig): HF's default


_unfuse_experts, _fuse_experts = expert_hooks('mlp')


def _move_linear_layers(tensors: dict, cfg: ModelConfig, source: str, target: str) -> dict:
  """``tensors`` with the linear layers' ``model.layers.{i}.{source}.*`` renamed to ``target``."""
  linear = {i for i, t in enumerate(cfg.resolved_layer_types) if t == 'linear'}
  pattern = re.compile(rf'model\.layers\.(\d+)\.{source}\.(.*)')
  renamed = {}
  for name, value in tensors.items():
    match = pattern.fullmatch(name)
    if match and int(match.group(1)) in linear:
      name = f'model.layers.{match.group(1)}.{target}.{match.group(2)}'
    renamed[name] = value
  return renamed


def unfuse(tensors: TensorDict, cfg: ModelConfig) -> TensorDict:
  """Stack the experts, and file the linear layers' ``linear_attn`` under our ``attn``."""
  return _move_linear_layers(_unfuse_experts(tensors, cfg), cfg, 'linear_attn', 'self_attn')


def fuse(tensors: dict, cfg: ModelConfig) -> dict:
  """Inverse of :func:`unfuse` for export."""
  return _fuse_experts(_move_linear_layers(tensors, cfg, 'self_attn', 'linear_attn'), cfg)


# -- Presets -----------------------------------------------------------------------------------


def qwen3_next_80b_a3b() -> ModelConfig:
  """Qwen3-Next-80B-A3B: 80B parameters, 3B active (512 experts, top-10, one shared;
  36 Gated DeltaNet + 12 gated attention layers, 262,144-token context)."""
  return SPEC.config(vocab_size=151_936, d_model=2048, num_layers=48, num_heads=16,
                     num_kv_heads=2, head_dim=256, mlp_dim=5120,
                     max_position_embeddings=262_144, norm_eps=1e-6,
                     rope=RopeConfig(theta=10_000_000.0, partial_rotary_factor=0.25),
                     layer_types=tuple('linear' if (i + 1) % FULL_EVERY else 'full'
                                       for i in range(48)),
                     moe={'num_experts': 512, 'num_experts_per_tok': 10, 'mlp_dim': 512},
                     eos_token_id=151_645)


def tiny_qwen3_next() -> ModelConfig:
  """A tiny Qwen3-Next (4 layers: 3 Gated DeltaNet + 1 gated attention, 8 experts) for CPU."""
  return SPEC.config(vocab_size=512, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=32, mlp_dim=256, max_position_embeddings=512,
                     rope=RopeConfig(theta=10_000.0, partial_rotary_factor=0.25),
                     layer_types=('linear', 'linear', 'linear', 'full'),
                     linear_attn={'num_key_heads': 2, 'num_value_heads': 4, 'key_head_dim': 16,
                                  'value_head_dim': 16},
                     moe={'num_experts': 8, 'num_experts_per_tok': 2, 'mlp_dim': 64})


SPEC = FamilySpec(
    name='qwen3_next',
    description='Gated DeltaNet linear-attention layers with one gated full-attention layer '
                'in four, (1 + w) norms, and top-10 of 512 experts plus a sigmoid-gated '
                'shared expert.',
    hf=Family('qwen3_next', ('qwen3_next',), 'Qwen3NextForCausalLM', config_from_hf,
              config_to_hf,
              defaults={'rms_norm_eps': 1e-6, 'max_position_embeddings': 32_768,
                        'head_dim': 256, 'partial_rotary_factor': 0.25},
              module_names={'router': 'gate', 'shared_experts': 'shared_expert'},
              unfuse=unfuse, fuse=fuse),
    differences={'attention': {'qk_norm': 'head', 'output_gate': True}, 'norm_scale_offset': 1.0,
                 'moe': {'num_shared_experts': 1, 'shared_expert_gate': True}},
    presets={'qwen3-next-80b-a3b': qwen3_next_80b_a3b, 'tiny-qwen3-next': tiny_qwen3_next},
    chat_template='chatml')

"""Qwen3.5 (the MoE text model): Qwen3-Next with separate linear-attention projections.

The block is Qwen3-Next's (:mod:`maxnnx.models.qwen3_next`): three Gated DeltaNet
layers then one gated full-attention layer, ``(1 + w)`` norms, softmax top-k experts
(always renormalised) plus a sigmoid-gated shared expert in every layer. What differs
is the linear layers' input projections, ``in_proj_qkv`` / ``in_proj_z`` /
``in_proj_b`` / ``in_proj_a`` (``linear_attn.projections='split'``), and the sizes.

The Hub releases are multimodal; this family loads their text model
(``qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``). Its rotary embedding is MRoPE,
which for text (the same position on every axis) is the ordinary rotary embedding of
a quarter of ``head_dim``.
"""

from maxnnx.config import ModelConfig, RopeConfig
from maxnnx.models import qwen3_next
from maxnnx.models.hf import Family, HFConfig
from maxnnx.models.registry import FamilySpec

# Keys Qwen3-Next has and the Qwen3.5 text config removes (it has no dense layers).
_REMOVED_KEYS = ('intermediate_size', 'decoder_sparse_step', 'norm_topk_prob', 'mlp_only_layers')


def config_from_hf(hf: HFConfig) -> ModelConfig:
  data = {**hf.data, 'intermediate_size': hf.get('moe_intermediate_size', 512),
          'norm_topk_prob': True, 'mlp_only_layers': [], 'decoder_sparse_step': 1}
  cfg = qwen3_next.config_from_hf(HFConfig(data, hf.path, hf.defaults))
  return cfg.replace(family='qwen3_5', **{'linear_attn.projections': 'split'})


def config_to_hf(cfg: ModelConfig) -> dict:
  out = qwen3_next.config_to_hf(cfg)
  for key in _REMOVED_KEYS:
    out.pop(key)
  out.update(model_type='qwen3_5_moe_text', architectures=['Qwen3_5MoeForCausalLM'])
  return out


# -- Presets -----------------------------------------------------------------------------------


def _qwen3_5(d_model: int, num_layers: int, num_heads: int, value_heads: int, experts: int,
             top_k: int, expert_dim: int) -> ModelConfig:
  return SPEC.config(
      vocab_size=248_320, d_model=d_model, num_layers=num_layers, num_heads=num_heads,
      num_kv_heads=2, head_dim=256, mlp_dim=expert_dim, max_position_embeddings=262_144,
      norm_eps=1e-6, rope=RopeConfig(theta=10_000_000.0, partial_rotary_factor=0.25),
      layer_types=tuple('linear' if (i + 1) % qwen3_next.FULL_EVERY else 'full'
                        for i in range(num_layers)),
      linear_attn={'num_value_heads': value_heads},
      moe={'num_experts': experts, 'num_experts_per_tok': top_k, 'mlp_dim': expert_dim})


def qwen3_5_35b_a3b() -> ModelConfig:
  """Qwen3.5-35B-A3B (text): 35B parameters, 3B active (256 experts, top-8, one shared)."""
  return _qwen3_5(2048, 40, 16, 32, 256, 8, 512)


def qwen3_5_397b_a17b() -> ModelConfig:
  """Qwen3.5-397B-A17B (text): 397B parameters, 17B active (512 experts, top-10, one shared;
  45 Gated DeltaNet layers of 64 value heads + 15 gated attention layers)."""
  return _qwen3_5(4096, 60, 32, 64, 512, 10, 1024)


SPEC = FamilySpec(
    name='qwen3_5',
    description="Qwen3-Next's hybrid Gated DeltaNet / gated-attention stack with every layer "
                'MoE and separate linear-attention projections.',
    hf=Family('qwen3_5', ('qwen3_5_moe_text',), 'Qwen3_5MoeForCausalLM', config_from_hf,
              config_to_hf, defaults=qwen3_next.SPEC.hf.defaults,
              module_names=qwen3_next.SPEC.hf.module_names,
              unfuse=qwen3_next.unfuse, fuse=qwen3_next.fuse),
    differences={**qwen3_next.SPEC.differences, 'linear_attn': {'projections': 'split'},
                 'moe': {'num_shared_experts': 1, 'shared_expert_gate': True}},
    presets={'qwen3.5-35b-a3b': qwen3_5_35b_a3b, 'qwen3.5-397b-a17b': qwen3_5_397b_a17b},
    chat_template='chatml')

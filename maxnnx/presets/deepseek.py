"""DeepSeek V2 / V2-Lite / V3 and Kimi K2 presets: latent attention + fine-grained experts.

DeepSeek-V3 has one multi-token-prediction module (``mtp.num_layers=1``, as its
checkpoints ship). The published 671B excludes it; ``maxnnx.num_params`` counts it
(about 11.7B more: a MoE block plus ``eh_proj`` and norms); the Hub's 685B also
counts the MTP layer's stored copies of the embedding and output head (2 x 0.93B).
"""

from maxnnx.config import MLAConfig, ModelConfig, MoEConfig, MTPConfig, RopeConfig


def _yarn(theta: float, factor: float, mscale: float) -> RopeConfig:
  return RopeConfig(theta=theta, scaling='yarn', factor=factor,
                    original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                    mscale=mscale, mscale_all_dim=mscale)


def _deepseek(family: str, *, q_lora_rank: int | None, moe: dict, **fields) -> ModelConfig:
  common = dict(family=family, attention_type='mla', rope_interleave=True, norm_eps=1e-6,
                max_position_embeddings=163_840)
  mla = MLAConfig(q_lora_rank=q_lora_rank, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128)
  return ModelConfig(**{**common, **fields}, mla=mla,
                     moe=MoEConfig(**{'first_k_dense_layers': 1, **moe}))


def deepseek_v2_lite() -> ModelConfig:
  """DeepSeek-V2-Lite: 15.7B parameters, 2.4B active (64 experts, top-6, full-rank queries)."""
  return _deepseek('deepseek_v2', vocab_size=102_400, d_model=2048, num_layers=27, num_heads=16,
                   num_kv_heads=16, mlp_dim=10_944, q_lora_rank=None,
                   moe=dict(num_experts=64, num_experts_per_tok=6, mlp_dim=1408,
                            num_shared_experts=2, router_norm_topk=False),
                   rope=_yarn(10_000.0, 40.0, 0.707))


def deepseek_v2() -> ModelConfig:
  """DeepSeek-V2: 236B parameters, 21B active (160 experts, top-6 of the best 3 of 8 groups)."""
  return _deepseek('deepseek_v2', vocab_size=102_400, d_model=5120, num_layers=60, num_heads=128,
                   num_kv_heads=128, mlp_dim=12_288, q_lora_rank=1536,
                   moe=dict(num_experts=160, num_experts_per_tok=6, mlp_dim=1536,
                            num_shared_experts=2, router_norm_topk=False,
                            router_scaling_factor=16.0, router_groups=8, router_topk_groups=3,
                            router_group_score='max'),
                   rope=_yarn(10_000.0, 40.0, 0.707))


def deepseek_v3() -> ModelConfig:
  """DeepSeek-V3 / R1: 671B parameters, 37B active (256 experts, top-8, sigmoid routing),
  plus one multi-token-prediction module."""
  return _deepseek('deepseek_v3', vocab_size=129_280, d_model=7168, num_layers=61, num_heads=128,
                   num_kv_heads=128, mlp_dim=18_432, q_lora_rank=1536,
                   moe=dict(num_experts=256, num_experts_per_tok=8, mlp_dim=2048,
                            num_shared_experts=1, first_k_dense_layers=3,
                            router_score='sigmoid', router_score_bias=True,
                            router_scaling_factor=2.5, router_groups=8, router_topk_groups=4,
                            router_group_score='top2_sum'),
                   rope=_yarn(10_000.0, 40.0, 1.0), mtp=MTPConfig(num_layers=1))


def kimi_k2() -> ModelConfig:
  """Kimi K2: the DeepSeek V3 architecture with 384 experts and 64 heads; 1.04T parameters,
  32B active."""
  return _deepseek('deepseek_v3', vocab_size=163_840, d_model=7168, num_layers=61, num_heads=64,
                   num_kv_heads=64, mlp_dim=18_432, q_lora_rank=1536,
                   moe=dict(num_experts=384, num_experts_per_tok=8, mlp_dim=2048,
                            num_shared_experts=1, router_score='sigmoid',
                            router_score_bias=True, router_scaling_factor=2.827,
                            router_group_score='top2_sum'),
                   max_position_embeddings=131_072, rope=_yarn(50_000.0, 32.0, 1.0))

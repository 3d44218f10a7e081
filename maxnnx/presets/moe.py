"""Mixture-of-Experts presets: Mixtral, Qwen3-MoE, GPT-OSS, and the CPU-sized ``tiny-moe``."""

from maxnnx.config import ModelConfig, MoEConfig, RopeConfig


def tiny_moe() -> ModelConfig:
  """A tiny Mixtral-style model (8 experts, top-2) for tests and tutorials on a CPU."""
  return ModelConfig(family='mixtral', vocab_size=512, d_model=128, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=32, mlp_dim=128, max_position_embeddings=512,
                     norm_eps=1e-5, rope=RopeConfig(theta=10_000.0),
                     moe=MoEConfig(num_experts=8, num_experts_per_tok=2))


def _mixtral(vocab_size: int, d_model: int, num_layers: int, num_heads: int, mlp_dim: int,
             max_position_embeddings: int) -> ModelConfig:
  return ModelConfig(family='mixtral', vocab_size=vocab_size, d_model=d_model,
                     num_layers=num_layers, num_heads=num_heads, num_kv_heads=8, mlp_dim=mlp_dim,
                     max_position_embeddings=max_position_embeddings, norm_eps=1e-5,
                     rope=RopeConfig(theta=1_000_000.0),
                     moe=MoEConfig(num_experts=8, num_experts_per_tok=2))


def mixtral_8x7b() -> ModelConfig:
  """Mixtral 8x7B (v0.1): 46.7B parameters, 12.9B active."""
  return _mixtral(32_000, 4096, 32, 32, 14_336, 32_768)


def mixtral_8x22b() -> ModelConfig:
  """Mixtral 8x22B (v0.1): 141B parameters, 39B active."""
  return _mixtral(32_768, 6144, 56, 48, 16_384, 65_536)


def _qwen3_moe(d_model: int, num_layers: int, num_heads: int, moe_mlp_dim: int,
               mlp_dim: int) -> ModelConfig:
  return ModelConfig(family='qwen3_moe', vocab_size=151_936, d_model=d_model,
                     num_layers=num_layers, num_heads=num_heads, num_kv_heads=4, head_dim=128,
                     mlp_dim=mlp_dim, max_position_embeddings=40_960, norm_eps=1e-6,
                     qk_norm='head', rope=RopeConfig(theta=1_000_000.0),
                     moe=MoEConfig(num_experts=128, num_experts_per_tok=8, mlp_dim=moe_mlp_dim,
                                   router_norm_topk=True))


def qwen3_30b_a3b() -> ModelConfig:
  """Qwen3-30B-A3B: 30.5B parameters, 3.3B active (128 experts, top-8)."""
  return _qwen3_moe(2048, 48, 32, 768, 6144)


def qwen3_235b_a22b() -> ModelConfig:
  """Qwen3-235B-A22B: 235B parameters, 22B active (128 experts, top-8)."""
  return _qwen3_moe(4096, 94, 64, 1536, 12_288)


def _gpt_oss(num_layers: int, num_experts: int) -> ModelConfig:
  return ModelConfig(family='gpt_oss', vocab_size=201_088, d_model=2880, num_layers=num_layers,
                     num_heads=64, num_kv_heads=8, head_dim=64, mlp_dim=2880,
                     max_position_embeddings=131_072, norm_eps=1e-5, qkv_bias=True,
                     out_bias=True, attention_sinks=True, sliding_window=128,
                     layer_types=('sliding', 'full') * (num_layers // 2),
                     rope=RopeConfig(theta=150_000.0, scaling='yarn', factor=32.0,
                                     original_max_position_embeddings=4096, beta_fast=32.0,
                                     beta_slow=1.0, truncate=False),
                     moe=MoEConfig(num_experts=num_experts, num_experts_per_tok=4,
                                   router_norm_topk=True, router_bias=True, expert_bias=True,
                                   swiglu_limit=7.0),
                     eos_token_id=200_002, pad_token_id=199_999)


def gpt_oss_20b() -> ModelConfig:
  """gpt-oss-20b: 20.9B parameters, 3.6B active (32 experts, top-4)."""
  return _gpt_oss(24, 32)


def gpt_oss_120b() -> ModelConfig:
  """gpt-oss-120b: 116.8B parameters, 5.1B active (128 experts, top-4)."""
  return _gpt_oss(36, 128)

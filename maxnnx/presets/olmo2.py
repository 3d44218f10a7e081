"""OLMo 2 presets: post-norm only, RMSNorm over the whole q and k projections."""

from maxnnx.config import ModelConfig, RopeConfig


def olmo2_7b() -> ModelConfig:
  """OLMo 2 7B (OLMo-2-1124-7B)."""
  return ModelConfig(family='olmo2', vocab_size=100_352, d_model=4096, num_layers=32,
                     num_heads=32, num_kv_heads=32, mlp_dim=11_008,
                     max_position_embeddings=4096, norm_eps=1e-6, pre_norm=False,
                     post_norm=True, qk_norm='projection', rope=RopeConfig(theta=500_000.0))

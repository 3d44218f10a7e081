"""Qwen3: Qwen2 without q/k/v biases, plus per-head RMSNorm on queries and keys.

The dense models have head_dim 128 and a 40k context.
"""

from maxnnx.config import ModelConfig, RopeConfig
from maxnnx.models.hf import Family, HFConfig, common_to_hf
from maxnnx.models.qwen2 import sliding_layers, sliding_layers_to_hf
from maxnnx.models.registry import FamilySpec


def config_from_hf(hf: HFConfig) -> ModelConfig:
  bias = bool(hf.get('attention_bias', False))
  return ModelConfig(family='qwen3', **hf.common_fields(),
                     **sliding_layers(hf, qkv_bias=bias, out_bias=bias, qk_norm='head'))


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'qwen3', 'Qwen3ForCausalLM'), **sliding_layers_to_hf(cfg),
          'attention_bias': cfg.attention.qkv_bias}


def _qwen3(d_model: int, num_layers: int, num_heads: int, mlp_dim: int,
           tie_word_embeddings: bool = False) -> ModelConfig:
  """A Qwen3 config (8 kv heads, 151936-token vocab, rope theta 1e6)."""
  return SPEC.config(vocab_size=151_936, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=8, head_dim=128, mlp_dim=mlp_dim,
                     max_position_embeddings=40_960, norm_eps=1e-6,
                     tie_word_embeddings=tie_word_embeddings,
                     rope=RopeConfig(theta=1_000_000.0))


def qwen3_0_6b() -> ModelConfig:
  """Qwen3 0.6B."""
  return _qwen3(1024, 28, 16, 3072, tie_word_embeddings=True)


def qwen3_1_7b() -> ModelConfig:
  """Qwen3 1.7B."""
  return _qwen3(2048, 28, 16, 6144, tie_word_embeddings=True)


def qwen3_4b() -> ModelConfig:
  """Qwen3 4B."""
  return _qwen3(2560, 36, 32, 9728, tie_word_embeddings=True)


def qwen3_4b_thinking_2507() -> ModelConfig:
  """Qwen3-4B-Thinking-2507: Qwen3 4B's shapes with a 262,144-token context (rope theta 5e6)."""
  return qwen3_4b().replace(max_position_embeddings=262_144,
                            rope=RopeConfig(theta=5_000_000.0))


def qwen3_8b() -> ModelConfig:
  """Qwen3 8B (8.19B parameters)."""
  return _qwen3(4096, 36, 32, 12_288)


def qwen3_14b() -> ModelConfig:
  """Qwen3 14B."""
  return _qwen3(5120, 40, 40, 17_408)


def qwen3_32b() -> ModelConfig:
  """Qwen3 32B (32.8B parameters)."""
  return _qwen3(5120, 64, 64, 25_600)


SPEC = FamilySpec(
    name='qwen3',
    description='Llama with per-head RMSNorm on queries and keys.',
    hf=Family('qwen3', ('qwen3',), 'Qwen3ForCausalLM', config_from_hf, config_to_hf,
              defaults={'max_position_embeddings': 32768}),
    differences={'attention': {'qk_norm': 'head'}},
    presets={'qwen3-0.6b': qwen3_0_6b, 'qwen3-1.7b': qwen3_1_7b, 'qwen3-4b': qwen3_4b,
             'qwen3-4b-thinking-2507': qwen3_4b_thinking_2507, 'qwen3-8b': qwen3_8b,
             'qwen3-14b': qwen3_14b, 'qwen3-32b': qwen3_32b},
    chat_template='chatml')

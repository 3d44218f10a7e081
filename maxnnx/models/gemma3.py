"""Gemma 3 (text): Gemma 2's block with per-head q/k norms, no soft-caps by
default, 5 local : 1 global layers, and a separate rotary base for local layers.

The 4B/12B/27B presets are the language model of the multimodal checkpoints
(``text_config``); their 262208-token vocabulary includes the image tokens.
"""

from maxnnx.config import ModelConfig, RopeConfig
from maxnnx.models import gemma
from maxnnx.models.gemma import GEMMA_DEFAULTS, gemma_fields
from maxnnx.models.gemma2 import SANDWICH_NORM_NAMES, sandwich_fields, sandwich_to_hf
from maxnnx.models.hf import Family, HFConfig, rope_to_hf
from maxnnx.models.registry import FamilySpec

# -- Hugging Face mapping ----------------------------------------------------------------------


def config_from_hf(hf: HFConfig) -> ModelConfig:
  fields = gemma_fields(hf)
  fields['rope'] = hf.rope('full_attention')
  if 'rope_parameters' in hf.data and 'sliding_attention' in hf.data['rope_parameters']:
    local_rope = hf.rope('sliding_attention')
  else:  # older configs: rope_local_base_freq, never scaled
    local_rope = fields['rope'].replace(theta=float(hf.get('rope_local_base_freq', 10_000.0)),
                                        scaling='none', factor=None)
  return ModelConfig(family='gemma3', **fields, **sandwich_fields(hf, 6), qk_norm='head',
                     local_rope=local_rope)


def config_to_hf(cfg: ModelConfig) -> dict:
  out = sandwich_to_hf(cfg, 'gemma3_text', 'Gemma3ForCausalLM')
  out['rope_parameters'] = {'full_attention': rope_to_hf(cfg.rope),
                            'sliding_attention': rope_to_hf(cfg.local_rope or cfg.rope)}
  return out


# -- Presets -----------------------------------------------------------------------------------

GLOBAL_ROPE_LONG = RopeConfig(theta=1_000_000.0, scaling='linear', factor=8.0)


def _gemma3(vocab_size: int, d_model: int, num_layers: int, num_heads: int, num_kv_heads: int,
            head_dim: int, mlp_dim: int, query_pre_attn_scalar: int, sliding_window: int,
            max_position_embeddings: int, rope: RopeConfig) -> ModelConfig:
  """A Gemma 3 config; layer ``i`` is global iff ``(i + 1) % 6 == 0``."""
  layer_types = tuple('full' if (i + 1) % 6 == 0 else 'sliding' for i in range(num_layers))
  return SPEC.config(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     mlp_dim=mlp_dim, max_position_embeddings=max_position_embeddings,
                     query_scale=query_pre_attn_scalar**-0.5, sliding_window=sliding_window,
                     layer_types=layer_types, rope=rope)


def gemma3_1b() -> ModelConfig:
  """Gemma 3 1B (text only, 32k context, unscaled global rope)."""
  return _gemma3(262_144, 1152, 26, 4, 1, 256, 6912, 256, 512, 32_768,
                 RopeConfig(theta=1_000_000.0))


def gemma3_4b() -> ModelConfig:
  """Gemma 3 4B (language model)."""
  return _gemma3(262_208, 2560, 34, 8, 4, 256, 10_240, 256, 1024, 131_072, GLOBAL_ROPE_LONG)


def gemma3_12b() -> ModelConfig:
  """Gemma 3 12B (language model)."""
  return _gemma3(262_208, 3840, 48, 16, 8, 256, 15_360, 256, 1024, 131_072, GLOBAL_ROPE_LONG)


def gemma3_27b() -> ModelConfig:
  """Gemma 3 27B (language model; queries scaled by 168 ** -0.5)."""
  return _gemma3(262_208, 5376, 62, 32, 16, 128, 21_504, 168, 1024, 131_072, GLOBAL_ROPE_LONG)


SPEC = FamilySpec(
    name='gemma3',
    description='Gemma with norms before and after each sub-block, per-head q/k norms, '
                '5 sliding-window layers per global one and a separate rotary base for them.',
    hf=Family('gemma3', ('gemma3_text',), 'Gemma3ForCausalLM', config_from_hf, config_to_hf,
              defaults={**GEMMA_DEFAULTS, 'sliding_window': 4096, 'rope_theta': 1_000_000.0,
                        'query_pre_attn_scalar': 256, 'max_position_embeddings': 131072},
              module_names=SANDWICH_NORM_NAMES),
    differences={**gemma.DIFFERENCES, 'post_norm': True, 'qk_norm': 'head',
                 'local_rope': {'theta': 10_000.0}},
    presets={'gemma3-1b': gemma3_1b, 'gemma3-4b': gemma3_4b, 'gemma3-12b': gemma3_12b,
             'gemma3-27b': gemma3_27b})

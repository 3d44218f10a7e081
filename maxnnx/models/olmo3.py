"""OLMo 3: OLMo 2 with three sliding-window layers for every full-attention one.

Architecture choices, all expressed as :class:`ModelConfig` fields:

* OLMo 2's block: norms after each sub-block only (``post_norm``), RMSNorm over the
  whole q and k projections (``attention.qk_norm='projection'``);
* layer ``i`` attends fully iff ``(i + 1) % 4 == 0``; the others see the last
  ``attention.sliding_window`` (4096) positions (``layer_types``);
* the released models extend their context with YaRN on the full-attention layers
  only (``rope``); sliding layers keep plain rotary at the same base (``local_rope``).

Checkpoints store OLMo 2's tensor names. transformers 5 writes ``rope_parameters``
per layer type; older configs give ``rope_theta`` + ``rope_scaling``, which
describe the full-attention layers, and sliding layers use the unscaled rotary at
``rope_theta``.
"""

from maxnnx.config import AttentionConfig, ModelConfig, RopeConfig
from maxnnx.models import olmo2
from maxnnx.models.hf import (
  Family,
  HFConfig,
  PretrainedError,
  common_to_hf,
  layer_types_to_hf,
  rope_to_hf,
)
from maxnnx.models.registry import FamilySpec

FULL_EVERY = 4  # layer i attends fully iff (i + 1) % FULL_EVERY == 0

# -- Hugging Face mapping ----------------------------------------------------------------------


def default_layer_types(num_layers: int) -> tuple[str, ...]:
  """OLMo 3's pattern: three sliding-window layers, then a full-attention one."""
  return tuple('full' if (i + 1) % FULL_EVERY == 0 else 'sliding' for i in range(num_layers))


def config_from_hf(hf: HFConfig) -> ModelConfig:
  if 'sliding_window' in hf.data and hf.data['sliding_window'] is None:
    raise PretrainedError(f'{hf.path}: sliding_window is null; OLMo 3 sliding layers need a '
                          'window (set sliding_window, or layer_types without sliding layers '
                          'in an OLMo 2 config).')
  fields = hf.common_fields()
  fields['rope'] = hf.rope('full_attention')
  params = hf.data.get('rope_parameters') or {}
  if 'sliding_attention' in params:
    local_rope = hf.rope('sliding_attention')
  else:  # older configs: rope_scaling extends the full-attention layers only
    local_rope = RopeConfig(theta=fields['rope'].theta)
  bias = bool(hf.get('attention_bias', False))
  return ModelConfig(
      family='olmo3', **fields, pre_norm=False, post_norm=True,
      attention=AttentionConfig(qk_norm='projection', qkv_bias=bias, out_bias=bias,
                                sliding_window=hf.require('sliding_window')),
      layer_types=hf.layer_types() or default_layer_types(hf.require('num_hidden_layers')),
      local_rope=None if local_rope == fields['rope'] else local_rope)


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'olmo3', 'Olmo3ForCausalLM'),
          'attention_bias': cfg.attention.qkv_bias,
          'sliding_window': cfg.attention.sliding_window, 'layer_types': layer_types_to_hf(cfg),
          'rope_parameters': {'full_attention': rope_to_hf(cfg.rope),
                              'sliding_attention': rope_to_hf(cfg.local_rope or cfg.rope)}}


# -- Presets -----------------------------------------------------------------------------------


def _olmo3(d_model: int, num_layers: int, num_heads: int, num_kv_heads: int,
           mlp_dim: int) -> ModelConfig:
  """An OLMo 3 release: 65,536-token context (YaRN x8 over 8,192 on full layers)."""
  return SPEC.config(vocab_size=100_278, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, mlp_dim=mlp_dim,
                     max_position_embeddings=65_536, layer_types=default_layer_types(num_layers),
                     eos_token_id=100_257, pad_token_id=100_277)


def olmo3_7b() -> ModelConfig:
  """OLMo 3 7B (Olmo-3-1025-7B, 7.30B parameters)."""
  return _olmo3(4096, 32, 32, 32, 11_008)


def olmo3_32b() -> ModelConfig:
  """OLMo 3 32B (Olmo-3-1125-32B, 32.2B parameters; grouped-query attention, 8 kv heads)."""
  return _olmo3(5120, 64, 40, 8, 27_648)


SPEC = FamilySpec(
    name='olmo3',
    description='OLMo 2 (norms after each sub-block, RMSNorm over the whole q and k '
                'projections) with three sliding-window layers per full-attention one, and '
                'YaRN on the full-attention layers only.',
    hf=Family('olmo3', ('olmo3',), 'Olmo3ForCausalLM', config_from_hf, config_to_hf,
              defaults={'rms_norm_eps': 1e-5, 'max_position_embeddings': 2048,
                        'rope_theta': 500_000.0, 'sliding_window': 4096},
              module_names=olmo2.SPEC.hf.module_names),
    differences={'pre_norm': False, 'post_norm': True,
                 'attention': {'qk_norm': 'projection', 'sliding_window': 4096},
                 'rope': {'theta': 500_000.0, 'scaling': 'yarn', 'factor': 8.0,
                          'original_max_position_embeddings': 8192},
                 'local_rope': {'theta': 500_000.0}},
    presets={'olmo3-7b': olmo3_7b, 'olmo3-32b': olmo3_32b})

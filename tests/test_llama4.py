"""Llama 4 (text) beyond the parity fixture: Hub configs, export, and the scanned layout.

``tests/fixtures/hf/llama4`` (``make_moe_fixtures.py llama4``) pins the logits, greedy
generation and round trip against transformers in ``test_hf_parity.py``; it interleaves
dense and MoE layers, which only the list layout holds. These tests cover the rest.
"""


import numpy as np
import pytest
from conftest import export_and_compare
from flax import nnx

import maxnnx
from maxnnx.config import VisionConfig
from maxnnx.models.hf import HFConfig
from maxnnx.models.registry import specs

LLAMA4 = specs()['llama4']

# The text model of meta-llama/Llama-4-Scout-17B-16E as its config.json spells it (the
# pre-transformers-5 layout, nested under text_config there).
SCOUT_TEXT_CONFIG = {
    'model_type': 'llama4_text', 'attention_bias': False, 'attention_chunk_size': 8192,
    'attn_scale': 0.1, 'attn_temperature_tuning': 4, 'bos_token_id': 200000,
    'eos_token_id': [200001, 200007, 200008], 'floor_scale': 8192, 'head_dim': 128,
    'hidden_act': 'silu', 'hidden_size': 5120, 'interleave_moe_layer_step': 1,
    'intermediate_size': 8192, 'intermediate_size_mlp': 16384,
    'max_position_embeddings': 10485760, 'num_attention_heads': 40, 'num_experts_per_tok': 1,
    'num_hidden_layers': 48, 'num_key_value_heads': 8, 'num_local_experts': 16,
    'pad_token_id': 200018, 'rms_norm_eps': 1e-05,
    'rope_scaling': {'factor': 16.0, 'high_freq_factor': 1.0, 'low_freq_factor': 1.0,
                     'original_max_position_embeddings': 8192, 'rope_type': 'llama3'},
    'rope_theta': 500000.0, 'use_qk_norm': True, 'vocab_size': 202048,
}


# The Hub's vision_config of Scout and Maverick (transformers 4.51 layout: rope_theta).
HUB_VISION_CONFIG = {
    'attention_dropout': 0.0, 'hidden_act': 'gelu', 'hidden_size': 1408, 'image_size': 336,
    'initializer_range': 0.02, 'intermediate_size': 5632, 'model_type': 'llama4_vision_model',
    'multi_modal_projector_bias': False, 'norm_eps': 1e-05, 'num_attention_heads': 16,
    'num_channels': 3, 'num_hidden_layers': 34, 'patch_size': 14, 'pixel_shuffle_ratio': 0.5,
    'projector_dropout': 0.0, 'projector_input_dim': 4096, 'projector_output_dim': 4096,
    'rope_theta': 10000, 'vision_feature_layer': -1, 'vision_feature_select_strategy': 'default',
    'vision_output_dim': 4096,
}


def _multimodal(text: dict) -> HFConfig:
  return HFConfig({'model_type': 'llama4', 'text_config': text, 'vision_config': HUB_VISION_CONFIG,
                   'image_token_index': 200092, 'boi_token_index': 200080,
                   'eoi_token_index': 200081}, 'config.json', LLAMA4.hf.defaults)


def test_the_scout_hub_config_is_the_scout_preset():
  """Every field the Hub config implies (NoPE every 4th layer, chunked others, all MoE,
  Scout's equal-factor llama3 rope, the vision tower) equals the preset; its text_config
  alone is the preset's text model."""
  cfg = LLAMA4.hf.config_from_hf(_multimodal(SCOUT_TEXT_CONFIG))
  assert cfg == maxnnx.get_preset('llama4-17b-16e')
  assert cfg.attention.nope_layers == tuple(range(3, 48, 4)) and all(cfg.moe_layers)
  text = LLAMA4.hf.config_from_hf(HFConfig(SCOUT_TEXT_CONFIG, 'config.json', LLAMA4.hf.defaults))
  assert text == cfg.replace(vision=VisionConfig())
  maverick = dict(SCOUT_TEXT_CONFIG, num_local_experts=128, interleave_moe_layer_step=2,
                  use_qk_norm=False, rope_scaling=None, max_position_embeddings=1048576)
  cfg = LLAMA4.hf.config_from_hf(_multimodal(maverick))
  assert cfg == maxnnx.get_preset('llama4-17b-128e')
  assert cfg.moe_layers == tuple(i % 2 == 1 for i in range(48))


def test_export_writes_the_transformers_tensors_and_config(tmp_path):
  """save_pretrained gives back the fixture's tensors (gate_up_proj fused again) and a
  config.json transformers reads as the same model."""
  theirs, ours = export_and_compare('llama4', tmp_path)
  for key in ('moe_layers', 'no_rope_layers', 'layer_types', 'attention_chunk_size',
              'floor_scale', 'attn_scale', 'use_qk_norm', 'intermediate_size',
              'intermediate_size_mlp', 'num_local_experts', 'num_experts_per_tok',
              'rope_parameters', 'head_dim'):
    assert ours[key] == theirs[key], key


def _all_moe_tiny():
  """tiny-llama4 with every layer MoE (as in Scout): a layout the scanned stack holds."""
  return maxnnx.get_preset('tiny-llama4', moe={'first_k_dense_layers': 0, 'layer_step': 1},
                           **{'attention.chunk_size': 6, 'attention.temperature_floor': 3.0},
                           initializer_range=0.5)


@pytest.mark.slow  # ~30 s
def test_a_scanned_stack_mixing_nope_and_rotary_layers_equals_the_list(tmp_path):
  """Scanned, the NoPE flag is traced per layer; logits and greedy decoding (KV cache,
  chunks shorter than the text) equal the list layout's."""
  listed = maxnnx.Transformer(_all_moe_tiny(), rngs=nnx.Rngs(7))
  for _, var in nnx.iter_graph(listed):  # norms away from 1 so that dropping one shows
    if isinstance(var, nnx.Param) and var.ndim == 1:
      var[...] = var[...] + 0.2 * np.random.default_rng(0).normal(size=var.shape)
  maxnnx.save_pretrained(listed, str(tmp_path))
  scanned = maxnnx.from_pretrained(str(tmp_path), scan_layers=True)
  ids = np.random.default_rng(1).integers(0, 512, (2, 20))
  np.testing.assert_allclose(np.asarray(scanned(ids)), np.asarray(listed(ids)), rtol=1e-5,
                             atol=1e-5)
  want = maxnnx.generate(listed, ids[:1, :9], max_new_tokens=10, eos_ids=None).tokens
  got = maxnnx.generate(scanned, ids[:1, :9], max_new_tokens=10, eos_ids=None).tokens
  np.testing.assert_array_equal(got, want)
  assert len(set(want[0].tolist())) > 2


@pytest.mark.parametrize('change,match', [
    ({'attention.nope_layers': (4,)}, 'nope_layers'),
    (dict(layer_types=('chunked',) * 4, **{'attention.chunk_size': None}), 'attention.chunk_size'),
    ({'attention.chunk_size': 0}, 'attention.chunk_size'),
])
def test_bad_llama4_settings_are_clear_errors(change, match):
  with pytest.raises(maxnnx.ConfigError, match=match):
    maxnnx.get_preset('tiny-llama4', **change)

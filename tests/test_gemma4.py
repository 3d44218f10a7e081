"""Gemma 4 (text) beyond the parity fixtures: Hub configs, export, rotary, refusals.

``tests/fixtures/hf/gemma4`` (``make_fixtures.py gemma4``: wider global layers whose values
are their keys, proportional rope, value norms, layer scalars), ``gemma4_moe``
(``make_moe_fixtures.py gemma4_moe``: experts beside the dense MLP) and ``gemma4_small``
(per-layer inputs, keys/values shared across layers, doubled MLPs) pin logits, greedy
generation and round trips against transformers in ``test_hf_parity.py``.
"""

import json
import os

import numpy as np
import pytest
from conftest import FIXTURES, export_and_compare
from flax import nnx

import maxnnx
from maxnnx.config import RopeConfig
from maxnnx.layers.attention import Attention
from maxnnx.layers.rope import RotaryEmbedding, apply_rope
from maxnnx.models.hf import HFConfig
from maxnnx.models.registry import specs

GEMMA4 = specs()['gemma4']

# gemma-4-31B's text model with the shapes of MaxText's gemma4-31b.yml, spelt as the Hub
# release spells them (global_head_dim / num_global_key_value_heads, no layer_types).
HUB_31B = {
    'model_type': 'gemma4_text', 'vocab_size': 262144, 'hidden_size': 5376,
    'intermediate_size': 21504, 'num_hidden_layers': 60, 'num_attention_heads': 32,
    'num_key_value_heads': 16, 'head_dim': 256, 'global_head_dim': 512,
    'num_global_key_value_heads': 4, 'attention_k_eq_v': True, 'sliding_window': 1024,
    'final_logit_softcapping': 30.0, 'max_position_embeddings': 262144,
    'hidden_activation': 'gelu_pytorch_tanh', 'rms_norm_eps': 1e-6,
    'hidden_size_per_layer_input': 0, 'num_kv_shared_layers': 0, 'enable_moe_block': False,
    'tie_word_embeddings': True, 'bos_token_id': 2, 'eos_token_id': 1, 'pad_token_id': 0,
    'rope_parameters': {
        'full_attention': {'rope_type': 'proportional', 'partial_rotary_factor': 0.25,
                           'rope_theta': 1000000.0},
        'sliding_attention': {'rope_type': 'default', 'rope_theta': 10000.0}},
}


def _from_hub(data):
  return GEMMA4.hf.config_from_hf(HFConfig(data, 'config.json', GEMMA4.hf.defaults))


def test_hub_configs_are_the_presets():
  """The 31B and 26B-A4B configs (the last layer forced global, 5:1 pattern) are the presets."""
  cfg = _from_hub(HUB_31B)
  assert cfg == maxnnx.get_preset('gemma4-31b')
  assert cfg.attention_shape('full') == (512, 4, True)
  assert cfg.attention_shape('sliding') == (256, 16, False)
  assert cfg.layer_types.count('full') == 10 and cfg.layer_types[-1] == 'full'
  moe = dict(HUB_31B, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
             num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
             enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704)
  assert _from_hub(moe) == maxnnx.get_preset('gemma4-26b-a4b')


def test_global_layers_have_their_own_shapes():
  """Full layers: wider heads, one projection for keys and values; sliding layers: both."""
  model = maxnnx.from_pretrained(os.path.join(FIXTURES, 'gemma4'))
  sliding, full = model.layers[0].attn, model.layers[1].attn
  assert sliding.k_proj.out_shape == (2, 16) and sliding.v_proj is not None
  assert full.k_proj.out_shape == (1, 32) and full.v_proj is None
  assert full.q_proj.out_shape == (4, 32)
  moe = maxnnx.from_pretrained(os.path.join(FIXTURES, 'gemma4_moe'))
  assert moe.layers[1].attn.v_proj.out_shape == (2, 32)  # no k_eq_v: the model's kv heads
  assert moe.layers[0].moe is not None and moe.layers[0].mlp.up_proj.kernel.shape == (64, 48)


@pytest.mark.parametrize('case', ['gemma4', 'gemma4_moe', 'gemma4_small'])
def test_export_writes_the_transformers_tensors_and_config(case, tmp_path):
  """save_pretrained gives back every tensor of the fixture (MoE tensors renamed and
  gate_up_proj fused again) and the keys transformers builds the global layers from."""
  _, ours = export_and_compare(case, tmp_path)
  with open(os.path.join(FIXTURES, case, 'legacy', 'config.json')) as f:
    theirs = json.load(f)
  for key in ('global_head_dim', 'attention_k_eq_v', 'layer_types', 'rope_parameters',
              'enable_moe_block', 'num_experts', 'top_k_experts', 'moe_intermediate_size',
              'final_logit_softcapping', 'sliding_window', 'hidden_size_per_layer_input',
              'num_kv_shared_layers', 'use_double_wide_mlp'):
    assert ours.get(key) == theirs.get(key), key
  assert ours.get('num_global_key_value_heads') == theirs.get('num_global_key_value_heads')


def test_proportional_rope_matches_a_float64_reference():
  """Proportional rope (full-width rotation, only the first quarter of the pairs turning, at
  their full-width frequencies, divided by the factor) against NumPy float64."""
  head_dim, theta, factor = 32, 1e5, 2.0
  rope = RotaryEmbedding.from_config(
      RopeConfig(theta=theta, scaling='proportional', partial_rotary_factor=0.25,
                 factor=factor), head_dim, 64)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 7, 3, head_dim))
  positions = rng.integers(0, 60, (2, 7))
  ours = np.asarray(apply_rope(x.astype(np.float32), *rope.cos_sin(positions)))
  half = head_dim // 2
  inv_freq = np.zeros(half)
  inv_freq[:4] = theta ** (-np.arange(0, 8, 2) / head_dim) / factor
  angles = positions[..., None, None] * inv_freq  # [B, T, 1, half]
  x1, x2 = x[..., :half], x[..., half:]
  want = np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles),
                         x2 * np.cos(angles) + x1 * np.sin(angles)], -1)
  np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)
  assert np.allclose(ours[..., 4:half], x[..., 4:half], atol=1e-6)  # still pairs pass through


def test_values_from_keys_and_value_norm():
  """values = unit-RMS(k_proj(x)) per head, no weight; keys are then normed and rotated."""
  cfg = maxnnx.get_preset('tiny-gemma4', initializer_range=0.5)
  attn = Attention(cfg, rngs=nnx.Rngs(0), layer_type='full')
  x = np.random.default_rng(1).normal(size=(2, 5, cfg.d_model)).astype(np.float32)
  k, v = attn._keys_values(x)
  raw = np.asarray(attn.k_proj(x), np.float64)
  want = raw / np.sqrt(np.mean(raw**2, axis=-1, keepdims=True) + cfg.norm_eps)
  np.testing.assert_allclose(np.asarray(v), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(k), np.asarray(attn.k_proj(x)))


def test_the_vision_models_bidirectional_attention_is_refused_by_name():
  with pytest.raises(maxnnx.PretrainedError, match='use_bidirectional_attention'):
    _from_hub(dict(HUB_31B, use_bidirectional_attention='vision'))


def test_a_config_without_per_layer_inputs_key_means_the_default_256():
  """transformers' default hidden_size_per_layer_input is 256 (as in E2B/E4B)."""
  data = {k: v for k, v in HUB_31B.items() if k != 'hidden_size_per_layer_input'}
  assert _from_hub(data).per_layer_input_dim == 256


def test_the_e2b_and_e4b_hub_configs_are_the_presets():
  """Period-5 (E2B) and period-6 (E4B) layer patterns, per-layer inputs of 256, the last 20 /
  18 layers sharing keys and values (E2B's with doubled MLPs)."""
  e2b = dict(HUB_31B, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35,
             num_attention_heads=8, num_key_value_heads=1, attention_k_eq_v=False,
             sliding_window=512, max_position_embeddings=131072,
             hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
             num_kv_shared_layers=20, use_double_wide_mlp=True,
             layer_types=['full_attention' if (i + 1) % 5 == 0 else 'sliding_attention'
                          for i in range(35)])
  del e2b['num_global_key_value_heads']
  cfg = _from_hub(e2b)
  assert cfg == maxnnx.get_preset('gemma4-e2b')
  assert cfg.kv_donors == (None,) * 15 + tuple(14 if (i + 1) % 5 == 0 else 13
                                               for i in range(15, 35))
  e4b = dict(e2b, hidden_size=2560, intermediate_size=10240, num_hidden_layers=42,
             num_key_value_heads=2, num_kv_shared_layers=18, use_double_wide_mlp=False,
             layer_types=['full_attention' if (i + 1) % 6 == 0 else 'sliding_attention'
                          for i in range(42)])
  assert _from_hub(e4b) == maxnnx.get_preset('gemma4-e4b')


def test_kv_sharing_layers_have_no_keys_values_or_cache_of_their_own():
  model = maxnnx.from_pretrained(os.path.join(FIXTURES, 'gemma4_small'))
  assert model.config.kv_donors == (None, None, None, 1, 2, 1)
  for i, block in enumerate(model.layers):
    assert (block.attn.k_proj is None) == (i >= 3)
    assert block.mlp.up_proj.kernel.shape == (64, 192 if i >= 3 else 96)
  model.init_cache(1, 16)
  assert model.layers[3].attn.cache_k is None and model.layers[2].attn.cache_k is not None


@pytest.mark.parametrize('change,match', [
    ({'runtime.scan_layers': True}, 'scan_layers'),
    (dict(layer_types=('full',) * 4, **{'runtime.scan_layers': True}, per_layer_input_dim=8),
     'scan_layers'),
    (dict(layer_types=('sliding', 'sliding', 'full', 'full'), num_kv_shared_layers=2),
     "type \\['full'\\]"),
    (dict(num_kv_shared_layers=4), 'num_kv_shared_layers'),
    (dict(layer_types=('chunked', 'full') * 2, **{'attention.chunk_size': 4}), 'chunked'),
    ({'attention.global_layers': {'num_kv_heads': 3}}, 'num_kv_heads'),
    ({'attention.global_layers': {'head_dim': 0}}, 'head_dim'),
])
def test_bad_global_attention_settings_are_clear_errors(change, match):
  with pytest.raises(maxnnx.ConfigError, match=match):
    maxnnx.get_preset('tiny-gemma4', **change)


@pytest.mark.slow  # ~20 s
def test_a_scanned_stack_of_global_layers_only_equals_the_list():
  """All-full stacks have one shape: they scan, with the same logits."""
  cfg = maxnnx.get_preset('tiny-gemma4', layer_types=('full',) * 4, initializer_range=0.3)
  listed = maxnnx.Transformer(cfg, rngs=nnx.Rngs(3))
  scanned = maxnnx.Transformer(cfg.replace(**{'runtime.scan_layers': True}), rngs=nnx.Rngs(3))
  flat = dict(nnx.to_flat_state(nnx.state(listed, nnx.Param)))
  state = nnx.state(scanned, nnx.Param)
  for path, var in nnx.to_flat_state(state):
    if path[0] == 'layers':
      var[...] = np.stack([np.asarray(flat[('layers', i, *path[1:])][...]) for i in range(4)])
    else:
      var[...] = flat[path][...]
  nnx.update(scanned, state)
  ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 12))
  # Logits reach about 7 here: float32 sums in another order differ by ~1e-5 on some CPUs
  # (1.27e-5 in one of 12,288 on an AMD EPYC, before and after the attention group).
  np.testing.assert_allclose(np.asarray(scanned(ids)), np.asarray(listed(ids)), rtol=1e-5,
                             atol=5e-5)

"""GPT-OSS loading rules beyond logit parity (tests/test_hf_parity.py covers those):
config.json variants, and checkpoints that must be refused with a clear error."""

import json
import os

import numpy as np
import pytest

import maxnnx
from maxnnx.checkpoint.safetensors import read_safetensors, write_safetensors

GATE_UP = 'model.layers.0.mlp.experts.gate_up_proj'  # [experts, hidden, 2 * intermediate]


def _edit_config(path, drop=(), **changes):
  with open(os.path.join(path, 'config.json')) as f:
    data = json.load(f)
  for key in drop:
    data.pop(key, None)
  data.update(changes)
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(data, f)


def _edit_tensors(path, edit):
  file = os.path.join(path, 'model.safetensors')
  tensors = {k: np.array(v) for k, v in read_safetensors(file).items()}
  edit(tensors)
  write_safetensors(file, tensors)


def test_hub_config_defaults(checkpoint_copy):
  """Keys a config leaves out take transformers' GptOssConfig defaults."""
  path = checkpoint_copy('gpt_oss')
  _edit_config(path, drop=('rope_parameters', 'layer_types', 'sliding_window', 'swiglu_limit',
                           'swiglu_alpha', 'attention_bias'))
  cfg = maxnnx.config_from_pretrained(path)
  assert cfg.layer_types == ('sliding', 'full', 'sliding', 'full')
  attention = cfg.attention
  assert attention.sliding_window == 128 and cfg.moe.swiglu_limit == 7.0
  assert cfg.moe.swiglu_alpha == 1.702 and cfg.moe.router_bias
  assert attention.qkv_bias and attention.out_bias and attention.sinks
  rope = cfg.rope
  assert (rope.scaling, rope.theta, rope.factor, rope.original_max_position_embeddings,
          rope.beta_fast, rope.beta_slow, rope.truncate) == ('yarn', 150_000.0, 32.0, 4096,
                                                             32.0, 1.0, False)


def test_null_sliding_window_means_full_attention(checkpoint_copy):
  path = checkpoint_copy('gpt_oss')
  _edit_config(path, sliding_window=None)
  assert maxnnx.config_from_pretrained(path).resolved_layer_types == ('full',) * 4


def test_a_quantization_config_over_float_weights_is_refused(checkpoint_copy):
  """config.json says MXFP4 but no tensor is stored quantized: refused before loading, unless
  the config also says the weights were saved dequantized (transformers' ``dequantize``)."""
  path = checkpoint_copy('gpt_oss')
  _edit_config(path, quantization_config={'quant_method': 'mxfp4'})
  with pytest.raises(maxnnx.PretrainedError,
                     match=r"quant_method 'mxfp4' but no tensor is stored quantized"):
    maxnnx.from_pretrained(path)
  _edit_config(path, quantization_config={'quant_method': 'mxfp4', 'dequantize': True})
  assert maxnnx.from_pretrained(path).config.moe.num_experts == 8


def test_mxfp4_tensors_without_a_quantization_config_are_refused(checkpoint_copy):
  """Packed ``*_blocks``/``*_scales`` experts with no quantization_config are named."""
  path = checkpoint_copy('gpt_oss')

  def quantize(tensors):
    e, d, f2 = tensors.pop(GATE_UP).shape
    tensors[GATE_UP + '_blocks'] = np.zeros((e, f2, d // 32, 16), np.uint8)
    tensors[GATE_UP + '_scales'] = np.zeros((e, f2, d // 32), np.uint8)

  _edit_tensors(path, quantize)
  with pytest.raises(maxnnx.PretrainedError,
                     match=rf"tensor '{GATE_UP}_blocks' is quantized .* no quantization_config"):
    maxnnx.from_pretrained(path)


def test_experts_stored_out_by_in_are_refused(checkpoint_copy):
  """down_proj as [experts, hidden, intermediate] (a Linear's out x in) is named."""
  path = checkpoint_copy('gpt_oss')
  down = 'model.layers.1.mlp.experts.down_proj'
  _edit_tensors(path, lambda t: t.update({down: np.ascontiguousarray(t[down].transpose(0, 2, 1))}))
  with pytest.raises(maxnnx.PretrainedError,
                     match=rf"tensor '{down}' has shape \(8, 64, 32\), the config implies "
                           r'\(8, 32, 64\) \(transformers layout: experts, in, out\)'):
    maxnnx.from_pretrained(path)

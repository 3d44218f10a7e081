"""Quantized releases (block-wise FP8, MXFP4, compressed-tensors) load, check and save back.

The fixtures (``tests/hf_parity/make_quantized_fixtures.py``) are laid out as the
releases are: three shards with every scale in another file than its weight,
partial fp8 blocks, float32 and bfloat16 scales. Their reference logits are
transformers' float32 model on weights dequantized in torch by each format's
rule, so a loader that ignored a scale or guessed a block size fails here.
"""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from conftest import FIXTURES, reference, rel_error
from flax import nnx

import maxnnx
from maxnnx.checkpoint.quantized import dequantize_checkpoint, quantize_fp8_blocks, unpack_int32
from maxnnx.checkpoint.safetensors import read_safetensors, read_safetensors_dir, write_safetensors
from maxnnx.inference.quantize import param_bytes, quantize_for_inference
from maxnnx.models.hf import hf_layer_path
from maxnnx.models.registry import FAMILIES

QUANTIZED = os.path.join(FIXTURES, 'quantized')
CASES = {'deepseek_v3_fp8': 'deepseek_v3', 'qwen3_fp8': 'qwen3', 'gpt_oss_mxfp4': 'gpt_oss',
         'llama_ct_fp8_channel': 'llama', 'mistral_ct_fp8_tensor': 'mistral',
         'qwen2_ct_w4a16': 'qwen2', 'llama_fbgemm_fp8': 'llama'}
REL_TOL = 1e-4


def _reference(case):
  with np.load(os.path.join(QUANTIZED, case, 'reference.npz')) as data:
    return dict(data)


@pytest.mark.parametrize('case,scan', [(case, False) for case in CASES]
                         + [('deepseek_v3_fp8', True)])
def test_logits_match_transformers_on_the_dequantized_weights(case, scan):
  """float32 logits equal transformers' (rel 1e-4), also loaded into scanned stacks;
  quantizing moved them far more than that, so the scales, block sizes and packing count."""
  ref = _reference(case)
  unquantized = reference(CASES[case])['logits']
  assert rel_error(unquantized, ref['logits']) > 30 * REL_TOL  # the fixture bites
  model = maxnnx.from_pretrained(os.path.join(QUANTIZED, case), dtype='float32',
                                 scan_layers=scan)
  assert rel_error(model(ref['input_ids']), ref['logits']) < REL_TOL


def _copy(case, tmp_path):
  directory = tmp_path / case
  shutil.copytree(os.path.join(QUANTIZED, case), directory)
  return directory


@pytest.mark.parametrize('case,extra', [('deepseek_v3_fp8', {}),
                                        ('qwen3_fp8', {'scale_dtype': 'bfloat16'}),
                                        ('gpt_oss_mxfp4', {})])
def test_save_in_the_release_format_gives_back_every_byte(case, extra, tmp_path):
  """Load (dequantized to float32), save in the same format: every quantized tensor and scale
  is byte-identical to the release's, and transformers' config keeps its quantization_config."""
  source = os.path.join(QUANTIZED, case)
  with open(os.path.join(source, 'config.json')) as f:
    quant = json.load(f)['quantization_config']
  model = maxnnx.from_pretrained(source, dtype='float32')
  maxnnx.save_pretrained(model, str(tmp_path), quantization_config={**quant, **extra})
  original, saved = read_safetensors_dir(source), read_safetensors_dir(str(tmp_path))
  assert sorted(saved) == sorted(original)
  quantized = [n for n in original if n.endswith(('_scale_inv', '_blocks', '_scales'))]
  quantized += [n.removesuffix('_scale_inv') for n in quantized if n.endswith('_scale_inv')]
  assert len(quantized) >= 6
  for name in quantized:
    a, b = original[name][1], saved[name][1]
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert a.tobytes() == b.tobytes(), name
  with open(tmp_path / 'config.json') as f:
    assert json.load(f)['quantization_config']['quant_method'] == quant['quant_method']
  again = maxnnx.from_pretrained(str(tmp_path), dtype='float32')
  ref = _reference(case)
  assert rel_error(again(ref['input_ids']), ref['logits']) < REL_TOL


def test_fp8_scales_are_a_blocks_largest_magnitude_over_448():
  """Fresh weights: every block's scale is amax / 448 within an ulp, codes within fp8 rounding,
  partial blocks included."""
  rng = np.random.default_rng()
  values = rng.normal(size=(2, 37, 50)).astype(np.float32)
  weight, scale = quantize_fp8_blocks(values, (16, 24))
  assert weight.shape == values.shape and scale.shape == (2, 3, 3)
  amax = np.abs(values[0, 32:, 48:]).max()  # the last, partial block
  np.testing.assert_allclose(scale[0, 2, 2], amax / 448, rtol=3e-7)
  deq = weight.astype(np.float32) * np.repeat(np.repeat(scale, 16, 1)[:, :37], 24, 2)[..., :50]
  np.testing.assert_allclose(deq, values, atol=float(scale.max()) * 16)


def test_int4_unpacking_reads_the_packed_bit_stream():
  """Values -8..7 stored plus 8, little-endian nibbles, a row across several words."""
  rng = np.random.default_rng()
  values = rng.integers(-8, 8, size=(3, 24))
  unsigned = (values + 8).astype(np.uint64)
  words = np.zeros((3, 3), np.uint64)
  for i in range(24):
    words[:, i // 8] |= unsigned[:, i] << np.uint64(4 * (i % 8))
  np.testing.assert_array_equal(unpack_int32(words.astype(np.uint32).view(np.int32), 4, 24),
                                values)


def _drop_tensor(directory, name):
  """Rewrite the shard holding ``name`` without it (the index keeps naming it, as a user's
  hand-edited checkpoint would not: drop it there too)."""
  index_path = directory / 'model.safetensors.index.json'
  index = json.loads(index_path.read_text())
  shard = directory / index['weight_map'].pop(name)
  tensors = {k: np.array(v) for k, v in read_safetensors(str(shard)).items() if k != name}
  write_safetensors(str(shard), tensors)
  index_path.write_text(json.dumps(index))


def test_a_weight_whose_scale_was_deleted_is_refused(tmp_path):
  """The fp8 weight stays, its weight_scale_inv is gone, config.json still says fp8: refused,
  naming the tensor (the old loader ran it with logits off by several units)."""
  directory = _copy('deepseek_v3_fp8', tmp_path)
  name = 'model.layers.1.self_attn.o_proj.weight'
  _drop_tensor(directory, name + '_scale_inv')
  with pytest.raises(maxnnx.PretrainedError, match=rf"'{name}_scale_inv' is missing"):
    maxnnx.from_pretrained(str(directory))


def test_every_scale_deleted_and_the_config_removed_is_refused_too(tmp_path):
  """float8 weights with no quantization_config are not read as plain floats."""
  directory = _copy('qwen3_fp8', tmp_path)
  config = json.loads((directory / 'config.json').read_text())
  del config['quantization_config']
  (directory / 'config.json').write_text(json.dumps(config))
  with pytest.raises(maxnnx.PretrainedError, match='no quantization_config'):
    maxnnx.from_pretrained(str(directory))


@pytest.mark.parametrize('change,message', [
    ({'weight_block_size': [16, 16]}, r'in blocks of \[16, 16\] \(weight_block_size\) needs'),
    ({'weight_block_size': None}, 'weight_block_size is None'),
    ({'quant_method': 'gptq'}, "quant_method 'gptq' is not a format maxnnx reads"),
])
def test_a_quantization_config_that_does_not_fit_is_refused(tmp_path, change, message):
  directory = _copy('deepseek_v3_fp8', tmp_path)
  config = json.loads((directory / 'config.json').read_text())
  config['quantization_config'].update(change)
  (directory / 'config.json').write_text(json.dumps(config))
  with pytest.raises(maxnnx.PretrainedError, match=message):
    maxnnx.from_pretrained(str(directory))


def test_mxfp4_blocks_without_scales_are_refused(tmp_path):
  directory = _copy('gpt_oss_mxfp4', tmp_path)
  _drop_tensor(directory, 'model.layers.0.mlp.experts.down_proj_scales')
  with pytest.raises(maxnnx.PretrainedError, match="has no 'model.layers.0.mlp.experts.down_proj"
                                                    "_scales'"):
    maxnnx.from_pretrained(str(directory))


KEPT = {'deepseek_v3_fp8': 'float8_e4m3fn', 'qwen3_fp8': 'float8_e4m3fn',
        'llama_ct_fp8_channel': 'float8_e4m3fn', 'mistral_ct_fp8_tensor': 'float8_e4m3fn',
        'qwen2_ct_w4a16': 'int4', 'llama_fbgemm_fp8': 'float8_e4m3fn'}


def kept_module_mode(model, path):
  module = model
  for key in path[:-1]:
    module = module[key] if isinstance(key, int) else getattr(module, key)
  return module.inference_quantization


def _kept_kernels(model):
  return {path: var[...] for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
          if isinstance(var[...], qwix.QArray)}


@pytest.mark.parametrize('case', list(KEPT))
def test_kept_quantized_kernels_are_the_stored_values_and_give_the_dequantized_logits(case):
  """keep_quantized=True: every linear weight the release stores quantized becomes a QArray
  whose values are the file's own (bit for bit, transposed into the kernel) and whose scales,
  spread over the kernel's axes, give back exactly the float32 weight a dequantizing load
  holds. The model then computes with the same float32 kernels, so the logits equal the
  dequantizing load's (rel 1e-6 leaves room for a backend that orders the matmul's sums
  otherwise; on CPU they are equal bit for bit), and the kernels take 1 byte (int4: half a
  byte) per value plus their scales instead of 4."""
  directory = os.path.join(QUANTIZED, case)
  ref = _reference(case)
  plain = maxnnx.from_pretrained(directory, dtype='float32')
  kept = maxnnx.from_pretrained(directory, dtype='float32', keep_quantized=True)
  cfg = kept.config
  tensors = dequantize_checkpoint(read_safetensors_dir(directory),
                                  json.loads(open(os.path.join(directory, 'config.json')).read())
                                  ['quantization_config'], 'config.json')
  kernels = {path: q for path, q in _kept_kernels(kept).items() if path[-1] == 'kernel'}
  names = {FAMILIES[cfg.family].hf_name(hf_layer_path(path, cfg.num_layers)) for path in kernels}
  # every linear weight stored quantized is kept (routed experts: see the experts test)
  assert names == {n for n, (_, a) in tensors.items() if getattr(a, 'stored', None) is not None
                   and '.mlp.experts.' not in n}
  assert len(names) >= 7
  plain_params = dict(nnx.to_flat_state(nnx.state(plain, nnx.Param)))
  float_bytes = quantized_bytes = 0
  for path, qarray in kernels.items():
    name = FAMILIES[cfg.family].hf_name(hf_layer_path(path, cfg.num_layers))
    assert kept_module_mode(kept, path) == ('int4' if KEPT[case] == 'int4' else 'fp8')
    assert str(qarray.qvalue.dtype) == KEPT[case], path
    values = tensors[name][1].stored.values(slice(None))
    in_size = int(np.prod(values.shape[1:]))
    np.testing.assert_array_equal(np.asarray(qarray.qvalue).reshape(in_size, -1).T
                                  .astype(np.float32), values.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(qwix.dequantize(qarray)),
                                  np.asarray(plain_params[path][...]))
    float_bytes += 4 * qarray.qvalue.size
    quantized_bytes += qarray.qvalue.size * (0.5 if KEPT[case] == 'int4' else 1)
    quantized_bytes += qarray.scale.size * 4
  assert quantized_bytes < (0.2 if KEPT[case] == 'int4' else 0.3) * float_bytes
  experts = {path: q for path, q in _kept_kernels(kept).items() if path[-1] != 'kernel'}
  float_bytes += sum(4 * q.qvalue.size for q in experts.values())
  quantized_bytes += sum(q.qvalue.size + 4 * q.scale.size for q in experts.values())
  assert param_bytes(plain) - param_bytes(kept) == float_bytes - quantized_bytes
  logits = np.asarray(kept(ref['input_ids']))
  assert rel_error(logits, plain(ref['input_ids'])) < 1e-6
  assert rel_error(logits, ref['logits']) < REL_TOL


def test_kept_quantized_scanned_stacks_hold_every_layers_values():
  """Scanned stacks hold each layer's stored values and scales along their leading axis, with
  the DeepSeek fixture's partial fp8 blocks of 16 x 24."""
  directory = os.path.join(QUANTIZED, 'deepseek_v3_fp8')
  ref = _reference('deepseek_v3_fp8')
  kept = maxnnx.from_pretrained(directory, dtype='float32', scan_layers=True,
                                keep_quantized=True)
  plain = maxnnx.from_pretrained(directory, dtype='float32', scan_layers=True)
  kernels = _kept_kernels(kept)
  assert any(q.qvalue.ndim >= 3 and q.scale.shape[0] == q.qvalue.shape[0] > 1
             for q in kernels.values())
  plain_params = dict(nnx.to_flat_state(nnx.state(plain, nnx.Param)))
  for path, qarray in kernels.items():
    np.testing.assert_array_equal(np.asarray(qwix.dequantize(qarray)),
                                  np.asarray(plain_params[path][...]))
  assert rel_error(kept(ref['input_ids']), plain(ref['input_ids'])) < 1e-6


def test_kept_quantized_experts_are_each_experts_stored_values_and_scales():
  """DeepSeek's per-expert fp8 weights (blocks of 16 x 24, partial ones included) become one
  ``[experts, in, out]`` QArray per projection: expert ``e``'s values are its stored ones,
  transposed, bit for bit, the scales give back the float32 weights a dequantizing load stacks,
  and the grouped matmul runs on them (the model's logits are checked with the kernels')."""
  directory = os.path.join(QUANTIZED, 'deepseek_v3_fp8')
  kept = maxnnx.from_pretrained(directory, dtype='float32', keep_quantized=True)
  plain = dict(nnx.to_flat_state(nnx.state(
      maxnnx.from_pretrained(directory, dtype='float32'), nnx.Param)))
  tensors = read_safetensors_dir(directory)
  experts = {path: q for path, q in _kept_kernels(kept).items() if path[-1] != 'kernel'}
  assert {path[-1] for path in experts} == {'gate_proj', 'up_proj', 'down_proj'}
  for path, qarray in experts.items():
    assert qarray.qvalue.dtype == jnp.float8_e4m3fn and qarray.scale.shape[-1] == qarray.shape[-1]
    layer, name = path[1], path[-1]  # DeepSeek's experts keep our projection names
    for e in range(qarray.shape[0]):
      stored = tensors[f'model.layers.{layer}.mlp.experts.{e}.{name}.weight'][1]
      np.testing.assert_array_equal(np.asarray(qarray.qvalue[e]).view(np.uint8),
                                    np.asarray(stored).T.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(qwix.dequantize(qarray)),
                                  np.asarray(plain[path][...]))


def test_kept_mxfp4_experts_are_the_stored_codes_and_give_the_dequantized_logits():
  """GPT-OSS's MXFP4 experts (gate and up interleaved in one stored tensor) become float4_e2m1fn
  QArrays: the codes are the stored nibbles, the scales ``2 ** (s - 127)`` per 32 inputs, so
  dequantizing gives the float32 experts of a dequantizing load and the logits are equal."""
  directory = os.path.join(QUANTIZED, 'gpt_oss_mxfp4')
  ref = _reference('gpt_oss_mxfp4')
  kept = maxnnx.from_pretrained(directory, dtype='float32', keep_quantized=True)
  plain_model = maxnnx.from_pretrained(directory, dtype='float32')
  plain = dict(nnx.to_flat_state(nnx.state(plain_model, nnx.Param)))
  experts = _kept_kernels(kept)
  assert {path[-1] for path in experts} == {'gate_proj', 'up_proj', 'down_proj'}
  blocks = read_safetensors_dir(directory)['model.layers.0.mlp.experts.down_proj_blocks'][1]
  down = experts[('layers', 0, 'mlp', 'experts', 'down_proj')]
  low = np.asarray(down.qvalue)[:, 0::2, :].view(np.uint8) & 0x0F  # inputs 0, 2, 4... of each row
  stored_low = (np.asarray(blocks) & 0x0F).reshape(blocks.shape[0], blocks.shape[1], -1)
  np.testing.assert_array_equal(low, np.swapaxes(stored_low, -1, -2))  # [experts, in/2, out]
  for path, qarray in experts.items():
    assert qarray.qvalue.dtype == jnp.float4_e2m1fn
    np.testing.assert_array_equal(np.asarray(qwix.dequantize(qarray)),
                                  np.asarray(plain[path][...]))
  assert param_bytes(kept) < 0.6 * param_bytes(plain_model)
  logits = np.asarray(kept(ref['input_ids']))
  assert rel_error(logits, plain_model(ref['input_ids'])) < 1e-6


def test_keep_quantized_is_refused_where_nothing_is_stored_in_a_kept_form():
  """A float checkpoint: one error saying what to do; a kept model is not quantized a second
  time."""
  with pytest.raises(maxnnx.PretrainedError, match='keep_quantized=True: .* load it without'):
    maxnnx.from_pretrained(os.path.join(FIXTURES, 'llama'), keep_quantized=True)
  with pytest.raises(ValueError, match="keep_quantized='yes': expected True or False"):
    maxnnx.from_pretrained(os.path.join(FIXTURES, 'llama'), keep_quantized='yes')
  kept = maxnnx.from_pretrained(os.path.join(QUANTIZED, 'qwen3_fp8'), keep_quantized=True)
  with pytest.raises(ValueError, match='already quantized'):
    quantize_for_inference(kept, 'int8')

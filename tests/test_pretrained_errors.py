"""Bad checkpoints fail with one clear error naming the file and tensor."""

import json
import os
import struct

import numpy as np
import pytest

import maxnnx
from maxnnx.checkpoint.safetensors import read_safetensors, write_safetensors


def _edit_config(path, **changes):
  with open(os.path.join(path, 'config.json')) as f:
    data = json.load(f)
  data.update(changes)
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(data, f)


def test_missing_directory(tmp_path):
  """A path that is not a directory says what from_pretrained expects."""
  with pytest.raises(maxnnx.PretrainedError, match='not a directory'):
    maxnnx.from_pretrained(str(tmp_path / 'nope'))


def test_missing_config(checkpoint_copy):
  """No config.json: the error names the missing file."""
  path = checkpoint_copy('llama')
  os.remove(os.path.join(path, 'config.json'))
  with pytest.raises(maxnnx.PretrainedError, match=r'config\.json: missing'):
    maxnnx.from_pretrained(path)


def test_missing_weights_and_pickle_refused(checkpoint_copy):
  """Without safetensors files nothing loads, and a pickle file is not read."""
  path = checkpoint_copy('llama')
  os.remove(os.path.join(path, 'model.safetensors'))
  open(os.path.join(path, 'pytorch_model.bin'), 'wb').close()
  with pytest.raises(maxnnx.SafetensorsError, match='pickle checkpoints are not loaded'):
    maxnnx.from_pretrained(path)


def test_unknown_model_type(checkpoint_copy):
  """An unsupported model_type lists the supported ones."""
  path = checkpoint_copy('llama')
  _edit_config(path, model_type='bert')
  with pytest.raises(maxnnx.PretrainedError, match="model_type 'bert' is not supported.*llama"):
    maxnnx.from_pretrained(path)


def test_shape_mismatch_names_file_and_tensor(checkpoint_copy):
  """A config that disagrees with the weights names the tensor, its shape and the file."""
  path = checkpoint_copy('llama')
  _edit_config(path, intermediate_size=100)
  with pytest.raises(maxnnx.PretrainedError,
                     match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight'"
                           r' has shape'):
    maxnnx.from_pretrained(path)


def test_missing_tensor_is_named(checkpoint_copy):
  """A tensor absent from the files is named, not silently left at its init value."""
  path = checkpoint_copy('qwen3')
  file = os.path.join(path, 'model.safetensors')
  tensors = {k: np.array(v) for k, v in read_safetensors(file).items()}
  del tensors['model.layers.1.self_attn.k_norm.weight']
  write_safetensors(file, tensors)
  with pytest.raises(maxnnx.PretrainedError,
                     match=r"'model\.layers\.1\.self_attn\.k_norm\.weight' is missing"):
    maxnnx.from_pretrained(path)


def test_unexpected_tensor_is_an_error(checkpoint_copy):
  """Extra tensors mean the config does not describe the file: refuse."""
  path = checkpoint_copy('mistral')
  file = os.path.join(path, 'model.safetensors')
  tensors = {k: np.array(v) for k, v in read_safetensors(file).items()}
  tensors['model.layers.0.self_attn.q_proj.bias'] = np.zeros(4, np.float32)
  write_safetensors(file, tensors)
  with pytest.raises(maxnnx.PretrainedError, match=r'q_proj\.bias'):
    maxnnx.from_pretrained(path)


def test_truncated_file_names_file_and_tensor(checkpoint_copy):
  """A truncated safetensors file is detected before any tensor is loaded."""
  path = checkpoint_copy('gemma')
  file = os.path.join(path, 'model.safetensors')
  size = os.path.getsize(file)
  with open(file, 'r+b') as f:
    f.truncate(size - 1000)
  with pytest.raises(maxnnx.SafetensorsError, match=r"model\.safetensors: tensor '.*' ends at "
                                                     r'byte \d+ but the file has'):
    maxnnx.from_pretrained(path)


def test_corrupt_header(checkpoint_copy):
  """A garbage header is reported as such, naming the file."""
  path = checkpoint_copy('gemma')
  file = os.path.join(path, 'model.safetensors')
  with open(file, 'r+b') as f:
    f.write(struct.pack('<Q', 10**15))
  with pytest.raises(maxnnx.SafetensorsError, match='header length'):
    maxnnx.from_pretrained(path)


def test_sharded_checkpoint_round_trip(tmp_path):
  """Sharded export writes an index; loading reads every shard back."""
  model = maxnnx.from_pretrained(os.path.join(os.path.dirname(__file__), 'fixtures', 'hf',
                                              'llama'))
  files = maxnnx.save_pretrained(model, str(tmp_path), max_shard_bytes=200_000)
  assert 'model.safetensors.index.json' not in files  # the index is written beside shards
  assert len([f for f in files if f.endswith('.safetensors')]) > 1
  assert os.path.exists(tmp_path / 'model.safetensors.index.json')
  again = maxnnx.from_pretrained(str(tmp_path))
  ids = np.arange(12, dtype=np.int32)[None]
  np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(model(ids)))


def test_missing_shard_is_named(tmp_path):
  """An index that lists an absent shard names it."""
  model = maxnnx.from_pretrained(os.path.join(os.path.dirname(__file__), 'fixtures', 'hf',
                                              'llama'))
  files = maxnnx.save_pretrained(model, str(tmp_path), max_shard_bytes=200_000)
  os.remove(tmp_path / files[-1])
  with pytest.raises(maxnnx.SafetensorsError, match=files[-1]):
    maxnnx.from_pretrained(str(tmp_path))


def test_our_safetensors_match_the_reference_library(tmp_path):
  """Files we write are read identically by the safetensors package, and vice versa."""
  from safetensors.numpy import load_file, save_file
  rng = np.random.default_rng(0)
  tensors = {'a': rng.standard_normal((3, 5)).astype(np.float32),
             'b': rng.integers(0, 9, (7,)).astype(np.int64), 'c': np.zeros((0, 2), np.float16)}
  write_safetensors(str(tmp_path / 'ours.safetensors'), tensors)
  for name, value in load_file(str(tmp_path / 'ours.safetensors')).items():
    np.testing.assert_array_equal(value, tensors[name])
  save_file(tensors, str(tmp_path / 'theirs.safetensors'))
  for name, value in read_safetensors(str(tmp_path / 'theirs.safetensors')).items():
    np.testing.assert_array_equal(value, tensors[name])


def test_config_overrides_and_bad_override(checkpoint_copy):
  """Overrides reach the config; a misspelt one names the nearest field."""
  path = checkpoint_copy('llama')
  model = maxnnx.from_pretrained(path, dtype='bfloat16', scan_layers=True)
  assert model.config.runtime.dtype == 'bfloat16' and model.config.runtime.scan_layers
  with pytest.raises(maxnnx.PretrainedError, match="Did you mean 'attention.sliding_window'"):
    maxnnx.from_pretrained(path, sliding_windw=4)


@pytest.mark.parametrize('key', ['scale_attn_by_inverse_layer_idx', 'add_cross_attention'])
def test_gpt2_options_maxnnx_lacks_are_refused(checkpoint_copy, key):
  """GPT-2 configs that scale attention per layer or add cross-attention are refused."""
  path = checkpoint_copy('gpt2')
  _edit_config(path, **{key: True})
  with pytest.raises(maxnnx.PretrainedError, match=key):
    maxnnx.from_pretrained(path)


def test_gpt2_export_refuses_what_its_config_cannot_say(tmp_path):
  """A gpt3-family model whose fields GPT-2 has no key for is not exported as GPT-2."""
  from flax import nnx
  cfg = maxnnx.get_preset('gpt3-52k', mlp_gated=True, num_kv_heads=1)
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(maxnnx.PretrainedError, match=r'mlp_gated=True.*num_kv_heads=1'):
    maxnnx.save_pretrained(model, str(tmp_path))

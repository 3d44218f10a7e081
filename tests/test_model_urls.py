"""Models at URLs (``model=s3://...``, ``hf://org/name``, any fsspec URL): downloaded once per
process, only the files a checkpoint uses, then loaded as a local directory. The fake store is
fsspec's ``memory://`` filesystem."""

import os
import shutil
import uuid

import fsspec
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx import cli, paths
from maxnnx.data import load_tokenizer


@pytest.fixture(scope='module')
def local_model(tmp_path_factory, chat_checkpoint):
  """A tiny model saved with its tokenizer, beside files a download must skip."""
  directory = tmp_path_factory.mktemp('model')
  model = maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=512, num_layers=1),
                             rngs=nnx.Rngs(0))
  maxnnx.save_pretrained(model, str(directory))
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(chat_checkpoint / name, directory / name)
  (directory / 'pytorch_model.bin').write_bytes(b'pickle: never fetched')
  (directory / 'original').mkdir()
  (directory / 'original' / 'consolidated.safetensors').write_bytes(b'not fetched either')
  return directory


def _upload(directory) -> str:
  """``directory`` copied to a fresh ``memory://`` prefix; its URL."""
  fs = fsspec.filesystem('memory')
  url = f'memory://models/{uuid.uuid4().hex}'
  for root, _, files in os.walk(directory):
    for name in files:
      relative = os.path.relpath(os.path.join(root, name), directory)
      with open(os.path.join(root, name), 'rb') as f:
        fs.pipe_file(f'{url}/{relative}', f.read())
  return url


def test_a_model_and_its_tokenizer_load_from_a_url_downloaded_once(local_model):
  url = _upload(local_model)
  remote, local = maxnnx.from_pretrained(url), maxnnx.from_pretrained(str(local_model))
  ids = jnp.asarray(np.random.default_rng().integers(0, 512, (2, 9)))
  np.testing.assert_array_equal(remote(ids), local(ids))
  text = 'ROMEO: what light through yonder window breaks?'
  assert load_tokenizer(url).encode(text) == load_tokenizer(str(local_model)).encode(text)
  copy = paths.local_model_dir(url)
  assert paths.local_model_dir(url + '/') == copy  # one download per process
  expected = {n for n in os.listdir(local_model) if n.endswith(paths.MODEL_FILE_SUFFIXES)
              and os.path.isfile(local_model / n)}
  assert set(os.listdir(copy)) == expected and 'model.safetensors' in expected
  assert 'pytorch_model.bin' not in os.listdir(copy) and 'original' not in os.listdir(copy)


def test_cli_trains_from_a_model_at_a_url(local_model, tmp_path, capsys):
  url = _upload(local_model)
  assert cli.main(['train', f'model={url}', f'output_dir={tmp_path}/run', 'steps=2',
                   'seq_len=32', 'global_batch_size=4', 'sample_tokens=0', 'eval_every=0',
                   'checkpoint_every=0', 'mesh.data=1']) == 0
  assert f'Training {url}' in capsys.readouterr().out
  trained = maxnnx.from_pretrained(str(tmp_path / 'run' / 'final'))
  assert trained.config.vocab_size == 512


def test_nothing_at_the_url_is_one_line_naming_it():
  url = f'memory://models/{uuid.uuid4().hex}'
  with pytest.raises(FileNotFoundError, match=f'{url}: no such object'):
    maxnnx.from_pretrained(url)
  fsspec.filesystem('memory').pipe_file(f'{url}/notes.md', b'no model here')
  with pytest.raises(FileNotFoundError, match=f'{url}: no model files there'):
    maxnnx.from_pretrained(url)

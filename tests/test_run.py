"""A run from Python (:func:`maxnnx.train.run`) writes what ``maxnnx train`` writes."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

import maxnnx.train
from maxnnx import cli
from maxnnx.data import DEFAULT_CORPUS, SentencePieceTokenizer
from maxnnx.data.text import read_text
from maxnnx.train import run_settings


def _files(directory) -> set[str]:
  found = set()
  for root, _, names in os.walk(directory):
    found.update(os.path.relpath(os.path.join(root, n), directory) for n in names)
  return found


def _losses(directory) -> list[float]:
  with open(os.path.join(directory, 'metrics.jsonl')) as f:
    return [json.loads(line)['loss'] for line in f]


def test_a_notebook_run_writes_the_directory_maxnnx_train_writes(tmp_path, capsys):
  """The same settings, given to ``maxnnx train`` and to ``maxnnx.train.run``, train the same
  tokenizer and weights and leave the same files. A LoRA run, so every export is compared:
  the trained tokenizer, ``final/`` (merged) with it, ``adapter/``, ``loss.png``."""
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text(read_text(DEFAULT_CORPUS)[:30_000])
  settings = {'model': 'tiny', 'data': str(corpus), 'model.vocab_size': 384,
              'model.num_layers': 1, 'seed': 0, 'steps': 3, 'global_batch_size': 4,
              'seq_len': 16, 'log_every': 1, 'eval_every': 0, 'checkpoint_every': 0,
              'sample_tokens': 0, 'dtype': 'float32', 'mesh.data': 1, 'lora.rank': 2}
  by_cli, by_call = tmp_path / 'cli', tmp_path / 'call'
  args = [f'{key}={value}' for key, value in settings.items()]
  assert cli.main(['train', *args, f'output_dir={by_cli}']) == 0, capsys.readouterr().err
  summary = maxnnx.train.run(settings, output_dir=str(by_call))

  names = _files(by_cli)
  assert names == _files(by_call)
  assert {'tokenizer.model', 'metrics.jsonl', 'loss.png', 'run_config.json',
          'train_options.json', 'final/config.json', 'final/model.safetensors',
          'final/tokenizer.model'} <= names
  assert {'adapter/adapter_config.json', 'adapter/adapter_model.safetensors'} <= names
  losses = _losses(by_cli)
  assert len(losses) == 3 and losses == _losses(by_call)
  assert summary['first_loss'] == losses[0] and summary['last_loss'] == losses[-1]
  text = corpus.read_text()
  for name in ('tokenizer.model', 'final/tokenizer.model'):  # the file names its own path
    expected, got = (SentencePieceTokenizer(str(d / name)) for d in (by_cli, by_call))
    assert got.vocab_size == expected.vocab_size and got.encode(text) == expected.encode(text)
  stored = [json.loads((d / 'run_config.json').read_text()) for d in (by_cli, by_call)]
  for config in stored:
    config['tokenizer'].pop('sha256')
  assert stored[0] == stored[1]
  for name in [n for n in names if n.endswith('.safetensors')]:
    expected, got = load_file(by_cli / name), load_file(by_call / name)
    assert expected.keys() == got.keys()
    for key in expected:
      np.testing.assert_array_equal(got[key], expected[key], err_msg=f'{name}: {key}')
  options = [json.loads((d / 'train_options.json').read_text()) for d in (by_cli, by_call)]
  assert {**options[0], 'output_dir': ''} == {**options[1], 'output_dir': ''}


def test_settings_take_config_objects_and_refuse_unknown_keys(tmp_path):
  """A config object stands for its fields; a misspelt key is refused with the nearest one."""
  from maxnnx.config import MeshConfig
  from maxnnx.train import TrainConfig, split_settings
  settings = run_settings({'train': TrainConfig(steps=7, seq_len=16, mesh=MeshConfig(data=1)),
                           'output_dir': str(tmp_path)})
  assert settings['steps'] == 7 and settings['mesh.data'] == 1 and settings['model'] == 'tiny'
  assert run_settings({})['steps'] == cli.TRAIN_OVERRIDES['steps']  # the CLI's defaults
  _, train_config, _, _ = split_settings(settings)
  assert train_config.steps == 7 and train_config.mesh.data == 1
  assert run_settings({'train.seq_len': 8})['seq_len'] == 8
  with pytest.raises(ValueError, match="Did you mean 'steps'"):
    maxnnx.train.run({'stesp': 3}, output_dir=str(tmp_path))
  with pytest.raises(ValueError, match="Did you mean 'output_dir'"):
    maxnnx.train.run(ouput_dir=str(tmp_path))
  assert os.listdir(tmp_path) == []  # refused before anything is written

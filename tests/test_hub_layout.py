"""Splits and configs of Hub-layout dataset directories: the files of each split equal those that
the ``datasets`` library itself resolves (``load_dataset_builder``), and every data source
(local directory, bucket prefix, ``hf://``) reads the split and config asked for."""

import json
import os

import fsspec
import pytest

from maxnnx.data import DataConfig, resolve_source
from maxnnx.data.hub_layout import layout_splits, select_files
from maxnnx.data.sources import InMemorySource, _dataset_url

README_CONFIGS = """---
configs:
- config_name: en
  data_files:
  - split: train
    path: en/train-*.jsonl
  - split: test
    path:
    - en/test-*.jsonl
- config_name: fr
  data_files: fr/*.jsonl
  default: true
---
# A dataset with two configs
"""

LAYOUTS = {
    'shards': ['data/train-00000-of-00002.jsonl', 'data/train-00001-of-00002.jsonl',
               'data/test-00000-of-00001.jsonl', 'data/validation-00000-of-00001.jsonl'],
    'file_names': ['train.jsonl', 'dev.jsonl', 'wiki_test_0.jsonl', 'notes.jsonl'],
    'directories': ['train/a.jsonl', 'train/part/b.jsonl', 'valid-set/c.jsonl', 'other/d.jsonl'],
    'plain': ['a.jsonl', 'b/c.jsonl', 'attention.jsonl'],
    'readme_configs': ['en/train-0.jsonl', 'en/test-0.jsonl', 'fr/a.jsonl', 'fr/b.jsonl'],
}


def _write(root, files, readme=''):
  for i, name in enumerate(files):
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
      f.write(json.dumps({'text': f'document {i} of {name}'}) + '\n')
  if readme:
    with open(os.path.join(root, 'README.md'), 'w') as f:
      f.write(readme)


@pytest.mark.parametrize('config_name', ['', 'en'])
@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_splits_are_those_the_datasets_library_resolves(layout, config_name, tmp_path,
                                                        monkeypatch):
  if config_name and layout != 'readme_configs':
    pytest.skip('configs come from a README')
  datasets = pytest.importorskip('datasets')
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'cache'))
  root = tmp_path / 'dataset'
  readme = README_CONFIGS if layout == 'readme_configs' else ''
  _write(root, LAYOUTS[layout], readme)
  builder = datasets.load_dataset_builder(str(root), config_name or None)
  expected = {split: sorted(os.path.relpath(f, root) for f in files)
              for split, files in builder.config.data_files.items()}
  assert layout_splits(LAYOUTS[layout], readme, config_name) == expected


def test_a_plain_directory_is_read_whole_whatever_the_split(tmp_path):
  files = LAYOUTS['plain']
  assert select_files(files, 'validation|test') == sorted(files)
  with pytest.raises(ValueError, match=r"no split 'test' \(it has train, validation\); set "
                                       r'data.split'):
    select_files(['train.jsonl', 'dev.jsonl'], 'test')
  assert select_files(['train.jsonl', 'dev.jsonl'], 'test|validation') == ['dev.jsonl']


def test_config_errors_name_the_configs_there_are():
  files = LAYOUTS['readme_configs']
  with pytest.raises(ValueError, match=r"config_name='de': the dataset has the configs en, fr"):
    layout_splits(files, README_CONFIGS, 'de')
  no_default = README_CONFIGS.replace('  default: true\n', '')
  with pytest.raises(ValueError, match='none is the default: choose one with data.config_name'):
    layout_splits(files, no_default)
  # Without README configs a config is a top-level directory (the Hub's Parquet conversion).
  converted = ['en/train/0000.parquet', 'en/test/0000.parquet', 'fr/train/0000.parquet']
  assert layout_splits(converted, config_name='en') == {
      'train': ['en/train/0000.parquet'], 'test': ['en/test/0000.parquet']}
  with pytest.raises(ValueError, match=r"no directory of that name \(it has en, fr\)"):
    layout_splits(converted, config_name='de')


def _texts(resolved):
  source = InMemorySource(resolved.files, resolved.kind)
  return [source[i] for i in range(len(source))]


def test_a_local_directory_gives_the_split_and_config_asked_for(tmp_path):
  _write(tmp_path, LAYOUTS['readme_configs'], README_CONFIGS)
  assert _texts(resolve_source(str(tmp_path))) == [
      'document 2 of fr/a.jsonl', 'document 3 of fr/b.jsonl']
  assert _texts(resolve_source(str(tmp_path), split='validation|test', config_name='en')) == [
      'document 1 of en/test-0.jsonl']
  with pytest.raises(ValueError, match=r"data source '.*': no split 'test' \(it has train\)"):
    resolve_source(str(tmp_path), split='test')
  with pytest.raises(ValueError, match='chooses a config of a dataset directory; this is a file'):
    resolve_source(str(tmp_path / 'fr' / 'a.jsonl'), config_name='en')


def test_a_bucket_prefix_and_hf_urls_read_one_split(tmp_path):
  bucket = f'memory://maxnnx-hub-layout-{os.getpid()}'
  fs = fsspec.filesystem('memory')
  try:
    for i, name in enumerate(LAYOUTS['shards']):
      fs.pipe(f'{bucket}/{name}', (json.dumps({'text': f'doc {i}'}) + '\n').encode())
    train = resolve_source(bucket)
    assert [f.rsplit('/', 1)[-1] for f in train.files] == [
        'train-00000-of-00002.jsonl', 'train-00001-of-00002.jsonl']
    assert _texts(resolve_source(bucket, split='validation|test')) == ['doc 3']
  finally:
    fs.rm(bucket, recursive=True)
  assert _dataset_url('hf://org/name') == 'hf://datasets/org/name'
  assert _dataset_url('hf://datasets/org/name/data') == 'hf://datasets/org/name/data'


def test_the_split_is_a_data_key_and_eval_reads_the_held_out_one(tmp_path):
  config = DataConfig.from_string(str(tmp_path), split='test', config_name='en')
  assert (config.split, config.config_name) == ('test', 'en')
  with pytest.raises(ValueError, match='DataConfig.split must name a split'):
    DataConfig.from_string(str(tmp_path), split='|')
  from maxnnx.train.run_settings import RUN_SETTINGS
  assert RUN_SETTINGS['eval_split'][0] == 'validation|test'

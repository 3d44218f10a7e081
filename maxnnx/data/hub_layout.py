"""Splits and configs of a dataset directory laid out as the Hugging Face Hub lays them out.

A Hub dataset (``hf://datasets/org/name``, or a copy of one in a local directory or bucket) keeps
its splits side by side: ``data/train-00000-of-00002.parquet`` and ``data/test-...``,
``train.jsonl`` and ``validation.jsonl``, or ``train/`` and ``test/`` directories. Its README's
YAML header may name configs (subsets), each with the files of each split::

  configs:
  - config_name: en
    data_files:
    - split: train
      path: en/train-*.parquet
    default: true

:func:`select_files` picks the files of one split of one config by the rules the ``datasets``
library applies, so ``data.split=validation`` reads what ``load_dataset(..., split='validation')``
reads:

1. the README's ``configs`` when it has them (``data_files`` a pattern, a list of patterns or a
   list of ``{split, path}``; a config without splits is all ``train``);
2. else shards named ``data/<split>-00000-of-00004.<ext>``;
3. else a directory whose name holds a split's keyword as a word (``train/``, ``dev-set/``);
4. else a file name that does (``train.jsonl``, ``wiki-test-0.parquet``), where the keywords
   are those of ``datasets``: train, training; validation, valid, dev, val; test, testing, eval,
   evaluation;
5. else the directory names no splits: every file is ``train``, and every split asked for
   reads all of them (a plain data directory is read whole whatever ``data.split`` says).

Without README configs, ``config_name`` picks the top-level directory of that name (the layout of
the Hub's Parquet conversion, ``<config>/<split>/*.parquet``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence

import yaml

SPLIT_KEYWORDS = {
    'train': ('train', 'training'),
    'validation': ('validation', 'valid', 'dev', 'val'),
    'test': ('test', 'testing', 'eval', 'evaluation'),
}
_SEPARATORS = '-._ 0-9'
_SHARD = re.compile(r'^data/(\w+)-\d{5}-of-\d{5}[^/]*\.[^/]+$')


def _word(keyword: str) -> re.Pattern:
  """``keyword`` as a word of a name: at its start or after a separator, then its end or one."""
  return re.compile(rf'(^|[{_SEPARATORS}]){keyword}([{_SEPARATORS}]|$)')


_DIR_WORDS = {split: [_word(k) for k in keys] for split, keys in SPLIT_KEYWORDS.items()}
# In a file name the keyword is followed by a separator (the extension's dot at the latest).
_FILE_WORDS = {split: [re.compile(rf'(^|[{_SEPARATORS}]){k}[{_SEPARATORS}]') for k in keys]
               for split, keys in SPLIT_KEYWORDS.items()}


def readme_configs(readme: str) -> list[dict]:
  """The ``configs`` list of a dataset README's YAML header (``[]`` when it has none)."""
  if not readme.startswith('---'):
    return []
  end = readme.find('\n---', 3)
  if end < 0:
    return []
  try:
    header = yaml.safe_load(readme[3:end]) or {}
  except yaml.YAMLError as e:
    raise ValueError(f'README.md: its YAML header does not parse ({e}).') from None
  configs = header.get('configs', []) if isinstance(header, dict) else []
  return [c for c in configs if isinstance(c, dict)]


def _config_splits(config: dict) -> dict[str, list[str]]:
  """``{split: patterns}`` of one README config's ``data_files``."""
  data_files = config.get('data_files', [])
  if isinstance(data_files, str):
    return {'train': [data_files]}
  if isinstance(data_files, dict):
    return {str(k): [v] if isinstance(v, str) else list(v) for k, v in data_files.items()}
  splits: dict[str, list[str]] = {}
  for entry in data_files:
    if isinstance(entry, str):
      splits.setdefault('train', []).append(entry)
    else:
      path = entry.get('path', [])
      splits.setdefault(str(entry.get('split', 'train')), []).extend(
          [path] if isinstance(path, str) else path)
  return splits


def _matches(pattern: str, name: str) -> bool:
  """fsspec's glob rules on a relative path: ``**`` spans directories, ``*`` does not."""
  regex = re.escape(pattern.lstrip('./')).replace(r'\*\*/', '(.*/)?').replace(r'\*\*', '.*')
  regex = regex.replace(r'\*', '[^/]*').replace(r'\?', '[^/]')
  return re.fullmatch(regex, name) is not None or fnmatch.fnmatchcase(name, pattern)


def layout_splits(files: Sequence[str], readme: str = '', config_name: str = ''
                  ) -> dict[str, list[str]]:
  """``{split: files}`` of a dataset directory, in the order of its splits (``{'train': files}``
  when it names none).

  Args:
    files: the directory's data files, relative to it (``'data/train-00000-of-00001.parquet'``).
    readme: its README.md (``''`` when it has none).
    config_name: the config to read (``''``: the README's default config, or its only one).

  Raises:
    ValueError: ``config_name`` names no config (the message lists them), or the README has
      several configs, none the default, and none is named.
  """
  configs = readme_configs(readme)
  if configs:
    names = [str(c.get('config_name', 'default')) for c in configs]
    if config_name:
      if config_name not in names:
        raise ValueError(f'data.config_name={config_name!r}: the dataset has the configs '
                         f'{", ".join(names)}.')
      config = configs[names.index(config_name)]
    else:
      defaults = [c for c in configs if c.get('default')] or (
          configs if len(configs) == 1 else [c for c in configs
                                             if c.get('config_name') == 'default'])
      if not defaults:
        raise ValueError(f'the dataset has the configs {", ".join(names)} and none is the '
                         'default: choose one with data.config_name.')
      config = defaults[0]
    return {split: sorted(f for f in files if any(_matches(p, f) for p in patterns))
            for split, patterns in _config_splits(config).items()}
  if config_name:
    inside = [f for f in files if f.startswith(config_name.rstrip('/') + '/')]
    if not inside:
      tops = sorted({f.split('/')[0] for f in files if '/' in f})
      raise ValueError(f'data.config_name={config_name!r}: the dataset has no directory of that '
                       f'name (it has {", ".join(tops) or "no directories"}).')
    return {split: [f'{config_name.rstrip("/")}/{g}' for g in group]
            for split, group in layout_splits([f[len(config_name.rstrip('/')) + 1:]
                                               for f in inside]).items()}
  shards: dict[str, list[str]] = {}
  for f in files:
    if match := _SHARD.match(f):
      shards.setdefault(match.group(1), []).append(f)
  if shards:
    order = [s for s in SPLIT_KEYWORDS if s in shards] + sorted(set(shards) - set(SPLIT_KEYWORDS))
    return {split: sorted(shards[split]) for split in order}
  for words, part in ((_DIR_WORDS, lambda f: f.split('/')[:-1]),
                      (_FILE_WORDS, lambda f: f.split('/')[-1:])):
    found = {split: sorted(f for f in files
                           if any(w.search(name) for w in split_words for name in part(f)))
             for split, split_words in words.items()}
    found = {split: group for split, group in found.items() if group}
    if found:
      return found
  return {'train': sorted(files)}


def _names_a_split(file: str) -> bool:
  """Whether ``file``'s path names a split (a shard name, a directory or a file name)."""
  *dirs, name = file.split('/')
  return bool(_SHARD.match(file)) or any(
      w.search(d) for words in _DIR_WORDS.values() for w in words for d in dirs) or any(
      w.search(name) for words in _FILE_WORDS.values() for w in words)


def select_files(files: Sequence[str], split: str, readme: str = '', config_name: str = '',
                 *, where: str = 'the dataset') -> list[str]:
  """The files of the first split in ``split`` (``'validation|test'``) that the layout has.

  Raises:
    ValueError: the layout has none of those splits (the message lists the ones it has), or
      the config cannot be chosen (see :func:`layout_splits`).
  """
  splits = layout_splits(files, readme, config_name)
  if not readme_configs(readme) and splits == {'train': sorted(files)} and not any(
      _names_a_split(f) for f in files):
    return splits['train']  # a plain directory: no splits to choose from
  wanted = [s.strip() for s in split.split('|') if s.strip()]
  for name in wanted:
    if splits.get(name):
      return splits[name]
  raise ValueError(f'{where}: no split {" or ".join(repr(s) for s in wanted)} (it has '
                   f'{", ".join(splits) or "no data files"}); set data.split.')

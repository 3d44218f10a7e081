"""Document sources: random-access collections of documents, named by one string.

A source spec is either ``'synthetic'`` or a path: a file, a directory (a
Hugging Face datasets layout: its data files, recursively, README and other
files ignored) or a glob (``'data/train-*.parquet'``). Each may also be a URL
that fsspec reads (``s3://bucket/shards/*.parquet``, ``gs://bucket/corpus/``,
``https://host/data.jsonl``, ``hf://datasets/org/name``, ``file:///data/x.txt``):
a prefix is a directory, and its files are named by their URLs, so a resumed
run reads them again from there. The format comes from the file names:

===============  ===========================================================
kind             files and what a document is
===============  ===========================================================
``text``         ``*.txt``; a block of lines between blank lines
                 (``text_split='blank_lines'``), one line (``'lines'``) or
                 the whole file (``'file'``)
``jsonl``        ``*.jsonl``, ``*.ndjson``, ``*.json`` (JSON lines, or one JSON
                 list of objects); one object, the document in ``column``
``parquet``      ``*.parquet``; one row, the document in ``column``
``array_record`` ``*.array_record`` (also sharded ``*.array_record-00000-of-00008``);
                 one record: UTF-8 text, or int32 token ids when
                 ``pretokenized`` (see :mod:`maxnnx.data.convert`)
``synthetic``    random token ids, deterministic by seed (no files)
===============  ===========================================================

Text, JSONL and Parquet sources are read into memory once; ArrayRecord files
are read record by record, which is the path for corpora larger than memory
(ArrayRecord's reader opens local files only: a URL's files are first
downloaded into a local directory of the process, deleted at exit).
A document is a ``str``, or, for pre-tokenized data (``pretokenized=True``:
lists of ints in ``column``, int32 records), a 1-D int32 array.
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import json
import os
import re

import numpy as np

from maxnnx import paths
from maxnnx.data.hub_layout import select_files
from maxnnx.data.text import read_text

SYNTHETIC = 'synthetic'
_ARRAY_RECORD = re.compile(r'\.array_?record(-\d+-of-\d+)?$')
_EXTENSIONS = {'.txt': 'text', '.jsonl': 'jsonl', '.ndjson': 'jsonl', '.json': 'jsonl',
               '.parquet': 'parquet'}
KINDS = ('text', 'jsonl', 'parquet', 'array_record', SYNTHETIC)


def kind_of_file(path: str) -> str | None:
  """The source kind a file name implies, or ``None``."""
  if _ARRAY_RECORD.search(path):
    return 'array_record'
  return _EXTENSIONS.get(os.path.splitext(path)[1].lower())


@dataclasses.dataclass(frozen=True)
class ResolvedSource:
  """What a source spec names: its kind and its files (sorted)."""

  spec: str
  kind: str
  files: tuple[str, ...]


def resolve_source(spec: str, kind: str = 'auto', *, split: str = 'train',
                   config_name: str = '') -> ResolvedSource:
  """Resolve ``'synthetic'``, a file, a directory or a glob into a kind and files.

  A directory (or prefix) laid out as a Hugging Face Hub dataset gives the files of one split
  of one config (:mod:`maxnnx.data.hub_layout`): ``split`` names it (``'validation|test'``: the
  first of these it has), ``config_name`` the config; a directory that names no splits is read
  whole. A file or a glob is read as named. ``hf://org/name`` is the Hub dataset
  ``hf://datasets/org/name``.

  Raises:
    FileNotFoundError: nothing matches ``spec``.
    ValueError: the format cannot be told from the names, a directory mixes formats, or it
      has no such split or config (the message lists those it has).
  """
  if spec == SYNTHETIC or kind == SYNTHETIC:
    return ResolvedSource(spec, SYNTHETIC, ())
  if paths.is_remote(spec):
    files = _remote_files(_dataset_url(spec), kind, split, config_name)
  elif _has_glob(path := paths.normalize(spec)):
    files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    if not files:
      raise FileNotFoundError(f"data source {spec!r}: the pattern matches no files.")
  elif os.path.isdir(path):
    files = sorted(_data_files(path, kind))
    if not files:
      raise FileNotFoundError(f'data source {spec!r}: {_NO_DATA_FILES}')
    readme = os.path.join(path, 'README.md')
    files = _split_files(spec, path, files, split, config_name,
                         lambda: open(readme).read() if os.path.isfile(readme) else '')
  elif os.path.isfile(path):
    files = [path]
  else:
    raise FileNotFoundError(f"data source {spec!r}: no such file or directory "
                            "(use 'synthetic' for random tokens).")
  if config_name and not paths.is_remote(spec) and not os.path.isdir(path):
    raise ValueError(f'data source {spec!r}: data.config_name={config_name!r} chooses a config '
                     'of a dataset directory; this is a file or a pattern (drop config_name).')
  if kind != 'auto':
    return ResolvedSource(spec, kind, tuple(files))
  kinds = {f: kind_of_file(f) for f in files}
  unknown = [f for f, k in kinds.items() if k is None]
  if unknown:
    raise ValueError(f'data source {spec!r}: cannot tell the format of {unknown[0]} from its '
                     f'name; rename it or set kind= (one of {", ".join(KINDS[:-1])}).')
  found = sorted(set(kinds.values()))
  if len(found) > 1:
    raise ValueError(f'data source {spec!r} mixes formats ({", ".join(found)}); name one with '
                     "a glob such as 'dir/**/*.parquet' or set kind=.")
  return ResolvedSource(spec, found[0], tuple(files))


_NO_DATA_FILES = ('the directory holds no data files (*.txt, *.jsonl, *.json, *.parquet, '
                   '*.array_record).')


def _has_glob(spec: str) -> bool:
  return any(c in spec for c in '*?[')


def _wanted(name: str, kind: str) -> bool:
  """Whether file ``name`` is a data file of ``kind`` (hidden files are not)."""
  found = kind_of_file(name)
  return not name.startswith('.') and found is not None and kind in ('auto', found)


def _dataset_url(url: str) -> str:
  """``hf://org/name`` read as data is the Hub dataset ``hf://datasets/org/name``."""
  if url.startswith('hf://') and not url[5:].startswith(('datasets/', 'spaces/', 'buckets/')):
    return 'hf://datasets/' + url[5:]
  return url


def _split_files(spec: str, root: str, files: list[str], split: str, config_name: str,
                 readme) -> list[str]:
  """``files`` (under ``root``) of the split and config asked for; ``readme()`` reads the
  directory's README.md (``''`` when there is none)."""
  root = root.rstrip('/')
  relative = [f[len(root) + 1:] for f in files]
  try:
    chosen = select_files(relative, split, readme(), config_name,
                          where=f'data source {spec!r}')
  except ValueError as e:
    message = str(e)
    raise ValueError(message if message.startswith('data source') else
                     f'data source {spec!r}: {message}') from None
  return [f'{root}/{f}' for f in chosen]


def _remote_files(url: str, kind: str, split: str = 'train', config_name: str = '') -> list[str]:
  """The URLs of the data files a URL names: an object, a glob or a prefix (recursively; a
  Hub dataset layout gives one split of one config)."""
  fs, inner = paths.data_filesystem(url)
  try:
    if _has_glob(inner):
      found = [p for p, info in fs.glob(inner, detail=True).items() if info['type'] == 'file']
      if not found:
        raise FileNotFoundError(f"data source {url!r}: the pattern matches no files.")
    elif fs.info(inner)['type'] == 'directory':  # a prefix of an object store
      found = [p for p in fs.find(inner) if _wanted(p.rsplit('/', 1)[-1], kind)
               and not any(part.startswith('.') for part in p[len(inner):].split('/'))]
      if not found:
        raise FileNotFoundError(f'data source {url!r}: {_NO_DATA_FILES}')
      readme = f"{inner.rstrip('/')}/README.md"
      found = _split_files(url, inner, sorted(found), split, config_name,
                           lambda: fs.cat_file(readme).decode() if fs.exists(readme) else '')
    else:
      if config_name:
        raise ValueError(f'data source {url!r}: data.config_name={config_name!r} chooses a '
                         'config of a dataset directory; this is one object (drop config_name).')
      found = [inner]
  except (FileNotFoundError, ValueError) as e:
    if str(e).startswith('data source'):
      raise
    if isinstance(e, ValueError):
      raise paths.data_error(url, e) from None
    raise FileNotFoundError(f'data source {url!r}: no such object or prefix.') from None
  except Exception as e:  # each backend raises its own errors (OSError, botocore, httpx...)
    raise paths.data_error(url, e) from None
  return sorted(fs.unstrip_protocol(p) for p in found)


def _data_files(directory: str, kind: str):
  for root, dirs, names in os.walk(directory):
    dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
    for name in names:
      if _wanted(name, kind):
        yield os.path.join(root, name)


class InMemorySource:
  """Documents of text / JSONL / Parquet files, held in memory.

  Args:
    files: the files, all of ``kind``.
    kind: ``'text'``, ``'jsonl'`` or ``'parquet'``.
    column: the field holding the document (JSONL, Parquet).
    pretokenized: documents are lists of token ids instead of text.
    text_split: ``'blank_lines'``, ``'lines'`` or ``'file'`` (text files).
  """

  def __init__(self, files, kind: str, *, column: str = 'text', pretokenized: bool = False,
               text_split: str = 'blank_lines'):
    self.files = tuple(files)
    self.docs: list = []
    self._where: list[int] = []  # line (text, JSONL) or row (Parquet) of each document
    self._starts: list[int] = []  # index of each file's first document
    for path in self.files:
      self._starts.append(len(self.docs))
      if kind == 'text':
        if pretokenized:
          raise ValueError(f'{path}: text files hold text; pretokenized=True needs JSONL, '
                           'Parquet or ArrayRecord data.')
        pairs = _text_documents(path, text_split)
      elif kind == 'jsonl':
        pairs = _jsonl_documents(path, column, pretokenized)
      elif kind == 'parquet':
        pairs = _parquet_documents(path, column, pretokenized)
      else:
        raise ValueError(f'InMemorySource reads text, jsonl or parquet, not {kind!r}.')
      for where, doc in pairs:
        self._where.append(where)
        self.docs.append(doc)
      if len(self.docs) == self._starts[-1]:
        raise ValueError(f'{path}: the file holds no documents.')
    self.unit = 'row' if kind == 'parquet' else 'line'

  def __len__(self) -> int:
    return len(self.docs)

  def __getitem__(self, index: int):
    doc = self.docs[index]
    return doc if isinstance(doc, str) else np.asarray(doc, np.int32)

  def describe(self, index: int) -> str:
    """Where document ``index`` comes from, e.g. ``'a.jsonl line 7'``."""
    f = bisect.bisect_right(self._starts, index) - 1
    return f'{self.files[f]} {self.unit} {self._where[index]}'


def _text_documents(path: str, text_split: str):
  text = read_text(path)  # clear errors for missing, empty and non-UTF-8 files
  if text_split == 'file':
    yield 1, text
    return
  if text_split == 'lines':
    for number, line in enumerate(text.split('\n'), 1):
      if line.strip():
        yield number, line
    return
  line = 1
  for block in re.split(r'(\n[ \t\r]*\n)', text):
    if block.strip():  # separators are whitespace only
      lead = len(block) - len(block.lstrip('\n'))
      yield line + lead, block.strip('\n')
    line += block.count('\n')


def _check_value(value, path, where, column, pretokenized):
  if pretokenized:
    if not (isinstance(value, (list, tuple, np.ndarray))
            and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)):
      kind = 'text' if isinstance(value, str) else type(value).__name__
      hint = ' (set pretokenized=False for text)' if isinstance(value, str) else ''
      raise ValueError(f"{path} {where}: column '{column}' holds {kind}, not a list of token "
                       f'ids{hint}.')
  elif not isinstance(value, str):
    hint = (' It holds token ids: set pretokenized=True.' if isinstance(value, list) else '')
    raise ValueError(f"{path} {where}: column '{column}' holds {type(value).__name__}, "
                     f'not text.{hint}')


def _jsonl_documents(path: str, column: str, pretokenized: bool):
  raw = paths.read_data_bytes(path)
  if not raw.strip():
    raise ValueError(f'{path}: the file is empty.')
  if raw.lstrip()[:1] == b'[':  # a .json file holding one list of objects
    try:
      records = json.loads(raw.decode('utf-8'))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f'{path}: not a valid UTF-8 JSON list ({e}).') from None
    numbered = enumerate(records, 1)
    unit = 'record'
  else:
    numbered = ((n, line) for n, line in enumerate(raw.split(b'\n'), 1) if line.strip())
    unit = 'line'
  for number, record in numbered:
    if unit == 'line':
      try:
        record = json.loads(record.decode('utf-8'))
      except UnicodeDecodeError as e:
        raise ValueError(f'{path} line {number}: not UTF-8 (byte {e.start} of the line).') from None
      except json.JSONDecodeError as e:
        raise ValueError(f'{path} line {number}: not valid JSON ({e.msg}).') from None
    if not isinstance(record, dict):
      raise ValueError(f'{path} {unit} {number}: expected a JSON object, got '
                       f'{type(record).__name__}.')
    if column not in record:
      raise ValueError(f"{path} {unit} {number}: no column '{column}'; the columns are "
                       f'{sorted(record)}. Set column= (data.column= on the command line) to '
                       'one of them.')
    _check_value(record[column], path, f'{unit} {number}', column, pretokenized)
    yield number, record[column]


def _parquet_documents(path: str, column: str, pretokenized: bool):
  import pyarrow as pa
  import pyarrow.parquet as pq
  raw = paths.read_data_bytes(path) if paths.is_remote(path) else None
  try:
    parquet = pq.ParquetFile(path if raw is None else pa.BufferReader(raw))
  except Exception as e:  # pyarrow raises ArrowInvalid and friends
    raise ValueError(f'{path}: not a Parquet file ({e}).') from None
  names = parquet.schema_arrow.names
  if column not in names:
    raise ValueError(f"{path}: no column '{column}'; the columns are {names}. "
                     'Set column= (data.column= on the command line) to one of them.')
  values = parquet.read(columns=[column]).column(column).to_pylist()
  for row, value in enumerate(values):
    if value is None:
      continue
    _check_value(value, path, f'row {row}', column, pretokenized)
    yield row, value


class ArrayRecordSource:
  """Documents of ArrayRecord files, read record by record.

  Records are UTF-8 text, or little-endian int32 token ids when ``pretokenized``.
  """

  def __init__(self, files, *, pretokenized: bool = False):
    import grain
    self.files = tuple(files)  # as named (URLs stay URLs in messages)
    self.local_files = tuple(paths.download_data_file(f) if paths.is_remote(f) else f
                             for f in self.files)
    for path, local in zip(self.files, self.local_files, strict=True):
      if os.path.getsize(local) == 0:
        raise ValueError(f'{path}: the file is empty.')
    self.records = grain.sources.ArrayRecordDataSource(list(self.local_files))
    if len(self.records) == 0:
      raise ValueError(f'{", ".join(self.files)}: the ArrayRecord files hold no records.')
    self.pretokenized = pretokenized

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, index: int):
    record = self.records[index]
    if self.pretokenized:
      if len(record) % 4:
        raise ValueError(f'{self.describe(index)}: {len(record)} bytes is not a whole number '
                         'of int32 token ids; was the file written with a tokenizer?')
      return np.frombuffer(record, '<i4').astype(np.int32)
    try:
      return record.decode('utf-8')
    except UnicodeDecodeError as e:
      raise ValueError(f'{self.describe(index)}: not UTF-8 text (byte {e.start}); if the file '
                       'holds token ids, set pretokenized=True.') from None

  def describe(self, index: int) -> str:
    """The file and record number of record ``index``."""
    if len(self.files) == 1:
      return f'{self.files[0]} record {index}'
    from array_record.python.array_record_module import ArrayRecordReader
    for path, local in zip(self.files, self.local_files, strict=True):
      count = ArrayRecordReader(local).num_records()
      if index < count:
        return f'{path} record {index}'
      index -= count
    return f'record {index} of {self.files}'


class SyntheticSource:
  """Random token documents, deterministic by ``seed``: document ``i`` is always the same.

  Lengths are uniform in ``[min_length, max_length]``; ids uniform in
  ``[0, vocab_size)``.
  """

  def __init__(self, vocab_size: int, *, max_length: int, min_length: int = 1,
               num_documents: int = 1_000_000, seed: int = 0):
    if vocab_size < 1:
      raise ValueError(f'synthetic data needs vocab_size >= 1, got {vocab_size}.')
    self.vocab_size, self.seed = vocab_size, seed
    self.min_length, self.max_length = min_length, max(min_length, max_length)
    self.num_documents = num_documents

  def __len__(self) -> int:
    return self.num_documents

  def __getitem__(self, index: int) -> np.ndarray:
    rng = np.random.default_rng([self.seed, index])
    length = rng.integers(self.min_length, self.max_length + 1)
    return rng.integers(0, self.vocab_size, length, dtype=np.int32)

  def describe(self, index: int) -> str:
    """``'synthetic document i'``."""
    return f'synthetic document {index}'

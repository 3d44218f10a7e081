"""Streamed JSONL and Parquet sources: documents read block by block as they are asked for.

With ``DataConfig.streaming`` a JSONL or Parquet source is not read into memory. Its files
are split into blocks, a Parquet row group or :data:`JSONL_BLOCK_LINES` lines of JSON lines,
and a block is read (from disk, or with ranged reads from an object store or the Hub) when one
of its documents is asked for; the last :data:`CACHED_BLOCKS` blocks stay in memory. What a
source holds is then its index: the row counts of the Parquet footers, and one byte offset per
block and one line number per document of a JSONL file (found by one pass over the file that
keeps none of its text).

Random access to a streamed source is exact but slow, so the pipeline does not shuffle it
globally: :class:`BlockShuffle` visits the blocks in a random order and the documents of each
block in a random order, both reshuffled every epoch, so that every block is read once an
epoch. The order is still deterministic by seed and resumable, like every other source
(the position is an index into it).
"""

from __future__ import annotations

import bisect
import collections
import json

import grain
import numpy as np

from maxnnx import paths

JSONL_BLOCK_LINES = 1024  # JSON lines per block of a streamed JSONL file
CACHED_BLOCKS = 2  # blocks each streamed source keeps in memory


def _open(path: str):
  """A binary file object for a local path or a data URL."""
  if not paths.is_remote(path):
    return open(paths.normalize(path), 'rb')
  fs, inner = paths.data_filesystem(path)
  return paths.retrying(lambda: fs.open(inner, 'rb'), path)


class StreamedSource:
  """Documents of JSONL or Parquet files, read one block at a time.

  Args:
    files: the files, all of ``kind``.
    kind: ``'jsonl'`` or ``'parquet'``.
    column: the field holding the document.
    pretokenized: documents are lists of token ids instead of text.

  Attributes:
    block_starts: index of each block's first document, in order.
    blocks_read: how many times a block was read (a block read again after it left the
      cache counts again).

  Raises:
    ValueError: a file that is empty, not JSON lines (a ``.json`` list cannot be streamed),
      not Parquet, or has no ``column``; all naming the file.
  """

  def __init__(self, files, kind: str, *, column: str = 'text', pretokenized: bool = False):
    if kind not in ('jsonl', 'parquet'):
      raise ValueError(f'DataConfig.streaming reads JSONL and Parquet sources, not {kind!r}; '
                       'set streaming=false for this source.')
    self.files, self.kind = tuple(files), kind
    self.column, self.pretokenized = column, pretokenized
    self._blocks: list[tuple[int, object]] = []  # (file index, row group or byte range)
    self.block_starts: list[int] = []
    self._numbers: list[np.ndarray] = []  # per block: line (JSONL) or row (Parquet) per doc
    length = 0
    for f, path in enumerate(self.files):
      found = self._parquet_blocks(path) if kind == 'parquet' else self._jsonl_blocks(path)
      if not found:
        raise ValueError(f'{path}: the file holds no documents.')
      for key, numbers in found:
        self._blocks.append((f, key))
        self.block_starts.append(length)
        self._numbers.append(numbers)
        length += len(numbers)
    self._length = length
    self._cache: collections.OrderedDict[int, list] = collections.OrderedDict()
    self.blocks_read = 0

  def __getstate__(self):  # a worker process gets the index, not the cached blocks
    state = dict(self.__dict__)
    state['_cache'] = collections.OrderedDict()
    return state

  def _parquet_blocks(self, path: str):
    import pyarrow.parquet as pq  # noqa: PLC0415
    with _open(path) as f:
      try:
        meta = pq.ParquetFile(f)
      except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise ValueError(f'{path}: not a Parquet file ({e}).') from None
      names = meta.schema_arrow.names
      if self.column not in names:
        raise ValueError(f"{path}: no column '{self.column}'; the columns are {names}. "
                         'Set column= (data.column= on the command line) to one of them.')
      blocks, row = [], 0
      for group in range(meta.num_row_groups):
        rows = meta.metadata.row_group(group).num_rows
        if rows:
          blocks.append((group, np.arange(row, row + rows, dtype=np.int64)))
        row += rows
      return blocks

  def _jsonl_blocks(self, path: str):
    blocks, numbers, start, offset = [], [], 0, 0
    with _open(path) as f:
      head = f.read(1)
      while head in (b' ', b'\n', b'\r', b'\t'):
        head = f.read(1)
      if head == b'[':
        raise ValueError(f'{path}: a JSON list cannot be streamed (it is one document to '
                         'parse); use JSON lines (one object per line) or streaming=false.')
      f.seek(0)
      for number, line in enumerate(f, 1):
        if line.strip():
          if not numbers:
            start = offset
          numbers.append(number)
        offset += len(line)
        if len(numbers) == JSONL_BLOCK_LINES:
          blocks.append(((start, offset), np.asarray(numbers, np.int64)))
          numbers = []
      if numbers:
        blocks.append(((start, offset), np.asarray(numbers, np.int64)))
    return blocks

  def __len__(self) -> int:
    return self._length

  def _block_of(self, index: int) -> int:
    return bisect.bisect_right(self.block_starts, index) - 1

  def __getitem__(self, index: int):
    block = self._block_of(index)
    doc = self._load(block)[index - self.block_starts[block]]
    if doc is None:  # a null Parquet cell: an empty document
      doc = [] if self.pretokenized else ''
    return doc if isinstance(doc, str) else np.asarray(doc, np.int32)

  def describe(self, index: int) -> str:
    """Where document ``index`` comes from, e.g. ``'a.jsonl line 7'``."""
    block = self._block_of(index)
    number = int(self._numbers[block][index - self.block_starts[block]])
    unit = 'row' if self.kind == 'parquet' else 'line'
    return f'{self.files[self._blocks[block][0]]} {unit} {number}'

  def _load(self, block: int) -> list:
    if block in self._cache:
      self._cache.move_to_end(block)
      return self._cache[block]
    file_index, key = self._blocks[block]
    path = self.files[file_index]
    read = ((lambda: self._read_row_group(path, key)) if self.kind == 'parquet'
            else (lambda: self._read_lines(path, key, self._numbers[block])))
    docs = paths.retrying(read, path) if paths.is_remote(path) else read()
    self.blocks_read += 1
    self._cache[block] = docs
    while len(self._cache) > CACHED_BLOCKS:
      self._cache.popitem(last=False)
    return docs

  def _read_row_group(self, path: str, group: int) -> list:
    import pyarrow.parquet as pq  # noqa: PLC0415

    from maxnnx.data.sources import _check_value  # noqa: PLC0415
    with _open(path) as f:
      values = pq.ParquetFile(f).read_row_group(group, columns=[self.column]).column(
          self.column).to_pylist()
    for row, value in enumerate(values):
      if value is not None:
        _check_value(value, path, f'row group {group} row {row}', self.column,
                     self.pretokenized)
    return values

  def _read_lines(self, path: str, byte_range: tuple[int, int], numbers: np.ndarray) -> list:
    from maxnnx.data.sources import _check_value  # noqa: PLC0415
    start, end = byte_range
    with _open(path) as f:
      f.seek(start)
      raw = f.read(end - start)
    lines = [line for line in raw.split(b'\n') if line.strip()]
    docs = []
    for number, line in zip(numbers, lines, strict=True):
      try:
        record = json.loads(line.decode('utf-8'))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f'{path} line {number}: not valid UTF-8 JSON ({e}).') from None
      if not isinstance(record, dict):
        raise ValueError(f'{path} line {number}: expected a JSON object, got '
                         f'{type(record).__name__}.')
      if self.column not in record:
        raise ValueError(f"{path} line {number}: no column '{self.column}'; the columns are "
                         f'{sorted(record)}. Set column= (data.column= on the command line) '
                         'to one of them.')
      _check_value(record[self.column], path, f'line {number}', self.column, self.pretokenized)
      docs.append(record[self.column])
    return docs


def sliced_block_starts(block_starts: list[int], length: int, start: int, step: int) -> list[int]:
  """The block starts of ``range(length)[start::step]``: the first position in the slice of
  each block that keeps at least one element."""
  out = []
  for first in block_starts:
    position = max(0, -(-(first - start) // step))
    if start + position * step < length and (not out or position > out[-1]):
      out.append(position)
  return out or [0]


class BlockShuffle(grain.MapDataset):
  """``parent`` in a block-local random order: its blocks (consecutive runs of elements
  starting at ``block_starts``) in a random order, the elements of each block in a random
  order; both reshuffled every epoch (an index ``i >= len`` is in epoch ``i // len``).

  Args:
    parent: the dataset to reorder.
    block_starts: index of each block's first element, ascending, starting at 0.
    seed: the order's seed.
  """

  def __init__(self, parent: grain.MapDataset, block_starts: list[int], seed: int):
    super().__init__(parent)
    self._length = len(parent)
    self._starts = np.asarray(list(block_starts) + [self._length], np.int64)
    self._sizes = np.diff(self._starts)
    self._seed = seed
    self._epoch = None
    self._order = self._offsets = None
    self._within: collections.OrderedDict[tuple[int, int], np.ndarray] = (
        collections.OrderedDict())

  def __len__(self) -> int:
    return self._length

  def __str__(self) -> str:
    return f'BlockShuffle(blocks={len(self._sizes)}, seed={self._seed})'

  def _epoch_order(self, epoch: int) -> None:
    if epoch != self._epoch:
      rng = np.random.default_rng([self._seed, epoch])
      self._order = rng.permutation(len(self._sizes))
      self._offsets = np.concatenate([[0], np.cumsum(self._sizes[self._order])])
      self._epoch = epoch

  def _permutation(self, epoch: int, block: int) -> np.ndarray:
    key = (epoch, block)
    if key not in self._within:
      self._within[key] = np.random.default_rng([self._seed, epoch, block, 1]).permutation(
          int(self._sizes[block]))
      while len(self._within) > CACHED_BLOCKS + 1:
        self._within.popitem(last=False)
    return self._within[key]

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    epoch, position = divmod(int(index), self._length)
    self._epoch_order(epoch)
    k = int(np.searchsorted(self._offsets, position, side='right')) - 1
    block = int(self._order[k])
    inner = self._permutation(epoch, block)[position - int(self._offsets[k])]
    return self._parent[epoch * self._length + int(self._starts[block]) + int(inner)]

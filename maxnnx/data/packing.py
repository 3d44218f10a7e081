"""From token documents to fixed-shape rows: examples, the overlong policy, packing.

A document of ``n`` token ids (BOS/EOS included) becomes one *example* of
``n - 1`` (input, target) pairs: ``inputs = ids[:-1]``, ``targets = ids[1:]``.
Packing puts whole examples side by side in a row of ``seq_len``, so no target
ever belongs to another document and every non-padding target counts; each
example is a segment (1, 2, ... in its row; 0 is padding) with positions
restarting at 0.

An example longer than ``seq_len`` is handled by the ``overlong`` policy:
``'split'`` cuts it into ``seq_len``-long pieces (no target is lost: the
pieces share no pair), ``'truncate'`` keeps the first piece, ``'drop'`` skips
it, ``'error'`` raises. :class:`ExamplesIterDataset` counts every case; the
counts are part of its checkpointable state.

grain's ``FirstFitPackIterDataset`` / ``BestFitPackIterDataset`` (checked in the
tests) emit, per packed feature ``f``, ``f``, ``f_segment_ids`` (1, 2, ... per
example in the row, 0 on padding) and ``f_positions`` (0.. within each example,
0 on padding); :class:`ToBatch` renames them to the batch contract.
"""

from __future__ import annotations

import grain
import numpy as np

COUNTS = ('documents', 'empty_skipped', 'overlong', 'overlong_split_pieces',
          'overlong_truncated', 'overlong_dropped', 'targets_dropped')


def check_image_fits(doc: dict, seq_len: int, overlong: str, name: str) -> None:
  """Refuse a document (named ``name``) whose image tokens run past ``seq_len``: an image
  cannot be cut, so only ``overlong='drop'`` (which skips it) lets it through."""
  if doc.get('images') is not None and doc.get('image_end', 0) > seq_len and overlong != 'drop':
    raise ValueError(
        f"{name}: the conversation's image tokens run to position {doc['image_end']}, past "
        f"seq_len={seq_len}; an image cannot be cut. Raise seq_len, or set "
        "DataConfig.overlong='drop'.")


def kept_targets(length: int, seq_len: int, overlong: str) -> int:
  """How many of a document's ``length`` targets its examples keep (from the start) under
  the ``overlong`` policy (``'error'``: all; reading such a document raises)."""
  if length <= seq_len or overlong in ('split', 'error'):
    return length
  return seq_len if overlong == 'truncate' else 0


class ExamplesIterDataset(grain.IterDataset):
  """Token documents -> ``{'inputs', 'targets'}`` examples of at most ``seq_len`` pairs.

  The parent yields dicts with ``ids`` (int32 ``[n]``) and ``where`` (a tuple
  that ``describe(*where)`` turns into the document's name, for errors), and
  optionally ``loss_mask`` (float32 ``[n]``, 1 on the ids trained on as targets):
  the examples then carry ``loss_mask`` aligned with ``targets``.
  Documents with fewer than two ids have no target and are skipped (counted as
  ``empty_skipped``).
  """

  def __init__(self, parent: grain.IterDataset, *, seq_len: int, overlong: str,
               describe=lambda *where: f'document {where}'):
    super().__init__(parent)
    self.seq_len, self.overlong, self.describe = seq_len, overlong, describe
    self.iterator: _ExamplesIterator | None = None  # the latest one, for its counts

  def __iter__(self):
    self.iterator = _ExamplesIterator(self._parent.__iter__(), self.seq_len, self.overlong,
                                      self.describe)
    return self.iterator

  def __getstate__(self):  # worker processes get the dataset, not the live iterator
    state = self.__dict__.copy()
    state['iterator'] = None
    return state

  def __str__(self) -> str:
    return f'ExamplesIterDataset(seq_len={self.seq_len}, overlong={self.overlong})'


class _ExamplesIterator(grain.DatasetIterator):
  """Yields the pieces of one document at a time; resumable mid-document."""

  def __init__(self, parent, seq_len: int, overlong: str, describe):
    super().__init__(parent)
    self.seq_len, self.overlong, self.describe = seq_len, overlong, describe
    self.counts = dict.fromkeys(COUNTS, 0)
    self._pieces: list[dict] = []
    self._next_piece = 0
    self._resume_piece = 0
    self._doc_state = None  # parent state before the current document
    self._counts_before: dict = dict(self.counts)

  def __next__(self) -> dict:
    while self._next_piece >= len(self._pieces):
      self._doc_state = self._parent.get_state()
      self._counts_before = dict(self.counts)
      self._pieces = self._examples(next(self._parent))
      self._next_piece, self._resume_piece = self._resume_piece, 0
    piece = self._pieces[self._next_piece]
    self._next_piece += 1
    return piece

  def _examples(self, doc: dict) -> list[dict]:
    ids = doc['ids']
    mask = doc.get('loss_mask')  # per id: 1 where that id is trained on as a target
    self.counts['documents'] += 1
    if len(ids) < 2:
      self.counts['empty_skipped'] += 1
      return []
    length = len(ids) - 1

    images = doc.get('images')  # [n, C, H, W]: they go with the piece holding their tokens

    def piece(start: int, end: int) -> dict:
      example = {'inputs': ids[start:end], 'targets': ids[start + 1:end + 1]}
      if mask is not None:
        example['loss_mask'] = mask[start + 1:end + 1]
      if images is not None:
        example['images'] = images if start == 0 else images[:0]
      return example

    if length <= self.seq_len:
      return [piece(0, length)]
    self.counts['overlong'] += 1
    check_image_fits(doc, self.seq_len, self.overlong, self.describe(*doc['where']))
    if self.overlong == 'error':
      raise ValueError(
          f"{self.describe(*doc['where'])}: the document has {length + 1} tokens "
          f"({length} targets), more than seq_len={self.seq_len}. Set DataConfig.overlong "
          "to 'split', 'truncate' or 'drop', or raise seq_len.")
    if self.overlong == 'drop':
      self.counts['overlong_dropped'] += 1
      self.counts['targets_dropped'] += length
      return []
    if self.overlong == 'truncate':
      self.counts['overlong_truncated'] += 1
      self.counts['targets_dropped'] += length - self.seq_len
      return [piece(0, self.seq_len)]
    starts = range(0, length, self.seq_len)
    self.counts['overlong_split_pieces'] += len(starts)
    return [piece(s, min(s + self.seq_len, length)) for s in starts]

  def get_state(self) -> dict:
    if self._next_piece < len(self._pieces):  # inside a split document
      return {'parent': self._doc_state, 'piece': self._next_piece,
              'counts': dict(self._counts_before)}
    return {'parent': self._parent.get_state(), 'piece': self._resume_piece,
            'counts': dict(self.counts)}

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state['parent'])
    self.counts = dict(state['counts'])
    self._pieces, self._next_piece, self._resume_piece = [], 0, state['piece']


def pad_example(example: dict, seq_len: int, images_per_row: int = 0) -> dict:
  """One example alone in a row: ids padded with 0, segment 1, positions 0.. (no packing).

  An example's ``images`` ``[n, C, H, W]`` become ``images_per_row`` of them, zero
  images after its own."""
  length = len(example['inputs'])
  row = {}
  if 'images' in example:
    images = example['images']
    row['images'] = np.zeros((images_per_row, *images.shape[1:]), np.float32)
    row['images'][:len(images)] = images
  for key in ('inputs', 'targets', 'loss_mask'):
    if key in example:
      row[key] = np.zeros(seq_len, np.float32 if key == 'loss_mask' else np.int32)
      row[key][:length] = example[key]
  row['inputs_segment_ids'] = (np.arange(seq_len) < length).astype(np.int32)
  row['inputs_positions'] = np.where(row['inputs_segment_ids'] == 1,
                                     np.arange(seq_len, dtype=np.int32), 0).astype(np.int32)
  return row


def pack(examples: grain.IterDataset, *, mode: str, seq_len: int, bins: int, seed: int,
         shuffle: bool, loss_mask: bool = False, images_per_row: int = 0) -> grain.IterDataset:
  """Rows ``{'inputs', 'targets', 'inputs_segment_ids', 'inputs_positions'}`` of ``seq_len``.

  ``mode`` is ``'first_fit'`` / ``'best_fit'`` (grain's packers, ``bins`` rows
  at a time, rows shuffled when ``shuffle``) or ``'none'`` (one example per row).
  ``loss_mask``: the examples carry a ``loss_mask``, packed (0 on padding) like
  ``targets``. ``images_per_row``: the examples carry ``images``, and rows get that
  many (see :func:`pad_example`); such rows are never packed.
  """
  if mode == 'none' or images_per_row:
    return examples.map(_PadExample(seq_len, images_per_row))
  packer = {'first_fit': grain.experimental.FirstFitPackIterDataset,
            'best_fit': grain.experimental.BestFitPackIterDataset}[mode]
  length_struct = {'inputs': seq_len, 'targets': seq_len}
  if loss_mask:
    length_struct['loss_mask'] = seq_len
  return packer(examples, length_struct=length_struct, num_packing_bins=bins, seed=seed,
                shuffle_bins=shuffle)


class _PadExample(grain.transforms.Map):
  """Picklable ``pad_example`` for grain workers."""

  def __init__(self, seq_len: int, images_per_row: int = 0):
    self.seq_len, self.images_per_row = seq_len, images_per_row

  def map(self, element: dict) -> dict:
    return pad_example(element, self.seq_len, self.images_per_row)


class ToBatch(grain.transforms.Map):
  """Packed rows (batched) -> the batch contract of :func:`maxnnx.data.make_pipeline`.

  ``loss_mask`` is 1 on every real target, times the rows' own ``loss_mask`` if
  they carry one.
  """

  def __init__(self, pad_id: int):
    self.pad_id = pad_id

  def map(self, rows: dict) -> dict:
    segment_ids = np.asarray(rows['inputs_segment_ids'], np.int32)
    real = segment_ids != 0
    images = {} if 'images' not in rows else {'pixel_values': np.asarray(rows['images'],
                                                                         np.float32)}
    return {**images,
        'inputs': np.where(real, rows['inputs'], self.pad_id).astype(np.int32),
        'targets': np.where(real, rows['targets'], self.pad_id).astype(np.int32),
        'segment_ids': segment_ids,
        'positions': np.where(real, rows['inputs_positions'], 0).astype(np.int32),
        'loss_mask': (real * np.asarray(rows.get('loss_mask', 1), np.float32)
                      ).astype(np.float32),
    }

"""Training batches: the dict the train step takes, synthetic batches, context reordering.

A batch is a dict of ``[batch, seq_len]`` arrays (:data:`BATCH_KEYS`): ``inputs`` and
``targets`` token ids, ``segment_ids`` and ``positions`` for packed documents, and a float
``loss_mask``. :func:`as_batch` fills in the optional ones. Image+text batches add
``pixel_values`` ``[batch, images_per_row, channels, H, W]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

BATCH_KEYS = ('inputs', 'targets', 'segment_ids', 'positions', 'loss_mask')
BATCH_AXES = ('activation_batch', 'activation_length')
IMAGE_AXES = ('activation_batch', None, None, None, None)  # pixel_values: split like the rows


def as_batch(batch: Any, extra: dict[str, Any] | None = None,
             image_shape: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
  """A training batch as the dict the step takes (see :data:`BATCH_KEYS`).

  Accepts the dict itself (``segment_ids``, ``positions`` and ``loss_mask`` are
  optional) or a ``[batch, seq_len + 1]`` array of token windows. ``extra``
  names further required ``[batch, seq_len]`` fields and their dtypes (an
  objective's :attr:`~maxnnx.train.objectives.Objective.batch_fields`).
  ``image_shape`` ``(images_per_row, channels, H, W)`` requires ``pixel_values``
  ``[batch, *image_shape]`` float32 (image+text training).
  """
  if not isinstance(batch, dict):
    windows = np.asarray(batch)
    if windows.ndim != 2 or windows.shape[1] < 2:
      raise ValueError(f'A token-window batch must be [batch, seq_len + 1], got {windows.shape}.')
    batch = {'inputs': windows[:, :-1], 'targets': windows[:, 1:]}
  missing = {'inputs', 'targets'} - set(batch)
  if missing:
    raise ValueError(f'Batch is missing {sorted(missing)}; it has {sorted(batch)}.')
  inputs = np.asarray(batch['inputs'], np.int32)
  if inputs.ndim != 2:
    raise ValueError(f"Batch 'inputs' must be [batch, seq_len], got {inputs.shape}.")
  b, t = inputs.shape
  out = {
      'inputs': inputs,
      'targets': np.asarray(batch['targets'], np.int32),
      'segment_ids': np.asarray(batch.get('segment_ids', np.ones((b, t))), np.int32),
      'positions': np.asarray(batch.get('positions', np.broadcast_to(np.arange(t), (b, t))),
                              np.int32),
      'loss_mask': np.asarray(batch.get('loss_mask', np.ones((b, t))), np.float32),
  }
  for key, dtype in (extra or {}).items():
    if key not in batch:
      raise ValueError(f'Batch is missing {key!r}, which the objective needs (its '
                       f'batch_fields are {sorted(extra)}); it has {sorted(batch)}.')
    out[key] = np.asarray(batch[key], dtype)
  for key, value in out.items():
    if value.shape != (b, t):
      raise ValueError(f"Batch '{key}' has shape {value.shape}, expected {(b, t)} like 'inputs'.")
  if image_shape is not None:
    if 'pixel_values' not in batch:
      raise ValueError("Batch is missing 'pixel_values' [batch, images_per_row, channels, H, W] "
                       '(TrainConfig.images_per_row > 0).')
    pixels = np.asarray(batch['pixel_values'], np.float32)
    if pixels.shape != (b, *image_shape):
      raise ValueError(f"Batch 'pixel_values' has shape {pixels.shape}, expected "
                       f'{(b, *image_shape)} (batch, TrainConfig.images_per_row, channels, H, W).')
    out['pixel_values'] = pixels
  elif 'pixel_values' in batch:
    raise ValueError("Batch has 'pixel_values' but TrainConfig.images_per_row is 0; set it to "
                     'the number of images in every row.')
  return out


def synthetic_batches(vocab_size: int, batch_size: int, seq_len: int,
                      seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """Endless batches of uniformly random tokens (for benchmarks and dry runs).

  The iterator has ``get_state()`` / ``set_state()``, so checkpoints resume it.
  """
  return _SyntheticBatches(vocab_size, batch_size, seq_len, seed)


class _SyntheticBatches:
  def __init__(self, vocab_size: int, batch_size: int, seq_len: int, seed: int):
    self.shape, self.vocab_size = (batch_size, seq_len + 1), vocab_size
    self.rng = np.random.default_rng(seed)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return as_batch(self.rng.integers(0, self.vocab_size, self.shape, dtype=np.int32))

  def get_state(self) -> dict:
    return {'rng': self.rng.bit_generator.state}

  def set_state(self, state: dict) -> None:
    self.rng.bit_generator.state = state['rng']


def context_permutation(seq_len: int, shards: int) -> np.ndarray:
  """Token order that balances causal attention over ``shards`` context shards.

  The sequence is cut into ``2 * shards`` chunks and shard ``i`` gets chunks
  ``i`` and ``2 * shards - 1 - i``: one early (cheap) and one late (expensive)
  chunk each. Positions travel with the tokens, so the model's masks and rotary
  embeddings are unchanged.
  """
  if seq_len % (2 * shards):
    return np.arange(seq_len)
  chunks = np.arange(seq_len).reshape(2 * shards, -1)
  order = [c for i in range(shards) for c in (chunks[i], chunks[2 * shards - 1 - i])]
  return np.concatenate(order)


class HeldOutBatches:
  """The same held-out batches at every evaluation: the first ones of an iterator of batches
  (a data pipeline over ``eval_data=``), drawn once and kept.

  Args:
    batches: an iterator of batches (as the Trainer's ``data`` takes them).
    name: what the batches are, for the error when there are too few.
  """

  def __init__(self, batches: Iterator, name: str):
    self._batches, self.name = batches, name
    self._kept: list = []

  def eval_batches(self, num_batches: int) -> list:
    """The first ``num_batches`` batches (drawn on first use)."""
    while len(self._kept) < num_batches:
      try:
        self._kept.append(next(self._batches))
      except StopIteration:
        raise ValueError(f'{self.name} gives {len(self._kept)} batches, fewer than the '
                         f'eval_batches={num_batches} each evaluation takes: lower '
                         'eval_batches or give more held-out data.') from None
    return self._kept[:num_batches]

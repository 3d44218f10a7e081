"""Preference data for DPO: ``{"prompt", "chosen", "rejected"}`` records -> pair batches.

Each record holds a prompt and two completions, the preferred ``chosen`` one and
the ``rejected`` one. The prompt is text or a message list; a completion is
text or a message list (the assistant's turns), as in TRL's preference
datasets. Each side is encoded like a prompt/completion SFT record
(:func:`maxnnx.data.chat.encode_prompt_completion`): the loss mask covers the
completion only.

Batches follow :data:`maxnnx.train.batches.BATCH_KEYS` with the layout
:class:`maxnnx.train.preference.DPOObjective` reads: rows come in pairs, row
``2i`` the chosen and row ``2i + 1`` the rejected sequence of pair ``i``, one
sequence per row (never packed), padded to ``seq_len`` with ``segment_ids`` 0
and ``loss_mask`` 0. A sequence longer than ``seq_len`` targets keeps its first
``seq_len`` (the end of the completion is cut, counted in ``stats``); a pair
whose prompt leaves no completion token inside the window is an error naming the
record. Data in which every record's ``chosen`` equals its ``rejected`` is refused before
any batch is made (:func:`check_preference_sources`).
"""

from __future__ import annotations

import hashlib

import grain
import numpy as np

from maxnnx.data.chat import ChatTemplate, encode_prompt_completion
from maxnnx.data.config import DataConfig
from maxnnx.data.pipeline import Pipeline, _jsonable, pipeline_arguments
from maxnnx.data.sft import record_dataset, resolve_tokenizer_and_template
from maxnnx.data.tokenizer import Tokenizer

PAIR_KEYS = ('prompt', 'chosen', 'rejected')


def check_preference_sources(sources) -> None:
  """Refuse preference data DPO cannot learn from, before any batch is made: a record
  without ``prompt``/``chosen``/``rejected`` is a ``ValueError`` naming its file and line,
  and so is a source whose every record has ``chosen`` equal to ``rejected`` (the loss
  then stays at log 2 with gradient 0); where only some have, a warning counts them."""
  for source in sources:
    same = []
    for index in range(len(source)):
      record = source[index]
      try:
        _check_pair_keys(record)
      except ValueError as e:
        raise ValueError(f'{source.describe(index)}: {e}') from None
      if record['chosen'] == record['rejected']:
        same.append(index)
    if len(same) == len(source):
      raise ValueError(f'{source.name}: "chosen" equals "rejected" in every record '
                       f'({len(same)}), so DPO has no preference to learn (its loss stays at '
                       'log 2, gradient 0). Check which columns hold the two completions.')
    if same:
      print(f'Warning: {source.name}: "chosen" equals "rejected" in {len(same)} of '
            f'{len(source)} records (the first: {source.describe(same[0])}); they train on '
            'nothing.')


def _check_pair_keys(record) -> None:
  if not isinstance(record, dict):
    raise ValueError(f'expected a JSON object, got {type(record).__name__}.')
  missing = [k for k in PAIR_KEYS if k not in record]
  if missing:
    raise ValueError(f'a preference record needs "prompt", "chosen" and "rejected"; missing '
                     f'{", ".join(repr(k) for k in missing)} (keys: {sorted(record)}).')


def encode_preference_record(tokenizer, template: ChatTemplate | None, record, *,
                             add_bos: bool = True, add_eos: bool = True
                             ) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
  """``((chosen ids, mask), (rejected ids, mask))`` of one preference record."""
  _check_pair_keys(record)
  return tuple(encode_prompt_completion(tokenizer, record['prompt'], record[side],
                                        template=template, add_bos=add_bos, add_eos=add_eos)
               for side in ('chosen', 'rejected'))


class EncodePair(grain.transforms.Map):
  """``(source, index, record)`` -> the pair's two rows as ``[2, seq_len]`` arrays."""

  def __init__(self, tokenizer, template, sources, *, seq_len: int, add_bos: bool,
               add_eos: bool, vocab_size: int, pad_id: int):
    self.tokenizer, self.template, self.sources = tokenizer, template, sources
    self.seq_len, self.add_bos, self.add_eos = seq_len, add_bos, add_eos
    self.vocab_size, self.pad_id = vocab_size, pad_id

  def map(self, element) -> dict:
    source, index, record = element
    where = self.sources[source].describe(index)
    try:
      sides = encode_preference_record(self.tokenizer, self.template, record,
                                       add_bos=self.add_bos, add_eos=self.add_eos)
    except ValueError as e:
      raise ValueError(f'{where}: {e}') from None
    rows = {k: np.zeros((2, self.seq_len), np.float32 if k == 'loss_mask' else np.int32)
            for k in ('inputs', 'targets', 'segment_ids', 'positions', 'loss_mask')}
    rows['inputs'][:] = self.pad_id
    rows['targets'][:] = self.pad_id
    truncated = 0
    for row, (side, (ids, mask)) in enumerate(zip(('chosen', 'rejected'), sides)):
      ids = np.asarray(ids, np.int32)
      if ids.size and ids.max() >= self.vocab_size:
        raise ValueError(f'{where}: token id {int(ids.max())} is outside the vocabulary '
                         f'[0, {self.vocab_size}).')
      if ids.size > self.seq_len + 1:
        truncated += 1
      ids, mask = ids[:self.seq_len + 1], np.asarray(mask[:self.seq_len + 1], np.float32)
      n = ids.size - 1
      if n < 1 or not mask[1:].any():
        raise ValueError(f'{where}: the {side} completion has no token within seq_len='
                         f'{self.seq_len} (the prompt fills the window); raise seq_len or '
                         'shorten the prompt.')
      rows['inputs'][row, :n], rows['targets'][row, :n] = ids[:-1], ids[1:]
      rows['segment_ids'][row, :n] = 1
      rows['positions'][row, :n] = np.arange(n)
      rows['loss_mask'][row, :n] = mask[1:]
    rows['truncated'] = np.int32(truncated)
    return rows


class _StackPairs:
  """``[pairs of {key: [2, T]}]`` -> ``{key: [2 * pairs, T]}`` with rows chosen, rejected, ..."""

  def __call__(self, pairs) -> dict:
    return {k: np.concatenate([p[k] for p in pairs]) for k in pairs[0] if k != 'truncated'}


class PreferencePipeline(Pipeline):
  """A :class:`Pipeline` of pair batches; ``stats`` counts pairs and truncated sequences."""

  def __init__(self, dataset, fingerprint: dict, counter: _PairCounter, **kwargs):
    super().__init__(dataset, None, fingerprint, **kwargs)
    self._counter = counter

  @property
  def stats(self) -> dict[str, int]:
    """``{'pairs': pairs read, 'truncated': sequences cut to seq_len}`` so far."""
    return dict(self._counter.counts)


class _PairCounter(grain.transforms.Map):
  def __init__(self):
    self.counts = {'pairs': 0, 'truncated': 0}

  def map(self, rows: dict) -> dict:
    self.counts['pairs'] += 1
    self.counts['truncated'] += int(rows['truncated'])
    return rows


def make_preference_pipeline(config: DataConfig | str, tokenizer: Tokenizer | str,
                             template: ChatTemplate | str | None = None, *, batch_size: int,
                             seq_len: int, seed: int = 0, shard_index: int | None = None,
                             shard_count: int | None = None, vocab_size: int | None = None
                             ) -> PreferencePipeline:
  """Pair batches for :class:`~maxnnx.train.preference.DPOObjective` from preference records.

  Args:
    config: a :class:`DataConfig` whose ``sources`` are JSONL / JSON / Parquet files of
      ``{"prompt", "chosen", "rejected"}`` records (``shuffle``, ``num_epochs``,
      ``weights``, ``add_bos``/``add_eos`` apply), or a path string.
    tokenizer: a tokenizer or a path for :func:`~maxnnx.data.load_tokenizer`.
    template: chat template for conversational records; default the one stored beside
      the tokenizer.
    batch_size: rows per batch, two per pair: must be even.
    seq_len, seed, shard_index, shard_count, vocab_size: as for
      :func:`maxnnx.data.make_pipeline`.
  """
  config, shard_index, shard_count = pipeline_arguments(
      'make_preference_pipeline', config, batch_size, seq_len, shard_index, shard_count)
  if batch_size % 2:
    raise ValueError(f'batch_size={batch_size}: preference batches hold (chosen, rejected) '
                     'row pairs, so the rows per process must be even.')
  tokenizer, template = resolve_tokenizer_and_template(tokenizer, template)
  vocab_size = vocab_size or tokenizer.vocab_size
  sources, ds = record_dataset(config, seed=seed, shard_index=shard_index,
                               shard_count=shard_count)
  check_preference_sources(sources)
  ds = ds.map(EncodePair(tokenizer, template, sources, seq_len=seq_len, add_bos=config.add_bos,
                         add_eos=config.add_eos, vocab_size=vocab_size,
                         pad_id=tokenizer.pad_id or 0))
  counter = _PairCounter()
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)).map(counter)
  batches = ds.batch(batch_size // 2, drop_remainder=True, batch_fn=_StackPairs())
  fingerprint = _jsonable({
      'kind': 'preference', 'config': config.to_dict(), 'batch_size': batch_size,
      'seq_len': seq_len, 'seed': seed, 'shard_index': shard_index,
      'shard_count': shard_count, 'vocab_size': vocab_size,
      'template': hashlib.sha256(template.source.encode()).hexdigest()[:16] if template else None})
  return PreferencePipeline(batches, fingerprint, counter, config=config, tokenizer=tokenizer,
                            batch_size=batch_size, seq_len=seq_len)


__all__ = ['PreferencePipeline', 'check_preference_sources', 'encode_preference_record',
           'make_preference_pipeline']

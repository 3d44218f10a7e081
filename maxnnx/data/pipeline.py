"""``make_pipeline``: one entry point from a :class:`DataConfig` to training batches.

The pipeline is a grain dataset graph, run in-process by default::

  per source:  documents -> this process's shard -> shuffle (per epoch) -> repeat
  mixed by weight -> tokenize (+BOS/EOS, id check) -> examples (overlong policy)
  -> pack into seq_len rows -> batch -> the batch contract

Batch contract (a dict of NumPy arrays, each ``[batch_size, seq_len]``):

* ``inputs`` (int32): token ids; ``pad_id`` (or 0) on padding.
* ``targets`` (int32): the next token of the same document.
* ``segment_ids`` (int32): 1, 2, ... per document packed in the row; 0 = padding.
* ``positions`` (int32): position of each token within its document (0 on padding).
* ``loss_mask`` (float32): 1 where the target counts, 0 on padding. A document
  is packed as its own (input, target) pairs, so no target crosses into the
  next document and every non-padding target counts.

Pass ``segment_ids`` and ``positions`` to the model so that packed documents do
not attend to each other, and weight the per-token loss by ``loss_mask``.
"""

from __future__ import annotations

import grain
import jax
import numpy as np

from maxnnx.config import ConfigError
from maxnnx.data import packing
from maxnnx.data.config import DataConfig
from maxnnx.data.sources import (
    SYNTHETIC,
    ArrayRecordSource,
    InMemorySource,
    SyntheticSource,
    resolve_source,
)
from maxnnx.data.streaming import BlockShuffle, StreamedSource, sliced_block_starts
from maxnnx.data.tokenizer import Tokenizer, load_tokenizer

_STATE_VERSION = 1


def _derived_seed(seed: int, *keys: int) -> int:
  return int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0])


class _Tokenize(grain.transforms.Map):
  """``(source, record, document)`` -> ``{'ids', 'where'}`` with BOS/EOS and an id check."""

  def __init__(self, tokenizer, sources, *, bos: int | None, eos: int | None, vocab_size: int):
    self.tokenizer, self.sources = tokenizer, sources
    self.bos, self.eos, self.vocab_size = bos, eos, vocab_size

  def map(self, element) -> dict:
    source, record, doc = element
    if isinstance(doc, str):
      if self.tokenizer is None:
        raise ValueError(f'{self.sources[source].describe(record)} is text but the pipeline '
                         'has no tokenizer: pass one to make_pipeline or set '
                         'DataConfig.tokenizer.')
      ids = np.asarray(self.tokenizer.encode(doc), np.int32)
    else:
      ids = np.asarray(doc, np.int32)
    if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
      bad = ids[(ids < 0) | (ids >= self.vocab_size)]
      raise ValueError(f'{self.sources[source].describe(record)}: token id {int(bad[0])} is '
                       f'outside the vocabulary [0, {self.vocab_size}); the data was '
                       'tokenized with another vocabulary, or the model is too small for '
                       'the tokenizer.')
    if ids.size:  # an empty document stays empty (and is skipped, counted)
      ids = np.concatenate([[self.bos] if self.bos is not None else [], ids,
                            [self.eos] if self.eos is not None else []]).astype(np.int32)
    return {'ids': ids, 'where': (source, record)}


def _tag(source_index: int, length: int):
  return lambda index, doc: (source_index, index % length, doc)


class Pipeline:
  """An iterator of training batches (see the module docstring for the contract).

  ``get_state()`` returns a JSON-serialisable dict; ``set_state`` on a pipeline
  made with the same config, tokenizer, sizes, seed and shard continues with
  exactly the batches that followed the saved state.

  Attributes:
    config: the :class:`DataConfig`.
    tokenizer: the tokenizer (``None`` for synthetic / pre-tokenized data without one).
    batch_size, seq_len: the batch shape.
  """

  def __init__(self, dataset: grain.IterDataset, examples: packing.ExamplesIterDataset,
               fingerprint: dict, *, config: DataConfig, tokenizer, batch_size: int,
               seq_len: int):
    self.config, self.tokenizer = config, tokenizer
    self.batch_size, self.seq_len = batch_size, seq_len
    self._examples = examples
    self._fingerprint = fingerprint
    self._iterator = iter(dataset)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def close(self) -> None:
    """Stop worker processes and prefetch threads (also on ``with make_pipeline(...)``)."""
    self._iterator.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()

  def get_state(self) -> dict:
    """The position in the data, as a JSON-serialisable dict."""
    return {'version': _STATE_VERSION, 'pipeline': dict(self._fingerprint),
            'iterator': self._iterator.get_state()}

  def set_state(self, state: dict) -> None:
    """Continue from a state returned by :meth:`get_state` of an identical pipeline."""
    if not isinstance(state, dict) or state.get('version') != _STATE_VERSION:
      raise ValueError('Not a maxnnx data pipeline state (expected a dict from '
                       'Pipeline.get_state()).')
    saved = state['pipeline']
    changed = {k: (saved.get(k), v) for k, v in self._fingerprint.items() if saved.get(k) != v}
    if changed:
      diff = ', '.join(f'{k}: saved {a!r}, now {b!r}' for k, (a, b) in changed.items())
      raise ValueError(f'The data state belongs to a different pipeline ({diff}); restore it '
                       'into a pipeline built with the same settings.')
    self._iterator.set_state(state['iterator'])

  @property
  def stats(self) -> dict[str, int]:
    """Counts of documents read so far (including those the packer holds).

    Keys: ``documents``, ``empty_skipped``, ``overlong`` (documents with more
    than ``seq_len`` targets), ``overlong_split_pieces``, ``overlong_truncated``,
    ``overlong_dropped``, ``targets_dropped`` (by truncation or dropping).
    With ``worker_count > 0`` the counts live in the worker processes and are
    not available here.
    """
    iterator = self._examples.iterator
    if self.config.worker_count or iterator is None:
      raise RuntimeError('Pipeline.stats is only available in-process (worker_count=0).')
    return dict(iterator.counts)


def _files_per_process(resolved, config: DataConfig, shard_index: int,
                       shard_count: int) -> tuple[tuple[str, ...], bool]:
  """``(files this process reads, whether documents are still to be sharded)`` of a source
  (``DataConfig.shard_by``)."""
  by_file = resolved.kind in ('text', 'jsonl', 'parquet') and shard_count > 1 and (
      config.shard_by == 'file' or (config.shard_by == 'auto' and config.num_epochs is None
                                    and len(resolved.files) >= shard_count))
  if not by_file:
    return resolved.files, True
  if len(resolved.files) < shard_count:
    raise ValueError(f'data source {resolved.spec!r} has {len(resolved.files)} files, fewer '
                     f'than shard_count={shard_count}: DataConfig.shard_by=file needs one per '
                     "process at least (shard_by='document' shares documents instead).")
  return resolved.files[shard_index::shard_count], False


def _make_source(resolved, config: DataConfig, *, vocab_size: int, seq_len: int, extras: int,
                 seed: int, index: int, files: tuple[str, ...] | None = None):
  if resolved.kind == SYNTHETIC:
    max_length = max(1, seq_len + 1 - extras)
    return SyntheticSource(vocab_size, max_length=max_length, min_length=max(1, 2 - extras),
                           num_documents=config.synthetic_documents,
                           seed=_derived_seed(seed, index, 1))
  if resolved.kind == 'array_record':
    return ArrayRecordSource(resolved.files, pretokenized=config.pretokenized)
  if config.streaming:
    if resolved.kind == 'text':
      raise ValueError(f'data source {resolved.spec!r}: DataConfig.streaming reads JSONL and '
                       'Parquet; text files are read whole. Set streaming=false, or convert '
                       'the text to ArrayRecord (python -m maxnnx.data.convert).')
    return StreamedSource(resolved.files if files is None else files, resolved.kind,
                          column=config.column, pretokenized=config.pretokenized)
  return InMemorySource(resolved.files if files is None else files, resolved.kind,
                        column=config.column,
                        pretokenized=config.pretokenized, text_split=config.text_split)


def pipeline_arguments(caller: str, config: DataConfig | str, batch_size: int, seq_len: int,
                       shard_index: int | None, shard_count: int | None,
                       **from_string) -> tuple[DataConfig, int, int]:
  """The checked arguments every pipeline builder takes: ``(config, shard_index, shard_count)``.

  A string ``config`` is parsed with :meth:`DataConfig.from_string` (``from_string`` its
  keyword arguments); the shard defaults are this process's index and the process count.

  Raises:
    ConfigError, ValueError: naming ``caller`` and the argument to fix.
  """
  if isinstance(config, str):
    config = DataConfig.from_string(config, **from_string)
  if not isinstance(config, DataConfig):
    raise ConfigError(f'{caller} needs a DataConfig or a string, got {type(config).__name__}.')
  for name, value in (('batch_size', batch_size), ('seq_len', seq_len)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f'{name} must be a positive int, got {value!r}.')
  shard_index = jax.process_index() if shard_index is None else shard_index
  shard_count = jax.process_count() if shard_count is None else shard_count
  if not 0 <= shard_index < shard_count:
    raise ValueError(f'shard_index={shard_index} must be in [0, shard_count={shard_count}).')
  return config, shard_index, shard_count


def make_pipeline(config: DataConfig | str, tokenizer: Tokenizer | str | None = None, *,
                  batch_size: int, seq_len: int, seed: int = 0, shard_index: int | None = None,
                  shard_count: int | None = None, vocab_size: int | None = None) -> Pipeline:
  """Build the training batch iterator described by ``config``.

  Args:
    config: a :class:`DataConfig`, or a string for :meth:`DataConfig.from_string`
      (``'synthetic'``, a path, comma-separated paths).
    tokenizer: a tokenizer object or a path for :func:`load_tokenizer`; default
      ``config.tokenizer``. Needed for text; optional for synthetic and
      pre-tokenized data (then no BOS/EOS are added).
    batch_size: rows per batch on this process (a finite pipeline drops its last,
      partial batch).
    seq_len: tokens per row.
    seed: seed of document order, packing order and synthetic data.
    shard_index, shard_count: this process reads documents
      ``shard_index::shard_count`` of every source, or its files
      ``shard_index::shard_count`` (``DataConfig.shard_by``); default
      ``jax.process_index()`` / ``jax.process_count()``.
    vocab_size: the model's vocabulary size: every id must be below it (default
      the tokenizer's). Required for synthetic data without a tokenizer.

  Raises:
    ConfigError, ValueError, FileNotFoundError: with the field or file to fix.
  """
  config, shard_index, shard_count = pipeline_arguments(
      'make_pipeline', config, batch_size, seq_len, shard_index, shard_count)

  tokenizer, vocab_size = _tokenizer_and_vocab(config, tokenizer, vocab_size)
  bos = eos = None
  if tokenizer is not None:
    bos = _special(tokenizer, 'bos_id', config.add_bos)
    eos = _special(tokenizer, 'eos_id', config.add_eos)

  resolved = [resolve_source(spec, config.kind, split=config.split, config_name=config.config_name)
              for spec in config.sources]
  sources, datasets = [], []
  for i, res in enumerate(resolved):
    source, ds = _source_dataset(res, i, config, tokenizer, vocab_size=vocab_size,
                                 seq_len=seq_len, extras=(bos is not None) + (eos is not None),
                                 seed=seed, shard_index=shard_index, shard_count=shard_count)
    sources.append(source)
    datasets.append(ds)
  ds = datasets[0] if len(datasets) == 1 else grain.MapDataset.mix(datasets, config.weights)
  ds = ds.map(_Tokenize(tokenizer, sources, bos=bos, eos=eos, vocab_size=vocab_size))
  examples, rows = pack_examples(ds, sources, config, seq_len=seq_len, batch_size=batch_size,
                                 seed=seed)
  pad = (tokenizer.pad_id if tokenizer is not None else None) or 0
  batches = batch_rows(rows, batch_size, pad, config.worker_count)
  fingerprint = {'config': config.to_dict(), 'batch_size': batch_size, 'seq_len': seq_len,
                 'seed': seed, 'shard_index': shard_index, 'shard_count': shard_count,
                 'vocab_size': vocab_size}
  fingerprint = _jsonable(fingerprint)
  return Pipeline(batches, examples, fingerprint, config=config, tokenizer=tokenizer,
                  batch_size=batch_size, seq_len=seq_len)


def _tokenizer_and_vocab(config: DataConfig, tokenizer, vocab_size: int | None):
  """``(tokenizer or None, vocab_size)`` of :func:`make_pipeline`: the tokenizer given, else
  ``config.tokenizer``, loaded from a path; the vocabulary size given (which the tokenizer's
  must not exceed), else the tokenizer's."""
  tokenizer = tokenizer if tokenizer is not None else (config.tokenizer or None)
  if isinstance(tokenizer, str):
    tokenizer = load_tokenizer(tokenizer)
  if tokenizer is not None:
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
      raise ValueError(f'The tokenizer has {tokenizer.vocab_size} tokens but the model only '
                       f'{vocab_size} (vocab_size): its ids would fall outside the model. Use '
                       'the tokenizer the model was made for, or a larger vocab_size.')
    vocab_size = vocab_size or tokenizer.vocab_size
  if vocab_size is None:
    raise ValueError('make_pipeline needs a tokenizer or vocab_size= (the model vocabulary) '
                     'to know the valid token ids.')
  return tokenizer, vocab_size


def _source_dataset(res, i: int, config: DataConfig, tokenizer, *, vocab_size: int, seq_len: int,
                    extras: int, seed: int, shard_index: int, shard_count: int):
  """``(source, dataset)`` of the ``i``-th resolved source: this process's documents (or
  files), tagged with the source, shuffled as ``config`` says and repeated for its epochs."""
  files, by_document = _files_per_process(res, config, shard_index, shard_count)
  source = _make_source(res, config, vocab_size=vocab_size, seq_len=seq_len, extras=extras,
                        seed=seed, index=i, files=files)
  if res.kind not in (SYNTHETIC, 'array_record') and not config.pretokenized \
      and tokenizer is None:
    raise ValueError(f'data source {res.spec!r} is text: pass a tokenizer to make_pipeline '
                     'or set DataConfig.tokenizer.')
  if by_document and len(source) < shard_count:
    raise ValueError(f'data source {res.spec!r} has {len(source)} documents, fewer than '
                     f'shard_count={shard_count}: every process needs at least one.')
  ds = grain.MapDataset.source(source).map_with_index(_tag(i, len(source)))
  blocks = getattr(source, 'block_starts', None)  # a streamed source: shuffle within blocks
  if by_document:
    ds = ds[shard_index::shard_count]
    if blocks is not None:
      blocks = sliced_block_starts(blocks, len(source), shard_index, shard_count)
  if config.shuffle:
    ds = (BlockShuffle(ds, blocks, _derived_seed(seed, i, 2)) if blocks is not None
          else ds.shuffle(seed=_derived_seed(seed, i, 2)))
  return source, ds.repeat(config.num_epochs)


def pack_examples(ds: grain.MapDataset, sources: list, config: DataConfig, *, seq_len: int,
                  batch_size: int, seed: int, **pack_options):
  """``(examples, rows)``: the encoded documents of ``ds`` (``{'ids', 'where', ...}``) as
  examples under ``config.overlong`` (named by ``sources[i].describe``), packed into
  ``seq_len`` rows by ``config.packing``; ``pack_options`` go to :func:`packing.pack`."""
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  examples = packing.ExamplesIterDataset(
      ds, seq_len=seq_len, overlong=config.overlong,
      describe=lambda source, index: sources[source].describe(index))
  rows = packing.pack(examples, mode=config.packing, seq_len=seq_len,
                      bins=config.packing_bins or batch_size, seed=_derived_seed(seed, 3),
                      shuffle=config.shuffle, **pack_options)
  return examples, rows


def batch_rows(rows, batch_size: int, pad_id: int, worker_count: int):
  """Packed ``rows`` as batches of the batch contract, run by ``worker_count`` grain worker
  processes (0: in this process)."""
  batches = rows.batch(batch_size, drop_remainder=True).map(packing.ToBatch(pad_id))
  if not worker_count:
    return batches
  from absl import flags  # noqa: PLC0415
  if not flags.FLAGS.is_parsed():  # grain's worker code reads absl flags; use their defaults
    flags.FLAGS.mark_as_parsed()
  return batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))


def _special(tokenizer, attribute: str, wanted: bool) -> int | None:
  if not wanted:
    return None
  value = getattr(tokenizer, attribute)
  if value is None:
    field = 'add_bos' if attribute == 'bos_id' else 'add_eos'
    raise ValueError(f'DataConfig.{field}=True but the tokenizer has no {attribute[:3].upper()} '
                     f'token; set {field}=False or give the tokenizer one.')
  return int(value)


def _jsonable(value):
  if isinstance(value, dict):
    return {k: _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  return value

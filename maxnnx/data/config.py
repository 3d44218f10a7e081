"""``DataConfig``: where training documents come from and how they become batches.

A typed, validated frozen dataclass like :class:`maxnnx.config.ModelConfig`:
every field is type-checked, ``from_dict`` rejects unknown keys with the nearest
valid name, and :meth:`DataConfig.from_string` turns the CLI's
``data=synthetic|<path>`` into a config.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from maxnnx.config import ConfigError, ValidatedConfig

SourceKind = Literal['auto', 'text', 'jsonl', 'parquet', 'array_record', 'synthetic']
Packing = Literal['first_fit', 'best_fit', 'none']
Overlong = Literal['split', 'truncate', 'drop', 'error']
TextSplit = Literal['blank_lines', 'lines', 'file']
ShardBy = Literal['auto', 'document', 'file']


@dataclasses.dataclass(frozen=True)
class DataConfig(ValidatedConfig):
  """Documents, tokenization, packing and order of a training data pipeline.

  Attributes:
    sources: source specs, each ``'synthetic'``, a file, a directory (Hugging
      Face datasets layout) or a glob; see :mod:`maxnnx.data.sources`.
    weights: relative sampling weight of each source (``None``: equal). Sources
      are interleaved deterministically in these proportions.
    kind: the format of every source; ``'auto'`` tells it from file names.
    column: the JSONL / Parquet field holding each document.
    pretokenized: documents are token ids (lists of ints in ``column``, int32
      ArrayRecord records) and are not tokenized again.
    text_split: what one document of a ``.txt`` file is: a block between blank
      lines, one line, or the whole file.
    split: the split read from a directory laid out as a Hugging Face Hub dataset
      (``data/train-00000-of-00002.parquet``, ``test.jsonl``, a README's ``configs``;
      see :mod:`maxnnx.data.hub_layout`); ``'validation|test'`` reads the first of these
      it has. A directory that names no splits, a file and a glob are read whole.
    config_name: the config (subset) of such a dataset, as its README names it (``''``:
      its default config).
    tokenizer: path for :func:`~maxnnx.data.tokenizer.load_tokenizer` (``''``:
      pass a tokenizer to ``make_pipeline``, or use synthetic/pre-tokenized data).
    add_bos: start every document with the tokenizer's BOS id.
    add_eos: end every document with the tokenizer's EOS id.
    packing: ``'first_fit'`` / ``'best_fit'`` pack several documents per row
      (grain's packers, ``packing_bins`` rows at a time); ``'none'`` puts one
      document per row and pads the rest.
    packing_bins: rows the packer fills at once (0: the batch size). More bins
      waste less padding but mix documents of further-apart reads.
    overlong: a document with more than ``seq_len`` targets is ``'split'`` into
      pieces (each its own segment, positions restarting at 0), ``'truncate'``-d
      to its first ``seq_len``, ``'drop'``-ped, or an ``'error'``. The pipeline
      counts each case (``Pipeline.stats``).
    shuffle: shuffle documents (reshuffled every epoch) and packed rows.
    num_epochs: passes over the data (``None``: repeat forever).
    shard_by: how the processes of a multi-process run share a text / JSONL / Parquet
      source. ``'document'``: every process reads every file and keeps every
      ``shard_count``-th document. ``'file'``: each process reads only every
      ``shard_count``-th file (it holds about ``1/shard_count`` of the data in memory;
      needs at least one file per process; processes may hold unequal numbers of
      documents). ``'auto'``: by file when the source has a file per process and the data
      repeats forever (``num_epochs=None``, so no process runs out first), else by
      document. ArrayRecord and synthetic sources read only what they serve either way.
    streaming: read JSONL and Parquet sources block by block as the pipeline reaches them
      (a Parquet row group, or 1024 JSON lines) instead of into memory first: for data
      larger than memory, in a bucket or on the Hub. Documents are then shuffled within
      blocks and the blocks among themselves, every epoch (see
      :mod:`maxnnx.data.streaming`). ArrayRecord is always read record by record; text
      files and the fine-tuning recipes' records are read whole.
    synthetic_documents: how many distinct documents the synthetic source has.
    worker_count: grain worker processes (0: in-process; on small data workers
      were measured about 10x slower than in-process). Each worker packs its own
      slice of the documents, so the batch order depends on ``worker_count`` (it
      is still deterministic and resumable).
  """

  sources: tuple[str, ...] = ('synthetic',)
  weights: tuple[float, ...] | None = None
  kind: SourceKind = 'auto'
  column: str = 'text'
  pretokenized: bool = False
  text_split: TextSplit = 'blank_lines'
  split: str = 'train'
  config_name: str = ''
  tokenizer: str = ''
  add_bos: bool = True
  add_eos: bool = True
  packing: Packing = 'first_fit'
  packing_bins: int = 0
  overlong: Overlong = 'split'
  shuffle: bool = True
  num_epochs: int | None = None
  shard_by: ShardBy = 'auto'
  streaming: bool = False
  synthetic_documents: int = 100_000
  worker_count: int = 0

  def _validate(self):
    if not self.sources or any(not s for s in self.sources):
      raise ConfigError('DataConfig.sources needs at least one non-empty source '
                        "('synthetic' or a path).")
    if self.weights is not None:
      if len(self.weights) != len(self.sources):
        raise ConfigError(f'DataConfig.weights has {len(self.weights)} values for '
                          f'{len(self.sources)} sources; give one weight per source.')
      if any(w <= 0 for w in self.weights):
        raise ConfigError(f'DataConfig.weights must all be > 0, got {self.weights}.')
    if not self.split.strip('| '):
      raise ConfigError("DataConfig.split must name a split, e.g. 'train' or 'validation|test'.")
    if not self.column:
      raise ConfigError("DataConfig.column must name a field, e.g. 'text'.")
    if self.packing_bins < 0:
      raise ConfigError(f'DataConfig.packing_bins must be >= 0, got {self.packing_bins}.')
    if self.num_epochs is not None and self.num_epochs < 1:
      raise ConfigError(f'DataConfig.num_epochs must be >= 1 or None (forever), '
                        f'got {self.num_epochs}.')
    if self.synthetic_documents < 1:
      raise ConfigError('DataConfig.synthetic_documents must be >= 1.')
    if self.worker_count < 0:
      raise ConfigError(f'DataConfig.worker_count must be >= 0, got {self.worker_count}.')

  @classmethod
  def from_string(cls, data: str, **fields) -> DataConfig:
    """A config for ``data='synthetic'``, a path, or comma-separated paths.

    ``fields`` set any other field (``DataConfig.from_string('a.jsonl',
    column='content')``).
    """
    sources = tuple(s.strip() for s in data.split(',') if s.strip())
    if not sources:
      raise ConfigError("data= needs 'synthetic' or a path to a text, JSONL, Parquet or "
                        'ArrayRecord file or directory.')
    return cls.from_dict({'sources': sources, **fields})

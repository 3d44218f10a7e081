"""Streamed JSONL and Parquet sources (``DataConfig.streaming``): the documents the in-memory
source reads, a block read once an epoch, block-local shuffling, resume, and buckets."""

import json

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maxnnx.data import DataConfig, make_pipeline
from maxnnx.data import streaming as streaming_module
from maxnnx.data.sources import InMemorySource
from maxnnx.data.streaming import BlockShuffle, StreamedSource, sliced_block_starts
from tests.test_data_remote import _ByteTokenizer, _upload, bucket  # noqa: F401 (a fixture)


def _docs(count: int, seed: int) -> list[str]:
  rng = np.random.default_rng(seed)
  return [f'doc {i} ' + 'ab' * int(rng.integers(1, 9)) for i in range(count)]


def _write_jsonl(path, docs, blank_every: int = 0) -> None:
  lines = []
  for i, doc in enumerate(docs):
    lines.append(json.dumps({'text': doc, 'id': i}))
    if blank_every and i % blank_every == 0:
      lines.append('')  # blank lines are skipped, and line numbers still count them
  path.write_text('\n'.join(lines) + '\n')


def _write_parquet(path, docs, row_group_size: int) -> None:
  pq.write_table(pa.table({'text': docs}), path, row_group_size=row_group_size)


@pytest.fixture
def small_blocks(monkeypatch):
  monkeypatch.setattr(streaming_module, 'JSONL_BLOCK_LINES', 7)


@pytest.fixture
def made(monkeypatch):
  """The streamed sources the pipelines of a test build, in order."""
  from maxnnx.data import pipeline as pipeline_module
  sources = []

  class Recorded(StreamedSource):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      sources.append(self)

  monkeypatch.setattr(pipeline_module, 'StreamedSource', Recorded)
  return sources


@pytest.mark.parametrize('kind', ['jsonl', 'parquet'])
def test_a_streamed_source_holds_the_in_memory_sources_documents(tmp_path, small_blocks, kind):
  files = []
  for n in range(2):
    path = tmp_path / f'part-{n}.{kind}'
    docs = _docs(23 + n * 5, seed=n)
    if kind == 'jsonl':
      _write_jsonl(path, docs, blank_every=4)
    else:
      _write_parquet(path, docs, row_group_size=7)
    files.append(str(path))
  whole = InMemorySource(files, kind)
  streamed = StreamedSource(files, kind)
  assert len(streamed) == len(whole) == 23 + 28
  assert [streamed[i] for i in range(len(whole))] == [whole[i] for i in range(len(whole))]
  assert [streamed.describe(i) for i in range(len(whole))] == [
      whole.describe(i) for i in range(len(whole))]
  # 23 documents in blocks of 7: 7, 7, 7, 2; then 28: 7 x 4.
  assert streamed.block_starts == [0, 7, 14, 21, 23, 30, 37, 44]
  assert streamed.blocks_read == 8  # in order, each block read once


def test_a_block_is_read_only_when_reached_and_the_cache_is_bounded(tmp_path, small_blocks):
  path = tmp_path / 'a.jsonl'
  _write_jsonl(path, _docs(70, seed=3))
  source = StreamedSource([str(path)], 'jsonl')
  assert source.blocks_read == 0  # the index holds offsets, no documents
  source[0], source[1], source[6]
  assert source.blocks_read == 1
  source[69], source[0]
  assert source.blocks_read == 2  # the first block is still cached
  source[35], source[69], source[0]
  assert source.blocks_read == 5  # two blocks kept: 69's and 0's were read again
  assert len(source._cache) <= streaming_module.CACHED_BLOCKS


def test_block_shuffle_is_a_per_epoch_permutation_within_blocks(tmp_path):
  import grain
  starts = [0, 5, 12, 13, 20]
  ds = BlockShuffle(grain.MapDataset.range(26), starts, seed=7)
  bounds = starts + [26]
  block_of = {i: b for b in range(len(starts)) for i in range(bounds[b], bounds[b + 1])}
  epochs = [[ds[e * 26 + i] for i in range(26)] for e in range(3)]  # range wraps
  for order in epochs:
    assert sorted(order) == list(range(26))
    runs = [block_of[i] for i in order]  # each block's elements come together
    assert [b for k, b in enumerate(runs) if k == 0 or runs[k - 1] != b] == sorted(
        set(runs), key=runs.index)
  assert epochs[0] != epochs[1] != epochs[2]
  again = BlockShuffle(grain.MapDataset.range(26), starts, seed=7)
  assert [again[i] for i in range(26)] == [ds[i] for i in range(26)]
  assert [ds[i] for i in range(26)] != [BlockShuffle(grain.MapDataset.range(26), starts,
                                                     seed=8)[i] for i in range(26)]


def test_sliced_block_starts_follow_the_slice():
  # range(20)[1::3] = 1, 4, 7, 10, 13, 16, 19; blocks start at 0, 5, 9, 15.
  assert sliced_block_starts([0, 5, 9, 15], 20, 1, 3) == [0, 2, 3, 5]
  assert sliced_block_starts([0, 2, 3], 4, 0, 4) == [0]  # only one element survives
  assert sliced_block_starts([0, 4, 8], 12, 0, 1) == [0, 4, 8]


def _batches(config, count, **kwargs):
  pipeline = make_pipeline(config, _ByteTokenizer(), batch_size=2, seq_len=24, seed=5,
                           shard_index=kwargs.pop('shard_index', 0),
                           shard_count=kwargs.pop('shard_count', 1))
  return pipeline, [next(pipeline) for _ in range(count)]


def test_an_unshuffled_streamed_pipeline_gives_the_in_memory_batches(tmp_path, small_blocks):
  path = tmp_path / 'a.parquet'
  _write_parquet(path, _docs(40, seed=1), row_group_size=6)
  plain = DataConfig(sources=(str(path),), shuffle=False)
  _, want = _batches(plain, 6)
  _, got = _batches(DataConfig(sources=(str(path),), shuffle=False, streaming=True), 6)
  for a, b in zip(want, got):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_a_shuffled_streamed_pipeline_reads_each_block_once_an_epoch_and_resumes(
    tmp_path, small_blocks, made):
  path = tmp_path / 'a.jsonl'
  _write_jsonl(path, _docs(60, seed=2))
  config = DataConfig(sources=(str(path),), streaming=True, packing='none', num_epochs=1)
  _, batches = _batches(config, 29)
  source = made[0]
  assert source.blocks_read == len(source.block_starts) == 9  # 60 lines in blocks of 7
  firsts = [bytes(int(t) - 1 for t in row if 0 < t < 257).decode()
            for batch in batches for row in batch['inputs']]
  assert len(set(firsts)) == 58 and firsts[:7] != sorted(firsts[:7])  # shuffled, no repeats

  first, _ = _batches(DataConfig(sources=(str(path),), streaming=True), 0)
  for _ in range(4):
    next(first)
  state = json.loads(json.dumps(first.get_state()))
  expected = [next(first) for _ in range(3)]
  resumed, _ = _batches(DataConfig(sources=(str(path),), streaming=True), 0)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


def test_streaming_from_a_bucket_with_processes_sharing_documents(bucket, tmp_path):  # noqa: F811
  sink = pa.BufferOutputStream()
  pq.write_table(pa.table({'text': _docs(30, seed=4)}), sink, row_group_size=8)
  url = _upload(bucket, {'train.parquet': sink.getvalue().to_pybytes()})
  config = DataConfig(sources=(f'{url}/train.parquet',), streaming=True, packing='none',
                      num_epochs=1, shard_by='document')
  seen = []
  for index in range(2):
    pipeline, batches = _batches(config, 7, shard_index=index, shard_count=2)
    seen += [bytes(int(t) - 1 for t in row if 0 < t < 257).decode()
             for batch in batches for row in batch['inputs']]
  assert len(seen) == len(set(seen)) == 28 and set(seen) <= set(_docs(30, seed=4))
  assert fsspec.filesystem('memory').exists(f'/{bucket}/shards/train.parquet')


def test_streaming_refuses_what_it_cannot_stream(tmp_path):
  (tmp_path / 'a.json').write_text(json.dumps([{'text': 'x'}]))
  with pytest.raises(ValueError, match='a JSON list cannot be streamed'):
    StreamedSource([str(tmp_path / 'a.json')], 'jsonl')
  (tmp_path / 'b.txt').write_text('some text\n')
  with pytest.raises(ValueError, match='streaming reads JSONL and Parquet'):
    _batches(DataConfig(sources=(str(tmp_path / 'b.txt'),), streaming=True), 1)
  _write_jsonl(tmp_path / 'c.jsonl', ['x'])
  with pytest.raises(ValueError, match="no column 'body'"):
    StreamedSource([str(tmp_path / 'c.jsonl')], 'jsonl', column='body')[0]
  _write_parquet(tmp_path / 'd.parquet', ['x'], row_group_size=1)
  with pytest.raises(ValueError, match="no column 'body'"):
    StreamedSource([str(tmp_path / 'd.parquet')], 'parquet', column='body')

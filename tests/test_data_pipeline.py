"""make_pipeline: the batch contract, packing isolation in a real model, determinism,
sharding, checkpointable state, mixtures and the bad-input policies."""

import json
import os

import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import ConfigError
from maxnnx.data import DEFAULT_CORPUS, DataConfig, make_pipeline

KEYS = ('inputs', 'targets', 'segment_ids', 'positions', 'loss_mask')


class ByteTokenizer:
  """UTF-8 bytes as ids; BOS 256, EOS 257: simple enough to check every batch by hand."""
  vocab_size, bos_id, eos_id, pad_id = 258, 256, 257, None

  def encode(self, text):
    return list(text.encode('utf-8'))

  def decode(self, ids):
    return bytes(int(i) for i in ids if i < 256).decode('utf-8', errors='replace')


def _write_jsonl(path, texts, column='text'):
  path.write_text(''.join(json.dumps({column: t}) + '\n' for t in texts))
  return str(path)


def _random_texts(rng, n, low=3, high=40):
  letters = np.array(list('abcdefghij klmnopqrstuvwxyz'))
  return [''.join(rng.choice(letters, rng.integers(low, high))) for _ in range(n)]


def _segments(batch):
  """Each packed document of a batch as (inputs, targets, positions) arrays."""
  out = []
  for row in range(batch['inputs'].shape[0]):
    seg = batch['segment_ids'][row]
    for s in np.unique(seg[seg > 0]):
      where = seg == s
      out.append((batch['inputs'][row][where], batch['targets'][row][where],
                  batch['positions'][row][where]))
  return out


def test_batches_follow_the_contract(tmp_path):
  """Dtypes, shapes; each segment is one whole document: BOS + bytes + EOS, shifted by one."""
  rng = np.random.default_rng()
  texts = _random_texts(rng, 60)
  path = _write_jsonl(tmp_path / 'd.jsonl', texts)
  pipe = make_pipeline(path, ByteTokenizer(), batch_size=4, seq_len=64, seed=int(rng.integers(99)))
  expected = {tuple([256, *t.encode(), 257]) for t in texts}
  for _ in range(5):
    batch = next(pipe)
    assert set(batch) == set(KEYS)
    for key in KEYS:
      assert batch[key].shape == (4, 64)
      assert batch[key].dtype == (np.float32 if key == 'loss_mask' else np.int32)
    np.testing.assert_array_equal(batch['loss_mask'], batch['segment_ids'] > 0)
    pad = batch['segment_ids'] == 0
    assert not batch['inputs'][pad].any() and not batch['positions'][pad].any()
    for row in batch['segment_ids']:  # segments are numbered 1, 2, ... then padding
      ids = row[row > 0]
      assert ids[0] == 1 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
      assert np.all(row[np.argmax(row == 0):] == 0) if (row == 0).any() else True
    for inputs, targets, positions in _segments(batch):
      np.testing.assert_array_equal(positions, np.arange(len(inputs)))
      np.testing.assert_array_equal(inputs[1:], targets[:-1])
      assert (*inputs, targets[-1]) in expected


def test_packed_documents_do_not_attend_to_each_other():
  """Logits of each packed document equal those of the document run alone."""
  cfg = maxnnx.get_preset('tiny')
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))
  pipe = make_pipeline(DataConfig(packing='best_fit'), batch_size=2, seq_len=48,
                       vocab_size=cfg.vocab_size, seed=int(np.random.default_rng().integers(99)))
  # Some synthetic documents fill a whole row; take the first batch where two share one.
  batch = next(b for b, _ in zip(pipe, range(50)) if b['segment_ids'].max() >= 2)
  forward = nnx.jit(lambda m, ids, seg, pos: m(ids, segment_ids=seg, positions=pos))
  packed = forward(model, batch['inputs'], batch['segment_ids'], batch['positions'])
  docs = []
  for row in range(2):
    seg = batch['segment_ids'][row]
    docs += [batch['inputs'][row][seg == s] for s in np.unique(seg[seg > 0])]
  # Each document alone, at the start of its own row; what follows it cannot reach it
  # under plain causal attention (one segment, positions 0..47: the model's defaults).
  alone_ids = np.zeros((len(docs), 48), np.int32)
  for i, doc in enumerate(docs):
    alone_ids[i, :len(doc)] = doc
  plain_seg, plain_pos = np.ones((len(docs), 48), np.int32), np.tile(np.arange(48), (len(docs), 1))
  alone = np.asarray(forward(model, alone_ids, plain_seg, plain_pos))
  i = 0
  for row in range(2):
    seg = batch['segment_ids'][row]
    for s in np.unique(seg[seg > 0]):
      np.testing.assert_allclose(np.asarray(packed[row][seg == s]), alone[i, :len(docs[i])],
                                 atol=2e-5, rtol=1e-5)
      i += 1
  # Without segment ids the same rows give different logits: the check above can fail.
  mixed = forward(model, batch['inputs'], plain_seg[:2], plain_pos[:2])
  assert not np.allclose(np.asarray(mixed), np.asarray(packed), atol=1e-3)
  assert len(docs) >= 3


def test_no_packing_pads_one_document_per_row(tmp_path):
  texts = _random_texts(np.random.default_rng(), 12)
  path = _write_jsonl(tmp_path / 'd.jsonl', texts)
  pipe = make_pipeline(DataConfig.from_string(path, packing='none', shuffle=False, num_epochs=1),
                       ByteTokenizer(), batch_size=3, seq_len=64)
  rows = [b for b in pipe]
  assert len(rows) == 4  # 12 documents, 3 per batch, in file order
  for i, batch in enumerate(rows):
    for r in range(3):
      ids = [256, *texts[3 * i + r].encode(), 257]
      n = len(ids) - 1
      np.testing.assert_array_equal(batch['inputs'][r][:n], ids[:-1])
      np.testing.assert_array_equal(batch['targets'][r][:n], ids[1:])
      np.testing.assert_array_equal(batch['segment_ids'][r], np.arange(64) < n)
      np.testing.assert_array_equal(batch['positions'][r][:n], np.arange(n))
      assert batch['loss_mask'][r].sum() == n


def test_same_seed_same_batches_other_seed_other_batches():
  def take(seed):
    pipe = make_pipeline('synthetic', batch_size=2, seq_len=32, vocab_size=100, seed=seed)
    return [next(pipe) for _ in range(3)]
  a, b, c = take(5), take(5), take(6)
  assert all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in KEYS)
  assert not np.array_equal(a[0]['inputs'], c[0]['inputs'])


def test_shards_read_disjoint_documents(tmp_path):
  texts = [f'document number {i}' for i in range(20)]
  path = _write_jsonl(tmp_path / 'd.jsonl', texts)
  tok = ByteTokenizer()
  config = DataConfig.from_string(path, num_epochs=1, packing='none')

  def documents(**shard):
    pipe = make_pipeline(config, tok, batch_size=1, seq_len=64, **shard)
    return [tok.decode(b['inputs'][0][1:b['loss_mask'][0].astype(bool).sum()]) for b in pipe]
  shards = [documents(shard_index=i, shard_count=3) for i in range(3)]
  assert sorted(sum(shards, [])) == sorted(texts)
  assert [len(s) for s in shards] == [7, 7, 6]
  assert sorted(documents()) == sorted(texts)  # one process: jax.process_index() == 0 of 1
  with pytest.raises(ValueError, match=r'shard_index=3 must be in \[0, shard_count=3\)'):
    make_pipeline(config, tok, batch_size=1, seq_len=8, shard_index=3, shard_count=3)
  with pytest.raises(ValueError, match='20 documents, fewer than shard_count=32'):
    make_pipeline(config, tok, batch_size=1, seq_len=8, shard_index=0, shard_count=32)


def test_processes_read_only_their_files_when_sharded_by_file(tmp_path, monkeypatch):
  """Four JSONL files over two processes, repeating forever: each process opens only its two
  files (auto), the two read disjoint documents that together are all of them; with a set
  number of epochs auto shares documents instead, and shard_by=file needs a file per
  process."""
  from maxnnx.data import sources
  texts = [[f'file {f} document {i}' for i in range(5)] for f in range(4)]
  paths = [_write_jsonl(tmp_path / f'part-{f}.jsonl', t) for f, t in enumerate(texts)]
  opened = []
  read = sources._jsonl_documents
  monkeypatch.setattr(sources, '_jsonl_documents',
                      lambda path, *a: (opened.append(os.path.basename(path)), read(path, *a))[1])
  tok = ByteTokenizer()

  def documents(config, shard_index, count):
    opened.clear()
    pipe = make_pipeline(config, tok, batch_size=1, seq_len=64, shard_index=shard_index,
                         shard_count=2)
    docs = [tok.decode(b['inputs'][0][1:b['loss_mask'][0].astype(bool).sum()])
            for b, _ in zip(pipe, range(count))]
    return docs, sorted(opened)

  forever = DataConfig(sources=(str(tmp_path),), packing='none', shuffle=False)
  first, opened_first = documents(forever, 0, 10)
  second, opened_second = documents(forever, 1, 10)
  assert opened_first == ['part-0.jsonl', 'part-2.jsonl']
  assert opened_second == ['part-1.jsonl', 'part-3.jsonl']
  assert sorted(first + second) == sorted(sum(texts, []))
  once = forever.replace(num_epochs=1)
  docs, opened_once = documents(once, 1, 100)
  assert opened_once == sorted(os.path.basename(p) for p in paths) and len(docs) == 10
  with pytest.raises(ValueError, match='4 files, fewer than shard_count=8.*shard_by'):
    make_pipeline(forever.replace(shard_by='file'), tok, batch_size=1, seq_len=8,
                  shard_index=0, shard_count=8)


@pytest.mark.parametrize('packing', ['first_fit', 'none'])
def test_restored_state_gives_the_same_next_batches(tmp_path, packing):
  """Take N batches, save, take M: a fresh pipeline restored from the JSON state gives the M."""
  rng = np.random.default_rng()
  a = _write_jsonl(tmp_path / 'a.jsonl', _random_texts(rng, 30, 5, 150))  # some get split
  config = DataConfig(sources=(a, 'synthetic'), weights=(2.0, 1.0), packing=packing,
                      num_epochs=None)

  def build():
    return make_pipeline(config, ByteTokenizer(), batch_size=2, seq_len=32, seed=7)
  pipe = build()
  n = int(rng.integers(3, 12))
  for _ in range(n):
    next(pipe)
  state = json.loads(json.dumps(pipe.get_state()))
  expected = [next(pipe) for _ in range(6)]
  assert pipe.stats['overlong_split_pieces'] > 0
  fresh = build()
  fresh.set_state(state)
  got = [next(fresh) for _ in range(6)]
  for x, y in zip(expected, got):
    for key in KEYS:
      np.testing.assert_array_equal(x[key], y[key])
  assert fresh.stats == pipe.stats  # the counts are part of the state
  other = make_pipeline(config, ByteTokenizer(), batch_size=2, seq_len=32, seed=8)
  with pytest.raises(ValueError, match='different pipeline .*seed: saved 7, now 8'):
    other.set_state(state)


def test_mixture_follows_the_weights(tmp_path):
  a = tmp_path / 'a.jsonl'
  b = tmp_path / 'b.jsonl'
  a.write_text(''.join(json.dumps({'ids': [1] * 5}) + '\n' for _ in range(50)))
  b.write_text(''.join(json.dumps({'ids': [2] * 5}) + '\n' for _ in range(50)))
  config = DataConfig(sources=(str(a), str(b)), weights=(3.0, 1.0), column='ids',
                      pretokenized=True, packing='none')
  pipe = make_pipeline(config, batch_size=8, seq_len=8, vocab_size=10)
  first = np.concatenate([next(pipe)['inputs'][:, 0] for _ in range(10)])
  assert (first == 1).sum() == 60 and (first == 2).sum() == 20
  again = make_pipeline(config, batch_size=8, seq_len=8, vocab_size=10)
  np.testing.assert_array_equal(first[:8], next(again)['inputs'][:, 0])


def test_shipped_corpus_with_a_sentencepiece_tokenizer(tmp_path):
  tok_path = maxnnx.data.train_sentencepiece(DEFAULT_CORPUS, str(tmp_path / 'sp'), 512)
  pipe = make_pipeline(DataConfig(sources=(DEFAULT_CORPUS,), tokenizer=tok_path),
                       batch_size=4, seq_len=128, vocab_size=512)
  batch = next(pipe)
  assert batch['segment_ids'].max() >= 2 and batch['loss_mask'].mean() > 0.5  # packed
  for inputs, _, _ in _segments(batch):
    assert pipe.tokenizer.decode(inputs[1:]) in open(DEFAULT_CORPUS, encoding='utf-8').read()


def test_array_record_text_and_token_ids_give_the_batches_of_the_jsonl(tmp_path):
  """JSONL -> ArrayRecord (text, or ids via the converter) reads back into the same batches."""
  from maxnnx.data.convert import convert_to_array_record
  texts = _random_texts(np.random.default_rng(), 25)
  path = _write_jsonl(tmp_path / 'd.jsonl', texts)
  convert_to_array_record(path, str(tmp_path / 'text' / 'd.array_record'))
  convert_to_array_record(path, str(tmp_path / 'ids' / 'd.array_record'), num_shards=3,
                          tokenizer=ByteTokenizer())
  tok = ByteTokenizer()

  def batches(source, batch_size=2, **fields):
    config = DataConfig.from_string(source, num_epochs=1, **fields)
    return list(make_pipeline(config, tok, batch_size=batch_size, seq_len=32, seed=1))
  reference = batches(path)
  assert len(reference) >= 4
  other = batches(str(tmp_path / 'text'))
  assert len(other) == len(reference)
  for x, y in zip(reference, other):
    for key in KEYS:
      np.testing.assert_array_equal(x[key], y[key])
  # Three int32 shards hold the documents in another order: compare every piece read
  # (one per row and batch, so no partial last batch is dropped).
  def pieces(rows):
    return sorted(tuple(d[0]) + (d[1][-1],) for b in rows for d in _segments(b))
  ids = batches(str(tmp_path / 'ids' / 'd.array_record*'), 1, pretokenized=True, packing='none')
  assert pieces(ids) == pieces(batches(path, 1, packing='none'))
  assert len(pieces(ids)) >= 25


def _ids_file(tmp_path, docs):
  path = tmp_path / 'ids.jsonl'
  path.write_text(''.join(json.dumps({'ids': d}) + '\n' for d in docs))
  return str(path)


@pytest.mark.parametrize('policy', ['split', 'truncate', 'drop'])
def test_overlong_policies_are_counted(tmp_path, policy):
  docs = [list(range(1, 4)), list(range(1, 30)), list(range(1, 5))]  # 2, 28 and 3 targets
  config = DataConfig(sources=(_ids_file(tmp_path, docs),), column='ids', pretokenized=True,
                      overlong=policy, packing='none', shuffle=False, num_epochs=1)
  pipe = make_pipeline(config, batch_size=1, seq_len=10, vocab_size=50)
  lengths = [int(b['loss_mask'].sum()) for b in pipe]
  stats = pipe.stats
  assert stats['documents'] == 3 and stats['overlong'] == 1
  if policy == 'split':
    assert lengths == [2, 10, 10, 8, 3] and stats['overlong_split_pieces'] == 3
  elif policy == 'truncate':
    assert lengths == [2, 10, 3] and stats['overlong_truncated'] == 1
    assert stats['targets_dropped'] == 18
  else:
    assert lengths == [2, 3] and stats['overlong_dropped'] == 1
    assert stats['targets_dropped'] == 28


def test_overlong_error_names_the_document(tmp_path):
  path = _ids_file(tmp_path, [[1, 2], list(range(1, 30))])
  config = DataConfig(sources=(path,), column='ids', pretokenized=True, overlong='error',
                      shuffle=False)
  pipe = make_pipeline(config, batch_size=2, seq_len=10, vocab_size=50)
  with pytest.raises(ValueError, match=r'ids.jsonl line 2: the document has 29 tokens '
                                       r"\(28 targets\), more than seq_len=10. Set "
                                       "DataConfig.overlong"):
    next(pipe)


def test_token_id_outside_the_vocabulary_is_caught_before_the_model(tmp_path):
  path = _ids_file(tmp_path, [[1, 2, 3], [4, 99, 5]])
  config = DataConfig(sources=(path,), column='ids', pretokenized=True, shuffle=False)
  pipe = make_pipeline(config, batch_size=2, seq_len=8, vocab_size=64)
  with pytest.raises(ValueError, match=r'ids.jsonl line 2: token id 99 is outside the '
                                       r'vocabulary \[0, 64\)'):
    next(pipe)


def test_tokenizer_larger_than_the_model_is_refused():
  with pytest.raises(ValueError, match='tokenizer has 258 tokens but the model only 200'):
    make_pipeline(DataConfig(sources=(DEFAULT_CORPUS,)), ByteTokenizer(), batch_size=1,
                  seq_len=8, vocab_size=200)


def test_empty_documents_are_skipped_and_counted(tmp_path):
  path = _write_jsonl(tmp_path / 'd.jsonl', ['ab', '', 'cd', ''])
  config = DataConfig.from_string(path, packing='none', shuffle=False, num_epochs=1,
                                  add_bos=False, add_eos=False)
  pipe = make_pipeline(config, ByteTokenizer(), batch_size=1, seq_len=4)
  assert [b['inputs'][0][0] for b in pipe] == [ord('a'), ord('c')]
  assert pipe.stats['empty_skipped'] == 2


def test_config_and_argument_errors(tmp_path):
  assert DataConfig.from_string('a.jsonl, b.txt').sources == ('a.jsonl', 'b.txt')
  with pytest.raises(ConfigError, match='weights has 1 values for 2 sources'):
    DataConfig(sources=('a', 'b'), weights=(1.0,))
  with pytest.raises(ConfigError, match="Unknown DataConfig field 'colum'.*'column'"):
    DataConfig.from_dict({'colum': 'x'})
  with pytest.raises(ConfigError, match="DataConfig.packing = 'greedy' is invalid"):
    DataConfig(packing='greedy')
  with pytest.raises(ConfigError, match='needs \'synthetic\' or a path'):
    DataConfig.from_string(' , ')
  with pytest.raises(ValueError, match='needs a tokenizer or vocab_size'):
    make_pipeline('synthetic', batch_size=1, seq_len=8)
  path = _write_jsonl(tmp_path / 'd.jsonl', ['x'])
  with pytest.raises(ValueError, match='is text: pass a tokenizer'):
    make_pipeline(path, batch_size=1, seq_len=8, vocab_size=10)

  class NoBos(ByteTokenizer):
    bos_id = None
  with pytest.raises(ValueError, match='add_bos=True but the tokenizer has no BOS'):
    make_pipeline(path, NoBos(), batch_size=1, seq_len=8)
  with pytest.raises(ValueError, match='seq_len must be a positive int'):
    make_pipeline('synthetic', batch_size=1, seq_len=0, vocab_size=10)


@pytest.mark.slow
def test_worker_processes_are_deterministic_and_resumable():
  """worker_count=2: the same batches on every run, and a JSON state that resumes exactly.

  (Workers each pack their own slice of the documents, so the order differs from
  in-process reading; it depends on worker_count, not on timing.)
  """
  config = DataConfig(packing='best_fit', worker_count=2)

  def build():
    return make_pipeline(config, batch_size=2, seq_len=32, vocab_size=100, seed=3)
  with build() as first:
    expected = [next(first) for _ in range(6)]
  with build() as second:
    got = [next(second) for _ in range(3)]
    state = json.loads(json.dumps(second.get_state()))
  with build() as resumed:
    resumed.set_state(state)
    got += [next(resumed) for _ in range(3)]
  for x, y in zip(expected, got):
    for key in KEYS:
      np.testing.assert_array_equal(x[key], y[key])

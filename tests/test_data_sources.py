"""Document sources: formats, Hugging Face directory layout, ArrayRecord conversion, bad input."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maxnnx.data import DEFAULT_CORPUS, resolve_source
from maxnnx.data.convert import convert_to_array_record, main
from maxnnx.data.sources import ArrayRecordSource, InMemorySource, SyntheticSource


def _jsonl(path, records):
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))
  return str(path)


def _docs(source):
  return [source[i] for i in range(len(source))]


def test_text_documents_by_blank_lines_lines_or_file(tmp_path):
  path = tmp_path / 'a.txt'
  path.write_text('one\ntwo\n\n\nthree\n  \nfour\n')
  blocks = InMemorySource([str(path)], 'text')
  assert _docs(blocks) == ['one\ntwo', 'three', 'four']
  assert [blocks.describe(i) for i in range(3)] == [f'{path} line 1', f'{path} line 5',
                                                    f'{path} line 7']
  lines = InMemorySource([str(path)], 'text', text_split='lines')
  assert _docs(lines) == ['one', 'two', 'three', 'four']
  assert lines.describe(3) == f'{path} line 7'
  assert _docs(InMemorySource([str(path)], 'text', text_split='file')) == [path.read_text()]


def test_shipped_corpus_is_a_text_source():
  resolved = resolve_source(DEFAULT_CORPUS)
  assert resolved.kind == 'text'
  source = InMemorySource(resolved.files, 'text')
  with open(DEFAULT_CORPUS, encoding='utf-8') as f:
    blocks = [b.strip('\n') for b in f.read().split('\n\n') if b.strip()]
  assert _docs(source) == blocks
  assert source[0].startswith('First Citizen:\nBefore we proceed')


def test_jsonl_json_list_and_parquet_columns(tmp_path):
  a = _jsonl(tmp_path / 'a.jsonl', [{'text': 'alpha', 'id': 1}, {'text': 'beta', 'id': 2}])
  assert _docs(InMemorySource([a], 'jsonl')) == ['alpha', 'beta']
  b = tmp_path / 'b.json'
  b.write_text(json.dumps([{'content': 'x'}, {'content': 'y'}]))
  assert _docs(InMemorySource([str(b)], 'jsonl', column='content')) == ['x', 'y']
  c = str(tmp_path / 'c.parquet')
  pq.write_table(pa.table({'body': ['p', 'q', None, 'r'], 'n': [1, 2, 3, 4]}), c)
  source = InMemorySource([c], 'parquet', column='body')
  assert _docs(source) == ['p', 'q', 'r']
  assert source.describe(2) == f'{c} row 3'
  ids = str(tmp_path / 'ids.parquet')
  pq.write_table(pa.table({'input_ids': [[1, 2, 3], [4, 5]]}), ids)
  got = _docs(InMemorySource([ids], 'parquet', column='input_ids', pretokenized=True))
  assert [d.tolist() for d in got] == [[1, 2, 3], [4, 5]] and got[0].dtype == np.int32


def test_hugging_face_directory_layout_and_globs(tmp_path):
  (tmp_path / 'data').mkdir()
  (tmp_path / 'README.md').write_text('# dataset card, not data')
  (tmp_path / '.cache').mkdir()
  (tmp_path / '.cache' / 'x.jsonl').write_text('{"text": "hidden"}\n')
  for split in ('train', 'test'):
    pq.write_table(pa.table({'text': [f'{split} {i}' for i in range(3)]}),
                   str(tmp_path / 'data' / f'{split}-00000-of-00001.parquet'))
  resolved = resolve_source(str(tmp_path))  # the train split, as datasets reads it
  assert resolved.kind == 'parquet'
  assert _docs(InMemorySource(resolved.files, 'parquet')) == ['train 0', 'train 1', 'train 2']
  held_out = resolve_source(str(tmp_path), split='validation|test')
  assert _docs(InMemorySource(held_out.files, 'parquet')) == ['test 0', 'test 1', 'test 2']
  train = resolve_source(str(tmp_path / 'data' / 'train-*.parquet'))
  assert _docs(InMemorySource(train.files, 'parquet')) == ['train 0', 'train 1', 'train 2']
  _jsonl(tmp_path / 'data' / 'train-00000-of-00001.jsonl', [{'text': 'z'}])
  with pytest.raises(ValueError, match='mixes formats .*jsonl, parquet'):
    resolve_source(str(tmp_path))
  assert resolve_source(str(tmp_path), kind='jsonl').files == (str(tmp_path / 'data' /
                                                                   'train-00000-of-00001.jsonl'),)


def test_resolve_errors_name_the_source(tmp_path):
  assert resolve_source('synthetic').kind == 'synthetic'
  with pytest.raises(FileNotFoundError, match="'nope.jsonl': no such file"):
    resolve_source('nope.jsonl')
  with pytest.raises(FileNotFoundError, match='matches no files'):
    resolve_source(str(tmp_path / '*.parquet'))
  (tmp_path / 'notes.dat').write_text('x')
  with pytest.raises(ValueError, match='cannot tell the format of .*notes.dat.*set kind='):
    resolve_source(str(tmp_path / 'notes.dat'))
  with pytest.raises(FileNotFoundError, match='holds no data files'):
    resolve_source(str(tmp_path))


def test_missing_column_lists_the_columns(tmp_path):
  a = _jsonl(tmp_path / 'a.jsonl', [{'text': 'ok'}, {'body': 'no text', 'meta': 1}])
  with pytest.raises(ValueError, match=r"a.jsonl line 2: no column 'text'; the columns are "
                                       r"\['body', 'meta'\]"):
    InMemorySource([a], 'jsonl')
  p = str(tmp_path / 'p.parquet')
  pq.write_table(pa.table({'content': ['x'], 'url': ['u']}), p)
  with pytest.raises(ValueError, match=r"no column 'text'; the columns are \['content', 'url'\]"):
    InMemorySource([p], 'parquet')


def test_empty_files_are_errors(tmp_path):
  for name, kind in (('e.txt', 'text'), ('e.jsonl', 'jsonl')):
    (tmp_path / name).write_text('' if kind == 'text' else '\n\n')
    with pytest.raises(ValueError, match=f'{name}: the file is empty'):
      InMemorySource([str(tmp_path / name)], kind)
  (tmp_path / 'blank.txt').write_text('   \n\n  ')
  with pytest.raises(ValueError, match='blank.txt: the file is empty'):
    InMemorySource([str(tmp_path / 'blank.txt')], 'text')


def test_non_utf8_lines_name_file_and_line(tmp_path):
  (tmp_path / 'bad.txt').write_bytes(b'fine\nalso fine\nbad \xff byte\n')
  with pytest.raises(ValueError, match=r'bad.txt: not UTF-8 \(byte \d+, line 3\)'):
    InMemorySource([str(tmp_path / 'bad.txt')], 'text')
  (tmp_path / 'bad.jsonl').write_bytes(b'{"text": "a"}\n{"text": "\xc3\x28"}\n')
  with pytest.raises(ValueError, match='bad.jsonl line 2: not UTF-8'):
    InMemorySource([str(tmp_path / 'bad.jsonl')], 'jsonl')
  (tmp_path / 'broken.jsonl').write_text('{"text": "a"}\n{"text": \n')
  with pytest.raises(ValueError, match='broken.jsonl line 2: not valid JSON'):
    InMemorySource([str(tmp_path / 'broken.jsonl')], 'jsonl')


def test_text_versus_token_ids_mismatch_is_explained(tmp_path):
  ids = _jsonl(tmp_path / 'ids.jsonl', [{'text': [1, 2, 3]}])
  with pytest.raises(ValueError, match='holds list, not text. It holds token ids: set '
                                       'pretokenized=True'):
    InMemorySource([ids], 'jsonl')
  text = _jsonl(tmp_path / 'text.jsonl', [{'text': 'words'}])
  with pytest.raises(ValueError, match='holds text, not a list of token ids'):
    InMemorySource([text], 'jsonl', pretokenized=True)


def test_convert_text_and_jsonl_to_array_record(tmp_path):
  a = _jsonl(tmp_path / 'a.jsonl', [{'text': f'doc {i} ü'} for i in range(5)])
  out = str(tmp_path / 'out' / 'a.array_record')
  result = convert_to_array_record(a, out, num_shards=2)
  assert result['documents'] == 5 and result['format'] == 'text'
  assert result['files'] == [out + '-00000-of-00002', out + '-00001-of-00002']
  resolved = resolve_source(str(tmp_path / 'out'))
  assert resolved.kind == 'array_record'
  source = ArrayRecordSource(resolved.files)
  assert sorted(_docs(source)) == sorted(f'doc {i} ü' for i in range(5))
  assert source.describe(4) == f'{out}-00001-of-00002 record 1'
  # int32 records read as text: the error says what to set.
  convert_to_array_record(a, str(tmp_path / 'ids.array_record'), tokenizer=_ByteTokenizer())
  with pytest.raises(ValueError, match='record 0: not UTF-8 text .* set pretokenized=True'):
    ArrayRecordSource([str(tmp_path / 'ids.array_record')])[0]


class _ByteTokenizer:
  """UTF-8 bytes as ids, plus 256 = BOS: an independent, obvious tokenizer for tests."""
  vocab_size, bos_id, eos_id, pad_id = 258, 256, 257, None

  def encode(self, text):
    return list(text.encode('utf-8'))

  def decode(self, ids):
    return bytes(int(i) for i in ids if i < 256).decode('utf-8')


def test_convert_entry_point_writes_token_ids(tmp_path, capsys):
  text = tmp_path / 'c.txt'
  text.write_text('ab\n\ncd ü\n')
  out = str(tmp_path / 'c.array_record')
  assert main([str(text), '--output', out]) == 0
  assert 'Wrote 2 documents (text)' in capsys.readouterr().out
  assert _docs(ArrayRecordSource([out])) == ['ab', 'cd ü']
  convert_to_array_record(str(text), out, tokenizer=_ByteTokenizer())
  ids = _docs(ArrayRecordSource([out], pretokenized=True))
  assert [d.tolist() for d in ids] == [list(b'ab'), list('cd ü'.encode())]
  assert main([str(tmp_path / 'missing.txt'), '--output', out]) == 2
  assert 'no such file' in capsys.readouterr().err


def test_synthetic_documents_are_deterministic():
  a, b = SyntheticSource(50, max_length=9, seed=3), SyntheticSource(50, max_length=9, seed=3)
  docs = [a[i] for i in range(200)]
  assert all(np.array_equal(d, b[i]) for i, d in enumerate(docs))
  assert {len(d) for d in docs} == set(range(1, 10))
  assert min(d.min() for d in docs) == 0 and max(d.max() for d in docs) == 49
  assert not np.array_equal(SyntheticSource(50, max_length=9, seed=4)[0], docs[0])

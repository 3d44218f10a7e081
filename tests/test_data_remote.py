"""Data at URLs: ``data=`` read through fsspec (a bucket served from memory, ``file://``)."""

import importlib.util
import json
import os
import subprocess
import sys
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import maxnnx.train
from maxnnx.data import DEFAULT_CORPUS, DataConfig, make_pipeline, resolve_source
from maxnnx.data.convert import convert_to_array_record
from maxnnx.data.sources import ArrayRecordSource, InMemorySource
from maxnnx.data.text import read_text

DOCS = [f'document {i}: ' + 'to be or not to be ' * (i % 3 + 1) for i in range(12)]


@pytest.fixture
def bucket():
  """A fresh prefix of fsspec's in-process ``memory://`` filesystem, removed afterwards."""
  name = f'bucket-{uuid.uuid4().hex[:8]}'
  fs = fsspec.filesystem('memory')
  yield name
  fs.rm(f'/{name}', recursive=True)


def _shards(directory, kind: str) -> dict[str, bytes]:
  """Three shards of ``DOCS`` in ``kind``'s format: ``{file name: bytes}``, also written into
  local ``directory``."""
  shards = {}
  for n, part in enumerate((DOCS[:5], DOCS[5:9], DOCS[9:])):
    if kind == 'jsonl':
      name, data = f'train-{n}.jsonl', ''.join(json.dumps({'text': d}) + '\n' for d in part)
      data = data.encode()
    elif kind == 'text':
      name, data = f'train-{n}.txt', '\n\n'.join(part).encode()
    else:
      name, sink = f'train-{n}.parquet', pa.BufferOutputStream()
      pq.write_table(pa.table({'text': part}), sink)
      data = sink.getvalue().to_pybytes()
    shards[name] = data
    (directory / name).write_bytes(data)
  return shards


def _upload(bucket: str, files: dict[str, bytes], prefix: str = 'shards') -> str:
  fs = fsspec.filesystem('memory')
  for name, data in files.items():
    fs.pipe(f'/{bucket}/{prefix}/{name}', data)
  return f'memory://{bucket}/{prefix}'


def _documents(spec: str):
  resolved = resolve_source(spec)
  source = InMemorySource(resolved.files, resolved.kind)
  return resolved, [source[i] for i in range(len(source))]


@pytest.mark.parametrize('kind,suffix', [('jsonl', 'jsonl'), ('text', 'txt'),
                                         ('parquet', 'parquet')])
def test_a_url_glob_reads_what_the_local_glob_reads(bucket, tmp_path, kind, suffix):
  prefix = _upload(bucket, _shards(tmp_path, kind))
  local, local_docs = _documents(str(tmp_path / f'*.{suffix}'))
  remote, remote_docs = _documents(f'{prefix}/*.{suffix}')
  assert remote.kind == local.kind == kind
  assert [f.rsplit('/', 1)[1] for f in remote.files] == [os.path.basename(f) for f in local.files]
  assert all(f.startswith('memory://') for f in remote.files)  # named by URL, not a local copy
  assert remote_docs == local_docs and len(remote_docs) == len(DOCS)
  # A prefix is a directory: every data file below it.
  assert _documents(prefix)[1] == local_docs


def test_messages_name_the_url_of_the_document(bucket, tmp_path):
  prefix = _upload(bucket, _shards(tmp_path, 'jsonl'))
  resolved = resolve_source(f'{prefix}/*.jsonl')
  source = InMemorySource(resolved.files, 'jsonl')
  assert source.describe(5) == f'memory:///{bucket}/shards/train-1.jsonl line 1'
  fsspec.filesystem('memory').pipe(f'/{bucket}/bad/x.jsonl', b'{"content": "a"}\n')
  with pytest.raises(ValueError, match=rf"memory:///{bucket}/bad/x.jsonl line 1: no column"):
    _documents(f'memory://{bucket}/bad/x.jsonl')


def test_array_record_at_a_url_is_downloaded_and_named_by_its_url(bucket, tmp_path):
  text = tmp_path / 'docs.txt'
  text.write_text('\n\n'.join(DOCS))
  convert_to_array_record(str(text), str(tmp_path / 'docs.array_record'))
  _upload(bucket, {'docs.array_record': (tmp_path / 'docs.array_record').read_bytes()})
  resolved = resolve_source(f'memory://{bucket}/shards/*.array_record')
  source = ArrayRecordSource(resolved.files)
  assert [source[i] for i in range(len(source))] == DOCS
  assert source.describe(2) == f'memory:///{bucket}/shards/docs.array_record record 2'


def test_missing_objects_patterns_and_denied_reads_are_one_line_naming_the_url(bucket):
  _upload(bucket, {'a.jsonl': b'{"text": "x"}\n'})
  cases = [(f'memory://{bucket}/shards/*.parquet', FileNotFoundError, 'matches no files'),
           (f'memory://{bucket}/none.jsonl', FileNotFoundError, 'no such object or prefix'),
           (f'memory://{bucket}/empty/', FileNotFoundError, 'no such object or prefix')]
  for url, error, words in cases:
    with pytest.raises(error) as caught:
      resolve_source(url)
    assert url in str(caught.value) and words in str(caught.value)
    assert '\n' not in str(caught.value)

  class Denied(MemoryFileSystem):
    """A bucket whose objects this process may list but not read or stat (403)."""
    protocol = 'denied'

    def info(self, path, **kwargs):
      raise PermissionError(13, 'Forbidden')

    def cat_file(self, path, *args, **kwargs):
      raise PermissionError(13, 'Forbidden')

  fsspec.register_implementation('denied', Denied, clobber=True)
  url = f'denied://{bucket}/shards/a.jsonl'
  with pytest.raises(PermissionError, match=rf'^{url}: access denied \(.*Forbidden\)'):
    resolve_source(url)
  with pytest.raises(PermissionError, match=rf'^{url}: access denied'):
    InMemorySource([url], 'jsonl')


@pytest.mark.skipif(importlib.util.find_spec('s3fs') is not None, reason='s3fs is installed')
def test_a_missing_backend_names_the_package_and_extra():
  with pytest.raises(ValueError, match=r"s3://bucket/x.jsonl: reading s3:// URLs needs s3fs; "
                                       r"pip install s3fs \(the maxnnx\[s3\] extra\)"):
    resolve_source('s3://bucket/x.jsonl')


def test_hugging_face_urls_go_to_the_hub_filesystem():
  """``hf://`` is huggingface_hub's fsspec filesystem; with no network here the read fails, in
  one line naming the URL (not a local 'no such file')."""
  pytest.importorskip('huggingface_hub')
  url = 'hf://datasets/maxnnx-no-such-org/no-such-dataset'
  with pytest.raises((ValueError, FileNotFoundError, PermissionError)) as caught:
    resolve_source(url)
  assert url in str(caught.value) and '\n' not in str(caught.value)


def test_a_pipeline_over_a_url_resumes_at_the_same_batch(bucket, tmp_path):
  """The pipeline state holds indices and the sources as given (the URL), never a local path:
  a fresh pipeline over the same URL, given the state, continues with the same batch."""
  url = f'{_upload(bucket, _shards(tmp_path, "jsonl"))}/*.jsonl'
  config = DataConfig(sources=(url,), pretokenized=False)
  tokenizer = _ByteTokenizer()

  def pipeline():
    return make_pipeline(config, tokenizer, batch_size=2, seq_len=16, seed=3, shard_index=0,
                         shard_count=1)

  first = pipeline()
  for _ in range(3):
    next(first)
  state = first.get_state()
  expected = next(first)
  assert url in json.dumps(state) and str(tmp_path) not in json.dumps(state)
  resumed = pipeline()
  resumed.set_state(json.loads(json.dumps(state)))
  got = next(resumed)
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key])


class _ByteTokenizer:
  """Bytes as token ids (1..256), BOS 257, EOS 258: a tokenizer with nothing to train."""
  vocab_size, bos_id, eos_id, pad_id = 259, 257, 258, 0

  def encode(self, text):
    return [b + 1 for b in text.encode()]


RUN = {'model': 'tiny', 'model.vocab_size': 384, 'model.num_layers': 1, 'steps': 2,
       'global_batch_size': 2, 'seq_len': 16, 'log_every': 1, 'eval_every': 0,
       'checkpoint_every': 0, 'sample_tokens': 0, 'dtype': 'float32', 'mesh.data': 1}


def test_a_run_trains_on_a_bucket_glob_in_process(bucket, tmp_path):
  """``maxnnx.train.run`` with ``data=memory://…/*.jsonl``: the tokenizer is trained on the
  bucket's documents and the run trains; the stored config names the URL."""
  corpus = read_text(DEFAULT_CORPUS)[:20_000].split('\n\n')
  lines = ''.join(json.dumps({'text': d}) + '\n' for d in corpus if d.strip())
  url = f"{_upload(bucket, {'a.jsonl': lines.encode()})}/*.jsonl"
  summary = maxnnx.train.run(RUN, data=url, output_dir=str(tmp_path / 'run'))
  assert summary['last_loss'] is not None and np.isfinite(summary['last_loss'])
  stored = json.loads((tmp_path / 'run' / 'run_config.json').read_text())
  assert stored['tokenizer']['source'] == url


def test_the_cli_reads_a_file_url(tmp_path):
  """``maxnnx train data=file:///…/*.jsonl`` in a subprocess, as a user runs it."""
  corpus = read_text(DEFAULT_CORPUS)[:20_000].split('\n\n')
  (tmp_path / 'shards').mkdir()
  (tmp_path / 'shards' / 'a.jsonl').write_text(
      ''.join(json.dumps({'text': d}) + '\n' for d in corpus if d.strip()))
  args = [f'{k}={v}' for k, v in RUN.items()]
  out = tmp_path / 'run'
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  done = subprocess.run([sys.executable, '-m', 'maxnnx', 'train', *args,
                         f'data=file://{tmp_path}/shards/*.jsonl', f'output_dir={out}'],
                        capture_output=True, text=True, env=env, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert len((out / 'metrics.jsonl').read_text().splitlines()) == 2
  missing = subprocess.run([sys.executable, '-m', 'maxnnx', 'train', *args,
                            f'data=file://{tmp_path}/none/*.jsonl',
                            f'output_dir={tmp_path / "run2"}'],
                           capture_output=True, text=True, env=env, timeout=300)
  assert missing.returncode == 2
  assert missing.stderr.strip().splitlines()[-1] == (
      f"error: data source '{tmp_path}/none/*.jsonl': the pattern matches no files.")


def test_a_run_on_a_bucket_resumes_at_the_same_example(bucket, tmp_path, capsys):
  """A run over ``memory://…/*.jsonl`` killed after its step-2 checkpoint (its directory as
  it was then: the later checkpoint and exports gone) resumes with the batches of the run that
  was not killed: steps 3 and 4 have the same losses."""
  import shutil
  corpus = read_text(DEFAULT_CORPUS)[:20_000].split('\n\n')
  lines = ''.join(json.dumps({'text': d}) + '\n' for d in corpus if d.strip())
  url = f"{_upload(bucket, {'a.jsonl': lines.encode()})}/*.jsonl"
  settings = {**RUN, 'steps': 4, 'checkpoint_every': 2, 'data': url}
  reference = tmp_path / 'reference'
  maxnnx.train.run(settings, output_dir=str(reference))
  expected = [json.loads(m)['loss'] for m in (reference / 'metrics.jsonl').read_text().splitlines()]
  killed = tmp_path / 'killed'
  shutil.copytree(reference, killed)
  for name in ('checkpoints/4', 'final', 'loss.png'):
    shutil.rmtree(killed / name) if (killed / name).is_dir() else (killed / name).unlink()
  capsys.readouterr()
  maxnnx.train.run(settings, output_dir=str(killed))
  assert 'Resuming from the checkpoint of step 2' in capsys.readouterr().out
  losses = [json.loads(m)['loss'] for m in (killed / 'metrics.jsonl').read_text().splitlines()]
  assert len(losses) == 4
  np.testing.assert_allclose(losses, expected, rtol=1e-6)


class _Flaky(MemoryFileSystem):
  """The memory filesystem, failing the first ``failures`` reads with ``error``."""
  protocol = 'flaky'
  failures, error, calls = 0, ConnectionError('connection reset by peer'), 0

  def cat_file(self, path, *args, **kwargs):
    type(self).calls += 1
    if type(self).calls <= type(self).failures:
      raise type(self).error
    return super().cat_file('/' + path.split('://', 1)[-1].lstrip('/'), *args, **kwargs)


@pytest.fixture
def flaky(monkeypatch):
  from maxnnx import paths
  fsspec.register_implementation('flaky', _Flaky, clobber=True)
  monkeypatch.setattr(paths, 'DATA_RETRY_DELAY_S', 0.0)
  _Flaky.calls = 0
  name = f'flaky-{uuid.uuid4().hex[:8]}'
  fsspec.filesystem('memory').pipe(f'/{name}/a.txt', b'to be or not to be')
  yield f'flaky://{name}/a.txt'
  fsspec.filesystem('memory').rm(f'/{name}', recursive=True)


def test_transient_read_errors_are_retried_and_the_last_one_names_the_url(flaky):
  """A read that fails twice on a lost connection succeeds on its third try; a read that keeps
  failing stops after DATA_READ_TRIES with one line naming the URL; a missing object is not
  retried."""
  from maxnnx import paths
  _Flaky.failures, _Flaky.error = 2, ConnectionError('connection reset by peer')
  assert paths.read_data_bytes(flaky) == b'to be or not to be' and _Flaky.calls == 3
  _Flaky.calls, _Flaky.failures, _Flaky.error = 0, 99, TimeoutError('read timed out')
  with pytest.raises(ValueError, match=f'{flaky}: cannot read it .*after 4 tries') as info:
    paths.read_data_bytes(flaky)
  assert '\n' not in str(info.value) and _Flaky.calls == paths.DATA_READ_TRIES
  _Flaky.calls, _Flaky.error = 0, FileNotFoundError('gone')
  with pytest.raises(FileNotFoundError, match='no such object'):
    paths.read_data_bytes(flaky)
  assert _Flaky.calls == 1


def test_backend_errors_are_transient_by_type_or_by_name():
  from maxnnx import paths

  class ServiceUnavailableError(Exception):
    pass

  assert paths.is_transient(ServiceUnavailableError('503'))
  assert paths.is_transient(OSError('wrapped')) is False
  try:
    try:
      raise TimeoutError('socket')
    except TimeoutError as inner:
      raise RuntimeError('backend gave up') from inner
  except RuntimeError as outer:
    assert paths.is_transient(outer)
  assert not paths.is_transient(PermissionError('denied'))

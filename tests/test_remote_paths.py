"""Run directories and checkpoint paths at URLs (``gs://…``), on a fake in-memory bucket.

The ``fake_gcs`` fixture (conftest.py) serves ``gs://`` from memory through fsspec, which is
what ``etils.epath`` uses; like Cloud Storage it cannot append. Checkpoint arrays are written
by tensorstore, which talks to Cloud Storage itself and does not see the fake, so the
end-to-end runs keep their checkpoints in a local directory and a separate test checks that
the URL reaches orbax unchanged.
"""

import io
import json
import os
import pathlib
import shutil
import time

import fsspec
import jax
import jax.numpy as jnp
import pytest

from maxnnx import cli, paths
from maxnnx.checkpoint import manager
from maxnnx.checkpoint.run_lock import LOCK_NAME
from maxnnx.train import TrainConfig
from maxnnx.train.diagnostics import StepProfiler, dump_hlo, run_directory
from maxnnx.train.goodput import read_high_water, write_high_water
from maxnnx.train.metrics import JsonlWriter, TensorBoardWriter, read_tensorboard_scalars
from maxnnx.train.run_dir import RunDir
from maxnnx.train.watchdog import Watchdog

ARGS = ['model=tiny', 'model.num_layers=1', 'seq_len=32', 'global_batch_size=4',
        'sample_tokens=0', 'eval_every=0', 'checkpoint_every=2', 'log_every=1', 'mesh.data=1']


# -- the helpers ---------------------------------------------------------------------------------

def test_local_paths_urls_and_file_urls(tmp_path):
  assert paths.is_remote('gs://b/run') and not paths.is_remote('runs/x')
  assert not paths.is_remote(f'file://{tmp_path}')
  assert paths.normalize(f'file://{tmp_path}/run') == f'{tmp_path}/run'
  assert paths.join('gs://b/run', 'checkpoints', '4') == 'gs://b/run/checkpoints/4'
  assert paths.absolute('gs://b/run') == 'gs://b/run'
  assert paths.absolute('runs/x') == os.path.abspath('runs/x')
  assert paths.parent('gs://b/run/metrics.jsonl') == 'gs://b/run'
  assert paths.parent('gs://b') == 'gs://b'
  with pytest.raises(ValueError, match='unsupported URL scheme ftp://'):
    paths.normalize('ftp://host/run')
  # A file:// URL is the local directory it names.
  paths.makedirs(f'file://{tmp_path}/run')
  paths.write_text(f'file://{tmp_path}/run/a.json', '{}')
  assert (tmp_path / 'run' / 'a.json').read_text() == '{}'
  assert paths.listdir(f'file://{tmp_path}/run') == ['a.json']


def test_objects_are_written_whole_and_appends_are_rewrites(fake_gcs, tmp_path):
  run = fake_gcs.url('run')
  paths.write_text(paths.join(run, 'a.json'), '{"x": 1}')
  assert paths.read_text(paths.join(run, 'a.json')) == '{"x": 1}'
  assert paths.isdir(run) and paths.isfile(paths.join(run, 'a.json'))
  with pytest.raises(ValueError, match='cannot append'):
    paths.open_file(paths.join(run, 'a.json'), 'a')

  log = paths.AppendFile(paths.join(run, 'log.txt'), upload_every=3600)
  log.write('one\n')
  log.flush()  # the first flush uploads
  log.write('two\n')
  log.flush()  # too soon for another upload
  assert fake_gcs.files('run/log.txt') == {'run/log.txt': b'one\n'}
  log.close()
  assert fake_gcs.files('run/log.txt') == {'run/log.txt': b'one\ntwo\n'}
  again = paths.AppendFile(paths.join(run, 'log.txt'))  # reopening keeps what is there
  again.write('three\n')
  again.close()
  paths.append_bytes(paths.join(run, 'log.txt'), b'four\n')
  assert paths.read_text(paths.join(run, 'log.txt')) == 'one\ntwo\nthree\nfour\n'

  def export(directory):
    os.makedirs(os.path.join(directory, 'sub'))
    for name in ('config.json', 'model.safetensors', 'sub/x'):
      with open(os.path.join(directory, name), 'w') as f:
        f.write(name)

  paths.write_text(paths.join(run, 'final', 'stale.txt'), 'old')
  paths.write_dir(paths.join(run, 'final'), export, last=('config.json',))
  names = [n for n in fake_gcs.fs.store if n.startswith('/fake-bucket/run/final/')]
  assert names[-1].endswith('config.json')  # uploaded last
  assert sorted(paths.listdir(paths.join(run, 'final'))) == ['config.json', 'model.safetensors',
                                                              'sub']
  local = paths.local_copy(paths.join(run, 'final'))
  assert sorted(os.listdir(local)) == ['config.json', 'model.safetensors', 'sub']
  assert pathlib.Path(local, 'sub', 'x').read_text() == 'sub/x'


def test_metrics_goodput_and_diagnostics_at_a_url(fake_gcs):
  run = fake_gcs.url('run')
  jsonl = JsonlWriter(paths.join(run, 'metrics.jsonl'))
  board = TensorBoardWriter(paths.join(run, 'tb'))
  for step in (1, 2):
    jsonl.write({'step': step})
    board.scalars(step, {'loss': 1.0 / step})
  jsonl.close()
  board.close()
  assert paths.read_text(paths.join(run, 'metrics.jsonl')) == '{"step": 1}\n{"step": 2}\n'
  assert read_tensorboard_scalars(board.path) == [(1, {'loss': 1.0}), (2, {'loss': 0.5})]

  assert read_high_water(paths.join(run, 'checkpoints')) == 0
  write_high_water(paths.join(run, 'checkpoints'), 7)
  assert read_high_water(paths.join(run, 'checkpoints')) == 7

  config = TrainConfig(metrics_jsonl=paths.join(run, 'metrics.jsonl'))
  assert run_directory(config) == run
  assert run_directory(TrainConfig(checkpoint_dir=run + '/checkpoints/')) == run


def test_profile_hlo_and_watchdog_stacks_at_a_url(fake_gcs):
  """A profile is traced locally and copied up when it stops; HLO text and hang stacks are
  written to the bucket."""
  run = fake_gcs.url('run')
  profiler = StepProfiler('steps:1-1', paths.join(run, 'profile'))
  profiler.before_step(1)
  profiler.after_step(1, jnp.ones((8, 8)) @ jnp.ones((8, 8)))
  traced = jax.jit(lambda x: x @ x).trace(jnp.ones((4, 4)))
  lowered = traced.lower()
  dump_hlo(paths.join(run, 'hlo'), 'f', traced, lowered, lowered.compile())
  watchdog = Watchdog(5.0, 0.1, paths.join(run, 'watchdog_stacks.txt'), stream=io.StringIO(),
                      poll=0.01).start()
  try:
    watchdog.set_median(0.01)
    watchdog.step_started(2)
    deadline = time.monotonic() + 10
    while not watchdog.dumps and time.monotonic() < deadline:
      time.sleep(0.05)
  finally:
    watchdog.close()
  files = fake_gcs.files()
  assert [n for n in files if n.startswith('run/profile/plugins/profile/')
          and n.endswith('.xplane.pb')]
  assert {'run/hlo/f.jaxpr.txt', 'run/hlo/f.stablehlo.mlir', 'run/hlo/f.hlo.txt',
          'run/hlo/f.optimized.hlo.txt'} <= set(files)
  assert b'maxnnx watchdog: step 2 has run' in files['run/watchdog_stacks.txt']


def test_resume_never_moves_a_run_aside_inside_the_bucket(fake_gcs):
  run = fake_gcs.url('run')
  for name in ('run_config.json', 'metrics.jsonl', 'final/config.json'):
    paths.write_text(paths.join(run, name), name)
  with RunDir(run, resume='never') as opened:
    assert opened.moved_to.startswith(f'{run}/previous/')
    assert sorted(paths.listdir(run)) == [LOCK_NAME, 'previous']
  moved = {name.split('/', 3)[3] for name in fake_gcs.files('run/previous/')}
  assert moved == {'run_config.json', 'metrics.jsonl', 'final/config.json'}
  assert paths.listdir(run) == ['previous']  # the lock is gone with the run


# -- checkpoints ---------------------------------------------------------------------------------

def test_checkpoint_manager_hands_urls_to_orbax_unchanged(monkeypatch, tmp_path):
  seen = []

  class Recorder:
    def __init__(self, directory, options=None):
      seen.append(directory)

  monkeypatch.setattr(manager.ocp, 'CheckpointManager', Recorder)
  assert manager.CheckpointManager('gs://bucket/run/checkpoints').directory == (
      'gs://bucket/run/checkpoints')
  manager.CheckpointManager(f'file://{tmp_path}/ckpt')
  monkeypatch.chdir(tmp_path)
  manager.CheckpointManager('relative/ckpt')
  assert seen == ['gs://bucket/run/checkpoints', f'{tmp_path}/ckpt',
                  os.path.join(str(tmp_path), 'relative', 'ckpt')]


# -- maxnnx train with output_dir=gs://… ----------------------------------------------------------

def _train(out, checkpoints, *extra) -> int:
  return cli.main(['train', f'output_dir={out}', f'checkpoint_dir={checkpoints}', *ARGS,
                   'steps=4', *extra])


def test_cli_run_in_a_bucket_resumes_and_refuses_like_a_local_one(fake_gcs, tmp_path, capsys,
                                                                  monkeypatch):
  monkeypatch.chdir(tmp_path)  # a URL mangled into a local path would appear here
  out, checkpoints = fake_gcs.url('run'), tmp_path / 'checkpoints'
  assert _train(out, checkpoints) == 0, capsys.readouterr().err
  files = fake_gcs.files('run/')
  assert {'run/run_config.json', 'run/metrics.jsonl', 'run/tokenizer.model', 'run/loss.png',
          'run/train_options.json', 'run/final/config.json',
          'run/final/model.safetensors'} <= set(files)
  assert files['run/loss.png'].startswith(b'\x89PNG')
  assert not [n for n in files if LOCK_NAME in n or '.tokenizer-new' in n]  # released
  assert read_high_water(str(checkpoints)) == 4
  metrics = [json.loads(line)['step'] for line in
             paths.read_text(paths.join(out, 'metrics.jsonl')).splitlines()]
  assert metrics == [1, 2, 3, 4]

  # A live lock object of another host refuses the run, saying how to remove it.
  lock = {'host': 'elsewhere', 'pid': 1, 'started': 'earlier', 'renewed': time.time()}
  paths.write_text(paths.join(out, LOCK_NAME), json.dumps(lock))
  capsys.readouterr()
  assert _train(out, checkpoints, 'steps=6') == 2
  assert f'delete {out}/{LOCK_NAME}' in capsys.readouterr().err
  paths.remove(paths.join(out, LOCK_NAME))

  # Training longer resumes from the (local) checkpoint; the metrics in the bucket are cut
  # back to it (step 4's checkpoint is gone, as if the run had been killed before saving it).
  shutil.rmtree(checkpoints / '4')
  assert _train(out, checkpoints, 'steps=6') == 0
  assert 'Resuming from the checkpoint of step 2' in capsys.readouterr().out
  metrics = [json.loads(line)['step'] for line in
             paths.read_text(paths.join(out, 'metrics.jsonl')).splitlines()]
  assert metrics == [1, 2, 3, 4, 5, 6]

  # A changed config is refused and nothing is touched.
  before = fake_gcs.files('run/')
  assert _train(out, checkpoints, 'steps=6', 'model.num_layers=2') == 2
  assert 'model.num_layers: 1 -> 2' in capsys.readouterr().err
  assert fake_gcs.files('run/') == before

  # generate reads the exported model and tokenizer from the bucket.
  assert cli.main(['generate', f'output_dir={out}', 'prompt=KING:', 'max_new_tokens=4']) == 0
  assert capsys.readouterr().out.startswith('KING:')

  assert os.listdir(tmp_path) == ['checkpoints']


def test_default_checkpoint_dir_is_inside_a_remote_output_dir():
  options = cli.parse_overrides(['output_dir=gs://bucket/run', 'checkpoint_every=2'],
                                cli.train_keys())
  run, config, _, _ = cli._split_options(options)
  assert run['output_dir'] == 'gs://bucket/run'
  assert config.checkpoint_dir == 'gs://bucket/run/checkpoints'


def test_the_fake_bucket_is_gone_after_its_tests():
  """(Runs after the tests above.) gs:// is no longer served by the fake."""
  assert getattr(fsspec.registry.get('gcs'), '__name__', None) != 'FakeBucket'
  assert getattr(fsspec.registry.get('gs'), '__name__', None) != 'FakeBucket'

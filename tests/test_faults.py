"""Runs that never lose work: ``maxnnx train`` under faults.

One run per output directory, resume checked against the stored config (``resume=never`` moves
the old run aside), a pinned tokenizer, idempotent finishing, SIGTERM with an exact resume,
filesystem faults as one error line, and the smaller misconfigurations.
"""

import errno
import glob
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from maxnnx import cli, paths
from maxnnx.checkpoint.manager import CheckpointManager
from maxnnx.checkpoint.run_lock import RunLock
from maxnnx.data import DEFAULT_CORPUS
from maxnnx.train import TrainConfig, run_dir
from maxnnx.train.optimizers import make_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ['model=tiny', 'model.num_layers=1', 'seq_len=32', 'global_batch_size=4',
        'sample_tokens=0', 'eval_every=0', 'checkpoint_every=2', 'log_every=1', 'mesh.data=1']


def _train(out, *extra) -> int:
  return cli.main(['train', f'output_dir={out}', *ARGS, 'steps=4', *extra])


def _snapshot(out) -> dict[str, str]:
  """``{relative path: sha256}`` of every file of a run directory but the lock."""
  files = {}
  for path in glob.glob(os.path.join(out, '**', '*'), recursive=True):
    if os.path.isfile(path) and not path.endswith(run_dir.LOCK_NAME):
      with open(path, 'rb') as f:
        files[os.path.relpath(path, out)] = hashlib.sha256(f.read()).hexdigest()
  return files


def _steps(out) -> list[int]:
  with open(os.path.join(out, 'metrics.jsonl')) as f:
    return [json.loads(line)['step'] for line in f]


def _error_line(err: str) -> str:
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith('error: '), err
  return lines[0]


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  """A finished 4-step run with checkpoints at steps 2 and 4."""
  out = tmp_path_factory.mktemp('finished') / 'run'
  assert _train(out) == 0
  return out


@pytest.fixture
def run_copy(finished, tmp_path):
  out = tmp_path / 'run'
  shutil.copytree(finished, out)
  return out


# -- the run lock ------------------------------------------------------------------------------

def test_second_run_is_refused_naming_the_holder(tmp_path, capsys):
  out = tmp_path / 'run'
  with RunLock(str(out), command='first'):
    assert _train(out) != 0
  line = _error_line(capsys.readouterr().err)
  assert f'pid {os.getpid()}' in line and str(out) in line and 'started' in line


@pytest.mark.slow
def test_second_run_is_refused_while_the_first_finishes_intact(tmp_path, capsys):
  out = tmp_path / 'run'
  env = {**os.environ, 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu'}
  first = subprocess.Popen([sys.executable, '-m', 'maxnnx', 'train', f'output_dir={out}', *ARGS,
                            'steps=4'], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  lock = RunLock(str(out))
  deadline = time.time() + 120
  while time.time() < deadline and lock.holder().get('pid') != first.pid:
    time.sleep(0.05)
  assert _train(out) != 0
  assert f'pid {first.pid}' in _error_line(capsys.readouterr().err)
  _, err = first.communicate(timeout=300)
  assert first.returncode == 0, err.decode()[-2000:]
  assert os.path.exists(out / 'final' / 'config.json') and _steps(out) == [1, 2, 3, 4]


# -- resume is checked, never guessed ----------------------------------------------------------

@pytest.mark.parametrize('change, line', [
    ('model.num_layers=2', 'model.num_layers: 1 -> 2'),
    ('learning_rate=1e-3', 'learning_rate: 0.003 -> 0.001'),
    ('scan_layers=true', 'model.scan_layers: False -> True'),
])
def test_changed_config_is_refused_and_nothing_is_touched(run_copy, capsys, change, line):
  before = _snapshot(run_copy)
  assert _train(run_copy, change) != 0
  err = capsys.readouterr().err
  assert err.startswith('error: ') and line in err and 'resume=never' in err
  assert 'Traceback' not in err
  assert _snapshot(run_copy) == before


def test_a_start_that_failed_before_its_first_step_pins_no_config(tmp_path, capsys):
  """A start refused for its mesh (after its config was stored) leaves no config that refuses
  the corrected command, which also changes the model; a run that wrote a checkpoint does."""
  out = tmp_path / 'run'
  assert _train(out, 'model.num_layers=2', 'mesh.data=16', 'global_batch_size=16') != 0
  assert 'uses 16 devices' in _error_line(capsys.readouterr().err)
  assert os.path.exists(out / run_dir.RUN_CONFIG)
  assert _train(out, 'steps=1', 'checkpoint_every=0') == 0
  assert 'wrote no checkpoint; this run replaces it' in capsys.readouterr().out
  assert os.path.exists(out / 'final' / 'config.json')
  assert _train(out, 'steps=1', 'checkpoint_every=0', 'model.num_layers=2') != 0  # final/ pins
  assert 'model.num_layers: 1 -> 2' in capsys.readouterr().err


@pytest.mark.slow
def test_resume_never_moves_the_old_run_aside(run_copy, capsys):
  before = _snapshot(run_copy)
  assert cli.main(['train', f'output_dir={run_copy}', *ARGS, 'steps=2', 'model.num_layers=2',
                   'resume=never']) == 0
  out = capsys.readouterr().out
  assert 'moved the earlier run to' in out
  [previous] = glob.glob(str(run_copy / 'previous' / '*'))
  assert _snapshot(previous) == before
  assert _steps(run_copy) == [1, 2]


def test_training_longer_resumes_and_says_the_schedule_is_stretched(run_copy, capsys):
  assert _train(run_copy, 'steps=6') == 0
  out = capsys.readouterr().out
  assert 'Resuming from the checkpoint of step 4' in out
  [note] = [line for line in out.splitlines() if 'schedule' in line]
  made_for, now = (TrainConfig(steps=n, learning_rate=3e-3) for n in (4, 6))
  before, after = (float(make_schedule(c)(4)) for c in (made_for, now))
  assert before != after
  assert note == (f'Note: resuming at step 4 of a run whose learning-rate schedule was 4 steps '
                  f'long: it is stretched to 6 steps, so the learning rate jumps from '
                  f'{before:.3g} to {after:.3g}; set learning_rate_schedule_steps=4 to keep it.')
  assert _steps(run_copy) == [1, 2, 3, 4, 5, 6]
  assert _train(run_copy, 'steps=8') == 0  # its checkpoint of step 6 was made for 6 steps
  out = capsys.readouterr().out
  assert 'Resuming from the checkpoint of step 6' in out and 'was 6 steps long' in out
  shutil.rmtree(run_copy / 'final')
  assert _train(run_copy, 'steps=8') == 0
  out = capsys.readouterr().out
  assert 'Resuming from the checkpoint of step 8' in out and 'schedule' not in out


def test_metrics_are_trimmed_to_the_restored_step(run_copy, capsys):
  shutil.rmtree(run_copy / 'checkpoints' / '4')  # as if killed before step 4's save
  assert _train(run_copy) == 0
  assert 'Resuming from the checkpoint of step 2' in capsys.readouterr().out
  assert _steps(run_copy) == [1, 2, 3, 4]


@pytest.mark.parametrize('broken, message', [
    ((4,), 'Resuming from the checkpoint of step 2'),
    ((2, 4), 'starting from scratch'),
])
def test_corrupt_checkpoints_fall_back_cleanly(run_copy, capfd, caplog, broken, message):
  for step in broken:
    os.remove(run_copy / 'checkpoints' / str(step) / 'state' / 'manifest.ocdbt')
  assert _train(run_copy) == 0
  out, err = capfd.readouterr()
  assert message in out
  assert 'Traceback' not in err and 'Event loop is closed' not in err
  assert caplog.text.count('is unusable') == len(broken)
  assert _steps(run_copy) == [1, 2, 3, 4]


# -- the tokenizer is pinned -------------------------------------------------------------------

def test_resuming_on_another_corpus_is_refused(run_copy, tmp_path, capsys):
  corpus = tmp_path / 'other.txt'
  with open(DEFAULT_CORPUS) as f:
    corpus.write_text(f.read()[:200_000].upper())
  before = _snapshot(run_copy)
  assert _train(run_copy, f'data={corpus}') != 0
  err = capsys.readouterr().err
  assert 'tokenizer:' in err and 'other.txt' in err and 'a different vocabulary' in err
  assert _snapshot(run_copy) == before and not os.path.exists(run_copy / '.tokenizer-new')


# -- idempotent finishing ----------------------------------------------------------------------

def test_rerun_of_a_finished_run_writes_only_what_is_missing(run_copy, capsys):
  for name in ('loss.png', 'train_options.json'):
    os.remove(run_copy / name)
  shutil.rmtree(run_copy / 'final')
  before = _snapshot(run_copy)
  assert _train(run_copy) == 0
  assert 'wrote the missing final/, loss.png, train_options.json' in capsys.readouterr().out
  after = _snapshot(run_copy)
  assert {k: v for k, v in after.items() if k in before} == before
  assert {'loss.png', 'train_options.json', 'final/config.json'} <= set(after)
  assert _train(run_copy) == 0  # and once complete, a rerun changes nothing at all
  assert _snapshot(run_copy) == after


# -- preemption --------------------------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_saves_and_the_restart_resumes_exactly(tmp_path, capsys):
  steps = ['steps=300', 'checkpoint_every=1000']
  reference = tmp_path / 'reference'
  assert cli.main(['train', f'output_dir={reference}', *ARGS, *steps]) == 0
  with open(reference / 'metrics.jsonl') as f:
    expected = {m['step']: m['loss'] for m in map(json.loads, f)}
  out = tmp_path / 'run'
  env = {**os.environ, 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu'}
  command = [sys.executable, '-m', 'maxnnx', 'train', f'output_dir={out}', *ARGS, *steps]
  child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
  metrics, deadline = out / 'metrics.jsonl', time.time() + 120
  while time.time() < deadline and not (metrics.exists() and len(_steps(out)) >= 5):
    time.sleep(0.02)
  child.send_signal(signal.SIGTERM)
  stdout, stderr = child.communicate(timeout=120)
  assert child.returncode == 0, stderr[-2000:]
  assert 'Stopped by SIGTERM after step' in stdout
  stopped = CheckpointManager(str(out / 'checkpoints')).all_steps()[-1]
  assert 5 <= stopped < 300 and _steps(out) == list(range(1, stopped + 1))
  capsys.readouterr()
  assert cli.main(['train', f'output_dir={out}', *ARGS, *steps]) == 0
  assert f'Resuming from the checkpoint of step {stopped}' in capsys.readouterr().out
  with open(metrics) as f:
    losses = {m['step']: m['loss'] for m in map(json.loads, f)}
  assert sorted(losses) == list(range(1, 301))
  for step, loss in losses.items():
    assert loss == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step


def test_stop_request_restores_the_handlers():
  from maxnnx.train.preemption import StopRequest
  before = signal.getsignal(signal.SIGTERM)
  with StopRequest() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)
    assert stop and stop.signal_name == 'SIGTERM'
  assert signal.getsignal(signal.SIGTERM) is before


# -- filesystem faults -------------------------------------------------------------------------

def test_output_dir_that_is_a_file(tmp_path, capsys):
  path = tmp_path / 'file'
  path.write_text('x')
  assert _train(path) != 0
  assert 'is a file' in _error_line(capsys.readouterr().err)
  assert _train(path / 'run') != 0
  assert str(path) in _error_line(capsys.readouterr().err)


def test_read_only_output_dir(tmp_path, capsys, monkeypatch):
  out = tmp_path / 'run'
  out.mkdir()
  if os.geteuid() == 0:  # root writes anywhere: simulate the file system's answer
    def read_only(path, *args, **kwargs):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    monkeypatch.setattr(paths, 'open', read_only, raising=False)
  else:
    os.chmod(out, 0o555)
  try:
    assert _train(out) != 0
  finally:
    os.chmod(out, 0o755)
  line = _error_line(capsys.readouterr().err)
  assert str(out) in line and ('Read-only' in line or 'Permission denied' in line)


def test_full_disk_while_saving_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
  out = tmp_path / 'run'
  save = CheckpointManager.save

  def full_at_step_4(self, step, *args, **kwargs):
    if step == 4:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(self.directory, '4'))
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(CheckpointManager, 'save', full_at_step_4)
  assert _train(out) != 0
  line = _error_line(capsys.readouterr().err)
  assert 'No space left on device' in line and str(out / 'checkpoints' / '4') in line
  assert CheckpointManager(str(out / 'checkpoints')).all_steps() == [2]
  RunLock(str(out)).acquire().release()  # the lock went with the failed run


def test_a_write_the_file_system_refuses_is_one_line_and_no_traceback(tmp_path):
  """A real refused write inside orbax's writers (the file-size limit stands in for a full disk:
  tensorstore reports both as ``RESOURCE_EXHAUSTED ... [os_error_code=N]``): every writer thread
  used to echo it, 14 to 75 tracebacks before the error line. Now the run ends with one line
  naming the step's directory and nothing else on stderr (the slow-step warning is off: on a
  loaded machine it may fire, and it is not what this test pins down)."""
  out = tmp_path / 'run'
  script = ('import resource, signal, sys\n'
            'signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n'
            'resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000))\n'
            'from maxnnx import cli\n'
            'sys.exit(cli.main(sys.argv[1:]))\n')
  done = subprocess.run([sys.executable, '-c', script, 'train', f'output_dir={out}', *ARGS,
                         'steps=4', 'data=synthetic', 'outlier_factor=0'],
                        capture_output=True, text=True,
                        timeout=300,
                        env={**os.environ, 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu'})
  assert done.returncode == 1, done.stderr[-2000:]
  lines = [line for line in done.stderr.splitlines() if line.strip()]
  assert 'Traceback' not in done.stderr, done.stderr[-2000:]
  assert lines == [f'error: File too large: {out / "checkpoints" / "2"}'], lines


# -- smaller faults ----------------------------------------------------------------------------

def test_missing_text_file_is_reported_missing(tmp_path, capsys):
  assert _train(tmp_path / 'run', f'data={tmp_path}/missing.txt') != 0
  line = _error_line(capsys.readouterr().err)
  assert 'missing.txt: no such file' in line


def test_nan_learning_rate_is_refused(tmp_path, capsys):
  assert _train(tmp_path / 'run', 'learning_rate=nan') != 0
  assert 'learning_rate' in _error_line(capsys.readouterr().err)


def test_batch_that_the_mesh_does_not_divide(tmp_path, capsys):
  assert cli.main(['train', f'output_dir={tmp_path}/run', *ARGS, 'global_batch_size=12',
                   'mesh.data=8', 'data=synthetic']) != 0
  line = _error_line(capsys.readouterr().err)
  assert 'global_batch_size=12' in line and 'mesh.data=8' in line


def test_seq_len_past_the_positions(tmp_path, capsys):
  assert _train(tmp_path / 'run', 'seq_len=1024', 'data=synthetic') != 0
  line = _error_line(capsys.readouterr().err)
  assert 'seq_len=1024' in line and 'max_position_embeddings=512' in line


def test_generate_caps_max_new_tokens_to_the_context(finished, capsys, caplog):
  """max_new_tokens=1000 runs to the end of the 512-token context and says so in one line (it
  ran on past the trained positions with only a warning); a prompt that fills it is refused."""
  with caplog.at_level(logging.WARNING):
    assert cli.main(['generate', f'output_dir={finished}', 'prompt=KING:', 'temperature=0',
                     'max_new_tokens=1000']) == 0
  notes = [line for line in capsys.readouterr().out.splitlines() if 'capped' in line]
  assert notes and notes[0].startswith('Note: max_new_tokens=1000 is capped to 5')
  assert "of the model's 512 (max_position_embeddings)" in notes[0]
  assert 'run past' not in caplog.text
  assert cli.main(['generate', f'output_dir={finished}', 'prompt=' + 'KING ' * 600]) == 2
  assert 'max_position_embeddings' in _error_line(capsys.readouterr().err)


def test_top_k_past_the_vocabulary_is_clamped(finished, capsys, caplog):
  with caplog.at_level(logging.WARNING):
    assert cli.main(['generate', f'output_dir={finished}', 'top_k=100000',
                     'max_new_tokens=2']) == 0
  assert 'top_k=100000 is larger than the vocabulary (512 tokens)' in caplog.text


def test_generate_takes_sampling_controls_and_refuses_bad_ones_in_one_line(finished, capsys):
  """logit_bias=7:100 forces token 7 on every step (min_tokens and the penalties pass through);
  a penalty out of range or a malformed bias is one line naming the key."""
  from maxnnx.data import SentencePieceTokenizer  # noqa: PLC0415
  assert cli.main(['generate', f'output_dir={finished}', 'prompt=KING:', 'temperature=0',
                   'max_new_tokens=4', 'logit_bias=7:100', 'min_tokens=2',
                   'frequency_penalty=0.5', 'repetition_penalty=1.2']) == 0
  tokenizer = SentencePieceTokenizer(str(finished / 'tokenizer.model'))
  assert capsys.readouterr().out.strip() == 'KING:' + tokenizer.decode([7] * 4)
  for bad, named in (('frequency_penalty=3', 'frequency_penalty=3.0 (need -2 <='),
                     ('logit_bias=7', "logit_bias='7': expected id:bias pairs"),
                     ('logit_bias=7:500', 'logit_bias {7: 500.0}')):
    assert cli.main(['generate', f'output_dir={finished}', 'max_new_tokens=2', bad]) == 2
    assert named in _error_line(capsys.readouterr().err)


def test_generate_with_quantized_weights_and_a_mode_that_does_not_exist(finished, capsys):
  """quantization=int8 generates from int8 linear layers; quantization=int3 is refused in one
  line naming the choices, before anything loads; quantization=checkpoint over a float run is
  refused in one line saying there is nothing stored quantized to keep."""
  assert cli.main(['generate', f'output_dir={finished}', 'prompt=KING:', 'temperature=0',
                   'max_new_tokens=4', 'quantization=int8']) == 0
  assert capsys.readouterr().out.strip()
  assert cli.main(['generate', f'output_dir={finished}', 'quantization=int3']) != 0
  line = _error_line(capsys.readouterr().err)
  assert "quantization='int3': expected one of int8, int4, fp8, w8a8" in line
  # checkpoint: a quantized release's own weights, which a float run does not have
  assert cli.main(['generate', f'output_dir={finished}', 'quantization=checkpoint']) != 0
  assert 'keep_quantized=True: ' in _error_line(capsys.readouterr().err)


def test_generate_with_a_quantized_kv_cache_and_a_dtype_that_does_not_exist(finished, capsys):
  """kv_cache_dtype=int8 generates through an int8 KV cache (beside int8 weights);
  kv_cache_dtype=int4 is refused in one line naming the key and the choices."""
  assert cli.main(['generate', f'output_dir={finished}', 'prompt=KING:', 'temperature=0',
                   'max_new_tokens=4', 'quantization=int8', 'kv_cache_dtype=int8']) == 0
  assert capsys.readouterr().out.strip()
  assert cli.main(['generate', f'output_dir={finished}', 'kv_cache_dtype=int4']) != 0
  line = _error_line(capsys.readouterr().err)
  assert "kv_cache_dtype='int4': expected one of auto, int8, fp8" in line

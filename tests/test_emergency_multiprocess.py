"""Emergency checkpoints over two processes joined by jax.distributed on 127.0.0.1.

One run of 2 processes x 2 CPU devices (mesh data=2 x fsdp=2, float32) saves a local
checkpoint every step and a persistent one every 4; process 1 is killed when step 6's metrics
arrive (local step 5 is complete on both disks, step 6 only half written, persistent step 4).
From copies of what it left:

* process 1's local directory is deleted and the 2 processes restart: both resume from local
  step 5 (newer than persistent 4; the half-written 6 skipped), process 1 reading its shards
  from the replica on process 0's disk and copying them back;
* one process restarts alone: it resumes from local step 5 (its own shards and its replica of
  process 1's), resharded onto its 2 devices, with grad_accum_steps 2 so that each
  micro-batch still holds 4 rows per process and the global batch 8.

Asserted: every loss, before the kill and after each restart, equals the loss of the same
step in one uninterrupted single-device run on the same global batches (float32, rel 1e-5).
"""

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import free_port

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.train import TrainConfig, Trainer
from tests.multihost.common import BATCH, SEQ, StepBatches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, DIE_AT = 8, 6

pytestmark = pytest.mark.slow  # 20-110 s per run of the processes on 2 shared CPU cores


def _start(root, processes, die_at=0):
  port = free_port()
  env = {**os.environ, 'PYTHONPATH': ROOT + os.pathsep + os.environ.get('PYTHONPATH', '')}
  return [subprocess.Popen([sys.executable, '-m', 'tests.multihost.emergency_worker', str(port),
                            str(i), str(processes), str(root), str(die_at)], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for i in range(processes)]


def _finish(procs, timeout=300):
  logs = []
  for proc in procs:
    try:
      logs.append(proc.communicate(timeout=timeout)[0])
    finally:
      proc.kill()
  assert all(p.returncode == 0 for p in procs), '\n\n'.join(log[-3000:] for log in logs)


def _losses(root) -> dict[int, float]:
  records = [json.loads(line) for line in open(root / 'losses.jsonl')]
  return {r['step']: r['loss'] for r in records}


def _resume(root, process) -> dict:
  return json.loads((root / f'resume-{process}.json').read_text())


@pytest.fixture(scope='module')
def reference():
  """Losses of an uninterrupted 8-step run on one device, on the same global batches."""
  model = maxnnx.get_preset('tiny', num_layers=2,
                            runtime={'scan_layers': True, 'dtype': 'float32'})
  config = TrainConfig(steps=STEPS, global_batch_size=BATCH, seq_len=SEQ, learning_rate=1e-2,
                       warmup_steps=0, log_every=1, mesh=MeshConfig(data=1))
  history = Trainer(model, config, data=StepBatches()).fit(log=lambda line: None)
  return {m['step']: m['loss'] for m in history}


@pytest.fixture(scope='module')
def killed(tmp_path_factory):
  """What the 2-process run left when process 1 died at step 6."""
  root = tmp_path_factory.mktemp('killed')
  started = time.time()
  procs = _start(root, 2, DIE_AT)
  assert procs[1].wait(timeout=300) == 17, procs[1].communicate()[0][-3000:]
  try:
    procs[0].wait(timeout=10)  # blocked in step 7's collectives with a dead peer
  except subprocess.TimeoutExpired:
    pass
  procs[0].kill()
  procs[0].communicate()
  print(f'2-process run to the kill: {time.time() - started:.1f} s')
  local = root / 'local'
  assert sorted(os.listdir(local / 'process-0' / '5')) == [
      'shards-0.json', 'shards-0.npz', 'shards-1.json', 'shards-1.npz']  # own + replica of 1
  assert not (local / 'process-1' / '6' / 'shards-1.json').exists()  # step 6: half written
  assert sorted(os.listdir(root / 'persistent'))[:1] == ['4']
  return root


def _copy(killed, tmp_path):
  root = tmp_path / 'run'
  shutil.copytree(killed, root)
  return root


def test_losses_before_the_kill_match_an_uninterrupted_run(killed, reference):
  losses = _losses(killed)
  assert sorted(losses) == list(range(1, DIE_AT + 1))
  np.testing.assert_allclose([losses[s] for s in losses], [reference[s] for s in losses],
                             rtol=1e-5)


def test_a_lost_local_directory_is_restored_from_its_replica(killed, reference, tmp_path):
  root = _copy(killed, tmp_path)
  shutil.rmtree(root / 'local' / 'process-1')
  (root / 'losses.jsonl').unlink()
  started = time.time()
  _finish(_start(root, 2))
  print(f'2-process restart: {time.time() - started:.1f} s')
  for process in (0, 1):
    resumed = _resume(root, process)
    assert resumed['step'] == DIE_AT - 1 and resumed['grad_accum_steps'] == 1
    assert resumed['own_copy']  # process 1 copied its shards back from process 0's disk
  losses = _losses(root)
  assert sorted(losses) == list(range(DIE_AT, STEPS + 1))
  np.testing.assert_allclose([losses[s] for s in losses], [reference[s] for s in losses],
                             rtol=1e-5)


def test_a_restart_on_one_process_continues_with_the_same_global_batch(killed, reference,
                                                                      tmp_path):
  root = _copy(killed, tmp_path)
  (root / 'losses.jsonl').unlink()
  started = time.time()
  _finish(_start(root, 1))
  print(f'1-process restart: {time.time() - started:.1f} s')
  resumed = _resume(root, 0)
  assert resumed['step'] == DIE_AT - 1 and resumed['grad_accum_steps'] == 2
  assert 'saved by 2 processes with grad_accum_steps=1; on 1 it is 2' in resumed['batch_note']
  records = [json.loads(line) for line in open(root / 'losses.jsonl')]
  assert {r['processes'] for r in records} == {1}
  losses = _losses(root)
  assert sorted(losses) == list(range(DIE_AT, STEPS + 1))
  np.testing.assert_allclose([losses[s] for s in losses], [reference[s] for s in losses],
                             rtol=1e-5)
  assert sorted(os.listdir(root / 'persistent'))[:2] == ['4', '8']

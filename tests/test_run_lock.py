"""One run per output directory: refusal naming the holder, stale-lock takeover; on an object
store (the ``fake_gcs`` bucket), a renewed lock object."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from maxnnx import paths
from maxnnx.checkpoint.run_lock import LOCK_NAME, RunLock, RunLockedError

HOLD = textwrap.dedent('''
    import sys, time
    from maxnnx.checkpoint.run_lock import RunLock
    RunLock(sys.argv[1], command='holder').acquire()
    print('held', flush=True)
    time.sleep(120)
    ''')


def _holder(directory):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
  proc = subprocess.Popen([sys.executable, '-c', HOLD, str(directory)], stdout=subprocess.PIPE,
                          text=True, env=env)
  assert proc.stdout.readline().strip() == 'held'
  return proc


def test_second_run_is_refused_with_the_holder_named(tmp_path):
  proc = _holder(tmp_path)
  try:
    with pytest.raises(RunLockedError) as info:
      RunLock(str(tmp_path)).acquire()
    message = str(info.value)
    assert f'pid {proc.pid}' in message and str(tmp_path) in message and '\n' not in message
  finally:
    proc.kill()
    proc.wait()


def test_lock_of_a_killed_run_is_taken_over(tmp_path, caplog):
  proc = _holder(tmp_path)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  lock = RunLock(str(tmp_path), command='second').acquire()
  try:
    assert lock.stale_holder['pid'] == proc.pid
    assert 'left by a run that is gone' in caplog.text
    assert lock.holder()['pid'] == os.getpid() and lock.holder()['command'] == 'second'
  finally:
    lock.release()


def test_release_then_reacquire_is_not_stale(tmp_path):
  with RunLock(str(tmp_path)) as lock:
    assert lock.held
  assert RunLock(str(tmp_path)).holder() == {}
  again = RunLock(str(tmp_path)).acquire()
  assert again.stale_holder is None
  again.release()


def test_same_process_twice_is_refused(tmp_path):
  # flock is per open file description: a second acquire in one process is refused too.
  first = RunLock(str(tmp_path)).acquire()
  try:
    with pytest.raises(RunLockedError):
      RunLock(str(tmp_path)).acquire()
  finally:
    first.release()


# -- the run lock on an object store ---------------------------------------------------------------

def test_lock_object_is_refused_while_fresh_and_deleted_on_release(fake_gcs):
  run = fake_gcs.url('run')
  first = RunLock(run, command='first', heartbeat_seconds=0.05).acquire()
  try:
    holder = json.loads(paths.read_text(paths.join(run, LOCK_NAME)))
    assert holder['command'] == 'first' and holder['pid'] == os.getpid()
    renewed = holder['renewed']
    time.sleep(0.3)
    assert first.holder()['renewed'] > renewed  # the heartbeat renews it
    with pytest.raises(RunLockedError, match='is in use by another run') as refused:
      RunLock(run).acquire()
    assert f'delete {run}/{LOCK_NAME}' in str(refused.value)
  finally:
    first.release()
  assert not paths.exists(paths.join(run, LOCK_NAME)) and not first.held
  RunLock(run).acquire().release()  # free again


@pytest.mark.parametrize('host, pid, age', [
    ('elsewhere', 1, 3600.0),  # not renewed for an hour
    (socket.gethostname(), 2 ** 22 + 1, 0.0),  # renewed just now, by a process gone from here
])
def test_stale_lock_object_is_taken_over(fake_gcs, host, pid, age, caplog):
  run = fake_gcs.url('run')
  holder = {'host': host, 'pid': pid, 'renewed': time.time() - age}
  paths.write_text(paths.join(run, LOCK_NAME), json.dumps(holder))
  lock = RunLock(run).acquire()
  try:
    assert lock.held and lock.stale_holder == holder
    assert 'Taking over the lock' in caplog.text
    assert lock.holder()['pid'] == os.getpid()
  finally:
    lock.release()

"""One run per output directory: refusal naming the holder, stale-lock takeover."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from maxnnx.checkpoint.run_lock import RunLock, RunLockedError

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


def test_remote_directories_are_not_locked(caplog):
  lock = RunLock('gs://bucket/run').acquire()
  assert not lock.held and 'not locked' in caplog.text

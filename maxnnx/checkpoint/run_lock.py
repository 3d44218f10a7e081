"""One run per output directory: a lock with the holder's name on it.

``RunLock(directory).acquire()`` creates ``<directory>/.run.lock`` holding who took it
(host, pid, start time, command). A second run on the same directory gets
:class:`RunLockedError`, one line naming the holder. The lock is released by
:meth:`RunLock.release` or at process exit.

A local directory is locked with an exclusive ``flock`` on that file. The operating system
drops a ``flock`` when its process dies however it dies (SIGKILL included), so a lock file left
behind by a killed run is unlocked: the next run recognises it as stale, says whose it was, and
takes it over.

An object store (``gs://…``) has no locks, so there the lock is an object the holder renews
(a thread rewrites its ``renewed`` time every ``heartbeat_seconds``) and deletes on release. A
lock object is live while it was renewed less than ``stale_seconds`` ago, unless it names this
host and a process that no longer runs (a restart on the same machine after a crash). A live
one is refused, naming the holder and how to delete it should that run be gone; a stale one is
taken over with a warning. This lock is advisory: two runs starting within the same moment can
both read "free" before either writes, and after writing each reads the object back so that
at least the later writer sees the earlier one and stops.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid

from maxnnx import paths
from maxnnx.paths import is_remote

logger = logging.getLogger(__name__)

LOCK_NAME = '.run.lock'


class RunLockedError(RuntimeError):
  """Another live run holds the output directory."""


def _describe(holder: dict) -> str:
  return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started "
          f"{holder.get('started', '?')}")


class RunLock:
  """An exclusive, self-describing lock on a run directory (see the module docstring).

  Args:
    directory: the run's output directory (created if missing), local or a URL.
    command: what the holder is running, shown to a refused second run.
    heartbeat_seconds: how often the holder renews a lock on an object store.
    stale_seconds: how long after its last renewal a lock on an object store counts as left
      behind by a run that is gone.
  """

  def __init__(self, directory: str, command: str | None = None, *,
               heartbeat_seconds: float = 60.0, stale_seconds: float = 300.0):
    self.directory = paths.normalize(directory)
    self.path = paths.join(self.directory, LOCK_NAME)
    self.command = command if command is not None else ' '.join(sys.argv)
    self.heartbeat_seconds, self.stale_seconds = heartbeat_seconds, stale_seconds
    self._fd: int | None = None
    self._record: dict | None = None  # the lock object this holder wrote (object stores)
    self._stop = threading.Event()
    self._heartbeat: threading.Thread | None = None
    self.stale_holder: dict | None = None

  @property
  def held(self) -> bool:
    """Whether this object holds the lock."""
    return self._fd is not None or self._record is not None

  def _new_record(self) -> dict:
    return {'host': socket.gethostname(), 'pid': os.getpid(),
            'started': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
            'command': self.command}

  def acquire(self) -> RunLock:
    """Take the lock, taking over a stale one.

    Raises:
      RunLockedError: a live process holds it (the message names it).
    """
    if is_remote(self.directory):
      return self._acquire_object()
    os.makedirs(self.directory, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = self._read(fd)
      os.close(fd)
      raise RunLockedError(
          f'{self.directory} is in use by another run ({_describe(holder)}); wait for it to '
          'finish or use another output_dir.') from None
    previous = self._read(fd)
    if previous:
      self.stale_holder = previous
      logger.warning('Taking over the lock of %s left by a run that is gone (%s).',
                     self.directory, _describe(previous))
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(self._new_record()).encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def release(self) -> None:
    """Give the lock up (a local lock file is emptied, so nobody mistakes it for a stale one;
    a lock object is deleted)."""
    if self._record is not None:
      self._release_object()
    if self._fd is None:
      return
    try:
      os.ftruncate(self._fd, 0)
      fcntl.flock(self._fd, fcntl.LOCK_UN)
    finally:
      os.close(self._fd)
      self._fd = None

  def holder(self) -> dict:
    """Who holds (or last held) the lock, as written in the lock file; ``{}`` if nobody."""
    if is_remote(self.directory):
      return self._read_object()
    try:
      fd = os.open(self.path, os.O_RDONLY)
    except FileNotFoundError:
      return {}
    try:
      return self._read(fd)
    finally:
      os.close(fd)

  @staticmethod
  def _read(fd: int) -> dict:
    try:
      text = os.pread(fd, 1 << 16, 0).decode()
      return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
      return {}

  # -- on an object store -----------------------------------------------------------------------

  def _read_object(self) -> dict:
    try:
      text = paths.read_text(self.path)
      return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
      return {}

  def live(self, holder: dict) -> bool:
    """Whether a lock object's ``holder`` record belongs to a run that may still be going:
    renewed less than ``stale_seconds`` ago, and not a dead process of this host."""
    if not holder:
      return False
    if time.time() - float(holder.get('renewed', 0)) > self.stale_seconds:
      return False
    if holder.get('host') == socket.gethostname() and isinstance(holder.get('pid'), int):
      return _process_exists(holder['pid'])
    return True

  def _acquire_object(self) -> RunLock:
    previous = self._read_object()
    if self.live(previous):
      raise self._refusal(previous)
    if previous:
      self.stale_holder = previous
      logger.warning('Taking over the lock of %s left by a run that is gone (%s; last renewed '
                     '%.0f s ago).', self.directory, _describe(previous),
                     time.time() - float(previous.get('renewed', 0)))
    record = {**self._new_record(), 'token': uuid.uuid4().hex, 'renewed': time.time()}
    paths.makedirs(self.directory)
    paths.write_text(self.path, json.dumps(record))
    written = self._read_object()
    if written.get('token') != record['token']:  # another run wrote it at the same moment
      raise self._refusal(written)
    self._record = record
    self._stop.clear()
    self._heartbeat = threading.Thread(target=self._renew, name='maxnnx-run-lock', daemon=True)
    self._heartbeat.start()
    return self

  def _refusal(self, holder: dict) -> RunLockedError:
    age = time.time() - float(holder.get('renewed', 0))
    return RunLockedError(
        f'{self.directory} is in use by another run ({_describe(holder)}; its lock was renewed '
        f'{age:.0f} s ago); wait for it to finish or use another output_dir. If that run is '
        f'gone, delete {self.path} (it counts as stale {self.stale_seconds:.0f} s after its '
        'last renewal).')

  def _renew(self) -> None:
    while not self._stop.wait(self.heartbeat_seconds):
      record = self._record
      if record is None:
        return
      try:
        if self._read_object().get('token') != record['token']:
          logger.warning('The lock of %s was taken over by another run (%s); no longer '
                         'renewing it.', self.directory, _describe(self._read_object()))
          return
        record['renewed'] = time.time()
        paths.write_text(self.path, json.dumps(record))
      except Exception as e:  # noqa: BLE001 (a failed renewal is retried at the next beat)
        logger.warning('Could not renew the lock of %s: %s', self.directory, e)

  def _release_object(self) -> None:
    self._stop.set()
    if self._heartbeat is not None:
      self._heartbeat.join()
      self._heartbeat = None
    record, self._record = self._record, None
    try:
      if self._read_object().get('token') == record['token']:
        paths.remove(self.path)
    except OSError as e:
      logger.warning('Could not delete the lock %s: %s', self.path, e)

  def __enter__(self) -> RunLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _process_exists(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


__all__ = ['LOCK_NAME', 'RunLock', 'RunLockedError', 'is_remote']

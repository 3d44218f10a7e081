"""One run per output directory: an advisory lock with the holder's name on it.

``RunLock(directory).acquire()`` creates ``<directory>/.run.lock`` holding who took it
(host, pid, start time, command) and takes an exclusive ``flock`` on it. A second run on the
same directory gets :class:`RunLockedError`, one line naming the holder. The operating system
drops a ``flock`` when its process dies however it dies (SIGKILL included), so a lock file left
behind by a killed run is unlocked: the next run recognises it as stale, says whose it was, and
takes it over. The lock is released by :meth:`RunLock.release` or at process exit.

Only local directories can be locked this way; for remote paths (``gs://…``) the lock is
skipped with a warning, since object stores offer no advisory locks.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import sys

logger = logging.getLogger(__name__)

LOCK_NAME = '.run.lock'


class RunLockedError(RuntimeError):
  """Another live run holds the output directory."""


def is_remote(path: str) -> bool:
  """True for URLs such as ``gs://bucket/run`` (anything with a scheme but ``file://``)."""
  return '://' in path and not path.startswith('file://')


def _describe(holder: dict) -> str:
  return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started "
          f"{holder.get('started', '?')}")


class RunLock:
  """An exclusive, self-describing lock on a run directory.

  Args:
    directory: the run's output directory (created if missing).
    command: what the holder is running, shown to a refused second run.
  """

  def __init__(self, directory: str, command: str | None = None):
    self.directory = directory
    self.path = os.path.join(directory, LOCK_NAME)
    self.command = command if command is not None else ' '.join(sys.argv)
    self._fd: int | None = None
    self.stale_holder: dict | None = None

  @property
  def held(self) -> bool:
    """Whether this object holds the lock."""
    return self._fd is not None

  def acquire(self) -> RunLock:
    """Take the lock, taking over a stale one.

    Raises:
      RunLockedError: a live process holds it (the message names it).
    """
    if is_remote(self.directory):
      logger.warning('%s is remote: runs on it are not locked against each other.',
                     self.directory)
      return self
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
    record = {'host': socket.gethostname(), 'pid': os.getpid(),
              'started': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
              'command': self.command}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def release(self) -> None:
    """Give the lock up (the file is emptied, so nobody mistakes it for a stale one)."""
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

  def __enter__(self) -> RunLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()

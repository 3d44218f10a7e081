"""Stop requests: SIGTERM and SIGINT become a flag the training loop checks between steps.

A preempted job gets SIGTERM (Kubernetes, Slurm, spot VMs) and some seconds before SIGKILL.
While a :class:`StopRequest` is entered (in the main thread only: Python runs signal handlers
there), the first SIGTERM or SIGINT only sets :attr:`StopRequest.signal_name`; the loop
finishes its step, saves a checkpoint and returns. A second SIGINT (Ctrl-C twice) raises
``KeyboardInterrupt`` as usual. The previous handlers are restored on exit.

Code that waits inside a step on something that may never end (a reward function in its
worker thread) polls :func:`requested` and raises :class:`StopRequested`; the loop then stops
before that step, which was never taken, and checkpoints the one before.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(Exception):
  """A wait inside a step was cut short by a stop request: the step is not taken."""


_ACTIVE: list[StopRequest] = []  # the entered requests, innermost last


def requested() -> str | None:
  """The signal's name (``'SIGTERM'``) once the innermost entered :class:`StopRequest` got one,
  else ``None``."""
  return _ACTIVE[-1].signal_name if _ACTIVE else None


class StopRequest:
  """A context manager that turns SIGTERM/SIGINT into a stop flag while it is entered."""

  def __init__(self):
    self.signal_name: str | None = None
    self._previous: dict[int, object] = {}

  def __bool__(self) -> bool:
    return self.signal_name is not None

  def _handle(self, signum, frame) -> None:
    del frame
    if self.signal_name is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signal_name = signal.Signals(signum).name

  def __enter__(self) -> StopRequest:
    if threading.current_thread() is threading.main_thread():
      for signum in SIGNALS:
        previous = signal.getsignal(signum)
        if previous is None:  # installed outside Python: leave it alone
          continue
        self._previous[signum] = previous
        signal.signal(signum, self._handle)
      _ACTIVE.append(self)
    return self

  def __exit__(self, *exc) -> None:
    if self in _ACTIVE:
      _ACTIVE.remove(self)
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}


__all__ = ['SIGNALS', 'StopRequest', 'StopRequested', 'requested']

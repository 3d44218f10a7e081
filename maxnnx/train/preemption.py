"""Stop requests: SIGTERM and SIGINT become a flag the training loop checks between steps.

A preempted job gets SIGTERM (Kubernetes, Slurm, spot VMs) and some seconds before SIGKILL.
While a :class:`StopRequest` is entered (in the main thread only: Python runs signal handlers
there), the first SIGTERM or SIGINT only sets :attr:`StopRequest.signal_name`; the loop
finishes its step, saves a checkpoint and returns. A second SIGINT (Ctrl-C twice) raises
``KeyboardInterrupt`` as usual. The previous handlers are restored on exit.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
    return self

  def __exit__(self, *exc) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}


__all__ = ['SIGNALS', 'StopRequest']

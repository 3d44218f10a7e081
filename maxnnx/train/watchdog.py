"""Step-time outliers and a hang watchdog for the training loop.

:class:`StepTimes` keeps a running median of the time per step (measured over
each metrics window: ``log_every`` steps, data waits included) and returns one
warning line for a window slower than ``outlier_factor`` times the median, at
most one every ``min_interval`` seconds.

:class:`Watchdog` is a daemon thread. When a step has run longer than
``factor`` times the median step time (times the steps still in flight, which
the step may have to wait for) and at least ``min_seconds``, it writes the
stack of every thread (``faulthandler``) to stderr and to a file, once per
hang, and lets the run go on. Before a median is known (the first steps), a step is hung
after ``first_seconds``. A file at a URL (``gs://``) gets the stacks written
locally first (``faulthandler`` needs a real file) and then added to it.
"""

from __future__ import annotations

import collections
import faulthandler
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from maxnnx import paths

logger = logging.getLogger(__name__)


class StepTimes:
  """Running median of seconds per step, and outlier warnings.

  Args:
    outlier_factor: warn when a window is this many times slower than the
      median (0: never).
    warmup_windows: windows ignored at the start (the first executions).
    min_samples: windows needed before there is a median.
    history: how many recent windows the median is over.
    min_interval: seconds between two warnings; ones in between are counted.
    clock: monotonic clock in seconds.
  """

  def __init__(self, outlier_factor: float, *, warmup_windows: int = 1, min_samples: int = 2,
               history: int = 100, min_interval: float = 30.0,
               clock: Callable[[], float] = time.monotonic):
    self.outlier_factor = outlier_factor
    self.warmup_windows, self.min_samples = warmup_windows, min_samples
    self.min_interval, self.clock = min_interval, clock
    self._samples: collections.deque[float] = collections.deque(maxlen=history)
    self._seen = 0
    self._last_warning: float | None = None
    self._suppressed = 0
    self.outliers = 0

  @property
  def median(self) -> float | None:
    """Median seconds per step over recent windows (``None`` until warmed up)."""
    if len(self._samples) < self.min_samples:
      return None
    return statistics.median(self._samples)

  def add(self, last_step: int, seconds_per_step: float, steps: int = 1) -> str | None:
    """Record a window of ``steps`` steps ending at ``last_step``; returns a warning or None."""
    self._seen += 1
    if self._seen <= self.warmup_windows:
      return None
    median = self.median
    self._samples.append(seconds_per_step)
    if not (self.outlier_factor and median and seconds_per_step > self.outlier_factor * median):
      return None
    self.outliers += 1
    now = self.clock()
    if self._last_warning is not None and now - self._last_warning < self.min_interval:
      self._suppressed += 1
      return None
    where = f'step {last_step}' if steps == 1 else f'steps {last_step - steps + 1}-{last_step}'
    line = (f'Slow {where}: {seconds_per_step:.3f} s per step, '
            f'{seconds_per_step / median:.1f}x the median {median:.3f} s')
    if self._suppressed:
      line += f' ({self._suppressed} more slow windows since the last warning)'
    self._last_warning, self._suppressed = now, 0
    return line + '.'


class Watchdog:
  """Dumps every thread's stack when a step hangs (see the module docstring).

  Args:
    factor: a step is hung after ``factor`` x median step time (0: off).
    min_seconds: ... and never before this many seconds.
    path: file the stacks are appended to (``None``: stderr only).
    stream: where else they go (default ``sys.stderr``).
    poll: seconds between checks (default from ``min_seconds``).
    first_seconds: the limit while no median is known (``None`` or 0: such steps are not
      watched).
  """

  def __init__(self, factor: float, min_seconds: float, path: str | None = None, *,
               stream=None, poll: float | None = None, first_seconds: float | None = None):
    self.factor, self.min_seconds, self.path = factor, min_seconds, path
    self.first_seconds = first_seconds or None
    self.stream = stream
    self.poll = poll if poll is not None else min(1.0, max(0.02, min_seconds / 5))
    self.dumps = 0
    self._lock = threading.Lock()
    self._step: int | None = None
    self._started = 0.0
    self._in_flight = 1
    self._median: float | None = None
    self._fired = False
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def start(self) -> Watchdog:
    """Start the thread (nothing happens with ``factor=0``)."""
    if self.factor and self._thread is None:
      self._thread = threading.Thread(target=self._run, name='maxnnx-watchdog', daemon=True)
      self._thread.start()
    return self

  def close(self) -> None:
    """Stop the thread."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def set_median(self, seconds: float | None) -> None:
    """The current median step time (``None``: not known yet, so no watching)."""
    with self._lock:
      self._median = seconds

  def step_started(self, step: int, in_flight: int = 1) -> None:
    """Step ``step`` begins; it may wait for ``in_flight`` steps (itself included)."""
    with self._lock:
      self._step, self._started = step, time.monotonic()
      self._in_flight, self._fired = max(1, in_flight), False

  def step_finished(self) -> None:
    """The step is done (eval, checkpoints and logging that follow are not watched)."""
    with self._lock:
      self._step = None

  def limit(self) -> float | None:
    """Seconds after which the current step counts as hung (``None``: not watching)."""
    if self._step is None:
      return None
    if self._median is None:
      return self.first_seconds
    return max(self.min_seconds, self.factor * self._median * self._in_flight)

  def _run(self) -> None:
    while not self._stop.wait(self.poll):
      with self._lock:
        limit = self.limit()
        if limit is None or self._fired:
          continue
        elapsed = time.monotonic() - self._started
        if elapsed <= limit:
          continue
        self._fired = True
        step, median = self._step, self._median
      self._dump(step, elapsed, median, limit)

  def _dump(self, step: int, elapsed: float, median: float | None, limit: float) -> None:
    known = f'median step {median:.3f} s' if median is not None else 'no median yet'
    header = (f'maxnnx watchdog: step {step} has run {elapsed:.1f} s ({known}, '
              f'limit {limit:.1f} s); stacks of all threads follow '
              f'(pid {os.getpid()}, {time.strftime("%Y-%m-%d %H:%M:%S")}).')
    logger.warning('%s%s', header.split(';')[0],
                   f'; stacks of all threads written to stderr and {self.path}' if self.path
                   else '; stacks of all threads written to stderr')
    self.dumps += 1
    _write_stacks(self.stream or sys.stderr, header)
    if self.path:
      paths.makedirs(paths.parent(self.path))
      if not paths.is_remote(self.path):
        with open(self.path, 'a') as f:
          _write_stacks(f, header)
        return
      with tempfile.TemporaryFile('w+') as f:
        _write_stacks(f, header)
        f.seek(0)
        paths.append_bytes(self.path, f.read().encode())


def _write_stacks(stream, header: str) -> None:
  """``header`` and every thread's stack to ``stream`` (a real file, else stderr's fd)."""
  try:
    stream.fileno()
  except (AttributeError, OSError, ValueError):
    stream = sys.__stderr__
  if stream is None:
    return
  stream.write(header + '\n')
  stream.flush()
  faulthandler.dump_traceback(file=stream, all_threads=True)
  stream.write('\n')
  stream.flush()


__all__ = ['StepTimes', 'Watchdog']

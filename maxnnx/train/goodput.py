"""Goodput: where a run's wall time went.

A :class:`GoodputRecorder` accounts time to categories with nested timers::

  recorder = GoodputRecorder()
  with recorder.time('other'):           # the whole of fit()
    with recorder.time('compile'):
      ...
    with recorder.time('productive'):    # one train step
      with recorder.time('data'):        # time blocked in next(data)
        ...

A timer inside another takes its time out of the outer one, so the categories
always add up to the wall time of the outermost timers. ``productive`` is
time in train steps that moved the run forward; ``lost`` is time in steps
re-done after resuming from a checkpoint older than the furthest step an
earlier run reached (the *high-water step*, kept in ``high_water.json`` in
the checkpoint directory). ``init`` is placing or initialising the parameters
(compiling the initialiser included); ``other`` is what no category claims
(logging, callbacks, set-up). Goodput is ``productive / wall``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator

from maxnnx import paths

CATEGORIES = ('productive', 'compile', 'data', 'checkpoint', 'restore', 'eval', 'lost', 'init',
              'other')
HIGH_WATER_FILE = 'high_water.json'


class GoodputRecorder:
  """Seconds per category from nested timers (see the module docstring).

  Args:
    clock: a monotonic clock in seconds (tests pass a fake one).
  """

  def __init__(self, clock: Callable[[], float] = time.perf_counter):
    self.clock = clock
    self.seconds = dict.fromkeys(CATEGORIES, 0.0)
    self.lost_steps = 0
    self._open: list[list] = []  # [category, seconds taken by inner timers]

  @contextlib.contextmanager
  def time(self, category: str) -> Iterator[None]:
    """Account the time inside the block, less inner timers' time, to ``category``."""
    if category not in self.seconds:
      raise ValueError(f'Unknown goodput category {category!r}; one of {CATEGORIES}.')
    start = self.clock()
    self._open.append([category, 0.0])
    try:
      yield
    finally:
      _, inner = self._open.pop()
      elapsed = self.clock() - start
      self.seconds[category] += elapsed - inner
      if self._open:
        self._open[-1][1] += elapsed

  @property
  def wall_seconds(self) -> float:
    """Total time accounted (the outermost timers' wall time)."""
    return sum(self.seconds.values())

  @property
  def goodput(self) -> float:
    """Productive time as a fraction of the wall time (0 before anything ran)."""
    wall = self.wall_seconds
    return self.seconds['productive'] / wall if wall > 0 else 0.0

  def summary(self) -> dict[str, float]:
    """``{'goodput', 'wall_s', '<category>_s'..., 'lost_steps'}``."""
    out = {'goodput': self.goodput, 'wall_s': self.wall_seconds}
    out.update({f'{name}_s': value for name, value in self.seconds.items()})
    out['lost_steps'] = self.lost_steps
    return out

  def metrics(self) -> dict[str, float]:
    """:meth:`summary` with ``goodput/`` names, for metric records."""
    return {f'goodput/{k}': v for k, v in self.summary().items()}

  def format(self) -> str:
    """One line: ``goodput 83.1% of 50.2 s: productive 41.7 s, compile 6.0 s, ...``."""
    parts = []
    for name in CATEGORIES:
      text = f'{name} {self.seconds[name]:.1f} s'
      if name == 'lost' and self.lost_steps:
        text += f' ({self.lost_steps} steps re-done)'
      parts.append(text)
    return (f'goodput {100 * self.goodput:.1f}% of {self.wall_seconds:.1f} s: '
            + ', '.join(parts))


def read_high_water(directory: str) -> int:
  """The furthest step any run in checkpoint ``directory`` reached (0 when unknown)."""
  try:
    return int(json.loads(paths.read_text(paths.join(directory, HIGH_WATER_FILE)))['step'])
  except (OSError, ValueError, KeyError, TypeError):
    return 0


def write_high_water(directory: str, step: int) -> None:
  """Record ``step`` as the furthest step reached in ``directory`` (atomic replace)."""
  paths.makedirs(directory)
  paths.write_text(paths.join(directory, HIGH_WATER_FILE),
                   json.dumps({'step': int(step), 'time': time.time()}))


class HighWater:
  """The high-water step of a checkpoint directory: read once, raised as steps complete, and
  written back (by one process) at most every few seconds.

  Attributes:
    step: the furthest step known so far (``None`` before :meth:`load`).
  """

  def __init__(self, clock: Callable[[], float] = time.monotonic):
    self.step: int | None = None
    self._clock = clock
    self._saved, self._written = 0, -float('inf')

  def load(self, directory: str | None) -> int:
    """The step, read from ``directory`` on first use (0 without one)."""
    if self.step is None:
      self.step = self._saved = read_high_water(directory) if directory else 0
    return self.step

  def reach(self, directory: str | None, step: int) -> int:
    """Raise the high-water mark to ``step`` (kept in memory); returns it."""
    self.step = max(self.load(directory), step)
    return self.step

  def write(self, directory: str | None, every: float = 5.0, *, primary: bool = True) -> None:
    """Write the step to ``directory`` when it rose and ``every`` seconds have passed since the
    last write; only the ``primary`` process writes."""
    now = self._clock()
    if (not directory or not primary or self.step is None or self.step <= self._saved
        or now - self._written < every):
      return
    write_high_water(directory, self.step)
    self._saved, self._written = self.step, now


__all__ = ['CATEGORIES', 'HIGH_WATER_FILE', 'GoodputRecorder', 'HighWater', 'read_high_water',
           'write_high_water']

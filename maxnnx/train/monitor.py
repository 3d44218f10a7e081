"""What watches ``Trainer.fit``: the profiler window, step-time outliers and the watchdog.

The Trainer calls :class:`FitMonitor` around each step; the pieces live in
:mod:`maxnnx.train.diagnostics` (profiles) and :mod:`maxnnx.train.watchdog`.
"""

from __future__ import annotations

import logging

import jax

from maxnnx import paths
from maxnnx.train.diagnostics import StepProfiler, profile_directory, run_directory
from maxnnx.train.watchdog import StepTimes, Watchdog

logger = logging.getLogger(__name__)


def watchdog_path(config) -> str:
  """The file hang stacks are appended to: ``<run directory>/watchdog_stacks.txt``."""
  suffix = f'.{jax.process_index()}' if jax.process_count() > 1 else ''
  return paths.join(run_directory(config), f'watchdog_stacks{suffix}.txt')


class FitMonitor:
  """Profiler, outlier warnings and hang watchdog for one ``fit`` call.

  Args:
    config: the run's ``TrainConfig`` (``profile``, ``outlier_factor``,
      ``watchdog_factor``, ``watchdog_min_seconds``…).
  """

  def __init__(self, config):
    self.profiler = StepProfiler(config.profile, profile_directory(config))
    self.times = StepTimes(config.outlier_factor)
    self.watchdog = Watchdog(config.watchdog_factor, config.watchdog_min_seconds,
                             watchdog_path(config),
                             first_seconds=config.watchdog_first_step_seconds).start()

  def step_started(self, step: int, in_flight: int) -> None:
    """Step ``step`` is about to run; ``in_flight`` steps (itself included) are unfetched."""
    self.profiler.before_step(step)
    self.watchdog.step_started(step, in_flight)

  def step_dispatched(self, step: int, state) -> None:
    """Step ``step`` was dispatched; ``state`` is its output (the profiler may wait on it)."""
    self.profiler.after_step(step, state)

  def metrics_fetched(self, records: list[dict]) -> None:
    """A metrics window arrived: update the median, warn about a slow window."""
    if not records or 'step_time_s' not in records[-1]:
      return
    line = self.times.add(records[-1]['step'], records[-1]['step_time_s'], len(records))
    if line:
      logger.warning(line)
    self.watchdog.set_median(self.times.median)

  def step_finished(self) -> None:
    """The step (and its metrics fetch, if any) is over; what follows is not watched."""
    self.watchdog.step_finished()

  def close(self, state=None) -> None:
    """Stop a running profile (waiting for ``state``) and the watchdog."""
    try:
      self.profiler.stop(state)
    finally:
      self.watchdog.close()


__all__ = ['FitMonitor', 'watchdog_path']

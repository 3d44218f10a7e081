"""The training loop of a :class:`~maxnnx.train.Trainer`: :meth:`~FitLoop.fit`.

``fit`` steps without waiting for the device except every ``log_every`` steps, when the
pending metrics are fetched; around the steps it resumes from and saves checkpoints, evaluates
held-out data, stops early on a signal or a reached ``target_eval_loss``, accounts the wall time
to goodput categories and watches the steps (:mod:`maxnnx.train.monitor`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import jax

from maxnnx.train.metrics import ProgressBar, TensorBoardWriter, format_metrics
from maxnnx.train.monitor import FitMonitor
from maxnnx.train.preemption import StopRequest, StopRequested

logger = logging.getLogger(__name__)


class FitLoop:
  """The Trainer's loop (a mixin of :class:`~maxnnx.train.Trainer`: it drives ``_step``,
  ``_fetch``, ``evaluate`` and ``save_checkpoint`` and keeps the goodput and high-water
  bookkeeping)."""

  def fit(self, steps: int | None = None, *, log: Callable[[str], None] | None = None
          ) -> list[dict]:
    """Train for ``steps`` (default ``config.steps``) more steps; returns ``history``.

    Prints a progress bar (or lines) with loss, tokens/s and MFU every
    ``log_every`` steps, evaluates every ``eval_every`` steps, and writes
    ``metrics_jsonl`` / ``tensorboard_dir`` when set. With ``checkpoint_dir``
    it first resumes from the newest complete checkpoint there, trains up to
    ``config.steps`` in total, and saves every ``checkpoint_every`` steps and
    at the end (and, with ``enable_emergency_checkpoint``, a local checkpoint every
    ``local_checkpoint_period`` steps). SIGTERM or SIGINT (while ``fit`` runs in the main
    thread) ends it after the current step, with a checkpoint, and sets :attr:`stopped_by`. It
    ends with a goodput line (:meth:`goodput`), whose totals are also in the last step's record
    (``goodput/...``);
    ``config.profile``, ``outlier_factor`` and ``watchdog_factor`` watch the steps
    (:mod:`maxnnx.train.monitor`).
    """
    deferred: list[dict] = []  # the last step's records, emitted with the goodput totals
    try:
      with self._goodput.time('other'):  # everything the categories inside do not claim
        self._fit(steps, log, deferred)
    finally:
      if self.history:
        self.history[-1].update(self._goodput.metrics())
      self._emit(deferred)
      self._record_high_water(every=0)
      if isinstance(self._writers, list):
        for writer in self._writers:
          if isinstance(writer, TensorBoardWriter):
            writer.flush()
    (log or print)(self._goodput.format())
    return self.history

  def _fit(self, steps: int | None, log: Callable[[str], None] | None,
           deferred: list[dict]) -> None:
    cfg = self.config
    self.stopped_by = self.reached_target = None
    if cfg.checkpoint_dir and self._checkpoints is None:
      self.restore_checkpoint()  # resume where an earlier run of this config stopped
    if steps is None:  # resumed (or continued: count_steps_taken), config.steps is the total
      continued = cfg.checkpoint_dir or self._step_offset
      steps = max(cfg.steps - self.step_count, 0) if continued else cfg.steps
    if self._compiled is None:
      self.compile(verbose=log is None)
    self._open_writers()
    self._materialise()
    high_water = self._high_water.load(cfg.checkpoint_dir)
    bar = ProgressBar(self.step_count + steps)
    stop, saved = StopRequest(), None
    monitor = FitMonitor(cfg)
    try:
      stop.__enter__()
      for i in range(1, steps + 1):
        last = i == steps
        step = self.step_count + 1
        redo = step <= high_water  # re-doing a step an earlier run already took
        self._goodput.lost_steps += redo
        monitor.step_started(step, in_flight=len(self._pending) + 1)
        try:
          with self._goodput.time('lost' if redo else 'productive'):
            self._step(None, fetch=False)
        except StopRequested:  # stopped while the step waited for its data: it is not taken
          self._goodput.lost_steps -= redo
          monitor.step_finished()
          self._stop_early(stop.signal_name, saved, bar, log)
          break
        with self._goodput.time('lost' if redo else 'productive'):
          monitor.step_dispatched(step, self._state)
          evaluate = cfg.eval_every and (self.step_count % cfg.eval_every == 0 or last)
          save = cfg.checkpoint_dir and (last or (cfg.checkpoint_every
                                                  and self.step_count % cfg.checkpoint_every == 0))
          save_local = (cfg.enable_emergency_checkpoint
                        and self.step_count % cfg.local_checkpoint_period == 0)
          records = []
          if evaluate or last or self.step_count % cfg.log_every == 0:
            records = self._fetch()
            monitor.metrics_fetched(records)
            self._record_high_water()
          elif save or save_local:
            jax.block_until_ready(self._state)  # the step's compute is not the checkpoint's
        monitor.step_finished()
        if records and evaluate:
          records[-1].update(self._held_out_metrics())
          if self._target_reached(records[-1]['eval_loss']) and not last:
            last, save = True, bool(cfg.checkpoint_dir)
            bar.total = self.step_count
        if records:
          if last:
            deferred.extend(records)
          else:
            self._emit(records)
          if log is None:
            bar.update(records[-1])
          else:
            log(format_metrics(records[-1], bar.total))
        if save_local:
          self.save_local_checkpoint()
        if save:
          saved = self.save_checkpoint()
        if last:  # the last step, or the held-out loss reached target_eval_loss
          break
        if stop:
          self._stop_early(stop.signal_name, saved, bar, log)
          break
    finally:
      stop.__exit__(None, None, None)
      monitor.close(self._state)

  def _held_out_metrics(self) -> dict[str, float]:
    """``eval_loss`` (:meth:`evaluate`) and its perplexity, ``exp(eval_loss)``."""
    loss = self.evaluate()
    return {'eval_loss': loss, 'eval_perplexity': math.exp(min(loss, 700.0))}

  def _target_reached(self, eval_loss: float) -> bool:
    """Whether ``eval_loss`` reaches ``config.target_eval_loss`` (kept in
    :attr:`reached_target`)."""
    target = self.config.target_eval_loss
    if target is None or not eval_loss <= target:
      return False
    self.reached_target = {'step': self.step_count, 'eval_loss': eval_loss, 'target': target}
    logger.info('Held-out loss %.4f reached target_eval_loss=%g at step %d.', eval_loss, target,
                self.step_count)
    return True

  def goodput(self) -> dict[str, float]:
    """Where this Trainer's time went (:mod:`maxnnx.train.goodput`).

    ``goodput`` (productive step time over wall time), ``wall_s`` and seconds
    per category: ``productive_s``, ``compile_s``, ``data_s`` (blocked in
    ``next(data)``), ``checkpoint_s``, ``restore_s``, ``eval_s``, ``lost_s``
    (steps re-done after a resume; ``lost_steps`` of them) and ``other_s``.
    """
    return self._goodput.summary()

  def _record_high_water(self, every: float = 5.0) -> None:
    """Keep the furthest step reached; written to ``checkpoint_dir`` at most every ``every`` s."""
    directory = self.config.checkpoint_dir
    self._high_water.reach(directory, self._step_offset + len(self.history))  # fetched steps
    self._high_water.write(directory, every, primary=jax.process_index() == 0)

  def _stop_early(self, signal_name: str, saved: int | None, bar, log) -> None:
    """End ``fit`` on a stop request: flush the metrics and checkpoint the step just taken."""
    records = self._fetch()
    self._emit(records)
    if records and log is None:
      bar.update(records[-1])
    elif records:
      log(format_metrics(records[-1], bar.total))
    if self.config.checkpoint_dir and saved != self.step_count:
      self.save_checkpoint()
    self.stopped_by = signal_name
    logger.info('%s: stopped after step %d.', signal_name, self.step_count)


__all__ = ['FitLoop']

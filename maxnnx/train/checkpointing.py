"""Checkpoints of a :class:`~maxnnx.train.Trainer`: save and restore its whole state.

A checkpoint holds the model and optimizer state, the loss-guard state, the step, the model
config, the length of the learning-rate schedule and, for a
:class:`~maxnnx.data.protocol.Checkpointable` data source, its position in the data. Saving is
asynchronous (:class:`~maxnnx.checkpoint.manager.CheckpointManager`); restoring takes the
newest complete checkpoint unless told a step.
"""

from __future__ import annotations

import logging

from maxnnx.data.protocol import Checkpointable
from maxnnx.train.optimizers import schedule_change

logger = logging.getLogger(__name__)


class Checkpointing:
  """The Trainer's checkpoint methods (a mixin of :class:`~maxnnx.train.Trainer`, whose state
  they read and replace: ``_state``, ``_extra``, ``history``, ``data``...)."""

  def _checkpoint_manager(self):
    from maxnnx.checkpoint.manager import CheckpointManager  # noqa: PLC0415
    if not self.config.checkpoint_dir:
      raise ValueError('TrainConfig.checkpoint_dir is not set: give it a directory to save '
                       'checkpoints in.')
    if self._checkpoints is None:
      self._checkpoints = CheckpointManager(self.config.checkpoint_dir,
                                            keep=self.config.keep_checkpoints)
    return self._checkpoints

  def save_checkpoint(self) -> int:
    """Start an asynchronous save of the current step into ``config.checkpoint_dir``.

    Saves model and optimizer state, the loss average, the data position
    (when ``data`` is :class:`~maxnnx.data.protocol.Checkpointable`) and the step.
    Returns the step.
    """
    with self._goodput.time('checkpoint'):
      return self._save_checkpoint()

  def _save_checkpoint(self) -> int:
    self._sync_from_objects()
    self._materialise()
    data_state = self.data.get_state() if isinstance(self.data, Checkpointable) else None
    if data_state is None:
      logger.warning('The data source has no get_state() and set_state() (it is not '
                     'Checkpointable): a resumed run restarts its stream.')
    meta = {'history_len': self.step_count, 'data': data_state,
            'model_config': self.model_config.to_dict(),
            'schedule_steps': self.config.resolved_schedule_steps}
    self._checkpoint_manager().save(self.step_count, self._state, self._extra, meta)
    return self.step_count

  def restore_checkpoint(self, step: int | None = None) -> int | None:
    """Load checkpoint ``step`` (default: the newest complete one) from ``config.checkpoint_dir``.

    Parameters, optimizer state and the data position are replaced and steps
    continue counting from there. A damaged newest checkpoint is reported and
    the one before it used. Returns the step, or ``None`` when there is none.
    Steps taken again after it, up to the furthest step any run reached,
    count as lost time in :meth:`goodput`. When the checkpoint was made by a run
    with a learning-rate schedule of another length (``steps``, or
    ``learning_rate_schedule_steps``), :attr:`schedule_note` says what that
    does to the schedule in one line.
    """
    with self._goodput.time('restore'):
      return self._restore_checkpoint(step)

  def _restore_checkpoint(self, step: int | None) -> int | None:
    self._high_water.reach(self.config.checkpoint_dir, self._step_offset + len(self.history))
    manager = self._checkpoint_manager()
    restored = manager.restore(self._abstract_state, self._abstract_extra, step)
    if restored is None:
      return None
    step, self._state, self._extra, meta = restored
    self._pending = []
    self.history = [m for m in self.history if m['step'] <= step]
    self._step_offset = step - len(self.history)
    self._sync_to_objects()
    made_for = meta.get('schedule_steps')
    self.schedule_note = (schedule_change(self.config, made_for, step)
                          if isinstance(made_for, int) else None)
    if self.schedule_note:
      logger.info('%s', self.schedule_note)
    if meta.get('data') is not None:
      if isinstance(self.data, Checkpointable):
        self.data.set_state(meta['data'])
      else:
        logger.warning('Checkpoint %d has a data position but the data source has no '
                       'set_state() (it is not Checkpointable): its stream restarts.', step)
    logger.info('Restored checkpoint step %d from %s.', step, manager.directory)
    return step


__all__ = ['Checkpointing']

"""Checkpoints of a :class:`~maxnnx.train.Trainer`: save and restore its whole state.

A checkpoint holds the model and optimizer state, the loss-guard state, the step, the model
config, the length of the learning-rate schedule and, for a
:class:`~maxnnx.data.protocol.Checkpointable` data source, its position in the data. Saving is
asynchronous (:class:`~maxnnx.checkpoint.manager.CheckpointManager`); restoring takes the
newest complete checkpoint unless told a step.

With ``enable_emergency_checkpoint`` there are also local checkpoints, each process's shards on
its own disk and its peer's (:mod:`maxnnx.checkpoint.emergency`), and a resume takes the newest
step that is complete anywhere. A checkpoint made by more processes than the run now has is
resharded onto the new mesh, and ``grad_accum_steps`` grows so that each process's micro-batch,
and so the global batch, stay what they were.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

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

  def _local_checkpoints(self):
    from maxnnx.checkpoint.emergency import LocalCheckpoints  # noqa: PLC0415
    if self._local is None:
      self._local = LocalCheckpoints(self.config.local_checkpoint_directory)
    return self._local

  def save_checkpoint(self) -> int:
    """Start an asynchronous save of the current step into ``config.checkpoint_dir``.

    Saves model and optimizer state, the loss average, the data position
    (when ``data`` is :class:`~maxnnx.data.protocol.Checkpointable`) and the step.
    Returns the step.
    """
    with self._goodput.time('checkpoint'):
      return self._save_checkpoint()

  def _save_checkpoint(self) -> int:
    return self._save_to(self._checkpoint_manager())

  def _save_to(self, manager) -> int:
    """Save the current step with ``manager`` (persistent or local); the step saved."""
    self._sync_from_objects()
    self._materialise()
    manager.save(self.step_count, self._state, self._extra, self._checkpoint_meta())
    return self.step_count

  def save_local_checkpoint(self) -> int:
    """Save the current step as an emergency checkpoint: this process's shards to its own
    local disk and to its peer's (``config.local_checkpoint_directory``). Every process calls
    it; it returns, with the step, once both copies are written."""
    if not self.config.enable_emergency_checkpoint:
      raise ValueError('TrainConfig.enable_emergency_checkpoint is off: set it (with '
                       'local_checkpoint_directory) to save local checkpoints.')
    with self._goodput.time('checkpoint'):
      return self._save_to(self._local_checkpoints())

  def _checkpoint_meta(self) -> dict:
    """The JSON record saved with a checkpoint."""
    data_state = self.data.get_state() if isinstance(self.data, Checkpointable) else None
    if data_state is None:
      logger.warning('The data source has no get_state() and set_state() (it is not '
                     'Checkpointable): a resumed run restarts its stream.')
    cfg = self.config
    return {'history_len': self.step_count, 'data': data_state,
            'model_config': self.model_config.to_dict(),
            'schedule_steps': cfg.resolved_schedule_steps, 'process_count': jax.process_count(),
            'global_batch_size': cfg.global_batch_size, 'grad_accum_steps': cfg.grad_accum_steps}

  def restore_checkpoint(self, step: int | None = None, *, required: bool = False) -> int | None:
    """Load checkpoint ``step`` (default: the newest complete one) from ``config.checkpoint_dir``
    or, with ``enable_emergency_checkpoint``, from the local checkpoints when they hold a step
    as new or newer (a local step that fails to load falls back to the persistent one).

    Parameters, optimizer state and the data position are replaced and steps
    continue counting from there. A damaged newest checkpoint is reported and
    the one before it used. Returns the step, or ``None`` when there is none (with
    ``required``: raises :class:`~maxnnx.checkpoint.manager.CheckpointError`).
    Steps taken again after it, up to the furthest step any run reached,
    count as lost time in :meth:`goodput`. When the checkpoint was made by a run
    with a learning-rate schedule of another length (``steps``, or
    ``learning_rate_schedule_steps``), :attr:`schedule_note` says what that
    does to the schedule in one line. A checkpoint saved by more processes than this run has
    raises ``grad_accum_steps`` (when this run leaves it as the checkpoint's) so that the
    per-process micro-batch stays the same and the global batch too; :attr:`batch_note` says
    so in one line.
    """
    with self._goodput.time('restore'):
      restored = self._restore_checkpoint(step)
    if restored is None and required:
      from maxnnx.checkpoint.manager import CheckpointError  # noqa: PLC0415
      where = f'checkpoint_dir={self.config.checkpoint_dir}'
      if self.config.enable_emergency_checkpoint:
        where += f' nor local_checkpoint_directory={self.config.local_checkpoint_directory}'
      raise CheckpointError(f'Nothing to resume from: no complete checkpoint in {where}; '
                            'point them at the run to resume, or start without resuming.')
    return restored

  def _restore_checkpoint(self, step: int | None) -> int | None:
    self._high_water.reach(self.config.checkpoint_dir, self._step_offset + len(self.history))
    manager = self._checkpoint_manager()
    restored = self._restore_local(manager) if step is None else None
    if restored is None:
      restored = manager.restore(self._abstract_state, self._abstract_extra, step)
      if restored is None:
        return None
      source = self.config.checkpoint_dir
    else:
      source = self.config.local_checkpoint_directory
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
    self._keep_micro_batch(step, meta)
    self.restored_from = source
    logger.info('Restored checkpoint step %d from %s.', step, source)
    return step

  def _restore_local(self, manager):
    """``(step, state, extra, meta)`` of the newest local step when it is at least as new as
    the newest persistent one, else ``None`` (every process takes process 0's choice)."""
    if not self.config.enable_emergency_checkpoint:
      return None
    import json  # noqa: PLC0415

    from maxnnx.checkpoint.emergency import choose_source  # noqa: PLC0415
    from maxnnx.processes import allgather_bytes, broadcast_bytes  # noqa: PLC0415
    local = self._local_checkpoints()
    choice = choose_source(list(local.complete_steps()), manager.all_steps())
    choice = json.loads(broadcast_bytes(json.dumps(choice).encode()))
    if choice is None or choice[0] != 'local':
      if choice is not None:
        local.drop_after(choice[1])
      return None
    step, problem = choice[1], None
    try:
      state, extra, meta = local.restore(step, self._abstract_state, self._abstract_extra)
    except Exception as e:  # noqa: BLE001 (a local copy that fails: the persistent one remains)
      problem = f'{type(e).__name__}: {e}'
    said = allgather_bytes(b'!' if problem else b'.')
    failed = [i for i, answer in enumerate(said) if answer == b'!']
    if failed:  # every process falls back together, or their states would differ
      logger.warning('Local checkpoint step %d cannot be restored (%s); falling back to the '
                     'persistent checkpoints.', step,
                     problem or f'it failed on process(es) {failed}')
      return None
    local.drop_after(step)
    return step, state, extra, meta

  def _keep_micro_batch(self, step: int, meta: dict) -> None:
    """Raise ``grad_accum_steps`` after a restart on fewer processes, so that each process's
    micro-batch and the global batch stay those of the run that saved ``step``."""
    cfg = self.config
    self.batch_note = None
    made_by, accum = meta.get('process_count'), meta.get('grad_accum_steps')
    now = jax.process_count()
    if (not isinstance(made_by, int) or not isinstance(accum, int) or made_by <= now
        or meta.get('global_batch_size') != cfg.global_batch_size
        or cfg.grad_accum_steps != accum):
      return
    wanted, rest = divmod(accum * made_by, now)
    if rest or cfg.global_batch_size % (wanted * now):
      return
    self.config = dataclasses.replace(cfg, grad_accum_steps=wanted)
    self._compiled = None  # the step splits its batch into the new number of micro-batches
    self.batch_note = (f'checkpoint step {step} was saved by {made_by} processes with '
                       f'grad_accum_steps={accum}; on {now} it is {wanted}, keeping '
                       f'{cfg.global_batch_size // (wanted * now)} rows per process per '
                       f'micro-batch and the global batch of {cfg.global_batch_size}.')
    logger.info('%s', self.batch_note)


__all__ = ['Checkpointing']

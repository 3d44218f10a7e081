"""``PolicyView``: what code that samples from the policy in training sees of a Trainer.

RL rollouts (:class:`~maxnnx.rl.Rollouts`) sample from the model being trained, on its mesh,
and build batches of the step's shape. They need the live model, the mesh's context, the batch
shape, this process's rows and the objective's sampling settings, and nothing else: not the
optimizer, the checkpoints or the loop. :meth:`Trainer.policy_view
<maxnnx.train.Trainer.policy_view>` hands them this narrow view.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from flax import nnx


class PolicyView:
  """A read-only view of a Trainer's policy for the code that samples from it.

  Args:
    trainer: the :class:`~maxnnx.train.Trainer` whose policy this shows.

  Attributes:
    global_batch_size: rows of a step's batch over all processes.
    seq_len: tokens of each row.
    objective: the Trainer's objective, for its settings (``temperature``, ``chunk_length``,
      ``beta``, ``loss_type``, ``batch_fields``): sampling must see the distribution the
      loss sees.
  """

  def __init__(self, trainer):
    self._trainer = trainer
    self.global_batch_size: int = trainer.config.global_batch_size
    self.seq_len: int = trainer.config.seq_len
    self.objective = trainer.objective

  @property
  def model(self) -> nnx.Module:
    """The live model, with the parameters of the latest step (on the mesh)."""
    return self._trainer.model

  @property
  def frozen_models(self) -> dict[str, nnx.Module]:
    """The objective's frozen models (e.g. ``'reference'``) as placed on the mesh."""
    return self._trainer.frozen_models

  @property
  def step_count(self) -> int:
    """Optimizer steps taken so far."""
    return self._trainer.step_count

  def mesh_context(self) -> AbstractContextManager:
    """A context in which the Trainer's mesh and logical-axis rules apply."""
    return self._trainer.mesh_context()

  def local_rows(self) -> slice:
    """The rows of the global batch that this process's devices hold."""
    return self._trainer.local_rows()

  def place_batch(self, batch: dict[str, Any]) -> dict:
    """This process's rows of a batch, checked and laid out on the mesh as the step takes
    them."""
    return self._trainer.place_batch(batch)


__all__ = ['PolicyView']

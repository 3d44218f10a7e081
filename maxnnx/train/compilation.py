"""Compiling a :class:`~maxnnx.train.Trainer`'s steps ahead of time, for its mesh.

The train step is lowered and compiled over abstract (sharded ``ShapeDtypeStruct``) state and
batch, so nothing is allocated; the compiled program's memory analysis is checked against the
device's limit before a step runs (:mod:`maxnnx.train.memory`), and with
``TrainConfig.dump_hlo`` its stages are written out (:mod:`maxnnx.train.diagnostics`).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp

from maxnnx.train import diagnostics
from maxnnx.train import step as step_lib
from maxnnx.train.checks import TrainingError
from maxnnx.train.memory import (
  compiler_oom_message,
  format_memory_report,
  memory_report,
  overshoot_message,
)

logger = logging.getLogger(__name__)


class Compilation:
  """The Trainer's compile methods (a mixin of :class:`~maxnnx.train.Trainer`: they read its
  graph, shardings, abstract state and objective, and set ``_compiled``, ``_eval_compiled``
  and ``memory``)."""

  def _abstract_batch(self) -> dict:
    shape = (self.config.global_batch_size, self.config.seq_len)
    dtypes = {'inputs': jnp.int32, 'targets': jnp.int32, 'segment_ids': jnp.int32,
              'positions': jnp.int32, 'loss_mask': jnp.float32,
              **dict(self.objective.batch_fields)}
    out = {k: jax.ShapeDtypeStruct(shape, dtypes[k], sharding=self._token_sharding)
           for k in dtypes}
    if self._image_shape is not None and isinstance(self._batch_sharding, dict):
      out['pixel_values'] = jax.ShapeDtypeStruct(
          (shape[0], *self._image_shape), jnp.float32,
          sharding=self._batch_sharding['pixel_values'])
    return out

  def compile(self, *, verbose: bool = True) -> dict:
    """Lower and compile the train step for the mesh without running it.

    Nothing is allocated: parameters and optimizer state are abstract here.
    Returns a memory report (bytes per device) and raises :class:`TrainingError`
    when the step needs more memory per device than the limit
    (``TrainConfig.memory_limit_gib`` or the device's own).
    """
    with self._goodput.time('compile'):
      report, compiled = self._compile_train_step()
    self.memory = report
    quantized = f'; {self.quantization} quantized training' if self.quantization != 'none' else ''
    if verbose:
      print(format_memory_report(report) + quantized)
    else:
      logger.info(format_memory_report(report) + quantized)
    overshoot = overshoot_message(report)
    if overshoot:
      raise TrainingError(overshoot)
    self._compiled = compiled
    return report

  def _compile_train_step(self) -> tuple[dict, Any]:
    cfg = self.config
    if cfg.compile_cache:
      diagnostics.enable_compile_cache(cfg.compile_cache)
    start = time.perf_counter()
    train_step = functools.partial(step_lib.train_step, self._graphdef,
                                   frozen_graphdef=self._frozen_graphdef,
                                   objective=self.objective, config=self.config,
                                   schedule=self.schedule, trainable=self.trainable)
    with self._context():
      jitted = jax.jit(train_step,
                       in_shardings=(self._state_shardings, self._extra_sharding,
                                     self._batch_sharding, self._frozen_shardings),
                       out_shardings=(self._state_shardings, self._extra_sharding, None),
                       donate_argnums=(0, 1))
      args = (self._abstract_state, self._abstract_extra, self._abstract_batch(),
              self._frozen_state)
      traced = jitted.trace(*args) if cfg.dump_hlo else None
      lowered = traced.lower() if traced is not None else jitted.lower(*args)
      with diagnostics.CacheEvents().watch() as cache:
        try:
          compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
          message = compiler_oom_message(e)
          if message is None:
            raise
          raise TrainingError(message) from None
    report = memory_report(compiled, self.mesh, cfg.memory_limit_gib)
    report['compile_seconds'] = time.perf_counter() - start
    report['compile_cache'] = cache.outcome
    if cfg.dump_hlo:
      diagnostics.dump_hlo(diagnostics.hlo_directory(cfg), 'train_step', traced, lowered, compiled)
    return report, compiled


  def _compile_eval_step(self) -> None:
    with self._goodput.time('compile'):
      eval_step = functools.partial(
          step_lib.eval_step, self._graphdef, frozen_graphdef=self._frozen_graphdef,
          objective=self.objective,
          parameters_on_host=self.config.parameter_memory_host_offload,
          streaming=self.config.parameter_streaming)
      with self._context():
        self._eval_compiled = jax.jit(eval_step).lower(
            self._abstract_state, self._abstract_batch(), self._frozen_state).compile()



__all__ = ['Compilation']

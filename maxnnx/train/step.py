"""The train step as small pure functions around one state.

The state of a run is the nnx ``State`` of ``(model, optimizer)`` plus the
guard's bookkeeping (:func:`initial_guard_state`): the loss average and the
first non-finite step. :func:`train_step` composes

* :func:`accumulate_gradients`: gradients of an objective's loss, summed over
  ``grad_accum_steps`` micro-batches;
* :func:`guard`: whether to apply the update (finite loss and gradient norm,
  no loss spike) and the guard's new bookkeeping;
* :func:`apply_update`: the optimizer update and the MoE balancing-bias step
  (:func:`~maxnnx.layers.moe.balance_router_biases`, outside the gradient), kept or
  dropped by the guard;
* :func:`step_metrics`: the step's metrics.

``Trainer`` jits :func:`train_step` (and :func:`eval_step`) with the run's
shardings; the functions themselves know nothing about meshes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from maxnnx.layers.dropout import dropout_key
from maxnnx.layers.moe import (
  balance_router_biases,
  dropped_assignments,
  dropped_fraction,
  expert_loads,
  load_spread,
)
from maxnnx.layers.qk_clip import attention_max_logits, clip_query_key, qk_clip_metrics
from maxnnx.layers.remat import to_device
from maxnnx.models.transformer import STACK_NAMES
from maxnnx.train.config import TrainConfig
from maxnnx.train.lora.dropout import adapter_dropout
from maxnnx.train.objectives import Objective
from maxnnx.train.optimizer_placement import (
  model_to_device,
  optimizer_state_to_device,
  parameters_to_device,
)

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


def initial_guard_state() -> dict[str, jax.Array]:
  """Guard bookkeeping kept on the device: loss average and the first non-finite step."""
  return {'loss_ema': jnp.zeros((), jnp.float32), 'first_bad_step': jnp.zeros((), jnp.int32),
          'bad_metric': jnp.zeros((), jnp.int32)}


def accumulate_gradients(loss_fn: Callable, params, batch: Batch, steps: int, *,
                         maxima: bool = False) -> tuple[Any, Metrics]:
  """Gradients of ``loss_fn(params, micro, index) -> (loss, metrics)`` and the summed metrics.

  With ``steps > 1`` the batch is split into ``steps`` micro-batches along its
  first axis and their gradients and metrics are summed (in float32, then the
  gradients cast to the parameters' dtypes) with one ``lax.scan``. ``index`` is
  the micro-batch's number (an int32 scalar, 0 for a single batch). With ``maxima``,
  ``metrics`` is a pair ``(summed, maxed)`` whose second part is combined by maximum.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if steps == 1:
    (_, sums), grads = grad_fn(params, batch, jnp.zeros((), jnp.int32))
    return grads, sums
  micro_batches = jax.tree.map(lambda x: x.reshape(steps, -1, *x.shape[1:]), batch)
  shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro_batches),
                          jnp.zeros((), jnp.int32))[0][1]

  def combine(acc, x):
    if not maxima:
      return jax.tree.map(jnp.add, acc, x)
    return jax.tree.map(jnp.add, acc[0], x[0]), jax.tree.map(jnp.maximum, acc[1], x[1])

  def accumulate(carry, xs):
    grads_acc, sums = carry
    micro, index = xs
    (_, metrics), g = grad_fn(params, micro, index)
    g = jax.tree.map(to_device, g)  # streamed stacks' gradients come out in host memory
    return (jax.tree.map(jnp.add, grads_acc, g), combine(sums, metrics)), None

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
  if maxima:
    zero_sums = (zero_sums[0], jax.tree.map(lambda s: jnp.full(s.shape, -jnp.inf), shapes[1]))
  (grads, sums), _ = jax.lax.scan(accumulate, (zeros, zero_sums),
                                  (micro_batches, jnp.arange(steps, dtype=jnp.int32)))
  return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), sums


def guard(extra: dict[str, jax.Array], step: jax.Array, loss: jax.Array, grad_norm: jax.Array,
          skip_spike_factor: float | None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """``(ok, new_extra)``: whether the update may be applied, and the new bookkeeping.

  A non-finite loss or gradient norm, or (with ``skip_spike_factor``, after
  step 10) a loss above that many times its running average, skips the update.
  The first non-finite step and which metric it was (1 loss, 2 grad norm) are
  recorded; the running average moves only on applied steps.
  """
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  ok = finite
  if skip_spike_factor is not None:
    spike = (step > 10) & (loss > skip_spike_factor * extra['loss_ema'])
    ok = ok & ~spike
  ema = jnp.where(step == 0, loss, 0.9 * extra['loss_ema'] + 0.1 * loss)
  first_bad = jnp.where((extra['first_bad_step'] == 0) & ~finite, step + 1,
                        extra['first_bad_step'])
  bad_metric = jnp.where((extra['first_bad_step'] == 0) & ~finite,
                         jnp.where(jnp.isfinite(loss), 2, 1), extra['bad_metric'])
  return ok, {'loss_ema': jnp.where(ok, ema, extra['loss_ema']), 'first_bad_step': first_bad,
              'bad_metric': bad_metric}


def apply_update(model: nnx.Module, optimizer: nnx.Optimizer, grads, ok: jax.Array,
                 loads: list[jax.Array] = (), max_logits: list[jax.Array] = (),
                 qk_clip_threshold: float = 0.0):
  """The state of ``(model, optimizer)`` after ``optimizer.update``, the aux-loss-free
  balancing step of the MoE router biases from the step's ``loads`` (tokens per expert of
  each MoE module, :func:`~maxnnx.layers.moe.expert_loads`) and, with a
  ``qk_clip_threshold``, QK-clip from the step's ``max_logits``
  (:func:`~maxnnx.layers.qk_clip.clip_query_key`); the state before all of them when
  not ``ok``."""
  old_state = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))  # fresh Variables
  optimizer.update(model, grads)
  if loads:
    balance_router_biases(model, loads)
  if qk_clip_threshold:
    clip_query_key(model, max_logits, qk_clip_threshold)
  new_state = nnx.state((model, optimizer))
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, old_state)


def step_metrics(objective_metrics: Metrics, grad_norm: jax.Array, lr: jax.Array,
                 ok: jax.Array) -> Metrics:
  """The step's metrics: the objective's, ``grad_norm``, ``lr`` and ``skipped``."""
  metrics = dict(objective_metrics)
  metrics.update(grad_norm=grad_norm, lr=lr, skipped=~ok)
  return metrics


def train_step(graphdef, state, extra: dict[str, jax.Array], batch: Batch, frozen_state=None,
               *, frozen_graphdef=None, objective: Objective, config: TrainConfig,
               schedule: Callable, trainable=nnx.Param
               ) -> tuple[Any, dict[str, jax.Array], Metrics]:
  """One optimizer step: ``(state, extra, batch) -> (new_state, new_extra, metrics)``.

  ``graphdef``/``state`` are ``nnx.split((model, optimizer))``; ``frozen_graphdef``
  and ``frozen_state`` split the objective's frozen models (a dict), which the
  loss sees merged and which are never updated. ``trainable`` is the nnx filter
  of the parameters differentiated (the optimizer's ``wrt``): every ``nnx.Param``,
  or e.g. ``nnx.LoRAParam`` when only adapters train; the rest is held constant.
  MoE models also log how evenly the step's tokens (summed over micro-batches) went
  to experts (:func:`~maxnnx.layers.moe.load_spread`) and, with
  ``moe.ragged_buffer_factor``, the share of assignments its receive cap dropped
  (``moe_dropped_fraction``, :func:`~maxnnx.layers.moe.dropped_fraction`); their router
  biases move by ``moe.router_bias_update_rate`` after the update. With
  ``config.qk_clip_threshold`` the query/key projections are rescaled after the update by QK-clip
  (:mod:`maxnnx.layers.qk_clip`) from the largest logits of the step's micro-batches, and
  ``max_attention_logit`` / ``qk_clipped_heads`` are logged.
  The loss is traced under :func:`~maxnnx.layers.dropout.dropout_key` (residual dropout,
  ``model.dropout_rate``) and :func:`~maxnnx.train.lora.dropout.adapter_dropout`
  with a key of ``config.seed``, the step and the micro-batch (LoRA adapters
  with dropout drop their input here, and only here).
  """
  if config.optimizer_memory_host_offload:
    state = optimizer_state_to_device(state)
  if config.parameter_memory_host_offload:
    state = parameters_to_device(state, streamed_stacks(config.parameter_streaming))
  model, optimizer = nnx.merge(graphdef, state)
  step = optimizer.step[...]
  model_graphdef, params, rest = nnx.split(model, trainable, ...)
  norm = objective.normalizers(model, batch)

  step_key = jax.random.fold_in(jax.random.key(config.seed), step)

  def loss_fn(params, micro, index):
    # Fresh Variables for the non-parameter state: the forward pass writes MoE
    # routing statistics into them, which must happen at this trace level.
    m = nnx.merge(model_graphdef, params, jax.tree.map(lambda x: x, rest))
    frozen = _merge_frozen(frozen_graphdef, frozen_state)
    micro_key = jax.random.fold_in(step_key, index)
    with adapter_dropout(micro_key), dropout_key(micro_key):
      loss, sums = objective.loss(m, micro, frozen=frozen, norm=norm)
    return loss, ((sums, expert_loads(m), dropped_assignments(m)), attention_max_logits(m))

  grads, ((sums, loads, dropped), max_logits) = accumulate_gradients(
      loss_fn, params, batch, config.grad_accum_steps, maxima=True)
  metrics = objective.metrics(sums, norm)
  metrics.update(load_spread(loads))
  metrics.update(dropped_fraction(loads, dropped))
  if config.qk_clip_threshold:
    metrics.update(qk_clip_metrics(max_logits, config.qk_clip_threshold))
  if config.parameter_streaming:  # the stacks and their gradients, from host memory
    grads = jax.tree.map(to_device, grads)
    model_to_device(model)
  grad_norm = optax.tree.norm(grads)
  ok, extra = guard(extra, step, metrics['loss'], grad_norm, config.skip_spike_factor)
  new_state = apply_update(model, optimizer, grads, ok, loads, max_logits,
                           config.qk_clip_threshold)
  return new_state, extra, step_metrics(metrics, grad_norm, schedule(step), ok)


def eval_step(graphdef, state, batch: Batch, frozen_state=None, *, frozen_graphdef=None,
              objective: Objective, parameters_on_host: bool = False, streaming: bool = False
              ) -> tuple[jax.Array, jax.Array]:
  """``objective.eval_loss`` of the model in ``state`` on a held-out batch: ``(total, weight)``
  (``parameters_on_host``: the model's state is copied to the device first; with
  ``streaming`` but for the scanned layer stacks, which the scan copies in layer by layer)."""
  if parameters_on_host:
    state = parameters_to_device(state, streamed_stacks(streaming))
  model, _ = nnx.merge(graphdef, state)
  frozen = _merge_frozen(frozen_graphdef, frozen_state)
  return objective.eval_loss(model, batch, frozen=frozen)


def streamed_stacks(streaming: bool) -> tuple[str, ...]:
  """The model attributes left in host memory inside a step: the scanned layer stacks
  (:func:`~maxnnx.models.transformer.layer_stacks`) with ``parameter_streaming``, else none."""
  return STACK_NAMES if streaming else ()


def _merge_frozen(graphdef, state) -> dict[str, nnx.Module]:
  return {} if graphdef is None else nnx.merge(graphdef, jax.tree.map(lambda x: x, state))


__all__ = ['accumulate_gradients', 'apply_update', 'eval_step', 'guard', 'initial_guard_state',
           'step_metrics', 'streamed_stacks', 'train_step']

"""GPipe over the ``stage`` mesh axis for a scanned layer stack.

A model whose layers are one stacked module (every variable with a leading
``layers`` axis, run with ``lax.scan``) hands that module to
:func:`pipeline_stack` together with a function that runs a contiguous slice
of it. The stack is split into ``stages`` consecutive groups, one per stage
device group, and the batch into ``M`` micro-batches. At iteration ``i`` stage
``s`` runs its layers on micro-batch ``i - s``, then every stage hands its
output to the next (a collective permute), so after ``M + stages - 1``
iterations every micro-batch has passed every layer. The numbers are those of
running the whole stack on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.layers.block import RESIDUAL_AXES
from maxnnx.sharding import constrain, mesh_axis_size, pipeline_microbatches

STAGE_AXES = ('activation_stage',)


def pipeline_stack(layers: nnx.Module, x_BTD: jax.Array, per_layer_L: Any, per_row_B: Any,
                   run_stage: Callable, *, stages: int | None = None,
                   microbatches: int | None = None) -> jax.Array:
  """Run stacked ``layers`` over ``x_BTD`` as a pipeline over the ``stage`` mesh axis.

  Args:
    layers: a module whose every variable has a leading ``layers`` axis.
    x_BTD: the stack's input ``[B, T, D]``.
    per_layer_L: a pytree of arrays with a leading ``layers`` axis (per-layer
      inputs, e.g. which layers use a sliding window); each stage gets its slice.
    per_row_B: a pytree of arrays with a leading batch axis (e.g. segment ids
      and positions); each micro-batch gets its rows.
    run_stage: ``run_stage(stage_layers, per_layer_L, x_bTD, per_row_b) -> x_bTD``
      runs one stage's slice of the stack on one micro-batch (``stage_layers``
      is a module of the same type as ``layers`` with ``num_layers / stages``
      layers). It is vmapped over stages with ``spmd_axis_name='stage'``.
    stages: pipeline stages; default the ``stage`` mesh axis size.
    microbatches: micro-batches per batch; default
      :func:`maxnnx.sharding.pipeline_microbatches` (one per stage unless the
      mesh context says otherwise).

  Returns:
    The stack's output ``[B, T, D]``. Variables ``run_stage`` writes into its
    per-stage module (KV caches, routing statistics) are not carried back.
  """
  stages = stages or mesh_axis_size('stage')
  micro = microbatches or pipeline_microbatches()
  graphdef, state = nnx.split(layers)
  num_layers = jax.tree.leaves(state)[0].shape[0]
  batch, length, width = x_BTD.shape
  if num_layers % stages or batch % micro:
    raise ValueError(f'Pipeline: num_layers ({num_layers}) must be divisible by the stages '
                     f'({stages}) and the batch ({batch}) by the micro-batches ({micro}).')
  per_stage = num_layers // stages

  def by_stage(a):
    return a.reshape(stages, per_stage, *a.shape[1:])

  def by_micro(a):
    return a.reshape(micro, batch // micro, *a.shape[1:])

  state_S = jax.tree.map(by_stage, state)
  per_layer_SL = jax.tree.map(by_stage, per_layer_L)
  x_M = by_micro(x_BTD)
  per_row_M = jax.tree.map(by_micro, per_row_B)

  def one_stage(stage_state, per_layer, x, per_row):
    return run_stage(nnx.merge(graphdef, stage_state), per_layer, x, per_row)

  run_stages = jax.vmap(one_stage, spmd_axis_name='stage')
  buffer_axes = STAGE_AXES + RESIDUAL_AXES

  def iteration(carry, i):
    buffer, outputs = carry
    micro_index_S = jnp.clip(i - jnp.arange(stages), 0, micro - 1)
    buffer = buffer.at[0].set(x_M[jnp.minimum(i, micro - 1)])
    out = run_stages(state_S, per_layer_SL, constrain(buffer, buffer_axes),
                     jax.tree.map(lambda a: a[micro_index_S], per_row_M))
    out = constrain(out, buffer_axes)
    done = i - (stages - 1)
    updated = jax.lax.dynamic_update_index_in_dim(outputs, out[-1], jnp.maximum(done, 0), 0)
    outputs = jnp.where(done >= 0, updated, outputs)
    return (jnp.roll(out, 1, axis=0), outputs), None

  buffer = jnp.zeros((stages, batch // micro, length, width), x_BTD.dtype)
  (_, outputs), _ = jax.lax.scan(iteration, (buffer, jnp.zeros_like(x_M)),
                                 jnp.arange(micro + stages - 1))
  return outputs.reshape(batch, length, width)


__all__ = ['STAGE_AXES', 'pipeline_stack']

"""GPipe and circular pipelines over the ``stage`` mesh axis for a scanned layer stack.

A model whose layers are one stacked module (every variable with a leading
``layers`` axis, run with ``lax.scan``) hands that module to
:func:`pipeline_stack` together with a function that runs a contiguous slice
of it. The batch is split into ``M`` micro-batches and the stack into
``R * S`` chunks of consecutive layers for ``S`` stages and ``R`` repeats; chunk
``c`` runs on stage ``c mod S``. At iteration ``i`` stage ``s`` works on item
``t = i - s`` (micro-batch ``t mod M``, repeat ``t // M``), then every stage hands
its output to the next (a collective permute). The last stage's output goes back
to the first stage for the next repeat (kept in a buffer of ``M`` micro-batches
until stage 0 reaches it), or out after the last repeat. After ``R M + S - 1``
iterations every micro-batch has passed every layer, in order. The numbers are those
of running the whole stack on the whole batch.

``R = 1`` is GPipe. More repeats cut the idle share of the step (the bubble) from
``(S-1)/(M+S-1)`` to ``(S-1)/(R M+S-1)`` (:func:`pipeline_bubble`), for the price of
``R`` times as many stage-to-stage transfers (each a ``1/R`` share of the work) and
the buffer.

The statistics the layers write as they run (:class:`~maxnnx.layers.params.ForwardStat`: MoE
loads and auxiliary losses, attention max logits, the indexer loss) come back out of the
pipeline for the whole batch, combined over micro-batches as each variable's ``combine``
metadata says: ``sum`` (expert loads), ``max`` (max logits) or ``mean`` (the default; losses
that are means over tokens equal the whole batch's, and the MoE load-balancing loss, a
product of means, becomes the mean of its micro-batches' values, as under gradient
accumulation). The stack's parameters are stored in layer order, sharded over ``stage``
in contiguous blocks; with ``R > 1`` each step lays them out by chunk first (a
re-sharding of ``(R-1)/R`` of every stage's layers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from maxnnx.layers.block import RESIDUAL_AXES
from maxnnx.layers.params import ForwardStat
from maxnnx.sharding import constrain, mesh_axis_size, pipeline_microbatches, pipeline_repeats

STAGE_AXES = ('activation_stage',)


def pipeline_bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
  """The share of a pipelined step each stage idles: ``(S-1) / (R M + S-1)``."""
  return (stages - 1) / (repeats * microbatches + stages - 1)


def describe_schedule(stages: int, microbatches: int, repeats: int = 1) -> str:
  """One line on a pipeline's schedule and its bubble, beside GPipe's with the same batches."""
  bubble = pipeline_bubble(stages, microbatches, repeats)
  line = (f'Pipeline: {stages} stages x {repeats} repeat(s), {microbatches} micro-batches: '
          f'stages idle {bubble:.0%} of each step (the bubble)')
  if repeats > 1:
    line += f'; GPipe with these micro-batches: {pipeline_bubble(stages, microbatches):.0%}'
  return line + '.'


def pipeline_stack(layers: nnx.Module, x_BTD: jax.Array, per_layer_L: Any, per_row_B: Any,
                   run_stage: Callable, *, stages: int | None = None,
                   microbatches: int | None = None, repeats: int | None = None) -> jax.Array:
  """Run stacked ``layers`` over ``x_BTD`` as a pipeline over the ``stage`` mesh axis.

  Args:
    layers: a module whose every variable has a leading ``layers`` axis.
    x_BTD: the stack's input ``[B, T, D]``.
    per_layer_L: a pytree of arrays with a leading ``layers`` axis (per-layer
      inputs, e.g. which layers use a sliding window); each chunk gets its slice.
    per_row_B: a pytree of arrays with a leading batch axis (e.g. segment ids
      and positions); each micro-batch gets its rows.
    run_stage: ``run_stage(chunk_layers, per_layer_L, x_bTD, per_row_b) -> x_bTD``
      runs one chunk of the stack on one micro-batch (``chunk_layers`` is a module
      of the same type as ``layers`` with ``num_layers / (stages * repeats)``
      layers). All stages run it at once, under ``jax.shard_map`` with ``stage`` manual when
      the mesh's ``stage`` axis is ``stages`` long, else vmapped (see :func:`_per_stage`).
    stages: pipeline stages; default the ``stage`` mesh axis size.
    microbatches: micro-batches per batch; default
      :func:`maxnnx.sharding.pipeline_microbatches` (one per stage unless the
      mesh context says otherwise).
    repeats: rounds of the stages per micro-batch; default
      :func:`maxnnx.sharding.pipeline_repeats` (1, GPipe, unless the mesh context
      says otherwise). More than 1 needs ``microbatches >= stages``.

  Returns:
    The stack's output ``[B, T, D]``. The :class:`ForwardStat` variables ``run_stage`` writes
    into its chunk are written back into ``layers``, combined over micro-batches (see the
    module docstring); other variables it writes (KV caches) are not carried back.
  """
  stages = stages or mesh_axis_size('stage')
  micro = microbatches or pipeline_microbatches()
  repeats = repeats or pipeline_repeats()
  graphdef, state = nnx.split(layers)
  num_layers = jax.tree.leaves(state)[0].shape[0]
  batch, length, width = x_BTD.shape
  _check_schedule(num_layers, batch, stages, micro, repeats)
  per_chunk = num_layers // (stages * repeats)
  items = repeats * micro  # (micro-batch, repeat) pairs each stage works through

  state_S, per_layer_S = _by_stage((state, per_layer_L), stages, repeats, per_chunk)
  x_M, per_row_M = _by_micro((x_BTD, per_row_B), micro)
  stats = _Statistics(layers, stages, repeats, per_chunk)

  def one_stage(stage_state, per_layer, repeat, x, per_row):
    chunk_state, chunk_per_layer = jax.tree.map(lambda a: a[repeat], (stage_state, per_layer))
    chunk = nnx.merge(graphdef, chunk_state)
    out = run_stage(chunk, chunk_per_layer, x, per_row)
    return out, jax.tree.leaves(nnx.state(chunk, ForwardStat))

  run_stages = _per_stage(one_stage, stages)
  buffer_axes = STAGE_AXES + RESIDUAL_AXES

  def iteration(carry, i):
    buffer, circulating, outputs, totals = carry
    item_S = jnp.clip(i - jnp.arange(stages), 0, items - 1)
    buffer = buffer.at[0].set(_first_stage_input(x_M, circulating, i, micro, repeats))
    out, stats_S = run_stages(state_S, per_layer_S, item_S // micro,
                              constrain(buffer, buffer_axes),
                              jax.tree.map(lambda a: a[item_S % micro], per_row_M))
    out = constrain(out, buffer_axes)
    working_S = (i - jnp.arange(stages) >= 0) & (i - jnp.arange(stages) < items)
    totals = stats.accumulate(totals, stats_S, working_S, item_S // micro)
    outputs, circulating = _keep_finished(outputs, circulating, out[-1], i - (stages - 1),
                                          micro, repeats)
    return (jnp.roll(out, 1, axis=0), circulating, outputs, totals), None

  buffer = jnp.zeros((stages, batch // micro, length, width), x_BTD.dtype)
  circulating = jnp.zeros_like(x_M) if repeats > 1 else jnp.zeros((), x_BTD.dtype)
  (_, _, outputs, totals), _ = jax.lax.scan(
      iteration, (buffer, circulating, jnp.zeros_like(x_M), stats.zeros()),
      jnp.arange(items + stages - 1))
  stats.write_back(layers, totals, micro)
  return outputs.reshape(batch, length, width)


def _per_stage(one_stage: Callable, stages: int) -> Callable:
  """``one_stage`` run for every stage at once (every argument and result with a leading
  stage axis). On a mesh whose ``stage`` axis is ``stages`` long: under ``jax.shard_map``
  with ``stage`` manual, each stage's devices running their own, so what the layers call
  inside sees ``stage`` as manual (a ``shard_map`` of their own, e.g. the MoE dispatch per
  batch shard, lowers there; under ``vmap(spmd_axis_name='stage')`` its batching rule puts
  ``stage`` in the inner specs without making it manual, which the lowering refuses).
  Otherwise ``vmap`` over stages."""
  if mesh_axis_size('stage') != stages:
    return jax.vmap(one_stage, spmd_axis_name='stage')

  # check_vma=False: every argument and result is split over stage; nothing varies otherwise.
  @functools.partial(jax.shard_map, in_specs=P('stage'), out_specs=P('stage'),
                     axis_names={'stage'}, check_vma=False)
  def on_stage(*args):
    out = one_stage(*jax.tree.map(lambda a: a[0], args))
    return jax.tree.map(lambda a: a[None], out)

  return on_stage


def _by_stage(tree, stages: int, repeats: int, per_chunk: int):
  """Every ``[L, ...]`` leaf of ``tree`` as ``[S, R, L/(R S), ...]``: chunk ``r S + s`` on
  stage ``s``."""
  return jax.tree.map(
      lambda a: jnp.swapaxes(a.reshape(repeats, stages, per_chunk, *a.shape[1:]), 0, 1), tree)


def _by_micro(tree, micro: int):
  """Every ``[B, ...]`` leaf of ``tree`` as ``[M, B/M, ...]``, one micro-batch a row."""
  return jax.tree.map(lambda a: a.reshape(micro, a.shape[0] // micro, *a.shape[1:]), tree)


def _first_stage_input(x_M, circulating, i, micro: int, repeats: int) -> jax.Array:
  """Stage 0's input at iteration ``i``: micro-batch ``i`` in the first round, from the
  second round on what came round from the last stage."""
  first = x_M[jnp.minimum(i, micro - 1)]
  if repeats > 1:
    first = jnp.where(i < micro, first, circulating[i % micro])
  return first


def _keep_finished(outputs, circulating, last_out, done, micro: int, repeats: int):
  """``(outputs, circulating)`` with the item ``done`` that the last stage finished
  (``last_out``) stored: among the outputs after its last repeat, else in the buffer that
  hands it back to stage 0 (nothing while ``done < 0``, the pipeline filling)."""
  items = repeats * micro
  slot = jnp.maximum(done, 0) % micro
  last_round = done >= items - micro
  updated = jax.lax.dynamic_update_index_in_dim(outputs, last_out, slot, 0)
  outputs = jnp.where(last_round, updated, outputs)
  if repeats > 1:
    kept = jax.lax.dynamic_update_index_in_dim(circulating, last_out, slot, 0)
    circulating = jnp.where((done >= 0) & ~last_round, kept, circulating)
  return outputs, circulating


def _check_schedule(num_layers: int, batch: int, stages: int, micro: int, repeats: int) -> None:
  if num_layers % (stages * repeats) or batch % micro:
    raise ValueError(f'Pipeline: num_layers ({num_layers}) must be divisible by the stages '
                     f'({stages}) times the repeats ({repeats}), and the batch ({batch}) by the '
                     f'micro-batches ({micro}).')
  if repeats > 1 and micro < stages:
    raise ValueError(f'A circular pipeline (pipeline_repeats={repeats}) needs at least one '
                     f'micro-batch per stage: pipeline_microbatches={micro} < stage={stages}.')


class _Statistics:
  """The stack's :class:`ForwardStat` variables through a pipeline: totals ``[S, R, layers per
  chunk, ...]`` per variable, folded each iteration and written back in layer order."""

  def __init__(self, layers: nnx.Module, stages: int, repeats: int, per_chunk: int):
    self.state = nnx.state(layers, ForwardStat)
    variables = jax.tree.leaves(self.state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    self.combines = [v.get_metadata().get('combine', 'mean') for v in variables]
    self.stages, self.repeats, self.per_chunk = stages, repeats, per_chunk

  def zeros(self) -> list:
    """Empty totals: 0 to sum or average, -inf to take the maximum."""
    return [jnp.full((self.stages, self.repeats, self.per_chunk, *v.shape[1:]),
                     -jnp.inf if how == 'max' else 0, v.dtype)
            for v, how in zip(jax.tree.leaves(self.state), self.combines)]

  def accumulate(self, totals: list, stats_S: list, working_S: jax.Array,
                 repeat_S: jax.Array) -> list:
    """Fold one iteration's statistics ``[S, layers per chunk, ...]`` into ``totals``: each
    working stage into its item's repeat."""
    into_SR = working_S[:, None] & (jnp.arange(self.repeats)[None, :] == repeat_S[:, None])
    out = []
    for total, stat, how in zip(totals, stats_S, self.combines):
      mask = into_SR.reshape(into_SR.shape + (1,) * (stat.ndim - 1))
      value = stat[:, None].astype(total.dtype)
      if how == 'max':
        out.append(jnp.maximum(total, jnp.where(mask, value, -jnp.inf)))
      else:
        out.append(total + jnp.where(mask, value, 0))
    return out

  def write_back(self, layers: nnx.Module, totals: list, micro: int) -> None:
    """Set the stack's variables to the totals, in layer order (means divided by ``micro``)."""
    if not totals:
      return
    by_layer = [(t / micro if how == 'mean' else t) for t, how in zip(totals, self.combines)]
    by_layer = [jnp.swapaxes(t, 0, 1).reshape(-1, *t.shape[3:]) for t in by_layer]
    nnx.update(layers, jax.tree.unflatten(jax.tree.structure(self.state), by_layer))


__all__ = ['STAGE_AXES', 'describe_schedule', 'pipeline_bubble', 'pipeline_stack']

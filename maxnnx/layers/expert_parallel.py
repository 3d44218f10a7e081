"""MoE tokens across the ``expert`` mesh axis by all-to-all
(``MeshConfig.expert_parallel_strategy=all_to_all``).

Under the default ``gspmd`` strategy the dropless dispatch sorts each batch shard's tokens
(:func:`dispatch_per_batch_shard`, over the batch axes other than ``expert``) and the compiler
moves them across ``expert`` however it likes; the capacity dispatch's per-expert buffers are
left to it whole. Here the
dispatch runs under ``jax.shard_map`` over ``expert`` and the axes that split the batch ahead
of it (``data``, ``fsdp``), so each device holds only its own tokens (the FSDP shards of the
expert weights are gathered on entry, as GSPMD does per layer); the other axes (``tensor``,
``context``) stay with GSPMD. Under pipeline stages this ``shard_map`` nests in the
pipeline's own (see :func:`dispatch_per_batch_shard`). Each device holds
``num_experts / expert`` experts and its own tokens, already routed, and exchanges with the
devices that differ from it in ``expert`` alone:

1. it packs its assignments per destination shard into a buffer of fixed size:
   ``dropless`` the worst case (every local assignment, so none is dropped) or, with
   ``MoEConfig.ragged_buffer_factor``, the receive cap below; ``capacity`` the per-expert
   slots of :func:`~maxnnx.layers.moe_dispatch.capacity` counted over the device's own tokens;
2. one ``jax.lax.all_to_all`` sends each buffer to the device of its experts (with the
   per-expert counts, for ``dropless``);
3. the device runs its experts with the block's grouped matmul (``ragged_dot_impl``) or
   batched matmul;
4. the reverse ``all_to_all`` brings the results home, where each token sums its
   assignments with their routing weights.

The buffers have static shapes because XLA:CPU has no ragged all-to-all; a ragged
exchange would send only the filled rows. Routing and the auxiliary statistics stay
outside, on the global token set, so they equal the ``gspmd`` path's.

The dropless receive cap (``ragged_buffer_factor = f``, MaxText's setting of that name): a
device holding ``N`` tokens has ``M = N * k`` assignments, its balanced share of what the
exchange brings it. Its buffer for each destination shard, and so each block of its receive
buffer, holds ``rows = min(M, ceil(f * M / expert))`` assignments: the receive buffer is
``expert * rows``, about ``f * M`` rather than ``expert * M``. The drop rule, on each device
and for each destination shard: number the device's assignments choice-major (``j * N + n``
for its local token ``n``'s ``j``-th choice in the router's top-k order, ``j < k``: every
token's first choice before any second one, as ``capacity`` dispatch fills its slots); of
those whose expert lives on that shard, the first ``rows`` in that order are sent and the rest
dropped (their results count zero in the token's weighted sum, and their routing weights get
no gradient from it). So what drops depends on how the mesh splits the batch,
not only on the routing. ``f >= expert`` drops nothing and gives the uncapped result.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxnnx.config import ConfigError, check_expert_split
from maxnnx.layers.moe_dispatch import CapacityPlan, capacity, sorted_inputs
from maxnnx.sharding import mesh_axis_size, spec_for

EXPERT_AXIS = 'expert'


def dispatch_all_to_all(moe, x_BTD: jax.Array, weights_NK: jax.Array, experts_NK: jax.Array,
                        input_weights_NK: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """The routed experts' output ``[B*T, d_model]`` (float32) of ``moe`` (a
  :class:`~maxnnx.layers.moe.MoE`), its tokens exchanged by ``all_to_all``, and how many
  assignments the dropless receive cap (``ragged_buffer_factor``) dropped over all devices
  (int32; 0 without the cap and for ``capacity`` dispatch, whose drops are its own).

  Raises:
    ConfigError: ``num_experts`` or the tokens do not split evenly over ``expert``.
  """
  shards = mesh_axis_size(EXPERT_AXIS)
  cfg = moe.cfg
  check_expert_split('all_to_all', cfg.num_experts, shards)
  batch, length, d = x_BTD.shape
  token_axes = _token_axes(batch)
  blocks = math.prod(mesh_axis_size(axis) for axis in token_axes)
  if (batch * length) % blocks:
    raise ConfigError(f'mesh.expert_parallel_strategy=all_to_all splits the {batch * length} '
                      f'tokens of a batch over {blocks} shards: use a batch whose tokens are a '
                      f'multiple of {blocks}, or mesh.expert_parallel_strategy=gspmd.')
  exchange = _dropless_shard if cfg.dispatch == 'dropless' else _capacity_shard
  tokens = P(token_axes)

  # check_vma=False: jax 0.10's searchsorted (the dense and tiled ragged dots use it) fails an
  # internal assertion on arrays that vary over a manual axis.
  @functools.partial(jax.shard_map, in_specs=(tokens, tokens, tokens, tokens, P(EXPERT_AXIS)),
                     out_specs=(tokens, P()), axis_names=set(token_axes), check_vma=False)
  def per_device(x, weights, experts, input_weights, expert_weights):
    y, dropped = exchange(moe, shards, x, weights, experts, input_weights, expert_weights)
    return y, jax.lax.psum(dropped, token_axes)

  return per_device(x_BTD.reshape(-1, d), weights_NK, experts_NK, input_weights_NK,
                    moe.expert_weights())


def dispatch_per_batch_shard(dispatch, batch: int, x_ND: jax.Array, weights_NK: jax.Array,
                             experts_NK: jax.Array, input_weights_NK: jax.Array | None,
                             expert_weights: dict) -> jax.Array:
  """``dispatch(x_ND, weights_NK, experts_NK, input_weights_NK, expert_weights)`` run on each
  device's own tokens: under ``jax.shard_map`` over the mesh axes that split the batch other
  than ``expert`` (e.g. ``data``, ``fsdp``), which GSPMD keeps partitioning as before.

  The ``gspmd`` strategy's dropless dispatch sorts all ``tokens * k`` assignments by expert;
  left to the partitioner, the sort and everything sorted (the inputs, the grouped matmuls'
  rows, their gradients) are replicated on every device, so a device holds the whole global
  batch's assignments however many devices split the batch. Per batch shard each device sorts
  only its own; the expert weights' FSDP shards are gathered on entry, as GSPMD does per layer,
  and their gradients summed over the shards on the way out. Dropless routing keeps no state
  across tokens, so the result is the global dispatch's. Under pipeline stages (``stage`` > 1)
  it runs the same way on each stage's micro-batch: the pipeline
  (:func:`maxnnx.parallel.pipeline.pipeline_stack`) runs its stages under a ``shard_map`` with
  ``stage`` manual, and this one nests inside it. (Under ``vmap(spmd_axis_name='stage')``, as
  the stages ran before, ``vmap``'s batching rule adds ``stage`` to this ``shard_map``'s specs
  without making it manual, and the lowering refuses the result: "operand shape,
  corresponding sharding, and region operand shape ... must match".)
  """
  axes = _batch_shard_axes(batch)
  if not axes:
    return dispatch(x_ND, weights_NK, experts_NK, input_weights_NK, expert_weights)
  tokens = P(axes)

  # check_vma=False: as in dispatch_all_to_all (jax 0.10's searchsorted on manual axes).
  @functools.partial(jax.shard_map, in_specs=(tokens, tokens, tokens, tokens, P()),
                     out_specs=tokens, axis_names=set(axes), check_vma=False)
  def per_shard(x, weights, experts, input_weights, expert_weights):
    return dispatch(x, weights, experts, input_weights, expert_weights)

  return per_shard(x_ND, weights_NK, experts_NK, input_weights_NK, expert_weights)


def count_per_batch_shard(experts_NK: jax.Array, num_experts: int, batch: int) -> jax.Array:
  """Assignments per expert ``[num_experts]`` (int32) in ``experts_NK``: each batch shard
  counts its own (over the axes of :func:`dispatch_per_batch_shard`) and the counts are summed
  over the shards. Left to the partitioner inside the pipeline's stages, the count gathered the
  micro-batch's routing onto every device."""
  def count(e):
    return jnp.bincount(e.reshape(-1), length=num_experts).astype(jnp.int32)

  axes = _batch_shard_axes(batch)
  if not axes:
    return count(experts_NK)

  @functools.partial(jax.shard_map, in_specs=P(axes), out_specs=P(), axis_names=set(axes),
                     check_vma=False)
  def per_shard(experts):
    return jax.lax.psum(count(experts), axes)

  return per_shard(experts_NK)


def _batch_shard_axes(batch: int) -> tuple[str, ...]:
  """The mesh axes that split a batch of ``batch`` rows, ``expert`` (left to GSPMD) and
  axes already manual excepted."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return ()
  spec = spec_for(('activation_batch',), mesh=mesh, shape=(batch,))[0]
  axes = (spec,) if isinstance(spec, str) else tuple(spec or ())
  return tuple(axis for axis in axes if axis != EXPERT_AXIS)


def _token_axes(batch: int) -> tuple[str, ...]:
  """The mesh axes the dispatch takes over: those that split the batch up to and including
  ``expert`` (e.g. ``data, expert``), so each device exchanges only its own tokens with the
  devices that differ from it in ``expert`` alone; just ``expert`` when it does not split
  the batch."""
  mesh = jax.sharding.get_abstract_mesh()
  spec = spec_for(('activation_batch',), mesh=mesh, shape=(batch,))[0]
  axes = (spec,) if isinstance(spec, str) else tuple(spec or ())
  if EXPERT_AXIS not in axes:
    return (EXPERT_AXIS,)
  return axes[:axes.index(EXPERT_AXIS) + 1]


def _exchange(buffer: jax.Array) -> jax.Array:
  """Block ``i`` of ``buffer``'s first axis goes to expert shard ``i``; block ``j`` of the
  result came from shard ``j``."""
  return jax.lax.all_to_all(buffer, EXPERT_AXIS, 0, 0, tiled=True)


def receive_rows(cfg, local_assignments: int, shards: int) -> int:
  """Rows of each source's block in a device's dropless receive buffer: every local
  assignment (the worst case) without ``cfg.ragged_buffer_factor``, else
  ``min(local_assignments, ceil(factor * local_assignments / shards))``."""
  factor = cfg.ragged_buffer_factor
  if factor is None:
    return local_assignments
  return max(1, min(local_assignments, math.ceil(factor * local_assignments / shards)))


def _kept_under_cap(experts_NK, local_experts: int, shards: int, rows: int) -> jax.Array:
  """Whether each assignment (token-major, ``[N * k]``) is sent: per destination shard, the
  first ``rows`` in choice-major order (the module's drop rule)."""
  num_tokens, k = experts_NK.shape
  dest_P = experts_NK.T.reshape(-1) // local_experts   # choice-major: first choices first
  order_P = jnp.argsort(dest_P, stable=True)
  sorted_P = dest_P[order_P]
  rank_P = jnp.arange(sorted_P.shape[0]) - jnp.searchsorted(sorted_P, sorted_P, side='left')
  kept_P = jnp.zeros(sorted_P.shape, bool).at[order_P].set(rank_P < rows)
  return kept_P.reshape(k, num_tokens).T.reshape(-1)


def _dropless_shard(moe, shards, x_ND, weights_NK, experts_NK, input_weights_NK,
                    expert_weights):
  """One shard's dropless exchange: buffers of :func:`receive_rows` rows per destination
  (the worst case, all ``N * k`` local assignments, unless capped); returns the output and
  the count of assignments the cap dropped here."""
  num_tokens, k = experts_NK.shape
  num_experts = moe.cfg.num_experts
  local_experts = num_experts // shards
  experts_M = experts_NK.reshape(-1)
  rows = receive_rows(moe.cfg, experts_M.shape[0], shards)
  dropped = jnp.zeros((), jnp.int32)
  if moe.cfg.ragged_buffer_factor is not None:
    kept_M = _kept_under_cap(experts_NK, local_experts, shards, rows)
    dropped = (~kept_M).sum(dtype=jnp.int32)
    experts_M = jnp.where(kept_M, experts_M, num_experts)  # dropped: sorted last, sent nowhere
  order_M = jnp.argsort(experts_M, stable=True)
  sorted_M = experts_M[order_M]
  dest_M = sorted_M // local_experts                     # == shards for dropped assignments
  dest_starts_X = jnp.searchsorted(sorted_M, jnp.arange(shards + 1) * local_experts,
                                   side='left')
  pos_M = jnp.arange(sorted_M.shape[0]) - dest_starts_X[dest_M]
  x_MD = sorted_inputs(x_ND, order_M, k, input_weights_NK).astype(moe.dtype)
  send_XMD = jnp.zeros((shards, rows, x_ND.shape[-1]), moe.dtype).at[dest_M, pos_M].set(
      x_MD, mode='drop')
  counts_XL = jnp.bincount(experts_M, length=num_experts + 1)[:num_experts].reshape(
      shards, local_experts)
  recv_XMD, recv_counts_XL = _exchange(send_XMD), _exchange(counts_XL.astype(jnp.int32))

  # Each source's rows arrive sorted by expert; regroup them by expert across sources.
  ends_XL = jnp.cumsum(recv_counts_XL, axis=1)
  expert_XM = jax.vmap(lambda ends: jnp.searchsorted(ends, jnp.arange(rows), side='right'))(
      ends_XL)  # == local_experts for padding rows
  expert_R = expert_XM.reshape(-1)
  order_R = jnp.argsort(expert_R, stable=True)
  y_RD = moe.grouped_ffn(recv_XMD.reshape(shards * rows, -1)[order_R],
                         jnp.minimum(expert_R[order_R], local_experts - 1),
                         recv_counts_XL.sum(axis=0), expert_weights)
  # Back in arrival order, in the exchange's dtype before the move: the buffer is ``expert``
  # times the rows, and a float32 copy of it doubles the largest temporaries.
  y_XMD = y_RD.astype(moe.dtype)[jnp.argsort(order_R)].reshape(shards, rows, -1)

  back_XMD = _exchange(y_XMD)
  y_MD = back_XMD.at[dest_M, pos_M].get(mode='fill', fill_value=0)[jnp.argsort(order_M)]
  y = jnp.einsum('nkd,nk->nd', y_MD.astype(jnp.float32).reshape(num_tokens, k, -1),
                 weights_NK)
  return y, dropped


def _capacity_shard(moe, shards, x_ND, weights_NK, experts_NK, input_weights_NK,
                    expert_weights):
  """One shard's capacity exchange: each expert's slots for this shard's tokens travel to
  the expert's shard, which runs all sources' slots in one batched matmul. Returns the output
  and 0 (the receive cap's count; capacity's own drops are not counted here)."""
  num_experts = moe.cfg.num_experts
  local_experts = num_experts // shards
  slots = capacity(x_ND.shape[0], moe.cfg)
  plan = CapacityPlan.of(experts_NK, slots)
  buffer_ECD = plan.pack(x_ND, input_weights_NK, num_experts, moe.dtype)
  recv_XLCD = _exchange(buffer_ECD.reshape(shards, local_experts, slots, -1))
  by_expert_LCD = recv_XLCD.transpose(1, 0, 2, 3).reshape(local_experts, shards * slots, -1)
  y_LCD = moe.batched_ffn(by_expert_LCD, expert_weights).astype(moe.dtype)
  y_XLCD = y_LCD.reshape(local_experts, shards, slots, -1).transpose(1, 0, 2, 3)
  back_ECD = _exchange(y_XLCD).reshape(num_experts, slots, -1)
  return plan.combine(back_ECD, weights_NK), jnp.zeros((), jnp.int32)

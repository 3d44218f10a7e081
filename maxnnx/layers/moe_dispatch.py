"""Bookkeeping shared by the MoE dispatches: which token each assignment reads and where
``capacity`` dispatch puts it. Used by :class:`~maxnnx.layers.moe.MoE` under GSPMD (one plan
per capacity group, vmapped) and by :mod:`maxnnx.layers.expert_parallel` on each ``expert``
shard."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from maxnnx.config import MoEConfig


def capacity(num_tokens: int, cfg: MoEConfig) -> int:
  """Slots per expert of ``capacity`` dispatch for ``num_tokens`` tokens."""
  return max(1, math.ceil(cfg.capacity_factor * num_tokens * cfg.num_experts_per_tok
                          / cfg.num_experts))


def sorted_inputs(x_ND, order_M, k, input_weights_NK=None):
  """The token of each assignment in ``order_M`` (assignment ``m`` is token ``m // k``),
  scaled by its routing weight when the experts weight their inputs."""
  x_MD = x_ND[order_M // k]
  if input_weights_NK is not None:
    x_MD = x_MD * input_weights_NK.reshape(-1)[order_M][:, None].astype(x_MD.dtype)
  return x_MD


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=['experts_M', 'tokens_M', 'slot_M', 'kept_M'],
                   meta_fields=['slots'])
@dataclasses.dataclass(frozen=True)
class CapacityPlan:
  """Where each assignment sits in ``capacity`` dispatch's per-expert buffers.

  Assignments are taken choice-major (every token's first choice before any second one);
  each expert fills its ``slots`` in that order and drops the rest. A pytree (``slots`` is
  static), so :func:`jax.vmap` builds one plan per capacity group.

  Attributes:
    experts_M, tokens_M: expert and token of each assignment (``M = tokens * k``).
    slot_M: its slot in the expert's buffer (``slots`` when dropped).
    kept_M: whether it found a slot.
    slots: slots per expert.
  """

  experts_M: jax.Array
  tokens_M: jax.Array
  slot_M: jax.Array
  kept_M: jax.Array
  slots: int

  @classmethod
  def of(cls, experts_NK: jax.Array, slots: int) -> CapacityPlan:
    """The plan of ``experts_NK`` with ``slots`` slots per expert."""
    num_tokens, k = experts_NK.shape
    experts_M = experts_NK.T.reshape(-1)            # choice-major: all first choices first
    order_M = jnp.argsort(experts_M, stable=True)
    sorted_M = experts_M[order_M]
    starts_M = jnp.searchsorted(sorted_M, sorted_M, side='left')
    slot_sorted_M = jnp.arange(experts_M.shape[0]) - starts_M
    slot_M = jnp.zeros_like(slot_sorted_M).at[order_M].set(slot_sorted_M)
    kept_M = slot_M < slots
    return cls(experts_M, jnp.tile(jnp.arange(num_tokens), k),
               jnp.where(kept_M, slot_M, slots), kept_M, slots)

  def pack(self, x_ND, input_weights_NK, num_experts: int, dtype) -> jax.Array:
    """The buffers ``[num_experts, slots, d_model]`` (empty slots are zeros)."""
    x_MD = x_ND[self.tokens_M]
    if input_weights_NK is not None:
      x_MD = x_MD * input_weights_NK.T.reshape(-1)[:, None].astype(x_MD.dtype)
    buffer_ECD = jnp.zeros((num_experts, self.slots, x_ND.shape[-1]), dtype)
    return buffer_ECD.at[self.experts_M, self.slot_M].set(x_MD.astype(dtype), mode='drop')

  def combine(self, y_ECD, weights_NK) -> jax.Array:
    """Each token's weighted sum of its kept assignments' results (float32 ``[N, D]``)."""
    y_MD = y_ECD[self.experts_M, jnp.minimum(self.slot_M, self.slots - 1)]
    y_MD = y_MD.astype(jnp.float32) * jnp.where(self.kept_M, weights_NK.T.reshape(-1),
                                                0.0)[:, None]
    num_tokens = weights_NK.shape[0]
    return jnp.zeros((num_tokens, y_MD.shape[-1]), jnp.float32).at[self.tokens_M].add(y_MD)

"""Grouped (ragged) matmuls for Mixture-of-Experts, registered by name.

Tokens sorted by expert form ``lhs [M, K]``; ``group_sizes [G]`` says how many
consecutive rows belong to each expert; expert ``g`` multiplies its rows by
``rhs[g] [K, N]``. Every strategy computes the same ``[M, N]`` result.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RaggedDotKernel:
  """Base class of ragged-dot strategies; instances are stateless and hashable."""

  name: str = 'base'

  def __call__(self, lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array, *,
               preferred_element_type=None) -> jax.Array:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class LaxRaggedDot(RaggedDotKernel):
  """``jax.lax.ragged_dot``: XLA's grouped matmul, available everywhere."""

  name: str = 'lax'

  def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None):
    return jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32),
                              preferred_element_type=preferred_element_type)


@dataclasses.dataclass(frozen=True)
class DenseRaggedDot(RaggedDotKernel):
  """Reference: every row times every expert, then keep its own expert's result.

  ``G`` times the FLOPs of the grouped matmul; for tests and tiny models.
  """

  name: str = 'dense'

  def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None):
    rows = jnp.arange(lhs_MK.shape[0])
    ends_G = jnp.cumsum(group_sizes_G)
    group_M = jnp.searchsorted(ends_G, rows, side='right')  # == G for rows past the last group
    all_GMN = jnp.einsum('mk,gkn->gmn', lhs_MK, rhs_GKN,
                         preferred_element_type=preferred_element_type)
    onehot_GM = group_M[None, :] == jnp.arange(rhs_GKN.shape[0])[:, None]
    return jnp.einsum('gmn,gm->mn', all_GMN, onehot_GM.astype(all_GMN.dtype))


RAGGED_DOT_IMPLEMENTATIONS: dict[str, Callable[[], RaggedDotKernel]] = {
    'lax': LaxRaggedDot, 'dense': DenseRaggedDot}


def register_ragged_dot_kernel(name: str, factory: Callable[[], RaggedDotKernel]) -> None:
  """Make ``factory`` available as ``ModelConfig.ragged_dot_impl = name``."""
  RAGGED_DOT_IMPLEMENTATIONS[name] = factory


def get_ragged_dot_kernel(name: str) -> RaggedDotKernel:
  """The ragged-dot strategy registered as ``name``; a clear error lists the known ones."""
  if name not in RAGGED_DOT_IMPLEMENTATIONS:
    known = ', '.join(sorted(RAGGED_DOT_IMPLEMENTATIONS))
    raise ValueError(f"Unknown ragged_dot_impl '{name}'. Known implementations: {known}.")
  return RAGGED_DOT_IMPLEMENTATIONS[name]()

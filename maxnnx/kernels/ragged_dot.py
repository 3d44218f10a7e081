"""Grouped (ragged) matmuls for Mixture-of-Experts, registered by name.

Tokens sorted by expert form ``lhs [M, K]``; ``group_sizes [G]`` says how many
consecutive rows belong to each expert; expert ``g`` multiplies its rows by
``rhs[g] [K, N]``; everything else a call asks for travels in one
:class:`~maxnnx.kernels.options.RaggedDotOptions`. Every strategy computes the
same ``[M, N]`` result (rows past the last group are zeros). Strategies declare what they support
(:class:`~maxnnx.kernels.capabilities.RaggedDotCapabilities`); a call they
cannot serve is refused or computed with ``lax`` as their ``on_unsupported``
policy says (see :mod:`maxnnx.kernels.capabilities`).
"""

import abc
import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp

from maxnnx.kernels.capabilities import (
  ALL_PLATFORMS,
  FLOAT_DTYPES,
  KernelStrategy,
  RaggedDotCapabilities,
  RaggedDotRequest,
  TokamaxStrategy,
  import_tokamax,
  lookup_kernel,
)
from maxnnx.kernels.options import RaggedDotOptions


@dataclasses.dataclass(frozen=True)
class RaggedDotKernel(KernelStrategy):
  """Base class of ragged-dot strategies; instances are stateless and hashable.

  A strategy declares :attr:`capabilities` and implements :meth:`compute`;
  ``__call__`` checks each call first and applies the ``on_unsupported``
  policy (``fallback`` to ``lax`` with a warning logged once, or ``error``).
  """

  kind: ClassVar[str] = 'ragged_dot'
  reference: ClassVar[str] = 'lax'

  def __call__(self, lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array,
               options: RaggedDotOptions | None = None) -> jax.Array:
    """``[M, N]``: row ``m`` of group ``g`` times ``rhs_GKN[g]`` (default options when ``None``)."""
    options = RaggedDotOptions() if options is None else options
    return self.run_checked(RaggedDotRequest.of(lhs_MK, rhs_GKN, options), self.compute,
                            LaxRaggedDot().compute, lhs_MK, rhs_GKN, group_sizes_G, options)

  @abc.abstractmethod
  def compute(self, lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array,
              options: RaggedDotOptions) -> jax.Array:
    """Compute a call already checked against the capabilities."""


_EVERYTHING = RaggedDotCapabilities(platforms=ALL_PLATFORMS, dtypes=FLOAT_DTYPES,
                                    mixed_dtypes=True)


@dataclasses.dataclass(frozen=True)
class LaxRaggedDot(RaggedDotKernel):
  """``jax.lax.ragged_dot``: XLA's grouped matmul, available everywhere."""

  name: str = 'lax'

  @property
  def capabilities(self) -> RaggedDotCapabilities:
    """Every float dtype on every platform."""
    return _EVERYTHING

  def compute(self, lhs_MK, rhs_GKN, group_sizes_G, options):
    """One ``jax.lax.ragged_dot``."""
    return jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32),
                              preferred_element_type=options.preferred_element_type)


@dataclasses.dataclass(frozen=True)
class DenseRaggedDot(RaggedDotKernel):
  """Reference: every row times every expert, then keep its own expert's result.

  ``G`` times the FLOPs of the grouped matmul; for tests and tiny models.
  """

  name: str = 'dense'

  @property
  def capabilities(self) -> RaggedDotCapabilities:
    """Every float dtype on every platform."""
    return _EVERYTHING

  def compute(self, lhs_MK, rhs_GKN, group_sizes_G, options):
    """Einsum over all experts, select each row's own."""
    rows = jnp.arange(lhs_MK.shape[0])
    ends_G = jnp.cumsum(group_sizes_G)
    group_M = jnp.searchsorted(ends_G, rows, side='right')  # == G for rows past the last group
    all_GMN = jnp.einsum('mk,gkn->gmn', lhs_MK, rhs_GKN,
                         preferred_element_type=options.preferred_element_type)
    onehot_GM = group_M[None, :] == jnp.arange(rhs_GKN.shape[0])[:, None]
    return jnp.einsum('gmn,gm->mn', all_GMN, onehot_GM.astype(all_GMN.dtype))


@dataclasses.dataclass(frozen=True)
class TiledRaggedDot(RaggedDotKernel):
  """Each group padded to whole tiles of ``tile`` rows, then one batched matmul.

  Every tile holds rows of one group only, so ``tiles x [tile, K] @ [K, N]``
  with each tile's own expert weight is exact (padding rows are zeros and are
  dropped). It costs at most ``G * (tile - 1)`` padding rows, where XLA's CPU
  ``ragged_dot`` multiplies every row by every group (``G`` times the FLOPs):
  the fast dropless path on CPUs. It gathers one ``[K, N]`` weight per tile, so
  memory grows with ``(M / tile + G) * K * N``. On an H100 (jax 0.11.2) it was also
  the one that trained a 64-expert, 5.6 B-parameter model on one GPU (57 GiB), where
  ``lax``'s plan needed 245 GiB, or 64 GiB for its autotuner alone
  (``benchmarks/RESULTS.md``); at about 6% MFU there, so a faster grouped matmul for GPUs
  is still wanted.

  Attributes:
    tile: rows per tile.
  """

  name: str = 'tiled'
  tile: int = 128

  @property
  def capabilities(self) -> RaggedDotCapabilities:
    """Every float dtype on every platform."""
    return _EVERYTHING

  def compute(self, lhs_MK, rhs_GKN, group_sizes_G, options):
    """Scatter rows into group-aligned tiles, batched matmul, gather rows back."""
    rows, _ = lhs_MK.shape
    groups = rhs_GKN.shape[0]
    tile = self.tile
    num_tiles = -(-rows // tile) + groups  # enough for every group's padding
    sizes_G = group_sizes_G.astype(jnp.int32)
    padded_G = (sizes_G + tile - 1) // tile * tile
    starts_G = jnp.cumsum(sizes_G) - sizes_G
    padded_ends_G = jnp.cumsum(padded_G)
    group_M = jnp.searchsorted(jnp.cumsum(sizes_G), jnp.arange(rows), side='right')
    in_group_M = group_M < groups
    g_M = jnp.minimum(group_M, groups - 1)
    dest_M = jnp.where(in_group_M, padded_ends_G[g_M] - padded_G[g_M] + jnp.arange(rows)
                       - starts_G[g_M], num_tiles * tile)  # past the end: dropped
    buffer_PK = jnp.zeros((num_tiles * tile, lhs_MK.shape[1]), lhs_MK.dtype)
    buffer_PK = buffer_PK.at[dest_M].set(lhs_MK, mode='drop')
    tile_group = jnp.searchsorted(padded_ends_G, jnp.arange(num_tiles) * tile, side='right')
    weights_TKN = rhs_GKN[jnp.minimum(tile_group, groups - 1)]
    out_TRN = jnp.einsum('trk,tkn->trn', buffer_PK.reshape(num_tiles, tile, -1), weights_TKN,
                         preferred_element_type=options.preferred_element_type)
    out_PN = out_TRN.reshape(num_tiles * tile, -1)
    return jnp.take(out_PN, dest_M, axis=0, mode='fill', fill_value=0)


#: Platforms of each tokamax ragged-dot implementation.
TOKAMAX_RAGGED_DOT_PLATFORMS = {'mosaic': ('gpu', 'tpu'), 'triton': ('gpu',),
                                'xla': ALL_PLATFORMS}


@dataclasses.dataclass(frozen=True)
class TokamaxRaggedDot(TokamaxStrategy, RaggedDotKernel):
  """``tokamax.ragged_dot`` over ``implementations`` (see
  :class:`~maxnnx.kernels.capabilities.TokamaxStrategy`), first that runs wins.

  Implementations that cannot run are logged once (a warning on
  ``maxnnx.kernels``), so a drop to XLA is visible. tokamax is imported on
  first use.
  """

  PLATFORMS: ClassVar[dict[str, tuple[str, ...]]] = TOKAMAX_RAGGED_DOT_PLATFORMS

  @property
  def capabilities(self) -> RaggedDotCapabilities:
    """Float dtypes, same dtype on both sides; platforms of its implementations."""
    return RaggedDotCapabilities(platforms=self.platforms, dtypes=FLOAT_DTYPES,
                                 mixed_dtypes=False)

  def compute(self, lhs_MK, rhs_GKN, group_sizes_G, options):
    """Try each implementation; log the ones that refuse; raise if all refuse."""
    tokamax = import_tokamax()
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    return self.run_first(
        lambda impl: tokamax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G,
                                        preferred_element_type=options.preferred_element_type,
                                        implementation=impl))


RAGGED_DOT_IMPLEMENTATIONS: dict[str, Callable[[], RaggedDotKernel]] = {
    'lax': LaxRaggedDot, 'dense': DenseRaggedDot, 'tiled': TiledRaggedDot,
    'tokamax': TokamaxRaggedDot}
for _impl in TOKAMAX_RAGGED_DOT_PLATFORMS:
  RAGGED_DOT_IMPLEMENTATIONS[f'tokamax_{_impl}'] = (
      lambda impl=_impl: TokamaxRaggedDot(name=f'tokamax_{impl}', implementations=(impl,)))


def register_ragged_dot_kernel(name: str, factory: Callable[[], RaggedDotKernel]) -> None:
  """Make ``factory`` available as ``ModelConfig.ragged_dot_impl = name``."""
  RAGGED_DOT_IMPLEMENTATIONS[name] = factory


def get_ragged_dot_kernel(name: str, *, on_unsupported: str | None = None) -> RaggedDotKernel:
  """The ragged-dot strategy registered as ``name``; a clear error lists the known ones.

  ``on_unsupported`` (``fallback`` or ``error``) overrides the strategy's policy.
  """
  return lookup_kernel(RAGGED_DOT_IMPLEMENTATIONS, 'ragged_dot', name, on_unsupported)

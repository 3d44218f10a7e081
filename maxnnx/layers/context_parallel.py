"""Attention across the ``context`` mesh axis, by ``MeshConfig.context_parallel_strategy``.

``all_gather`` (the default) calls the layer's attention kernel on the whole
sequence and lets GSPMD gather the keys and values of every ``context`` shard.
``ring`` runs :func:`~maxnnx.kernels.ring_attention.ring_attention` under
``jax.shard_map`` over ``context`` alone: the batch and head axes stay with GSPMD
(``axis_names={'context'}``), so data, FSDP and tensor parallelism compose as
before. Calls whose queries are not the keys' own tokens (decoding over a cache)
keep the kernel.
"""

import functools

import jax
from jax.sharding import PartitionSpec as P

from maxnnx.config import ConfigError, check_ring_split
from maxnnx.kernels.attention import AttentionKernel
from maxnnx.kernels.masks import AttentionMask
from maxnnx.kernels.options import AttentionOptions
from maxnnx.kernels.ring_attention import ring_attention
from maxnnx.layers.qk_clip import head_max_logits
from maxnnx.sharding import context_parallel_strategy, mesh_axis_size

CONTEXT_AXIS = 'context'
_TRACED_OPTIONS = ('sliding_window', 'sinks_N', 'chunk_size')


def attend(kernel: AttentionKernel, q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
           mask: AttentionMask | None, options: AttentionOptions) -> jax.Array:
  """Attention output ``[B, T, heads, v_head_dim]`` by the current context strategy.

  Raises:
    ConfigError: ``ring`` with a sequence that does not split evenly over ``context``
      or with a dense key mask (sparse attention).
  """
  shards = mesh_axis_size(CONTEXT_AXIS)
  self_attention = mask is not None and q_BTNH.shape[1] == k_BSKH.shape[1]
  if context_parallel_strategy() != 'ring' or shards == 1 or not self_attention:
    return kernel(q_BTNH, k_BSKH, v_BSKH, mask, options)
  check_ring_split('ring', q_BTNH.shape[1], shards)
  if options.key_mask_BTS is not None:
    raise ConfigError('mesh.context_parallel_strategy=ring cannot pass a dense key mask '
                      '(sparse attention) around the ring: use '
                      'mesh.context_parallel_strategy=all_gather.')
  return _ring(q_BTNH, k_BSKH, v_BSKH, mask, options, shards)


def attend_and_max_logits(kernel: AttentionKernel, q_BTNH: jax.Array, k_BSKH: jax.Array,
                          v_BSKH: jax.Array, mask: AttentionMask, options: AttentionOptions
                          ) -> tuple[jax.Array, jax.Array]:
  """:func:`attend`'s output and each head's largest visible logit ``[heads]`` (QK-clip's
  record): from the kernel's own blocks where it tracks them (``xla_flash``, no dense mask or
  scores), else :func:`~maxnnx.layers.qk_clip.head_max_logits` over the dense mask."""
  max_N = None
  if context_parallel_strategy() != 'ring' or mesh_axis_size(CONTEXT_AXIS) == 1:
    out, max_N = kernel.attend_and_max_logits(q_BTNH, k_BSKH, v_BSKH, mask, options)
  else:
    out = attend(kernel, q_BTNH, k_BSKH, v_BSKH, mask, options)
  if max_N is None:
    max_N = head_max_logits(q_BTNH, k_BSKH, options.visible(mask), options.scale)
  return out, max_N


def _ring(q_BTNH, k_BSKH, v_BSKH, mask, options, shards):
  """``ring_attention`` under ``shard_map`` over ``context``; array-valued options
  (traced windows, sinks) enter replicated, the others stay static."""
  traced = {name: getattr(options, name) for name in _TRACED_OPTIONS
            if isinstance(getattr(options, name), jax.Array)}
  sequence = P(None, CONTEXT_AXIS)

  @functools.partial(jax.shard_map, in_specs=(sequence, sequence, sequence, sequence, P()),
                     out_specs=sequence, axis_names={CONTEXT_AXIS})
  def per_shard(q, k, v, local_mask, local_options):
    local = AttentionOptions(**{**vars(options), **local_options})
    return ring_attention(q, k, v, local_mask, local, axis_name=CONTEXT_AXIS, axis_size=shards)

  return per_shard(q_BTNH, k_BSKH, v_BSKH, mask, traced)

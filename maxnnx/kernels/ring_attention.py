"""Ring attention: one device's share of attention whose keys travel around a mesh axis.

Run inside ``shard_map`` over a sequence-sharded axis (``context``): each device
keeps its block of queries and, for ``axis_size`` steps, attends to the key/value
block it holds, then hands that block to its neighbour with ``jax.lax.ppermute``
(``axis_size - 1`` hand-overs in all). Partial results merge with an online
softmax: a running row maximum, row sum and weighted value sum, all float32.

Which keys a query sees comes from the :class:`~maxnnx.kernels.masks.AttentionMask`
fields travelling with the blocks (segment ids, positions, image blocks), so the
true global positions decide causality: a load-balanced token order (each device
holding an early and a late chunk), packed documents, sliding windows and chunked
layers are all honoured without the ring knowing about them. A block no query of
the device can see is skipped (``lax.cond``). GQA/MQA, soft-capping, attention
sinks and a value head size of its own are supported; a dense ``key_mask_BTS``
(sparse attention) is not, since it cannot be cut into the travelling blocks.

Gradients come from JAX's autodiff through ``ppermute`` (its transpose sends the
key/value gradients back the other way round the ring). The backward pass keeps
each step's key/value block and scores, so the per-device residuals equal those of
the all-gather strategy; a custom VJP re-circulating the blocks would lower that.
"""

import dataclasses

import jax
import jax.numpy as jnp

from maxnnx.kernels.masks import AttentionMask
from maxnnx.kernels.options import AttentionOptions

_NEG = float(jnp.finfo(jnp.float32).min)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Softmax:
  """The running state of one device's online softmax.

  Attributes:
    max_BKGT1: running row maximum of the visible scores (float32).
    sum_BKGT1: running row sum of ``exp(score - max)`` (float32).
    acc_BKGTV: running ``sum(exp(score - max) * value)`` (float32).
  """

  max_BKGT1: jax.Array
  sum_BKGT1: jax.Array
  acc_BKGTV: jax.Array


def _absorb(state: _Softmax | None, q_BKGTH, k_BSKH, v_BSKV, allowed_BTS, options):
  """``state`` after one key/value block (``None``: the first block)."""
  scores = jnp.einsum('bkgth,bskh->bkgts', q_BKGTH, k_BSKH,
                      preferred_element_type=jnp.float32) * options.scale
  if options.softcap is not None:
    scores = options.softcap * jnp.tanh(scores / options.softcap)
  allowed = allowed_BTS[:, None, None]
  scores = jnp.where(allowed, scores, _NEG)
  # The result does not depend on the maximum: it only keeps exp() in range.
  block_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
  new_max = block_max if state is None else jnp.maximum(state.max_BKGT1, block_max)
  probs = jnp.where(allowed, jnp.exp(scores - new_max), 0.0)
  block_sum = jnp.sum(probs, axis=-1, keepdims=True)
  block_acc = jnp.einsum('bkgts,bskv->bkgtv', probs.astype(v_BSKV.dtype), v_BSKV,
                         preferred_element_type=jnp.float32)
  if state is None:
    return _Softmax(new_max, block_sum, block_acc)
  rescale = jnp.exp(state.max_BKGT1 - new_max)
  return _Softmax(new_max, state.sum_BKGT1 * rescale + block_sum,
                  state.acc_BKGTV * rescale + block_acc)


def _finish(state: _Softmax, sinks_KG) -> jax.Array:
  """``acc / sum`` with the sinks joining the sum; rows that saw nothing give 0."""
  total, acc = state.sum_BKGT1, state.acc_BKGTV
  if sinks_KG is not None:
    sinks = sinks_KG[None, :, :, None, None]
    top = jax.lax.stop_gradient(jnp.maximum(state.max_BKGT1, sinks))
    rescale = jnp.exp(state.max_BKGT1 - top)
    total = total * rescale + jnp.exp(sinks - top)
    acc = acc * rescale
  return acc / jnp.where(total > 0, total, 1.0)


def ring_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
                   mask: AttentionMask, options: AttentionOptions, *, axis_name: str,
                   axis_size: int) -> jax.Array:
  """This device's attention output ``[B, T, heads, v_head_dim]`` (inside ``shard_map``).

  ``q``/``k``/``v`` and ``mask`` are this device's blocks along ``axis_name`` (``T``
  tokens each, the mask's query and key fields those of the same tokens). Query
  rows that see no key at all (padding) give zeros.

  Raises:
    ValueError: ``options.key_mask_BTS`` is given (a dense mask cannot travel).
  """
  if options.key_mask_BTS is not None:
    raise ValueError('ring attention cannot take a dense key mask (sparse attention): use '
                     'mesh.context_parallel_strategy=all_gather.')
  batch, length, num_heads, head_dim = q_BTNH.shape
  num_kv_heads = k_BTKH.shape[2]
  groups = num_heads // num_kv_heads
  q_BKGTH = q_BTNH.reshape(batch, length, num_kv_heads, groups, head_dim).transpose(
      0, 2, 3, 1, 4)
  sinks_KG = (None if options.sinks_N is None
              else options.sinks_N.astype(jnp.float32).reshape(num_kv_heads, groups))

  def visible(block):
    keys = AttentionMask(mask.q_segment_ids, mask.q_positions, block['segment_ids'],
                         block['positions'], mask.q_blocks, block['image_blocks'])
    return options.visible(keys)

  def absorb(state, block, allowed_BTS):
    return _absorb(state, q_BKGTH, block['k'], block['v'], allowed_BTS, options)

  block = {'k': k_BTKH, 'v': v_BTKH, 'segment_ids': mask.kv_segment_ids,
           'positions': mask.kv_positions, 'image_blocks': mask.kv_blocks}
  state = absorb(None, block, visible(block))
  ring = [(i, (i + 1) % axis_size) for i in range(axis_size)]

  def step(carry, _):
    state, block = carry
    block = jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, ring), block)
    allowed_BTS = visible(block)
    state = jax.lax.cond(jnp.any(allowed_BTS), absorb, lambda s, *_: s, state, block,
                         allowed_BTS)
    return (state, block), None

  (state, _), _ = jax.lax.scan(step, (state, block), None, length=axis_size - 1)
  out_BKGTV = _finish(state, sinks_KG).astype(v_BTKH.dtype)
  return out_BKGTV.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads, -1)

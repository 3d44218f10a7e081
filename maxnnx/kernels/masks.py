"""Which keys each query may see, described by segment ids and positions."""

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
  """Segment ids and positions of the queries and of the keys.

  A key is visible to a query when both are in the same segment, the key's
  segment is not 0 (padding or an empty cache slot), the key's position is not
  after the query's (causal), in sliding layers the key is fewer than
  ``sliding_window`` positions back, and in chunked layers the key's position is
  in the query's chunk of ``chunk_size`` positions. The same rule covers plain causal
  training, packed documents (segments 1, 2, 3… with positions restarting),
  left-padded batches and KV-cache decoding, and lets an attention kernel use
  segment ids directly instead of a dense mask.

  Image blocks (Gemma 3): where ``q_blocks`` / ``kv_blocks`` are given, a query and a
  key of the same block id (``>= 0``; ``-1`` is text) see each other in both
  directions, whatever their order; the segment, window and chunk rules still apply.

  Attributes:
    q_segment_ids: ``[B, T]`` int32.
    q_positions: ``[B, T]`` int32.
    kv_segment_ids: ``[B, S]`` int32.
    kv_positions: ``[B, S]`` int32.
    q_blocks: ``[B, T]`` int32 image-block ids of the queries, or ``None``.
    kv_blocks: ``[B, S]`` int32 image-block ids of the keys, or ``None``.
  """

  q_segment_ids: jax.Array
  q_positions: jax.Array
  kv_segment_ids: jax.Array
  kv_positions: jax.Array
  q_blocks: jax.Array | None = None
  kv_blocks: jax.Array | None = None

  @classmethod
  def causal(cls, segment_ids_BT: jax.Array, positions_BT: jax.Array,
             blocks_BT: jax.Array | None = None) -> 'AttentionMask':
    """Self-attention of a (possibly packed) sequence over itself (with image blocks
    ``blocks_BT`` seeing themselves whole, when given)."""
    return cls(segment_ids_BT, positions_BT, segment_ids_BT, positions_BT, blocks_BT, blocks_BT)

  def dense(self, sliding_window: int | jax.Array | None = None,
            chunk_size: int | jax.Array | None = None) -> jax.Array:
    """Boolean mask ``[B, T, S]``; ``True`` where attention is allowed.

    ``sliding_window`` and ``chunk_size`` may be traced integers (scanned layers
    of mixed types).
    """
    q_seg, kv_seg = self.q_segment_ids[:, :, None], self.kv_segment_ids[:, None, :]
    q_pos, kv_pos = self.q_positions[:, :, None], self.kv_positions[:, None, :]
    order = kv_pos <= q_pos
    if self.q_blocks is not None:
      q_block = self.q_blocks[:, :, None]
      order |= (q_block == self.kv_blocks[:, None, :]) & (q_block >= 0)
    allowed = (q_seg == kv_seg) & (kv_seg != 0) & order
    if sliding_window is not None:
      allowed &= q_pos - kv_pos < sliding_window
    if chunk_size is not None:
      allowed &= q_pos // chunk_size == kv_pos // chunk_size
    return allowed


def index_order_matches_positions(mask: AttentionMask, *, step_per_index: bool = False
                                  ) -> jax.Array:
  """Whether causality by index equals causality by position for this self-attention mask.

  True when queries and keys share segment ids and positions, and along each
  row's non-padding tokens segment ids never decrease and positions strictly
  increase inside a segment (O(B·T), no ``[B, T, S]`` array). Then a query sees
  no key after it by index. With ``step_per_index``, positions must also rise by
  at least the index distance to the previous non-padding token of the segment,
  so a key fewer than ``W`` positions back is fewer than ``W`` indices back (a
  window or chunk of ``W`` bounds the look-back by index too).
  """
  seg_BT, pos_BT = mask.q_segment_ids, mask.q_positions
  same = jnp.all(seg_BT == mask.kv_segment_ids) & jnp.all(pos_BT == mask.kv_positions)
  length = seg_BT.shape[1]
  index_BT = jnp.broadcast_to(jnp.arange(length), seg_BT.shape)
  last_real_BT = jax.lax.cummax(jnp.where(seg_BT != 0, index_BT, -1), axis=1)
  prev_BT = jnp.pad(last_real_BT[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  prev_seg = jnp.take_along_axis(seg_BT, jnp.maximum(prev_BT, 0), axis=1)
  prev_pos = jnp.take_along_axis(pos_BT, jnp.maximum(prev_BT, 0), axis=1)
  min_step_BT = index_BT - prev_BT if step_per_index else 1
  ok_BT = ((seg_BT == 0) | (prev_BT < 0) | (seg_BT > prev_seg)
           | ((seg_BT == prev_seg) & (pos_BT - prev_pos >= min_step_BT)))
  return same & jnp.all(ok_BT)


def image_blocks(is_image_BT: jax.Array) -> jax.Array:
  """``[B, T]`` int32 block ids of runs of image tokens (0, 1, … per row) and -1 for text:
  each image's tokens form one block (transformers' ``token_type_ids == 1`` runs)."""
  is_image_BT = is_image_BT.astype(bool)
  previous_BT = jnp.pad(is_image_BT, ((0, 0), (1, 0)))[:, :-1]
  starts_BT = is_image_BT & ~previous_BT
  return jnp.where(is_image_BT, jnp.cumsum(starts_BT, axis=1) - 1, -1).astype(jnp.int32)


def default_segments_and_positions(ids_BT: jax.Array):
  """Segment ids (all 1) and positions (0..T-1) of unpacked, unpadded input."""
  batch, length = ids_BT.shape
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  return jnp.ones((batch, length), jnp.int32), positions

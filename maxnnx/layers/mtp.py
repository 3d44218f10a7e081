"""Multi-token prediction (DeepSeek V3): modules that predict tokens further ahead.

Module ``k`` (``k = 1 .. mtp.num_layers``) sees, at position ``i``, the previous
depth's hidden state ``h^{k-1}_i`` (depth 0: the main model's last block output,
before its final norm) and the embedding of token ``t_{i+k}`` (the main model's
embedding table):

  h'_i = proj([embed_norm(emb(t_{i+k})); hidden_norm(h^{k-1}_i)])   (2 d_model -> d_model)
  h^k = block(h')                        (one decoder block, causal, same positions)
  logits^k_i = head(final_norm(h^k_i))   (the main model's output head)

``logits^k_i`` predicts token ``t_{i+k+1}``, i.e. ``targets[i + k]`` of a
next-token batch. The training loss adds ``mtp_loss_scaling_factor`` times the
mean over depths of their cross-entropy. Plain generation ignores these modules;
speculative decoding can draft with module 1 (:mod:`maxnnx.inference.mtp_draft`).

The model runs the block (so it gets the same attention kernel and remat policy
as the main stack); this module holds the pieces and the target bookkeeping.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.config import ModelConfig
from maxnnx.layers.block import RESIDUAL_AXES, make_block
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.norm_factory import make_norm
from maxnnx.layers.parts import BlockParts, build_part
from maxnnx.sharding import constrain


class MTPLayer(nnx.Module):
  """One multi-token-prediction depth (Hugging Face: ``model.layers.{num_layers + k - 1}``).

  Calling it merges the token embeddings and the previous depth's hidden
  states into the block input ``h'``; the model then runs ``block`` and
  ``final_norm`` and its own output head.

  Attributes:
    embed_norm: norm of the shifted token embeddings (``enorm``).
    hidden_norm: norm of the previous depth's hidden states (``hnorm``).
    proj: ``[2 * d_model] -> [d_model]``, no bias (``eh_proj``).
    block: a :class:`~maxnnx.layers.block.DecoderBlock` (or ``parts.block``), MoE when
      the model has experts; built with the model's
      :class:`~maxnnx.layers.parts.BlockParts` like the main stack.
    final_norm: norm before the shared output head (``shared_head.norm``).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, parts: BlockParts | None = None):
    parts = BlockParts() if parts is None else parts
    d = cfg.d_model

    def norm():
      return (make_norm(cfg, rngs=rngs) if parts.norm is None else
              build_part(parts.norm, cfg, rngs, 'norm'))

    self.embed_norm = norm()
    self.hidden_norm = norm()
    self.proj = DenseGeneral((2 * d,), (d,), axes=('mlp', 'embed'), dtype=cfg.jnp_dtype(),
                             param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)
    self.block = make_block(cfg, rngs, cfg.moe.num_experts > 0, parts)
    self.final_norm = norm()

  def __call__(self, hidden_BTD: jax.Array, embedded_BTD: jax.Array) -> jax.Array:
    """The block input ``proj([embed_norm(embedded); hidden_norm(hidden)])`` ``[B, T, D]``."""
    merged = jnp.concatenate([self.embed_norm(embedded_BTD).astype(hidden_BTD.dtype),
                              self.hidden_norm(hidden_BTD)], axis=-1)
    return constrain(self.proj(merged), RESIDUAL_AXES)


def shift_left(x_BT: jax.Array, k: int, fill=0) -> jax.Array:
  """``x[:, i + k]`` at position ``i``; the last ``k`` positions hold ``fill``."""
  x_BT = jnp.asarray(x_BT)
  if k == 0:
    return x_BT
  pad = jnp.full((x_BT.shape[0], min(k, x_BT.shape[1])), fill, x_BT.dtype)
  return jnp.concatenate([x_BT[:, k:], pad], axis=1)


def mtp_targets(targets_BT: jax.Array, loss_mask_BT: jax.Array, segment_ids_BT: jax.Array,
                positions_BT: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """``(targets, mask)`` of MTP depth ``k`` for a next-token batch.

  Position ``i`` predicts ``targets[i + k]``. It counts only where that target
  counts (``loss_mask[i + k]``) and lies ``k`` tokens later in the same document
  (same non-zero segment id, position ``positions[i] + k``): a shifted target
  across a packed-document boundary, into padding or past the row's end does not.
  """
  segment_ids_BT = segment_ids_BT.astype(jnp.int32)
  same_doc = ((shift_left(segment_ids_BT, k) == segment_ids_BT) & (segment_ids_BT != 0)
              & (shift_left(positions_BT, k, -1) == positions_BT + k))
  mask = shift_left(loss_mask_BT, k) * same_doc.astype(loss_mask_BT.dtype)
  return shift_left(targets_BT, k), mask

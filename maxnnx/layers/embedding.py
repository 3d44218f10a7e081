"""Token embedding (optionally reused as the output projection) and learned position tables."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.layers.params import logical_param
from maxnnx.sharding import constrain


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lookup(table_VD: jax.Array, ids_BT: jax.Array, dtype) -> jax.Array:
  """Rows ``table_VD[ids_BT]`` in ``dtype``, the table gathered whole along ``embed``.

  The cast comes before the gather, so under FSDP a bf16 copy of the table crosses the wire,
  not the float32 master (half the bytes). The gradient is summed into the table in float32
  whatever ``dtype`` is: a token that appears many times in a batch adds all its rows'
  gradients without bf16 rounding between them.
  """
  return _lookup_fwd(table_VD, ids_BT, dtype)[0]


def _lookup_fwd(table_VD, ids_BT, dtype):
  # Cast where the table lies (split as stored), then gather along embed.
  copy_VD = constrain(constrain(table_VD.astype(dtype), ('vocab', 'embed')), ('vocab', None))
  return jnp.take(copy_VD, ids_BT, axis=0), (ids_BT, jnp.zeros((0,) + table_VD.shape[1:],
                                                               table_VD.dtype), table_VD.shape[0])


def _lookup_bwd(dtype, residuals, dy_BTD):
  ids_BT, like, vocab = residuals
  table = constrain(jnp.zeros((vocab,) + like.shape[1:], jnp.float32), ('vocab', None))
  grad_VD = table.at[ids_BT].add(dy_BTD.astype(jnp.float32))
  return grad_VD.astype(like.dtype), None


lookup.defvjp(_lookup_fwd, _lookup_bwd)


class Embed(nnx.Module):
  """Lookup table ``[vocab, d_model]``; ``attend`` gives tied output logits.

  Attributes:
    embedding: ``nnx.Param`` of shape ``[vocab_size, d_model]``.
  """

  def __init__(self, vocab_size: int, d_model: int, *, init_std: float = 0.02,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.vocab_size, self.dtype = vocab_size, dtype
    self.embedding = logical_param(nnx.initializers.normal(init_std), rngs.params(),
                                   (vocab_size, d_model), param_dtype, ('vocab', 'embed'))

  def __call__(self, ids_BT: jax.Array) -> jax.Array:
    """Embeddings ``[B, T, d_model]`` of integer ids ``[B, T]``.

    The table is gathered whole along ``embed`` first (as FSDP gathers every weight) and
    stays split along ``vocab``: looked up while split along ``embed``, the rows would come
    out split along ``d_model`` and XLA cannot move them to the batch-split activation
    layout without replicating them (an "involuntary full rematerialization"). The table is
    cast to the compute dtype before that gather (:func:`lookup`).
    """
    return lookup(self.embedding[...], ids_BT, jnp.dtype(self.dtype))

  def attend(self, x_BTD: jax.Array, dtype=None) -> jax.Array:
    """Logits ``x · embeddingᵀ`` (``[B, T, vocab]``), for tied output layers."""
    dtype = dtype or self.dtype
    return jnp.einsum('btd,vd->btv', x_BTD.astype(dtype), self.embedding[...].astype(dtype),
                      preferred_element_type=jnp.float32).astype(dtype)


class LearnedPositions(nnx.Module):
  """A trained table ``[max_positions, d_model]`` looked up by token position (GPT-2/3).

  The model adds its rows to the token embeddings. Positions are those of the
  :class:`~maxnnx.kernels.masks.AttentionMask` (restarting per packed document,
  counting from each row's first real token in left-padded batches); positions
  past the table reuse its last row (``generate`` warns before that happens).

  Attributes:
    embedding: ``nnx.Param`` of shape ``[max_positions, d_model]``.
  """

  def __init__(self, max_positions: int, d_model: int, *, init_std: float = 0.02,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.dtype = dtype
    self.embedding = logical_param(nnx.initializers.normal(init_std), rngs.params(),
                                   (max_positions, d_model), param_dtype, ('position', 'embed'))

  def __call__(self, positions_BT: jax.Array) -> jax.Array:
    """Position embeddings ``[B, T, d_model]`` of integer positions ``[B, T]``."""
    return jnp.take(self.embedding[...], positions_BT, axis=0, mode='clip').astype(self.dtype)

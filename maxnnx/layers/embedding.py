"""Token embedding (optionally reused as the output projection) and learned position tables."""

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.layers.params import logical_param
from maxnnx.sharding import constrain


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
    layout without replicating them (an "involuntary full rematerialization").
    """
    table_VD = constrain(self.embedding[...], ('vocab', None))
    return jnp.take(table_VD, ids_BT, axis=0).astype(self.dtype)

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

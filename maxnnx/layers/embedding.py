"""Token embedding, optionally reused as the output projection."""

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.layers.params import logical_param


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
    """Embeddings ``[B, T, d_model]`` of integer ids ``[B, T]``."""
    return jnp.take(self.embedding[...], ids_BT, axis=0).astype(self.dtype)

  def attend(self, x_BTD: jax.Array, dtype=None) -> jax.Array:
    """Logits ``x · embeddingᵀ`` (``[B, T, vocab]``), for tied output layers."""
    dtype = dtype or self.dtype
    return jnp.einsum('btd,vd->btv', x_BTD.astype(dtype), self.embedding[...].astype(dtype),
                      preferred_element_type=jnp.float32).astype(dtype)

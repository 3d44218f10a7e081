"""Choosing the next token from logits: greedy, temperature, top-k, top-p."""

import jax
import jax.numpy as jnp


def sample_next_token(logits_BV: jax.Array, key: jax.Array, *, temperature: float = 0.0,
                      top_k: int | None = None, top_p: float | None = None) -> jax.Array:
  """Next token ids ``[B]``.

  ``temperature == 0`` is greedy (argmax; ``top_k``/``top_p`` are then moot).
  Otherwise logits are divided by ``temperature``, restricted to the ``top_k``
  most likely tokens and to the smallest set whose probability reaches
  ``top_p`` (the most likely token always stays), and sampled.
  """
  logits = logits_BV.astype(jnp.float32)
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  neg_inf = jnp.finfo(jnp.float32).min
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, neg_inf, logits)
  if top_p is not None:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # The smallest logit still inside the nucleus is the cut-off.
    keep = mass_before < top_p
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, neg_inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

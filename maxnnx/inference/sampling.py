"""Choosing the next token from logits: greedy, temperature, top-k, top-p.

The one home of the sampling rule, for :func:`~maxnnx.inference.generate` (one setting for
the whole batch, as static Python values) and the serving engine (a setting per row, as
arrays, so that changing one never recompiles). The rule is the same for both: greedy at
temperature 0; otherwise divide by the temperature, keep the ``top_k`` best tokens (ties
kept), then the smallest set whose probability reaches ``top_p`` (the most likely token
always stays), and sample.
"""

import jax
import jax.numpy as jnp


def cut_top_k_top_p(scaled_BV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
  """``scaled_BV`` with the logits outside each row's top-k and top-p sets at the lowest float.

  Args:
    scaled_BV: ``[B, vocab]`` float32 logits, already divided by the temperature.
    top_k_B: ``[B]`` int; 0 means no top-k cut (a ``k`` over the vocabulary keeps it all).
    top_p_B: ``[B]`` float; 1 means no top-p cut.

  Returns:
    ``[B, vocab]`` logits to sample from.
  """
  vocab = scaled_BV.shape[-1]
  neg_inf = jnp.finfo(jnp.float32).min
  sorted_BV = -jnp.sort(-scaled_BV, axis=-1)
  k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
  kth_B1 = jnp.take_along_axis(sorted_BV, (k_B - 1)[:, None], axis=-1)
  scaled_BV = jnp.where(scaled_BV < kth_B1, neg_inf, scaled_BV)
  sorted_BV = jnp.where(sorted_BV < kth_B1, neg_inf, sorted_BV)
  probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
  mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  keep_BV = (mass_before_BV < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0)
  # The smallest logit still inside the nucleus is the cut-off.
  cutoff_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(scaled_BV < cutoff_B1, neg_inf, scaled_BV)


def sample_next_token(logits_BV: jax.Array, key: jax.Array, *, temperature: float = 0.0,
                      top_k: int | None = None, top_p: float | None = None) -> jax.Array:
  """Next token ids ``[B]``, with one setting for every row.

  Args:
    logits_BV: ``[B, vocab]`` logits.
    key: one random key for the batch.
    temperature: 0 is greedy (argmax; ``top_k`` / ``top_p`` are then moot).
    top_k: sample only among the ``top_k`` most likely tokens (``None``: all).
    top_p: sample only from the smallest set of tokens whose probability reaches ``top_p``
      (``None``: all).

  Returns:
    ``[B]`` int32 token ids.
  """
  logits_BV = logits_BV.astype(jnp.float32)
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / temperature
  if top_k is not None or top_p is not None:
    batch = logits_BV.shape[0]
    logits_BV = cut_top_k_top_p(logits_BV, jnp.full((batch,), top_k or 0, jnp.int32),
                                jnp.full((batch,), 1.0 if top_p is None else top_p,
                                         jnp.float32))
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def row_keys(seeds_B: jax.Array, counters_B: jax.Array) -> jax.Array:
  """One key per row: ``fold_in(key(seed), counter)``, so a request's ``n``-th sample
  depends only on its seed and ``n``."""
  return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds_B, counters_B)


def sample_rows(logits_BV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array,
                top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
  """Next token ids ``[B]``; row ``b`` uses its own parameters and key.

  Args:
    logits_BV: ``[B, vocab]`` logits.
    keys_B: ``[B]`` random keys (:func:`row_keys`).
    temperature_B: ``[B]`` float; 0 means greedy.
    top_k_B: ``[B]`` int; 0 means no top-k cut.
    top_p_B: ``[B]`` float; 1 means no top-p cut.

  Returns:
    ``[B]`` int32 token ids.
  """
  logits_BV = logits_BV.astype(jnp.float32)
  greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

  def sample(_):
    scaled_BV = logits_BV / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
    # The sort over the vocabulary dominates a CPU step (250 ms for 32 x 32k): skip it when
    # no row cuts (the cut would then keep every logit, so the result is the same).
    cuts = jnp.any(top_k_B > 0) | jnp.any(top_p_B < 1.0)
    scaled_BV = jax.lax.cond(cuts, lambda x: cut_top_k_top_p(x, top_k_B, top_p_B),
                             lambda x: x, scaled_BV)
    sampled_B = jax.vmap(jax.random.categorical)(keys_B, scaled_BV).astype(jnp.int32)
    return jnp.where(temperature_B > 0, sampled_B, greedy_B)

  return jax.lax.cond(jnp.any(temperature_B > 0), sample, lambda _: greedy_B, None)

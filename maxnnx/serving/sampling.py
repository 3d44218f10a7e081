"""Sampling with per-row parameters, inside the engine's jitted step.

:func:`maxnnx.inference.sample_next_token` takes one temperature / top-k / top-p
for the whole batch as Python values (they are static). Here every row is a
different request, so the parameters are arrays and changing them never
recompiles. The rule per row is the same: greedy at temperature 0, otherwise
divide by the temperature, keep the ``top_k`` best tokens (ties kept), then the
smallest set reaching ``top_p``, and sample.
"""

import jax
import jax.numpy as jnp


def row_keys(seeds_B: jax.Array, counters_B: jax.Array) -> jax.Array:
  """One key per row: ``fold_in(key(seed), counter)``, so a request's ``n``-th sample
  depends only on its seed and ``n``."""
  return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds_B, counters_B)


def sample_rows(logits_BV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array,
                top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
  """Next token ids ``[B]``; row ``b`` uses its own parameters.

  Args:
    logits_BV: ``[B, vocab]`` logits.
    keys_B: ``[B]`` random keys (:func:`row_keys`).
    temperature_B: ``[B]`` float; 0 means greedy.
    top_k_B: ``[B]`` int; 0 means no top-k cut.
    top_p_B: ``[B]`` float; 1 means no top-p cut.
  """
  logits_BV = logits_BV.astype(jnp.float32)
  greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

  def cut(scaled):
    """``scaled`` with the logits outside each row's top-k and top-p set to -inf."""
    vocab = logits_BV.shape[-1]
    neg_inf = jnp.finfo(jnp.float32).min
    sorted_BV = -jnp.sort(-scaled, axis=-1)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
    kth_B1 = jnp.take_along_axis(sorted_BV, (k_B - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < kth_B1, neg_inf, scaled)
    sorted_BV = jnp.where(sorted_BV < kth_B1, neg_inf, sorted_BV)
    probs = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0)
    cutoff_B1 = jnp.min(jnp.where(keep, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled < cutoff_B1, neg_inf, scaled)

  def sample(_):
    scaled = logits_BV / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
    # The sort over the vocabulary dominates a CPU step (250 ms for 32 x 32k): skip it when
    # no row cuts (the cut would then keep every logit, so the result is the same).
    cuts = jnp.any(top_k_B > 0) | jnp.any(top_p_B < 1.0)
    scaled = jax.lax.cond(cuts, cut, lambda x: x, scaled)
    sampled_B = jax.vmap(jax.random.categorical)(keys_B, scaled).astype(jnp.int32)
    return jnp.where(temperature_B > 0, sampled_B, greedy_B)

  return jax.lax.cond(jnp.any(temperature_B > 0), sample, lambda _: greedy_B, None)

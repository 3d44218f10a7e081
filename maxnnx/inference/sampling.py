"""Choosing the next token from logits: controls, then greedy, temperature, top-k, top-p.

The one home of the sampling rule, for :func:`~maxnnx.inference.generate` (one setting for
the whole batch, as static Python values) and the serving engine (a setting per row, as
arrays, so that changing one never recompiles). The rule is the same for both: greedy at
temperature 0; otherwise divide by the temperature, keep the ``top_k`` best tokens (ties
kept), then the smallest set whose probability reaches ``top_p`` (the most likely token
always stays), and sample.

Before that rule, the logits may be adjusted per row (:func:`apply_controls`), as vLLM
does (and OpenAI defines the penalties): a ``logit_bias`` is added (an id masked by
``min_tokens`` gets ``-inf``), then the repetition penalty (HF / CTRL) divides the positive
logits and multiplies the negative ones of every token seen in the prompt or the output,
then the frequency and presence penalties (OpenAI) subtract ``count * frequency +
(count > 0) * presence`` over the tokens generated so far. Last, a row's token mask (a
structured output's grammar, :mod:`maxnnx.inference.structured`) sets the logits of the
tokens it does not allow to ``-inf``.
"""

import dataclasses
import math
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_PENALTY = 2.0  # OpenAI's range for presence / frequency penalties: [-2, 2]


def logit_bias_pairs(bias: Mapping | Iterable) -> tuple[tuple[int, float], ...]:
  """``{token id: bias}`` (or ``(id, bias)`` pairs) as sorted ``(int, float)`` pairs."""
  items = bias.items() if isinstance(bias, Mapping) else bias
  return tuple(sorted((int(i), float(v)) for i, v in dict(items).items()))


def control_problems(logit_bias: tuple[tuple[int, float], ...], presence_penalty: float,
                     frequency_penalty: float, repetition_penalty: float, min_tokens: int,
                     max_tokens: int) -> list[str]:
  """What is wrong with these logit controls, one phrase per argument at fault."""
  problems = []
  bad_bias = [(i, v) for i, v in logit_bias
              if i < 0 or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS]
  if bad_bias:
    i, v = bad_bias[0]
    problems.append(f'logit_bias {{{i}: {v}}} (need token ids >= 0 and biases in '
                    f'[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}])')
  for name, value in (('presence_penalty', presence_penalty),
                      ('frequency_penalty', frequency_penalty)):
    if not -MAX_PENALTY <= value <= MAX_PENALTY:
      problems.append(f'{name}={value} (need -{MAX_PENALTY:g} <= {name} <= {MAX_PENALTY:g})')
  if not (repetition_penalty > 0 and math.isfinite(repetition_penalty)):
    problems.append(f'repetition_penalty={repetition_penalty} (need > 0; 1 is none)')
  if not 0 <= min_tokens <= max_tokens:
    problems.append(f'min_tokens={min_tokens} (need 0 <= min_tokens <= max_tokens='
                    f'{max_tokens})')
  return problems


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Controls:
  """Per-row logit adjustments applied before sampling (see :func:`apply_controls`).

  Attributes:
    bias_ids_BK: ``[B, K]`` token ids to bias; ids ``>= vocab`` are padding.
    bias_values_BK: ``[B, K]`` float32 value added to each id's logit (``-inf`` masks it).
    presence_B: ``[B]`` OpenAI presence penalty (0: none).
    frequency_B: ``[B]`` OpenAI frequency penalty (0: none).
    repetition_B: ``[B]`` HF repetition penalty (1: none).
    counts_BV: ``[B, vocab]`` int32 count of each token among the generated tokens, or
      ``None`` when no row is penalised.
    prompt_seen_BV: ``[B, vocab]`` bool, whether each token is in the row's prompt (for the
      repetition penalty), or ``None`` with ``counts_BV``.
    allowed_BW: ``[B, ceil(vocab / 32)]`` int32 token masks, bit ``i % 32`` of word
      ``i // 32`` set when token ``i`` may be sampled (-1 everywhere: every token), or
      ``None`` for no mask.
  """

  bias_ids_BK: jax.Array
  bias_values_BK: jax.Array
  presence_B: jax.Array
  frequency_B: jax.Array
  repetition_B: jax.Array
  counts_BV: jax.Array | None = None
  prompt_seen_BV: jax.Array | None = None
  allowed_BW: jax.Array | None = None


def add_logit_bias(logits_BV: jax.Array, ids_BK: jax.Array, values_BK: jax.Array) -> jax.Array:
  """``logits_BV`` plus ``values_BK`` at ``ids_BK`` of each row (repeated ids add up; ids
  outside the vocabulary are padding and dropped)."""
  rows_BK = jnp.broadcast_to(jnp.arange(logits_BV.shape[0])[:, None], ids_BK.shape)
  return logits_BV.at[rows_BK, ids_BK].add(values_BK.astype(logits_BV.dtype), mode='drop')


def penalize(logits_BV: jax.Array, counts_BV: jax.Array, prompt_seen_BV: jax.Array,
             presence_B: jax.Array, frequency_B: jax.Array,
             repetition_B: jax.Array) -> jax.Array:
  """Repetition, frequency and presence penalties, as vLLM applies them.

  The repetition penalty ``r`` (HF ``RepetitionPenaltyLogitsProcessor``, from CTRL) acts on
  every token of the prompt or the output: a positive logit is divided by ``r``, a negative
  one multiplied by it. Then OpenAI's rule over the generated tokens only:
  ``logit - count * frequency - (count > 0) * presence``.

  Args:
    logits_BV: ``[B, vocab]`` float32 logits.
    counts_BV: ``[B, vocab]`` int count of each token among the row's generated tokens.
    prompt_seen_BV: ``[B, vocab]`` bool, token in the row's prompt.
    presence_B, frequency_B: ``[B]`` penalties (0: none).
    repetition_B: ``[B]`` penalty ``> 0`` (1: none).

  Returns:
    ``[B, vocab]`` penalised logits.
  """
  generated_BV = counts_BV > 0
  repetition_B1 = repetition_B[:, None]
  repeated_BV = jnp.where(logits_BV > 0, logits_BV / repetition_B1, logits_BV * repetition_B1)
  logits_BV = jnp.where(prompt_seen_BV | generated_BV, repeated_BV, logits_BV)
  return (logits_BV - counts_BV.astype(jnp.float32) * frequency_B[:, None]
          - generated_BV.astype(jnp.float32) * presence_B[:, None])


def unpack_mask(allowed_BW: jax.Array, vocab: int) -> jax.Array:
  """``[B, vocab]`` bool from packed ``[B, W]`` int32 masks (bit ``i % 32`` of word
  ``i // 32`` is token ``i``; ids past ``32 * W`` are not allowed)."""
  bits_BW32 = (allowed_BW[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
  allowed_BV = bits_BW32.reshape(allowed_BW.shape[0], -1).astype(bool)[:, :vocab]
  return jnp.pad(allowed_BV, ((0, 0), (0, vocab - allowed_BV.shape[1])))


def apply_controls(logits_BV: jax.Array, controls: Controls | None) -> jax.Array:
  """``logits_BV`` (as float32) with each row's :class:`Controls` applied; ``None`` or rows
  that use none leave them as they are.

  The penalties' ``[B, vocab]`` work is skipped (``lax.cond``) when no row asks for one.
  """
  logits_BV = logits_BV.astype(jnp.float32)
  if controls is None:
    return logits_BV
  logits_BV = add_logit_bias(logits_BV, controls.bias_ids_BK, controls.bias_values_BK)
  if controls.counts_BV is not None:
    penalised = (jnp.any(controls.presence_B != 0) | jnp.any(controls.frequency_B != 0)
                 | jnp.any(controls.repetition_B != 1))
    logits_BV = jax.lax.cond(
        penalised,
        lambda x: penalize(x, controls.counts_BV, controls.prompt_seen_BV, controls.presence_B,
                           controls.frequency_B, controls.repetition_B),
        lambda x: x, logits_BV)
  if controls.allowed_BW is not None:
    allowed_BV = unpack_mask(controls.allowed_BW, logits_BV.shape[-1])
    logits_BV = jnp.where(allowed_BV, logits_BV, -jnp.inf)
  return logits_BV

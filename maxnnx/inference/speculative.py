"""Speculative decoding for :func:`~maxnnx.inference.generate`: draft, verify, accept.

Each step a drafter proposes ``k`` tokens; the target model scores the row's last token and
the ``k`` drafts in one forward pass over its KV cache (``k + 1`` query tokens at the row's
next positions) and keeps the longest prefix of drafts it agrees with, plus one token of its
own. Greedy decoding then gives exactly the tokens of plain decoding; sampling keeps the
target's distribution by rejection sampling (Leviathan et al., 2023; Chen et al., 2023):
draft ``x`` drawn from ``q`` is kept with probability ``min(1, p(x) / q(x))``, a rejected
one is replaced by a sample of ``max(0, p - q)`` renormalised, and after ``k`` kept drafts
a bonus token comes from ``p``. ``p`` is the target's distribution after temperature,
``top_k`` and ``top_p``, and so is ``q`` for a draft model or the MTP module.

Three drafters:

* :class:`PromptLookup`: the tokens that followed the most recent earlier occurrence of the
  row's last ``n`` tokens in its prompt and output (``n`` from ``max_ngram`` down to
  ``min_ngram``); no model, a point mass ``q``, so a draft ``x`` is kept with probability
  ``p(x)`` and a rejection samples ``p`` without ``x``. Fewer than ``k`` tokens may follow
  the match, or none may match: the missing drafts are never kept and are not counted as
  proposed.
* :class:`DraftModel`: a smaller model with the same vocabulary, with its own KV cache.
* :class:`MTPDraft`: the model's own multi-token-prediction module (DeepSeek V3,
  ``mtp.num_layers >= 1``), fed the model's hidden states, with a KV cache of its own that
  catches up on the kept positions after each verification (:mod:`.mtp_draft`).

Rejected drafts do not corrupt the cache: the cache is indexed by slot and every key carries
its row's segment id and position (see :class:`~maxnnx.kernels.masks.AttentionMask`). After a
step the cache index moves on by the most tokens any running row kept, and in rows that kept
fewer the slots of their rejected drafts get segment id 0, which no query attends to; the
next step writes over the slots past the index. So rows of a batch keep different counts,
at the price of dead slots: a batch of ``B > 1`` rows sizes its cache for ``k + 1`` slots per
generated token in the worst case (one row for one slot per token).

Recurrent layers (Gated DeltaNet, ``layer_types`` ``'linear'``) fold every fed token into a
state that cannot be rolled back; models with them are refused.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.inference.sampling import cut_top_k_top_p


@dataclasses.dataclass(frozen=True)
class PromptLookup:
  """Prompt-lookup (n-gram) drafting: propose what followed the last n-gram before.

  Attributes:
    num_draft_tokens: ``k``, the drafts proposed (and verified in one pass) per step.
    max_ngram: the longest suffix of the row looked up first.
    min_ngram: the shortest suffix tried when the longer ones do not occur earlier.
  """

  num_draft_tokens: int = 4
  max_ngram: int = 3
  min_ngram: int = 1

  def problems(self) -> list[str]:
    """What is wrong with these settings, one phrase per field at fault."""
    problems = []
    if self.num_draft_tokens < 1:
      problems.append(f'num_draft_tokens={self.num_draft_tokens} (need >= 1)')
    if not 1 <= self.min_ngram <= self.max_ngram:
      problems.append(f'min_ngram={self.min_ngram}, max_ngram={self.max_ngram} (need '
                      '1 <= min_ngram <= max_ngram)')
    return problems


@dataclasses.dataclass(frozen=True)
class DraftModel:
  """A smaller model that drafts autoregressively (same vocabulary as the target).

  Attributes:
    model: a :class:`~maxnnx.Transformer` (not modified); it samples its drafts with the
      target's temperature, ``top_k`` and ``top_p``.
    num_draft_tokens: ``k``, the drafts proposed (and verified in one pass) per step.
  """

  model: Any
  num_draft_tokens: int = 4

  def problems(self) -> list[str]:
    """What is wrong with these settings, one phrase per field at fault."""
    if self.num_draft_tokens < 1:
      return [f'num_draft_tokens={self.num_draft_tokens} (need >= 1)']
    return []


@dataclasses.dataclass(frozen=True)
class MTPDraft:
  """The model's multi-token-prediction module 0 drafts (DeepSeek V3; see
  :mod:`maxnnx.inference.mtp_draft`): from the model's hidden state at the row's last
  position and its last token, then chained on its own output for ``k > 1``.

  Attributes:
    num_draft_tokens: ``k``, the drafts proposed (and verified in one pass) per step.
  """

  num_draft_tokens: int = 1

  def problems(self) -> list[str]:
    """What is wrong with these settings, one phrase per field at fault."""
    if self.num_draft_tokens < 1:
      return [f'num_draft_tokens={self.num_draft_tokens} (need >= 1)']
    return []


def check_speculative(speculative, model, *, pixel_values=None, controls=None,
                      longrope_switch=None) -> None:
  """Raise a one-line ``ValueError`` if ``speculative`` cannot decode ``model`` as asked."""
  if not isinstance(speculative, (PromptLookup, DraftModel, MTPDraft)):
    raise ValueError('speculative must be maxnnx.inference.PromptLookup(...), '
                     f'DraftModel(model=...) or MTPDraft(...), got {type(speculative).__name__}.')
  problems = speculative.problems()
  if problems:
    raise ValueError(f"Invalid speculative settings: {', '.join(problems)}.")
  models = [('model', model)]
  if isinstance(speculative, DraftModel):
    models.append(('speculative.model', speculative.model))
    if speculative.model.config.vocab_size != model.config.vocab_size:
      raise ValueError(f'speculative.model has vocab_size {speculative.model.config.vocab_size}'
                       f' but the model has {model.config.vocab_size}; a draft model needs the '
                       'same tokenizer and vocabulary.')
    if pixel_values is not None:
      raise ValueError('pixel_values with a DraftModel: the draft model cannot see the images; '
                       'use PromptLookup or decode without speculative.')
  if isinstance(speculative, MTPDraft):
    _check_mtp(model, pixel_values)
  for name, each in models:
    if 'linear' in each.config.resolved_layer_types:
      raise ValueError(f'{name} ({each.config.family}) has recurrent Gated DeltaNet layers '
                       "(layer_types 'linear') whose state cannot roll back rejected drafts; "
                       'decode it without speculative.')
  if longrope_switch is not None:
    raise ValueError('speculative decoding does not re-encode the cache at the LongRoPE switch; '
                     'keep the prompt plus max_new_tokens within the original context or '
                     'decode without speculative.')
  if controls is not None and (controls.logit_bias or controls.min_tokens
                               or controls.penalized):
    raise ValueError('speculative decoding takes no logit_bias, penalties or min_tokens yet; '
                     'drop them or decode without speculative.')


def _check_mtp(model, pixel_values) -> None:
  """Refuse :class:`MTPDraft` for a model without MTP modules, or with images."""
  if not model.config.mtp.num_layers:
    raise ValueError(f'MTPDraft needs a model with multi-token-prediction modules but this '
                     f'{model.config.family} model has mtp.num_layers=0; use a checkpoint that '
                     'ships them (DeepSeek V3) or PromptLookup / DraftModel.')
  if pixel_values is not None:
    raise ValueError('pixel_values with MTPDraft: the MTP drafter takes text only; use '
                     'PromptLookup or decode without speculative.')


def prompt_lookup_drafts(context_BL: jax.Array, length_B: jax.Array, k: int, max_ngram: int,
                         min_ngram: int) -> tuple[jax.Array, jax.Array]:
  """The ``k`` tokens that followed the most recent earlier match of each row's last n-gram.

  Args:
    context_BL: ``[B, L]`` each row's prompt then generated tokens, from index 0.
    length_B: ``[B]`` tokens of each row in ``context_BL`` (the rest is ignored).
    k: drafts per row.
    max_ngram, min_ngram: the suffix lengths tried, longest first.

  Returns:
    ``(drafts_BK, valid_BK)``: int32 drafts, and whether each is a real proposal (false
    past the row's known tokens, and everywhere when no suffix occurs earlier).
  """
  batch, width = context_BL.shape
  rows_B1 = jnp.arange(batch)[:, None]
  found_B = jnp.zeros((batch,), bool)
  follow_B = jnp.zeros((batch,), jnp.int32)  # index of the first token after the match
  for n in range(max_ngram, min_ngram - 1, -1):
    if n >= width:
      continue
    starts = width - n
    suffix_Bn = context_BL[rows_B1, jnp.clip(length_B[:, None] - n + jnp.arange(n), 0)]
    match_BS = jnp.ones((batch, starts), bool)
    for j in range(n):
      match_BS &= context_BL[:, j:j + starts] == suffix_Bn[:, j:j + 1]
    start_S = jnp.arange(starts)
    # An earlier occurrence, with at least one known token after it.
    match_BS &= start_S[None] + n < length_B[:, None]
    match_BS &= (length_B >= n + 1)[:, None]
    last_B = jnp.max(jnp.where(match_BS, start_S[None], -1), axis=1)
    use_B = ~found_B & (last_B >= 0)
    follow_B = jnp.where(use_B, last_B + n, follow_B)
    found_B |= use_B
  index_BK = follow_B[:, None] + jnp.arange(k)
  valid_BK = found_B[:, None] & (index_BK < length_B[:, None])
  drafts_BK = context_BL[rows_B1, jnp.clip(index_BK, 0, width - 1)]
  return jnp.where(valid_BK, drafts_BK, 0).astype(jnp.int32), valid_BK


def _probs(logits_NV, temperature: float, top_k, top_p):
  """Float32 probabilities after temperature, ``top_k`` and ``top_p`` (rows of ``[N, V]``)."""
  scaled_NV = logits_NV.astype(jnp.float32) / temperature
  if top_k is not None or top_p is not None:
    rows = scaled_NV.shape[0]
    scaled_NV = cut_top_k_top_p(scaled_NV, jnp.full((rows,), top_k or 0, jnp.int32),
                                jnp.full((rows,), 1.0 if top_p is None else top_p, jnp.float32))
  return jax.nn.softmax(scaled_NV, axis=-1)


def _probs_BTV(logits_BTV, sampling):
  b, t, v = logits_BTV.shape
  return _probs(logits_BTV.reshape(b * t, v), *sampling).reshape(b, t, v)


def _pick(key, probs_BV, sampling):
  """One token per row: argmax when greedy, else a sample of ``probs_BV``."""
  if sampling[0] == 0.0:
    return jnp.argmax(probs_BV, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, jnp.log(probs_BV), axis=-1).astype(jnp.int32)


def _leading(accept_BK):
  """Number of leading ``True`` per row."""
  return jnp.sum(jnp.cumprod(accept_BK.astype(jnp.int32), axis=1), axis=1)


def accept_greedy(target_BT: jax.Array, drafts_BK: jax.Array, valid_BK: jax.Array) -> jax.Array:
  """Drafts kept per row under greedy decoding: the longest prefix equal to the target's
  argmax at the positions before them (``target_BT``: ``[B, k + 1]``, the last one the bonus
  token's). The row's output is then ``target_BT`` up to and including index ``kept``."""
  k = drafts_BK.shape[1]
  return _leading(valid_BK & (drafts_BK == target_BT[:, :k]))


def accept_sampled(p_BTV: jax.Array, drafts_BK: jax.Array, valid_BK: jax.Array,
                   u_BK: jax.Array, q_BKV: jax.Array | None = None):
  """The rejection-sampling rule: drafts kept per row, and the distribution of the token
  that follows them.

  Draft ``x`` drawn from ``q`` is kept while ``u < p(x) / q(x)`` (``q`` a point mass when
  ``q_BKV`` is ``None``, as for prompt lookup: the ratio is ``p(x)``). After a rejection the
  next token comes from ``max(0, p - q)`` renormalised (``p`` without ``x`` for a point
  mass); after ``k`` kept drafts, or at an invalid draft (never proposed), from ``p``.

  Args:
    p_BTV: ``[B, k + 1, V]`` the target's probabilities at the row's last token and each draft.
    drafts_BK: ``[B, k]`` the drafts.
    valid_BK: ``[B, k]`` whether each draft was proposed (only leading ones may be).
    u_BK: ``[B, k]`` uniform samples in ``[0, 1)``.
    q_BKV: ``[B, k, V]`` the drafter's distributions, or ``None`` (point masses).

  Returns:
    ``(kept_B, dist_BV)``: drafts kept, and the normalised distribution of the next token.
  """
  batch, k = drafts_BK.shape
  rows_B = jnp.arange(batch)
  p_BK = jnp.take_along_axis(p_BTV[:, :k], drafts_BK[..., None], axis=-1)[..., 0]
  if q_BKV is None:
    ratio_BK = p_BK
  else:
    ratio_BK = p_BK / jnp.take_along_axis(q_BKV, drafts_BK[..., None], axis=-1)[..., 0]
  kept_B = _leading(valid_BK & (u_BK < ratio_BK))
  p_BV = p_BTV[rows_B, kept_B]
  at_B = jnp.minimum(kept_B, k - 1)
  rejected_B = (kept_B < k) & valid_BK[rows_B, at_B]
  if q_BKV is None:
    residual_BV = p_BV.at[rows_B, drafts_BK[rows_B, at_B]].set(0.0)
  else:
    residual_BV = jnp.maximum(p_BV - q_BKV[rows_B, at_B], 0.0)
  residual_ok_B = jnp.sum(residual_BV, axis=-1) > 0
  dist_BV = jnp.where((rejected_B & residual_ok_B)[:, None], residual_BV, p_BV)
  return kept_B, dist_BV / jnp.sum(dist_BV, axis=-1, keepdims=True)


def drafts_then(drafts_BK: jax.Array, kept_B: jax.Array, new_B: jax.Array) -> jax.Array:
  """``[B, k + 1]``: each row's kept drafts, then ``new_B`` (the rest repeats it)."""
  batch, k = drafts_BK.shape
  padded_BT = jnp.concatenate([drafts_BK, jnp.zeros((batch, 1), drafts_BK.dtype)], axis=1)
  return jnp.where(jnp.arange(k + 1)[None] < kept_B[:, None], padded_BT, new_B[:, None])


def _kill_slots(model, start, keep_B, advance):
  """Give segment id 0 to each row's slots ``start + keep_B + 1 .. start + advance - 1``: its
  rejected drafts below the new cache index (those past it are written over next step)."""
  segments_BS = model.cache_segment_ids[...]
  slot_S = jnp.arange(segments_BS.shape[1])
  dead_BS = (slot_S[None] > start + keep_B[:, None]) & (slot_S[None] < start + advance)
  model.cache_segment_ids[...] = jnp.where(dead_BS, 0, segments_BS)


def _draft_with_model(graphdef, params, cache, prev_B, last_B, pos_B, k, sampling, key):
  """``k`` drafts of the draft model, fed ``[prev, last]`` then its own drafts.

  Returns drafts ``[B, k]``, their distributions ``[B, k, V]`` (``None`` when greedy), the
  model after feeding (its cache advanced by ``k + 1``) and the cache index before.
  """
  model = nnx.merge(graphdef, params, cache)
  start = model.cache_index[...]
  chunk_BT = jnp.stack([prev_B, last_B], axis=1)
  positions_BT = pos_B[:, None] + jnp.array([-1, 0], jnp.int32)
  drafts, dists = [], []
  for i in range(k):
    logits_BV = model(chunk_BT, segment_ids=jnp.ones(chunk_BT.shape, jnp.int32),
                      positions=positions_BT, decode=True)[:, -1].astype(jnp.float32)
    if sampling[0] == 0.0:
      token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    else:
      probs_BV = _probs(logits_BV, *sampling)
      token_B = _pick(jax.random.fold_in(key, i), probs_BV, sampling)
      dists.append(probs_BV)
    drafts.append(token_B)
    if i + 1 < k:
      chunk_BT = token_B[:, None]
      positions_BT = (pos_B + i + 1)[:, None]
  return (jnp.stack(drafts, axis=1), jnp.stack(dists, axis=1) if dists else None, model,
          start)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def speculative_decode(graphdef, draft_graphdef, settings, sampling, max_new_tokens, params,
                       draft_params, cache, first_logits_BV, draft_cache, context_BL,
                       lengths_B, eos_ids, key):
  """Generate up to ``max_new_tokens`` per row after a prefill, speculatively.

  Args:
    graphdef, params, cache: the target model split as :func:`generate` splits it, its
      cache holding the left-padded prompts (index at their width).
    draft_graphdef, draft_params, draft_cache: the draft model likewise, its cache index
      set back by one (its last prompt slot is written again), or ``None`` (prompt lookup).
    settings: ``(k, max_ngram, min_ngram)``.
    sampling: ``(temperature, top_k, top_p)``.
    max_new_tokens: tokens to generate per row at most.
    first_logits_BV: the target's logits after each prompt.
    context_BL: ``[B, L]`` each row's prompt from index 0 (room for the output after it).
    lengths_B: ``[B]`` prompt lengths.
    eos_ids: ``[E]`` ids that end a row.
    key: the sampling key.

  Returns:
    ``(tokens, logprobs, accepted, proposed)``: ``[B, max_new_tokens + k + 1]`` tokens (a
    row may run past its end-of-sequence id or ``max_new_tokens``; the caller cuts),
    their log-probabilities under ``log_softmax(logits / temperature)``, and the numbers
    of drafts kept and proposed.
  """
  k = settings[0]
  batch = first_logits_BV.shape[0]
  greedy = sampling[0] == 0.0
  buffer = max_new_tokens + k + 1
  rows_B = jnp.arange(batch)
  key, first_key = jax.random.split(key)
  first_logits_BV = first_logits_BV.astype(jnp.float32)
  first_B = (jnp.argmax(first_logits_BV, axis=-1).astype(jnp.int32) if greedy
             else _pick(first_key, _probs(first_logits_BV, *sampling), sampling))
  tokens_BN = jnp.zeros((batch, buffer), jnp.int32).at[:, 0].set(first_B)
  logprobs_BN = jnp.zeros((batch, buffer), jnp.float32).at[:, 0].set(
      _logprobs(first_logits_BV[:, None], first_B[:, None], sampling[0] or 1.0)[:, 0])
  context_BL = context_BL.at[rows_B, lengths_B].set(first_B)
  done_B = jnp.isin(first_B, eos_ids) | (max_new_tokens <= 1)
  prev_B = context_BL[rows_B, lengths_B - 1]
  zero = jnp.zeros((), jnp.int32)
  carry = (jnp.ones((batch,), jnp.int32), prev_B, first_B, lengths_B, context_BL, tokens_BN,
           logprobs_BN, done_B, cache, draft_cache, key, zero, zero)

  def cond(carry):
    return ~jnp.all(carry[7])

  body = functools.partial(_round, (graphdef, params), (draft_graphdef, draft_params), settings,
                           sampling, max_new_tokens, eos_ids)
  carry = jax.lax.while_loop(cond, body, carry)
  return carry[5], carry[6], carry[11], carry[12]


def _round(target, draft, settings, sampling, max_new_tokens, eos_ids, carry):
  """One step of :func:`speculative_decode`'s loop: draft ``k`` tokens per row, verify
  them in one target pass, write the kept tokens and move both caches on.

  ``target`` / ``draft``: ``(graphdef, params)`` of each model (the draft's ``(None, None)``
  for prompt lookup); ``carry``: the loop state, returned updated.
  """
  graphdef, params = target
  draft_graphdef, draft_params = draft
  k, max_ngram, min_ngram = settings
  (count_B, prev_B, last_B, pos_B, context_BL, tokens_BN, logprobs_BN, done_B, cache,
   draft_cache, key, accepted, proposed) = carry
  batch = last_B.shape[0]
  rows_B = jnp.arange(batch)
  steps_T = jnp.arange(k + 1)
  key, draft_key, accept_key, pick_key = jax.random.split(key, 4)
  q_BKV = None
  if draft_graphdef is None:
    drafts_BK, valid_BK = prompt_lookup_drafts(context_BL, pos_B + 1, k, max_ngram, min_ngram)
  else:
    drafts_BK, q_BKV, draft_model, draft_start = _draft_with_model(
        draft_graphdef, draft_params, draft_cache, prev_B, last_B, pos_B, k, sampling,
        draft_key)
    valid_BK = jnp.ones((batch, k), bool)
  model = nnx.merge(graphdef, params, cache)
  start = model.cache_index[...]
  logits_BTV, kept_B, out_BT = _verify(model, last_B, drafts_BK, valid_BK, q_BKV, pos_B,
                                       sampling, (accept_key, pick_key))
  running_B = ~done_B
  keep_BT = (steps_T[None] <= kept_B[:, None]) & running_B[:, None]
  tokens_BN, logprobs_BN, context_BL = _write_kept(
      (tokens_BN, logprobs_BN, context_BL), out_BT,
      _logprobs(logits_BTV, out_BT, sampling[0] or 1.0), keep_BT, count_B, pos_B)
  ended_B = jnp.any(keep_BT & jnp.isin(out_BT, eos_ids), axis=1)
  gained_B = jnp.where(running_B, kept_B + 1, 0)
  advance = jnp.max(gained_B)
  _advance(model, start, kept_B, advance)
  if draft_graphdef is not None:
    _advance(draft_model, draft_start, kept_B, advance)
    draft_cache = nnx.state(draft_model, nnx.Not(nnx.Param))
  new_last_B = out_BT[rows_B, kept_B]
  new_prev_B = jnp.where(kept_B > 0, out_BT[rows_B, jnp.maximum(kept_B - 1, 0)], last_B)
  count_B = count_B + gained_B
  done_B = done_B | ended_B | (count_B >= max_new_tokens)
  accepted = accepted + jnp.sum(jnp.where(running_B, kept_B, 0))
  proposed = proposed + jnp.sum(jnp.where(running_B, valid_BK.sum(axis=1), 0))
  return (count_B, jnp.where(running_B, new_prev_B, prev_B),
          jnp.where(running_B, new_last_B, last_B), pos_B + gained_B, context_BL, tokens_BN,
          logprobs_BN, done_B, nnx.state(model, nnx.Not(nnx.Param)), draft_cache, key,
          accepted, proposed)


def _logprobs(logits_BTV, tokens_BT, temperature):
  """``log_softmax(logits / temperature)`` at ``tokens_BT``."""
  scaled_BTV = logits_BTV / temperature
  return (jnp.take_along_axis(scaled_BTV, tokens_BT[..., None], axis=-1)[..., 0]
          - jax.nn.logsumexp(scaled_BTV, axis=-1))


def _verify(model, last_B, drafts_BK, valid_BK, q_BKV, pos_B, sampling, keys):
  """One target call on each row's last token and its ``k`` drafts, and what it keeps.

  Returns ``(logits_BTV, kept_B, out_BT)``: the target's float32 logits at the ``k + 1``
  places, the number of drafts each row keeps, and the row's tokens (the kept drafts, then
  the target's own choice after them).
  """
  k = drafts_BK.shape[1]
  inputs_BT = jnp.concatenate([last_B[:, None], drafts_BK], axis=1)
  logits_BTV = model(inputs_BT, segment_ids=jnp.ones(inputs_BT.shape, jnp.int32),
                     positions=pos_B[:, None] + jnp.arange(k + 1),
                     decode=True).astype(jnp.float32)
  return accept_step(logits_BTV, drafts_BK, valid_BK, q_BKV, sampling, keys)


def accept_step(logits_BTV, drafts_BK, valid_BK, q_BKV, sampling, keys):
  """What a step keeps from the target's float32 logits ``[B, k + 1, V]`` at the row's last
  token and its drafts: ``(logits_BTV, kept_B, out_BT)`` as :func:`_verify` returns them
  (``keys``: the acceptance and the pick keys, unused when greedy)."""
  batch, k = drafts_BK.shape
  if sampling[0] == 0.0:
    target_BT = jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
    return logits_BTV, accept_greedy(target_BT, drafts_BK, valid_BK), target_BT
  accept_key, pick_key = keys
  u_BK = jax.random.uniform(accept_key, (batch, k))
  kept_B, dist_BV = accept_sampled(_probs_BTV(logits_BTV, sampling), drafts_BK, valid_BK,
                                   u_BK, q_BKV)
  return logits_BTV, kept_B, drafts_then(drafts_BK, kept_B, _pick(pick_key, dist_BV, sampling))


def _advance(model, start, kept_B, advance) -> None:
  """Move a cache's index ``advance`` slots past ``start``, where a step began.

  Rows that kept fewer drafts than the most keep dead slots below the new index; they are
  killed. With one row there are none: the next step's ``k + 1`` writes cover every rejected
  slot.
  """
  if kept_B.shape[0] > 1:
    _kill_slots(model, start, kept_B, advance)
  model.cache_index[...] = start + advance


def _write_kept(buffers, out_BT, logprobs_BT, keep_BT, count_B, pos_B):
  """Each row's kept tokens written after its last: into the output tokens and their
  log-probabilities (at ``count_B``) and into the context (after ``pos_B``).

  ``buffers`` is ``(tokens_BN, logprobs_BN, context_BL)``; the new three are returned.
  """
  tokens_BN, logprobs_BN, context_BL = buffers
  rows_B1 = jnp.arange(out_BT.shape[0])[:, None]
  steps_T = jnp.arange(out_BT.shape[1])
  index_BT = jnp.where(keep_BT, count_B[:, None] + steps_T, tokens_BN.shape[1])
  tokens_BN = tokens_BN.at[rows_B1, index_BT].set(out_BT, mode='drop')
  logprobs_BN = logprobs_BN.at[rows_B1, index_BT].set(logprobs_BT, mode='drop')
  context_index_BT = jnp.where(keep_BT, pos_B[:, None] + 1 + steps_T, context_BL.shape[1])
  return tokens_BN, logprobs_BN, context_BL.at[rows_B1, context_index_BT].set(out_BT,
                                                                             mode='drop')


def cache_slots(width: int, max_new_tokens: int, k: int, batch: int) -> int:
  """KV-cache slots speculative decoding needs: the prompt, the output and one step's
  drafts; a batch of several rows may leave ``k`` dead slots per token (see the module)."""
  if batch == 1:
    return width + max_new_tokens + k + 1
  return width + max_new_tokens * (k + 1) + 1

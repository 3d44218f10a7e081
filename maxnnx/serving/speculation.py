"""Speculative decoding in the engine: prompt-lookup drafts, and their verification in the
model step (whoever drafted them: :mod:`maxnnx.serving.drafters`).

With ``EngineConfig.speculative_method='ngram'``, before each step the engine gives every
decoding request that may draft up to ``num_speculative_tokens`` draft tokens
(:func:`ngram_drafts`: what followed the latest earlier occurrence of the request's last
``n`` tokens in its own prompt and output, ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``). The scheduler counts them in the token budget and reserves their
pages, so the step computes the row's last token and its drafts together, ``k + 1`` query
tokens through the paged cache like a short prefill chunk, and the model step returns the
logits at each of them (``[max_batch, k + 1, vocab]``). :func:`verify` then keeps the longest
prefix of drafts the model agrees with and one token of its own, with the rule of
:mod:`maxnnx.inference.speculative` (greedy: argmax equality, so the tokens are those of
plain decoding; sampled: rejection sampling, so they keep the model's distribution). The
keys and values of rejected drafts sit past the request's computed tokens: the next step
writes over them, and the pages that hold only them go back to the pool at once.

Every request may draft. The verifier applies each request's controls at every position,
as the sampler does for one token: temperature, ``top_k``, ``top_p``, logit bias,
``min_tokens`` (its stop ids masked at each position still short of it), the penalties
(over its token counts plus the drafts before the position; the kept tokens then join the
sampler's counts) and its grammar (the tokens the matcher allows at each position, found by
walking the matcher through the drafts on the host and rolling it back). It returns the
log-probabilities of every kept token. Drafts never run past the request's ``max_tokens``
or ``max_model_len``, and the engine applies the stop rules to the kept tokens one at a
time, so a request emits nothing after its stop.
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxnnx.inference.sampling import (
  add_logit_bias,
  cut_top_k_top_p,
  penalize,
  row_keys,
  unpack_mask,
)
from maxnnx.inference.speculative import accept_greedy, accept_sampled, drafts_then
from maxnnx.inference.structured import mask_words
from maxnnx.processes import host_value
from maxnnx.serving.batch_sampler import BatchSampler, bias_bucket
from maxnnx.serving.params import TokenLogprobs


def ngram_drafts(token_ids: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
  """Up to ``k`` tokens that followed the latest earlier occurrence of the last ``n`` tokens of
  ``token_ids`` (``n`` from ``max_ngram`` down to ``min_ngram``); ``[]`` when none occurs.

  The same proposal as :func:`maxnnx.inference.speculative.prompt_lookup_drafts`, on the host
  for one request of any length.
  """
  ids = np.asarray(token_ids)
  length = len(ids)
  for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
    # Windows starting before length - n: each has at least one token after it.
    windows_SN = np.lib.stride_tricks.sliding_window_view(ids[:length - 1], n)
    hits = np.flatnonzero((windows_SN == ids[length - n:]).all(axis=1))
    if hits.size:
      start = int(hits[-1]) + n
      return ids[start:start + k].tolist()
  return []


@dataclasses.dataclass
class SpecCounts:
  """What speculative decoding did so far (``/metrics``' ``spec_decode`` counters).

  Attributes:
    drafts: verifications run (one per request and step with at least one draft).
    draft_tokens: draft tokens verified.
    accepted_tokens: draft tokens the model kept (before stop rules cut a request's output).
    accepted_per_position: of those, how many at each draft position.
  """

  drafts: int = 0
  draft_tokens: int = 0
  accepted_tokens: int = 0
  accepted_per_position: list[int] = dataclasses.field(default_factory=list)

  @property
  def acceptance_rate(self) -> float:
    """Accepted over drafted tokens (0 before any draft)."""
    return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

  def record(self, num_drafts: int, kept: int) -> None:
    """Count one verification of ``num_drafts`` drafts of which the first ``kept`` stayed."""
    if len(self.accepted_per_position) < num_drafts:
      self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
    self.drafts += 1
    self.draft_tokens += num_drafts
    self.accepted_tokens += kept
    for position in range(kept):
      self.accepted_per_position[position] += 1


@functools.partial(jax.jit, static_argnames=('num_logprobs',), donate_argnames=('counts_SV',))
def verify(logits_BSV, drafts_BK, num_drafts_B, temperature_B, top_k_B, top_p_B, seeds_B,
           counters_B, bias_ids_BSK=None, bias_values_BSK=None, logprob_temperature_B=None,
           penalties=None, counts_SV=None, allowed_BSW=None, num_logprobs: int = 0):
  """Each row's kept drafts and the token after them.

  Args:
    logits_BSV: ``[B, k + 1, V]`` the model's logits at each row's last token and its drafts.
    drafts_BK: ``[B, k]`` the drafts (past ``num_drafts_B``: ignored).
    num_drafts_B: ``[B]`` drafts of each row (0: nothing to verify).
    temperature_B, top_k_B, top_p_B: ``[B]`` each row's sampling (temperature 0: greedy).
    seeds_B, counters_B: ``[B]`` each row's seed and output length: its keys.
    bias_ids_BSK, bias_values_BSK: ``[B, k + 1, K]`` the logit bias of each row's token at
      each position (ids ``>= V`` are padding; ``None``: none), applied before verifying.
    logprob_temperature_B: ``[B]`` the log-probabilities' temperature (1: the model's own).
    penalties: ``(prompt_seen_SV, rows_B, presence_B, frequency_B, repetition_B)``, with
      ``counts_SV``: the sampler's token counts (:class:`BatchSampler`), each row's row of
      them (0: none) and its penalties, applied at each position to the counts with the
      drafts before it added; ``None``: no penalties.
    counts_SV: the sampler's token counts (donated), or ``None`` with ``penalties``.
    allowed_BSW: ``[B, k + 1, words]`` packed masks of the tokens each row's grammar allows at
      each position (-1: every token; ``None``: no masks).
    num_logprobs: the top log-probabilities returned per position (0: none).

  Returns:
    ``(tokens_BS, kept_B, chosen_BS, top_ids_BSN, top_lps_BSN, counts_SV)``: row ``b``
    emits ``tokens_BS[b, :kept_B[b] + 1]``; with ``num_logprobs``, each token's
    log-probability (of the model's logits, before the controls) and the top ones at each
    position, else ``None``; the counts with each penalised row's emitted tokens added.
  """
  batch, width, vocab = logits_BSV.shape
  k = width - 1
  raw_BSV = logits_BSV.astype(jnp.float32)
  logits_BSV = raw_BSV
  if bias_ids_BSK is not None:
    logits_BSV = add_logit_bias(raw_BSV.reshape(batch * width, vocab),
                                bias_ids_BSK.reshape(batch * width, -1),
                                bias_values_BSK.reshape(batch * width, -1)).reshape(raw_BSV.shape)
  valid_BK = jnp.arange(k)[None] < num_drafts_B[:, None]
  if penalties is not None:
    logits_BSV = _penalize_positions(logits_BSV, drafts_BK, valid_BK, counts_SV, *penalties)
  if allowed_BSW is not None:
    allowed_BSV = unpack_mask(allowed_BSW.reshape(batch * width, -1), vocab).reshape(
        logits_BSV.shape)
    logits_BSV = jnp.where(allowed_BSV, logits_BSV, -jnp.inf)
  target_BS = jnp.argmax(logits_BSV, axis=-1).astype(jnp.int32)
  greedy_B = temperature_B <= 0

  def sampled(_):
    scaled_BSV = logits_BSV / jnp.where(greedy_B, 1.0, temperature_B)[:, None, None]
    cut_NV = cut_top_k_top_p(scaled_BSV.reshape(batch * width, vocab),
                             jnp.repeat(top_k_B, width), jnp.repeat(top_p_B, width))
    p_BSV = jax.nn.softmax(cut_NV, axis=-1).reshape(batch, width, vocab)
    keys_B = row_keys(seeds_B, counters_B)
    u_BK = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1), (k,)))(keys_B)
    kept_B, dist_BV = accept_sampled(p_BSV, drafts_BK, valid_BK, u_BK)
    pick_B = jax.vmap(lambda key: jax.random.fold_in(key, 2))(keys_B)
    new_B = jax.vmap(jax.random.categorical)(pick_B, jnp.log(dist_BV)).astype(jnp.int32)
    return drafts_then(drafts_BK, kept_B, new_B), kept_B

  def greedy(_):
    return target_BS, jnp.zeros(batch, jnp.int32)

  sampled_BS, sampled_kept_B = jax.lax.cond(jnp.any(~greedy_B), sampled, greedy, None)
  kept_B = jnp.where(greedy_B, accept_greedy(target_BS, drafts_BK, valid_BK), sampled_kept_B)
  tokens_BS = jnp.where(greedy_B[:, None], target_BS, sampled_BS)
  if penalties is not None:  # the emitted tokens join the penalised rows' counts
    rows_B = penalties[1]
    emitted_BS = (jnp.arange(width)[None] <= kept_B[:, None]) & (rows_B > 0)[:, None]
    counts_SV = counts_SV.at[rows_B[:, None], tokens_BS].add(emitted_BS.astype(jnp.int32))
  if not num_logprobs:
    return tokens_BS, kept_B, None, None, None, counts_SV
  logprobs_BSV = jax.nn.log_softmax(raw_BSV / logprob_temperature_B[:, None, None], axis=-1)
  chosen_BS = jnp.take_along_axis(logprobs_BSV, tokens_BS[..., None], axis=-1)[..., 0]
  top_lps_BSN, top_ids_BSN = jax.lax.top_k(logprobs_BSV, num_logprobs)
  return tokens_BS, kept_B, chosen_BS, top_ids_BSN, top_lps_BSN, counts_SV


def _penalize_positions(logits_BSV, drafts_BK, valid_BK, counts_SV, prompt_seen_SV, rows_B,
                        presence_B, frequency_B, repetition_B):
  """``logits_BSV`` with each row's penalties at each position, over its counts plus the
  drafts before that position (skipped by ``lax.cond`` when no row is penalised)."""
  batch, width, vocab = logits_BSV.shape

  def penalized(x_BSV):
    drafted_BKV = jax.nn.one_hot(drafts_BK, vocab, dtype=jnp.int32) * valid_BK[..., None]
    before_BSV = jnp.concatenate([jnp.zeros((batch, 1, vocab), jnp.int32),
                                  jnp.cumsum(drafted_BKV, axis=1)], axis=1)
    counts_BSV = counts_SV[rows_B][:, None] + before_BSV
    seen_BSV = jnp.broadcast_to(prompt_seen_SV[rows_B][:, None], counts_BSV.shape)
    flat = (lambda a: a.reshape(batch * width, *a.shape[2:]))
    every = (lambda a_B: jnp.repeat(a_B, width))
    return penalize(flat(x_BSV), flat(counts_BSV), flat(seen_BSV), every(presence_B),
                    every(frequency_B), every(repetition_B)).reshape(x_BSV.shape)

  any_B = (presence_B != 0) | (frequency_B != 0) | (repetition_B != 1)
  return jax.lax.cond(jnp.any(any_B & (rows_B > 0)), penalized, lambda x: x, logits_BSV)


@dataclasses.dataclass
class Verified:
  """One verification's results on the host (:func:`verify_rows`).

  Attributes:
    tokens_BS: each row's kept drafts, then its own token (``[B, k + 1]``).
    kept_B: the drafts each row kept.
    chosen_BS: each token's log-probability, or ``None`` when no row asked for them.
    top_ids_BSN, top_lps_BSN: the most likely ids at each position and their
      log-probabilities, or ``None``.
  """

  tokens_BS: np.ndarray
  kept_B: np.ndarray
  chosen_BS: np.ndarray | None = None
  top_ids_BSN: np.ndarray | None = None
  top_lps_BSN: np.ndarray | None = None

  def tokens(self, row: int) -> list[int]:
    """What row ``row`` emits: its kept drafts and the token after them."""
    return self.tokens_BS[row, :int(self.kept_B[row]) + 1].tolist()

  def logprobs(self, row: int, position: int,
               num: int | None) -> tuple[TokenLogprobs, ...] | None:
    """The token at ``position`` of row ``row`` with its log-probability and ``num`` top
    ones (``None``: none asked), as :meth:`Sampled.logprobs` gives a sampled token's."""
    if num is None:
      return None
    top = tuple(zip(self.top_ids_BSN[row, position, :num].tolist(),
                    self.top_lps_BSN[row, position, :num].tolist()))
    return (TokenLogprobs(int(self.tokens_BS[row, position]),
                          float(self.chosen_BS[row, position]), top),)


def propose_drafts(running, k: int, max_model_len: int, lookup_max: int,
                   lookup_min: int) -> None:
  """Set each ``running`` request's ``draft_ids`` for the next step: its n-gram drafts if it
  decodes, as many (up to ``k``) as its ``max_tokens`` and ``max_model_len`` leave room for
  after the model's own token; else none."""
  for request in running:
    room = min(k, request.params.max_tokens - len(request.output_ids) - 1,
               max_model_len - request.num_tokens)
    decoding = request.num_computed == request.num_tokens - 1
    request.draft_ids = (ngram_drafts(request.token_ids, room, lookup_max, lookup_min)
                         if decoding and room > 0 else [])


def verify_rows(logits_BSV, requests, sampler: BatchSampler, k: int) -> Verified | None:
  """:func:`verify` on the host for a step's ``requests`` (row by row; the rest of the
  sampler's ``max_batch`` rows are padding), with each request's sampling settings and, at
  each draft position, its logit bias and ``min_tokens`` (:meth:`BatchSampler.bias_entries`),
  penalties (:meth:`BatchSampler.penalty_counts`) and grammar
  (:meth:`BatchSampler.draft_masks`), and log-probabilities; ``None`` when no request has
  drafts."""
  if not any(request.draft_ids for request in requests):
    return None
  rows, vocab = sampler.max_batch, sampler.vocab_size
  drafts_BK, num_drafts_B = np.zeros((rows, k), np.int32), np.zeros(rows, np.int32)
  allowed_BSW = np.full((rows, k + 1, mask_words(vocab)), -1, np.int32)
  for row, request in enumerate(requests):
    drafts = request.draft_ids
    drafts_BK[row, :len(drafts)], num_drafts_B[row] = drafts, len(drafts)
    if drafts:
      allowed_BSW[row] = sampler.draft_masks(request, k)
  temperature_B, top_k_B, top_p_B, seeds_B, counters_B, logprob_temperature_B = (
      sampler.row_inputs([(request, 0) for request in requests]))
  num_logprobs = (max(sampler.max_logprobs, 1) if any(
      r.draft_ids and r.params.logprobs is not None for r in requests) else 0)
  counts_SV, prompt_seen_SV, rows_B = sampler.penalty_counts(requests)
  drafting_B = np.zeros(rows, bool)
  drafting_B[:len(requests)] = [bool(r.draft_ids) for r in requests]
  rows_B = np.where(drafting_B, rows_B, 0)  # the sampler counts the rows without drafts
  *out, counts_SV = verify(
      logits_BSV, drafts_BK, num_drafts_B, temperature_B, top_k_B, top_p_B, seeds_B,
      counters_B, *_bias_inputs(requests, sampler, k), logprob_temperature_B,
      _penalty_inputs(requests, rows, prompt_seen_SV, rows_B), counts_SV, allowed_BSW,
      num_logprobs=num_logprobs)
  sampler.keep_counts(counts_SV)
  return Verified(*(None if a is None else np.asarray(host_value(a)) for a in out))


def _bias_inputs(requests, sampler: BatchSampler, k: int) -> tuple:
  """:func:`verify`'s ``(bias_ids_BSK, bias_values_BSK)``: each drafting row's bias pairs at
  each position, in a width among the sampler's (:func:`bias_bucket`)."""
  rows, vocab = sampler.max_batch, sampler.vocab_size
  entries = [[sampler.bias_entries(request, ahead) for ahead in range(k + 1)]
             if request.draft_ids else [] for request in requests]
  width = bias_bucket(max((len(e) for row in entries for e in row), default=0), vocab)
  ids_BSK = np.full((rows, k + 1, width), vocab, np.int32)  # ids >= vocab are padding
  values_BSK = np.zeros((rows, k + 1, width), np.float32)
  for row, positions in enumerate(entries):
    for position, pairs in enumerate(positions):
      if pairs:
        ids_BSK[row, position, :len(pairs)], values_BSK[row, position, :len(pairs)] = (
            zip(*pairs))
  return ids_BSK, values_BSK


def _penalty_inputs(requests, rows: int, prompt_seen_SV, rows_B) -> tuple:
  """:func:`verify`'s ``penalties`` for ``requests`` (the rest of ``rows`` padding)."""
  presence_B, frequency_B = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
  repetition_B = np.ones(rows, np.float32)
  for row, request in enumerate(requests):
    params = request.params
    presence_B[row], frequency_B[row] = params.presence_penalty, params.frequency_penalty
    repetition_B[row] = params.repetition_penalty
  return prompt_seen_SV, rows_B, presence_B, frequency_B, repetition_B


def warm_verify(logits_BSV, sampler: BatchSampler) -> int:
  """Compile :func:`verify` for these logits' shape in each of the sampler's variants
  (log-probabilities or not, times the logit-bias width; no row keeps anything); returns
  how many programs that is."""
  batch, width, vocab = logits_BSV.shape
  zeros_B = np.zeros(batch, np.int32)
  counts_SV, prompt_seen_SV, rows_B = sampler.penalty_counts([])
  for num_logprobs, bias_width in sampler.variants():
    *out, counts_SV = verify(
        logits_BSV, np.zeros((batch, width - 1), np.int32), zeros_B,
        np.zeros(batch, np.float32), zeros_B, np.ones(batch, np.float32), zeros_B, zeros_B,
        np.full((batch, width, bias_width), vocab, np.int32),
        np.zeros((batch, width, bias_width), np.float32), np.ones(batch, np.float32),
        _penalty_inputs([], batch, prompt_seen_SV, rows_B), counts_SV,
        np.full((batch, width, mask_words(vocab)), -1, np.int32), num_logprobs=num_logprobs)
    jax.block_until_ready(out[0])
  sampler.keep_counts(counts_SV)
  return len(sampler.variants())

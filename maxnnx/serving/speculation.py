"""Speculative decoding in the engine: draft on the host, verify in the model step.

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

A request drafts only when nothing but temperature, ``top_k`` and ``top_p`` shapes its
tokens: logit bias, penalties, ``min_tokens``, log-probabilities and structured outputs
decode one token per step as before, in the same batch. Drafts never run past the
request's ``max_tokens`` or ``max_model_len``, and the engine applies the stop rules to the
kept tokens one at a time, so a request emits nothing after its stop.
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxnnx.inference.sampling import cut_top_k_top_p, row_keys
from maxnnx.inference.speculative import accept_greedy, accept_sampled, drafts_then
from maxnnx.processes import host_value
from maxnnx.serving.params import SamplingParams


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


def may_draft(params: SamplingParams) -> bool:
  """Whether a request with ``params`` drafts: only temperature, top-k and top-p shape its
  tokens (the verifier applies no other control)."""
  return not (params.structured is not None or params.logit_bias or params.penalized
              or params.min_tokens or params.logprobs is not None)


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


@jax.jit
def verify(logits_BSV, drafts_BK, num_drafts_B, temperature_B, top_k_B, top_p_B, seeds_B,
           counters_B):
  """Each row's kept drafts and the token after them.

  Args:
    logits_BSV: ``[B, k + 1, V]`` the model's logits at each row's last token and its drafts.
    drafts_BK: ``[B, k]`` the drafts (past ``num_drafts_B``: ignored).
    num_drafts_B: ``[B]`` drafts of each row (0: nothing to verify).
    temperature_B, top_k_B, top_p_B: ``[B]`` each row's sampling (temperature 0: greedy).
    seeds_B, counters_B: ``[B]`` each row's seed and output length: its keys.

  Returns:
    ``(tokens_BS, kept_B)``: row ``b`` emits ``tokens_BS[b, :kept_B[b] + 1]``.
  """
  batch, width, vocab = logits_BSV.shape
  k = width - 1
  logits_BSV = logits_BSV.astype(jnp.float32)
  valid_BK = jnp.arange(k)[None] < num_drafts_B[:, None]
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
  return jnp.where(greedy_B[:, None], target_BS, sampled_BS), kept_B


def propose_drafts(running, k: int, max_model_len: int, lookup_max: int,
                   lookup_min: int) -> None:
  """Set each ``running`` request's ``draft_ids`` for the next step: its n-gram drafts if it
  decodes and :func:`may_draft`, as many (up to ``k``) as its ``max_tokens`` and
  ``max_model_len`` leave room for after the model's own token; else none."""
  for request in running:
    room = min(k, request.params.max_tokens - len(request.output_ids) - 1,
               max_model_len - request.num_tokens)
    decoding = request.num_computed == request.num_tokens - 1
    request.draft_ids = (ngram_drafts(request.token_ids, room, lookup_max, lookup_min)
                         if decoding and room > 0 and may_draft(request.params) else [])


def verify_rows(logits_BSV, requests, rows: int, k: int):
  """``(tokens [B, k + 1], kept [B])`` on the host for a step's ``requests`` (row by row, the
  rest of the ``rows`` padding), verified by :func:`verify` with each request's sampling
  settings; ``None`` when no request has drafts."""
  if not any(request.draft_ids for request in requests):
    return None
  drafts_BK, num_drafts_B = np.zeros((rows, k), np.int32), np.zeros(rows, np.int32)
  temperature_B, top_p_B = np.zeros(rows, np.float32), np.ones(rows, np.float32)
  top_k_B, seeds_B, counters_B = (np.zeros(rows, np.int32) for _ in range(3))
  for row, request in enumerate(requests):
    params, drafts = request.params, request.draft_ids
    drafts_BK[row, :len(drafts)], num_drafts_B[row] = drafts, len(drafts)
    temperature_B[row], top_k_B[row] = params.temperature, params.top_k or 0
    top_p_B[row] = 1.0 if params.top_p is None else params.top_p
    seeds_B[row], counters_B[row] = request.seed, len(request.output_ids)
  tokens_BS, kept_B = verify(logits_BSV, drafts_BK, num_drafts_B, temperature_B, top_k_B,
                             top_p_B, seeds_B, counters_B)
  return np.asarray(host_value(tokens_BS)), np.asarray(host_value(kept_B))


@functools.cache
def _blank(batch: int, width: int) -> tuple:
  """Host inputs of :func:`verify` for ``batch`` empty rows (warm-up)."""
  zeros_B = np.zeros(batch, np.int32)
  return (np.zeros((batch, width - 1), np.int32), zeros_B, np.zeros(batch, np.float32),
          zeros_B, np.ones(batch, np.float32), zeros_B, zeros_B)


def warm_verify(logits_BSV) -> None:
  """Compile :func:`verify` for these logits' shape (no row keeps anything)."""
  batch, width, _ = logits_BSV.shape
  jax.block_until_ready(verify(logits_BSV, *_blank(batch, width)))

"""The engine's sampler: one token per batch row from the model step's last-token logits.

The sampler is one jitted call whose ``[max_batch, vocab]`` logits never change shape, so
it compiles once per variant of :meth:`BatchSampler.variants` (with or without
log-probabilities, times the logit-bias width).

**Controls.** ``logit_bias`` and ``min_tokens`` (its stop ids get a bias of ``-inf`` until
enough tokens are out) travel as ``(id, bias)`` pairs per row, 64 of them (the vocabulary's
size in a step where a row has more), in every step. The penalties need each request's token
counts: rather than sending its history every step, the sampler keeps two device arrays
``[max_batch + 1, vocab]`` (allocated at warm-up or the first step), passed to every call
(penalties skipped by ``lax.cond`` when none): the count of each generated token and whether
it is in the prompt, one row per running penalised request (row 0 scratch). A request's row
is filled from its history when it is scheduled without one (at admission, or again after a
preemption), and the sampler adds each new token to it on the device, so a step moves
``O(batch)`` numbers, not ``O(batch * history)``.

**Structured outputs.** A request with ``SamplingParams.structured`` gets a grammar matcher
(llguidance, :mod:`maxnnx.inference.structured`) kept on the host. Before a call, each such
row that samples writes the tokens its grammar allows next into a packed mask
``[max_batch, ceil(vocab / 32)]`` int32, which every call passes (rows without a grammar:
every bit set), so one program serves both kinds of rows. After the step the matcher takes
the sampled token (:meth:`BatchSampler.advance_grammar`); once the grammar can take no
further token the request finishes, and the stop ids are allowed only where the grammar
accepts the output.
"""

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxnnx.inference.sampling import Controls, apply_controls, row_keys, sample_rows
from maxnnx.inference.structured import fill_allowed, grammar_tokenizer, mask_words, new_matcher
from maxnnx.processes import host_value
from maxnnx.serving.params import SamplingParams, TokenLogprobs
from maxnnx.serving.scheduler import Request

logger = logging.getLogger(__name__)

FEW_BIAS_ENTRIES = 64  # logit-bias pairs per row: 64, else the vocabulary's size


def bias_bucket(n: int, vocab: int) -> int:
  """Logit-bias pairs per row for ``n`` entries (at most one per id): 64, or the vocabulary's
  size beyond that."""
  return FEW_BIAS_ENTRIES if n <= FEW_BIAS_ENTRIES else max(vocab, FEW_BIAS_ENTRIES)


def bias_widths(vocab: int) -> tuple[int, ...]:
  """Every width :func:`bias_bucket` gives for a vocabulary of ``vocab``."""
  return tuple(sorted({FEW_BIAS_ENTRIES, max(vocab, FEW_BIAS_ENTRIES)}))


@dataclasses.dataclass
class Sampled:
  """One sampler call's results on the host.

  Attributes:
    tokens_B: the token of each row.
    chosen_B: its log-probability, or ``None`` when no row asked for log-probabilities.
    top_ids_BN: the most likely ids of each row, or ``None``.
    top_lps_BN: their log-probabilities, or ``None``.
  """

  tokens_B: np.ndarray
  chosen_B: np.ndarray | None = None
  top_ids_BN: np.ndarray | None = None
  top_lps_BN: np.ndarray | None = None

  def logprobs(self, row: int, num: int | None) -> tuple[TokenLogprobs, ...] | None:
    """Row ``row``'s token with its log-probability and ``num`` top ones (``None``: none
    asked)."""
    if num is None:
      return None
    token = int(self.tokens_B[row])
    top = tuple(zip(self.top_ids_BN[row, :num].tolist(), self.top_lps_BN[row, :num].tolist()))
    return (TokenLogprobs(token, float(self.chosen_B[row]), top),)


class BatchSampler:
  """Samples every row of a step, with each request's controls (see the module docstring).

  Args:
    max_batch: rows of a step.
    vocab_size: the model's vocabulary.
    max_logprobs: the most log-probabilities a request may ask for.
    stop_ids: a request's sampling parameters to the ids that end it
      (:meth:`~maxnnx.serving.output_processor.OutputProcessor.stop_ids`).
    running: the ids of the requests now running (their penalty rows are kept).
  """

  def __init__(self, max_batch: int, vocab_size: int, max_logprobs: int,
               stop_ids: Callable[[SamplingParams], frozenset],
               running: Callable[[], set[int]]):
    self.max_batch = max_batch
    self.vocab_size = vocab_size
    self.max_logprobs = max_logprobs
    self.stop_ids = stop_ids
    self._running = running
    self._history_rows: dict[int, int] = {}  # request id -> its row of _counts_SV
    self._counts_SV = self._prompt_seen_SV = None
    self._matchers: dict = {}  # request id -> its structured output's grammar matcher
    self._grammar_tokenizer = None  # the tokenizer as llguidance reads it, built when needed

  def variants(self) -> list[tuple[int, int]]:
    """Every ``(log-probabilities, logit-bias width)`` the sampler is called with."""
    logprobs = sorted({0, max(self.max_logprobs, 1)})
    return [(n, width) for n in logprobs for width in bias_widths(self.vocab_size)]

  # -- grammars -------------------------------------------------------------------------------

  def wrap_tokenizer(self, tokenizer, eos_ids, *, quiet: bool = False) -> None:
    """Wrap ``tokenizer`` for llguidance once (a second for a large vocabulary); ``quiet``
    skips a tokenizer it cannot read instead of raising."""
    if self._grammar_tokenizer is not None:
      return
    with contextlib.suppress(*((ValueError, ImportError) if quiet else ())):
      self._grammar_tokenizer = grammar_tokenizer(tokenizer, self.vocab_size, eos_ids)

  def matcher_for(self, structured, tokenizer, eos_ids):
    """A matcher for ``structured`` (raises when it does not compile), not yet attached."""
    if tokenizer is None:
      raise ValueError('Structured outputs need an Engine with a tokenizer.')
    self.wrap_tokenizer(tokenizer, eos_ids)
    return new_matcher(self._grammar_tokenizer, structured)

  def attach(self, request_id: int, matcher) -> None:
    """Keep ``matcher`` (from :meth:`matcher_for`) for the request."""
    self._matchers[request_id] = matcher

  def advance_grammar(self, request: Request, token: int) -> bool:
    """Feed ``token`` to the request's matcher, if it has one; whether the grammar is done
    (it can take no further token, or refused this one: a ``min_tokens`` ban can leave no
    allowed token)."""
    matcher = self._matchers.get(request.request_id)
    if matcher is None or token in self.stop_ids(request.params):
      return False  # no grammar, or the request stops at the token anyway
    if not matcher.consume_token(token):
      logger.warning('request %d: token %d is outside its grammar (%s); it stops here.',
                     request.request_id, token, matcher.get_error())
      return True
    return matcher.is_stopped()

  def draft_masks(self, request: Request, k: int) -> np.ndarray:
    """``[k + 1, words]`` packed masks of the tokens the request's grammar allows at its next
    token and at each draft position after it (every token without a grammar, and past a
    draft the grammar refuses, a stop id, or a draft that ends the grammar: verification
    stops there). The matcher is walked through the drafts and rolled back."""
    masks_SW = np.full((k + 1, mask_words(self.vocab_size)), -1, np.int32)
    matcher = self._matchers.get(request.request_id)
    if matcher is None:
      return masks_SW
    stops, consumed = self.stop_ids(request.params), 0
    for position, draft in enumerate([*request.draft_ids, None]):
      fill_allowed(matcher, masks_SW, position, request.params.stop_token_ids)
      if draft is None or draft in stops or matcher.is_stopped():
        break
      if matcher.try_consume_tokens([draft]) != 1:
        break
      consumed += 1
    if consumed:
      matcher.rollback(consumed)
    return masks_SW

  def forget(self, request_id: int) -> None:
    """Drop a finished or cancelled request's matcher."""
    self._matchers.pop(request_id, None)

  # -- sampling -------------------------------------------------------------------------------

  def sample(self, logits_BV, scheduled: list[tuple[Request, int]]) -> Sampled:
    """One token per row of ``scheduled`` from its last-token logits ``[max_batch, vocab]``."""
    self._allocate(logits_BV)
    controls, history_B = self._controls(scheduled), self._history(scheduled)
    # Log-probabilities (a softmax and a top-k over the vocabulary) only when a row asks.
    wants_logprobs = any(r.params.logprobs is not None for r, _ in scheduled)
    num_logprobs = max(self.max_logprobs, 1) if wants_logprobs else 0
    tokens_B, chosen_B, top_ids_BN, top_lps_BN, self._counts_SV = _sample(
        num_logprobs, logits_BV, *self.row_inputs(scheduled), controls, self._counts_SV,
        self._prompt_seen_SV, *history_B)
    # Whole on every process of a model spread over several.
    if not wants_logprobs:
      return Sampled(host_value(tokens_B))
    return Sampled(*(host_value(a) for a in (tokens_B, chosen_B, top_ids_BN, top_lps_BN)))

  def warm(self, logits_BV, num_logprobs: int, width: int) -> None:
    """Run the sampler once in one of :meth:`variants` (no row emits a token)."""
    rows, vocab = self.max_batch, self.vocab_size
    controls = Controls(np.full((rows, width), vocab, np.int32),
                        np.zeros((rows, width), np.float32), np.zeros(rows, np.float32),
                        np.zeros(rows, np.float32), np.ones(rows, np.float32),
                        allowed_BW=np.full((rows, mask_words(vocab)), -1, np.int32))
    self._allocate(logits_BV)
    self._history([])  # the count arrays, and their writer
    self._write_row(0, [], [])
    tokens_B, *_, self._counts_SV = _sample(
        num_logprobs, logits_BV, *self.row_inputs([]), controls, self._counts_SV,
        self._prompt_seen_SV, np.zeros(rows, np.int32), np.zeros(rows, bool))
    jax.block_until_ready(tokens_B)

  def row_inputs(self, scheduled: list[tuple[Request, int]]) -> tuple:
    """Each row's temperature, top-k, top-p, seed, sample counter and log-probability
    temperature (empty rows: greedy, unused)."""
    rows = self.max_batch
    temperature_B, top_p_B = np.zeros(rows, np.float32), np.ones(rows, np.float32)
    top_k_B, seeds_B, counters_B = (np.zeros(rows, np.int32) for _ in range(3))
    logprob_temperature_B = np.ones(rows, np.float32)
    for row, (request, _) in enumerate(scheduled):
      params = request.params
      temperature_B[row] = params.temperature
      top_k_B[row] = params.top_k or 0
      top_p_B[row] = 1.0 if params.top_p is None else params.top_p
      if params.scaled_logprobs and params.temperature > 0:
        logprob_temperature_B[row] = params.temperature
      seeds_B[row], counters_B[row] = request.seed, len(request.output_ids)
    return temperature_B, top_k_B, top_p_B, seeds_B, counters_B, logprob_temperature_B

  def _controls(self, scheduled: list[tuple[Request, int]]) -> Controls:
    """The rows' logit bias, penalties and token masks (without the counts, which
    :meth:`_history` keeps): every call passes them, so that the sampler's shapes stay among
    :meth:`variants` (rows without a control add nothing)."""
    entries = [self.bias_entries(request) for request, _ in scheduled]
    rows, vocab = self.max_batch, self.vocab_size
    width = bias_bucket(max(len(e) for e in entries), vocab)
    ids_BK = np.full((rows, width), vocab, np.int32)  # ids >= vocab are padding
    values_BK = np.zeros((rows, width), np.float32)
    presence_B, frequency_B = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    repetition_B = np.ones(rows, np.float32)
    allowed_BW = np.full((rows, mask_words(vocab)), -1, np.int32)
    for row, ((request, count), pairs) in enumerate(zip(scheduled, entries)):
      if pairs:
        ids_BK[row, :len(pairs)], values_BK[row, :len(pairs)] = zip(*pairs)
      params = request.params
      presence_B[row], frequency_B[row] = params.presence_penalty, params.frequency_penalty
      repetition_B[row] = params.repetition_penalty
      matcher = self._matchers.get(request.request_id)
      # A row with drafts takes its tokens from the verifier, which masks each position itself
      # (draft_masks): its sampled token is never kept, so its mask is not computed here.
      if (matcher is not None and not request.draft_ids
          and request.num_computed + count >= request.num_tokens):
        fill_allowed(matcher, allowed_BW, row, params.stop_token_ids)
    return Controls(ids_BK, values_BK, presence_B, frequency_B, repetition_B,
                    allowed_BW=allowed_BW)

  def bias_entries(self, request: Request, ahead: int = 0) -> list[tuple[int, float]]:
    """``(token id, bias)`` pairs of the request's token ``ahead`` tokens after its next one:
    its ``logit_bias``, and ``-inf`` on its stop ids while fewer than ``min_tokens`` tokens
    are out before it."""
    params = request.params
    pairs = dict(params.logit_bias)  # one entry per id: at most the vocabulary
    if len(request.output_ids) + ahead < params.min_tokens:
      pairs.update((i, -np.inf) for i in sorted(self.stop_ids(params)) if i < self.vocab_size)
    return list(pairs.items())

  def _allocate(self, logits_BV) -> None:
    """Make the count arrays, the first time, laid out as the logits when those are spread over
    a mesh (a sharded model): every later call meets them with that one sharding, not with the
    one the first call happened to give back (a program compiled anew after warm-up)."""
    sharding = getattr(logits_BV, 'sharding', None)
    if self._counts_SV is None and isinstance(sharding, jax.sharding.NamedSharding):
      shape = (self.max_batch + 1, self.vocab_size)
      self._counts_SV = jax.device_put(np.zeros(shape, np.int32), sharding)
      self._prompt_seen_SV = jax.device_put(np.zeros(shape, bool), sharding)

  def _history(self, scheduled: list[tuple[Request, int]]):
    """``(row of the count arrays, whether a token is added)`` per batch row, both ``[B]``
    (row 0, nothing added, for rows without a penalty).

    Allocates the count arrays the first time. Frees the count rows of requests no longer
    running and fills one from its history for each penalised request scheduled without
    one (new, or back after a preemption).
    """
    penalised = [(row, r) for row, (r, _) in enumerate(scheduled) if r.params.penalized]
    running = self._running()
    self._history_rows = {i: n for i, n in self._history_rows.items() if i in running}
    if self._counts_SV is None:
      self._counts_SV = jnp.zeros((self.max_batch + 1, self.vocab_size), jnp.int32)
      self._prompt_seen_SV = jnp.zeros((self.max_batch + 1, self.vocab_size), bool)
    free = sorted(set(range(1, self.max_batch + 1)) - set(self._history_rows.values()),
                  reverse=True)
    rows_B, emits_B = np.zeros(self.max_batch, np.int32), np.zeros(self.max_batch, bool)
    for row, request in penalised:
      if request.request_id not in self._history_rows:
        self._history_rows[request.request_id] = n = free.pop()
        self._write_row(n, request.output_ids, request.token_ids[:request.num_prompt])
      rows_B[row] = self._history_rows[request.request_id]
      # A prefill chunk that does not reach the last token samples nothing that is kept,
      # nor does a row with drafts (its tokens come from the verifier, which counts them).
      emits_B[row] = (not request.draft_ids
                      and request.num_computed + scheduled[row][1] >= request.num_tokens)
    return rows_B, emits_B

  def penalty_counts(self, requests: Sequence[Request]) -> tuple:
    """``(counts_SV, prompt_seen_SV, rows_B)`` for verifying ``requests`` (row by row): the
    count arrays and each row's row of them (0: not penalised), filled for a penalised
    request that has none yet. The verifier returns the counts with its kept tokens added,
    for :meth:`keep_counts`."""
    rows_B, _ = self._history([(request, 0) for request in requests])
    return self._counts_SV, self._prompt_seen_SV, rows_B

  def keep_counts(self, counts_SV) -> None:
    """Take back the count arrays a verification donated and updated."""
    self._counts_SV = counts_SV

  def _write_row(self, row: int, output_ids: Sequence[int], prompt_ids: Sequence[int]) -> None:
    """Set row ``row`` of the count arrays to these tokens' counts and prompt presence."""
    vocab = self.vocab_size
    self._counts_SV, self._prompt_seen_SV = _write_history(
        self._counts_SV, self._prompt_seen_SV, row,
        np.bincount(np.asarray(output_ids, np.int64), minlength=vocab).astype(np.int32),
        np.bincount(np.asarray(prompt_ids, np.int64), minlength=vocab) > 0)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_history(counts_SV, prompt_seen_SV, row, counts_V, prompt_seen_V):
  """The count arrays with row ``row`` set to one request's counts and prompt tokens."""
  return counts_SV.at[row].set(counts_V), prompt_seen_SV.at[row].set(prompt_seen_V)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(9,))
def _sample(num_logprobs, logits_BV, temperature_B, top_k_B, top_p_B, seeds_B, counters_B,
            logprob_temperature_B, controls, counts_SV, prompt_seen_SV, history_rows_B, emits_B):
  """Tokens, their log-probabilities and the top ones, and the new token counts.

  ``[B, vocab]`` never changes shape, so this compiles once per ``num_logprobs`` (0 when no
  row asks for log-probabilities: then only the tokens are computed and the log-probability
  outputs are None) and per logit-bias width of ``controls`` (:func:`bias_bucket`).
  ``counts_SV`` is each penalised request's token counts (row 0 scratch), ``history_rows_B``
  each batch row's row of it, and ``emits_B`` which rows keep their token (added to the
  counts, which are returned). Log-probabilities are of the model's logits (before the
  controls) divided by ``logprob_temperature_B`` (1: the model's own).
  """
  if counts_SV is not None:
    controls = dataclasses.replace(controls, counts_BV=counts_SV[history_rows_B],
                                   prompt_seen_BV=prompt_seen_SV[history_rows_B])
  tokens_B = sample_rows(apply_controls(logits_BV, controls), row_keys(seeds_B, counters_B),
                         temperature_B, top_k_B, top_p_B)
  if counts_SV is not None:
    counts_SV = counts_SV.at[history_rows_B, tokens_B].add(emits_B.astype(jnp.int32))
  if not num_logprobs:
    return tokens_B, None, None, None, counts_SV
  scaled_BV = logits_BV.astype(jnp.float32) / logprob_temperature_B[:, None]
  logprobs_BV = jax.nn.log_softmax(scaled_BV, axis=-1)
  chosen_B = jnp.take_along_axis(logprobs_BV, tokens_B[:, None], axis=-1)[:, 0]
  top_lps_BN, top_ids_BN = jax.lax.top_k(logprobs_BV, num_logprobs)
  return tokens_B, chosen_B, top_ids_BN, top_lps_BN, counts_SV

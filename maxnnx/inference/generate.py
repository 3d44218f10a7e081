"""``generate``: prefill a batch of prompts, then decode inside one jitted loop.

Prompts of different lengths are left-padded; padding gets segment id 0 (never
attended to) and every row's positions start at 0 at its first real token, so a
row's continuation does not depend on the other rows. The KV cache lives in
``nnx.Cache`` variables of a working copy of the model (the caller's model is
not modified). Decoding runs as a ``jax.lax.while_loop`` with no host sync per
token and stops early once every row has produced an end-of-sequence id.
"""

import dataclasses
import functools
import logging
import types
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxnnx.inference import mtp_draft
from maxnnx.inference import speculative as spec
from maxnnx.inference.sampling import (
  Controls,
  apply_controls,
  control_problems,
  logit_bias_pairs,
  sample_next_token,
)
from maxnnx.inference.stops import eos_token_ids
from maxnnx.kernels.kv_quant import check_kv_cache_dtype
from maxnnx.processes import host_value

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  """Generated continuations.

  Attributes:
    tokens: ``[B, max_new_tokens]`` generated ids; after a row's end-of-sequence
      id (kept) the row holds ``pad_id``.
    lengths: ``[B]`` number of generated tokens per row, EOS included.
    logprobs: ``[B, max_new_tokens]`` float32 log-probability of each generated
      token under the distribution it was drawn from before truncation:
      ``log_softmax(logits / temperature)`` (``temperature`` 1 for greedy
      decoding), without the ``top_k`` / ``top_p`` cut; 0 after a row's end.
      An RL objective compares these with its own forward pass.
    accepted_draft_tokens: with ``speculative``, the drafts the target kept (over the
      rows, counted until each row ended); ``None`` otherwise.
    proposed_draft_tokens: with ``speculative``, the drafts proposed (prompt lookup counts
      only the tokens it found); ``None`` otherwise.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  logprobs: np.ndarray | None = None
  accepted_draft_tokens: int | None = None
  proposed_draft_tokens: int | None = None

  @property
  def acceptance_rate(self) -> float | None:
    """Share of the proposed drafts the target kept (``None`` without speculative decoding
    or when nothing was proposed)."""
    if not self.proposed_draft_tokens:
      return None
    return self.accepted_draft_tokens / self.proposed_draft_tokens

  def as_lists(self) -> list[list[int]]:
    """Each row's generated ids, without padding."""
    return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]


def working_copy(model):
  """``model`` with the same parameters and a copy of its other state (MoE statistics), to
  which a decode adds its cache: the prefill donates that state, which must not delete the
  buffers of ``model`` (those of modules a decode never runs, such as MTP modules, would go)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return nnx.merge(graphdef, params, jax.tree.map(jnp.copy, rest))


def _left_pad(prompts, prompt_lengths, pad_id: int):
  if prompt_lengths is None and isinstance(prompts, (list, tuple)):
    rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
  else:
    array = np.asarray(prompts)
    if array.ndim != 2:
      raise ValueError(f'prompt_ids must be [batch, length] or a list of sequences, got shape '
                       f'{array.shape}.')
    lengths = (np.full(array.shape[0], array.shape[1]) if prompt_lengths is None
               else np.asarray(prompt_lengths))
    if lengths.shape != (array.shape[0],) or lengths.min() < 1 or lengths.max() > array.shape[1]:
      raise ValueError(f'prompt_lengths must give 1..{array.shape[1]} for each of the '
                       f'{array.shape[0]} rows, got {lengths.tolist()}.')
    rows = [array[i, :n] for i, n in enumerate(lengths)]
  if not rows or min(len(r) for r in rows) == 0:
    raise ValueError('Every prompt needs at least one token.')
  width = max(len(r) for r in rows)
  ids = np.full((len(rows), width), pad_id, np.int32)
  segments = np.zeros((len(rows), width), np.int32)
  positions = np.zeros((len(rows), width), np.int32)
  for i, row in enumerate(rows):
    ids[i, width - len(row):] = row
    segments[i, width - len(row):] = 1
    positions[i, width - len(row):] = np.arange(len(row))
  return ids, segments, positions, np.array([len(r) for r in rows], np.int32)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _prefill(graphdef, params, cache, ids, segments, positions, pixel_values=None):
  model = nnx.merge(graphdef, params, cache)
  images = {} if pixel_values is None else {'pixel_values': pixel_values}
  x_BTD = model.hidden_states(ids, segment_ids=segments, positions=positions, decode=True,
                              **images)
  # Prompts are left-padded: only the last position's logits are needed (the head on the
  # whole prompt would cost more than the rest of the model for a large vocabulary).
  return model.logits(x_BTD[:, -1:])[:, 0], nnx.state(model, nnx.Not(nnx.Param))


@dataclasses.dataclass(frozen=True)
class _Rule:
  """The batch's logit controls for :func:`_decode` (``None`` there when unused).

  ``bias_ids_K`` / ``bias_values_K``: the ``logit_bias`` then the stop ids that
  ``min_tokens`` masks (``-inf`` while ``step < min_tokens``, flagged by ``held_K``);
  ``prompt_seen_BV``: each row's prompt tokens (repetition penalty), ``None`` when no
  penalty is set (then no counts are kept either).
  """

  bias_ids_K: jax.Array
  bias_values_K: jax.Array
  held_K: jax.Array
  min_tokens: jax.Array
  penalties: jax.Array  # [presence, frequency, repetition]
  prompt_seen_BV: jax.Array | None


jax.tree_util.register_dataclass(_Rule)


def _controls_at(rule: _Rule, step, counts_BV, batch: int) -> Controls:
  """The :class:`Controls` of decode step ``step`` (``min_tokens`` masks while early)."""
  values_K = jnp.where(rule.held_K & (step < rule.min_tokens), -jnp.inf, rule.bias_values_K)
  presence, frequency, repetition = (jnp.full((batch,), p) for p in rule.penalties)
  return Controls(jnp.broadcast_to(rule.bias_ids_K, (batch,) + rule.bias_ids_K.shape),
                  jnp.broadcast_to(values_K, (batch,) + values_K.shape), presence, frequency,
                  repetition, counts_BV, rule.prompt_seen_BV)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(9,))
def _decode(graphdef, end_step, temperature, top_k, top_p, params, tokens, logprobs, done, cache,
            logits, start_step, next_positions, eos_ids, pad_id, key, rule=None, counts=None):
  """Sample tokens ``start_step..end_step-1``, feeding each back through the cache.

  ``rule``: the logit controls (:class:`_Rule`), with ``counts`` ``[B, vocab]`` of the
  tokens generated so far when it has penalties.
  """
  batch = logits.shape[0]

  def cond(carry):
    step, _, _, done, *_ = carry
    return (step < end_step) & ~jnp.all(done)

  def body(carry):
    step, tokens, logprobs, done, cache, logits, key, counts = carry
    key, sample_key = jax.random.split(key)
    controlled = logits if rule is None else apply_controls(
        logits, _controls_at(rule, step, counts, batch))
    token = sample_next_token(controlled, sample_key, temperature=temperature, top_k=top_k,
                              top_p=top_p)
    token = jnp.where(done, pad_id, token)
    if counts is not None:
      counts = counts.at[jnp.arange(batch), token].add((~done).astype(counts.dtype))
    scaled_BV = logits.astype(jnp.float32) / (temperature or 1.0)
    logprob = (jnp.take_along_axis(scaled_BV, token[:, None], axis=-1)[:, 0]
               - jax.nn.logsumexp(scaled_BV, axis=-1))
    tokens = tokens.at[:, step].set(token)
    logprobs = logprobs.at[:, step].set(jnp.where(done, 0.0, logprob))
    done = done | jnp.isin(token, eos_ids)
    model = nnx.merge(graphdef, params, cache)
    new_logits = model(token[:, None], segment_ids=jnp.ones((batch, 1), jnp.int32),
                       positions=(next_positions + step)[:, None], decode=True)
    return (step + 1, tokens, logprobs, done, nnx.state(model, nnx.Not(nnx.Param)),
            new_logits[:, -1], key, counts)

  carry = (start_step, tokens, logprobs, done, cache, logits, key, counts)
  _, tokens, logprobs, done, cache, logits, key, counts = jax.lax.while_loop(cond, body, carry)
  return tokens, logprobs, done, cache, logits, key, counts


def _check_images(model, ids, pixel_values) -> None:
  """Placeholders and images agree (the model cannot check under jit)."""
  vision = model.config.vision
  if not vision.num_layers:
    raise ValueError('pixel_values needs a model with a vision tower '
                     '(ModelConfig.vision.num_layers > 0).')
  placeholders = int((np.asarray(ids) == vision.image_token_id).sum())
  images = np.shape(pixel_values)[0]
  if placeholders != images * vision.tokens_per_image:
    raise ValueError(f'The prompts hold {placeholders} image placeholder tokens (id '
                     f'{vision.image_token_id}) but {images} image(s) need '
                     f'{images * vision.tokens_per_image} ({vision.tokens_per_image} each).')


def _longrope_switch_step(model, prompt_width: int, max_new_tokens: int) -> int | None:
  """Decode step after which a LongRoPE model's cache must be recomputed.

  LongRoPE rotates with its short factors while every position fits the
  original context and with its long factors after; keys cached before the
  switch carry the short rotation. As the Phi-3 reference implementation does,
  the whole sequence is re-encoded once the first position past the original
  context has been fed.
  """
  thresholds = [r.long_threshold for r in (model.rotary, model.local_rotary)
                if r is not None and r.long_inv_freq is not None]
  if not thresholds or prompt_width > min(thresholds):
    return None
  steps = min(thresholds) - prompt_width + 1
  return steps if steps < max_new_tokens else None


def generate(model, prompt_ids: Sequence[Sequence[int]] | np.ndarray, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             eos_ids: Sequence[int] | int | None | str = 'config', pad_id: int = 0, seed: int = 0,
             prompt_lengths: Sequence[int] | None = None,
             pixel_values: np.ndarray | None = None, logit_bias: dict[int, float] | None = None,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float = 1.0, min_tokens: int = 0,
             speculative: 'spec.PromptLookup | spec.DraftModel | spec.MTPDraft | None' = None,
             kv_cache_dtype: str = 'auto') -> GenerationResult:
  """Continue each prompt by up to ``max_new_tokens`` tokens.

  Args:
    model: a :class:`~maxnnx.Transformer` (not modified).
    prompt_ids: a list of token-id sequences (any lengths), or a ``[B, T]``
      array whose rows are full prompts, or right-padded rows with
      ``prompt_lengths``.
    max_new_tokens: tokens to generate per row at most.
    temperature: 0 for greedy decoding, else the sampling temperature.
    top_k: sample only among the ``top_k`` most likely tokens.
    top_p: sample only from the smallest set of tokens with probability ``>= top_p``.
    eos_ids: id(s) that end a row; generation stops when every row has ended.
      ``'config'`` (default) uses ``model.config.eos_token_id``; ``None`` never stops.
    pad_id: id written after a row has ended (and used to pad prompts).
    seed: seed of the sampling key (same seed, same samples).
    prompt_lengths: real length of each row of an array ``prompt_ids``.
    pixel_values: ``[num_images, channels, H, W]`` images for a model with a vision
      tower: their embeddings take the places of the image placeholder tokens of the
      prompts, in order (see :meth:`~maxnnx.Transformer.hidden_states`).
    logit_bias, presence_penalty, frequency_penalty, repetition_penalty, min_tokens: logit
      controls for every row, with :class:`~maxnnx.serving.SamplingParams`' meanings and
      ranges (applied before temperature, top-k and top-p; see
      :mod:`maxnnx.inference.sampling`). ``min_tokens`` holds back ``eos_ids``. The returned
      ``logprobs`` stay those of the model's own logits.
    speculative: a :class:`~maxnnx.inference.speculative.PromptLookup`,
      :class:`~maxnnx.inference.speculative.DraftModel` or
      :class:`~maxnnx.inference.speculative.MTPDraft` (the model's own multi-token-prediction
      module, DeepSeek V3) drafter: each step the model
      verifies its drafts in one forward pass (see :mod:`maxnnx.inference.speculative`).
      Greedy output is the same token for token; sampling keeps the same distribution
      (with different random draws). Not with the logit controls.
    kv_cache_dtype: how the KV cache stores keys and values: ``auto`` (the compute dtype),
      ``int8`` or ``fp8`` (e4m3, with a float32 scale per token and KV head; see
      :mod:`maxnnx.kernels.kv_quant`). With ``speculative``, the model's cache (not a draft
      model's).

  Returns:
    A :class:`GenerationResult` with ``tokens [B, max_new_tokens]`` and ``lengths``.
  """
  _check_sampling(max_new_tokens, temperature, top_k, top_p, kv_cache_dtype)
  ids, segments, positions, lengths = _left_pad(prompt_ids, prompt_lengths, pad_id)
  vocab = model.config.vocab_size
  controls = _checked_controls(vocab, max_new_tokens, logit_bias=logit_bias or {},
                               presence_penalty=presence_penalty,
                               frequency_penalty=frequency_penalty,
                               repetition_penalty=repetition_penalty, min_tokens=min_tokens)
  top_k = _clamped_top_k(top_k, vocab)
  _check_prompts(model, ids, max_new_tokens, pixel_values)
  eos = _eos_array(model, eos_ids)
  sampling = (float(temperature), top_k, top_p)
  prompt = (ids, segments, positions, lengths)
  if speculative is not None:
    spec.check_speculative(speculative, model, pixel_values=pixel_values, controls=controls,
                           longrope_switch=_longrope_switch_step(model, ids.shape[1],
                                                                 max_new_tokens))
    return _speculative(model, speculative, *prompt, max_new_tokens, sampling, eos, pad_id, seed,
                        pixel_values, kv_cache_dtype)
  return _plain(model, prompt, max_new_tokens, sampling, eos, pad_id, seed, pixel_values,
                kv_cache_dtype, controls)


def _check_sampling(max_new_tokens: int, temperature: float, top_k, top_p,
                    kv_cache_dtype: str) -> None:
  """Raise on a length, sampling setting or cache dtype :func:`generate` cannot use."""
  if max_new_tokens < 1:
    raise ValueError(f'max_new_tokens must be >= 1, got {max_new_tokens}.')
  check_kv_cache_dtype(kv_cache_dtype)
  if temperature < 0 or (top_p is not None and not 0 < top_p <= 1) or (
      top_k is not None and top_k < 1):
    raise ValueError('Need temperature >= 0, 1 <= top_k and 0 < top_p <= 1; got '
                     f'temperature={temperature}, top_k={top_k}, top_p={top_p}.')


def _clamped_top_k(top_k: int | None, vocab: int) -> int | None:
  """``top_k``, lowered (with a warning) to the vocabulary size when larger."""
  if top_k is not None and top_k > vocab:
    logger.warning('top_k=%d is larger than the vocabulary (%d tokens); using top_k=%d.', top_k,
                   vocab, vocab)
    return vocab
  return top_k


def _check_prompts(model, ids: np.ndarray, max_new_tokens: int, pixel_values) -> None:
  """Warn when the prompts plus ``max_new_tokens`` run past the trained positions; raise
  on ids outside the vocabulary and on images that do not match their placeholders."""
  vocab = model.config.vocab_size
  limit = model.config.max_position_embeddings
  if ids.shape[1] + max_new_tokens > limit:
    logger.warning('The prompt (%d tokens) plus max_new_tokens=%d run past the model\'s '
                   'max_position_embeddings=%d; positions beyond it were never trained.',
                   ids.shape[1], max_new_tokens, limit)
  if ids.min() < 0 or ids.max() >= vocab:
    raise ValueError(f'prompt_ids contain ids outside [0, {vocab}); check the tokenizer '
                     'matches the model.')
  if pixel_values is not None:
    _check_images(model, ids, pixel_values)


def _eos_array(model, eos_ids) -> np.ndarray:
  """The end-of-sequence ids as an int32 array (empty: never stop); ``'config'`` reads
  them from the model's config."""
  if isinstance(eos_ids, str):
    if eos_ids != 'config':
      raise ValueError(f"eos_ids must be ids, None or 'config', got {eos_ids!r}.")
    eos_ids = eos_token_ids(model.config)
  return np.asarray([] if eos_ids is None else np.atleast_1d(eos_ids), np.int32)


def _plain(model, prompt, max_new_tokens: int, sampling, eos, pad_id: int, seed: int,
           pixel_values, kv_cache_dtype: str, controls) -> GenerationResult:
  """:func:`generate` without a drafter (checked): prefill, then :func:`_decode`, with one
  re-encoding of the whole sequence where a LongRoPE model switches factors."""
  ids, segments, positions, lengths = prompt
  batch, width = ids.shape
  work = working_copy(model)
  work.init_cache(batch, width + max_new_tokens, kv_cache_dtype=kv_cache_dtype)
  # `cache` holds every non-parameter: KV caches, and MoE routing statistics if any.
  graphdef, params, cache = nnx.split(work, nnx.Param, ...)
  logits, cache = _prefill(graphdef, params, cache, ids, segments, positions,
                           None if pixel_values is None else jnp.asarray(pixel_values))
  tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32)
  logprobs = jnp.zeros((batch, max_new_tokens), jnp.float32)
  done = jnp.zeros((batch,), bool)
  decode = functools.partial(_decode, graphdef)
  extra = (jnp.asarray(lengths), jnp.asarray(eos), pad_id)
  key = jax.random.key(seed)
  rule, counts = _rule(controls, ids, segments, eos, model.config.vocab_size)
  switch = _longrope_switch_step(work, width, max_new_tokens)
  if switch is None:
    tokens, logprobs, *_ = decode(max_new_tokens, *sampling, params, tokens, logprobs, done,
                                  cache, logits, 0, *extra, key, rule, counts)
  else:
    tokens, logprobs, done, cache, _, key, counts = decode(
        switch, *sampling, params, tokens, logprobs, done, cache, logits, 0, *extra, key, rule,
        counts)
    # Re-encode prompt + generated tokens with fresh keys, then continue.
    new = host_value(tokens[:, :switch])
    cache = jax.tree.map(jnp.zeros_like, cache)
    logits, cache = _prefill(
        graphdef, params, cache, np.concatenate([ids, new], 1),
        np.concatenate([segments, np.ones_like(new)], 1),
        np.concatenate([positions, lengths[:, None] + np.arange(switch)], 1),
        None if pixel_values is None else jnp.asarray(pixel_values))
    tokens, logprobs, *_ = decode(max_new_tokens, *sampling, params, tokens, logprobs, done,
                                  cache, logits, switch, *extra, key, rule, counts)
  tokens = host_value(tokens)  # gathered when the rows are sharded over several processes
  ended = np.isin(tokens, eos)
  out_lengths = np.where(ended.any(axis=1), ended.argmax(axis=1) + 1, max_new_tokens)
  return GenerationResult(tokens, out_lengths.astype(np.int32), host_value(logprobs))


def _ended(tokens: np.ndarray, eos: np.ndarray, pad_id: int):
  """``(tokens with pad_id after each row's first end id, lengths)``."""
  ended = np.isin(tokens, eos)
  lengths = np.where(ended.any(axis=1), ended.argmax(axis=1) + 1, tokens.shape[1])
  tokens = np.where(np.arange(tokens.shape[1])[None] < lengths[:, None], tokens, pad_id)
  return tokens.astype(np.int32), lengths.astype(np.int32)


def _speculative(model, speculative, ids, segments, positions, lengths, max_new_tokens: int,
                 sampling, eos, pad_id: int, seed: int, pixel_values,
                 kv_cache_dtype: str = 'auto') -> GenerationResult:
  """:func:`generate` with a drafter (checked): prefill, then
  :func:`~maxnnx.inference.speculative.speculative_decode`."""
  batch, width = ids.shape
  if isinstance(speculative, spec.MTPDraft):
    *out, _ = mtp_draft.decode_with_mtp(model, speculative, (ids, segments, positions), lengths,
                                        max_new_tokens, sampling, eos, seed, kv_cache_dtype)
    return _speculative_result(*out, max_new_tokens, eos, pad_id)
  k = speculative.num_draft_tokens
  slots = spec.cache_slots(width, max_new_tokens, k, batch)
  images = None if pixel_values is None else jnp.asarray(pixel_values)

  def prefilled(each, kv='auto'):
    work = working_copy(each)
    work.init_cache(batch, slots, kv_cache_dtype=kv)
    graphdef, params, cache = nnx.split(work, nnx.Param, ...)
    logits, cache = _prefill(graphdef, params, cache, ids, segments, positions, images)
    return graphdef, params, cache, logits

  graphdef, params, cache, logits = prefilled(model, kv_cache_dtype)
  draft_graphdef = draft_params = draft_cache = None
  settings = (k, 0, 0)
  if isinstance(speculative, spec.DraftModel):
    draft_graphdef, draft_params, draft_cache, _ = prefilled(speculative.model)
    draft = nnx.merge(draft_graphdef, draft_params, draft_cache)
    draft.cache_index[...] = jnp.asarray(width - 1, jnp.int32)  # its last slot is fed again
    draft_cache = nnx.state(draft, nnx.Not(nnx.Param))
  else:
    settings = (k, speculative.max_ngram, speculative.min_ngram)
  context = np.zeros((batch, width + max_new_tokens + k + 1), np.int32)
  for row in range(batch):
    context[row, :lengths[row]] = ids[row, width - lengths[row]:]
  tokens, logprobs, accepted, proposed = spec.speculative_decode(
      graphdef, draft_graphdef, settings, sampling, max_new_tokens, params, draft_params, cache,
      logits, draft_cache, jnp.asarray(context), jnp.asarray(lengths), jnp.asarray(eos),
      jax.random.key(seed))
  return _speculative_result(tokens, logprobs, accepted, proposed, max_new_tokens, eos, pad_id)


def _speculative_result(tokens, logprobs, accepted, proposed, max_new_tokens: int, eos,
                        pad_id: int) -> GenerationResult:
  """The :class:`GenerationResult` of a speculative decode's buffers (cut after each row's
  first end id or ``max_new_tokens``)."""
  tokens, out_lengths = _ended(host_value(tokens)[:, :max_new_tokens], eos, pad_id)
  logprobs = host_value(logprobs)[:, :max_new_tokens]
  logprobs = np.where(np.arange(max_new_tokens)[None] < out_lengths[:, None], logprobs, 0.0)
  return GenerationResult(tokens, out_lengths, logprobs.astype(np.float32), int(accepted),
                          int(proposed))


def _checked_controls(vocab: int, max_new_tokens: int, *, logit_bias, presence_penalty,
                      frequency_penalty, repetition_penalty, min_tokens):
  """The logit controls, checked as ``SamplingParams`` checks them (one error naming each
  argument at fault), as a namespace :func:`_rule` reads."""
  bias = logit_bias_pairs(logit_bias)
  problems = control_problems(bias, presence_penalty, frequency_penalty, repetition_penalty,
                              min_tokens, max_new_tokens)
  if bias and bias[-1][0] >= vocab:
    problems.append(f'logit_bias names token {bias[-1][0]}, outside the vocabulary '
                    f'[0, {vocab})')
  if problems:
    raise ValueError(f"Invalid generate arguments: {', '.join(problems)}.".replace(
        'max_tokens=', 'max_new_tokens='))
  penalized = presence_penalty != 0 or frequency_penalty != 0 or repetition_penalty != 1
  return types.SimpleNamespace(logit_bias=bias, presence_penalty=presence_penalty,
                               frequency_penalty=frequency_penalty,
                               repetition_penalty=repetition_penalty, min_tokens=min_tokens,
                               penalized=penalized)


def _rule(controls, ids, segments, eos: np.ndarray, vocab: int):
  """``(_Rule, zero counts)`` for :func:`_decode`, or ``(None, None)`` without controls;
  counts are ``None`` without a penalty."""
  held = eos if controls.min_tokens else np.zeros(0, np.int32)
  if not controls.logit_bias and not held.size and not controls.penalized:
    return None, None
  bias_ids = np.array([i for i, _ in controls.logit_bias] + held.tolist(), np.int32)
  bias_values = np.array([v for _, v in controls.logit_bias] + [0.0] * held.size, np.float32)
  held_K = np.arange(len(bias_ids)) >= len(controls.logit_bias)
  prompt_seen = counts = None
  if controls.penalized:
    prompt_seen = np.zeros((len(ids), vocab), bool)
    for row, (row_ids, row_segments) in enumerate(zip(ids, segments)):
      prompt_seen[row, row_ids[row_segments > 0]] = True
    counts = jnp.zeros((len(ids), vocab), jnp.int32)
  penalties = np.array([controls.presence_penalty, controls.frequency_penalty,
                        controls.repetition_penalty], np.float32)
  return _Rule(bias_ids, bias_values, held_K, np.int32(controls.min_tokens), penalties,
               prompt_seen), counts

"""Multi-token-prediction drafting (DeepSeek V3): :class:`~.speculative.MTPDraft`.

The drafter is the model's MTP module 0 (:class:`~maxnnx.layers.mtp.MTPLayer`), as in vLLM
and SGLang. At position ``t`` it merges the model's hidden state ``h_t`` (the last block's
output before the final norm: what the training forward feeds it) with the embedding of token
``t + 1``, runs its block and predicts token ``t + 2`` through its own final norm and the
shared output head. A step whose row's last token sits at position ``pos`` (not yet in the
model's cache):

* draft 1 comes from the module at ``pos - 1`` (``h_{pos-1}`` and the last token), computed
  at the end of the previous step (by the prefill at first);
* drafts ``2 .. k`` chain the module on itself: at ``pos + i - 1`` it takes its own output
  (before its final norm) in place of the model's hidden state, and draft ``i``. Every draft
  uses module 0, also when the model has several: training's depth ``i`` predicts from the
  same position with the previous depth's output, which would need a cache per depth, while
  chaining one module over the next positions is what vLLM does;
* the model verifies ``[last, d_1 .. d_k]`` at ``pos .. pos + k`` and returns its hidden
  states there too; the module then runs once over those ``k + 1`` positions with the tokens
  that follow each (the kept drafts, then the model's own token), writing its KV cache over
  the chained entries. Its output at the last kept position gives the next step's draft 1.

The module's KV cache sits in the same slots as the model's (the catch-up chunk lands in the
slots the verification used), and rejected slots get segment id 0 the same way; its segment
ids and positions are kept here, beside the model. Sampled drafts come with the module's
distribution after the target's temperature, ``top_k`` and ``top_p``, the ``q`` of rejection
sampling, so sampling keeps the target's distribution and greedy decoding its tokens.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.inference.speculative import (
    _advance,
    _logprobs,
    _pick,
    _probs,
    accept_step,
    cache_slots,
)
from maxnnx.kernels.masks import AttentionMask


def decode_with_mtp(model, drafter, prompt, lengths, max_new_tokens: int, sampling, eos,
                    seed: int, kv_cache_dtype: str = 'auto'):
  """Prefill and decode ``model`` speculatively with its MTP module as drafter.

  Args:
    model: a :class:`~maxnnx.Transformer` with ``mtp.num_layers >= 1`` (not modified).
    drafter: the :class:`~maxnnx.inference.speculative.MTPDraft` settings.
    prompt: ``(ids, segment_ids, positions)`` ``[B, W]``, left-padded as
      :func:`~maxnnx.inference.generate` pads them.
    lengths: ``[B]`` prompt lengths.
    max_new_tokens: tokens to generate per row at most.
    sampling: ``(temperature, top_k, top_p)``.
    eos: ``[E]`` ids that end a row.
    seed: the sampling seed.
    kv_cache_dtype: the model's KV-cache dtype (the module's cache stays in the compute dtype).

  Returns:
    ``(tokens, logprobs, accepted, proposed, first_drafts)`` as
    :func:`mtp_speculative_decode` returns them.
  """
  ids = jnp.asarray(prompt[0])
  batch, width = ids.shape
  k = drafter.num_draft_tokens
  slots = cache_slots(width, max_new_tokens, k, batch)
  work = nnx.merge(*nnx.split(model))  # a working copy: the caches are not added to `model`
  work.init_cache(batch, slots, kv_cache_dtype=kv_cache_dtype)
  work.mtp[0].block.attn.init_cache(batch, slots, work.config.jnp_dtype())
  graphdef, params, cache = nnx.split(work, nnx.Param, ...)
  return mtp_speculative_decode(graphdef, k, sampling, max_new_tokens, params, cache,
                                tuple(jnp.asarray(x, jnp.int32) for x in prompt),
                                jnp.asarray(lengths), jnp.asarray(eos), jax.random.key(seed))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def mtp_speculative_decode(graphdef, k: int, sampling, max_new_tokens: int, params, cache,
                           prompt, lengths_B, eos_ids, key):
  """Prefill the prompts, then generate up to ``max_new_tokens`` per row with MTP drafts.

  Args:
    graphdef, params, cache: the model split with its KV cache and its MTP module 0's
      allocated (empty) for ``cache_slots`` slots.
    k: drafts per step.
    sampling: ``(temperature, top_k, top_p)``.
    max_new_tokens: tokens to generate per row at most.
    prompt: ``(ids, segment_ids, positions)`` ``[B, W]``, left-padded.
    lengths_B: ``[B]`` prompt lengths.
    eos_ids: ``[E]`` ids that end a row.
    key: the sampling key.

  Returns:
    ``(tokens, logprobs, accepted, proposed, first_drafts)``: tokens and logprobs as
    :func:`~maxnnx.inference.speculative.speculative_decode` gives them, the numbers of
    drafts kept and proposed, and ``[B, max_new_tokens + k + 1]`` the first draft of each
    step at the index of the output token it proposed (``-1`` elsewhere).
  """
  model = nnx.merge(graphdef, params, cache)
  key, first_key = jax.random.split(key)
  first_logits_BV, first_B, book, out_BD = _prefill(model, prompt, sampling, first_key)
  batch = first_B.shape[0]
  buffer = max_new_tokens + k + 1
  zero = jnp.zeros((), jnp.int32)
  first_logprob_B = _logprobs(first_logits_BV[:, None], first_B[:, None], sampling[0] or 1.0)
  carry = {
      'count': jnp.ones((batch,), jnp.int32), 'last': first_B, 'pos': lengths_B,
      'tokens': jnp.zeros((batch, buffer), jnp.int32).at[:, 0].set(first_B),
      'logprobs': jnp.zeros((batch, buffer), jnp.float32).at[:, 0].set(first_logprob_B[:, 0]),
      'firsts': jnp.full((batch, buffer), -1, jnp.int32),
      'done': jnp.isin(first_B, eos_ids) | (max_new_tokens <= 1),
      'cache': nnx.state(model, nnx.Not(nnx.Param)), 'book': book, 'out': out_BD,
      'mtp_logits': _mtp_logits(model, out_BD), 'key': key, 'accepted': zero,
      'proposed': zero}
  step = functools.partial(_step, graphdef, params, k, sampling, max_new_tokens, eos_ids)
  carry = jax.lax.while_loop(lambda c: ~jnp.all(c['done']), step, carry)
  return (carry['tokens'], carry['logprobs'], carry['accepted'], carry['proposed'],
          carry['firsts'])


def _prefill(model, prompt, sampling, key):
  """The prompts through the model and then the MTP module (whose last query gets the first
  generated token): ``(first_logits_BV, first_B, book, out_BD)``, ``out_BD`` the module's
  output at each prompt's last position."""
  ids_BW, segments_BW, positions_BW = prompt
  hidden_BWD = model.hidden_states(ids_BW, segment_ids=segments_BW, positions=positions_BW,
                                   decode=True, pre_norm=True)
  logits_BV = model.logits(model.final_norm(hidden_BWD[:, -1:]))[:, 0].astype(jnp.float32)
  first_B = (jnp.argmax(logits_BV, axis=-1).astype(jnp.int32) if sampling[0] == 0.0
             else _pick(key, _probs(logits_BV, *sampling), sampling))
  batch, slots = model.cache_positions.shape
  book = (jnp.zeros((batch, slots), jnp.int32), jnp.zeros((batch, slots), jnp.int32),
          jnp.zeros((), jnp.int32))
  next_ids_BW = jnp.concatenate([ids_BW[:, 1:], first_B[:, None]], axis=1)
  out_BWD, book = _mtp_run(model, hidden_BWD, next_ids_BW, segments_BW, positions_BW, book)
  return logits_BV, first_B, book, out_BWD[:, -1]


def _mtp_run(model, hidden_BTD, next_ids_BT, segments_BT, positions_BT, book):
  """MTP module 0 on ``T`` queries written at the book's index: ``(out_BTD, book)``.

  ``book`` is ``(segment_ids_BS, positions_BS, index)`` of the module's cache slots.
  """
  segments_BS, positions_BS, index = book
  segments_BS = jax.lax.dynamic_update_slice(segments_BS, segments_BT, (0, index))
  positions_BS = jax.lax.dynamic_update_slice(positions_BS, positions_BT, (0, index))
  mask = AttentionMask(segments_BT, positions_BT, segments_BS, positions_BS)
  out_BTD = model.mtp_decode(0, hidden_BTD, next_ids_BT, mask, index)
  return out_BTD, (segments_BS, positions_BS, index + next_ids_BT.shape[1])


def _mtp_logits(model, out_BD):
  """Float32 logits ``[B, V]`` of the module's outputs (its final norm, the shared head)."""
  return model.logits(model.mtp[0].final_norm(out_BD[:, None]))[:, 0].astype(jnp.float32)


def _mtp_drafts(model, book, out_BD, logits_BV, pos_B, k: int, sampling, key):
  """``k`` drafts: the first of ``logits_BV`` (the module at ``pos - 1``), the next ones of
  the module chained on its own output at ``pos .. pos + k - 2``.

  Returns drafts ``[B, k]`` and their distributions ``[B, k, V]`` (``None`` when greedy).
  The chained entries land in the module's cache past the book's index (written over by
  the catch-up); the book itself is not returned.
  """
  ones_B1 = jnp.ones((pos_B.shape[0], 1), jnp.int32)
  drafts, dists = [], []
  for i in range(k):
    if i:
      out_B1D, book = _mtp_run(model, out_BD[:, None], drafts[-1][:, None], ones_B1,
                               (pos_B + i - 1)[:, None], book)
      out_BD = out_B1D[:, 0]
      logits_BV = _mtp_logits(model, out_BD)
    if sampling[0] == 0.0:
      drafts.append(jnp.argmax(logits_BV, axis=-1).astype(jnp.int32))
    else:
      probs_BV = _probs(logits_BV, *sampling)
      drafts.append(_pick(jax.random.fold_in(key, i), probs_BV, sampling))
      dists.append(probs_BV)
  return jnp.stack(drafts, axis=1), jnp.stack(dists, axis=1) if dists else None


def _kill_book(book, start, kept_B, advance):
  """The book after a step: rejected slots below the new index get segment id 0 (as
  :func:`~maxnnx.inference.speculative._advance` does to the model's), the index moves on."""
  segments_BS, positions_BS, _ = book
  slot_S = jnp.arange(segments_BS.shape[1])
  dead_BS = (slot_S[None] > start + kept_B[:, None]) & (slot_S[None] < start + advance)
  return jnp.where(dead_BS, 0, segments_BS), positions_BS, start + advance


def _step(graphdef, params, k, sampling, max_new_tokens, eos_ids, c):
  """One draft-verify-catch-up step of :func:`mtp_speculative_decode` on its carry ``c``."""
  batch = c['last'].shape[0]
  rows_B = jnp.arange(batch)
  key, draft_key, accept_key, pick_key = jax.random.split(c['key'], 4)
  model = nnx.merge(graphdef, params, c['cache'])
  start = model.cache_index[...]
  drafts_BK, q_BKV = _mtp_drafts(model, c['book'], c['out'], c['mtp_logits'], c['pos'], k,
                                 sampling, draft_key)
  inputs_BT = jnp.concatenate([c['last'][:, None], drafts_BK], axis=1)
  ones_BT = jnp.ones(inputs_BT.shape, jnp.int32)
  positions_BT = c['pos'][:, None] + jnp.arange(k + 1)
  hidden_BTD = model.hidden_states(inputs_BT, segment_ids=ones_BT, positions=positions_BT,
                                   decode=True, pre_norm=True)
  logits_BTV = model.logits(model.final_norm(hidden_BTD)).astype(jnp.float32)
  _, kept_B, out_BT = accept_step(logits_BTV, drafts_BK, jnp.ones((batch, k), bool), q_BKV,
                                  sampling, (accept_key, pick_key))
  running_B = ~c['done']
  keep_BT = (jnp.arange(k + 1)[None] <= kept_B[:, None]) & running_B[:, None]
  buffer = c['tokens'].shape[1]
  index_BT = jnp.where(keep_BT, c['count'][:, None] + jnp.arange(k + 1), buffer)
  logprobs_BT = _logprobs(logits_BTV, out_BT, sampling[0] or 1.0)
  gained_B = jnp.where(running_B, kept_B + 1, 0)
  advance = jnp.max(gained_B)
  # Catch-up: the module at the verified positions, with the token after each.
  out_BTD, book = _mtp_run(model, hidden_BTD, out_BT, ones_BT, positions_BT, c['book'])
  out_BD = jnp.where(running_B[:, None], out_BTD[rows_B, kept_B], c['out'])
  _advance(model, start, kept_B, advance)
  count_B = c['count'] + gained_B
  ended_B = jnp.any(keep_BT & jnp.isin(out_BT, eos_ids), axis=1)
  return {
      'count': count_B, 'last': jnp.where(running_B, out_BT[rows_B, kept_B], c['last']),
      'pos': c['pos'] + gained_B,
      'tokens': c['tokens'].at[rows_B[:, None], index_BT].set(out_BT, mode='drop'),
      'logprobs': c['logprobs'].at[rows_B[:, None], index_BT].set(logprobs_BT, mode='drop'),
      'firsts': c['firsts'].at[rows_B, jnp.where(running_B, c['count'], buffer)].set(
          drafts_BK[:, 0], mode='drop'),
      'done': c['done'] | ended_B | (count_B >= max_new_tokens),
      'cache': nnx.state(model, nnx.Not(nnx.Param)),
      'book': _kill_book(book, start, kept_B, advance), 'out': out_BD,
      'mtp_logits': _mtp_logits(model, out_BD), 'key': key,
      'accepted': c['accepted'] + jnp.sum(jnp.where(running_B, kept_B, 0)),
      'proposed': c['proposed'] + jnp.sum(jnp.where(running_B, k, 0))}

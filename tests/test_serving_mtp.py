"""DeepSeek V3's MTP module as the serving engine's drafter (maxnnx.serving.mtp_runner): the
target step's hidden states, the module over a paged step's flat tokens (two requests, one
prefilled in two chunks, pages out of order) against the training forward's MTP logits, the
chained drafts against a dense loop over the module fed its own outputs, and the engine
drafting with it: greedy tokens of the plain engine, sampled tokens of the model's
distribution."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES
from flax import nnx
from test_serving_engine import _assert_idle, _run_staggered
from test_serving_speculative import sampled_engine_pvalue
from test_speculative_mtp import _model

import maxnnx
from maxnnx.kernels.masks import AttentionMask
from maxnnx.serving import Engine
from maxnnx.serving.model_runner import ModelRunner
from maxnnx.serving.mtp_runner import MTPDrafter, MTPRunner, next_token_ids
from maxnnx.serving.params import SamplingParams
from maxnnx.serving.scheduler import Request

PAGE_SIZE, NUM_PAGES, K = 4, 12, 4
PROMPTS = ([11, 200, 3, 47, 90, 5, 133, 61, 8, 250, 19], [7, 99, 180, 42, 6, 71, 23])
NEXT = (77, 140)  # the token generated after each prompt
PAGES = ([3, 9, 1], [5, 2])  # out of order; no page for the chained positions past them


@pytest.fixture(scope='module')
def setup():
  model = _model(seed=3)
  runner = ModelRunner(model, num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_batch=3,
                       token_buckets=(16,), page_buckets=(4,), return_hidden=True)
  mtp = MTPRunner(model, runner, K)
  mtp.warm()
  return model, runner, mtp


def _requests():
  return [Request(i, list(p) + [n], len(p), SamplingParams(), 0, pages=list(pages))
          for i, (p, n, pages) in enumerate(zip(PROMPTS, NEXT, PAGES))]


def _prefill(runner, mtp):
  """Both prompts through the target and the module: row 0 in chunks of 6 and 5 tokens, row 1
  whole in the first step. Returns per request ``{position: (hidden, logits, out)}``."""
  requests = _requests()
  steps = [[(requests[0], 6), (requests[1], 7)], [(requests[0], 5)]]
  seen = [{}, {}]
  for scheduled in steps:
    inputs = runner.layout(scheduled, lambda r: 0, {})
    runner.run(inputs)
    width = len(inputs[0])
    next_T = next_token_ids([(r.token_ids, r.num_computed, n) for r, n in scheduled], width)
    logits_TV, out_TD = mtp.run(inputs, runner.hidden_TD, next_T, np.arange(width))
    offset = 0
    for request, count in scheduled:
      for j in range(count):
        seen[request.request_id][request.num_computed + j] = tuple(
            np.asarray(a[offset + j]) for a in (runner.hidden_TD, logits_TV, out_TD))
      offset += count
      request.num_computed += count
  return requests, seen


def test_mtp_logits_at_every_position_equal_the_training_forward(setup):
  """The target's hidden states before the final norm and the module's logits at each token
  of both prompts (the last one fed the generated token) equal ``model(ids, mtp=True)``'s."""
  model, runner, mtp = setup
  _, seen = _prefill(runner, mtp)
  forward = nnx.jit(lambda m, ids: (m.hidden_states(ids, pre_norm=True)[0],
                                    m(ids, mtp=True)[1][0][0]))
  for row, (prompt, token) in enumerate(zip(PROMPTS, NEXT)):
    hidden_TD, mtp_TV = forward(model, jnp.asarray([list(prompt) + [token]]))
    assert sorted(seen[row]) == list(range(len(prompt)))
    for position in range(len(prompt)):
      hidden, logits, _ = seen[row][position]
      np.testing.assert_allclose(hidden, hidden_TD[position], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(logits, mtp_TV[position], rtol=1e-5, atol=1e-5)


@nnx.jit
def _dense_module(model, hidden_1TD, following_1T):
  """The module's logits ``[T, V]`` over a whole sequence, densely (causal, no cache)."""
  positions = jnp.arange(hidden_1TD.shape[1])[None]
  call = model._layer_call(model.config.num_layers - 1, model._cos_sin(positions),
                           AttentionMask.causal(jnp.ones_like(positions), positions))
  out_TD = model._mtp_block(model.mtp[0], hidden_1TD, following_1T, positions, call)[0]
  return out_TD, model.logits(model.mtp[0].final_norm(out_TD[None]))[0]


def _dense_drafts(model, prompt, token, k):
  """``k`` greedy drafts of the module run densely over the whole sequence each time: the
  target's hidden states at the prompt, then the module's own outputs, each position fed the
  token after it (the generated token, then the drafts). Padded to 16 tokens at the end (one
  compile; causal, so the padding changes nothing before it)."""
  hidden = np.zeros((1, 16, model.config.d_model), np.float32)
  following = np.zeros((1, 16), np.int32)
  hidden[0, :len(prompt)] = model.hidden_states(jnp.asarray([prompt]), pre_norm=True)[0]
  following[0, :len(prompt)] = list(prompt[1:]) + [token]
  drafts, logits = [], []
  for i in range(k):
    last = len(prompt) - 1 + i
    out_TD, logits_TV = _dense_module(model, jnp.asarray(hidden), jnp.asarray(following))
    logits.append(np.asarray(logits_TV[last]))
    drafts.append(int(np.argmax(logits[-1])))
    hidden[0, last + 1] = out_TD[last]
    following[0, last + 1] = drafts[-1]
  return drafts, np.stack(logits)


def test_chained_drafts_equal_a_dense_loop_over_the_module(setup):
  """From each prompt's last position, ``k`` drafts (the chained ones at positions past the
  request's pages, on the row's private pages) equal a dense loop's, logits too; the middle
  row drafts nothing. Every bucket was compiled by ``warm``: these calls compile nothing."""
  model, runner, mtp = setup
  traces = list(mtp.traces)
  assert traces[0] >= len(runner.step_buckets())
  requests, seen = _prefill(runner, mtp)
  rows = [requests[0], None, requests[1]]
  out_BD = jnp.asarray(np.stack([seen[r.request_id][r.num_prompt - 1][2] if r else
                                 np.zeros(model.config.d_model, np.float32) for r in rows]))
  logits_BV = jnp.asarray(np.stack([seen[r.request_id][r.num_prompt - 1][1] if r else
                                    np.zeros(model.config.vocab_size, np.float32)
                                    for r in rows]))
  drafts_BK, logits_BKV = mtp.chain(
      out_BD, logits_BV, [None if r is None else (r.pages, r.num_prompt - 1) for r in rows])
  for b, request in enumerate(rows):
    if request is None:
      continue
    drafts, logits = _dense_drafts(model, PROMPTS[request.request_id],
                                   NEXT[request.request_id], K)
    np.testing.assert_array_equal(np.asarray(drafts_BK[b]), drafts)
    np.testing.assert_allclose(np.asarray(logits_BKV[b]), logits, rtol=1e-5, atol=1e-5)
  assert len(set(np.asarray(drafts_BK[0]).tolist())) > 1
  assert mtp.traces[1] == traces[1] == 1  # the one page bucket, compiled by warm


def test_a_model_without_mtp_modules_is_refused():
  """One line naming the fix."""
  cfg = maxnnx.config_from_pretrained(os.path.join(FIXTURES, 'deepseek_v3'),
                                      mtp={'num_layers': 0})
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r'mtp.num_layers=0; use a checkpoint') as error:
    MTPRunner(model, None, 2)
  assert '\n' not in str(error.value)


ENGINE = dict(page_size=4, max_batch=4, token_budget=32, max_model_len=64, max_pages=40,
              token_buckets=(8, 32), page_buckets=(16,))


def test_engine_with_mtp_drafts_streams_the_plain_engines_greedy_tokens():
  """Eight staggered requests (chunked prefill, rows joining mid-run) through a warm engine
  drafting with the module (``speculative_method='mtp'``) stream the plain engine's greedy
  tokens request by request and compile nothing after warm-up. Each step's first draft of a
  request with ``n`` tokens is the argmax of the training forward's MTP logits at position
  ``n - 2`` of its final sequence (an off-by-one hidden state or token gives others)."""
  model = _model(context=0.005)  # close to a bigram model the module predicts: some kept
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, 256, n).tolist() for n in (5, 17, 11, 3, 26, 9, 14, 30)]
  params = [SamplingParams(max_tokens=m, ignore_eos=True)
            for m in (20, 12, 23, 25, 8, 20, 21, 6)]
  arrivals = [0, 0, 0, 1, 2, 2, 3, 5]
  want, _ = _run_staggered(Engine(model, **ENGINE), prompts, params, arrivals)
  engine = Engine(model, **ENGINE, speculative_method='mtp', num_speculative_tokens=3)
  assert isinstance(engine.drafter, MTPDrafter)
  engine.warmup()
  firsts, propose = [], engine.drafter.before_schedule

  def recording(running):
    propose(running)
    firsts.extend((tuple(r.token_ids[:r.num_prompt]), r.num_tokens, r.draft_ids[0])
                  for r in running if r.draft_ids)

  engine.drafter.before_schedule = recording
  got, _ = _run_staggered(engine, prompts, params, arrivals)
  for i in range(len(prompts)):
    assert got[i] == want[i], i
  assert engine.compiles.after_warmup == 0 and engine.compiles.warm
  counts = engine.spec
  assert counts.draft_tokens > 50 and counts.accepted_tokens > 0
  assert counts.accepted_per_position[2] > 0  # third drafts: two chained steps
  _assert_first_drafts(model, prompts, got, firsts)
  assert len(firsts) >= 40


def _assert_first_drafts(model, prompts, outputs, firsts):
  """Each recorded first draft ``(prompt, n, draft)`` of a request with ``n`` tokens is the
  argmax of the training forward's MTP logits at position ``n - 2`` of its final sequence,
  and most differ from the argmax at ``n - 1`` (the check sees an off-by-one)."""
  sequences = np.zeros((len(prompts), ENGINE['max_model_len']), np.int32)
  segments = np.zeros_like(sequences)
  for i, prompt in enumerate(prompts):  # right-padded
    sequences[i, :len(prompt) + len(outputs[i])] = prompt + outputs[i]
    segments[i, :len(prompt) + len(outputs[i])] = 1
  forward = nnx.jit(lambda m, ids, segments: m(ids, segment_ids=segments, mtp=True)[1][0])
  predicted = np.asarray(jnp.argmax(forward(model, sequences, segments), axis=-1))
  row = {tuple(prompt): i for i, prompt in enumerate(prompts)}
  shifted = 0
  for prompt, n, draft in firsts:
    assert draft == predicted[row[prompt], n - 2], (prompt, n)
    shifted += int(draft != predicted[row[prompt], n - 1])
  assert shifted > len(firsts) // 2


def test_a_decoding_request_a_step_left_out_drafts_at_the_next():
  """Four short prompts prefilled in one step, then a token budget of 8 that two decoding
  rows with three drafts each fill: the other two decoding requests are left out of steps,
  and each drafts at the step it is scheduled anyway, from the module's output stored when
  its last token was run (first drafts the training forward's MTP argmax); the tokens are
  the plain engine's."""
  model = _model(context=0.005)
  small = dict(ENGINE, token_budget=8, token_buckets=(8,))
  rng = np.random.default_rng(6)
  prompts = [rng.integers(0, 256, n).tolist() for n in (3, 2, 1, 2)]
  params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (10, 8, 9, 7)]
  want, _ = _run_staggered(Engine(model, **small), prompts, params, [0] * 4)
  engine = Engine(model, **small, speculative_method='mtp', num_speculative_tokens=3)
  drafter = engine.drafter
  propose, keep = drafter.before_schedule, drafter.after_step
  last, firsts, left_out = set(), [], []

  def after_step(scheduled, inputs, outputs):
    last.clear()
    last.update(id(request) for request, _ in scheduled)
    keep(scheduled, inputs, outputs)

  def before_schedule(running):
    propose(running)
    for r in running:
      if drafter.room(r):
        assert r.draft_ids, (r.request_id, r.num_tokens)
        firsts.append((tuple(r.token_ids[:r.num_prompt]), r.num_tokens, r.draft_ids[0]))
        left_out.append(id(r) not in last)

  drafter.after_step, drafter.before_schedule = after_step, before_schedule
  got, _ = _run_staggered(engine, prompts, params, [0] * 4)
  assert got == want
  assert sum(left_out) >= 3 and engine.spec.accepted_tokens > 0
  _assert_first_drafts(model, prompts, got, firsts)
  _assert_idle(engine)


def test_sampled_engine_tokens_with_mtp_drafts_keep_the_models_distribution():
  """The first three tokens of 1,600 sampled engine requests (temperature 1.5, top-k 6 of 8)
  drafted by the MTP module (its first draft and a chained one): a chi-square test over the
  joint cells against the model's exact float64 distribution; drafts were kept and
  rejected."""
  rows = 1600
  engine, pvalue, cells = sampled_engine_pvalue(_model(vocab_size=8), speculative_method='mtp')
  assert cells > 20
  assert pvalue > 1e-4, pvalue
  counts = engine.spec
  assert counts.drafts > rows // 2 and counts.accepted_per_position[1] > 0
  assert rows // 20 < counts.accepted_tokens < counts.draft_tokens - rows // 20
  _assert_idle(engine)

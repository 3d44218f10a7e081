"""Speculative decoding with DeepSeek V3's own multi-token-prediction module as the drafter:
greedy tokens equal plain decoding, the drafts are the training forward's MTP predictions,
sampling keeps the target's distribution, and a model without MTP modules is refused."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES
from flax import nnx
from numpy_reference import randomize_params
from test_speculative import check_sampled_distribution

import maxnnx
from maxnnx.inference import MTPDraft
from maxnnx.inference.generate import _left_pad
from maxnnx.inference.mtp_draft import decode_with_mtp


def _model(seed=0, context=None, **overrides):
  """The tiny DeepSeek V3 fixture (MLA, a dense layer then routed experts) with one MTP
  module, random.

  With ``context``, the blocks' output projections are scaled by it, so the model is close
  to a bigram model, and the MTP module is set to predict that bigram model's next token
  from the token it is fed (its embedding half of ``eh_proj`` the identity, plus a little
  of the hidden half): its drafts are kept at some steps and not at others.
  """
  cfg = maxnnx.config_from_pretrained(os.path.join(FIXTURES, 'deepseek_v3'),
                                      mtp={'num_layers': 1}, **overrides)
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed + 1)
  randomize_params(model, rng)
  if context is None:
    return model
  for path, node in list(nnx.iter_graph(model)):
    if isinstance(node, nnx.Param) and ('o_proj' in path or 'down_proj' in path):
      node[...] = node[...] * context
  layer, d = model.mtp[0], cfg.d_model
  layer.proj.kernel[...] = jnp.concatenate(
      [jnp.eye(d), jnp.asarray(rng.normal(size=(d, d)) * 0.01)]).astype(jnp.float32)
  layer.final_norm.scale[...] = model.final_norm.scale[...]
  layer.embed_norm.scale[...] = jnp.ones((d,), jnp.float32)
  return model


def _prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(0, 256, 9).tolist(), rng.integers(0, 256, 4).tolist(),
          rng.integers(0, 256, 6).tolist()]


@pytest.fixture(scope='module')
def deepseek():
  return _model(context=0.005)


@pytest.mark.parametrize('k', [1, 3])
def test_greedy_tokens_equal_plain_decoding(deepseek, k):
  """Three left-padded rows of different lengths: the tokens of plain greedy decoding, with
  some drafts kept and some rejected (rows keep different counts)."""
  prompts = _prompts()
  plain = maxnnx.generate(deepseek, prompts, 20, eos_ids=None)
  result = maxnnx.generate(deepseek, prompts, 20, eos_ids=None, speculative=MTPDraft(k))
  np.testing.assert_array_equal(result.tokens, plain.tokens)
  np.testing.assert_allclose(result.logprobs, plain.logprobs, rtol=1e-4, atol=1e-5)
  assert result.proposed_draft_tokens > 0
  assert 0 < result.acceptance_rate < 1


def test_plain_decoding_runs_twice_on_a_model_with_mtp_modules(deepseek):
  """The prefill donates the working copy's non-parameter state; the model's own (the MTP
  module's MoE statistics, which decoding never touches) stays usable."""
  first = maxnnx.generate(deepseek, [[5, 6, 7]], 4, eos_ids=None)
  again = maxnnx.generate(deepseek, [[5, 6, 7]], 4, eos_ids=None)
  np.testing.assert_array_equal(first.tokens, again.tokens)


def test_first_drafts_are_the_training_forwards_mtp_predictions():
  """At each step the first draft is the argmax of the MTP logits that ``model(ids,
  mtp=True)`` computes for the position two before the drafted token, over the decoded
  sequence: the module got the model's hidden state at that position and the token after
  it (an off-by-one hidden state or token gives other drafts). A random model, so the
  drafts are mostly rejected and the neighbouring positions' predictions differ."""
  model = _model(seed=2)
  prompts = _prompts()
  steps = 12
  ids, segments, positions, lengths = _left_pad(prompts, None, 0)
  tokens, _, _, _, firsts = decode_with_mtp(model, MTPDraft(2), (ids, segments, positions),
                                            lengths, steps, (0.0, None, None),
                                            np.zeros((0,), np.int32), 0)
  tokens, firsts = np.asarray(tokens), np.asarray(firsts)
  width = max(len(prompt) for prompt in prompts) + steps
  sequences = np.zeros((len(prompts), width), np.int32)
  segments = np.zeros((len(prompts), width), np.int32)
  for row, prompt in enumerate(prompts):  # right-padded: the training forward's layout
    sequences[row, :len(prompt) + steps] = prompt + tokens[row, :steps].tolist()
    segments[row, :len(prompt) + steps] = 1
  forward = nnx.jit(lambda m, ids, segments: m(ids, segment_ids=segments, mtp=True)[1][0])
  predicted = np.asarray(jnp.argmax(forward(model, sequences, segments), axis=-1))
  checked = shifted = 0
  for row, prompt in enumerate(prompts):
    for index in np.flatnonzero(firsts[row, :steps] >= 0):
      at = len(prompt) + index - 2  # the drafted token sits at len(prompt) + index
      assert firsts[row, index] == predicted[row, at], (row, index)
      shifted += int(firsts[row, index] != predicted[row, at + 1])
      checked += 1
  assert checked >= 2 * steps
  assert shifted > checked // 2


def test_sampling_keeps_the_target_distribution():
  """The first three sampled tokens of 6,000 rows follow the target's exact distribution
  (temperature 1.5, top-k 6 of 8): a chi-square test over the joint cells, with the MTP
  module's distributions as ``q`` (of the first draft and of the chained one)."""
  vocab, steps, rows = 8, 3, 6000
  model = _model(vocab_size=vocab)
  prompt = [1, 2, 3, 1, 2, 3, 1, 2]
  check_sampled_distribution(model, prompt, MTPDraft(2), steps, rows)


def test_a_model_without_mtp_modules_is_refused():
  """One line naming the fix; bad settings name the field."""
  cfg = maxnnx.config_from_pretrained(os.path.join(FIXTURES, 'deepseek_v3'),
                                      mtp={'num_layers': 0})
  model = nnx.eval_shape(lambda: maxnnx.Transformer(cfg, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r'mtp.num_layers=0; use a checkpoint') as error:
    maxnnx.generate(model, [[1, 2]], 4, speculative=MTPDraft(2))
  assert '\n' not in str(error.value)
  with pytest.raises(ValueError, match='num_draft_tokens=0'):
    maxnnx.generate(model, [[1, 2]], 4, speculative=MTPDraft(num_draft_tokens=0))

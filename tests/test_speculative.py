"""Speculative decoding: greedy tokens equal plain decoding for every drafter, sampling keeps
the target's distribution (a chi-square test against float64 NumPy), and bad settings are
refused."""

import numpy as np
import pytest
from flax import nnx
from scipy import stats

import maxnnx
from maxnnx.inference import DraftModel, PromptLookup
from maxnnx.inference.speculative import prompt_lookup_drafts

FAMILIES = {
    'llama': {},
    'qwen3_scanned': {'family': 'qwen3', 'attention.qk_norm': 'head', 'runtime.scan_layers': True},
    'moe_sliding': {'moe.num_experts': 4, 'moe.num_experts_per_tok': 2,
                    'attention.sliding_window': 5,
                    'layer_types': ('sliding', 'full', 'sliding')},
}


def _model(seed=3, vocab=97, **overrides):
  cfg = maxnnx.ModelConfig.from_dict(dict(
      vocab_size=vocab, d_model=48, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=96,
      max_position_embeddings=256, initializer_range=1.0, **overrides))
  return maxnnx.Transformer(cfg, rngs=nnx.Rngs(seed))


def _prompts():
  """A prompt that repeats itself (prompt lookup finds matches) and a random shorter one."""
  rng = np.random.default_rng(0)
  return [rng.integers(0, 97, 6).tolist() * 3, rng.integers(0, 97, 5).tolist()]


@pytest.mark.parametrize('family', list(FAMILIES))
def test_greedy_tokens_equal_plain_decoding_for_every_drafter(family):
  """Prompt lookup, the model as its own draft (every draft kept) and an unrelated random
  draft model (most drafts rejected) all give plain generate's tokens, in a left-padded
  batch whose rows keep different numbers of drafts."""
  overrides = FAMILIES[family]
  model = _model(**overrides)
  prompts = _prompts()
  plain = maxnnx.generate(model, prompts, 14, eos_ids=None)
  drafters = {'lookup': PromptLookup(num_draft_tokens=3),
              'self': DraftModel(model, num_draft_tokens=3),
              'other': DraftModel(_model(seed=8, **overrides), num_draft_tokens=3)}
  for name, drafter in drafters.items():
    result = maxnnx.generate(model, prompts, 14, eos_ids=None, speculative=drafter)
    np.testing.assert_array_equal(result.tokens, plain.tokens, err_msg=name)
    assert result.proposed_draft_tokens > 0, name
    if name == 'self':
      assert result.acceptance_rate == 1.0
    if name == 'other':
      assert result.acceptance_rate < 0.5


def test_speculative_stops_at_eos_and_keeps_the_logprobs():
  """Batch 1: a row ends at its first end id (pad after), as plain decoding's does, with the
  same log-probabilities; the model as its own draft keeps all 3 drafts of each step."""
  model = _model()
  prompt = _prompts()[0]
  free = maxnnx.generate(model, [prompt], 10, eos_ids=None)
  eos = int(free.tokens[0, 4])
  plain = maxnnx.generate(model, [prompt], 10, eos_ids=[eos], pad_id=-1)
  for drafter in (PromptLookup(num_draft_tokens=3), DraftModel(model, num_draft_tokens=3)):
    result = maxnnx.generate(model, [prompt], 10, eos_ids=[eos], pad_id=-1,
                             speculative=drafter)
    np.testing.assert_array_equal(result.tokens, plain.tokens)
    np.testing.assert_array_equal(result.lengths, plain.lengths)
    np.testing.assert_allclose(result.logprobs, plain.logprobs, rtol=1e-4, atol=1e-5)
    if isinstance(drafter, DraftModel):
      # The first token comes from the prefill, then each step keeps 3 drafts and adds 1.
      steps = -(-(int(plain.lengths[0]) - 1) // 4)
      assert result.accepted_draft_tokens == result.proposed_draft_tokens == 3 * steps


def _lookup_reference(context, k, max_ngram, min_ngram):
  for n in range(max_ngram, min_ngram - 1, -1):
    if len(context) <= n:
      continue
    suffix = context[-n:]
    for start in range(len(context) - n - 1, -1, -1):
      if context[start:start + n] == suffix:
        follow = context[start + n:start + n + k]
        return follow + [0] * (k - len(follow)), [True] * len(follow) + [False] * (
            k - len(follow))
  return [0] * k, [False] * k


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
  """Drafts equal a plain-Python search: the longest suffix first, its latest earlier
  occurrence, the tokens after it up to the known end."""
  rng = np.random.default_rng(2)
  rows = [rng.integers(0, 4, n).tolist() for n in (1, 2, 5, 9, 17, 30)] + [[1, 2, 3, 1, 2]]
  width = 32
  context = np.zeros((len(rows), width), np.int32)
  for i, row in enumerate(rows):
    context[i, :len(row)] = row
  drafts, valid = prompt_lookup_drafts(context, np.array([len(r) for r in rows]), 4, 3, 1)
  for i, row in enumerate(rows):
    want, want_valid = _lookup_reference(row, 4, 3, 1)
    assert np.asarray(valid[i]).tolist() == want_valid, row
    np.testing.assert_array_equal(np.where(want_valid, drafts[i], 0), want, err_msg=str(row))
  assert np.asarray(valid[-1]).tolist() == [True, True, True, False]
  assert np.asarray(drafts[-1, :3]).tolist() == [3, 1, 2]


def _exact_first_tokens(model, prompt, steps, temperature, top_k):
  """Float64 probabilities of every sequence of the first ``steps`` tokens (``[V] * steps``),
  from the model's cache-free logits with the temperature and top-k rule applied."""
  vocab = model.config.vocab_size
  forward = nnx.jit(lambda m, ids: m(ids))
  probs = np.ones([vocab] * 0)
  for depth in range(steps):
    tails = np.array(np.meshgrid(*[np.arange(vocab)] * depth, indexing='ij')).reshape(
        depth, -1).T if depth else np.zeros((1, 0), np.int64)
    ids = np.concatenate([np.tile(prompt, (len(tails), 1)), tails], axis=1).astype(np.int32)
    logits = np.asarray(forward(model, ids))[:, -1].astype(np.float64) / temperature
    kth = -np.sort(-logits, axis=1)[:, top_k - 1:top_k]
    logits = np.where(logits < kth, -np.inf, logits)
    step = np.exp(logits - logits.max(axis=1, keepdims=True))
    step /= step.sum(axis=1, keepdims=True)
    probs = probs[..., None] * step.reshape([vocab] * depth + [vocab])
  return probs


def _chi_square_p(samples, probs):
  """p-value of the samples' counts against ``probs`` (cells expecting < 5 pooled)."""
  vocab = probs.shape[0]
  flat = np.ravel_multi_index(samples.T, [vocab] * samples.shape[1])
  counts = np.bincount(flat, minlength=probs.size)
  expected = probs.ravel() * len(samples)
  big = expected >= 5
  observed = np.append(counts[big], counts[~big].sum())
  expected = np.append(expected[big], expected[~big].sum())
  return stats.chisquare(observed, expected).pvalue, int(big.sum())


@pytest.mark.parametrize('drafter', ['lookup', 'draft_model'])
def test_sampling_keeps_the_target_distribution(drafter):
  """The first three sampled tokens of 6,000 rows follow the target's exact distribution
  (temperature 1.5, top-k 6 of 8): a chi-square test over the joint cells. Broken rules fail
  it for both drafters (measured p < 1e-37): keeping every draft, or sampling a rejected
  position from the target instead of the residual."""
  vocab, steps, rows = 8, 3, 6000
  model = _model(vocab=vocab)
  prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # lookup drafts [3, 1, 2] at the first step
  speculative = (PromptLookup(num_draft_tokens=2) if drafter == 'lookup'
                 else DraftModel(_model(seed=8, vocab=vocab), num_draft_tokens=2))
  check_sampled_distribution(model, prompt, speculative, steps, rows)


def check_sampled_distribution(model, prompt, speculative, steps: int, rows: int) -> None:
  """``rows`` sampled continuations of ``prompt`` (temperature 1.5, top-k 6) with the
  ``speculative`` drafter: their first ``steps`` tokens pass a chi-square test over the joint
  cells against the model's exact float64 distribution, and drafts were proposed, some kept
  and some not."""
  result = maxnnx.generate(model, [prompt] * rows, steps, temperature=1.5, top_k=6,
                           eos_ids=None, seed=4, speculative=speculative)
  probs = _exact_first_tokens(model, prompt, steps, 1.5, 6)
  pvalue, cells = _chi_square_p(result.tokens[:, :steps], probs)
  assert cells > 20
  assert pvalue > 1e-4, pvalue
  assert result.proposed_draft_tokens > rows // 2
  assert 0 < result.acceptance_rate < 1


def test_bad_settings_are_refused_naming_the_field():
  """Settings, draft vocabularies, controls and recurrent layers get a one-line error."""
  model = _model()
  with pytest.raises(ValueError, match='num_draft_tokens=0'):
    maxnnx.generate(model, [[1, 2]], 4, speculative=PromptLookup(num_draft_tokens=0))
  with pytest.raises(ValueError, match='min_ngram=3, max_ngram=2'):
    maxnnx.generate(model, [[1, 2]], 4, speculative=PromptLookup(max_ngram=2, min_ngram=3))
  with pytest.raises(ValueError, match='vocab_size 50'):
    maxnnx.generate(model, [[1, 2]], 4, speculative=DraftModel(_model(vocab=50)))
  with pytest.raises(ValueError, match='logit_bias, penalties or min_tokens'):
    maxnnx.generate(model, [[1, 2]], 4, logit_bias={3: 1.0}, speculative=PromptLookup())
  with pytest.raises(ValueError, match='speculative must be'):
    maxnnx.generate(model, [[1, 2]], 4, speculative=3)
  recurrent = nnx.eval_shape(  # the check reads the config only
      lambda: maxnnx.Transformer(maxnnx.get_preset('tiny-qwen3-next'), rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r'qwen3_next.*Gated DeltaNet'):
    maxnnx.generate(recurrent, [[1, 2]], 4, speculative=PromptLookup())

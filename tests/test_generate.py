"""generate(): KV-cache decoding against cache-free references, batching, stopping, sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.inference.sampling import row_keys, sample_next_token, sample_rows
from maxnnx.serving import SamplingParams
from tests.test_sampling_controls import penalised_greedy


def _model(**overrides):
  cfg = maxnnx.ModelConfig.from_dict(dict(
      vocab_size=97, d_model=48, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=96,
      max_position_embeddings=128, initializer_range=1.0, **overrides))
  return maxnnx.Transformer(cfg, rngs=nnx.Rngs(3))


def _argmax_loop(model, prompt, steps):
  """Greedy decoding without a cache: the whole sequence re-run every step.

  The sequence lives in a buffer of its final length (zeros not yet written), so one
  compiled forward pass serves every step; causal attention keeps the zeros after
  position ``i`` out of the logits at ``i``."""
  forward = nnx.jit(lambda m, tokens: m(tokens))
  seq = np.zeros((1, len(prompt) + steps), np.int32)
  seq[0, :len(prompt)] = prompt
  for i in range(len(prompt), len(prompt) + steps):
    seq[0, i] = np.asarray(forward(model, seq))[0, i - 1].argmax()
  return seq[0, len(prompt):]


@pytest.mark.parametrize('overrides', [
    {}, {'runtime.scan_layers': True},
    {'attention.sliding_window': 5, 'layer_types': ('sliding', 'full', 'sliding')},
    # GPT-OSS-like (sinks, biases, clamped MoE); the gpt_oss HF parity case decodes in the
    # default suite.
    pytest.param({'attention.sliding_window': 5, 'layer_types': ('sliding', 'full', 'sliding'),
                  'runtime.scan_layers': True, 'attention.sinks': True, 'attention.qkv_bias': True,
                  'moe.num_experts': 4, 'moe.num_experts_per_tok': 2, 'moe.router_bias': True,
                  'moe.expert_bias': True, 'moe.swiglu_limit': 1.0}, marks=pytest.mark.slow),
], ids=['list', 'scan', 'sliding', 'gpt_oss_like'])
def test_greedy_equals_cache_free_argmax(overrides):
  """Greedy generation with the KV cache equals re-running the full sequence."""
  model = _model(**overrides)
  prompt = np.random.default_rng(0).integers(0, 97, 7).tolist()
  result = maxnnx.generate(model, [prompt], max_new_tokens=10, eos_ids=None)
  np.testing.assert_array_equal(result.tokens[0], _argmax_loop(model, prompt, 10))


def test_rows_of_different_lengths_are_independent():
  """A left-padded batch gives each row what it would get alone."""
  model = _model()
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 97, n).tolist() for n in (3, 9, 6)]
  batched = maxnnx.generate(model, prompts, max_new_tokens=6, eos_ids=None)
  for row, prompt in zip(batched.tokens, prompts):
    alone = maxnnx.generate(model, [prompt], max_new_tokens=6, eos_ids=None)
    np.testing.assert_array_equal(row, alone.tokens[0])


def test_right_padded_array_with_lengths():
  """An array of right-padded prompts plus prompt_lengths equals the list form."""
  model = _model()
  prompts = [[5, 6, 7, 8], [9, 10]]
  array = np.array([[5, 6, 7, 8], [9, 10, 0, 0]])
  a = maxnnx.generate(model, array, max_new_tokens=5, prompt_lengths=[4, 2], eos_ids=None)
  b = maxnnx.generate(model, prompts, max_new_tokens=5, eos_ids=None)
  np.testing.assert_array_equal(a.tokens, b.tokens)


def test_stops_at_eos_and_pads_after():
  """Each row stops at its first EOS id; what follows is pad_id."""
  model = _model()
  prompt = [1, 2, 3]
  free = maxnnx.generate(model, [prompt], max_new_tokens=8, eos_ids=None).tokens[0]
  eos = int(free[3])
  first = int(np.argmax(free == eos))
  result = maxnnx.generate(model, [prompt], max_new_tokens=8, eos_ids=[eos], pad_id=-1)
  assert result.lengths[0] == first + 1
  np.testing.assert_array_equal(result.tokens[0, :first + 1], free[:first + 1])
  assert (result.tokens[0, first + 1:] == -1).all()
  assert result.as_lists()[0] == free[:first + 1].tolist()


def test_eos_defaults_to_the_config():
  """Without eos_ids, the model config's eos_token_id stops generation."""
  model = _model()
  free = maxnnx.generate(model, [[4, 5]], max_new_tokens=6, eos_ids=None).tokens[0]
  stopping = _model(eos_token_id=int(free[1]))
  result = maxnnx.generate(stopping, [[4, 5]], max_new_tokens=6)
  assert result.lengths[0] == int(np.argmax(free == free[1])) + 1


def test_sampling_is_seeded():
  """The same seed gives the same samples; another seed gives others."""
  model = _model()
  kwargs = dict(max_new_tokens=12, temperature=1.0, eos_ids=None)
  a = maxnnx.generate(model, [[1, 2]], seed=0, **kwargs).tokens
  b = maxnnx.generate(model, [[1, 2]], seed=0, **kwargs).tokens
  c = maxnnx.generate(model, [[1, 2]], seed=1, **kwargs).tokens
  np.testing.assert_array_equal(a, b)
  assert (a != c).any()


def test_top_k_and_top_p_restrict_the_support():
  """top-k samples only the k best tokens; top-p only the smallest set reaching p."""
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.key(0), 400)

  def sample(keys, **kwargs):
    return jax.vmap(lambda k: sample_next_token(logits, k, temperature=1.0, **kwargs)[0])(keys)

  assert set(np.asarray(sample(keys, top_k=2)).tolist()) == {0, 1}
  assert set(np.asarray(sample(keys, top_p=0.75)).tolist()) == {0, 1}
  assert set(np.asarray(sample(keys, top_p=0.85)).tolist()) == {0, 1, 2}
  assert set(np.asarray(sample(keys, top_p=0.01)).tolist()) == {0}
  counts = np.bincount(np.asarray(sample(keys)), minlength=4) / 400
  np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.07)


def test_per_row_sampling_follows_the_batch_rule():
  """The engine's per-row sampler keeps, row by row, the tokens the batch sampler keeps with the
  same setting, and a greedy row beside sampled ones stays greedy."""
  logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
  settings = [(0.0, 0, 1.0), (1.0, 2, 1.0), (1.0, 0, 0.75), (1.0, 0, 0.85), (1.0, 3, 0.75),
              (1.0, 0, 1.0)]
  rows = len(settings)
  temperature_B = jnp.array([t for t, _, _ in settings], jnp.float32)
  top_k_B = jnp.array([k for _, k, _ in settings], jnp.int32)
  top_p_B = jnp.array([p for _, _, p in settings], jnp.float32)
  logits_BV = jnp.tile(logits, (rows, 1))

  def per_row(counter):
    keys_B = row_keys(jnp.arange(rows, dtype=jnp.uint32), jnp.full((rows,), counter, jnp.int32))
    return sample_rows(logits_BV, keys_B, temperature_B, top_k_B, top_p_B)

  rows_SB = np.asarray(jax.vmap(per_row)(jnp.arange(400)))
  keys = jax.random.split(jax.random.key(0), 400)

  def batch_support(temperature, top_k, top_p):
    def draw(key):
      return sample_next_token(logits[None], key, temperature=temperature, top_k=top_k or None,
                               top_p=None if top_p >= 1 else top_p)

    return set(np.asarray(jax.vmap(draw)(keys))[:, 0].tolist())

  for row, setting in enumerate(settings):
    assert set(rows_SB[:, row].tolist()) == batch_support(*setting), setting
  assert set(rows_SB[:, 0].tolist()) == {0}
  assert set(rows_SB[:, 4].tolist()) == {0, 1}


def test_generate_leaves_the_model_without_a_cache():
  """generate works on a copy: the caller's model gets no cache variables."""
  model = _model()
  maxnnx.generate(model, [[1, 2, 3]], max_new_tokens=3)
  assert not nnx.state(model, nnx.Cache)


@pytest.mark.parametrize('bad, message', [
    (dict(prompt_ids=[[1, 200]]), r'outside \[0, 97\)'),
    (dict(prompt_ids=[[]]), 'at least one token'),
    (dict(max_new_tokens=0), 'max_new_tokens'),
    (dict(top_p=1.5), 'top_p'),
    (dict(frequency_penalty=-3), r'frequency_penalty=-3 \(need -2'),
    (dict(logit_bias={97: 1}), r'logit_bias names token 97'),
    (dict(min_tokens=4), r'min_tokens=4 \(need 0 <= min_tokens <= max_new_tokens=3'),
])
def test_bad_arguments(bad, message):
  """Bad prompts or sampling settings get a clear error before any compute."""
  kwargs = dict(prompt_ids=[[1, 2]], max_new_tokens=3) | bad
  with pytest.raises(ValueError, match=message):
    maxnnx.generate(_model(), **kwargs)


def test_penalties_bias_and_min_tokens_follow_their_definitions():
  """Penalised greedy rows equal the float64 NumPy reference, a bias of 100 forces its
  token, and ``min_tokens`` holds back the end-of-sequence id that bias forces."""
  model = _model()
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, 97, n).tolist() for n in (5, 11, 8)]
  penalties = dict(presence_penalty=0.7, frequency_penalty=1.2, repetition_penalty=1.5)
  got = maxnnx.generate(model, prompts, max_new_tokens=12, eos_ids=None, **penalties)
  want = penalised_greedy(model, prompts, [SamplingParams(**penalties)] * 3, 12)
  assert got.as_lists() == want
  assert want != maxnnx.generate(model, prompts, max_new_tokens=12, eos_ids=None).as_lists()
  forced = maxnnx.generate(model, prompts, max_new_tokens=12, logit_bias={7: 100.0},
                           eos_ids=None)
  assert (forced.tokens == 7).all()
  stops = maxnnx.generate(model, prompts, max_new_tokens=12, logit_bias={7: 100.0}, eos_ids=7,
                          min_tokens=3)
  assert stops.lengths.tolist() == [4] * 3 and (stops.tokens[:, 3] == 7).all()
  assert not (stops.tokens[:, :3] == 7).any()

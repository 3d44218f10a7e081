"""Speculative decoding in the serving engine: greedy tokens equal plain engine decoding request
by request (stop ids, max_tokens, preemption), sampled tokens keep the model's distribution,
the drafted and accepted counts (and /metrics) are what the algorithm implies, every page
comes back, and a warm engine compiles nothing while it drafts."""

import dataclasses

import numpy as np
import pytest
from flax import nnx
from scipy import stats

import maxnnx
from maxnnx.config import ConfigError, EngineConfig
from maxnnx.serving import Engine, SamplingParams
from maxnnx.serving.engine_loop import EngineLoop
from maxnnx.serving.metrics import ServerMetrics
from maxnnx.serving.speculation import ngram_drafts, verify
from tests.test_serving_engine import _assert_idle, _DigitsTokenizer, _run_staggered
from tests.test_speculative import _chi_square_p, _exact_first_tokens, _lookup_reference, _model

VOCAB = 97
# 24 pages of 4 tokens for 6 rows of up to 64 tokens (full batches preempt), with few
# buckets so that the module compiles little.
ENGINE = dict(page_size=4, max_batch=6, token_budget=32, max_model_len=64, max_pages=24,
              token_buckets=(8, 32), page_buckets=(16,))
SPEC = dict(speculative_method='ngram', num_speculative_tokens=3)


@pytest.fixture(scope='module')
def model():
  return _model(vocab=VOCAB)


@pytest.fixture(scope='module')
def plain(model):
  return Engine(model, **ENGINE)


@pytest.fixture(scope='module')
def spec(model):
  return Engine(model, **ENGINE, **SPEC)


def _repeating(rng, phrase, length):
  """``length`` tokens repeating a random phrase of ``phrase`` tokens (lookup finds them)."""
  return np.resize(rng.integers(0, VOCAB, phrase), length).tolist()


def test_greedy_tokens_equal_plain_engine_decoding_request_by_request(plain, spec):
  """Ten staggered requests of different lengths, repeating and random, some stopped by a
  stop id the plain run emits mid-output, batched over a pool that preempts: the speculative
  engine streams, request by request, the plain engine's tokens and finish reasons, drafts
  are kept, and every page comes back."""
  rng = np.random.default_rng(5)
  prompts = [_repeating(rng, p, n) for p, n in ((4, 14), (6, 30), (3, 7), (5, 21), (2, 9))]
  prompts += [rng.integers(0, VOCAB, n).tolist() for n in (5, 17, 11, 3, 26)]
  max_tokens = [30, 12, 33, 25, 8, 20, 31, 6, 27, 16]
  params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
  arrivals = [0, 0, 0, 1, 2, 2, 3, 5, 8, 9]
  want, _ = _run_staggered(plain, prompts, params, arrivals)
  # Stop ids the plain run emits inside a request's output (a stop after accepted drafts).
  stops = {i: want[i][len(want[i]) // 2] for i in (0, 2, 6)}
  params = [SamplingParams(max_tokens=m, ignore_eos=True, stop_token_ids=(stops[i],)
                           if i in stops else ()) for i, m in enumerate(max_tokens)]
  want, want_finals = _run_staggered(plain, prompts, params, arrivals)
  assert any(f.finish_reason == 'stop' for f in want_finals.values())
  before = spec.spec.accepted_tokens
  got, got_finals = _run_staggered(spec, prompts, params, arrivals)
  for i in range(len(prompts)):
    assert got[i] == want[i], i
    assert got_finals[i].finish_reason == want_finals[i].finish_reason, i
    assert len(got[i]) <= max_tokens[i]
  assert spec.spec.accepted_tokens > before  # drafts were kept: several tokens per step
  assert spec.scheduler.num_preemptions > 0  # the pool ran out with drafts in flight
  _assert_idle(plain)
  _assert_idle(spec)


def test_speculation_over_an_int8_kv_cache_keeps_its_greedy_tokens(model):
  """Drafts verified against int8 pages (the drafts' keys and values quantized as they are
  written, rejected ones given back) give the int8 engine's own greedy tokens."""
  rng = np.random.default_rng(8)
  prompts = [_repeating(rng, p, n) for p, n in ((4, 14), (3, 9), (5, 21))]
  params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (24, 18, 12)]
  arrivals = [0, 0, 2]
  quantized = dict(ENGINE, kv_cache_dtype='int8')
  want, _ = _run_staggered(Engine(model, **quantized), prompts, params, arrivals)
  engine = Engine(model, **quantized, **SPEC)
  got, _ = _run_staggered(engine, prompts, params, arrivals)
  assert got == want
  assert engine.spec.accepted_tokens > 0
  _assert_idle(engine)


def _expected_counts(prompt, output, k, max_tokens, lookup=(3, 1)):
  """The verifications, draft tokens, accepted tokens and per-position acceptances that
  verifying n-gram drafts against greedy ``output`` gives one request alone (no budget cut)."""
  drafts = draft_tokens = accepted = 0
  per_position = [0] * k
  emitted = 1  # the first token comes from the prompt's step
  while emitted < len(output):
    room = min(k, max_tokens - emitted - 1)
    proposal = ngram_drafts(prompt + output[:emitted], room, *lookup) if room > 0 else []
    kept = 0
    while kept < len(proposal) and proposal[kept] == output[emitted + kept]:
      kept += 1
    if proposal:
      drafts, draft_tokens, accepted = drafts + 1, draft_tokens + len(proposal), accepted + kept
      for position in range(kept):
        per_position[position] += 1
    emitted += kept + 1
  return drafts, draft_tokens, accepted, per_position


def test_metrics_count_drafted_and_accepted_tokens_on_a_repeating_prompt(model, plain):
  """Three requests on prompts that repeat a phrase: the engine's counts equal the ones the
  drafting rule implies against the plain greedy output, and /metrics reports them with
  their ratio."""
  rng = np.random.default_rng(11)
  prompts = [_repeating(rng, 4, 16), _repeating(rng, 3, 12), _repeating(rng, 5, 20)]
  params = SamplingParams(max_tokens=24, ignore_eos=True)
  outputs = [list(c.token_ids) for c in plain.generate(prompts, params)]
  engine = Engine(model, **{**ENGINE, 'max_pages': 40}, **SPEC)  # no preemption
  got = [list(c.token_ids) for c in engine.generate(prompts, params)]
  assert got == outputs
  want = [_expected_counts(p, o, 3, 24) for p, o in zip(prompts, outputs)]
  drafts, draft_tokens, accepted = (sum(w[i] for w in want) for i in range(3))
  per_position = np.sum([w[3] for w in want], axis=0).tolist()
  counts = engine.spec
  assert (counts.drafts, counts.draft_tokens, counts.accepted_tokens) == (
      drafts, draft_tokens, accepted)
  assert counts.accepted_per_position == per_position
  assert accepted > 0 and 0 < counts.acceptance_rate == accepted / draft_tokens
  text = ServerMetrics().render(0, EngineLoop(engine).stats)
  assert f'maxnnx_spec_decode_num_drafts_total {drafts}\n' in text
  assert f'maxnnx_spec_decode_num_draft_tokens_total {draft_tokens}\n' in text
  assert f'maxnnx_spec_decode_num_accepted_tokens_total {accepted}\n' in text
  assert f'maxnnx_spec_decode_draft_acceptance_rate {accepted / draft_tokens}\n' in text
  assert (f'maxnnx_spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} '
          f'{per_position[0]}\n') in text
  _assert_idle(engine)


def test_ngram_drafts_equal_the_lookup_rule_of_generate():
  """The host's drafts are the latest longest earlier match's followers, as in generate."""
  rng = np.random.default_rng(2)
  rows = [rng.integers(0, 4, n).tolist() for n in (1, 2, 5, 9, 17, 30)] + [[1, 2, 3, 1, 2]]
  for row in rows:
    for k, top, bottom in ((4, 3, 1), (2, 2, 2), (5, 1, 1)):
      want, valid = _lookup_reference(row, k, top, bottom)
      assert ngram_drafts(row, k, top, bottom) == want[:sum(valid)], (row, k, top, bottom)
  assert ngram_drafts([1, 2, 3, 1, 2], 4, 3, 1) == [3, 1, 2]


def _probs(logits, temperature, top_k):
  """Float64 probabilities after temperature and top-k (rows of ``logits``)."""
  scaled = np.asarray(logits, np.float64) / temperature
  kth = -np.sort(-scaled, axis=-1)[..., top_k - 1:top_k]
  scaled = np.where(scaled < kth, -np.inf, scaled)
  out = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
  return out / out.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize('biased', [False, True])
def test_verification_keeps_the_distribution_on_a_tiny_vocabulary(biased):
  """40,000 rows verify the same two drafts under the same logits, each with its own seed:
  the first token follows p0 exactly, the second (after a kept first draft) p1, the third
  (after both) p2, by chi-square; greedy rows in the same call keep the drafts equal to the
  argmax and emit it. Keeping every draft or resampling a rejected position from p instead
  of p without the draft fails it. ``biased``: a logit bias (one id raised, one masked, other
  values at each position) shapes p first."""
  rows, vocab, temperature, top_k = 40_000, 5, 0.8, 4
  logits_SV = np.random.default_rng(0).normal(size=(3, vocab)).astype(np.float32) * 1.5
  bias_SV = np.zeros_like(logits_SV)
  if biased:
    bias_SV[:, 0], bias_SV[[0, 1, 2], [2, 3, 4]] = [1.0, -0.5, 2.0], -np.inf
  p_SV = _probs(logits_SV + bias_SV, temperature, top_k)
  drafts = [int(np.argsort(-p_SV[0])[1]), int(np.argsort(-p_SV[1])[0])]  # p0(x) < 1
  bias_ids_BSK = np.broadcast_to(np.arange(vocab, dtype=np.int32), (rows, 3, vocab))
  tokens, kept, *_ = verify(
      np.broadcast_to(logits_SV, (rows, 3, vocab)), np.tile(drafts, (rows, 1)).astype(np.int32),
      np.full(rows, 2, np.int32), np.where(np.arange(rows) < 8, 0.0, temperature).astype(
          np.float32), np.full(rows, top_k, np.int32), np.ones(rows, np.float32),
      np.arange(rows, dtype=np.int32), np.zeros(rows, np.int32), bias_ids_BSK,
      np.broadcast_to(bias_SV, (rows, 3, vocab)))
  tokens, kept = np.asarray(tokens), np.asarray(kept)
  greedy = (logits_SV + bias_SV).argmax(-1)
  assert (kept[:8] == (0 if greedy[0] != drafts[0] else 1 + (greedy[1] == drafts[1]))).all()
  assert (tokens[:8, :kept[0] + 1] == greedy[:kept[0] + 1]).all()
  tokens, kept = tokens[8:], kept[8:]
  assert ((tokens[:, 0] == drafts[0]) == (kept >= 1)).all()
  for position, chosen in enumerate((np.ones(len(kept), bool), kept >= 1, kept >= 2)):
    observed = np.bincount(tokens[chosen, position], minlength=vocab)
    expected = p_SV[position] * chosen.sum()
    live = expected > 0
    assert observed[~live].sum() == 0  # nothing outside the top-k
    assert stats.chisquare(observed[live], expected[live]).pvalue > 1e-4, position


def sampled_engine_pvalue(model, **spec):
  """1,600 sampled requests (temperature 1.5, top-k 6) of a repeating prompt through an
  engine drafting 2 tokens with ``spec``: returns the engine and the chi-square p-value and
  cell count of their first three tokens against ``model``'s exact float64 distribution."""
  prompt, steps, rows = [1, 2, 3, 1, 2, 3, 1, 2], 3, 1600
  engine = Engine(model, page_size=8, max_batch=48, token_budget=256, max_model_len=16,
                  token_buckets=(256,), page_buckets=(2,), num_speculative_tokens=2, **spec)
  params = SamplingParams(max_tokens=4, temperature=1.5, top_k=6, ignore_eos=True)
  result = engine.generate([prompt] * rows, params)
  samples = np.array([c.token_ids[:steps] for c in result])
  pvalue, cells = _chi_square_p(samples, _exact_first_tokens(model, prompt, steps, 1.5, 6))
  return engine, pvalue, cells


def test_sampled_engine_tokens_keep_the_models_distribution():
  """The first three tokens of 1,600 sampled requests (temperature 1.5, top-k 6 of 8) whose
  prompt repeats, so that the second and third often come from verified drafts: a chi-square
  test over the joint cells against the model's exact float64 distribution."""
  engine, pvalue, cells = sampled_engine_pvalue(_model(vocab=8), speculative_method='ngram')
  assert cells > 20
  assert pvalue > 1e-4, pvalue
  assert engine.spec.drafts > 1600 // 3 and engine.spec.accepted_tokens > 1600 // 20
  _assert_idle(engine)


def test_a_warm_speculative_engine_compiles_nothing_while_serving(model):
  """Warm-up compiles the verification buckets and the verifier; then mixed requests
  (greedy and sampled drafting rows beside rows with penalties, bias and log-probabilities)
  build no program."""
  engine = Engine(model, **ENGINE, **SPEC)
  assert len(engine.step_buckets()) == len(Engine(model, **ENGINE).step_buckets()) + 1
  engine.warmup()
  rng = np.random.default_rng(3)
  kinds = [dict(), dict(temperature=0.9, top_p=0.8), dict(presence_penalty=0.5),
           dict(temperature=0.7, logit_bias={3: 2.0}, logprobs=2)]
  for _ in range(3):
    prompts = [_repeating(rng, int(rng.integers(2, 6)), int(rng.integers(3, 40)))
               for _ in range(8)]
    params = [SamplingParams(max_tokens=int(rng.integers(2, 20)), ignore_eos=True,
                             **kinds[i % len(kinds)]) for i in range(8)]
    engine.generate(prompts, params)
  assert engine.spec.accepted_tokens > 0
  assert engine.compiles.after_warmup == 0 and engine.compiles.warm
  _assert_idle(engine)


@pytest.mark.parametrize('setting,message', [
    ({'speculative_method': 'eagle'}, 'speculative_method'),
    ({'num_speculative_tokens': 0}, 'Engine num_speculative_tokens=0: must be >= 1'),
    ({'prompt_lookup_min': 4, 'prompt_lookup_max': 2},
     'Engine prompt_lookup_min=4 is more than prompt_lookup_max=2'),
])
def test_bad_speculative_settings_are_refused_naming_the_field(model, setting, message):
  with pytest.raises(ConfigError, match=message):
    Engine(model, **setting)


def test_a_recurrent_model_is_refused_speculation():
  cfg = maxnnx.get_preset('tiny-qwen3-next', vocab_size=VOCAB, num_layers=2,
                          layer_types=('linear', 'full'), moe={'num_experts': 0})
  model = nnx.eval_shape(lambda: maxnnx.Transformer(cfg, rngs=nnx.Rngs(5)))  # refused first
  with pytest.raises(ValueError, match="speculative_method='none'"):
    Engine(model, max_model_len=32, **SPEC)


def test_serve_keys_set_speculation():
  """``maxnnx serve ... speculative_method=ngram num_speculative_tokens=3`` parses into the
  engine's settings; a method it does not know is refused naming the key."""
  from maxnnx.cli import _command_keys, parse_overrides
  from maxnnx.cli_keys import UsageError
  options = parse_overrides(['speculative_method=ngram', 'num_speculative_tokens=3',
                             'prompt_lookup_max=4'], _command_keys('serve'))
  config = EngineConfig(**{f.name: options[f.name] for f in dataclasses.fields(EngineConfig)})
  assert (config.speculative_method, config.num_speculative_tokens) == ('ngram', 3)
  assert (config.prompt_lookup_max, config.prompt_lookup_min) == (4, 1)
  with pytest.raises((UsageError, ConfigError), match='speculative_method'):
    parse_overrides(['speculative_method=medusa'], _command_keys('serve'))


def test_stop_strings_cut_speculated_tokens_as_plain_decoding_does(plain, spec):
  """A stop string the plain run's text reaches mid-output ends the speculative run at the
  same token with the same text (tokens kept after it in the same step are not emitted)."""
  rng = np.random.default_rng(8)
  prompts = [_repeating(rng, 3, 12), _repeating(rng, 4, 17)]
  want = plain.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
  stops = [f'<{c.token_ids[len(c.token_ids) // 2]}>' for c in want]
  for engine in (plain, spec):
    engine.tokenizer = _DigitsTokenizer()
  try:
    texts = [''.join(f'<{i}>' for i in p) for p in prompts]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, stop=s) for s in stops]
    want, got = plain.generate(texts, params), spec.generate(texts, params)
  finally:
    plain.tokenizer = spec.tokenizer = None
  for w, g in zip(want, got):
    assert w.finish_reason == g.finish_reason == 'stop'
    assert (g.token_ids, g.text) == (w.token_ids, w.text)
  _assert_idle(spec)


@pytest.mark.parametrize('family', [
    pytest.param(dict(attention={'sliding_window': 5}, layer_types=('sliding', 'full', 'sliding')),
                 id='sliding_and_full_pools'),
    pytest.param(dict(attention={'sliding_window': 6}, layer_types=('sliding',) * 3),
                 id='every_layer_sliding'),
    pytest.param(dict(attention={'type': 'mla'}, head_dim=None, mla=dict(
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12)),
                 id='mla'),
])
def test_families_with_speculation_give_generates_greedy_tokens(family):
  """Sliding windows (pages behind the window given back, in one pool or a second one) and
  MLA's compressed cache under speculation, with a budget of 8 tokens that cuts drafts: the
  tokens of greedy generate, every page back."""
  model = _model(vocab=VOCAB, **family)
  rng = np.random.default_rng(4)
  prompts = [_repeating(rng, p, n) for p, n in ((2, 3), (3, 9), (4, 14), (5, 20))]
  max_tokens = [12, 5, 10, 8]
  want = maxnnx.generate(model, prompts, max_new_tokens=12, eos_ids=None)
  engine = Engine(model, page_size=4, max_batch=3, token_budget=8, max_model_len=32, **SPEC)
  got = engine.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True)
                                  for m in max_tokens])
  for completion, row, m in zip(got, want.tokens, max_tokens):
    assert list(completion.token_ids) == row[:m].tolist()
  assert engine.spec.accepted_tokens > 0
  if engine.window_allocator is not None:
    assert engine.window_allocator.num_available == engine.max_window_pages
  _assert_idle(engine)


def test_requests_with_controls_and_logprobs_speculate_to_plain_tokens(plain, spec):
  """Greedy requests on repeating prompts with a logit bias, with ``min_tokens`` before a
  stop id the plain run would emit early, with presence, frequency and repetition penalties
  and with log-probabilities now draft (they used to decode one token per step): each gives
  the plain engine's tokens, finish reason and log-probabilities, and drafts are kept."""
  rng = np.random.default_rng(11)
  prompts = [_repeating(rng, p, n) for p, n in ((3, 12), (4, 20), (5, 15), (2, 9), (3, 18))]
  first = [c.token_ids for c in plain.generate(prompts, SamplingParams(max_tokens=12,
                                                                       ignore_eos=True))]
  mixed = [
      SamplingParams(max_tokens=14, ignore_eos=True, logit_bias={first[0][1]: -100.0,
                                                                 prompts[0][0]: 1.5}),
      SamplingParams(max_tokens=16, stop_token_ids=(first[1][2],), min_tokens=6),
      SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3),
      SamplingParams(max_tokens=12, stop_token_ids=(first[3][1],), min_tokens=4, logprobs=2,
                     logit_bias={first[3][0]: 0.7}),
      SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=0.1,
                     frequency_penalty=0.1),
      SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.1, logprobs=2),
  ]
  mild = [dict(presence_penalty=0.1, frequency_penalty=0.1), dict(repetition_penalty=1.1),
          dict(frequency_penalty=0.2)]
  penalised = [SamplingParams(max_tokens=20, ignore_eos=True, **mild[i % 3]) for i in range(5)]
  # Mixed controls, then only (mild) penalties, so that drafts are kept under penalties and
  # a count lost with them changes a later token.
  for run, params, arrivals in ((prompts + [prompts[2]], mixed, [0, 0, 1, 2, 2, 3]),
                                 (prompts, penalised, [0, 0, 1, 2, 2])):
    want_lps, got_lps = {}, {}
    want, want_finals = _run_staggered(plain, run, params, arrivals, want_lps)
    before = (spec.spec.drafts, spec.spec.accepted_tokens)
    got, got_finals = _run_staggered(spec, run, params, arrivals, got_lps)
    for i in range(len(run)):
      assert got[i] == want[i], i
      assert got_finals[i].finish_reason == want_finals[i].finish_reason, i
      assert len(got_lps.get(i, ())) == (len(got[i]) if params[i].logprobs else 0)
      for g, w in zip(got_lps.get(i, ()), want_lps.get(i, ()), strict=True):
        assert g[0] == w[0] and g[2] == w[2], i
        np.testing.assert_allclose([g[1], *g[3]], [w[1], *w[3]], rtol=1e-5, atol=1e-5)
    assert spec.spec.drafts > before[0] and spec.spec.accepted_tokens > before[1]
    if params is not penalised:
      assert len(want_finals[1].token_ids) >= 6 and len(want_finals[3].token_ids) >= 4
  _assert_idle(spec)


def test_the_verifier_masks_stop_ids_only_at_the_positions_short_of_min_tokens():
  """One greedy row whose model prefers a stop id at every position: with ``min_tokens=2``
  and nothing out yet, the stop id is masked at the first two positions, so the two drafts
  (the runners-up) are kept, and the third position emits the stop id; a logit bias moves the
  argmax; log-probabilities are of the model's own logits."""
  import types

  from maxnnx.serving.batch_sampler import BatchSampler
  from maxnnx.serving.speculation import verify_rows
  stop, vocab = 7, 8
  logits_SV = np.zeros((3, vocab), np.float32)
  logits_SV[:, stop] = 5.0
  logits_SV[[0, 1, 2], [1, 2, 3]] = 4.0  # the runner-up at each position
  sampler = BatchSampler(2, vocab, 3, stop_ids=lambda params: frozenset({stop}),
                         running=lambda: set())

  def row(**params):
    return types.SimpleNamespace(request_id=len(params), params=SamplingParams(
        max_tokens=9, **params), seed=0, output_ids=[], draft_ids=[1, 2])

  logits_BSV = np.broadcast_to(logits_SV, (2, 3, vocab))
  out = verify_rows(logits_BSV, [row(min_tokens=2, logprobs=2), row(logit_bias={5: 9.0})],
                    sampler, 2)
  assert out.tokens(0) == [1, 2, stop] and out.tokens(1) == [5]
  want = logits_SV - np.log(np.exp(logits_SV.astype(np.float64)).sum(-1, keepdims=True))
  for position, token in enumerate([1, 2, stop]):
    [lp] = out.logprobs(0, position, 2)
    assert lp.token_id == token and lp.top[0][0] == stop
    np.testing.assert_allclose(lp.logprob, want[position, token], rtol=1e-5)


def test_the_verifier_penalises_each_position_with_the_drafts_before_it():
  """A greedy row whose model prefers token 0 slightly over token 1 at every position, with a
  frequency penalty: the first draft 0 is kept, and at the next position the draft before it
  counts, so 1 wins there and the second draft (0 again) is rejected; the emitted tokens
  join the sampler's counts, which the next verification reads."""
  import types

  from maxnnx.serving.batch_sampler import BatchSampler
  from maxnnx.serving.speculation import verify_rows
  vocab = 6
  logits_SV = np.zeros((3, vocab), np.float32)
  logits_SV[:, 0], logits_SV[:, 1], logits_SV[:, 2] = 3.0, 2.9, 2.75
  request = types.SimpleNamespace(
      request_id=1, params=SamplingParams(max_tokens=9, frequency_penalty=0.2), seed=0,
      output_ids=[], draft_ids=[0, 0], token_ids=[4, 5], num_prompt=2, num_computed=1,
      num_tokens=2)
  sampler = BatchSampler(2, vocab, 0, stop_ids=lambda params: frozenset(),
                         running=lambda: {1})
  logits_BSV = np.broadcast_to(logits_SV, (2, 3, vocab))
  out = verify_rows(logits_BSV, [request], sampler, 2)
  assert out.tokens(0) == [0, 1]
  # The counts now hold 0 and 1 once each: drafts [0, 0] keep the first (2.8 over 2.75 and
  # 2.7), and then 0 counts twice (2.6), so 2 wins (counts not carried over: 1 would).
  request.output_ids, request.draft_ids = [0, 1], [0, 0]
  request.token_ids, request.num_computed, request.num_tokens = [4, 5, 0, 1], 3, 4
  assert verify_rows(logits_BSV, [request], sampler, 2).tokens(0) == [0, 2]

"""Speculative decoding with a draft model in the serving engine: greedy tokens equal plain
engine decoding request by request (the model drafting for itself keeps every draft, which
needs the draft model's keys and values of every computed token, cached prefixes included),
sampled tokens keep the model's distribution, a warm engine compiles nothing while it drafts,
``speculative_model`` loads a checkpoint, and what cannot work is refused naming the setting."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import ConfigError, EngineConfig
from maxnnx.serving import Engine, SamplingParams
from maxnnx.serving.drafters import DraftModelDrafter
from tests.test_serving_engine import _assert_idle, _run_staggered
from tests.test_serving_speculative import ENGINE, sampled_engine_pvalue
from tests.test_speculative import _model

VOCAB = 97
DRAFT = dict(speculative_method='draft_model', num_speculative_tokens=3)


@pytest.fixture(scope='module')
def model():
  return _model(vocab=VOCAB)


@pytest.fixture(scope='module')
def other():
  """An unrelated random model of the same vocabulary (most of its drafts are rejected)."""
  return _model(seed=8, vocab=VOCAB)


@pytest.fixture(scope='module')
def plain(model):
  return Engine(model, **ENGINE)


def _staggered_requests():
  """Ten prompts of 3 to 30 tokens, their greedy params and arrival steps."""
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 17, 11, 3, 26, 9, 14, 30, 7, 21)]
  max_tokens = [30, 12, 33, 25, 8, 20, 31, 6, 27, 16]
  arrivals = [0, 0, 0, 1, 2, 2, 3, 5, 8, 9]
  return prompts, max_tokens, arrivals


@pytest.mark.parametrize('drafter', ['self', 'other'])
def test_greedy_tokens_with_a_draft_model_equal_plain_engine_decoding(model, other, plain,
                                                                      drafter):
  """Ten staggered requests of different lengths, some stopped by a stop id the plain run
  emits mid-output, over a pool that preempts: the draft-model engine streams the plain
  engine's tokens and finish reasons request by request, and every page comes back. The
  model drafting for itself has every draft kept (its pool must hold its keys and values
  of every token the target computed, prefill chunks and last drafts included); an unrelated
  model has most rejected."""
  prompts, max_tokens, arrivals = _staggered_requests()
  first, _ = _run_staggered(plain, prompts, [SamplingParams(max_tokens=m, ignore_eos=True)
                                             for m in max_tokens], arrivals)
  stops = {i: first[i][len(first[i]) // 2] for i in (0, 2, 6)}
  params = [SamplingParams(max_tokens=m, ignore_eos=True, stop_token_ids=(stops[i],)
                           if i in stops else ()) for i, m in enumerate(max_tokens)]
  want, want_finals = _run_staggered(plain, prompts, params, arrivals)
  assert any(f.finish_reason == 'stop' for f in want_finals.values())
  engine = Engine(model, **ENGINE, **DRAFT, draft_model=model if drafter == 'self' else other)
  assert isinstance(engine.drafter, DraftModelDrafter)
  got, got_finals = _run_staggered(engine, prompts, params, arrivals)
  for i in range(len(prompts)):
    assert got[i] == want[i], i
    assert got_finals[i].finish_reason == want_finals[i].finish_reason, i
  counts = engine.spec
  assert counts.draft_tokens > 50
  if drafter == 'self':
    assert counts.accepted_tokens == counts.draft_tokens  # acceptance 100%
    assert counts.accepted_per_position[2] > 0  # third drafts: two chained draft steps
  else:
    assert counts.acceptance_rate < 0.5
  assert engine.scheduler.num_preemptions > 0  # the pool ran out with drafts in flight
  _assert_idle(engine)


def test_a_prefix_cache_hit_drafts_from_the_draft_models_cached_pages(model, other, plain):
  """A request whose prompt starts with six pages another request computed takes them from
  the prefix cache (the draft model never sees those tokens again), yet the model drafting
  for itself keeps every draft: the cached pages hold its keys and values too. An unrelated
  draft model gives the plain tokens as well."""
  rng = np.random.default_rng(7)
  shared = rng.integers(0, VOCAB, 24).tolist()
  prompts = [shared + rng.integers(0, VOCAB, n).tolist() for n in (3, 6, 2)]
  params = SamplingParams(max_tokens=20, ignore_eos=True)
  want = [list(c.token_ids) for c in plain.generate(prompts, params)]
  for draft in (model, other):
    engine = Engine(model, **{**ENGINE, 'max_pages': 40}, **DRAFT, draft_model=draft)
    first = engine.generate(prompts[:1], params)
    rest = engine.generate(prompts[1:], params)
    assert [list(c.token_ids) for c in first + rest] == want
    assert [c.num_cached_tokens for c in rest] == [24, 24]
    if draft is model:
      assert engine.spec.accepted_tokens == engine.spec.draft_tokens > 0
    _assert_idle(engine)


def test_sampled_tokens_with_a_draft_model_keep_the_models_distribution():
  """The first three tokens of 1,600 sampled requests (temperature 1.5, top-k 6 of 8) drafted
  by an unrelated model: a chi-square test over the joint cells against the model's exact
  float64 distribution; drafts were kept and rejected."""
  rows = 1600
  engine, pvalue, cells = sampled_engine_pvalue(
      _model(vocab=8), speculative_method='draft_model', draft_model=_model(seed=8, vocab=8))
  assert cells > 20
  assert pvalue > 1e-4, pvalue
  counts = engine.spec
  assert counts.drafts > rows // 2
  assert rows // 20 < counts.accepted_tokens < counts.draft_tokens - rows // 20
  _assert_idle(engine)


def test_a_warm_draft_model_engine_compiles_nothing_while_serving(model, other):
  """Warm-up compiles the draft model's one-token steps and its runs of every target bucket;
  then mixed requests (greedy and sampled, with penalties, bias and log-probabilities, whose
  prefill chunks and drafts take every kind of bucket) build no program."""
  engine = Engine(model, **ENGINE, **DRAFT, draft_model=other)
  drafter = engine.drafter
  assert drafter.num_warm() == len(engine.step_buckets()) + len(engine.page_buckets)
  engine.warmup()
  rng = np.random.default_rng(3)
  kinds = [dict(), dict(temperature=0.9, top_p=0.8), dict(presence_penalty=0.5),
           dict(temperature=0.7, logit_bias={3: 2.0}, logprobs=2)]
  for _ in range(3):
    prompts = [rng.integers(0, VOCAB, int(rng.integers(3, 40))).tolist() for _ in range(8)]
    params = [SamplingParams(max_tokens=int(rng.integers(2, 20)), ignore_eos=True,
                             **kinds[i % len(kinds)]) for i in range(8)]
    engine.generate(prompts, params)
  assert engine.spec.draft_tokens > 0
  assert engine.compiles.after_warmup == 0 and engine.compiles.warm
  _assert_idle(engine)


def test_speculative_model_loads_the_draft_from_a_checkpoint(model, plain, tmp_path):
  """``speculative_model=<dir>`` (``maxnnx serve``'s key) loads the draft with
  ``from_pretrained``: the model saved and drafting for itself keeps every draft."""
  maxnnx.save_pretrained(model, str(tmp_path))
  engine = Engine(model, **ENGINE, **DRAFT, speculative_model=str(tmp_path))
  prompts, max_tokens, _ = _staggered_requests()
  params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens[:4]]
  want = [c.token_ids for c in plain.generate(prompts[:4], params)]
  assert [c.token_ids for c in engine.generate(prompts[:4], params)] == want
  assert engine.spec.accepted_tokens == engine.spec.draft_tokens > 0


def test_serve_keys_set_a_draft_model():
  """``maxnnx serve ... speculative_method=draft_model speculative_model=<dir>`` parses into
  the engine's settings."""
  from maxnnx.cli import _command_keys, parse_overrides
  options = parse_overrides(['speculative_method=draft_model', 'speculative_model=runs/small',
                             'num_speculative_tokens=4'], _command_keys('serve'))
  config = EngineConfig(**{f.name: options[f.name] for f in dataclasses.fields(EngineConfig)})
  assert (config.speculative_method, config.speculative_model) == ('draft_model', 'runs/small')
  assert config.num_speculative_tokens == 4


def _recurrent_draft():
  cfg = maxnnx.get_preset('tiny-qwen3-next', vocab_size=VOCAB, num_layers=2,
                          layer_types=('linear', 'full'), moe={'num_experts': 0})
  return nnx.eval_shape(lambda: maxnnx.Transformer(cfg, rngs=nnx.Rngs(5)))


@pytest.mark.parametrize('case,message', [
    ('vocab', r"Engine draft_model: its vocab_size=50 differs from the model's 97"),
    ('recurrent', 'Engine draft_model: its Gated DeltaNet layers keep a state'),
    ('missing', "speculative_method='draft_model' needs a draft model"),
    ('ngram', "Engine draft_model is given but speculative_method='ngram'"),
    ('none', "Engine draft_model is given but speculative_method='none'"),
    ('sliding', 'every attention layer of the model slides'),
])
def test_a_draft_model_the_engine_cannot_run_is_refused_naming_the_setting(model, case,
                                                                           message):
  settings = dict(ENGINE, **DRAFT)
  draft = nnx.eval_shape(lambda: _model(vocab=VOCAB))
  if case == 'vocab':
    draft = nnx.eval_shape(lambda: _model(vocab=50))
  elif case == 'recurrent':
    draft = _recurrent_draft()
  elif case == 'missing':
    draft = None
  elif case in ('ngram', 'none'):
    settings['speculative_method'] = case
  elif case == 'sliding':
    model = _model(vocab=VOCAB, attention={'sliding_window': 6}, layer_types=('sliding',) * 3)
  with pytest.raises(ValueError, match=message):
    Engine(model, draft_model=draft, **settings)


def test_speculative_model_without_the_method_is_refused():
  with pytest.raises(ConfigError, match="speculative_model='runs/small' drafts only with"):
    EngineConfig(speculative_model='runs/small')


@pytest.mark.parametrize('family', [
    pytest.param(dict(attention={'sliding_window': 5}, layer_types=('sliding', 'full', 'sliding')),
                 id='sliding_and_full_pools'),
    pytest.param(dict(attention={'type': 'mla'}, head_dim=None, mla=dict(
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12)),
                 id='mla'),
])
def test_families_drafting_for_themselves_give_generates_greedy_tokens(family):
  """The staggered requests on a model mixing sliding and full layers (the target's sliding
  layers in a pool of their own, whose page ids part from the full pool's as pages behind the
  window go back; the draft model reads its one pool through the full page tables: drafts
  written through the sliding tables keep about half) and on MLA's compressed cache, each
  drafting for itself: the tokens of greedy generate, every draft kept, every page back."""
  model = _model(vocab=VOCAB, **family)
  prompts, max_tokens, arrivals = _staggered_requests()
  want = maxnnx.generate(model, prompts, max_new_tokens=max(max_tokens), eos_ids=None)
  engine = Engine(model, **ENGINE, **DRAFT, draft_model=model)
  got, _ = _run_staggered(engine, prompts, [SamplingParams(max_tokens=m, ignore_eos=True)
                                            for m in max_tokens], arrivals)
  for i, m in enumerate(max_tokens):
    assert got[i] == want.tokens[i, :m].tolist(), i
  assert engine.spec.accepted_tokens == engine.spec.draft_tokens > 50
  if 'layer_types' in family:
    assert engine.window_allocator is not None
    assert engine.window_allocator.num_available == engine.max_window_pages
  _assert_idle(engine)

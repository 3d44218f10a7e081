"""The serving engine against maxnnx.generate: continuous batching, chunked prefill, prefix
caching, preemption, sliding windows, MLA and MoE, sampling, stopping, cancellation, compiles."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import ConfigError, EngineConfig
from maxnnx.serving import Engine, SamplingParams
from maxnnx.serving.model_runner import bucket
from tests.test_sampling_controls import penalised_greedy

VOCAB = 97
MODEL = dict(vocab_size=VOCAB, d_model=48, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=96,
             max_position_embeddings=128, initializer_range=1.0)


def _model(**overrides):
  return maxnnx.Transformer(maxnnx.ModelConfig.from_dict({**MODEL, **overrides}),
                            rngs=nnx.Rngs(3))


@pytest.fixture(scope='module')
def model():
  return _model()


@pytest.fixture(scope='module')
def engine(model):
  """One engine for the module, so its compiled steps are reused across tests.

  40 pages of 4 tokens for 6 rows of up to 64 tokens: full batches run out of
  pages and preempt.
  """
  return Engine(model, page_size=4, max_batch=6, token_budget=32, max_model_len=64,
                max_pages=40)


def _greedy(max_tokens):
  return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _assert_idle(engine):
  assert not engine.has_unfinished()
  engine.allocator.check()
  assert engine.allocator.num_available == engine.max_pages  # nothing held: no leak


def _run_staggered(engine, prompts, params, arrivals, logprobs=None):
  """Add request ``i`` at the step ``arrivals[i]`` names; each request's streamed tokens and
  final output. ``logprobs``: a dict that gets each request's streamed log-probabilities, as
  ``(token, logprob, top ids, top logprobs)`` rows."""
  ids, streamed, finals, step = {}, {}, {}, 0
  while len(ids) < len(prompts) or engine.has_unfinished():
    for i, arrival in enumerate(arrivals):
      if arrival == step:
        ids[engine.add_request(prompts[i], params[i])] = i
    for out in engine.step():
      i = ids[out.request_id]
      streamed.setdefault(i, []).extend(out.new_token_ids)
      assert list(out.token_ids) == streamed[i]  # the stream adds up to the output
      if logprobs is not None:
        assert (out.new_logprobs is None) == (params[i].logprobs is None)
        logprobs.setdefault(i, []).extend(
            (lp.token_id, lp.logprob, [t for t, _ in lp.top], [v for _, v in lp.top])
            for lp in out.new_logprobs or ())
      if out.finished:
        finals[i] = out
    step += 1
  return streamed, finals


def test_greedy_matches_generate_for_staggered_requests(model, engine):
  """16 requests of different lengths arriving at different steps, batched continuously with
  chunked prefill (and preemption when pages run out), equal generate token for token."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in rng.integers(1, 40, 16)]
  max_tokens = [int(m) for m in rng.integers(1, 20, 16)]
  arrivals = [0] * 5 + [2] * 4 + [3] * 3 + [7] * 4
  want = maxnnx.generate(model, prompts, max_new_tokens=max(max_tokens), eos_ids=None)
  streamed, finals = _run_staggered(engine, prompts, [_greedy(m) for m in max_tokens], arrivals)
  for i, m in enumerate(max_tokens):
    assert streamed[i] == want.tokens[i, :m].tolist(), i
    assert finals[i].finish_reason == 'length' and list(finals[i].token_ids) == streamed[i]
  assert engine.scheduler.num_preemptions > 0
  # Steps mixing prefill chunks with decode rows ran only the chunk rows max_q wide.
  assert any(wide is not None and wide < engine.max_batch
             for _, _, _, wide, *_ in engine.step_shapes)
  _assert_idle(engine)


def test_prefix_cache_hits_give_identical_outputs(model, engine):
  """Prompts sharing a prefix reuse its full pages, and generate what they would alone."""
  rng = np.random.default_rng(1)
  shared = rng.integers(0, VOCAB, 13).tolist()
  prompts = [shared + rng.integers(0, VOCAB, n).tolist() for n in (1, 2, 5, 6)] + [shared[:8]]
  want = maxnnx.generate(model, prompts, max_new_tokens=6, eos_ids=None)
  first = engine.generate(prompts[:1], _greedy(6))
  rest = engine.generate(prompts[1:], _greedy(6))
  assert first[0].num_cached_tokens == 0
  # 3 full pages (12 tokens) are shared; an 8-token prompt reuses 1 page: its last token
  # must be computed again for the first output's logits.
  assert [c.num_cached_tokens for c in rest] == [12, 12, 12, 4]
  for completion, row in zip(first + rest, want.tokens):
    assert list(completion.token_ids) == row.tolist()
  _assert_idle(engine)


def test_cancel_frees_pages_and_reports_once(engine):
  """A cancelled request gives its pages back at once and is reported as cancelled."""
  long = engine.add_request(list(range(1, 30)), _greedy(30))
  other = engine.add_request(list(range(40, 50)), _greedy(5))
  engine.step()
  engine.step()
  free_before = engine.allocator.num_available
  assert engine.cancel(long)
  assert engine.allocator.num_available > free_before
  queued = engine.add_request([5, 6, 7], _greedy(3))
  assert engine.cancel(queued)  # cancelled before it ever ran
  outs = engine.step()
  cancelled = {o.request_id: o for o in outs if o.finish_reason == 'cancelled'}
  assert set(cancelled) == {long, queued}
  assert all(o.finished and o.new_token_ids == () for o in cancelled.values())
  assert len(cancelled[long].token_ids) == 2
  assert not engine.cancel(long)
  while engine.has_unfinished():
    assert all(o.request_id == other for o in engine.step())
  _assert_idle(engine)


def test_buckets_round_up_to_a_power_of_two():
  """Token counts round to powers of two, from a floor up to a cap."""
  assert [bucket(n, 8, 256) for n in (1, 8, 9, 200, 300)] == [8, 8, 16, 256, 256]


def test_compile_count_stays_bounded_across_request_mixes(engine):
  """Random mixes compile once per bucketed shape, never per mix, within the bound."""
  rng = np.random.default_rng(2)
  mixes = []
  for _ in range(3):
    n = int(rng.integers(4, 12))
    prompts = [rng.integers(0, VOCAB, k).tolist() for k in rng.integers(1, 50, n)]
    params = [_greedy(int(m)) for m in rng.integers(1, 12, n)]
    mixes.append((prompts, params, rng.integers(0, 6, n).tolist()))
    _run_staggered(engine, *mixes[-1])
  assert engine.compile_count == len(engine.step_shapes) <= engine.max_compiles()
  before = engine.compile_count
  engine.allocator.clear_cache()  # the same mixes again schedule the same steps
  for mix in mixes:
    _run_staggered(engine, *mix)
  assert engine.compile_count == before  # the same steps again: nothing compiles
  prompts = [rng.integers(0, VOCAB, k).tolist() for k in rng.integers(1, 50, 8)]
  engine.generate(prompts, [_greedy(int(m)) for m in rng.integers(1, 12, 8)])
  assert engine.compile_count == len(engine.step_shapes) <= engine.max_compiles()
  _assert_idle(engine)


def test_seeded_sampling_is_independent_of_the_batch(engine):
  """A request's samples depend on its seed only, not on what runs beside it."""
  prompt = [3, 1, 4, 1, 5, 9, 2, 6]
  sampled = SamplingParams(max_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=123,
                           ignore_eos=True)
  alone = engine.generate([prompt], sampled)[0].token_ids
  crowd = engine.generate([[7, 7, 7], prompt, list(range(20))],
                          [_greedy(5), sampled, SamplingParams(max_tokens=9, temperature=0.7,
                                                               seed=5, ignore_eos=True)])
  assert crowd[1].token_ids == alone
  other_seed = SamplingParams(max_tokens=8, temperature=1.0, seed=124, ignore_eos=True)
  assert engine.generate([prompt], other_seed)[0].token_ids != alone
  top1 = SamplingParams(max_tokens=8, temperature=1.0, top_k=1, seed=9, ignore_eos=True)
  assert engine.generate([prompt], top1)[0].token_ids == engine.generate([prompt], _greedy(8))[
      0].token_ids
  _assert_idle(engine)


def test_logprobs_are_the_models(model, engine):
  """Chosen and top-n log-probabilities equal a log-softmax of the model's logits."""
  prompt = [11, 12, 13, 14, 15]
  [done] = engine.generate([prompt], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))
  seq = np.asarray(prompt + list(done.token_ids[:-1]))[None]
  logprobs = np.asarray(jax.nn.log_softmax(model(seq)[0, len(prompt) - 1:], axis=-1))
  for step, entry in enumerate(done.logprobs):
    assert entry.token_id == done.token_ids[step]
    np.testing.assert_allclose(entry.logprob, logprobs[step, entry.token_id], atol=1e-4)
    top_ids = [i for i, _ in entry.top]
    assert top_ids == np.argsort(-logprobs[step])[:3].tolist()
    assert top_ids[0] == entry.token_id  # greedy
  _assert_idle(engine)


def test_score_prompt_is_the_models_log_softmax_and_leaves_running_requests_alone(model,
                                                                                 engine):
  """score_prompt (echo's prompt log-probabilities) between the steps of a running request:
  each token's log-probability given the ones before and the top ones equal a float64
  log-softmax of the model's logits, and the running request still gives generate's tokens."""
  prompt = np.random.default_rng(5).integers(0, VOCAB, 21).tolist()
  running = engine.add_request([3, 1, 4, 1, 5], _greedy(6))
  engine.step()
  scores = engine.score_prompt(prompt, 3)
  outputs = {}
  while engine.has_unfinished():
    outputs.update({out.request_id: out for out in engine.step() if out.finished})
  logits = np.asarray(model(np.asarray([prompt]))[0], np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  want = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  assert [s.token_id for s in scores] == prompt[1:]
  np.testing.assert_allclose([s.logprob for s in scores],
                             [want[t - 1, prompt[t]] for t in range(1, len(prompt))], rtol=1e-4)
  for t, entry in enumerate(scores, start=1):
    assert [i for i, _ in entry.top] == np.argsort(-want[t - 1])[:3].tolist()
    np.testing.assert_allclose([p for _, p in entry.top], np.sort(want[t - 1])[::-1][:3],
                               rtol=1e-4)
  assert engine.score_prompt(prompt[:1]) == () and engine.score_prompt(prompt)[0].top == ()
  greedy = maxnnx.generate(model, [[3, 1, 4, 1, 5]], max_new_tokens=6, eos_ids=None)
  assert list(outputs[running].token_ids) == greedy.tokens[0].tolist()
  for bad, message in (([], '1 to max_model_len'), ([0] * 65, '1 to max_model_len'),
                       ([VOCAB], 'outside'), ([1, 2], 'num_top')):
    with pytest.raises(ValueError, match=message):
      engine.score_prompt(bad, 9 if message == 'num_top' else 0)
  _assert_idle(engine)


class _DigitsTokenizer:
  """Token ``i`` decodes to ``<i>``."""

  eos_id = None

  def encode(self, text):
    return [int(t) for t in text.strip('<>').split('><')]

  def decode(self, ids):
    return ''.join(f'<{i}>' for i in ids)


def test_stop_ids_strings_and_length(engine):
  """Stop ids end a request (kept), stop strings cut the text, max_tokens ends it too."""
  prompt = [21, 22, 23]
  free = engine.generate([prompt], _greedy(8))[0]
  assert free.finish_reason == 'length' and len(free.token_ids) == 8
  third = free.token_ids[2]
  first_hit = free.token_ids.index(third)
  by_id = engine.generate([prompt], SamplingParams(max_tokens=8, stop_token_ids=[third]))[0]
  assert by_id.finish_reason == 'stop' and by_id.token_ids == free.token_ids[:first_hit + 1]
  engine.tokenizer = _DigitsTokenizer()
  try:
    [text] = engine.generate(['<21><22><23>'], SamplingParams(max_tokens=8, stop=f'<{third}>'))
  finally:
    engine.tokenizer = None
  assert text.finish_reason == 'stop' and text.token_ids == free.token_ids[:first_hit + 1]
  assert text.text == ''.join(f'<{i}>' for i in free.token_ids[:first_hit])
  _assert_idle(engine)


def test_load_weights_serves_the_new_parameters(model, engine):
  """After load_weights, the engine generates what the new weights generate."""
  changed = nnx.clone(model)
  changed.lm_head.kernel[...] = -changed.lm_head.kernel[...]
  prompts = [[8, 9, 10, 11, 12, 13, 14, 15, 16], [4, 2]]
  old = engine.generate(prompts, _greedy(5))
  before = engine.compile_count
  try:
    engine.load_weights(changed)
    got = engine.generate(prompts, _greedy(5))
  finally:
    engine.load_weights(model)
  want = maxnnx.generate(changed, prompts, max_new_tokens=5, eos_ids=None)
  assert [list(c.token_ids) for c in got] == want.tokens.tolist()
  assert [c.token_ids for c in got] != [c.token_ids for c in old]
  assert engine.compile_count == before  # parameters are arguments: nothing recompiles
  with pytest.raises(ValueError, match='same architecture'):
    engine.load_weights(_model(num_layers=2))
  _assert_idle(engine)


def test_requests_the_engine_cannot_serve_are_refused(engine):
  """Bad prompts and parameters fail at add_request with the reason."""
  with pytest.raises(ValueError, match=r'in \[0, 97\)'):
    engine.add_request([1, 200])
  with pytest.raises(ValueError, match='no room for output'):
    engine.add_request(list(range(64)))
  with pytest.raises(ValueError, match='max_logprobs=5'):
    engine.add_request([1], SamplingParams(logprobs=6))
  with pytest.raises(ValueError, match='tokenizer'):
    engine.add_request([1], SamplingParams(stop='x'))
  with pytest.raises(ValueError, match='top_p=0'):
    SamplingParams(top_p=0)
  with pytest.raises(ValueError, match=r'logit_bias names token 97, outside .*\[0, 97\)'):
    engine.add_request([1], SamplingParams(logit_bias={97: 1.0}))
  with pytest.raises(ValueError, match=r'frequency_penalty=2.5 \(need -2 <= '):
    SamplingParams(frequency_penalty=2.5)
  small = Engine(_model(), page_size=4, max_batch=2, token_budget=8, max_model_len=64, max_pages=3)
  with pytest.raises(ValueError, match='more than the pool holds'):
    small.add_request(list(range(10)), _greedy(8))
  assert not engine.has_unfinished()


def test_penalties_steer_greedy_decoding_as_their_definitions_say(model, engine):
  """Penalised greedy requests, batched continuously with unpenalised ones (and preempted
  when pages run out, which refills their counts from their history), give the tokens the
  NumPy reference of each penalty predicts, and those differ from plain greedy."""
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in rng.integers(8, 40, 8)]
  penalties = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(),
               dict(repetition_penalty=1.8), dict(frequency_penalty=-0.5, presence_penalty=1.0),
               dict(repetition_penalty=0.6, frequency_penalty=0.4), dict(),
               dict(presence_penalty=-1)]
  params = [SamplingParams(max_tokens=20, ignore_eos=True, **p) for p in penalties]
  preemptions = engine.scheduler.num_preemptions
  streamed, _ = _run_staggered(engine, prompts, params, [0] * 5 + [2, 3, 3])
  want = penalised_greedy(model, prompts, params, 20)
  assert [streamed[i] for i in range(8)] == want
  assert engine.scheduler.num_preemptions > preemptions
  plain = maxnnx.generate(model, prompts, max_new_tokens=20, eos_ids=None).as_lists()
  assert all((streamed[i] == plain[i]) == (not p) for i, p in enumerate(penalties))
  _assert_idle(engine)


def test_logit_bias_forces_and_bans_and_min_tokens_delays_the_stop(model, engine):
  """A bias of 100 forces its token, -100 bans greedy's choice, and ``min_tokens`` keeps a
  stop id from being sampled until that many tokens are out."""
  prompt = [3, 1, 4, 1, 5, 9, 2, 6]
  plain = engine.generate([prompt], _greedy(6))[0].token_ids
  forced, banned, stopped, delayed = engine.generate([prompt] * 4, [
      SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={11: 100}),
      SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={plain[0]: -100}),
      SamplingParams(max_tokens=6, stop_token_ids=(plain[0],)),
      SamplingParams(max_tokens=6, stop_token_ids=(plain[0],), min_tokens=4)])
  assert forced.token_ids == (11,) * 6
  assert banned.token_ids[0] != plain[0]
  assert stopped.token_ids == plain[:1] and stopped.finish_reason == 'stop'
  assert len(delayed.token_ids) >= 4 and plain[0] not in delayed.token_ids[:4]
  assert delayed.token_ids[0] == banned.token_ids[0]  # masked as a -inf bias
  _assert_idle(engine)


SLIDING = dict(vocab_size=VOCAB, d_model=48, num_layers=4, num_heads=4, num_kv_heads=2,
               head_dim=12, mlp_dim=96, attention={'sliding_window': 6, 'logit_softcap': 5.0},
               layer_types=('sliding', 'full', 'sliding', 'full'),
               final_logit_softcap=10.0, max_position_embeddings=128, initializer_range=1.0)


@pytest.mark.parametrize('family', [
    pytest.param(dict(preset='gemma2-2b', runtime={'scan_layers': True}, **SLIDING),
                 id='gemma2_scanned',
                 marks=pytest.mark.slow),  # ~19 s
    pytest.param(dict(preset='gemma3-1b', **SLIDING), id='gemma3_list', marks=pytest.mark.slow),
    pytest.param(dict(attention={'type': 'mla'}, head_dim=None, mla=dict(
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12)),
                 id='mla'),
    pytest.param(dict(attention={'type': 'mla'}, head_dim=None, mla=dict(
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12,
        index_topk=5, index_num_heads=2, index_head_dim=8)), id='mla_sparse_v32'),
    pytest.param(dict(moe={'num_experts': 4, 'num_experts_per_tok': 2, 'mlp_dim': 32},
                      runtime={'scan_layers': True}), id='moe', marks=pytest.mark.slow),
    pytest.param(dict(preset='tiny-llama4', attention={'chunk_size': 6, 'temperature_floor': 3.0},
                      vocab_size=VOCAB, initializer_range=1.0), id='llama4_chunked_nope'),
    pytest.param(dict(preset='tiny-gemma4', attention={'sliding_window': 6}, vocab_size=VOCAB,
                      initializer_range=1.0), id='gemma4_global_shapes_moe',
                 marks=pytest.mark.slow),
    pytest.param(dict(preset='tiny-gemma4', attention={'sliding_window': 6}, vocab_size=VOCAB,
                      initializer_range=1.0, moe={'num_experts': 0}, per_layer_input_dim=8,
                      num_kv_shared_layers=2, kv_shared_mlp_dim=256),
                 id='gemma4_per_layer_inputs_shared_kv', marks=pytest.mark.slow),
])
def test_family_under_paging_equals_its_unpaged_decode(family):
  """Sliding windows with soft-caps (Gemma 2/3 style), MLA's compressed cache (also sparse,
  DeepSeek V3.2's: its indexer keeps 5 keys of up to 32, from keys in pages of their own) and
  MoE layers give generate's tokens under paging, with prompts and outputs longer than the
  window."""
  family = dict(family)
  preset = family.pop('preset', None)
  if preset is None:
    model = _model(**family)
  else:
    model = maxnnx.Transformer(maxnnx.get_preset(preset, **family), rngs=nnx.Rngs(5))
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 9, 14, 20)]
  max_tokens = [12, 5, 10, 8]
  want = maxnnx.generate(model, prompts, max_new_tokens=12, eos_ids=None)
  engine = Engine(model, page_size=4, max_batch=3, token_budget=8, max_model_len=32)
  got = engine.generate(prompts, [_greedy(m) for m in max_tokens])
  for completion, row, m in zip(got, want.tokens, max_tokens):
    assert list(completion.token_ids) == row[:m].tolist()
  _assert_idle(engine)


def test_pages_behind_an_every_layer_window_go_back_to_the_pool():
  """Every layer sliding (window 6): a request gives back the pages no later token attends
  to as it advances, holding a bounded number however long it runs, and its tokens stay
  generate's. A model with full layers keeps every page."""
  windowed = _model(attention={'sliding_window': 6}, num_layers=2)
  assert set(windowed.config.resolved_layer_types) == {'sliding'}
  engine = Engine(windowed, page_size=4, max_batch=2, token_budget=8, max_model_len=64,
                  prefix_caching=False)
  assert engine.scheduler.window == 6
  rng = np.random.default_rng(6)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (13, 5)]
  ids = [engine.add_request(p, _greedy(40)) for p in prompts]
  held, tokens = [], {i: [] for i in ids}
  while engine.has_unfinished():
    for out in engine.step():
      tokens[out.request_id].extend(out.new_token_ids)
    for request in engine.scheduler.running:
      held.append(len(request.pages) - request.num_released)
      assert request.pages[:request.num_released] == [0] * request.num_released
    engine.allocator.check()
  assert max(held) <= -(-(6 + 8) // 4) + 1  # window plus a step's tokens, and a page's edge
  want = maxnnx.generate(windowed, prompts, max_new_tokens=40, eos_ids=None)
  assert [tokens[i] for i in ids] == want.tokens.tolist()
  _assert_idle(engine)
  small_pool = Engine(windowed, page_size=4, max_batch=1, token_budget=8, max_model_len=64,
                      max_pages=5)  # far less than one 53-token request's 14 pages
  assert [list(c.token_ids) for c in small_pool.generate(prompts[:1], _greedy(40))] == [
      want.tokens[0].tolist()]
  _assert_idle(small_pool)
  assert engine.window_allocator is None  # one pool: every layer gives pages back


def test_sliding_layers_of_a_mixed_model_give_back_their_pages():
  """Sliding and full layers (window 6): the sliding layers' pages come from a pool of their
  own and go back behind the window, the full layers keep every page; tokens stay
  generate's, and a prompt served again starts from both pools' cached pages."""
  mixed = maxnnx.Transformer(maxnnx.ModelConfig.from_dict(SLIDING), rngs=nnx.Rngs(0))
  engine = Engine(mixed, page_size=4, max_batch=2, token_budget=8, max_model_len=64)
  bound = -(-(6 + 8) // 4) + 1  # window plus a step's tokens, and a page's edge
  assert engine.window_pages_per_request == bound and engine.max_window_pages == 2 * 2 * bound
  pool_pages = sorted(x.shape[0] for x in jax.tree.leaves(engine.runner.cache) if x.ndim == 4)
  assert pool_pages == [21] * 4 + [33] * 4  # k and v of 2 sliding layers, then 2 full ones
  rng = np.random.default_rng(6)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (13, 5, 22)]
  want = maxnnx.generate(mixed, prompts, max_new_tokens=30, eos_ids=None)
  ids = [engine.add_request(p, _greedy(30)) for p in prompts]
  tokens, held = {i: [] for i in ids}, []
  while engine.has_unfinished():
    for out in engine.step():
      tokens[out.request_id].extend(out.new_token_ids)
    for request in engine.scheduler.running:
      assert len(request.pages) == -(-request.num_computed // 4)  # full layers: every page
      held.append(len(request.window_pages) - request.num_released)
    engine.allocator.check()
    engine.window_allocator.check()
  assert [tokens[i] for i in ids] == want.tokens.tolist()
  assert 0 < max(held) <= bound
  [again] = engine.generate(prompts[2:], _greedy(30))
  assert again.num_cached_tokens == 20 and list(again.token_ids) == want.tokens[2].tolist()
  _assert_idle(engine)
  assert engine.window_allocator.num_available == engine.max_window_pages
  small = Engine(mixed, page_size=4, max_batch=2, token_budget=8, max_model_len=64,
                 max_window_pages=3)
  assert small.max_window_pages == 3 and small.window_allocator.num_usable == 3
  with pytest.raises(ValueError, match='3 for sliding layers'):
    small.add_request(prompts[2], _greedy(30))  # its window needs more than 3 pages
  with pytest.raises(ValueError, match='max_window_pages=0'):
    Engine(mixed, max_model_len=64, max_window_pages=0)
  scanned = maxnnx.Transformer(maxnnx.ModelConfig.from_dict({**SLIDING,
                                                             'runtime.scan_layers': True}),
                               rngs=nnx.Rngs(0))
  assert Engine(scanned, max_model_len=16).window_allocator is None  # one pool: all kept


def test_a_model_sharded_over_tensor_devices_serves_the_same_tokens(model, tmp_path):
  """from_pretrained(mesh=tensor 2) -> the engine runs on both devices, its page pools split
  over the kv heads from the start, and greedy requests give generate's tokens and the
  one-device engine's log-probabilities."""
  from maxnnx.config import MeshConfig  # noqa: PLC0415
  from maxnnx.serving.server import load_engine  # noqa: PLC0415
  maxnnx.save_pretrained(model, str(tmp_path))
  sharded = maxnnx.from_pretrained(str(tmp_path), mesh=MeshConfig(data=1, tensor=2))
  kwargs = dict(page_size=4, max_batch=4, token_budget=16, max_model_len=64)
  engine = Engine(sharded, **kwargs)
  assert dict(engine.mesh.shape)['tensor'] == 2
  pools = [x for x in jax.tree.leaves(engine.runner.cache) if x.ndim == 4]
  assert pools and all(tuple(x.sharding.spec)[:3] == (None, None, 'tensor')
                       and not any(tuple(x.sharding.spec)[3:]) for x in pools), pools[0].sharding
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 17, 9, 30, 5)]
  params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
  ours = engine.generate(prompts, params)
  single = Engine(model, **kwargs)
  one_device = single.generate(prompts, params)
  np.testing.assert_allclose([t.logprob for t in engine.score_prompt(prompts[3], 2)],
                             [t.logprob for t in single.score_prompt(prompts[3], 2)], atol=1e-4)
  want = maxnnx.generate(model, prompts, max_new_tokens=6, eos_ids=None)
  for i, (a, b) in enumerate(zip(ours, one_device)):
    assert list(a.token_ids) == want.tokens[i].tolist() == list(b.token_ids), i
    np.testing.assert_allclose([t.logprob for t in a.logprobs], [t.logprob for t in b.logprobs],
                               atol=1e-4)
  _assert_idle(engine)
  with pytest.raises(ValueError, match='tensor_parallel=64: this process has 8 device'):
    load_engine(str(tmp_path), tensor_parallel=64)


LINEAR_ATTN = {'num_key_heads': 2, 'num_value_heads': 4, 'key_head_dim': 16,
               'value_head_dim': 16}
# A Gated DeltaNet layer and a gated attention layer (half the compiles of the 4-layer MoE).
RECURRENT = dict(initializer_range=1.0, vocab_size=VOCAB, num_layers=2,
                 layer_types=('linear', 'full'), moe={'num_experts': 0})


@pytest.mark.parametrize('changes', [
    pytest.param({}, id='qwen3_next'),
    pytest.param({'linear_attn': {**LINEAR_ATTN, 'projections': 'split'}}, id='qwen3_5_split',
                 marks=pytest.mark.slow),  # ~20 s
])
def test_a_recurrent_model_keeps_each_requests_state_across_chunks_and_preemption(changes):
  """Gated DeltaNet layers (Qwen3-Next, Qwen3.5) keep one state slot per running request:
  prompts prefilled in chunks of up to 8 tokens, a fourth request taking a finished one's
  slot, and requests preempted by a small pool (recomputed from a zero state) all give
  generate's greedy tokens, and every slot and page comes back."""
  cfg = maxnnx.get_preset('tiny-qwen3-next', **{**RECURRENT, **changes})
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(5))
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 9, 14, 20)]
  max_tokens = [12, 5, 10, 8]
  want = maxnnx.generate(model, prompts, max_new_tokens=12, eos_ids=None)
  engine = Engine(model, page_size=8, max_batch=3, token_budget=8, max_model_len=32,
                  max_pages=4)
  assert not engine.prefix_caching  # a state after a shared prefix is not kept
  got = engine.generate(prompts, [_greedy(m) for m in max_tokens])
  for completion, row, m in zip(got, want.tokens, max_tokens):
    assert list(completion.token_ids) == row[:m].tolist()
  assert engine.scheduler.num_preemptions > 0
  assert not engine.scheduler.kv_cache.state_slots.slots  # every slot came back
  _assert_idle(engine)


@pytest.mark.slow  # ~40 s of compiles
def test_a_sharded_recurrent_model_serves_the_same_tokens(tmp_path):
  """Qwen3-Next over tensor 2: the delta rule's state slots split over the value heads like
  out_proj, and greedy requests give the one-device generate's tokens."""
  from maxnnx.config import MeshConfig  # noqa: PLC0415
  cfg = maxnnx.get_preset('tiny-qwen3-next', **RECURRENT)
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(5))
  maxnnx.save_pretrained(model, str(tmp_path))
  sharded = maxnnx.from_pretrained(str(tmp_path), mesh=MeshConfig(data=1, tensor=2))
  engine = Engine(sharded, page_size=8, max_batch=4, token_budget=16, max_model_len=32)
  states = [x for x in jax.tree.leaves(engine.runner.cache) if x.shape[:1] == (5,) and x.ndim == 4]
  assert len(states) == 1 and all(tuple(x.sharding.spec)[:2] == (None, 'tensor')
                                  for x in states), states[0].sharding
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 17, 9)]
  want = maxnnx.generate(model, prompts, max_new_tokens=6, eos_ids=None)
  got = engine.generate(prompts, _greedy(6))
  assert [list(c.token_ids) for c in got] == want.tokens.tolist()
  _assert_idle(engine)


@pytest.mark.parametrize('setting,message', [
    ({'page_size': 0}, 'Engine page_size=0: must be >= 1'),
    ({'page_size': 3.5}, r'Engine page_size=3\.5: expected an integer >= 1'),
    ({'max_batch': True}, 'Engine max_batch=True: expected an integer'),
    ({'seed': 'x'}, "Engine seed='x': expected an integer >= 0"),
    ({'max_logprobs': -1}, 'Engine max_logprobs=-1: must be >= 0'),
    ({'max_model_len': 0}, 'Engine max_model_len=0: must be >= 1'),
    ({'prefix_caching': 'yes'}, "Engine prefix_caching='yes': expected True or False"),
])
def test_every_engine_setting_is_checked_before_use(model, setting, message):
  """A bad setting is one ValueError naming it, before any pool is allocated (page_size=0
  divided by zero, 3.5 failed deep in jax, a string seed was taken)."""
  with pytest.raises(ValueError, match=message):
    Engine(model, **setting)


def test_an_engine_config_with_overrides_and_the_serve_keys_it_gives(model):
  """Engine takes an EngineConfig, keyword settings replace its fields, an unknown setting
  is refused with the nearest name, and maxnnx serve's engine keys are the config's fields
  with its defaults."""
  from maxnnx.cli import _command_keys
  config = EngineConfig(max_batch=2, page_size=4, token_budget=8, max_model_len=32)
  engine = Engine(model, config=config, seed=7)
  assert engine.config == config.replace(seed=7) and engine.max_batch == 2
  assert engine.seed == 7 and engine.max_pages == 2 * 8  # 2 rows of 32 tokens in pages of 4
  with pytest.raises(ConfigError, match="Unknown Engine field 'max_batches'.*max_batch"):
    Engine(model, max_batches=4)
  keys = _command_keys('serve')
  for field in dataclasses.fields(EngineConfig):
    assert keys[field.name].default == getattr(EngineConfig(), field.name)

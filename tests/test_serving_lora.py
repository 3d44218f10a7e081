"""Many LoRA adapters in one engine: requests for different adapters and for the base model
share each step, and each request's greedy tokens equal maxnnx.generate on the model with its
adapter applied (PEFT directories: one written by peft, one of a smaller rank by maxnnx); a
warm engine compiles nothing when the mix changes; the server lists and selects adapters."""

import json
import os
import shutil

import httpx
import jax
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.checkpoint.safetensors import read_safetensors, write_safetensors
from maxnnx.config import ConfigError, EngineConfig
from maxnnx.serving import Engine, SamplingParams
from maxnnx.serving.server import make_app, serve_in_thread
from maxnnx.train.lora import LoraConfig, apply_lora, load_adapter, merge_adapters, save_adapter
from tests.conftest import FIXTURES
from tests.test_lora import _randomise_adapters

LLAMA = os.path.join(FIXTURES, 'llama')
PEFT_DIR = os.path.join(os.path.dirname(FIXTURES), 'peft', 'llama_lora')  # rank 4, by peft
VOCAB = 256
# Few buckets: every step at 16 tokens and 12 pages per row.
ENGINE = dict(page_size=4, max_batch=4, token_budget=16, max_model_len=48, token_buckets=(16,),
              page_buckets=(12,), max_lora_rank=4)


def _small_adapter(base, directory, seed=5):
  """A rank-2 adapter of three projections (padded to max_lora_rank=4 when served)."""
  config = LoraConfig(rank=2, alpha=4.0, targets=('q_proj', 'v_proj', 'down_proj'))
  save_adapter(_randomise_adapters(apply_lora(base, config), seed, 0.3), str(directory))
  return str(directory)


@pytest.fixture(scope='module')
def base():
  return maxnnx.from_pretrained(LLAMA, scan_layers=True)


@pytest.fixture(scope='module')
def adapters(base, tmp_path_factory):
  return {'a': PEFT_DIR, 'b': _small_adapter(base, tmp_path_factory.mktemp('adapter_b'))}


@pytest.fixture(scope='module')
def engine(base, adapters):
  return Engine(base, lora_modules=adapters, **ENGINE)


def _greedy(max_tokens):
  return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _record_slots(engine):
  """Wrap the runner's layout: a list that gets each step's set of adapter slots in use."""
  steps, layout = [], engine.runner.layout

  def recorded(scheduled, *args):
    steps.append({request.lora_slot for request, _ in scheduled})
    return layout(scheduled, *args)

  engine.runner.layout = recorded
  return steps


def test_staggered_requests_for_two_adapters_and_the_base_share_steps_and_match_generate(
    base, adapters, engine):
  """Requests for adapter a, adapter b and the base arrive at different steps and run in the
  same steps; each one's greedy tokens equal maxnnx.generate on its own model (the adapter
  merged into the base, or the base), and the three models disagree."""
  rng = np.random.default_rng(0)
  loras = ['a', None, 'b', 'a', 'b', None, 'b']
  arrivals = [0, 0, 1, 2, 2, 3, 5]
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in rng.integers(3, 20, len(loras))]
  max_tokens = [int(m) for m in rng.integers(4, 12, len(loras))]
  steps = _record_slots(engine)
  ids, got, step = {}, {}, 0
  try:
    while len(ids) < len(prompts) or engine.has_unfinished():
      for i, arrival in enumerate(arrivals):
        if arrival == step:
          ids[engine.add_request(prompts[i], _greedy(max_tokens[i]), lora=loras[i])] = i
      for out in engine.step():
        if out.finished:
          got[ids[out.request_id]] = list(out.token_ids)
      step += 1
  finally:
    del engine.runner.layout  # back to the method
  assert any(slots == {0, 1, 2} for slots in steps)  # a, b and the base in one step
  # The adapters merged into the kernels: the base's program, compiled once for all three.
  models = {None: base, 'a': merge_adapters(load_adapter(base, adapters['a'])),
            'b': merge_adapters(load_adapter(base, adapters['b']))}
  longest = max(max_tokens)
  for name, model in models.items():
    mine = [i for i, lora in enumerate(loras) if lora == name]
    want = maxnnx.generate(model, [prompts[i] for i in mine], max_new_tokens=longest,
                           eos_ids=None).tokens
    for row, i in enumerate(mine):
      assert got[i] == np.asarray(want)[row, :max_tokens[i]].tolist(), (name, i)
  # The same prompt under each model: the adapters change the tokens.
  same = engine.generate([prompts[0]] * 3, _greedy(10), lora=['a', 'b', None])
  assert len({c.token_ids for c in same}) == 3
  assert not engine.has_unfinished() and engine.allocator.num_available == engine.max_pages


def test_a_warm_engine_compiles_nothing_when_the_adapter_mix_changes(engine):
  """After warmup, batches of only a, of a and b, of b and the base, of all three, compile no
  program (the adapters' slots are data of the one step program)."""
  engine.warmup()
  count = engine.compile_count
  prompt = [5, 9, 33, 7, 100, 2]
  for mix in (['a'], ['a', 'b'], ['b', None, None], ['a', None, 'b', 'a']):
    engine.generate([prompt] * len(mix), _greedy(5), lora=mix)
  assert engine.compile_count == count
  assert engine.compiles.after_warmup == 0


def test_prefix_pages_are_not_shared_across_adapters(engine):
  """A prompt cached under one adapter is not a prefix hit for another (its keys differ),
  but is for the same adapter."""
  prompt = list(range(40, 61))  # five full pages
  engine.generate([prompt], _greedy(2), lora='a')
  other = engine.generate([prompt], _greedy(2), lora='b')[0]
  again = engine.generate([prompt], _greedy(2), lora='a')[0]
  assert other.num_cached_tokens == 0 and again.num_cached_tokens > 0


def test_unknown_adapter_is_refused_naming_the_served_ones(engine):
  with pytest.raises(ValueError, match=r"lora='c' is not an adapter.*'a', 'b'"):
    engine.add_request([1, 2, 3], _greedy(2), lora='c')
  assert engine.lora_names == ('a', 'b') and not engine.has_unfinished()


def test_unscanned_layers_and_speculative_drafts_serve_adapters_too(adapters):
  """A model whose layers are a list (no scan) gets the same per-token adapters, and n-gram
  drafts are verified under their request's adapter: greedy tokens = generate."""
  base = maxnnx.from_pretrained(LLAMA, scan_layers=False)
  engine = Engine(base, lora_modules={'b': adapters['b']}, speculative_method='ngram',
                  num_speculative_tokens=2, **ENGINE)
  prompt = [7, 3, 99, 41, 7, 3, 99, 41, 7, 3]  # repeats: prompt lookup finds drafts
  got = engine.generate([prompt, prompt], _greedy(8), lora=['b', None])
  for completion, model in zip(got, (load_adapter(base, adapters['b']), base)):
    want = maxnnx.generate(model, [prompt], max_new_tokens=8, eos_ids=None).tokens
    assert list(completion.token_ids) == np.asarray(want)[0].tolist()
  assert engine.spec.draft_tokens > 0
  assert got[0].token_ids != got[1].token_ids


def _adapter_with(tmp_path, name, extra):
  """A copy of the peft adapter with ``extra`` tensors added."""
  directory = tmp_path / name
  shutil.copytree(PEFT_DIR, directory)
  tensors = read_safetensors(str(directory / 'adapter_model.safetensors'))
  write_safetensors(str(directory / 'adapter_model.safetensors'), {**tensors, **extra},
                    {'format': 'pt'})
  return str(directory)


def test_bad_adapters_are_refused_at_start_naming_the_adapter_and_the_fix(base, tmp_path):
  with pytest.raises(ValueError, match=r"adapter 'a' .* rank 4, above max_lora_rank=2; set "
                                       r'max_lora_rank=4'):
    Engine(base, lora_modules={'a': PEFT_DIR}, **{**ENGINE, 'max_lora_rank': 2})
  with pytest.raises(ValueError, match=r"adapter 'gone' .*adapter_config.json: missing"):
    Engine(base, lora_modules={'gone': str(tmp_path / 'nowhere')}, **ENGINE)
  layer5 = 'base_model.model.model.layers.5.self_attn.q_proj'
  extra = {f'{layer5}.lora_A.weight': np.zeros((4, 64), np.float32),
           f'{layer5}.lora_B.weight': np.zeros((96, 4), np.float32)}
  with pytest.raises(ValueError, match=r"adapter 'deep' .*layers.5.self_attn.q_proj.*not a "
                                       'projection of this llama model'):
    Engine(base, lora_modules={'deep': _adapter_with(tmp_path, 'deep', extra)}, **ENGINE)


@pytest.mark.parametrize('settings, message', [
    (dict(lora_modules=('a',)), r"'a' is not name=path"),
    (dict(lora_modules=('a=x', 'a=y')), 'repeat'),
    (dict(lora_modules={'a': 'x', 'b': 'y'}, max_loras=1), 'raise max_loras to 2'),
    (dict(max_lora_rank=0), 'max_lora_rank=0'),
])
def test_lora_settings_errors_name_the_field(settings, message):
  with pytest.raises(ConfigError, match=message):
    EngineConfig(**settings)


def test_lora_modules_read_from_a_dict_and_from_the_command_line():
  """Engine(lora_modules={name: path}) and maxnnx serve's lora_modules=name=path,... give the
  same entries, and the serve command passes them to the engine."""
  from maxnnx.cli import _command_keys  # noqa: PLC0415
  from maxnnx.cli_keys import parse  # noqa: PLC0415
  from_dict = EngineConfig(lora_modules={'sql': 'out/sql', 'chat': 'out/chat'})
  assert from_dict.lora_modules == ('sql=out/sql', 'chat=out/chat')
  keys = _command_keys('serve')
  options = parse(['lora_modules=sql=out/sql,chat=out/chat', 'max_lora_rank=8'], keys)
  assert EngineConfig(lora_modules=options['lora_modules']) == from_dict
  assert options['max_lora_rank'] == 8 and options['max_loras'] is None
  runtime = parse(['lora_target_modules=q_proj,v_proj', 'allow_runtime_lora_updating=true'], keys)
  config = EngineConfig(lora_target_modules=runtime['lora_target_modules'],
                        allow_runtime_lora_updating=runtime['allow_runtime_lora_updating'])
  assert config.lora_target_modules == ('q_proj', 'v_proj') and config.allow_runtime_lora_updating


def test_the_adapter_travels_to_follower_processes():
  """A multi-process server's followers get each request's adapter with it."""
  from maxnnx.serving.lockstep import decode_call, encode_call  # noqa: PLC0415
  params = _greedy(3)
  assert decode_call(encode_call('add', [1, 2], params, None, 'sql')) == (
      'add', [1, 2], params, None, 'sql')
  assert decode_call(encode_call('add', [1, 2], params, None, None)) == (
      'add', [1, 2], params, None)


# -- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def served(tmp_path_factory, chat_checkpoint):
  """A tiny chat model's directory, a rank-2 adapter of it, and the model itself."""
  directory = tmp_path_factory.mktemp('served_lora')
  model = maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=512, num_layers=1),
                             rngs=nnx.Rngs(0))
  maxnnx.save_pretrained(model, str(directory))
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(chat_checkpoint / name, directory / name)
  base = maxnnx.from_pretrained(str(directory))
  adapter = _small_adapter(base, tmp_path_factory.mktemp('served_adapter'), seed=9)
  return str(directory), adapter, base


def test_server_lists_adapters_selects_them_by_model_and_refuses_unknown_ones(served):
  """/v1/models lists the base and the adapter (parent: the base); a completion with
  model=<adapter> gives the adapted model's greedy tokens, the base name the base's (and a
  chat completion selects the adapter the same way); an unknown model is a 404 naming what
  is served."""
  directory, adapter, base = served
  app = make_app(directory, model_name='tiny', lora_modules={'sql': adapter},
                 max_batch=2, token_budget=16, page_size=8, max_model_len=64,
                 token_buckets=(16,), page_buckets=(8,), max_lora_rank=4)
  prompt = [11, 42, 7, 300, 5, 18]
  with serve_in_thread(app) as (url, _):
    for _ in range(600):
      if httpx.get(f'{url}/health').status_code == 200:
        break
      import time  # noqa: PLC0415
      time.sleep(0.5)
    cards = httpx.get(f'{url}/v1/models').json()['data']
    assert [(c['id'], c['parent']) for c in cards] == [('tiny', None), ('sql', 'tiny')]
    assert httpx.get(f'{url}/v1/models/sql').json()['root'] == adapter

    def complete(model):
      return httpx.post(f'{url}/v1/completions', json={
          'model': model, 'prompt': prompt, 'max_tokens': 8, 'temperature': 0,
          'ignore_eos': True, 'return_token_ids': True}, timeout=120)

    answers = {name: complete(name).json() for name in ('sql', 'tiny')}
    missing = complete('sqll')
    chats = {name: httpx.post(f'{url}/v1/chat/completions', json={
        'model': name, 'messages': [{'role': 'user', 'content': 'hello'}], 'max_tokens': 6,
        'temperature': 0, 'ignore_eos': True, 'return_token_ids': True}, timeout=120).json()
        for name in ('sql', 'tiny')}
  for name, model in (('sql', load_adapter(base, adapter)), ('tiny', base)):
    want = np.asarray(maxnnx.generate(model, [prompt], max_new_tokens=8, eos_ids=None).tokens)
    assert answers[name]['choices'][0]['token_ids'] == want[0].tolist(), name
    assert answers[name]['model'] == name
  assert answers['sql']['choices'][0]['token_ids'] != answers['tiny']['choices'][0]['token_ids']
  assert [chats[n]['model'] for n in ('sql', 'tiny')] == ['sql', 'tiny']  # chat selects too
  assert (chats['sql']['choices'][0]['token_ids'] != chats['tiny']['choices'][0]['token_ids'])
  assert missing.status_code == 404
  error = missing.json()['error']
  assert error['code'] == 'model_not_found' and "'tiny', 'sql'" in error['message']
  assert json.dumps(error).count('sqll') == 1


# -- adapters loaded and unloaded while the engine serves (vLLM's runtime LoRA updating) --------


def _adapter(base, directory, seed, targets=('q_proj', 'v_proj', 'down_proj')):
  """A rank-2 adapter of ``targets`` with nonzero weights drawn from ``seed``."""
  config = LoraConfig(rank=2, alpha=4.0, targets=targets)
  save_adapter(_randomise_adapters(apply_lora(base, config), seed, 0.3), str(directory))
  return str(directory)


def _merged_tokens(base, directory, prompt, max_tokens):
  model = merge_adapters(load_adapter(base, directory))
  return np.asarray(maxnnx.generate(model, [prompt], max_new_tokens=max_tokens,
                                    eos_ids=None).tokens)[0].tolist()


@pytest.fixture(scope='module')
def later(base, tmp_path_factory):
  """Adapters loaded while serving: b and c (q, v, down), and k (k_proj, for the errors)."""
  made = tmp_path_factory.mktemp('later')
  return {'b': _adapter(base, made / 'b', seed=11), 'c': _adapter(base, made / 'c', seed=12),
          'k': _adapter(base, made / 'k', seed=13, targets=('k_proj',))}


def test_adapters_loaded_while_serving_match_generate_and_reuse_no_pages_of_an_earlier_one(
    base, adapters, later):
  """An engine started with adapter a and two free slots loads b: b's greedy tokens equal
  generate on b merged, and a's stay as they were. b's prompt pages are cached; b is unloaded
  and c loaded under the same name into the freed slot: the same prompt hits no page of the
  old b and gives c's tokens (not b's). No program is compiled across the loads."""
  engine = Engine(base, lora_modules={'a': adapters['a']}, max_loras=3, **ENGINE)
  engine.warmup()
  count, programs = engine.compile_count, engine.compiles.programs
  prompt = list(range(40, 61))  # five full pages
  before_a = engine.generate([prompt], _greedy(6), lora='a')[0].token_ids
  assert engine.load_lora('b', later['b']) == 2
  assert engine.lora_names == ('a', 'b')
  got = engine.generate([prompt, prompt], _greedy(6), lora=['b', 'a'])
  b_tokens = _merged_tokens(base, later['b'], prompt, 6)
  assert list(got[0].token_ids) == b_tokens
  assert got[1].token_ids == before_a
  assert engine.generate([prompt], _greedy(6), lora='b')[0].num_cached_tokens > 0

  assert engine.unload_lora('b') == 2
  assert engine.lora_names == ('a',)
  assert engine.load_lora('b', later['c']) == 2  # another adapter, same name, same slot
  again = engine.generate([prompt], _greedy(6), lora='b')[0]
  c_tokens = _merged_tokens(base, later['c'], prompt, 6)
  assert again.num_cached_tokens == 0
  assert list(again.token_ids) == c_tokens != b_tokens
  assert engine.generate([prompt], _greedy(6), lora='b')[0].num_cached_tokens > 0
  assert engine.load_lora('b2', later['b']) == 3  # the second free slot
  assert engine.generate([prompt], _greedy(6), lora='b2')[0].token_ids == tuple(b_tokens)
  assert engine.compile_count == count and engine.compiles.programs == programs
  assert engine.compiles.after_warmup == 0



def test_an_unload_frees_the_adapters_cached_pages_and_keeps_the_bases(base, later):
  """After requests of the base and of adapter b leave their prompt pages cached, unloading b
  frees b's cached pages at once (the free count is back to what it was before b's requests;
  the pool checks consistent), and the base's prompt is still a prefix hit."""
  engine = Engine(base, lora_target_modules='q_proj,v_proj,down_proj', max_loras=2,
                  **{**ENGINE, 'max_lora_rank': 2})
  allocator = engine.allocator
  base_prompt, b_prompt = list(range(40, 61)), list(range(100, 121))  # five full pages each
  engine.generate([base_prompt], _greedy(2))
  engine.load_lora('b', later['b'])
  free_before, cached_before = len(allocator._free), allocator.num_cached
  assert cached_before > 0
  engine.generate([b_prompt, base_prompt], _greedy(2), lora=['b', None])
  assert allocator.num_cached > cached_before  # b's prompt pages are cached too
  engine.unload_lora('b')
  allocator.check()
  assert len(allocator._free) == free_before and allocator.num_cached == cached_before
  assert engine.generate([base_prompt], _greedy(2))[0].num_cached_tokens > 0
  engine.load_lora('b', later['b'])  # the same adapter again: nothing of the old load is hit
  assert engine.generate([b_prompt], _greedy(2), lora='b')[0].num_cached_tokens == 0


def test_an_adapter_loaded_into_an_engine_sharded_over_tensor_devices_matches_generate(
    base, later):
  """An engine over the model sharded tensor=2, warmed up with no adapter, loads b: a batch
  mixing b and the base gives, row by row, generate's tokens with b merged into the one-device
  model and the base's; the slots keep their shardings and nothing is compiled after warmup
  (nor by the sampler, whose penalty counts are laid out as the sharded logits)."""
  from maxnnx.config import MeshConfig  # noqa: PLC0415
  sharded = maxnnx.from_pretrained(LLAMA, scan_layers=True,
                                   mesh=MeshConfig(data=1, tensor=2))
  engine = Engine(sharded, lora_target_modules='q_proj,v_proj,down_proj', max_loras=2,
                  **{**ENGINE, 'max_lora_rank': 2})
  assert dict(engine.mesh.shape)['tensor'] == 2
  engine.warmup()
  count = engine.compile_count

  def stacks():
    return {path: (leaf.sharding, leaf.committed)
            for path, leaf in jax.tree_util.tree_leaves_with_path(engine.runner.cache)
            if 'lora_' in jax.tree_util.keystr(path)}

  shardings = stacks()
  assert shardings and all(s.mesh.size == 2 for s, _ in shardings.values())
  engine.load_lora('b', later['b'])
  assert stacks() == shardings
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (7, 13, 5, 18)]
  loras = ['b', None, None, 'b']
  got = engine.generate(prompts, _greedy(6), lora=loras)
  merged = merge_adapters(load_adapter(base, later['b']))
  for i, (prompt, lora) in enumerate(zip(prompts, loras)):
    want = np.asarray(maxnnx.generate(merged if lora else base, [prompt], max_new_tokens=6,
                                      eos_ids=None).tokens)[0].tolist()
    assert list(got[i].token_ids) == want, (i, lora)
  assert got[0].token_ids != engine.generate([prompts[0]], _greedy(6))[0].token_ids
  engine.unload_lora('b')
  assert stacks() == shardings
  assert engine.compile_count == count and engine.compiles.after_warmup == 0

@pytest.fixture(scope='module')
def slotted(base):
  """An engine started with no adapter, one slot of rank 2 on q, v and down."""
  return Engine(base, lora_target_modules='q_proj,v_proj,down_proj', max_loras=1,
                **{**ENGINE, 'max_lora_rank': 2})


def test_an_engine_started_without_adapters_takes_one_on_its_target_modules(base, later,
                                                                             slotted):
  prompt = [5, 9, 33, 7, 100, 2, 64]
  base_tokens = slotted.generate([prompt], _greedy(6))[0].token_ids
  slotted.load_lora('b', later['b'])
  got = slotted.generate([prompt, prompt], _greedy(6), lora=['b', None])
  assert list(got[0].token_ids) == _merged_tokens(base, later['b'], prompt, 6)
  assert got[1].token_ids == base_tokens
  slotted.unload_lora('b')
  assert slotted.lora_names == () and slotted.generate([prompt], _greedy(6))[0].token_ids == (
      base_tokens)


def test_runtime_loads_and_unloads_are_refused_naming_the_fix(base, later, slotted):
  slotted.load_lora('b', later['b'])
  try:
    with pytest.raises(ValueError, match=r"lora_name 'b' is loaded already"):
      slotted.load_lora('b', later['c'])
    with pytest.raises(ValueError, match=r'No free adapter slot.*larger max_loras'):
      slotted.load_lora('c', later['c'])
    slotted.add_request([1, 2, 3], _greedy(4), lora='b')
    with pytest.raises(ValueError, match=r"'b' has 1 unfinished request.*once they finish"):
      slotted.unload_lora('b')
    while slotted.has_unfinished():
      slotted.step()
  finally:
    slotted.unload_lora('b')
  with pytest.raises(ValueError, match=r'rank 4, above max_lora_rank=2; set max_lora_rank=4'):
    slotted.load_lora('a', PEFT_DIR)
  with pytest.raises(ValueError, match=r'adapts layers\.\d+\.attn\.k_proj, which has no adapter '
                                       r'slots.*lora_target_modules naming k_proj'):
    slotted.load_lora('k', later['k'])
  with pytest.raises(ValueError, match=r"lora='gone' is not an adapter"):
    slotted.unload_lora('gone')
  assert slotted.lora_names == () and slotted.adapters.slots == {}  # refusals leave no trace
  with pytest.raises(ValueError, match=r'no adapter slots; start it with lora_target_modules'):
    Engine(base, **ENGINE).load_lora('b', later['b'])
  with pytest.raises(ValueError, match=r"lora_target_modules: 'qproj' is not a projection.*"
                                       'q_proj'):
    Engine(base, lora_target_modules=('qproj',), **ENGINE)
  with pytest.raises(ConfigError, match=r'allow_runtime_lora_updating=True: no projection.*'
                                        'lora_target_modules'):
    EngineConfig(allow_runtime_lora_updating=True)


def test_lockstep_carries_runtime_adapter_changes():
  from maxnnx.serving.lockstep import decode_call, encode_call  # noqa: PLC0415
  assert decode_call(encode_call('load_lora', 'sql', 'out/sql')) == ('load_lora', 'sql',
                                                                      'out/sql')
  assert decode_call(encode_call('unload_lora', 'sql')) == ('unload_lora', 'sql')


def _wait_healthy(url):
  import time  # noqa: PLC0415
  for _ in range(600):
    if httpx.get(f'{url}/health').status_code == 200:
      return
    time.sleep(0.5)


def test_server_loads_lists_serves_and_unloads_adapters_at_runtime(served):
  """With allow_runtime_lora_updating: load (vLLM's body and answer), /v1/models lists the
  adapter, a completion naming it gives its greedy tokens, a second load of the name is a
  400, unload, and then the name is a 404 for completions, /v1/models and unloads alike."""
  directory, adapter, base = served
  app = make_app(directory, model_name='tiny', lora_target_modules=('q_proj', 'v_proj',
                                                                     'down_proj'),
                 allow_runtime_lora_updating=True, max_batch=2, token_budget=16, page_size=8,
                 max_model_len=64, token_buckets=(16,), page_buckets=(8,), max_lora_rank=4)
  prompt = [11, 42, 7, 300, 5, 18]

  def complete(url, model):
    return httpx.post(f'{url}/v1/completions', json={
        'model': model, 'prompt': prompt, 'max_tokens': 8, 'temperature': 0,
        'ignore_eos': True, 'return_token_ids': True}, timeout=120)

  with serve_in_thread(app) as (url, _):
    _wait_healthy(url)
    before = complete(url, 'sql')
    load = httpx.post(f'{url}/v1/load_lora_adapter',
                      json={'lora_name': 'sql', 'lora_path': adapter}, timeout=120)
    cards = httpx.get(f'{url}/v1/models').json()['data']
    answer = complete(url, 'sql').json()
    twice = httpx.post(f'{url}/v1/load_lora_adapter',
                       json={'lora_name': 'sql', 'lora_path': adapter}, timeout=120)
    no_path = httpx.post(f'{url}/v1/load_lora_adapter', json={'lora_name': 'x'})
    unload = httpx.post(f'{url}/v1/unload_lora_adapter', json={'lora_name': 'sql'}, timeout=120)
    after = complete(url, 'sql')
    listed = [c['id'] for c in httpx.get(f'{url}/v1/models').json()['data']]
    card = httpx.get(f'{url}/v1/models/sql')
    again = httpx.post(f'{url}/v1/unload_lora_adapter', json={'lora_name': 'sql'}, timeout=120)
    compiles = app.state.engine_loop.engine.compiles.after_warmup
  assert before.status_code == 404
  assert (load.status_code, load.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
  assert [(c['id'], c['parent'], c['root']) for c in cards] == [
      ('tiny', None, 'tiny'), ('sql', 'tiny', adapter)]
  want = np.asarray(maxnnx.generate(load_adapter(base, adapter), [prompt], max_new_tokens=8,
                                    eos_ids=None).tokens)[0].tolist()
  assert answer['choices'][0]['token_ids'] == want and answer['model'] == 'sql'
  assert twice.status_code == 400 and 'loaded already' in twice.json()['error']['message']
  assert no_path.status_code == 400 and no_path.json()['error']['param'] == 'lora_path'
  assert (unload.status_code, unload.text) == (
      200, "Success: LoRA adapter 'sql' removed successfully.")
  assert after.status_code == 404 and after.json()['error']['code'] == 'model_not_found'
  assert listed == ['tiny'] and card.status_code == 404
  assert again.status_code == 404 and "'sql' cannot be found" in again.json()['error']['message']
  assert compiles == 0


def test_server_refuses_runtime_adapter_changes_unless_allowed(served):
  from starlette.testclient import TestClient  # noqa: PLC0415
  directory, adapter, _ = served
  app = make_app(directory, model_name='tiny', lora_modules={'sql': adapter}, max_batch=2,
                 token_budget=16, page_size=8, max_model_len=64, max_lora_rank=4)
  client = TestClient(app)  # the engine thread never starts: refused before it is asked
  for endpoint in ('load_lora_adapter', 'unload_lora_adapter'):
    answer = client.post(f'/v1/{endpoint}', json={'lora_name': 'sql', 'lora_path': adapter})
    assert answer.status_code == 400
    assert 'allow_runtime_lora_updating=true' in answer.json()['error']['message']


def test_adapters_serve_over_an_int8_quantized_base(adapters):
  """An engine over a base quantized for inference (qwix int8) serves adapters: in one batch
  each row gives the tokens of ``generate`` on that quantized base with the adapter loaded
  (unmerged), and the base row the quantized base's own."""
  from maxnnx.inference.quantize import quantize_for_inference

  def quantized():
    return quantize_for_inference(maxnnx.from_pretrained(LLAMA, scan_layers=True), 'int8')

  engine = Engine(quantized(), lora_modules=adapters, **ENGINE)
  prompt = [1, 5, 9, 33, 17]
  outs = engine.generate([prompt] * 3, _greedy(6), lora=['a', 'b', None])
  for out, name in zip(outs, ['a', 'b', None]):
    model = quantized() if name is None else load_adapter(quantized(), adapters[name])
    want = np.asarray(maxnnx.generate(model, [prompt], max_new_tokens=6, eos_ids=None).tokens)
    assert list(out.token_ids) == want[0].tolist(), name
  assert len({out.token_ids for out in outs}) == 3  # the adapters change the tokens

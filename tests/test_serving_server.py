"""The OpenAI-compatible HTTP server, queried with the ``openai`` client package against live
uvicorn servers on a tiny model: greedy parity with maxnnx.generate under concurrency, streaming,
the chat template, bad requests, a full queue, client disconnects, metrics, SIGTERM, and
``echo`` (prompt log-probabilities, as lm-evaluation-harness scores with) and ``best_of``."""

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from flax import nnx

import maxnnx
from maxnnx.data import load_tokenizer
from maxnnx.data.chat import encode_with_specials, load_chat_template
from maxnnx.serving import Engine, SamplingParams
from maxnnx.serving.output_processor import stable_text
from maxnnx.serving.server import make_app, serve_in_thread
from tests.test_sampling_controls import penalised_greedy

NAME = 'tiny-chat'
MAX_MODEL_LEN = 128
# Few buckets, so that warm-up takes seconds: every step at 32 tokens and 16 pages per row.
SERVER_ENGINE = dict(max_batch=4, token_budget=32, page_size=8, max_model_len=MAX_MODEL_LEN,
                     token_buckets=(32,), page_buckets=(16,))


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory, chat_checkpoint):
  """A Hugging Face directory like the final/ of an sft run: weights, tokenizer, template."""
  directory = tmp_path_factory.mktemp('served')
  model = maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=512, num_layers=1),
                             rngs=nnx.Rngs(0))
  maxnnx.save_pretrained(model, str(directory))
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(chat_checkpoint / name, directory / name)
  return str(directory)


@pytest.fixture(scope='module')
def reference(model_dir):
  return maxnnx.from_pretrained(model_dir)


@pytest.fixture(scope='module')
def tokenizer(model_dir):
  return load_tokenizer(model_dir)


def _running(app):
  """``app`` served on a free port in a thread; yields ``(base url, server)``."""
  return serve_in_thread(app)


@pytest.fixture(scope='module')
def server(model_dir):
  """The server as ``maxnnx serve`` builds it (from the directory): 4 rows, 12 more queued."""
  app = make_app(model_dir, model_name=NAME, max_queue=12, **SERVER_ENGINE)
  with _running(app) as (url, _):
    _wait_until_ready(url)
    yield url


class Gate:
  """Holds the engine thread before each step while closed."""

  def __init__(self, engine):
    self.opened = threading.Event()
    self.opened.set()
    step = engine.step

    def gated_step():
      self.opened.wait(60)
      return step()

    engine.step = gated_step


@pytest.fixture(scope='module')
def small(model_dir, tokenizer):
  """A server from an Engine, with room for 2 requests (1 running, 1 queued) and a gate."""
  engine = Engine(maxnnx.from_pretrained(model_dir), tokenizer, max_batch=1, token_budget=8,
                  page_size=8, max_model_len=64, page_buckets=(8,))
  app = make_app(engine, model_name=NAME, max_queue=1)
  with _running(app) as (url, uvicorn_server):
    _wait_until_ready(url)
    yield url, Gate(engine), app.state.engine_loop


def _client(url, **kwargs):
  return openai.OpenAI(base_url=f'{url}/v1', api_key='unused', max_retries=0, **kwargs)


def _metric(url, name):
  text = httpx.get(f'{url}/metrics').text
  found = re.search(rf'^maxnnx_{re.escape(name)} (\S+)$', text, re.M)
  return float(found.group(1)) if found else 0.0


def _wait_for(condition, timeout=30):
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, 'timed out'
    time.sleep(0.02)


def _wait_until_ready(url):
  """Wait for the warm-up: ``/health`` answers 200."""
  _wait_for(lambda: httpx.get(f'{url}/health').status_code == 200, timeout=300)


def test_greedy_completions_match_generate_for_16_concurrent_requests(server, reference,
                                                                       tokenizer):
  """16 requests at once (4 run, 12 queue; text and token-id prompts of different lengths)
  give maxnnx.generate's greedy tokens, and their text is those tokens decoded."""
  rng = np.random.default_rng(0)
  corpus = open(maxnnx.data.DEFAULT_CORPUS, encoding='utf-8').read()[:5000]
  prompts, ids = [], []
  for i in range(16):
    if i % 2:
      prompt = rng.integers(0, tokenizer.vocab_size, int(rng.integers(1, 50))).tolist()
      ids.append(prompt)
    else:
      start = int(rng.integers(0, 4000))
      prompt = corpus[start:start + int(rng.integers(1, 200))]
      ids.append([tokenizer.bos_id, *tokenizer.encode(prompt)])
    prompts.append(prompt)
  max_tokens = [int(m) for m in rng.integers(1, 13, 16)]
  want = maxnnx.generate(reference, ids, max_new_tokens=max(max_tokens), eos_ids=None)
  client = openai.AsyncOpenAI(base_url=f'{server}/v1', api_key='unused', max_retries=0)

  async def ask_all():
    return await asyncio.gather(*(client.completions.create(
        model=NAME, prompt=p, max_tokens=m, temperature=0,
        extra_body={'ignore_eos': True, 'return_token_ids': True})
        for p, m in zip(prompts, max_tokens)))

  responses = asyncio.run(ask_all())
  for i, (response, m) in enumerate(zip(responses, max_tokens)):
    choice = response.choices[0]
    assert choice.token_ids == want.tokens[i, :m].tolist(), i
    assert choice.prompt_token_ids == ids[i]
    assert choice.text == tokenizer.decode(choice.token_ids)
    assert choice.finish_reason == 'length'
    assert response.usage.prompt_tokens == len(ids[i]) and response.usage.completion_tokens == m


def test_streamed_chunks_join_to_the_same_text(server):
  client = _client(server)
  args = dict(model=NAME, prompt='ROMEO: what say you', max_tokens=24, temperature=0,
              extra_body={'ignore_eos': True})
  whole = client.completions.create(**args).choices[0].text
  chunks = list(client.completions.create(**args, stream=True,
                                          stream_options={'include_usage': True}))
  assert ''.join(c.choices[0].text for c in chunks if c.choices) == whole
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == 'length'
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
  stop = whole[10:13]  # text a stop string takes back must never have been streamed
  cut = client.completions.create(**args, stop=[stop]).choices[0]
  assert cut.text == whole[:whole.index(stop)] and cut.finish_reason == 'stop'
  streamed = client.completions.create(**args, stop=[stop], stream=True)
  assert ''.join(c.choices[0].text for c in streamed) == cut.text
  messages = [{'role': 'user', 'content': 'Speak, speak.'}]
  reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12,
                                         temperature=0).choices[0].message.content
  deltas = [c.choices[0].delta for c in client.chat.completions.create(
      model=NAME, messages=messages, max_tokens=12, temperature=0, stream=True)]
  assert deltas[0].role == 'assistant'
  assert ''.join(d.content or '' for d in deltas) == reply


def test_chat_completions_use_the_checkpoint_template(server, reference, tokenizer, model_dir):
  messages = [{'role': 'system', 'content': 'Be brief.'},
              {'role': 'user', 'content': [{'type': 'text', 'text': 'Who art thou?'}]}]
  response = _client(server).chat.completions.create(
      model=NAME, messages=messages, max_tokens=8, temperature=0,
      extra_body={'return_token_ids': True})
  choice = response.choices[0]
  flat = [messages[0], {'role': 'user', 'content': 'Who art thou?'}]
  rendered = load_chat_template(model_dir).render(flat, add_generation_prompt=True)
  assert rendered.startswith('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n')
  assert choice.prompt_token_ids == encode_with_specials(tokenizer, rendered)
  assert choice.message.content == maxnnx.chat(reference, tokenizer, [flat],
                                               max_new_tokens=8)[0]
  assert choice.message.role == 'assistant' and response.object == 'chat.completion'


BAD_REQUESTS = [  # (endpoint, body, param)
    ('completions', {'prompt': 'hi'}, 'model'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'max_tokens': 0}, 'max_tokens'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'max_tokens': -3}, 'max_tokens'),
    ('chat/completions', {'model': NAME, 'messages': [{'role': 'user', 'content': 'hi'}],
                          'max_tokens': 0}, 'max_tokens'),
    ('completions', {'model': NAME, 'prompt': [5] * MAX_MODEL_LEN}, 'prompt'),
    ('completions', {'model': NAME, 'prompt': 'To be ' * 200}, 'prompt'),
    ('chat/completions', {'model': NAME, 'messages': [{'role': 'user',
                                                       'content': 'To be ' * 200}]}, 'messages'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'max_tokens': '8'}, 'max_tokens'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'max_tokens': True}, 'max_tokens'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'temperature': 'hot'}, 'temperature'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'temperature': 3}, 'temperature'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'top_p': 0}, 'top_p'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'n': 1.5}, 'n'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'stream': 'yes'}, 'stream'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'stop': ['']}, 'stop'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'logprobs': 99}, 'logprobs'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'presence_penalty': 2.5},
     'presence_penalty'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'repetition_penalty': 0}, 'repetition_penalty'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'logit_bias': {'x': 1}}, 'logit_bias'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'logit_bias': {'512': 1}}, 'logit_bias'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'logit_bias': {'5': 101}}, 'logit_bias'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'max_tokens': 4, 'min_tokens': 5},
     'min_tokens'),
    ('completions', {'model': NAME, 'prompt': 5}, 'prompt'),
    ('completions', {'model': NAME, 'prompt': []}, 'prompt'),
    ('completions', {'model': NAME, 'prompt': [1, 100000]}, 'prompt'),
    ('chat/completions', {'model': NAME, 'messages': 'hi'}, 'messages'),
    ('chat/completions', {'model': NAME, 'messages': [{'role': 'wizard', 'content': 'hi'}]},
     'messages[0].role'),
    ('chat/completions', {'model': NAME, 'messages': [{'role': 'user', 'content': 7}]},
     'messages[0].content'),
    ('chat/completions', {'model': NAME, 'messages': [{'role': 'user', 'content': 'hi'}],
                          'tools': [{'type': 'function', 'function': {'name': 'f',
                                                                      'parameters': 'x'}}]},
     'tools'),
    ('chat/completions', {'model': NAME, 'messages': [{'role': 'user', 'content': 'hi'}],
                          'response_format': {'type': 'json_schema', 'json_schema': {
                              'name': 'x', 'schema': {'type': 'strin'}}}}, 'response_format'),
    ('chat/completions', {'model': NAME, 'messages': [{'role': 'user', 'content': 'hi'}],
                          'tool_choice': 'required'}, 'tool_choice'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'guided_regex': '[a-'}, 'guided_regex'),
    ('completions', {'model': NAME, 'prompt': 'hi', 'guided_choice': ['a', 2]},
     'guided_choice'),
]


def test_bad_requests_answer_400_and_the_server_goes_on(server):
  with httpx.Client(base_url=f'{server}/v1', timeout=30) as http:
    for endpoint, body, param in BAD_REQUESTS:
      response = http.post(f'/{endpoint}', json=body)
      assert response.status_code == 400, (body, response.text)
      error = response.json()['error']
      assert set(error) == {'message', 'type', 'param', 'code'} and error['message']
      assert error['type'] == 'invalid_request_error' and error['param'] == param, error
    unknown = http.post('/completions', json={'model': 'gpt-4', 'prompt': 'hi'})
    error = unknown.json()['error']
    assert unknown.status_code == 404 and error['param'] == 'model', error  # as vLLM answers
    assert error['code'] == 'model_not_found' and "serves 'tiny-chat'" in error['message']
    for raw in (b'{"model": "tiny-chat", "prompt": ', b'\xff\xfe', b'[1, 2]', b'"text"',
                b'[' * 100_000, b'{"model": "tiny-chat", "prompt": "to \\ud800 be"}'):
      response = http.post('/completions', content=raw,
                           headers={'content-type': 'application/json'})
      assert response.status_code == 400 and response.json()['error']['message'], raw
    missing = http.get('/no-such-endpoint')
    assert missing.status_code == 404 and missing.json()['error']['type'] == 'not_found_error'
  client = _client(server)
  with pytest.raises(openai.BadRequestError, match='max_tokens'):
    client.completions.create(model=NAME, prompt='hi', max_tokens=0)
  with pytest.raises(openai.NotFoundError, match='does not exist'):
    client.chat.completions.create(model='gpt-4o', messages=[{'role': 'user', 'content': 'x'}])
  ok = client.completions.create(model=NAME, prompt='hi', max_tokens=3, temperature=0,
                                 extra_body={'ignore_eos': True})
  assert ok.choices[0].finish_reason == 'length' and ok.usage.completion_tokens == 3


def test_sampling_controls_through_the_openai_client(server, reference, tokenizer):
  """Penalties give the greedy tokens their float64 NumPy definitions predict, a bias of 100
  forces its token (also in chat), ``min_tokens`` holds back an end-of-sequence id the bias
  forces, and a seed gives the same samples again, choice ``j`` of ``n`` using ``seed + j``."""
  client = _client(server)
  prompt = [5, 17, 42, 99, 7, 3, 17, 42]

  def ask(max_tokens=10, temperature=0, extra=(), **fields):
    response = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
        extra_body={'ignore_eos': True, 'return_token_ids': True, **dict(extra)}, **fields)
    return [choice.token_ids for choice in response.choices], response.choices[-1]

  [plain], _ = ask()
  penalties = dict(frequency_penalty=1.5, presence_penalty=0.5)
  [penalised], _ = ask(**penalties, extra={'repetition_penalty': 1.3})
  want = penalised_greedy(reference, [prompt], [SamplingParams(**penalties,
                                                               repetition_penalty=1.3)], 10)
  assert penalised == want[0] and penalised != plain
  [forced], _ = ask(logit_bias={'300': 100})
  assert forced == [300] * 10
  eos = {str(tokenizer.eos_id): 100}
  [at_once], choice = ask(logit_bias=eos, extra={'ignore_eos': False})
  assert len(at_once) == 1 and choice.finish_reason == 'stop'
  [held], choice = ask(logit_bias=eos, extra={'ignore_eos': False, 'min_tokens': 3})
  assert len(held) == 4 and held[-1] == tokenizer.eos_id
  assert choice.finish_reason == 'stop'
  chat = client.chat.completions.create(
      model=NAME, messages=[{'role': 'user', 'content': 'hi'}], max_tokens=3, temperature=0,
      logit_bias={'300': 100})
  assert chat.choices[0].message.content == tokenizer.decode([300] * 3)
  pair, _ = ask(temperature=1.0, n=2, seed=11)
  assert ask(temperature=1.0, seed=11)[0][0] == pair[0]
  assert ask(temperature=1.0, seed=12)[0][0] == pair[1] != pair[0]


def test_a_long_prompt_holds_up_no_other_client(server):
  """A 1.5 MB text prompt (about 640,000 tokens, some seconds of tokenizing here) is answered
  400 naming prompt; while it is tokenized another client's /health answers every time within
  1 s (tokenized on the event loop, as before, /health waited for all of it: over 3 s here)."""
  body = {'model': NAME, 'prompt': 'To be, or not to be: ' * 72_000, 'max_tokens': 2}
  answer = {}
  sender = threading.Thread(target=lambda: answer.update(
      response=httpx.post(f'{server}/v1/completions', json=body, timeout=120)))
  started = time.monotonic()
  sender.start()
  gaps, last = [], started
  with httpx.Client(timeout=60) as http:
    while sender.is_alive():
      assert http.get(f'{server}/health').status_code == 200
      gaps.append(time.monotonic() - last)  # the server runs in this process: a stall in
      last = time.monotonic()                # it stalls this thread too, whenever it comes
      time.sleep(0.05)
  took = time.monotonic() - started
  sender.join()
  assert len(gaps) > 5, (took, gaps)  # /health was asked while it ran
  assert max(gaps) < 1.0, (took, gaps)
  error = answer['response'].json()['error']
  assert answer['response'].status_code == 400 and error['param'] == 'prompt', error
  assert error['code'] == 'context_length_exceeded'


def test_a_body_over_the_limit_answers_413(server):
  with httpx.Client(base_url=f'{server}/v1', timeout=60) as http:
    response = http.post('/completions', content=b'x' * (9 << 20),
                         headers={'content-type': 'application/json'})
    assert response.status_code == 413, response.text
    error = response.json()['error']
    assert error['code'] == 'request_too_large' and 'max_request_bytes' in error['message']

    def chunks():  # no Content-Length: refused as the body arrives
      for _ in range(9):
        yield b' ' * (1 << 20)

    response = http.post('/completions', content=chunks(),
                         headers={'content-type': 'application/json'})
    assert response.status_code == 413, response.text
  ok = _client(server).completions.create(model=NAME, prompt='hi', max_tokens=2)
  assert ok.usage.completion_tokens == 2


def _rss_bytes() -> int:
  with open('/proc/self/status') as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmRSS:'))


@pytest.mark.skipif(not os.path.exists('/proc/self/status'), reason='reads VmRSS from /proc')
def test_a_32_mb_body_stalls_no_one_and_leaves_no_memory_behind(server):
  """One client streams a 32 MB body (no Content-Length, so the server cannot refuse it up
  front); meanwhile another's /health answers within 100 ms (all but scheduling noise: at least
  90% of the polls, none over 0.5 s). The body is refused
  413 once past max_request_bytes, and the process (server and both clients: they run here)
  ends within 24 MiB of where it started. Before the limit, such a body stalled /health for
  6.2 s and left the process 2.9 GB larger."""
  with httpx.Client(timeout=60) as http:
    assert http.get(f'{server}/health').status_code == 200
  before = _rss_bytes()
  answer = {}

  def chunks():
    for _ in range(32):
      yield b' ' * (1 << 20)

  def send():
    try:
      answer['response'] = httpx.post(f'{server}/v1/completions', content=chunks(),
                                      headers={'content-type': 'application/json'}, timeout=60)
    except httpx.TransportError as e:  # the server may close the socket as it answers 413
      answer['error'] = e

  sender = threading.Thread(target=send)
  sender.start()
  waits = []
  with httpx.Client(timeout=60) as http:
    while sender.is_alive() or len(waits) < 10:
      asked = time.monotonic()
      assert http.get(f'{server}/health').status_code == 200
      waits.append(time.monotonic() - asked)
      time.sleep(0.01)
  sender.join()
  # Every wait within 100 ms but for scheduling noise: on a loaded 2-core machine one poll in
  # a run can miss it (146 ms seen); a server that stalls on the body misses it for seconds.
  fast = sum(w < 0.1 for w in waits) / len(waits)
  assert fast >= 0.9 and max(waits) < 0.5, sorted(waits)[-5:]
  if 'response' in answer:
    assert answer['response'].status_code == 413, answer['response'].text
  after = _rss_bytes()
  assert after - before < 24 << 20, (before >> 20, after >> 20)
  ok = _client(server).completions.create(model=NAME, prompt='hi', max_tokens=2)
  assert ok.usage.completion_tokens == 2


FUZZ_FIELDS = ('model', 'prompt', 'messages', 'n', 'temperature', 'top_p', 'top_k', 'seed',
               'stop', 'stop_token_ids', 'stream', 'stream_options', 'logprobs', 'top_logprobs',
               'ignore_eos', 'return_token_ids', 'best_of', 'echo', 'suffix', 'logit_bias',
               'presence_penalty', 'frequency_penalty', 'repetition_penalty', 'min_tokens',
               'response_format', 'tool_choice', 'modalities', 'user')


def _random_json(rng, depth=0):
  """A random JSON value: edge-case numbers, odd text, nested arrays and objects."""
  kind = int(rng.integers(0, 8 if depth < 2 else 6))
  if kind == 0:
    return None
  if kind == 1:
    return bool(rng.integers(0, 2))
  if kind == 2:
    return [0, 1, 2, -1, 3, 511, 512, 2**31, -2**31, 2**63, 10**30][int(rng.integers(0, 11))]
  if kind == 3:
    return [0.0, -0.0, 0.5, 1.0, 1.5, -2.5, 1e-300, 1e308, 2.0][int(rng.integers(0, 9))]
  if kind in (4, 5):
    return ['', 'hi', NAME, 'user', 'assistant', 'text', 'image_url', '\x00', '\ud800', 'é' * 3,
            '<|im_end|>', 'data:image/png;base64,xx', 'x' * 300][int(rng.integers(0, 13))]
  if kind == 6:
    return [_random_json(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
  keys = ['role', 'content', 'type', 'text', 'image_url', 'url', 'include_usage', 'name']
  return {keys[int(rng.integers(0, len(keys)))]: _random_json(rng, depth + 1)
          for _ in range(int(rng.integers(0, 4)))}


def _fuzzed(rng) -> tuple[str, bytes]:
  """``(endpoint, body)``: a good request (2 tokens: max_tokens is left alone, so the test stays
  fast) with 1 to 3 fields set to random values, now and then a random JSON value as the whole
  body, or bytes that are not UTF-8."""
  endpoint = ('completions', 'chat/completions')[int(rng.integers(0, 2))]
  body = {'model': NAME, 'max_tokens': 2}
  if endpoint == 'completions':
    body['prompt'] = 'hi'
  else:
    body['messages'] = [{'role': 'user', 'content': 'hi'}]
  for _ in range(int(rng.integers(1, 4))):
    body[FUZZ_FIELDS[int(rng.integers(0, len(FUZZ_FIELDS)))]] = _random_json(rng)
  roll = rng.random()
  if roll < 0.05:
    return endpoint, b'{"model": "\xff\xfe' + bytes(rng.integers(128, 256, 8).tolist())
  if roll < 0.1:
    body = _random_json(rng)
  return endpoint, json.dumps(body).encode()


def test_fuzzed_requests_answer_2xx_or_4xx_and_the_server_goes_on(server):
  """200 random requests (seeded): none is answered 5xx, then a good request is served."""
  rng = np.random.default_rng(44)
  statuses = {}
  with httpx.Client(base_url=f'{server}/v1', timeout=60) as http:
    for _ in range(200):
      endpoint, content = _fuzzed(rng)
      response = http.post(f'/{endpoint}', content=content,
                           headers={'content-type': 'application/json'})
      assert 200 <= response.status_code < 500, (endpoint, content, response.text)
      if response.status_code >= 400:
        assert response.json()['error']['message'], response.text
      statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
  assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 50, statuses  # both kinds ran
  ok = _client(server).completions.create(model=NAME, prompt='hi', max_tokens=2)
  assert ok.usage.completion_tokens == 2


def test_a_full_queue_answers_429_then_serves_again(small):
  url, gate, _ = small
  client = _client(url, timeout=60)
  results = []

  def ask():
    results.append(client.completions.create(model=NAME, prompt='hi', max_tokens=2,
                                              temperature=0, extra_body={'ignore_eos': True}))

  gate.opened.clear()
  threads = [threading.Thread(target=ask) for _ in range(2)]
  try:
    for thread in threads:
      thread.start()
    _wait_for(lambda: _metric(url, 'requests_in_flight') == 2)
    with pytest.raises(openai.RateLimitError) as caught:
      client.completions.create(model=NAME, prompt='hi', max_tokens=2)
    assert caught.value.status_code == 429
    assert caught.value.body['code'] == 'queue_full'
  finally:
    gate.opened.set()
  for thread in threads:
    thread.join(60)
  assert [r.usage.completion_tokens for r in results] == [2, 2]
  assert client.completions.create(model=NAME, prompt='hi', max_tokens=2).choices


def _cancelled(url):
  return _metric(url, 'requests_finished_total{finish_reason="cancelled"}')


def test_a_client_disconnect_cancels_its_request(small):
  url, gate, loop = small
  before = _cancelled(url)
  gate.opened.clear()
  try:  # a client that gives up waiting for a whole response
    with pytest.raises(httpx.ReadTimeout):
      httpx.post(f'{url}/v1/completions', timeout=0.5,
                 json={'model': NAME, 'prompt': 'hi', 'max_tokens': 50, 'ignore_eos': True})
    _wait_for(lambda: _cancelled(url) == before + 1)
  finally:
    gate.opened.set()
  body = {'model': NAME, 'prompt': 'hi', 'max_tokens': 60, 'ignore_eos': True, 'stream': True}
  with httpx.stream('POST', f'{url}/v1/completions', json=body, timeout=30) as response:
    next(response.iter_lines())  # a client that leaves in the middle of a stream
  _wait_for(lambda: _cancelled(url) == before + 2)
  _wait_for(lambda: not loop.engine.has_unfinished() and loop.stats['running'] == 0)
  assert loop.engine.allocator.num_available == loop.engine.max_pages  # pages released
  assert _metric(url, 'requests_in_flight') == 0


def test_health_models_and_metrics(server):
  assert httpx.get(f'{server}/health').json() == {'status': 'ok'}
  client = _client(server)
  assert [m.id for m in client.models.list()] == [NAME]
  assert client.models.retrieve(NAME).id == NAME
  client.completions.create(model=NAME, prompt='hi', max_tokens=2)
  response = httpx.get(f'{server}/metrics')
  assert response.status_code == 200 and response.headers['content-type'].startswith('text/plain')
  text = response.text
  for family, kind in [('http_requests_total', 'counter'), ('requests_finished_total', 'counter'),
                       ('prompt_tokens_total', 'counter'), ('generation_tokens_total', 'counter'),
                       ('time_to_first_token_seconds', 'histogram'),
                       ('request_duration_seconds', 'histogram'), ('queue_depth', 'gauge'),
                       ('requests_running', 'gauge'), ('kv_pages_used', 'gauge')]:
    assert f'# TYPE maxnnx_{family} {kind}\n' in text, family
  assert 'maxnnx_http_requests_total{endpoint="completions",status="200"}' in text
  assert _metric(server, 'generation_tokens_total') >= 2
  assert _metric(server, 'time_to_first_token_seconds_count') >= 1
  assert _metric(server, 'queue_depth') == 0
  assert _metric(server, 'kv_sliding_pages_total') == 0  # no sliding layers: one pool


def _burst_params(rng, i):
  """The sampling fields of request ``i`` of a burst: greedy, top-p, penalties, a bias."""
  kinds = [{'temperature': 0},
           {'temperature': 0.8, 'top_p': 0.9, 'seed': int(rng.integers(1000))},
           {'temperature': 0, 'presence_penalty': 0.5, 'frequency_penalty': 0.3,
            'extra_body': {'repetition_penalty': 1.2}},
           {'temperature': 0.7, 'logit_bias': {str(int(rng.integers(512))): 5}, 'logprobs': 2,
            'extra_body': {'min_tokens': 2}}]
  return {**kinds[i % len(kinds)], 'max_tokens': int(rng.integers(2, 8))}


@pytest.mark.parametrize('speculation', [
    pytest.param({}, id='plain'),
    pytest.param({'speculative_method': 'ngram', 'num_speculative_tokens': 3}, id='ngram')])
def test_health_is_503_until_warm_then_bursts_compile_nothing(model_dir, tokenizer, speculation):
  """/health answers 503 while the engine warms up, 200 after; then ten bursts of 12
  concurrent requests of mixed lengths and sampling settings compile no program, also with
  speculative decoding (whose counts /metrics reports)."""
  engine = Engine(maxnnx.from_pretrained(model_dir), tokenizer, **SERVER_ENGINE, **speculation)
  opened, warmup = threading.Event(), engine.warmup
  engine.warmup = lambda progress=None: opened.wait(60) and warmup(progress)
  app = make_app(engine, model_name=NAME, max_queue=12)
  with _running(app) as (url, _):
    response = httpx.get(f'{url}/health')
    assert response.status_code == 503 and response.json()['status'] == 'warming up'
    opened.set()
    _wait_until_ready(url)
    assert httpx.get(f'{url}/health').json() == {'status': 'ok'}
    built = _metric(url, 'compiles_total') + _metric(url, 'compile_cache_hits_total')
    assert built >= len(engine.step_buckets())  # every model bucket, compiled or read back
    rng = np.random.default_rng(7)

    async def burst():
      prompts = [rng.integers(0, 512, int(n)).tolist() for n in rng.integers(1, 70, 12)]
      async with openai.AsyncOpenAI(base_url=f'{url}/v1', api_key='unused',
                                    max_retries=0) as client:
        return await asyncio.gather(*[
            client.completions.create(model=NAME, prompt=prompt, **_burst_params(rng, i))
            for i, prompt in enumerate(prompts)])

    for _ in range(10):
      answers = asyncio.run(burst())
      assert all(a.choices[0].finish_reason in ('stop', 'length') for a in answers)
      assert _metric(url, 'compiles_after_ready_total') == 0
    assert engine.compiles.after_warmup == 0 and engine.compiles.warm
    drafted = _metric(url, 'spec_decode_num_draft_tokens_total')
    assert drafted == engine.spec.draft_tokens and (drafted > 0) == bool(speculation)
    assert _metric(url, 'spec_decode_num_accepted_tokens_total') == engine.spec.accepted_tokens


def test_stable_text_holds_back_what_may_change():
  assert stable_text('abc\ufffd', []) == 'abc'
  assert stable_text('hello\n', ['\n\n']) == 'hello'
  assert stable_text('hello wo', ['world', 'x']) == 'hello '
  assert stable_text('hello', ['lo!']) == 'hel'


@pytest.mark.slow  # a server process of its own: import, load and compile take most of a minute
def test_sigterm_lets_the_requests_in_flight_finish(model_dir):
  """``maxnnx serve`` in a process of its own: SIGTERM during a stream; the stream still ends
  with [DONE], then the process exits."""
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    port = sock.getsockname()[1]
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join(
      [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get(
          'PYTHONPATH', '')])}
  process = subprocess.Popen([sys.executable, '-m', 'maxnnx', 'serve', f'model={model_dir}',
                              f'port={port}', f'served_model_name={NAME}', 'max_model_len=512'],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  try:
    url = f'http://127.0.0.1:{port}'
    deadline = time.monotonic() + 300  # warm-up compiles every bucket: slow on a busy machine
    while True:
      if process.poll() is not None or time.monotonic() > deadline:
        process.kill()  # so that reading its output ends
        pytest.fail(f'the server did not become healthy:\n{process.stdout.read().decode()}')
      with contextlib.suppress(httpx.TransportError):
        if httpx.get(f'{url}/health').status_code == 200:
          break
      time.sleep(0.2)
    # Long enough that the stream still runs when the signal is handled (uvicorn looks every
    # 0.1 s; a warm engine streams a 1-layer model's 120 tokens in less).
    body = {'model': NAME, 'prompt': 'hi', 'max_tokens': 480, 'ignore_eos': True,
            'temperature': 0, 'stream': True}
    with httpx.stream('POST', f'{url}/v1/completions', json=body, timeout=60) as response:
      lines = response.iter_lines()
      first = next(line for line in lines if line)
      process.send_signal(signal.SIGTERM)
      rest = [line for line in lines if line]
    chunks = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
    assert rest[-1] == 'data: [DONE]' and chunks[-1]['choices'][0]['finish_reason'] == 'length'
    process.wait(60)
    assert process.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
    log = process.stdout.read().decode()
    assert 'Waiting for connections to close' in log  # the signal came while the stream ran
    assert log.index('Waiting for connections') < log.index('Application shutdown complete')
  finally:
    if process.poll() is None:
      process.kill()


# -- echo and best_of ----------------------------------------------------------------------


def _reference_logprobs(model, ids):
  """``[len(ids), vocab]`` float64 log-softmax of the model's logits after each token."""
  logits = np.asarray(model(jnp.asarray([ids]))[0], np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _check_prompt_part(logprobs, ids, want, tokenizer, top):
  """The first ``len(ids)`` entries of a completions ``logprobs`` object score ``ids`` as the
  reference log-probabilities ``want`` do."""
  tokens = [tokenizer.decode([i]) for i in ids]
  assert logprobs['tokens'][:len(ids)] == tokens
  assert logprobs['text_offset'][:len(ids)] == np.cumsum([0] + [len(t) for t in tokens])[
      :-1].tolist()
  assert logprobs['token_logprobs'][0] is None and logprobs['top_logprobs'][0] is None
  got = np.array(logprobs['token_logprobs'][1:len(ids)])
  expected = np.array([want[t - 1, ids[t]] for t in range(1, len(ids))])
  np.testing.assert_allclose(got, expected, rtol=1e-4)
  for t in range(1, len(ids)):
    entry = logprobs['top_logprobs'][t]
    best = np.sort(want[t - 1])[::-1][:top]
    assert len(entry) <= top  # two tokens with the same text share one key
    if len(entry) == top:
      np.testing.assert_allclose(sorted(entry.values(), reverse=True), best, rtol=1e-4)
    for text, value in entry.items():
      assert any(abs(value - want[t - 1, i]) <= 1e-4 * abs(value)
                 for i in np.argsort(-want[t - 1])[:top] if tokenizer.decode([i]) == text)


def test_echo_with_max_tokens_0_scores_the_prompt_as_the_model_does(server, reference,
                                                                    tokenizer):
  """lm-evaluation-harness's request: the text is the prompt exactly, one log-probability per
  prompt token (BOS included), the first null, the others the model's own log-softmax."""
  prompt = 'ROMEO: But soft, what light through yonder window breaks?'
  ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
  response = httpx.post(f'{server}/v1/completions', timeout=60, json={
      'model': NAME, 'prompt': prompt, 'max_tokens': 0, 'echo': True, 'logprobs': 2})
  assert response.status_code == 200, response.text
  choice = response.json()['choices'][0]
  assert choice['text'] == prompt and choice['finish_reason'] == 'length'
  assert len(choice['logprobs']['tokens']) == len(ids)
  _check_prompt_part(choice['logprobs'], ids, _reference_logprobs(reference, ids), tokenizer, 2)
  usage = response.json()['usage']
  assert usage['prompt_tokens'] == len(ids) and usage['completion_tokens'] == 0


def test_echo_of_token_id_prompts_then_generated_tokens(server, reference, tokenizer):
  """Two token-id prompts with ``max_tokens=2``: each choice is its prompt (decoded, scored as
  the model does) followed by exactly the normal greedy completion and its log-probabilities."""
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 512, 9).tolist(), rng.integers(0, 512, 17).tolist()]
  args = {'model': NAME, 'prompt': prompts, 'max_tokens': 2, 'temperature': 0,
          'ignore_eos': True, 'logprobs': 1}
  with httpx.Client(base_url=f'{server}/v1', timeout=60) as http:
    plain = http.post('/completions', json=args).json()['choices']
    echoed = http.post('/completions', json={**args, 'echo': True}).json()['choices']
  for ids, normal, choice in zip(prompts, plain, echoed):
    text = tokenizer.decode(ids)
    assert choice['text'] == text + normal['text']
    lp, tail = choice['logprobs'], normal['logprobs']
    assert len(lp['tokens']) == len(ids) + 2
    _check_prompt_part(lp, ids, _reference_logprobs(reference, ids), tokenizer, 1)
    assert lp['tokens'][len(ids):] == tail['tokens']
    # the prefix cache may serve the second request's prompt: the same numbers to float32
    np.testing.assert_allclose(lp['token_logprobs'][len(ids):], tail['token_logprobs'],
                               rtol=1e-5)
    for echoed_top, top in zip(lp['top_logprobs'][len(ids):], tail['top_logprobs']):
      assert echoed_top.keys() == top.keys()
      np.testing.assert_allclose(list(echoed_top.values()), list(top.values()), rtol=1e-5)
    assert lp['text_offset'][len(ids):] == [len(text) + o for o in tail['text_offset']]


def test_the_openai_client_takes_an_echoed_prompt(server):
  client = _client(server)
  response = client.completions.create(model=NAME, prompt='Speak, speak.', echo=True,
                                       logprobs=2, max_tokens=0)
  choice = response.choices[0]
  assert choice.text == 'Speak, speak.' and choice.logprobs.token_logprobs[0] is None
  assert all(p < 0 for p in choice.logprobs.token_logprobs[1:])
  plain = client.completions.create(model=NAME, prompt='Speak', echo=True, max_tokens=3,
                                    temperature=0)
  assert plain.choices[0].text.startswith('Speak') and plain.choices[0].logprobs is None


ECHO_BAD_REQUESTS = [  # (endpoint, body, param)
    ('completions', {'prompt': 'hi', 'max_tokens': 0}, 'max_tokens'),
    ('completions', {'prompt': 'hi', 'max_tokens': 0, 'echo': False}, 'max_tokens'),
    ('completions', {'prompt': 'hi', 'echo': 'yes'}, 'echo'),
    ('completions', {'prompt': 'hi', 'echo': True, 'stream': True}, 'echo'),
    ('completions', {'prompt': 'hi', 'echo': True, 'logprobs': 99}, 'logprobs'),
    ('chat/completions', {'messages': [{'role': 'user', 'content': 'hi'}], 'echo': True},
     'echo'),
    ('completions', {'prompt': 'hi', 'best_of': 3, 'stream': True}, 'best_of'),
    ('completions', {'prompt': 'hi', 'n': 3, 'best_of': 2}, 'best_of'),
    ('completions', {'prompt': 'hi', 'best_of': 65}, 'best_of'),
    ('completions', {'prompt': 'hi', 'best_of': 0}, 'best_of'),
    ('completions', {'prompt': 'hi', 'best_of': 2, 'max_tokens': 0, 'echo': True}, 'best_of'),
]


@pytest.mark.parametrize('endpoint,body,param', ECHO_BAD_REQUESTS)
def test_bad_echo_and_best_of_requests_answer_400_naming_the_field(server, endpoint, body,
                                                                   param):
  response = httpx.post(f'{server}/v1/{endpoint}', json={'model': NAME, **body}, timeout=30)
  assert response.status_code == 400, response.text
  assert response.json()['error']['param'] == param, response.text


def test_best_of_answers_the_samples_with_the_highest_mean_logprob(server):
  """``best_of=4, n=2`` answers, of the 4 samples ``n=4`` gives with the same seed, the two
  with the highest mean log-probability per token, best first; usage counts all 4."""
  args = {'model': NAME, 'prompt': 'To be, or not', 'max_tokens': 5, 'temperature': 1.0,
          'seed': 7, 'ignore_eos': True}
  with httpx.Client(base_url=f'{server}/v1', timeout=60) as http:
    samples = http.post('/completions', json={**args, 'n': 4, 'logprobs': 0}).json()['choices']
    best = http.post('/completions', json={**args, 'n': 2, 'best_of': 4}).json()
  means = [np.mean(c['logprobs']['token_logprobs']) for c in samples]
  order = sorted(range(4), key=lambda i: -means[i])
  assert [c['text'] for c in best['choices']] == [samples[i]['text'] for i in order[:2]]
  assert [c['index'] for c in best['choices']] == [0, 1]
  assert all(c['logprobs'] is None for c in best['choices'])
  assert best['usage']['completion_tokens'] == 20

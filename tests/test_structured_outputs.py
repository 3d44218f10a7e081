"""Structured outputs: a grammar's token mask in the engine, then JSON schemas, regular
expressions and tool calls through the OpenAI server, with a tiny random model (its free
output is garbage, which makes the constraint visible)."""

import json
import re

import jax.numpy as jnp
import llguidance
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.data import load_tokenizer
from maxnnx.inference.structured import StructuredOutput, allowed_ids, grammar_tokenizer
from maxnnx.serving import Engine, SamplingParams
from maxnnx.serving.tools import held_back, parse_tool_calls
from tests.test_serving_server import model_dir, server  # noqa: F401  (module fixtures)

PERSON = {
  'type': 'object',
  'properties': {
    'name': {'enum': ['ada', 'bob', 'cy']},
    'age': {'type': 'integer', 'minimum': 18, 'maximum': 99},
    'address': {'type': 'object', 'properties': {'zip': {'type': 'integer', 'minimum': 0,
                                                         'maximum': 999},
                                                 'city': {'enum': ['rome', 'oslo']}},
                'required': ['zip', 'city'], 'additionalProperties': False},
    'tags': {'type': 'array', 'items': {'enum': ['x', 'y']}, 'minItems': 1, 'maxItems': 3},
    'ok': {'type': 'boolean'},
  },
  'required': ['name', 'age', 'address', 'tags', 'ok'],
  'additionalProperties': False,
}


def check_schema(value, schema, where='$'):
  """Raise AssertionError where ``value`` breaks ``schema`` (the keywords the tests use)."""
  if 'enum' in schema:
    assert value in schema['enum'], f'{where}: {value!r} not in {schema["enum"]}'
  kind = schema.get('type')
  if kind == 'object':
    assert isinstance(value, dict), f'{where}: {value!r} is not an object'
    props = schema.get('properties', {})
    for key in schema.get('required', []):
      assert key in value, f'{where}: missing {key!r}'
    if schema.get('additionalProperties') is False:
      assert set(value) <= set(props), f'{where}: extra keys {set(value) - set(props)}'
    for key, item in value.items():
      if key in props:
        check_schema(item, props[key], f'{where}.{key}')
  elif kind == 'array':
    assert isinstance(value, list), f'{where}: {value!r} is not an array'
    assert schema.get('minItems', 0) <= len(value) <= schema.get('maxItems', len(value))
    for i, item in enumerate(value):
      check_schema(item, schema.get('items', {}), f'{where}[{i}]')
  elif kind == 'integer':
    assert isinstance(value, int) and not isinstance(value, bool), f'{where}: {value!r}'
    assert schema.get('minimum', value) <= value <= schema.get('maximum', value), where
  elif kind == 'boolean':
    assert isinstance(value, bool), f'{where}: {value!r} is not a boolean'
  elif kind == 'string':
    assert isinstance(value, str), f'{where}: {value!r} is not a string'


def test_the_validator_of_these_tests_can_fail():
  good = {'name': 'ada', 'age': 18, 'address': {'zip': 1, 'city': 'oslo'}, 'tags': ['x'],
          'ok': True}
  check_schema(good, PERSON)
  for bad in ({**good, 'age': 17}, {**good, 'name': 'eve'}, {**good, 'tags': []},
              {**good, 'address': {'zip': 1}}, {**good, 'ok': 1}, {**good, 'more': 1}):
    with pytest.raises(AssertionError):
      check_schema(bad, PERSON)


@pytest.fixture(scope='module')
def tokenizer(chat_checkpoint):
  return load_tokenizer(str(chat_checkpoint))


@pytest.fixture(scope='module')
def model():
  return maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=512, num_layers=1),
                            rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def engine(model, tokenizer):
  return Engine(model, tokenizer, max_batch=2, token_budget=32, page_size=8, max_model_len=128,
                token_buckets=(32,), page_buckets=(16,))


def test_constrained_greedy_tokens_are_the_argmax_over_the_grammars_allowed_tokens(
    model, tokenizer, engine):
  """Each token equals the argmax of the model's own logits (a plain forward pass over the
  prompt and the tokens before it) among the tokens a fresh matcher allows there; beside it
  an unconstrained request runs in the same steps."""
  prompt = tokenizer.encode('Who is there?')
  structured = StructuredOutput.json_schema(PERSON)
  constrained, free = engine.generate(
      [prompt, prompt], [SamplingParams(max_tokens=80, structured=structured),
                         SamplingParams(max_tokens=8, ignore_eos=True)])
  assert constrained.finish_reason == 'stop'
  check_schema(json.loads(constrained.text), PERSON)
  vocab = model.config.vocab_size
  grammar_tok = grammar_tokenizer(tokenizer, vocab, sorted(engine.eos_ids))
  matcher = llguidance.LLMatcher(grammar_tok, structured.grammar())
  ids = list(prompt) + list(constrained.token_ids)
  logits_TV = np.asarray(model(jnp.asarray(ids)[None])[0], np.float32)
  masked_differs = False
  for t, token in enumerate(constrained.token_ids):
    mask_W = np.frombuffer(matcher.compute_bitmask(), np.int32)
    allowed = allowed_ids(mask_W, vocab)
    row = logits_TV[len(prompt) + t - 1]
    assert token == allowed[np.argmax(row[allowed])], t
    masked_differs |= token != int(np.argmax(row))
    assert matcher.consume_token(token)
  assert matcher.is_stopped()  # the output is complete: the engine stopped it there
  assert masked_differs  # the mask changed what greedy decoding would write
  assert free.token_ids == tuple(int(np.argmax(r)) for r in np.asarray(
      model(jnp.asarray(prompt + list(free.token_ids[:-1]))[None])[0])[len(prompt) - 1:])


def test_a_regex_is_matched_whole_and_sampling_stays_inside_it(engine, tokenizer):
  """Sampled rows, one with penalties and a logit bias beside its mask: every reply matches."""
  pattern = r'(yes|no) [0-9]{2,4}'
  digit = tokenizer.encode('7')[0]
  controls = [{}, {}, {'repetition_penalty': 1.5, 'presence_penalty': 1.0},
              {'logit_bias': {digit: 100.0}, 'top_k': 3}]
  outs = engine.generate([tokenizer.encode('Well?')] * 4, [
      SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                     structured=StructuredOutput('regex', pattern), **c)
      for s, c in enumerate(controls)])
  assert '77' in outs[3].text  # the bias still acts among the allowed tokens
  for out in outs:
    assert re.fullmatch(pattern, out.text), out.text
    assert out.finish_reason == 'stop'


@pytest.mark.parametrize('kind, spec, problem', [
  ('json_schema', '{"type": "strin"}', 'strin'),
  ('json_schema', '{"type": ', 'not valid JSON'),
  ('regex', '[a-', 'regex'),
  ('grammar', 'start: foo', 'foo'),
  ('yaml', '', 'expected one of'),
])
def test_a_grammar_that_does_not_compile_is_one_value_error_naming_it(kind, spec, problem):
  with pytest.raises(ValueError, match=re.escape(problem)):
    StructuredOutput(kind, spec)


# -- through the OpenAI server ------------------------------------------------------------

SCHEMAS = {
  'nested': PERSON,
  'enum': {'type': 'object', 'properties': {'mood': {'enum': ['calm', 'glad', 'sad']}},
           'required': ['mood'], 'additionalProperties': False},
  'array': {'type': 'array', 'items': {'type': 'integer', 'minimum': 0, 'maximum': 9},
            'minItems': 2, 'maxItems': 4},
  'integer': {'type': 'object', 'properties': {'n': {'type': 'integer', 'minimum': -5,
                                                     'maximum': 120}},
              'required': ['n'], 'additionalProperties': False},
}
WEATHER = {'type': 'function', 'function': {
  'name': 'get_weather', 'description': 'The forecast for a city.',
  'parameters': {'type': 'object', 'properties': {
      'city': {'enum': ['rome', 'oslo', 'lima']},
      'days': {'type': 'integer', 'minimum': 1, 'maximum': 7}},
    'required': ['city', 'days'], 'additionalProperties': False}}}
CLOCK = {'type': 'function', 'function': {
  'name': 'get_time', 'parameters': {'type': 'object', 'properties': {
      'zone': {'enum': ['utc', 'cet']}}, 'required': ['zone'], 'additionalProperties': False}}}
ASK = [{'role': 'user', 'content': 'Tell me about the weather.'}]


def _chat(client, **fields):
  from tests.test_serving_server import NAME
  return client.chat.completions.create(model=NAME, messages=ASK, **fields)


@pytest.fixture(scope='module')
def client(server):  # noqa: F811  (the fixture imported above)
  from tests.test_serving_server import _client
  return _client(server)


@pytest.mark.parametrize('name', sorted(SCHEMAS))
def test_every_reply_to_a_json_schema_parses_and_validates(client, name):
  """Sampled replies (three seeds), and a streamed one, are JSON valid under the schema."""
  schema = SCHEMAS[name]
  fmt = {'type': 'json_schema', 'json_schema': {'name': name, 'schema': schema}}
  for seed in range(3):
    reply = _chat(client, response_format=fmt, temperature=1.0, seed=seed, max_tokens=100)
    choice = reply.choices[0]
    assert choice.finish_reason == 'stop', choice
    check_schema(json.loads(choice.message.content), schema)
  chunks = list(_chat(client, response_format=fmt, temperature=1.0, seed=7, max_tokens=100,
                      stream=True))
  text = ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices)
  assert chunks[-1].choices[0].finish_reason == 'stop'
  check_schema(json.loads(text), schema)


def test_json_object_gives_an_object(client):
  reply = _chat(client, response_format={'type': 'json_object'}, temperature=0, max_tokens=100)
  assert reply.choices[0].finish_reason == 'stop', reply
  assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_guided_regex_and_grammar_on_completions(client):
  from tests.test_serving_server import NAME
  pattern = r'[a-c]{3}-[0-9]{1,3}'
  for seed in range(3):
    out = client.completions.create(model=NAME, prompt='Code:', max_tokens=20, seed=seed,
                                    temperature=1.0, extra_body={'guided_regex': pattern})
    assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text
    assert out.choices[0].finish_reason == 'stop'
  grammar = 'start: pair (";" pair)?\npair: KEY "=" NUM\nKEY: /[xy]/\nNUM: /[0-9]/\n'
  out = client.completions.create(model=NAME, prompt='Set:', max_tokens=20, temperature=0,
                                  extra_body={'guided_grammar': grammar})
  assert re.fullmatch(r'[xy]=[0-9](;[xy]=[0-9])?', out.choices[0].text), out.choices[0].text
  choices = ['red', 'green', 'a "blue" one']
  texts = {client.completions.create(
      model=NAME, prompt='Color:', max_tokens=10, temperature=1.0, seed=seed,
      extra_body={'guided_choice': choices}).choices[0].text for seed in range(6)}
  assert texts <= set(choices) and texts, texts


def _check_call(call, tools):
  function = {t['function']['name']: t['function'] for t in tools}[call.function.name]
  assert call.type == 'function' and call.id.startswith('call_')
  check_schema(json.loads(call.function.arguments), function['parameters'])


def test_tool_choice_required_and_named_come_back_as_tool_calls(client):
  tools = [WEATHER, CLOCK]
  for seed in range(3):
    reply = _chat(client, tools=tools, tool_choice='required', parallel_tool_calls=False,
                  temperature=1.0, seed=seed, max_tokens=100)
    choice = reply.choices[0]
    assert choice.finish_reason == 'tool_calls', choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], tools)
  named = _chat(client, tools=tools, temperature=1.0, seed=3, max_tokens=100,
                tool_choice={'type': 'function', 'function': {'name': 'get_time'}})
  [call] = named.choices[0].message.tool_calls
  assert call.function.name == 'get_time'
  _check_call(call, tools)
  chunks = list(_chat(client, tools=tools, tool_choice='required', parallel_tool_calls=False,
                      temperature=0, max_tokens=100, stream=True))
  deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
  assert chunks[-1].choices[0].finish_reason == 'tool_calls'
  assert {tc.index for tc in deltas} == {0}
  head, rest = deltas[0], deltas[1:]  # the call's header, then its arguments piece by piece
  assert rest and all(tc.id is None and tc.function.name is None for tc in rest)
  head.function.arguments += ''.join(tc.function.arguments for tc in rest)
  _check_call(head, tools)
  whole = _chat(client, tools=tools, tool_choice='required', parallel_tool_calls=False,
                temperature=0, max_tokens=100).choices[0].message.tool_calls[0]
  assert (head.function.name, head.function.arguments) == (whole.function.name,
                                                           whole.function.arguments)
  assert not ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices)


def test_a_schema_that_does_not_compile_answers_400_and_the_next_request_is_served(
    client, server):  # noqa: F811  (the fixture imported above)
  import openai
  bad = {'type': 'json_schema', 'json_schema': {'name': 'bad', 'schema': {
      'type': 'object', 'properties': {'x': {'type': 'intege'}}}}}
  with pytest.raises(openai.BadRequestError, match='intege') as raised:
    _chat(client, response_format=bad, max_tokens=5)
  assert raised.value.body['param'] == 'response_format'
  with pytest.raises(openai.BadRequestError, match='get_nothing'):
    _chat(client, tools=[WEATHER], max_tokens=5,
          tool_choice={'type': 'function', 'function': {'name': 'get_nothing'}})
  fmt = {'type': 'json_schema', 'json_schema': {'name': 'enum', 'schema': SCHEMAS['enum']}}
  reply = _chat(client, response_format=fmt, temperature=0, max_tokens=40)
  check_schema(json.loads(reply.choices[0].message.content), SCHEMAS['enum'])
  # The masks went through the programs warm-up compiled: nothing compiled since.
  from tests.test_serving_server import _metric
  assert _metric(server, 'compiles_total') + _metric(server, 'compile_cache_hits_total') > 0
  assert _metric(server, 'compiles_after_ready_total') == 0


# -- tool calls: the parser and the template --------------------------------------------


@pytest.mark.parametrize('fmt, text, content, calls', [
  ('hermes', '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None,
   [('f', {'a': 1})]),
  ('hermes', 'Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
   '<tool_call>{"name": "g", "arguments": {"b": [1, "x"]}}</tool_call>', 'Sure.',
   [('f', {}), ('g', {'b': [1, 'x']})]),
  ('hermes', '<tool_call>{"name": "f", "arguments": {"a": </tool_call>',
   '<tool_call>{"name": "f", "arguments": {"a": </tool_call>', []),
  ('hermes', 'no call here', 'no call here', []),
  ('llama3', '{"name": "f", "parameters": {"q": "é"}}', None, [('f', {'q': 'é'})]),
  ('llama3', '<|python_tag|>{"name": "f", "parameters": {}}', None, [('f', {})]),
  ('llama3', '{"answer": 4}', '{"answer": 4}', []),
  ('llama3', 'It is {"name": "f"}', 'It is {"name": "f"}', []),
  ('mistral', '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", '
   '"arguments": {}}]', None, [('f', {'a': 1}), ('g', {})]),
  ('mistral', '[{"name": "f", "arguments": {}}]', '[{"name": "f", "arguments": {}}]', []),
])
def test_tool_calls_parse_out_of_each_format(fmt, text, content, calls):
  got_content, got = parse_tool_calls(text, fmt)
  assert got_content == content
  assert [(c.name, json.loads(c.arguments)) for c in got] == calls
  assert len({c.id for c in got}) == len(got)


def test_streaming_holds_back_only_what_may_become_a_call():
  assert held_back('Hello <tool_call>{"na', 'hermes') == len('Hello ')
  assert held_back('Hello <tool', 'hermes') == len('Hello ')
  assert held_back('Hello there', 'hermes') == len('Hello there')
  assert held_back('  {"name', 'llama3') == 0
  assert held_back('It is {', 'llama3') == len('It is {')
  assert held_back('ok [TOOL_', 'mistral') == len('ok ')


def test_the_template_gets_the_tools_and_the_format_follows_it(tokenizer):
  from maxnnx.data.chat import ChatTemplate
  from maxnnx.serving.openai_api import ServedModel
  from maxnnx.serving.openai_chat import parse_chat
  source = ('{% for t in tools or [] %}TOOL {{ t.function.name }};{% endfor %}'
            '{% for m in messages %}{{ m.role }}: {{ m.content }};{% endfor %}')
  served = ServedModel('m', tokenizer, ChatTemplate(source), 128, 512, 5)
  body = {'model': 'm', 'messages': ASK, 'tools': [WEATHER, CLOCK], 'max_tokens': 4}
  parsed = parse_chat(body, served)
  assert tokenizer.decode(parsed.prompts[0]).startswith('TOOL get_weather;TOOL get_time;user')
  assert parsed.tool_format == 'hermes' and parsed.params[0].structured is None  # auto
  assert parse_chat({**body, 'tool_choice': 'none'}, served).tool_format is None
  forced = parse_chat({**body, 'tool_choice': 'required'}, served).params[0].structured
  assert forced.kind == 'grammar' and '<tool_call>' in forced.spec
  llama = ServedModel('m', tokenizer, ChatTemplate(source + '<|python_tag|>'), 128, 512, 5)
  forced = parse_chat({**body, 'tool_choice': 'required'}, llama).params[0].structured
  assert parse_chat(body, llama).tool_format == 'llama3' and '"parameters"' in forced.spec


def test_a_streamed_reply_sends_its_text_but_never_the_calls_text_as_content():
  """ChoiceStream fed a reply piece by piece (tool_choice auto): the text before the call
  streams, the call's text never does as content (its arguments stream as tool-call deltas,
  tests/test_serving_tools_stream.py), and the finished reply carries the parsed call."""
  from maxnnx.serving.openai_responses import ChoiceStream
  from maxnnx.serving.params import RequestOutput
  pieces = ['Let me ', 'check. <tool', '_call>\n{"name": "get_time", ', '"arguments": ',
            '{"zone": "utc"}}\n</tool_call>']
  stream = ChoiceStream(0, None, SamplingParams(), tool_format='hermes')
  sent = []
  for k in range(1, len(pieces) + 1):
    done = k == len(pieces)
    out = RequestOutput(0, (k,), None, tuple(range(1, k + 1)), done, 'stop' if done else None,
                        ''.join(pieces[:k]), 0)
    sent.append(stream.update(out)[0])
  assert sent == ['Let me ', 'check. ', '', '', '']
  assert stream.finish_reason == 'tool_calls' and stream.text == 'Let me check.'
  [call] = stream.tool_calls
  assert (call.name, json.loads(call.arguments)) == ('get_time', {'zone': 'utc'})


@pytest.mark.parametrize('fmt, first', [('hermes', '<tool_call>'), ('mistral', '[TOOL_CALLS]')])
def test_a_forced_call_writes_a_marker_token_the_vocabulary_has_as_that_token(
    model, tmp_path, fmt, first):
  """With ``<tool_call>`` / ``[TOOL_CALLS]`` special tokens in the vocabulary, the grammar
  of a forced call starts with that one token (the model's own way to write it), and the
  reply parses back into a call whose arguments validate."""
  from maxnnx.data.chat import CHATML_TEMPLATE, special_tokens
  from maxnnx.serving.tools import call_grammar
  from tests.conftest import CHAT_SPECIALS, _byte_level_bpe, _write_tokenizer_dir
  markers = ['<tool_call>', '</tool_call>', '[TOOL_CALLS]']
  _write_tokenizer_dir(tmp_path, _byte_level_bpe(500, CHAT_SPECIALS + markers),
                       {'eos_token': '<|im_end|>', 'chat_template': CHATML_TEMPLATE})
  tok = load_tokenizer(str(tmp_path))
  specials = special_tokens(tok)
  engine = Engine(model, tok, max_batch=2, token_budget=32, page_size=8, max_model_len=128,
                  token_buckets=(32,), page_buckets=(16,))
  structured = StructuredOutput('grammar', call_grammar([WEATHER], fmt, specials=specials))
  outs = engine.generate([tok.encode('Weather?')] * 2, [
      SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured=structured)
      for s in range(2)])
  for out in outs:
    assert out.finish_reason == 'stop' and out.token_ids[0] == specials[first]
    if fmt == 'hermes':
      assert out.token_ids[-1] == specials['</tool_call>']
    content, [call] = parse_tool_calls(out.text, fmt)
    assert content is None and call.name == 'get_weather'
    check_schema(json.loads(call.arguments), WEATHER['function']['parameters'])


def test_structured_requests_speculate_to_the_plain_engines_tokens(model, tokenizer, engine):
  """With n-gram speculation, requests under a JSON schema and under regexes that force
  repeats (so drafts are proposed and kept) give the plain engine's tokens, greedy; sampled
  replies still match their regex."""
  spec = Engine(model, tokenizer, max_batch=4, token_budget=32, page_size=8, max_model_len=128,
                token_buckets=(32,), page_buckets=(16,), speculative_method='ngram',
                num_speculative_tokens=3)
  prompt = tokenizer.encode('Who is there?')
  greedy = [StructuredOutput.json_schema(PERSON), StructuredOutput('regex', r'(ab ){6}[a-z]{2,5}'),
            StructuredOutput('regex', r'(yes|no)( (yes|no|maybe)){8}')]
  params = [SamplingParams(max_tokens=80, structured=s) for s in greedy]
  want = engine.generate([prompt] * 3, params)
  got = spec.generate([prompt] * 3, params)
  assert [g.token_ids for g in got] == [w.token_ids for w in want]
  assert spec.spec.drafts > 0 and spec.spec.accepted_tokens > 0
  pattern = r'(ab ){6}(yes|no) [0-9]{2,4}'
  outs = spec.generate([prompt] * 4, [SamplingParams(
      max_tokens=60, temperature=1.0, seed=s, structured=StructuredOutput('regex', pattern))
      for s in range(4)])
  for out in outs:
    assert re.fullmatch(pattern, out.text) and out.finish_reason == 'stop', out.text
  assert spec.allocator.num_available == spec.max_pages

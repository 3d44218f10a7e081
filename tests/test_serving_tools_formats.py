"""DeepSeek (V3 and V3.1) and harmony (GPT-OSS) tool calls: parsed whole, streamed piece by
piece (the pieces join to the whole parse, character by character, in random chunks and for
random arguments), forced by a grammar, and through the chat server end to end."""

import json
import random
import types

import llguidance
import pytest
from flax import nnx

import maxnnx
from maxnnx.data import load_tokenizer
from maxnnx.data.chat import encode_with_specials, special_tokens
from maxnnx.inference import end_of_turn_ids
from maxnnx.inference.structured import StructuredOutput, grammar_tokenizer
from maxnnx.serving import SamplingParams
from maxnnx.serving.openai_responses import ChoiceStream, chunk, response_body
from maxnnx.serving.params import RequestOutput
from maxnnx.serving.tools import (
  call_grammar,
  held_back,
  parse_tool_calls,
  split_reply,
  streamed_calls,
  tool_format,
)
from tests.test_serving_tools_stream import (
  _random_value,
  _request,
  _splits,
  _stream,
  check_streamed_calls,
)


def _ds(words):
  """A DeepSeek marker: full-width bars, U+2581 between the words."""
  return '<\uff5c' + words.replace(' ', '\u2581') + '\uff5c>'


CALLS, CALLS_END = _ds('tool calls begin'), _ds('tool calls end')
CALL, CALL_END, SEP = _ds('tool call begin'), _ds('tool call end'), _ds('tool sep')


def v3_call(name, arguments):
  """One call as DeepSeek V3's template writes it."""
  return f'{CALL}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}'


def v31_call(name, arguments):
  """One call as DeepSeek V3.1's template writes it."""
  return f'{CALL}{name}{SEP}{arguments}{CALL_END}'


DSML = '\uff5cDSML\uff5c'
DSML_CALLS, DSML_CALLS_END = f'<{DSML}function_calls>', f'</{DSML}function_calls>'


def dsml_call(name, parameters):
  """One call as DeepSeek V3.2 writes it: ``parameters`` maps a name to ``(text, is_string)``."""
  params = ''.join(f'<{DSML}parameter name="{k}" string="{str(raw).lower()}">{text}'
                   f'</{DSML}parameter>\n' for k, (text, raw) in parameters.items())
  return f'<{DSML}invoke name="{name}">\n{params}</{DSML}invoke>'


def harmony_call(name, arguments, before=False):
  """One call message, its recipient after the channel (or ``before`` it)."""
  if before:
    return f' to=functions.{name}<|channel|>commentary json<|message|>{arguments}<|call|>'
  return f'<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}'


THINK = '<|channel|>analysis<|message|>The user wants the weather; call it.<|end|>'
REPLIES = {
  'deepseek': ('Let me check. ' + CALLS + v3_call('get_weather', '{"city": "rome", "days": 3, '
               '"note": "a \\"q\\" \\u00e9 <x> }"}') + '\n'
               + v3_call('get_time', '{"zone":"utc","x":[true,null,1.5e1,-0,{}]}') + CALLS_END),
  'deepseek_v31': (CALLS + v31_call('get_weather', '{"city":"lima","days":7}')
                   + v31_call('get_time', '{"zone": "cet"}') + CALLS_END),
  'deepseek_v31-in-v3': CALLS + v31_call('f', '{"a": [1, 2]}') + CALLS_END,
  'deepseek_v32': ('Checking. ' + DSML_CALLS + '\n' + dsml_call('get_weather', {
      'city': ('Os"lo <b> é', True), 'days': ('[1, {"a": null}]', False), 'n': ('-1.5e1', False)})
      + '\n' + dsml_call('get_time', {'zone': ('utc', True)}) + '\n' + DSML_CALLS_END),
  'harmony': THINK + '<|start|>assistant' + harmony_call('get_weather', '{"city":"oslo"}'),
  'harmony-before': (THINK + '<|start|>assistant' + harmony_call('get_time', '{"zone":"utc"}',
                                                                  before=True)),
  'harmony-two': (harmony_call('get_weather', '{"city": "rome", "days": [1, 2]}') + '<|call|>'
                  + '<|start|>assistant' + harmony_call('get_time', '{"zone": "cet"}')),
}
FORMAT = {'deepseek_v31-in-v3': 'deepseek'}  # V3.1's layout read by the V3 format
CONTENT = {'deepseek': 'Let me check. ', 'deepseek_v32': 'Checking. '}
REASONING = {'harmony': 'The user wants the weather; call it.',
             'harmony-before': 'The user wants the weather; call it.'}


def _fmt(name):
  return FORMAT.get(name, name.split('-')[0])


@pytest.mark.parametrize('how', ['chars', 1, 2])
@pytest.mark.parametrize('name', sorted(REPLIES))
def test_streamed_argument_fragments_add_up_to_the_parsed_arguments(name, how):
  check_streamed_calls(REPLIES[name], _fmt(name), how, CONTENT.get(name, ''),
                       REASONING.get(name, ''))


@pytest.mark.parametrize('fmt, text, content, calls', [
  ('deepseek', 'Hi. ' + CALLS + v3_call('f', '{"a": 1}') + CALLS_END, 'Hi.', [('f', {'a': 1})]),
  ('deepseek', CALLS + v3_call('f', '{"a": 1}') + '\n' + v3_call('g', '{}'), None,
   [('f', {'a': 1}), ('g', {})]),  # no closing marker: the engine stopped at end of sentence
  ('deepseek', CALLS + v31_call('f', '{"a": "x"}') + CALLS_END, None, [('f', {'a': 'x'})]),
  ('deepseek_v31', CALLS + v3_call('f', '{}') + CALLS_END, None, [('f', {})]),
  ('deepseek', CALLS + v3_call('f', '{"a": ') + CALLS_END,
   CALLS + v3_call('f', '{"a": ') + CALLS_END, []),  # arguments that are not JSON
  ('deepseek', CALLS + v3_call('f', '{} x') + CALLS_END,
   CALLS + v3_call('f', '{} x') + CALLS_END, []),  # text after the arguments
  ('deepseek', CALLS + v31_call('', '{}') + CALLS_END,
   CALLS + v31_call('', '{}') + CALLS_END, []),  # no name
  ('deepseek', 'no call here', 'no call here', []),
  ('deepseek_v32', DSML_CALLS + dsml_call('f', {'a': ('x', True), 'b': ('2', False)})
   + DSML_CALLS_END + ' Done.', 'Done.', [('f', {'a': 'x', 'b': 2})]),
  ('deepseek_v32', DSML_CALLS + dsml_call('f', {'a': ('1', True)}), None,
   [('f', {'a': '1'})]),  # no closing marker: the engine stopped at end of sentence
  ('deepseek_v32', DSML_CALLS + dsml_call('f', {'b': ('{oops', False)}) + DSML_CALLS_END,
   DSML_CALLS + dsml_call('f', {'b': ('{oops', False)}) + DSML_CALLS_END, []),  # not JSON
  ('deepseek_v32', DSML_CALLS + f'<{DSML}invoke name="f">' + DSML_CALLS_END,
   DSML_CALLS + f'<{DSML}invoke name="f">' + DSML_CALLS_END, []),  # an unclosed invoke
  ('harmony', THINK + '<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>',
   'It is sunny.', []),
  ('harmony', '<|channel|>final<|message|>It is sunny.', 'It is sunny.', []),
  ('harmony', '<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant'
   + harmony_call('f', '{"q": "é"}'), 'Checking.', [('f', {'q': 'é'})]),
  ('harmony', '<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>',
   None, []),  # a built-in tool's call is neither a function call nor content
  ('harmony', harmony_call('f', 'not json'), harmony_call('f', 'not json'), []),
  ('harmony', 'plain text', 'plain text', []),
])
def test_tool_calls_parse_out_of_deepseek_and_harmony_replies(fmt, text, content, calls):
  got_content, got = parse_tool_calls(text, fmt)
  assert got_content == content
  assert [(c.name, json.loads(c.arguments)) for c in got] == calls
  assert len({c.id for c in got}) == len(got)


def test_harmony_content_and_reasoning_stream_as_their_channels_text():
  """Without calls, the final channel's text streams as content and the analysis channel's as
  ``reasoning_content``; neither carries a marker or a piece of one."""
  reply = (THINK + '<|start|>assistant<|channel|>final<|message|>It is <b>sunny</b> '
           'in Oslo.<|return|>')
  for how in ('chars', 3):
    stream, chunks = _stream('harmony', _splits(reply, how))
    deltas = [c['choices'][0]['delta'] for c in chunks]
    assert ''.join(d.get('content') or '' for d in deltas) == 'It is <b>sunny</b> in Oslo.'
    assert ''.join(d.get('reasoning_content') or '' for d in deltas) == REASONING['harmony']
    assert chunks[-1]['choices'][0]['finish_reason'] == 'stop' and stream.tool_calls == []
    assert stream.text == 'It is <b>sunny</b> in Oslo.'
    assert not any('tool_calls' in d for d in deltas)
  request = types.SimpleNamespace(kind='chat', n=1, prompts=[(1, 2)], logprobs=None,
                                  return_token_ids=False, best_of=None, samples_per_prompt=1)
  [choice] = response_body(request, 'id', 'm', [stream])['choices']
  assert choice['message'] == {'role': 'assistant', 'content': 'It is <b>sunny</b> in Oslo.',
                               'reasoning_content': REASONING['harmony']}


def test_only_what_no_later_text_can_change_is_sent():
  assert streamed_calls(CALLS + CALL + 'function' + SEP + 'get_w', 'deepseek') == [(None, '')]
  assert streamed_calls(CALLS + CALL + 'function' + SEP + 'f\n``', 'deepseek') == [('f', '')]
  head = CALLS + CALL + 'function' + SEP + 'f\n```json\n{"n": 12'
  assert streamed_calls(head, 'deepseek') == [('f', '{"n": ')]  # 12 may become 123
  assert streamed_calls(head + '\n`', 'deepseek') == [('f', '{"n": 12')]
  assert streamed_calls(CALLS + CALL + 'f' + SEP + '{"s": "a' + CALL_END[:3],
                        'deepseek_v31') == [('f', '{"s": "a')]  # may be the end marker
  assert streamed_calls(CALLS + CALL + 'f' + SEP, 'deepseek_v31') == [(None, '')]
  assert streamed_calls('Hi ' + CALLS[:4], 'deepseek') == []
  assert held_back('Hi ' + CALLS[:4], 'deepseek') == len('Hi ')
  assert held_back('Hi ' + CALLS + CALL, 'deepseek_v31') == len('Hi ')
  assert streamed_calls(harmony_call('f', '{"a": "x<|'), 'harmony') == [('f', '{"a": "x')]
  assert streamed_calls('<|channel|>commentary to=functions.f <|constr', 'harmony') == []
  assert split_reply('<|channel|>final<|message|>Hi <|re', 'harmony') == ('Hi ', '')
  assert split_reply('<|channel|>analysis<|message|>Hm<|end|><|start|>assistant<|chan',
                     'harmony') == ('', 'Hm')
  assert held_back('<|channel|>final<|message|>Hi', 'harmony') == 0


@pytest.mark.parametrize('seed', range(40))
def test_random_arguments_written_any_way_stream_to_the_parsed_arguments(seed):
  """Random JSON arguments, compact or spaced, escaped or not, after content or reasoning, in
  random pieces: each call's streamed pieces join to the parse of the whole reply."""
  rng = random.Random(seed)
  fmt = ['deepseek', 'deepseek_v31', 'harmony', 'deepseek_v32'][seed % 4]
  texts = []
  for _ in range(rng.randrange(1, 4)):
    arguments = {'x': _random_value(rng), 'y': _random_value(rng)}
    separators = rng.choice([(',', ':'), (', ', ': '), (' ,', ' : ')])
    texts.append(json.dumps(arguments, ensure_ascii=rng.random() < 0.5, separators=separators))
  before = rng.choice(['', 'Sure, ', 'Let me see {x}. '])
  if fmt == 'harmony':
    messages = [harmony_call(f'f{k}', t, before=rng.random() < 0.5) for k, t in enumerate(texts)]
    think = f'<|channel|>analysis<|message|>{before}<|end|><|start|>assistant' if before else ''
    reply = think + '<|start|>assistant'.join(messages)
  elif fmt == 'deepseek_v32':  # the same values as parameters, strings written raw
    calls = [dsml_call(f'f{k}', {key: (v, True) if isinstance(v, str) and '<' not in v else
                                 (json.dumps(v, separators=separators), False)
                                 for key, v in json.loads(t).items()})
             for k, t in enumerate(texts)]
    reply = before + DSML_CALLS + '\n' + '\n'.join(calls) + rng.choice([DSML_CALLS_END, ''])
  else:
    write = v3_call if fmt == 'deepseek' else v31_call
    joiner = '\n' if fmt == 'deepseek' else ''
    reply = before + CALLS + joiner.join(write(f'f{k}', t) for k, t in enumerate(texts))
    reply += rng.choice([CALLS_END, ''])
  content, parsed = parse_tool_calls(reply, fmt)
  assert [c.name for c in parsed] == [f'f{k}' for k in range(len(texts))]
  assert [json.loads(c.arguments) for c in parsed] == [json.loads(t) for t in texts]
  stream, chunks = _stream(fmt, _splits(reply, seed))
  deltas = [c['choices'][0]['delta'] for c in chunks]
  for k, call in enumerate(parsed):
    pieces = [t['function']['arguments'] for d in deltas for t in d.get('tool_calls', ())
              if t['index'] == k]
    assert ''.join(pieces) == call.arguments
  sent = ''.join(d.get('content') or '' for d in deltas)
  reasoning = ''.join(d.get('reasoning_content') or '' for d in deltas)
  if fmt == 'harmony':
    assert (sent, reasoning) == ('', before)
  else:
    assert (sent, reasoning, content) == (before, '', before.strip() or None)


def test_the_format_follows_the_chat_template():
  v3 = "{{'" + CALLS + CALL + "' + tool['type'] + '" + SEP + "' + name + '\\n```json\\n'}}"
  v31 = "{{'" + CALLS + CALL + "' + name + '" + SEP + "' + arguments}}"
  assert tool_format(v3) == 'deepseek' and tool_format(v31) == 'deepseek_v31'
  assert tool_format("{{'<|start|>assistant<|channel|>final<|message|>'}}") == 'harmony'
  assert tool_format("{{'<|call|>'}}") == 'harmony'
  assert tool_format("{{'<tool_call>'}}") == 'hermes'
  assert tool_format("{{'" + DSML_CALLS + "'}}") == 'deepseek_v32'


WEATHER = {'type': 'function', 'function': {'name': 'get_weather', 'parameters': {
  'type': 'object', 'properties': {'city': {'enum': ['rome', 'oslo']},
                                   'days': {'type': 'integer', 'minimum': 1, 'maximum': 9}},
  'required': ['city', 'days'], 'additionalProperties': False}}}
CLOCK = {'type': 'function', 'function': {'name': 'get_time', 'parameters': {
  'type': 'object', 'properties': {'zone': {'enum': ['utc', 'cet']}}, 'required': ['zone'],
  'additionalProperties': False}}}
NOTE = {'type': 'function', 'function': {'name': 'get_note', 'parameters': {
  'type': 'object', 'properties': {'text': {'type': 'string'}}, 'required': ['text']}}}
HARMONY = ['<|start|>', '<|channel|>', '<|message|>', '<|end|>', '<|call|>', '<|return|>',
           '<|constrain|>', '<|endoftext|>']
DEEPSEEK = [CALLS, CALLS_END, CALL, CALL_END, SEP, _ds('end of sentence')]


@pytest.fixture(scope='module')
def marker_tokenizer(tmp_path_factory):
  """A byte-level BPE with harmony's and DeepSeek's markers as special tokens."""
  from tests.conftest import _byte_level_bpe, _write_tokenizer_dir
  directory = tmp_path_factory.mktemp('markers')
  _write_tokenizer_dir(directory, _byte_level_bpe(500, HARMONY + DEEPSEEK),
                       {'eos_token': '<|return|>'})
  return load_tokenizer(str(directory))


@pytest.mark.parametrize('fmt, parallel, good, bad', [
  ('deepseek', True,
   CALLS + v3_call('get_weather', '{"city":"rome","days":2}') + '\n'
   + v3_call('get_time', '{"zone":"utc"}') + CALLS_END,
   CALLS + v3_call('get_weather', '{"city":"paris","days":2}') + CALLS_END),
  ('deepseek_v31', False, CALLS + v31_call('get_time', '{"zone":"cet"}') + CALLS_END,
   CALLS + v31_call('get_time', '{"zone":"cet"}') + v31_call('get_time', '{"zone":"cet"}')),
  ('deepseek_v32', True,
   DSML_CALLS + '\n' + dsml_call('get_weather', {'city': ('"rome"', False), 'days': ('2', False)})
   + '\n' + dsml_call('get_time', {'zone': ('"utc"', False)}) + '\n' + DSML_CALLS_END,
   DSML_CALLS + '\n' + dsml_call('get_weather', {'city': ('"rome"', False)}) + '\n'
   + DSML_CALLS_END),  # a required parameter missing
  ('deepseek_v32', False,
   DSML_CALLS + '\n' + dsml_call('get_note', {'text': ('any "text" \\ é', True)}) + '\n'
   + DSML_CALLS_END,
   DSML_CALLS + '\n' + dsml_call('get_note', {'text': ('1', False)}) + '\n' + DSML_CALLS_END),
  ('harmony', True, harmony_call('get_weather', '{"city":"oslo","days":9}'),
   THINK + '<|start|>assistant' + harmony_call('get_weather', '{"city":"oslo","days":9}')),
])
def test_the_grammar_of_a_forced_call_takes_the_models_own_call_and_refuses_others(
    marker_tokenizer, fmt, parallel, good, bad):
  """The grammar accepts a call written as the model writes it (the markers as their special
  tokens) and refuses a call outside the schema, or more than the grammar allows."""
  tok = marker_tokenizer
  specials = special_tokens(tok)
  grammar = StructuredOutput('grammar', call_grammar([WEATHER, CLOCK, NOTE], fmt, parallel=parallel,
                                                     specials=specials)).grammar()
  grammar_tok = grammar_tokenizer(tok, tok.vocab_size, [specials['<|return|>']])
  for text, accepted in ((good, True), (bad, False)):
    matcher = llguidance.LLMatcher(grammar_tok, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = encode_with_specials(tok, text)
    taken = matcher.try_consume_tokens(ids)
    assert (taken == len(ids) and matcher.is_accepting()) == accepted, (text, taken, len(ids))
  _, calls = parse_tool_calls(good, fmt)
  assert calls and all(c.name in ('get_weather', 'get_time', 'get_note') for c in calls)


def test_a_harmony_vocabulary_ends_its_turn_at_call_and_return_not_at_end(marker_tokenizer):
  specials = special_tokens(marker_tokenizer)
  ids = end_of_turn_ids(marker_tokenizer)
  assert specials['<|call|>'] in ids and specials['<|return|>'] in ids
  assert specials['<|end|>'] not in ids  # it closes the reasoning message, not the turn


# -- end to end: the chat server with a harmony template ------------------------------------

HARMONY_TEMPLATE = (  # short: the prompt and the call fit the test server's 128 tokens
  "{% for m in messages %}<|start|>{{ m.role }}"
  "{% if m.role == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>"
  "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.fixture(scope='module')
def harmony_server(tmp_path_factory):
  """A tiny model served with a harmony template and a vocabulary with its markers."""
  from maxnnx.serving.server import make_app, serve_in_thread
  from tests.conftest import _byte_level_bpe, _write_tokenizer_dir
  from tests.test_serving_server import SERVER_ENGINE, _wait_until_ready
  directory = tmp_path_factory.mktemp('harmony_served')
  model = maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=512, num_layers=1),
                             rngs=nnx.Rngs(0))
  maxnnx.save_pretrained(model, str(directory))
  _write_tokenizer_dir(directory, _byte_level_bpe(500, HARMONY),
                       {'eos_token': '<|return|>', 'chat_template': HARMONY_TEMPLATE})
  app = make_app(str(directory), model_name='tiny-harmony', max_queue=4, **SERVER_ENGINE)
  with serve_in_thread(app) as (url, _):
    _wait_until_ready(url)
    yield url


def test_a_forced_harmony_call_through_the_server_streams_to_the_non_streamed_call(
    harmony_server):
  """tool_choice required / named: the reply is a harmony call message whose arguments
  validate; streamed (greedy) it comes as a header and argument pieces that join to the
  non-streamed call, with no content."""
  from tests.test_serving_server import _client
  from tests.test_structured_outputs import check_schema
  client = _client(harmony_server)
  ask = [{'role': 'user', 'content': 'Weather?'}]
  fields = dict(model='tiny-harmony', messages=ask, tools=[WEATHER, CLOCK], temperature=0,
                max_tokens=80)
  schemas = {t['function']['name']: t['function']['parameters'] for t in (WEATHER, CLOCK)}
  for choice in ('required', {'type': 'function', 'function': {'name': 'get_time'}}):
    whole = client.chat.completions.create(tool_choice=choice, **fields).choices[0]
    assert whole.finish_reason == 'tool_calls' and whole.message.content is None, whole
    [call] = whole.message.tool_calls
    check_schema(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(choice, dict):
      assert call.function.name == 'get_time'
    chunks = list(client.chat.completions.create(tool_choice=choice, stream=True, **fields))
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert chunks[-1].choices[0].finish_reason == 'tool_calls'
    head, rest = deltas[0], deltas[1:]
    assert rest and all(t.index == 0 and t.id is None and t.function.name is None
                        for t in rest)
    arguments = head.function.arguments + ''.join(t.function.arguments for t in rest)
    assert (head.function.name, arguments) == (call.function.name, call.function.arguments)
    assert not ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices)


def test_a_past_call_renders_through_templates_that_join_or_serialize_its_arguments(
    marker_tokenizer):
  """DeepSeek V3's template joins a past call's arguments to text, most others write
  ``arguments | tojson``: both render the call's JSON."""
  from maxnnx.data.chat import ChatTemplate
  from maxnnx.serving.openai_api import ServedModel
  from maxnnx.serving.openai_chat import parse_chat
  joined = ("{% for m in messages %}{% for t in m.tool_calls or [] %}{{ '" + CALL + "' + "
            "t.function.name + '\\n```json\\n' + t.function.arguments + '\\n```' }}"
            "{% endfor %}{{ m.content }};{% endfor %}")
  serialized = ("{% for m in messages %}{% for t in m.tool_calls or [] %}"
                "{{ t.function.arguments | tojson }}{% endfor %}{{ m.content }};{% endfor %}")
  past = {'role': 'assistant', 'content': None, 'tool_calls': [
      {'id': 'call_1', 'type': 'function',
       'function': {'name': 'get_time', 'arguments': '{"zone":"utc"}'}}]}
  body = {'model': 'm', 'max_tokens': 4, 'messages': [
      {'role': 'user', 'content': 'Time?'}, past, {'role': 'tool', 'content': '12:00'}]}
  for source, expected in ((joined, CALL + 'get_time\n```json\n{"zone": "utc"}\n```;'),
                           (serialized, '{"zone": "utc"};')):
    served = ServedModel('m', marker_tokenizer, ChatTemplate(source), 128, 512, 5)
    text = marker_tokenizer.decode(parse_chat(body, served).prompts[0])
    assert text == 'Time?;' + expected + '12:00;', text


def test_forced_deepseek_calls_from_the_engine_parse_back_and_validate(marker_tokenizer):
  """The engine under each DeepSeek grammar writes the markers as their special tokens and a
  reply that parses back into calls whose arguments validate, whole and streamed alike."""
  from maxnnx.serving import Engine, SamplingParams
  from tests.test_structured_outputs import check_schema
  tok = marker_tokenizer
  specials = special_tokens(tok)
  model = maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=512, num_layers=1),
                             rngs=nnx.Rngs(0))
  engine = Engine(model, tok, max_batch=3, token_budget=32, page_size=8, max_model_len=512,
                  token_buckets=(32,), page_buckets=(64,))
  fmts = ['deepseek', 'deepseek_v31', 'deepseek_v32']
  # DSML's markers are text here, so one call spans hundreds of tokens: one call for it.
  params = [SamplingParams(max_tokens=400, temperature=1.0, seed=k, structured=StructuredOutput(
      'grammar', call_grammar([WEATHER, CLOCK], fmt, parallel=fmt != 'deepseek_v32',
                              specials=specials))) for k, fmt in enumerate(fmts)]
  outs = engine.generate([tok.encode('Weather?')] * 3, params)
  schemas = {t['function']['name']: t['function']['parameters'] for t in (WEATHER, CLOCK)}
  for fmt, out in zip(fmts, outs):
    assert out.finish_reason == 'stop', out.text
    if fmt == 'deepseek_v32':  # DSML's markers are text in this vocabulary
      assert out.text.startswith(DSML_CALLS) and out.text.endswith(DSML_CALLS_END), out.text
    else:
      assert out.token_ids[0] == specials[CALLS] and out.token_ids[-1] == specials[CALLS_END]
    content, calls = parse_tool_calls(out.text, fmt)
    assert content is None and calls
    for call in calls:
      check_schema(json.loads(call.arguments), schemas[call.name])
    stream, _ = _stream(fmt, _splits(out.text, 'chars'))
    assert [(c.name, c.arguments) for c in stream.tool_calls] == [
        (c.name, c.arguments) for c in calls]


def test_with_tool_choice_none_a_harmony_reply_is_read_for_its_channels_but_never_for_calls():
  """A harmony reply is always read for its final channel, but with no tools, or with
  ``tool_choice`` ``none``, a call message the model writes anyway is dropped: no
  ``tool_calls``, whole or streamed, and the reply finishes as ``stop``."""
  reply = ('<|channel|>final<|message|>It is sunny.<|end|><|start|>assistant'
           + harmony_call('get_weather', '{"city": "oslo"}'))
  for how in ('chars', 3, 'whole'):
    stream = ChoiceStream(0, None, SamplingParams(), tool_format='harmony', read_calls=False)
    pieces = [reply] if how == 'whole' else _splits(reply, how)
    chunks = []
    for k in range(1, len(pieces) + 1):
      done = k == len(pieces)
      text, _ = stream.update(RequestOutput(0, (k,), None, tuple(range(1, k + 1)), done,
                                            'stop' if done else None, ''.join(pieces[:k]), 0))
      chunks.append(chunk(_request(), 'id', 'm', stream, text))
    deltas = [c['choices'][0]['delta'] for c in chunks]
    assert not any('tool_calls' in d for d in deltas) and stream.tool_calls == []
    assert ''.join(d.get('content') or '' for d in deltas) == 'It is sunny.'
    assert stream.finish_reason == 'stop'
  # Read for calls, the same reply answers one: the flag is what drops it.
  assert [c.name for c in parse_tool_calls(reply, 'harmony')[1]] == ['get_weather']


def test_a_harmony_chat_reads_calls_only_when_it_sends_tools_without_tool_choice_none(
    marker_tokenizer):
  from maxnnx.data.chat import ChatTemplate
  from maxnnx.serving.openai_api import ServedModel
  from maxnnx.serving.openai_chat import parse_chat
  served = ServedModel('m', marker_tokenizer, ChatTemplate(HARMONY_TEMPLATE), 128, 512, 5)
  body = {'model': 'm', 'messages': [{'role': 'user', 'content': 'Weather?'}], 'max_tokens': 4}
  cases = (({'tools': [WEATHER]}, True), ({'tools': [WEATHER], 'tool_choice': 'auto'}, True),
           ({'tools': [WEATHER], 'tool_choice': 'none'}, False), ({}, False))
  for extra, reads in cases:
    parsed = parse_chat({**body, **extra}, served)
    assert (parsed.tool_format, parsed.read_calls) == ('harmony', reads), extra

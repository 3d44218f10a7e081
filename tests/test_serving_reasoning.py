"""Reasoning parsers: a chat reply's ``<think>`` block comes back as ``reasoning_content``,
streamed or whole, and tool calls are read from what follows it."""

import json
import types

import pytest
from flax import nnx

import maxnnx
from maxnnx.serving.openai_responses import response_body
from maxnnx.serving.reasoning import check_reasoning_parser, split_reasoning
from tests.test_serving_tools_stream import _splits, _stream

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.parametrize('parser, text, reasoning, content', [
    ('deepseek_r1', '<think>\nplan it</think>\n\nIt is sunny.', '\nplan it', '\n\nIt is sunny.'),
    ('deepseek_r1', 'plan it</think>It is sunny.', 'plan it', 'It is sunny.'),  # prompt opened
    ('deepseek_r1', 'still planning', 'still planning', ''),
    ('qwen3', '<think>plan it</think>It is sunny.', 'plan it', 'It is sunny.'),
    ('qwen3', 'It is sunny.', '', 'It is sunny.'),
    ('qwen3', '<think>cut short', 'cut short', ''),
])
def test_the_think_block_is_the_reasoning(parser, text, reasoning, content):
  assert split_reasoning(text, parser, finished=True) == (reasoning, content)


def test_a_possible_end_marker_is_held_back_while_the_reply_grows():
  assert split_reasoning('<think>plan</thi', 'deepseek_r1') == ('plan', '')
  assert split_reasoning('<think>plan</think>It', 'deepseek_r1') == ('plan', 'It')
  assert split_reasoning('<th', 'qwen3') == ('', '')  # may still open a block
  assert split_reasoning('Th', 'qwen3') == ('', 'Th')
  assert split_reasoning('<thin', 'deepseek_r1') == ('', '')  # nor is it reasoning yet


def test_an_unknown_parser_is_refused_naming_the_parsers():
  assert check_reasoning_parser('') is None and check_reasoning_parser('qwen3') == 'qwen3'
  with pytest.raises(ValueError, match='deepseek_r1, qwen3'):
    check_reasoning_parser('r1')


def _deltas(pieces, parser, tool_format=None):
  """The stream and the deltas a server sends for ``pieces`` under ``parser``."""
  stream, chunks = _stream(tool_format, pieces, parser)
  return stream, [c['choices'][0]['delta'] for c in chunks]


@pytest.mark.parametrize('how', ['chars', 1, 2, 3])
@pytest.mark.parametrize('parser, reply', [
    ('deepseek_r1', 'I should <b>check</b> the sky.</think>\n\nIt is sunny.'),
    ('qwen3', '<think>\nThe user asks; </thin is no end.\n</think>\n\nSunny, <think> aside.'),
    ('qwen3', 'No thinking here.'),
    ('deepseek_r1', 'Cut short while thin'),
    ('deepseek_r1', '<think>Its own block.</think>Done.'),
])
def test_streamed_reasoning_and_content_join_to_the_whole_replys(parser, reply, how):
  reasoning, content = split_reasoning(reply, parser, finished=True)
  stream, deltas = _deltas(_splits(reply, how), parser)
  assert ''.join(d.get('reasoning_content') or '' for d in deltas) == reasoning
  assert ''.join(d.get('content') or '' for d in deltas) == content
  whole, _ = _deltas([reply], parser)
  request = types.SimpleNamespace(kind='chat', n=1, prompts=[(1, 2)], logprobs=None,
                                  return_token_ids=False, best_of=None, samples_per_prompt=1)
  [choice] = response_body(request, 'id', 'm', [whole])['choices']
  assert choice['message'].get('reasoning_content', '') == reasoning
  assert choice['message']['content'] == content


@pytest.mark.parametrize('how', ['chars', 5])
def test_tool_calls_are_read_after_the_reasoning(how):
  reply = '<think>Weather needs a call.</think>\n' + CALL
  stream, deltas = _deltas(_splits(reply, how), 'qwen3', tool_format='hermes')
  assert ''.join(d.get('reasoning_content') or '' for d in deltas) == 'Weather needs a call.'
  assert [(c.name, json.loads(c.arguments)) for c in stream.tool_calls] == [
      ('get_weather', {'city': 'Oslo'})]
  assert stream.finish_reason == 'tool_calls'
  assert not ''.join(d.get('content') or '' for d in deltas).strip()


@pytest.fixture(scope='module')
def reasoning_server(tmp_path_factory, chat_checkpoint):
  """A tiny ChatML model served with ``reasoning_parser=deepseek_r1``."""
  from maxnnx.serving.server import make_app, serve_in_thread
  from tests.test_serving_server import SERVER_ENGINE, _wait_until_ready
  directory = tmp_path_factory.mktemp('reasoning_served')
  model = maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=512, num_layers=1),
                             rngs=nnx.Rngs(0))
  maxnnx.save_pretrained(model, str(directory))
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    (directory / name).write_bytes((chat_checkpoint / name).read_bytes())
  app = make_app(str(directory), model_name='tiny-r1', max_queue=4,
                 reasoning_parser='deepseek_r1', **SERVER_ENGINE)
  with serve_in_thread(app) as (url, _):
    _wait_until_ready(url)
    yield url


def test_the_chat_server_returns_the_think_block_as_reasoning_content(reasoning_server):
  """A reply forced to ``<think>...</think>answer`` (guided_choice) comes back as reasoning
  and content, whole and streamed alike; completions are not parsed."""
  from tests.test_serving_server import _client
  client = _client(reasoning_server)
  forced = '<think>Count the stars.</think>Seven.'
  fields = dict(model='tiny-r1', messages=[{'role': 'user', 'content': 'How many?'}],
                max_tokens=40, temperature=0, extra_body={'guided_choice': [forced]})
  message = client.chat.completions.create(**fields).choices[0].message
  assert (message.content, message.model_extra['reasoning_content']) == (
      'Seven.', 'Count the stars.')
  chunks = list(client.chat.completions.create(stream=True, **fields))
  deltas = [c.choices[0].delta for c in chunks if c.choices]
  assert ''.join(d.content or '' for d in deltas) == 'Seven.'
  assert ''.join((d.model_extra or {}).get('reasoning_content') or '' for d in deltas) == (
      'Count the stars.')

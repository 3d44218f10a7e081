"""Tool calls streamed as OpenAI streams them: a reply in each format, fed to
:class:`ChoiceStream` a piece at a time, comes out as content deltas and ``delta.tool_calls``
whose argument fragments add up to the finished reply's parsed arguments."""

import json
import random
import types

import pytest

from maxnnx.serving import SamplingParams
from maxnnx.serving.openai_responses import ChoiceStream, chunk
from maxnnx.serving.params import RequestOutput
from maxnnx.serving.tools import parse_tool_calls, streamed_calls

REPLIES = {
  'hermes': ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", '
             '"days": 3, "note": "a \\"q\\" \\u00e9\\n\\ud83d\\ude00 </tool"}}\n</tool_call>\n'
             '<tool_call>\n{"name":"get_time","arguments":{"zone":"utc","x":[true,null,1.50e1,'
             '-0,{}]}}\n</tool_call>'),
  'hermes-text-arguments': ('Sure. <tool_call>{"name": "f", "arguments": "{\\"a\\": '
                            '[1, 2]}"}</tool_call>'),
  'hermes-arguments-first': '<tool_call>{"arguments": {"b": "x"}, "name": "g"}</tool_call>',
  'llama3': '<|python_tag|>{"name": "get_weather", "parameters": {"city": "oslo", "days": 2}}',
  'llama3-bare': '{"name":"get_time","parameters":{"zone":"cet","n":12}}',
  'mistral': ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "lima", "days": 7}}, '
              '{"name": "get_time", "arguments": {"zone": "cet"}}]'),
}
CONTENT = {'hermes': 'Let me check. ', 'hermes-text-arguments': 'Sure. '}


def _request():
  return types.SimpleNamespace(kind='chat', logprobs=None, return_token_ids=False,
                               prompt_of=lambda index: ())


def _stream(fmt, pieces, reasoning_parser=None):
  """The chunks a server sends for ``pieces`` (the reply's text, piece by piece)."""
  stream = ChoiceStream(0, None, SamplingParams(), tool_format=fmt,
                        reasoning_parser=reasoning_parser)
  chunks = []
  for k in range(1, len(pieces) + 1):
    done = k == len(pieces)
    out = RequestOutput(0, (k,), None, tuple(range(1, k + 1)), done, 'stop' if done else None,
                        ''.join(pieces[:k]), 0)
    text, _ = stream.update(out)
    if text or stream.finished or stream.has_deltas:
      chunks.append(chunk(_request(), 'id', 'm', stream, text))
  return stream, chunks


def _splits(text, how):
  if how == 'chars':
    return list(text)
  rng = random.Random(how)
  cuts = sorted(rng.sample(range(1, len(text)), len(text) // 4))
  return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def check_streamed_calls(reply, fmt, how, content='', reasoning='', arrive_early=True):
  """Stream ``reply`` (in ``fmt``) cut ``how``, and check what the chunks carry against the
  parse of the whole reply: (a) each call's argument fragments join to its parsed arguments;
  (b) its first delta names it, the later ones carry only arguments; (c) the calls' indices
  come in order, 0, 1, ...; (d) the text before the calls streams as ``content`` (and
  ``reasoning``), no call text does; with ``arrive_early`` (character by character) the
  arguments go out as the model writes them, not at the end."""
  _, calls = parse_tool_calls(reply, fmt)
  assert calls, 'the reply must parse as calls'
  stream, chunks = _stream(fmt, _splits(reply, how))
  deltas = [c['choices'][0]['delta'] for c in chunks]
  assert chunks[-1]['choices'][0]['finish_reason'] == 'tool_calls'
  assert ''.join(d.get('content') or '' for d in deltas) == content
  assert ''.join(d.get('reasoning_content') or '' for d in deltas) == reasoning
  assert stream.reasoning == reasoning
  tool_deltas = [t for d in deltas for t in d.get('tool_calls', ())]
  assert sorted({t['index'] for t in tool_deltas}) == list(range(len(calls)))
  firsts = [min(i for i, t in enumerate(tool_deltas) if t['index'] == k)
            for k in range(len(calls))]
  assert firsts == sorted(firsts)
  for k, call in enumerate(calls):
    mine = [t for t in tool_deltas if t['index'] == k]
    head, rest = mine[0], mine[1:]
    assert head['type'] == 'function' and head['function']['name'] == call.name
    assert head['id'] == stream.tool_calls[k].id and head['id'].startswith('call_')
    assert all(set(t) == {'index', 'function'} and set(t['function']) == {'arguments'}
               for t in rest), rest
    assert ''.join(t['function']['arguments'] for t in mine) == call.arguments
    assert stream.tool_calls[k].arguments == call.arguments
  if how == 'chars' and arrive_early:
    for k, call in enumerate(calls):
      early = [t for c in chunks[:-1] for t in c['choices'][0]['delta'].get('tool_calls', ())
               if t['index'] == k]
      assert len(early) > 2
      assert len(''.join(t['function']['arguments'] for t in early)) >= len(call.arguments) - 3


@pytest.mark.parametrize('how', ['chars', 1, 2])
@pytest.mark.parametrize('name', sorted(REPLIES))
def test_streamed_argument_fragments_add_up_to_the_parsed_arguments(name, how):
  check_streamed_calls(REPLIES[name], name.split('-')[0], how, CONTENT.get(name, ''),
                       arrive_early=name != 'hermes-arguments-first')


def test_the_arguments_are_sent_only_once_certain_and_never_past_the_end_marker():
  assert streamed_calls('<tool_call>{"name": "f", "arguments": {"n": 12', 'hermes') == [
      ('f', '{"n": ')]  # 12 may become 123
  assert streamed_calls('<tool_call>{"name": "f", "arguments": {"s": "ab\\u00', 'hermes') == [
      ('f', '{"s": "ab')]  # an unfinished escape
  assert streamed_calls('<tool_call>{"name": "f", "arguments": {"s": "a\\ud83d', 'hermes') == [
      ('f', '{"s": "a')]  # half of a surrogate pair
  assert streamed_calls('<tool_call>{"name": "f", "arguments": {"s": "a</tool', 'hermes') == [
      ('f', '{"s": "a')]  # may be the end marker
  assert streamed_calls('<tool_call>{"name": "f", "arguments": {"s": "a</tool_call>b"}}',
                        'hermes') == [('f', '{"s": "a')]
  assert streamed_calls('<tool_call>{"name": "f', 'hermes') == [(None, '')]
  assert streamed_calls('It is {"name": "f", "parameters": {}}', 'llama3') == []
  assert streamed_calls('ok [TOOL_CALLS] [{"name": "f"', 'mistral') == []


def test_text_that_is_not_a_call_streams_as_content_with_no_tool_deltas():
  reply = 'It is {"name": 1} <tool_call'
  stream, chunks = _stream('hermes', list(reply))
  deltas = [c['choices'][0]['delta'] for c in chunks]
  assert not any('tool_calls' in d for d in deltas)
  assert ''.join(d.get('content') or '' for d in deltas) == reply
  assert chunks[-1]['choices'][0]['finish_reason'] == 'stop' and stream.tool_calls == []


def test_the_server_chunk_of_a_forced_call_streams_its_arguments_compactly_written():
  """The grammar of a forced call writes compact JSON; the streamed arguments are the
  non-streamed answer's (``json.dumps`` of the parsed value), piece by piece."""
  reply = '<tool_call>\n{"name":"get_weather","arguments":{"city":"rome","days":4}}\n</tool_call>'
  stream, chunks = _stream('hermes', list(reply))
  args = ''.join(t['function']['arguments'] for c in chunks
                 for t in c['choices'][0]['delta'].get('tool_calls', ()))
  assert args == '{"city": "rome", "days": 4}' == stream.tool_calls[0].arguments
  assert json.loads(args) == {'city': 'rome', 'days': 4}


def test_a_call_cut_by_max_tokens_finishes_as_content_after_its_header_went_out():
  reply = 'Hm. <tool_call>{"name": "f", "arguments": {"a": [1, 2'
  stream = ChoiceStream(0, None, SamplingParams(), tool_format='hermes')
  sent, deltas = [], []
  for k in range(1, len(reply) + 1):
    done = k == len(reply)
    out = RequestOutput(0, (k,), None, tuple(range(1, k + 1)), done, 'length' if done else None,
                        reply[:k], 0)
    sent.append(stream.update(out)[0])
    deltas += stream.take_tool_deltas()
  assert ''.join(sent) == reply and stream.finish_reason == 'length'
  assert stream.tool_calls == [] and deltas[0]['function']['name'] == 'f'
  assert ''.join(d['function']['arguments'] for d in deltas) == '{"a": [1, '


def _random_value(rng, depth=0):
  kind = rng.randrange(7 if depth < 3 else 4)
  if kind == 0:
    return rng.choice([True, False, None, 0, -7, 12345, 0.5, -1e-7, 2.5e20])
  if kind in (1, 2, 3):
    return ''.join(rng.choice('ab "\\/\n\té€😀<>}{,:[]') for _ in range(rng.randrange(6)))
  if kind in (4, 5):
    return {f'k{i}{rng.choice(["", "é", " "])}': _random_value(rng, depth + 1)
            for i in range(rng.randrange(4))}
  return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


@pytest.mark.parametrize('seed', range(40))
def test_random_arguments_written_any_way_stream_to_the_parsed_arguments(seed):
  """Random JSON arguments, written compact or spaced, escaped or not, in random pieces:
  the streamed pieces join to the parse of the whole reply."""
  rng = random.Random(seed)
  fmt = ['hermes', 'llama3', 'mistral'][seed % 3]
  key = 'parameters' if fmt == 'llama3' else 'arguments'
  calls = []
  for k in range(1 if fmt == 'llama3' else 2):
    arguments = {'x': _random_value(rng), 'y': _random_value(rng)}
    separators = rng.choice([(',', ':'), (', ', ': '), (' ,', ' : ')])
    text = json.dumps(arguments, ensure_ascii=rng.random() < 0.5, separators=separators)
    calls.append(f'{{"name": "f{k}", "{key}": {text}}}')
  reply = {'hermes': ''.join(f'<tool_call>\n{c}\n</tool_call>\n' for c in calls),
           'llama3': calls[0], 'mistral': '[TOOL_CALLS] [' + ', '.join(calls) + ']'}[fmt]
  _, parsed = parse_tool_calls(reply, fmt)
  assert len(parsed) == len(calls)
  stream, chunks = _stream(fmt, _splits(reply, seed))
  for k, call in enumerate(parsed):
    pieces = [t['function']['arguments'] for c in chunks
              for t in c['choices'][0]['delta'].get('tool_calls', ()) if t['index'] == k]
    assert ''.join(pieces) == call.arguments


def test_a_choice_that_does_not_stream_reads_its_reply_once_at_the_end(monkeypatch):
  """Without streaming nothing of the reply is parsed before it finishes (no per-token
  rescans), and the finished choice carries the same content and calls as a streamed one."""
  import maxnnx.serving.openai_responses as responses
  reply = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>'
  pieces = _splits(reply, 'chars')
  streamed, _ = _stream('hermes', pieces)
  calls = []
  monkeypatch.setattr(responses, 'streamed_calls', lambda *a: calls.append(a) or [])
  whole = ChoiceStream(0, None, SamplingParams(), tool_format='hermes', streaming=False)
  for k in range(1, len(pieces) + 1):
    done = k == len(pieces)
    text, _ = whole.update(RequestOutput(0, (k,), None, tuple(range(1, k + 1)), done,
                                         'stop' if done else None, ''.join(pieces[:k]), 0))
    assert (text == '') != done
  assert calls == []
  assert whole.text == streamed.text == 'Sure.' and whole.finish_reason == 'tool_calls'
  assert [(c.name, c.arguments) for c in whole.tool_calls] == [
      (c.name, c.arguments) for c in streamed.tool_calls]

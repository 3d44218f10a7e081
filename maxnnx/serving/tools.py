"""Tool calls for the chat API: the ``tools`` a request declares, the grammar that forces a
call, and the calls parsed back out of the model's text.

A model writes its tool calls in its family's own format; the server recognises seven, picked
from what the chat template writes (:func:`tool_format`):

* ``hermes`` (Qwen 2.5 / 3, Hermes, and the default):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call;
* ``llama3`` (Llama 3.1 / 3.2 / 3.3): the whole reply is one JSON object
  ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>`` before it is dropped);
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects;
* ``deepseek`` (DeepSeek V3 / R1): ``<|tool_calls_begin|>``, then per call
  ``<|tool_call_begin|>function<|tool_sep|>NAME\\n```json\\n{...}\\n```<|tool_call_end|>``
  (``\\n`` between calls), then ``<|tool_calls_end|>``; the markers are written here with
  ``|`` and ``_``, the model's have full-width bars (U+FF5C) and U+2581 between the words;
* ``deepseek_v31`` (DeepSeek V3.1): the same markers, each call
  ``<|tool_call_begin|>NAME<|tool_sep|>{...}<|tool_call_end|>``. Both DeepSeek formats read
  either layout (the character after the separator tells them apart); the format picks the
  layout a forced call is written in;
* ``deepseek_v32`` (DeepSeek V3.2): DSML markup, an ``invoke`` element per call with a
  ``parameter`` element per argument (:mod:`maxnnx.serving.tools_dsml`);
* ``harmony`` (GPT-OSS): the reply is messages ``<|channel|>CHANNEL<|message|>...<|end|>``,
  each after ``<|start|>assistant``; a call is a message addressed ``to=functions.NAME`` (in
  the header before or after ``<|channel|>``) whose text is the arguments, ended by
  ``<|call|>``. The ``analysis`` channel is the reasoning (:func:`split_reply`), the other
  messages without a recipient the content.

``tool_choice`` ``required`` or a named function makes the reply a call: a grammar in the
model's format (:func:`call_grammar`) whose arguments follow the function's ``parameters``
schema. ``auto`` lets the model choose and parses whatever calls it wrote
(:func:`parse_tool_calls`); ``none`` parses nothing.

While a reply streams, :func:`streamed_calls` gives each call started so far: its name once
written, and the part of its arguments (in the form :func:`parse_tool_calls` writes them) that
no later token can change, so the chat stream can send them piece by piece;
:func:`split_reply` gives the content (and reasoning) that may stream as text.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping, Sequence

from maxnnx.serving import tools_dsml
from maxnnx.serving.partial_json import (
  Incomplete,
  NotJson,
  partial_call,
  read_value,
  skip_space,
)

FORMATS = ('hermes', 'llama3', 'mistral', 'deepseek', 'deepseek_v31', 'deepseek_v32', 'harmony')
_HERMES_CALL = re.compile(r'<tool_call>\s*(.*?)\s*</tool_call>', re.S)


def _deepseek(words: str) -> str:
  """A DeepSeek marker: ``words`` between full-width bars, U+2581 for the spaces."""
  return '<\uff5c' + words.replace(' ', '\u2581') + '\uff5c>'


_DS_CALLS, _DS_CALLS_END = _deepseek('tool calls begin'), _deepseek('tool calls end')
_DS_CALL, _DS_CALL_END = _deepseek('tool call begin'), _deepseek('tool call end')
_DS_SEP = _deepseek('tool sep')
_MARKERS = {'hermes': '<tool_call>', 'llama3': '<|python_tag|>', 'mistral': '[TOOL_CALLS]',
            'deepseek': _DS_CALLS, 'deepseek_v31': _DS_CALLS, 'deepseek_v32': tools_dsml.CALLS}


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One call the model wrote.

  Attributes:
    name: the function's name.
    arguments: its arguments as JSON text (OpenAI's ``function.arguments``).
    id: the call's id (``call_...``).
  """

  name: str
  arguments: str
  id: str = dataclasses.field(default_factory=lambda: 'call_' + uuid.uuid4().hex[:24])

  def as_dict(self) -> dict:
    """OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    return {'id': self.id, 'type': 'function',
            'function': {'name': self.name, 'arguments': self.arguments}}


def tool_format(template_source: str) -> str:
  """The call format a chat template's model writes: ``deepseek_v32`` when the template
  writes DSML markup, ``deepseek`` when it holds
  DeepSeek's tool-calls marker and a fenced ``json`` block (``deepseek_v31`` without the
  fence), ``harmony`` when it holds ``<|channel|>`` or ``<|call|>``, ``mistral`` when it holds
  ``[TOOL_CALLS]``, ``llama3`` when it holds ``<|python_tag|>`` or the ``ipython`` role, else
  ``hermes``."""
  if tools_dsml.uses_dsml(template_source):
    return 'deepseek_v32'
  if _DS_CALLS in template_source:
    return 'deepseek' if '```json' in template_source else 'deepseek_v31'
  if '<|channel|>' in template_source or '<|call|>' in template_source:
    return 'harmony'
  if '[TOOL_CALLS]' in template_source:
    return 'mistral'
  if '<|python_tag|>' in template_source or 'ipython' in template_source:
    return 'llama3'
  return 'hermes'


def check_tools(tools) -> list[dict]:
  """``tools`` as a list of ``{"type": "function", "function": {"name", "parameters", ...}}``.

  Raises:
    ValueError: a malformed entry, named by its index (``parameters`` defaults to an empty
      object schema).
  """
  if not isinstance(tools, list) or not tools:
    raise ValueError('tools must be a non-empty array of {"type": "function", "function": '
                     '{"name": ..., "parameters": {...}}} objects.')
  checked, names = [], set()
  for i, tool in enumerate(tools):
    function = tool.get('function') if isinstance(tool, dict) else None
    if not (isinstance(tool, dict) and tool.get('type') == 'function'
            and isinstance(function, dict)):
      raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}.')
    name = function.get('name')
    if not isinstance(name, str) or not re.fullmatch(r'[A-Za-z0-9_.\-]{1,64}', name):
      raise ValueError(f'tools[{i}].function.name must be 1 to 64 letters, digits, '
                       f'underscores, dots or dashes; got {name!r}.')
    if name in names:
      raise ValueError(f'tools[{i}].function.name {name!r} is declared twice.')
    names.add(name)
    parameters = function.get('parameters', {'type': 'object', 'properties': {}})
    if not isinstance(parameters, dict):
      raise ValueError(f'tools[{i}].function.parameters must be a JSON schema object.')
    checked.append({'type': 'function', 'function': {**function, 'parameters': parameters}})
  return checked


def _call_schema(function: Mapping, fmt: str) -> dict:
  key = 'parameters' if fmt == 'llama3' else 'arguments'
  return {'type': 'object',
          'properties': {'name': {'const': function['name']}, key: function['parameters']},
          'required': ['name', key], 'additionalProperties': False}


def call_grammar(tools: Sequence[Mapping], fmt: str, name: str | None = None,
                 parallel: bool = False, specials: Mapping[str, int] | None = None) -> str:
  """A Lark grammar (llguidance's, with ``%json``) of a reply that is tool calls only, in
  ``fmt``: one call (or, with ``parallel``, one or more) of the function ``name``, or of any
  of ``tools``; each call's arguments follow the function's ``parameters`` schema. A harmony
  reply holds one call whatever ``parallel`` (GPT-OSS ends its turn at ``<|call|>``), written
  at once with no ``analysis`` message before it.

  ``specials`` (``{text: id}``, :func:`~maxnnx.data.chat.special_tokens`): a marker that is
  one token of the vocabulary (Qwen's ``<tool_call>``, Mistral's ``[TOOL_CALLS]``) is that
  token in the grammar, as the model writes it, rather than its text spelled in pieces."""
  specials = specials or {}

  def literal(text: str) -> str:
    return f'<[{specials[text]}]>' if text in specials else json.dumps(text, ensure_ascii=False)

  functions = [t['function'] for t in tools if name is None or t['function']['name'] == name]
  if fmt == 'deepseek_v32':
    return tools_dsml.grammar(functions, parallel, literal)
  if fmt in ('deepseek', 'deepseek_v31', 'harmony'):
    return _named_grammar(functions, fmt, parallel, literal)
  schemas = [_call_schema(f, fmt) for f in functions]
  schema = dict(schemas[0]) if len(schemas) == 1 else {'anyOf': schemas}
  schema['x-guidance'] = {'whitespace_flexible': False}  # compact JSON, as for schemas
  call = '%json ' + json.dumps(schema)
  if fmt == 'hermes':
    body = f'{literal("<tool_call>")} "\\n" {call} "\\n" {literal("</tool_call>")}'
    more = ' ("\\n" call)*' if parallel else ''
    return f'start: call{more}\ncall: {body}\n'
  if fmt == 'mistral':
    more = ' ("," call)*' if parallel else ''
    return f'start: {literal("[TOOL_CALLS]")} "[" call{more} "]"\ncall: {call}\n'
  return f'start: call\ncall: {call}\n'  # llama3: one JSON object per reply


def _named_grammar(functions: Sequence[Mapping], fmt: str, parallel: bool, literal) -> str:
  """:func:`call_grammar` of the formats that write the name outside the JSON (DeepSeek,
  harmony): a rule per function, its name then its arguments."""
  rules = []
  for k, function in enumerate(functions):
    schema = {**function['parameters'], 'x-guidance': {'whitespace_flexible': False}}
    arguments = '%json ' + json.dumps(schema)
    name = json.dumps(function['name'])
    if fmt == 'deepseek':
      body = (f'{literal(_DS_CALL)} "function" {literal(_DS_SEP)} {name} "\\n```json\\n" '
              f'{arguments} "\\n```" {literal(_DS_CALL_END)}')
    elif fmt == 'deepseek_v31':
      body = f'{literal(_DS_CALL)} {name} {literal(_DS_SEP)} {arguments} {literal(_DS_CALL_END)}'
    else:  # harmony: the grammar ends with the arguments, where the model writes <|call|>
      body = (f'{literal("<|channel|>")} "commentary to=functions." {name} " " '
              f'{literal("<|constrain|>")} "json" {literal("<|message|>")} {arguments}')
    rules.append(f'call_{k}: {body}\n')
  call = 'call: ' + ' | '.join(f'call_{k}' for k in range(len(functions))) + '\n'
  if fmt == 'harmony':  # GPT-OSS ends its turn at a call: one call per reply
    return 'start: call\n' + call + ''.join(rules)
  more = (' ("\\n" call)*' if fmt == 'deepseek' else ' call*') if parallel else ''
  return (f'start: {literal(_DS_CALLS)} call{more} {literal(_DS_CALLS_END)}\n' + call
          + ''.join(rules))


def _call(value, fmt: str) -> ToolCall | None:
  """A parsed JSON value as a call, if it is one."""
  if not isinstance(value, dict) or not isinstance(value.get('name'), str):
    return None
  arguments = value.get('parameters' if 'parameters' in value else 'arguments', {})
  if isinstance(arguments, str):  # some models write the arguments as JSON text already
    return ToolCall(value['name'], arguments)
  return ToolCall(value['name'], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
  """``(content, calls)`` of a finished reply in ``fmt``: the calls it holds, and the text
  outside them (``None`` when there is none). Text that does not parse as calls stays
  content, whole."""
  calls: list[ToolCall] = []
  if fmt in ('deepseek', 'deepseek_v31'):
    return _parse_deepseek(text)
  if fmt == 'harmony':
    return _parse_harmony(text)
  if fmt == 'deepseek_v32':
    found = tools_dsml.parse(text)
    return (text, []) if found is None else (found[0], [ToolCall(*c) for c in found[1]])
  if fmt == 'hermes':
    for found in _HERMES_CALL.finditer(text):
      try:
        call = _call(json.loads(found.group(1)), fmt)
      except json.JSONDecodeError:
        call = None
      if call is None:
        return text, []
      calls.append(call)
    content = _HERMES_CALL.sub('', text).strip() if calls else text
    return content or None, calls
  stripped = text.strip()
  if fmt == 'mistral':
    if not stripped.startswith('[TOOL_CALLS]'):
      return text, []
    stripped = stripped[len('[TOOL_CALLS]'):].strip()
  elif stripped.startswith('<|python_tag|>'):
    stripped = stripped[len('<|python_tag|>'):].strip()
  try:
    value = json.loads(stripped)
  except json.JSONDecodeError:
    return text, []
  values = value if isinstance(value, list) else [value]
  calls = [_call(v, fmt) for v in values]
  if not calls or any(c is None for c in calls):
    return text, []
  return None, calls


def held_back(text: str, fmt: str) -> int:
  """Where the text that may still become a tool call starts in a growing reply (streaming
  sends only what comes before it): at the format's marker or a tail that could begin it,
  for ``llama3`` a reply that starts with ``{``, and for ``harmony`` at the start (its
  content is not a prefix of the reply: :func:`split_reply`)."""
  if fmt == 'harmony' or (fmt == 'llama3' and text.lstrip().startswith('{')):
    return 0
  marker = _MARKERS[fmt]
  found = text.find(marker)
  if found >= 0:
    return found
  for k in range(min(len(marker) - 1, len(text)), 0, -1):
    if text.endswith(marker[:k]):
      return len(text) - k
  return len(text)


# -- streaming: each call's name and the certain prefix of its arguments -------------------

_END = '</tool_call>'
def streamed_calls(text: str, fmt: str) -> list[tuple[str | None, str]]:
  """The calls a growing reply in ``fmt`` has started, in order, as ``(name, arguments)``:
  the name once it is complete (else ``None``), and the prefix of the arguments text that
  no later text can change. Once the reply is finished and parses as calls
  (:func:`parse_tool_calls`), each call's arguments start with what this gave for it (a
  call object with a key twice is the exception: JSON keeps its last value)."""
  calls = []
  if fmt in ('deepseek', 'deepseek_v31'):
    return _streamed_deepseek(text)
  if fmt == 'harmony':
    return _streamed_harmony(text)
  if fmt == 'deepseek_v32':
    return tools_dsml.streamed(text)
  if fmt == 'hermes':
    start = text.find('<tool_call>')
    while start >= 0:
      body = start + len('<tool_call>')
      end = text.find(_END, body)
      if end < 0:  # no end marker yet: nor may the body's tail be the start of one
        end = len(text) - _tail(text, (_END,))
      name, arguments, _ = partial_call(text[:end], body)
      calls.append((name, arguments))
      start = text.find('<tool_call>', end)
    return calls
  stripped = text.lstrip()
  marker = _MARKERS[fmt]
  if stripped.startswith(marker):
    stripped = stripped[len(marker):].lstrip()
  elif fmt == 'mistral':
    return []
  if fmt == 'llama3' or stripped.startswith('{'):
    name, arguments, _ = partial_call(stripped, 0)
    return [(name, arguments)] if stripped.startswith('{') else []
  i = 0
  try:
    i = skip_space(stripped, 0)
    if stripped[i] != '[':
      return []
    while True:
      name, arguments, end = partial_call(stripped, i + 1)
      calls.append((name, arguments))
      i = skip_space(stripped, end) if end is not None else len(stripped)
      if stripped[i] != ',':
        return calls
  except (Incomplete, IndexError):
    return calls


def split_reply(text: str, fmt: str, finished: bool = False) -> tuple[str, str]:
  """``(content, reasoning)`` of a reply in ``fmt`` as far as it may stream: for ``harmony``
  the text of its messages that have no recipient (the ``analysis`` ones are the reasoning,
  the others the content; messages joined by ``\\n``), for the other formats the text before
  a call may start (:func:`held_back`) and no reasoning. While the reply grows (not
  ``finished``) a tail that may be the start of a marker is left out. A finished reply's
  content is :func:`parse_tool_calls`'s."""
  if fmt != 'harmony':
    return (text if finished else text[:held_back(text, fmt)]), ''
  content, reasoning = [], []
  for channel, recipient, body, _ in _harmony(text, finished):
    if recipient is None:
      (reasoning if channel == 'analysis' else content).append(body)
  return '\n'.join(content), '\n'.join(reasoning)


# -- DeepSeek and harmony: markers around each call, the name outside the JSON --------------


def _tail(text: str, markers: Sequence[str]) -> int:
  """The length of the longest end of ``text`` that begins one of ``markers``."""
  return max((k for marker in markers for k in range(1, len(marker))
              if text.endswith(marker[:k])), default=0)


def _deepseek_call(body: str) -> tuple[str | None, int | None]:
  """``(name, where its arguments start)`` in one DeepSeek call (the text after its begin
  marker), in either layout: ``function<sep>NAME\\n```json\\n{...}`` (V3) or
  ``NAME<sep>{...}`` (V3.1). The name is ``None`` until complete, the start ``None`` until
  the arguments may begin (V3's fence is still being written)."""
  sep = body.find(_DS_SEP)
  if sep < 0:
    return None, None
  after = sep + len(_DS_SEP)
  rest = body[after:]
  if not rest.strip():
    return None, None
  if rest.lstrip()[0] in '{["':  # V3.1: the arguments follow the separator
    return body[:sep].strip() or None, after
  newline = rest.find('\n')
  if newline < 0:
    return None, None
  name, i = rest[:newline].strip() or None, after + newline + 1
  while i < len(body) and body[i] in ' \t\n\r':
    i += 1
  fence = body[i:i + 7]
  if '```json'.startswith(fence):  # the fence may still be written (or is whole)
    return name, i + 7 if fence == '```json' else None
  return name, i + 3 if fence.startswith('```') else i


def _deepseek_segments(text: str) -> tuple[int, int, list[str]] | None:
  """``(start, end, calls)``: where the tool-calls block starts and ends in ``text`` (its
  end marker, or the end of the text) and each call's text after its begin marker, to its
  end marker if written; ``None`` without a block."""
  start = text.find(_DS_CALLS)
  if start < 0:
    return None
  end = text.find(_DS_CALLS_END, start)
  end = len(text) if end < 0 else end
  block = text[start + len(_DS_CALLS):end]
  return start, end, [part.split(_DS_CALL_END)[0] for part in block.split(_DS_CALL)[1:]]


def _parse_deepseek(text: str) -> tuple[str | None, list[ToolCall]]:
  found = _deepseek_segments(text)
  if found is None:
    return text, []
  start, end, segments = found
  calls = []
  for segment in segments:
    name, i = _deepseek_call(segment)
    try:
      value, j = json.JSONDecoder().raw_decode(segment, skip_space(segment, i or 0))
    except (Incomplete, json.JSONDecodeError):
      return text, []
    call = _call({'name': name, 'arguments': value}, 'deepseek')
    if name is None or i is None or segment[j:].strip() not in ('', '```') or call is None:
      return text, []
    calls.append(call)
  if not calls:
    return text, []
  content = (text[:start] + text[end + len(_DS_CALLS_END):]).strip()
  return content or None, calls


def _streamed_deepseek(text: str) -> list[tuple[str | None, str]]:
  found = _deepseek_segments(text)
  if found is None:
    return []
  calls = []
  for segment in found[2]:
    segment = segment[:len(segment) - _tail(segment, (_DS_CALL_END, _DS_CALLS_END, _DS_CALL))]
    name, i = _deepseek_call(segment)
    pieces: list[str] = []
    if name is not None and i is not None:
      try:
        read_value(segment, i, pieces, decoded=True)
      except (Incomplete, NotJson):
        pass
    calls.append((name, ''.join(pieces) if name is not None else ''))
  return calls


_H_ENDS = ('<|end|>', '<|call|>', '<|return|>')
_H_CHANNEL = re.compile(r'<\|channel\|>\s*([^\s<]+)')
_H_RECIPIENT = re.compile(r'\bto=([^\s<]+)')


def _harmony(text: str, finished: bool = True) -> list[tuple[str | None, str | None, str, bool]]:
  """The messages of a harmony reply, ``(channel, recipient, text, closed)``: each header
  (``<|start|>assistant``, ``<|channel|>`` and ``to=`` in either order, ``<|constrain|>``) up
  to ``<|message|>``, its text up to ``<|end|>``, ``<|call|>``, ``<|return|>`` or the next
  ``<|start|>`` (or the end of the reply: the engine drops a stop token's text). A message
  whose header is unfinished is left out; unless ``finished``, so is an end of the last
  text that may begin a marker."""
  messages, pos = [], 0
  while (opened := text.find('<|message|>', pos)) >= 0:
    header, body = text[pos:opened], opened + len('<|message|>')
    channel, recipient = _H_CHANNEL.search(header), _H_RECIPIENT.search(header)
    channel = channel.group(1) if channel else None
    recipient = recipient.group(1) if recipient else None
    ends = [(i, m) for m in (*_H_ENDS, '<|start|>') if (i := text.find(m, body)) >= 0]
    if not ends:
      last = text[body:]
      if not finished:
        last = last[:len(last) - _tail(last, (*_H_ENDS, '<|start|>'))]
      messages.append((channel, recipient, last, False))
      break
    end, marker = min(ends)
    messages.append((channel, recipient, text[body:end], True))
    pos = end + (len(marker) if marker in _H_ENDS else 0)
  return messages


def _parse_harmony(text: str) -> tuple[str | None, list[ToolCall]]:
  messages = _harmony(text)
  if not messages:
    return text, []
  calls = []
  for _, recipient, body, _ in messages:
    if recipient is None or not recipient.startswith('functions.'):
      continue
    try:
      call = _call({'name': recipient[len('functions.'):], 'arguments': json.loads(body)},
                   'harmony')
    except json.JSONDecodeError:
      call = None
    if call is None or not call.name:
      return text, []
    calls.append(call)
  return split_reply(text, 'harmony', finished=True)[0] or None, calls


def _streamed_harmony(text: str) -> list[tuple[str | None, str]]:
  calls = []
  for _, recipient, body, _ in _harmony(text, finished=False):
    if recipient is None or not recipient.startswith('functions.'):
      continue
    pieces: list[str] = []
    try:
      read_value(body, 0, pieces, decoded=True)
    except (Incomplete, NotJson):
      pass
    calls.append((recipient[len('functions.'):] or None, ''.join(pieces)))
  return calls


__all__ = ['FORMATS', 'ToolCall', 'call_grammar', 'check_tools', 'held_back',
           'parse_tool_calls', 'split_reply', 'streamed_calls', 'tool_format']

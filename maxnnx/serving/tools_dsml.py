"""DeepSeek V3.2's tool calls (``deepseek_v32``): the DSML markup.

The reply holds one block of calls, each an ``invoke`` of a function with one ``parameter``
element per argument (the markers' bars are full-width, U+FF5C)::

  <|DSML|function_calls>
  <|DSML|invoke name="get_weather">
  <|DSML|parameter name="city" string="true">Oslo</|DSML|parameter>
  <|DSML|parameter name="days" string="false">[1, 2]</|DSML|parameter>
  </|DSML|invoke>
  </|DSML|function_calls>

A parameter with ``string="true"`` holds a string's raw text, one with ``string="false"`` a
JSON value. A call's arguments are the object of its parameters in the order written, as
``json.dumps`` (``ensure_ascii=False``) writes it, and stream in that form: each parameter once
its value is certain, a raw string's text as it grows, the closing brace with the invoke's end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from maxnnx.serving.partial_json import Incomplete, NotJson, read_value

_BAR = '\uff5c'
_DSML = f'{_BAR}DSML{_BAR}'
CALLS, CALLS_END = f'<{_DSML}function_calls>', f'</{_DSML}function_calls>'
_INVOKE_END, _PARAM_END = f'</{_DSML}invoke>', f'</{_DSML}parameter>'
_INVOKE = re.compile(f'<{_DSML}invoke name="([^"]*)">')
_PARAM = re.compile(f'<{_DSML}parameter name="([^"]*)" string="(true|false)">')
_ENDS = (CALLS_END, _INVOKE_END, _PARAM_END, f'<{_DSML}invoke', f'<{_DSML}parameter')


def uses_dsml(template_source: str) -> bool:
  """Whether a chat template writes DSML calls."""
  return _DSML in template_source


def _tail(text: str) -> int:
  """The length of the longest end of ``text`` that may begin a DSML marker."""
  return max((k for marker in _ENDS for k in range(1, len(marker))
              if text.endswith(marker[:k])), default=0)


def _block(text: str) -> tuple[int, int, str] | None:
  """``(start, end, inside)`` of the calls block (``end``: its end marker, or the end of the
  text); ``None`` without one."""
  start = text.find(CALLS)
  if start < 0:
    return None
  end = text.find(CALLS_END, start)
  end = len(text) if end < 0 else end
  return start, end, text[start + len(CALLS):end]


def _invokes(block: str):
  """Each invoke in ``block``: ``(name, body, closed)``, the body to its end marker if
  written."""
  for found in _INVOKE.finditer(block):
    close = block.find(_INVOKE_END, found.end())
    yield found.group(1), block[found.end():None if close < 0 else close], close >= 0


def _parameters(body: str, finished: bool):
  """Each parameter in an invoke's body: ``(name, raw_text, is_string, closed)``."""
  for found in _PARAM.finditer(body):
    close = body.find(_PARAM_END, found.end())
    if close < 0:
      value = body[found.end():]
      yield found.group(1), value if finished else value[:len(value) - _tail(value)], (
          found.group(2) == 'true'), False
      return
    yield found.group(1), body[found.end():close], found.group(2) == 'true', True


def _member(first: bool, name: str) -> str:
  return ('{' if first else ', ') + json.dumps(name, ensure_ascii=False) + ': '


def parse(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
  """``(content, [(name, arguments)])`` of a finished reply, or ``None`` when it holds no
  well-formed calls block (then the whole reply is content)."""
  found = _block(text)
  if found is None:
    return None
  start, end, block = found
  calls = []
  for name, body, closed in _invokes(block):
    arguments = {}
    for key, raw, is_string, param_closed in _parameters(body, finished=True):
      if not param_closed:
        return None
      try:
        arguments[key] = raw if is_string else json.loads(raw)
      except json.JSONDecodeError:
        return None
    if not (closed and name):
      return None
    calls.append((name, json.dumps(arguments, ensure_ascii=False)))
  if not calls:
    return None
  content = (text[:start] + text[end + len(CALLS_END):]).strip()
  return content or None, calls


def streamed(text: str) -> list[tuple[str | None, str]]:
  """The calls a growing reply has started: ``(name, arguments so far)``, the arguments as
  far as no later text can change them (a prefix of what :func:`parse` gives)."""
  found = _block(text)
  if found is None:
    return []
  calls = []
  for name, body, closed in _invokes(found[2]):
    pieces: list[str] = []
    for k, (key, raw, is_string, param_closed) in enumerate(_parameters(body, finished=False)):
      head = _member(k == 0, key)
      if is_string:
        written = json.dumps(raw, ensure_ascii=False)
        pieces.append(head + (written if param_closed else written[:-1]))
      elif param_closed:
        try:
          pieces.append(head + json.dumps(json.loads(raw), ensure_ascii=False))
        except json.JSONDecodeError:
          break
      else:
        value: list[str] = []
        try:
          read_value(raw, 0, value)
        except (Incomplete, NotJson, IndexError):
          pass
        pieces.append(head + ''.join(value))
      if not param_closed:
        break
    else:
      if closed:
        pieces.append('}' if pieces else '{}')
    calls.append((name or None, ''.join(pieces)))
  return calls


def _is_plain_string(schema) -> bool:
  """A schema that any string meets (it may be written raw, ``string="true"``)."""
  return isinstance(schema, Mapping) and schema.get('type') == 'string' and not (
      set(schema) - {'type', 'description', 'title'})


def grammar(functions: Sequence[Mapping], parallel: bool, literal) -> str:
  """A Lark grammar (llguidance's) of a reply that is DSML calls only: one call (or, with
  ``parallel``, one or more) of any of ``functions``. Each call writes the declared
  properties in the schema's order, the required ones always and the others optionally, a
  plain string raw (without a ``<``, which could begin the end marker) and every other value
  as JSON following its schema; ``literal`` writes a marker (as one token where the
  vocabulary has it)."""
  rules = []
  for k, function in enumerate(functions):
    schema = function['parameters']
    properties = schema.get('properties', {}) if isinstance(schema, Mapping) else {}
    required = set(schema.get('required', ())) if isinstance(schema, Mapping) else set()
    params = []
    for name, sub in properties.items():
      raw = _is_plain_string(sub)
      head = json.dumps(f'<{_DSML}parameter name="{name}" string="{str(raw).lower()}">',
                        ensure_ascii=False)
      value = 'RAW' if raw else '%json ' + json.dumps(
          {**sub, 'x-guidance': {'whitespace_flexible': False}})
      param = f'{head} {value} {json.dumps(_PARAM_END, ensure_ascii=False)} "\\n"'
      params.append(param if name in required else f'({param})?')
    invoke = json.dumps(f'<{_DSML}invoke name="{function["name"]}">\n', ensure_ascii=False)
    rules.append(f'call_{k}: {invoke} {" ".join(params)} '
                 f'{json.dumps(_INVOKE_END, ensure_ascii=False)}\n')
  call = 'call: ' + ' | '.join(f'call_{k}' for k in range(len(functions))) + '\n'
  more = ' ("\\n" call)*' if parallel else ''
  return (f'start: {literal(CALLS)} "\\n" call{more} "\\n" {literal(CALLS_END)}\n' + call
          + 'RAW: /[^<]*/\n' + ''.join(rules))

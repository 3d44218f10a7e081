"""What is already certain of a JSON text that is still being written.

A streamed tool call's arguments go out piece by piece; :func:`read_value` appends the part
of a value's canonical form (``json.dumps``, ``ensure_ascii=False``) that no later text can
change, and :func:`partial_call` reads a call object (``name``, then ``arguments`` or
``parameters``) as far as it is written.
"""

from __future__ import annotations

import json
import re

_NOT_SCALAR = re.compile(r'[^\s,\]}]*')


class Incomplete(Exception):
  """The text ended before the JSON value did."""


class NotJson(Exception):
  """The text is not JSON."""


def skip_space(text: str, i: int) -> int:
  """The index of the first non-space character at or after ``i``."""
  while i < len(text) and text[i] in ' \t\n\r':
    i += 1
  if i == len(text):
    raise Incomplete
  return i


def read_string(text: str, i: int, out: list[str], decoded: bool = False) -> tuple[int, str]:
  """The JSON string at ``text[i]`` (a quote): appends what is certain of its canonical
  form (``json.dumps``, or with ``decoded`` its value) to ``out``; returns the index after it
  and its value. Raises :class:`Incomplete` (after appending) when the text ends inside it."""
  j = i + 1
  while j < len(text) and text[j] != '"':
    j += 2 if text[j] == '\\' else 1
  if j < len(text):
    try:
      value = json.loads(text[i:j + 1])
    except json.JSONDecodeError:
      raise NotJson from None
    out.append(value if decoded else json.dumps(value, ensure_ascii=False))
    return j + 1, value
  raw = text[i:]
  for cut in range(len(raw), max(len(raw) - 12, 0), -1):  # drop an unfinished escape
    try:
      value = json.loads(raw[:cut] + '"')
    except json.JSONDecodeError:
      continue
    if value and 0xD800 <= ord(value[-1]) < 0xDC00:
      continue  # half of a surrogate pair whose other half is still to come
    out.append(value if decoded else json.dumps(value, ensure_ascii=False)[:-1])
    break
  raise Incomplete


def read_value(text: str, i: int, out: list[str], decoded: bool = False) -> int:
  """Appends to ``out`` what is certain of the canonical JSON (``json.dumps``, with
  ``ensure_ascii=False``) of the value at ``text[i:]`` (a string's value with ``decoded``);
  returns the index after the value. Raises :class:`Incomplete` when the text ends first (what
  it appended is a prefix of the canonical form whatever follows), :class:`NotJson` when the
  text is not JSON."""
  i = skip_space(text, i)
  first = text[i]
  if first == '"':
    return read_string(text, i, out, decoded)[0]
  if first in '{[':
    close = '}' if first == '{' else ']'
    out.append(first)
    i = skip_space(text, i + 1)
    if text[i] == close:
      out.append(close)
      return i + 1
    while True:
      if first == '{':
        i = skip_space(text, i)
        if text[i] != '"':
          raise NotJson
        i = skip_space(text, read_string(text, i, out)[0])
        if text[i] != ':':
          raise NotJson
        out.append(': ')
        i += 1
      i = skip_space(text, read_value(text, i, out))
      if text[i] == close:
        out.append(close)
        return i + 1
      if text[i] != ',':
        raise NotJson
      out.append(', ')
      i += 1
  end = _NOT_SCALAR.match(text, i).end()
  if end == len(text):
    raise Incomplete  # a number or word that may go on
  try:
    value = json.loads(text[i:end])
  except json.JSONDecodeError:
    raise NotJson from None
  out.append(json.dumps(value))
  return end


def partial_call(text: str, i: int) -> tuple[str | None, str, int | None]:
  """``(name, arguments, end)`` of the call object at ``text[i:]``, as far as it is written:
  its ``name`` once complete, the certain prefix of its ``arguments`` (or ``parameters``) as
  ``parse_tool_calls`` writes them, and the index after the object once closed."""
  name, arguments, key_of_arguments = None, '', None
  try:
    i = skip_space(text, i)
    if text[i] != '{':
      return None, '', None
    i = skip_space(text, i + 1)
    if text[i] == '}':
      return None, '', i + 1
    while True:
      if text[i] != '"':
        return name, arguments, None
      i, key = read_string(text, i, [])
      i = skip_space(text, i)
      if text[i] != ':':
        return name, arguments, None
      i = skip_space(text, i + 1)
      if key == 'name' and text[i] == '"':
        i, name = read_string(text, i, [])
      elif key in ('arguments', 'parameters') and key_of_arguments != 'parameters':
        key_of_arguments, pieces = key, []
        try:
          i = read_value(text, i, pieces, decoded=True)
        finally:
          arguments = ''.join(pieces)
      else:
        i = read_value(text, i, [])
      i = skip_space(text, i)
      if text[i] == '}':
        return name, arguments, i + 1
      if text[i] != ',':
        return name, arguments, None
      i = skip_space(text, i + 1)
  except (Incomplete, NotJson):
    return name, arguments, None


__all__ = ['Incomplete', 'NotJson', 'partial_call', 'read_string', 'read_value', 'skip_space']

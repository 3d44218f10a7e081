r"""Reading an HTTP request's body for the server: a size limit (413 past it), JSON parsing that
answers 400 for what is not JSON or holds a lone UTF-16 surrogate, both as OpenAI-style
:class:`~maxnnx.serving.openai_api.ApiError`\ s."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from starlette.requests import Request

from maxnnx.serving.openai_api import ApiError, ServedModel


async def read_body(request: Request, limit: int) -> bytes:
  """The request's body, refused with 413 once it is longer than ``limit`` bytes (by its
  ``Content-Length`` before any of it is read, else as it arrives)."""
  declared = request.headers.get('content-length', '')
  if declared.isdigit() and int(declared) > limit:
    raise _too_large(limit)
  chunks, size = [], 0
  async for part in request.stream():
    size += len(part)
    if size > limit:
      raise _too_large(limit)
    chunks.append(part)
  return b''.join(chunks)


def _too_large(limit: int) -> ApiError:
  return ApiError(f'The request body is larger than this server takes ({limit} bytes, '
                  'max_request_bytes).', status=413, code='request_too_large')


def parse_json(parse: Callable, body: bytes, served: ServedModel):
  """``parse`` (:func:`~maxnnx.serving.openai_api.parse_completion`, ``parse_chat`` or a
  tokenizer endpoint's answer) of the JSON ``body``: what a worker thread runs (tokenizing a
  long prompt takes a while)."""
  try:
    value = json.loads(body)
  except ValueError as e:  # also text that is not UTF-8
    raise ApiError(f'The request body is not valid JSON: {e}', code='invalid_json') from None
  except RecursionError:
    raise ApiError('The request body is not valid JSON: nested too deeply.',
                   code='invalid_json') from None
  if _SURROGATE_ESCAPE.search(body):
    _check_text(value)
  return parse(value, served)


def _encodes(text: str) -> bool:
  try:
    text.encode('utf-8')
  except UnicodeEncodeError:
    return False
  return True


_SURROGATE_ESCAPE = re.compile(rb'\\u[dD][89a-fA-F]')


def _check_text(value) -> None:
  """Refuse a string holding half of a UTF-16 surrogate pair (JSON's ``"\\ud800"``): no
  text, and no tokenizer takes it."""
  stack = [(None, value)]
  while stack:
    where, item = stack.pop()
    if isinstance(item, dict):
      stack.extend((where or key, v) for key, v in item.items())
    elif isinstance(item, list):
      stack.extend((where, v) for v in item)
    elif isinstance(item, str) and not _encodes(item):
      raise ApiError(f'{where or "The request body"} holds a lone UTF-16 surrogate (an '
                     'unpaired \\ud800-\\udfff escape), which is not text.', param=where,
                     code='invalid_value')

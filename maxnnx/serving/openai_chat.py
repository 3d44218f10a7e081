"""The chat API's requests: messages (text, images, past tool calls) rendered through the
chat template, and ``tools`` / ``tool_choice`` (see :mod:`maxnnx.serving.openai_api`, whose
field readers and sampling parse the rest).
"""

from __future__ import annotations

import json
from typing import Any

from maxnnx.data.chat import encode_with_specials, special_tokens
from maxnnx.inference.structured import StructuredOutput
from maxnnx.serving.openai_api import (
  CHAT_ROLES,
  ApiError,
  ParsedRequest,
  ServedModel,
  _check_length,
  _check_logprobs,
  _check_model,
  _compiled,
  _field,
  _object,
  _sampling,
  _stream_fields,
  _structured,
  _unsupported,
)
from maxnnx.serving.tools import call_grammar, check_tools, tool_format


def parse_chat(body: Any, served: ServedModel) -> ParsedRequest:
  """Validate a ``/v1/chat/completions`` body and render its messages with the chat template.

  A message's ``content`` is a string or a list of ``{"type": "text", "text": ...}``
  parts, and, for a vision-language model, ``{"type": "image_url", "image_url":
  {"url": "data:image/...;base64,..."}}`` parts (the template writes its image marker,
  expanded to the model's placeholders). The rendered conversation (with the
  generation prompt) is encoded with its special-token strings as their ids; the reply
  stops at an end-of-turn token.
  Without ``max_tokens`` / ``max_completion_tokens`` it may run to the end of the context.

  Raises:
    ApiError: (400) as :func:`parse_completion`, and for malformed messages, a
      template that refuses them, or a model without a chat template.
  """
  body = _object(body)
  lora = _check_model(body, served)
  if served.template is None:
    raise ApiError('This model has no chat template (chat_template.jinja or tokenizer_config.'
                   "json's chat_template); use /v1/completions.", param='messages',
                   code='no_chat_template')
  for name in ('functions', 'audio', 'prediction'):
    _unsupported(body, name)
  _unsupported(body, 'echo', (None, False))  # the chat API has no echo
  _unsupported(body, 'function_call', (None, 'none', 'auto'))
  _unsupported(body, 'modalities', (None, ['text']))
  structured = _structured(body, 'chat')
  tools, fmt, forced = _tools(body, served)
  if forced is not None:
    if structured is not None:
      raise ApiError('tool_choice required or a named function fixes the reply\'s format; '
                     'give no response_format or guided_* field with it.',
                     param='tool_choice', code='invalid_value')
    structured = forced
  messages, sources = _messages(body.get('messages'))
  try:
    extra = {} if tools is None else {'tools': tools}
    text = served.template.render(messages, add_generation_prompt=True, **extra)
  except Exception as e:  # the template's own raise_exception, or a template bug
    raise ApiError(f'The chat template refused the messages: {e}', param='messages',
                   code='invalid_value') from None
  pixels = None
  if sources:
    text, pixels = _images(text, sources, served)
  ids = tuple(encode_with_specials(served.tokenizer, text))
  if not ids:
    raise ApiError('The rendered conversation is empty.', param='messages', code='invalid_value')
  _check_length(ids, served, 'messages')
  logprobs = None
  if _field(body, 'logprobs', (bool,), False):
    logprobs = _check_logprobs(_field(body, 'top_logprobs', (int,), 0), served, 'top_logprobs')
  elif body.get('top_logprobs') is not None:
    raise ApiError('top_logprobs needs logprobs=true.', param='top_logprobs',
                   code='invalid_value')
  name = 'max_completion_tokens' if body.get('max_completion_tokens') is not None else (
      'max_tokens')
  n, params = _sampling(body, served, 'chat', [ids], name, None, logprobs, structured)
  stream, include_usage = _stream_fields(body)
  return ParsedRequest('chat', (ids,), tuple(params), n, stream, include_usage, logprobs,
                       _field(body, 'return_token_ids', (bool,), False), pixels,
                       tool_format=fmt, lora=lora,
                       read_calls=tools is not None and body.get('tool_choice') != 'none',
                       reasoning_parser=None if fmt == 'harmony' else served.reasoning_parser)


def _tools(body, served: ServedModel) -> tuple[list | None, str | None, StructuredOutput | None]:
  """``(tools for the template, the format calls are parsed from, the grammar that forces a
  call)`` from ``tools``, ``tool_choice`` and ``parallel_tool_calls``. A harmony (GPT-OSS)
  reply is always read in its format, tools or not: its content is its final channel's text."""
  choice = body.get('tool_choice')
  fmt = tool_format(served.template.source)
  always = fmt if fmt == 'harmony' else None
  if body.get('tools') is None:
    if choice not in (None, 'none'):
      raise ApiError('tool_choice needs tools.', param='tool_choice', code='invalid_value')
    return None, always, None
  try:
    tools = check_tools(body['tools'])
  except ValueError as e:
    raise ApiError(str(e), param='tools', code='invalid_value') from None
  choice = 'auto' if choice is None else choice
  names = [t['function']['name'] for t in tools]
  named = None
  if isinstance(choice, dict):
    function = choice.get('function')
    named = function.get('name') if isinstance(function, dict) else None
    if choice.get('type') != 'function' or named not in names:
      raise ApiError(f'tool_choice must be {{"type": "function", "function": {{"name": ...}}}}'
                     f' naming one of the tools ({", ".join(names)}); got {choice!r}.',
                     param='tool_choice', code='invalid_value')
  elif choice not in ('none', 'auto', 'required'):
    raise ApiError(f'tool_choice must be none, auto, required or {{"type": "function", '
                   f'"function": {{"name": ...}}}}; got {choice!r}.', param='tool_choice',
                   code='invalid_value')
  if choice in ('none', 'auto'):
    return tools, always if choice == 'none' else fmt, None
  parallel = _field(body, 'parallel_tool_calls', (bool,), True) and named is None
  grammar = call_grammar(tools, fmt, named, parallel, special_tokens(served.tokenizer))
  return tools, fmt, _compiled('tools', 'grammar', grammar)


def _images(text: str, sources: list[tuple[str, str]], served: ServedModel):
  """``(text with the image markers expanded, pixels)`` of a chat's ``image_url`` parts."""
  from maxnnx.data.images import load_image  # noqa: PLC0415
  if served.image_prompt is None:
    raise ApiError('This model takes no images (no vision tower, or no known image prompt).',
                   param=sources[0][0], code='invalid_value')
  images = []
  for where, url in sources:
    if not url.startswith('data:'):
      raise ApiError('image_url.url must be a data: URL (data:image/png;base64,...); this '
                     'server fetches nothing.', param=where, code='invalid_value')
    try:
      images.append(load_image(url))
    except ValueError as e:
      raise ApiError(str(e), param=where, code='invalid_value') from None
  markers = text.count(served.image_prompt.marker)
  if markers != len(images):
    raise ApiError(f'The chat template wrote {markers} image marker(s) for {len(images)} '
                   'image(s).', param='messages', code='invalid_value')
  pixels, layouts = served.image_processor(images)
  return served.image_prompt.expand(text, layouts)[0], pixels


def _messages(value) -> tuple[list[dict], list[tuple[str, str]]]:
  """``(messages, [(param, image url), ...])``: text parts joined, image parts kept as
  ``{"type": "image"}`` (the content stays a list then)."""
  if not isinstance(value, list) or not value:
    raise ApiError('messages must be a non-empty array of {"role", "content"} objects.',
                   param='messages', code='invalid_type')
  messages, sources = [], []
  for i, message in enumerate(value):
    where = f'messages[{i}]'
    if not isinstance(message, dict):
      raise ApiError(f'{where} must be an object.', param=where, code='invalid_type')
    role = message.get('role')
    if role not in CHAT_ROLES:
      raise ApiError(f'{where}.role must be one of {", ".join(CHAT_ROLES)}; got {role!r}.',
                     param=f'{where}.role', code='invalid_value')
    content = message.get('content')
    if isinstance(content, list):
      parts = []
      for j, part in enumerate(content):
        url = part.get('image_url') if isinstance(part, dict) else None
        url = url.get('url') if isinstance(url, dict) else url
        if (isinstance(part, dict) and part.get('type') == 'image_url'
            and isinstance(url, str)):
          sources.append((f'{where}.content[{j}].image_url', url))
          parts.append({'type': 'image'})
          continue
        if not (isinstance(part, dict) and part.get('type') == 'text'
                and isinstance(part.get('text'), str)):
          raise ApiError(f'{where}.content: only {{"type": "text", "text": ...}} and '
                         '{"type": "image_url", "image_url": {"url": ...}} parts are '
                         'supported.', param=f'{where}.content', code='invalid_value')
        if parts and parts[-1]['type'] == 'text':  # adjacent text parts join, as before
          parts[-1] = {'type': 'text', 'text': parts[-1]['text'] + part['text']}
        else:
          parts.append({'type': 'text', 'text': part['text']})
      has_image = any(p['type'] == 'image' for p in parts)
      content = parts if has_image else ''.join(p['text'] for p in parts)
    elif content is None and role == 'assistant':
      content = ''
    elif not isinstance(content, str):
      raise ApiError(f'{where}.content must be a string or an array of text parts.',
                     param=f'{where}.content', code='invalid_type')
    entry = {'role': role, 'content': content}
    if isinstance(message.get('name'), str):
      entry['name'] = message['name']
    if role == 'tool' and isinstance(message.get('tool_call_id'), str):
      entry['tool_call_id'] = message['tool_call_id']
    if role == 'assistant' and message.get('tool_calls') is not None:
      entry['tool_calls'] = _past_calls(message['tool_calls'], where)
    messages.append(entry)
  return messages, sources


class _Arguments(dict):
  """A past call's arguments: the object most templates read (``arguments | tojson``), and
  its JSON text where a template joins it to text (DeepSeek V3's writes ``'\\n' + arguments``)
  or prints it."""

  def __str__(self) -> str:
    return json.dumps(self, ensure_ascii=False)

  def __add__(self, other):
    return str(self) + other if isinstance(other, str) else NotImplemented

  def __radd__(self, other):
    return other + str(self) if isinstance(other, str) else NotImplemented


def _past_calls(calls, where: str) -> list[dict]:
  """An assistant message's ``tool_calls`` for the template: each call's ``arguments``
  (JSON text in OpenAI's API) as the object templates expect, as transformers renders them
  (an object that is its JSON text where the template joins it to text)."""
  def call(i, value):
    function = value.get('function') if isinstance(value, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get('name'), str):
      raise ApiError(f'{where}.tool_calls[{i}] must be {{"type": "function", "function": '
                     '{"name", "arguments"}}.', param=f'{where}.tool_calls', code='invalid_value')
    arguments = function.get('arguments', {})
    if isinstance(arguments, str):
      try:
        arguments = json.loads(arguments)
      except json.JSONDecodeError:
        pass  # the template gets the text as it came
    if isinstance(arguments, dict):
      arguments = _Arguments(arguments)
    return {**value, 'function': {**function, 'arguments': arguments}}

  if not isinstance(calls, list):
    raise ApiError(f'{where}.tool_calls must be an array.', param=f'{where}.tool_calls',
                   code='invalid_type')
  return [call(i, value) for i, value in enumerate(calls)]

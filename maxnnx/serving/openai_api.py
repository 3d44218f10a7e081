"""The OpenAI HTTP API's requests and responses: validation, streaming text, JSON bodies.

Nothing here runs a model or opens a socket. :func:`parse_completion` and
:func:`parse_chat` turn a request body into a :class:`ParsedRequest` (prompts as
token ids, one :class:`~maxnnx.serving.SamplingParams` per choice) or raise an
:class:`ApiError` whose :meth:`~ApiError.body` is OpenAI's error object.
:class:`ChoiceStream` follows one choice's engine outputs and says which new text
is safe to send (never text a stop string could still take back, never half a
UTF-8 character); the ``*_body`` and ``*_chunk`` functions build the JSON of a
whole response and of a streamed chunk.

OpenAI's sampling fields ``logit_bias``, ``presence_penalty``, ``frequency_penalty`` and
``seed`` (choice ``j`` of a request uses ``seed + j``) are honoured. Accepted beyond
OpenAI's fields, as other OpenAI-compatible servers name them: ``top_k``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids`` and
``return_token_ids`` (each choice then carries ``token_ids`` and ``prompt_token_ids``).
Fields with no effect here (``user``, ``metadata``, ...) are ignored; fields that would
change the output in a way the engine cannot honour (``suffix``, ``functions``, audio, ...)
are refused with 400 rather than silently dropped.

Structured outputs: the chat API's ``response_format`` (``{"type": "json_object"}``, or
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``), and on both
endpoints vLLM's ``guided_json`` (a schema), ``guided_regex``, ``guided_grammar`` (Lark as
llguidance reads it, or GBNF / EBNF) and ``guided_choice`` (one of a list of strings) become
``SamplingParams.structured``: every token is
sampled among those the grammar allows (:mod:`maxnnx.inference.structured`). A grammar that
does not compile is a 400 naming the field and the problem.

Tools: the chat API's ``tools`` go to the chat template (its ``tools`` variable, as
transformers passes them), and each finished reply's calls are parsed in the model's format
(:mod:`~maxnnx.serving.tools`) into ``message.tool_calls`` (finish reason ``tool_calls``,
``content`` ``null`` when the reply is calls only; streamed, the text that may become a call
is held back and the calls come in the last chunk's ``delta.tool_calls``). ``tool_choice``
``auto`` (the default with tools) lets the model choose, ``none`` parses nothing, and
``required`` or ``{"type": "function", "function": {"name": ...}}`` constrains the reply with
a grammar to a call whose arguments follow the function's ``parameters`` schema (one call, or
with ``parallel_tool_calls`` and ``required``, one or more).

``/v1/completions`` takes ``echo``: each choice's ``text`` starts with its prompt's, and with
``logprobs`` the ``logprobs`` object covers every prompt token first (the first ``null``: nothing
predicts it), as OpenAI's legacy API and lm-evaluation-harness's ``local-completions`` want.
``max_tokens=0`` is allowed with ``echo`` only: the prompt is scored, nothing generated. The
server computes the prompt's log-probabilities with
:meth:`~maxnnx.serving.Engine.score_prompt`. ``best_of`` (``>= n``) samples that many choices
per prompt and answers the ``n`` with the highest mean log-probability per token
(:func:`best_choices`). Neither streams (400 naming the field); chat has no ``echo``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from maxnnx.data.chat import ChatTemplate, encode_with_specials, special_tokens
from maxnnx.inference.sampling import MAX_LOGIT_BIAS, MAX_PENALTY
from maxnnx.inference.structured import StructuredOutput
from maxnnx.serving.output_processor import stable_text, stop_ids
from maxnnx.serving.params import MAX_SEED, RequestOutput, SamplingParams, TokenLogprobs
from maxnnx.serving.tools import (
  ToolCall,
  call_grammar,
  check_tools,
  held_back,
  parse_tool_calls,
  tool_format,
)

MAX_STOP_STRINGS = 4
MAX_CHOICES = 64  # n times the number of prompts, per request
CHAT_ROLES = ('system', 'developer', 'user', 'assistant', 'tool')


class ApiError(Exception):
  """A request the server refuses; becomes an HTTP error with OpenAI's error body.

  Args:
    message: what is wrong, for the client.
    status: the HTTP status (400 bad request, 429 queue full, 503 shutting down...).
    type: OpenAI's error type (``invalid_request_error``, ...).
    param: the request field at fault, or ``None``.
    code: a short machine-readable code, or ``None``.
  """

  def __init__(self, message: str, *, status: int = 400, type: str = 'invalid_request_error',
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.message, self.status, self.type, self.param, self.code = (
        message, status, type, param, code)

  def body(self) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {'error': {'message': self.message, 'type': self.type, 'param': self.param,
                      'code': self.code}}


@dataclasses.dataclass(frozen=True)
class ServedModel:
  """What validating a request needs to know of the model being served.

  Attributes:
    name: the model name clients send (``/v1/models`` lists it).
    tokenizer: the model's tokenizer (``encode``, ``decode``, ``bos_id``).
    template: its :class:`~maxnnx.data.ChatTemplate`, or ``None`` (no chat endpoint).
    max_model_len: prompt plus output tokens of one request at most.
    vocab_size: token ids of a prompt must be below it.
    max_logprobs: the most log-probabilities per token a request may ask for.
    chat_stop_ids: ids that end an assistant turn (the chat endpoint stops at them).
    add_bos: text prompts of ``/v1/completions`` start with the tokenizer's BOS id.
    image_processor, image_prompt: a vision-language model's
      :class:`~maxnnx.data.ImageProcessor` and :class:`~maxnnx.data.ImagePrompt`
      (``None``: chat messages may not hold images).
  """

  name: str
  tokenizer: Any
  template: ChatTemplate | None
  max_model_len: int
  vocab_size: int
  max_logprobs: int
  chat_stop_ids: tuple[int, ...] = ()
  add_bos: bool = True
  image_processor: Any = None
  image_prompt: Any = None


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
  """A validated request: what the engine runs and how the answer is shaped.

  Attributes:
    kind: ``'completion'`` or ``'chat'``.
    prompts: the prompts' token ids (a chat has one).
    params: one :class:`SamplingParams` per choice; choice ``i`` continues
      ``prompts[i // n]``.
    n: choices per prompt.
    stream: answer with server-sent events.
    include_usage: a streamed answer ends with a chunk holding the token counts.
    logprobs: log-probabilities to return per token (``None``: none).
    return_token_ids: choices carry ``token_ids`` and ``prompt_token_ids``.
    images: the chat's pixels ``[num_images, 3, H, W]``, or ``None``.
    echo: each choice's text (and log-probabilities) starts with its prompt's.
    prompt_texts: the prompts' text when ``echo`` (a text prompt as sent, token ids decoded).
    score_only: ``max_tokens=0`` with ``echo``: nothing is generated, the prompts are only
      scored (``params`` are kept for the choices' shape, with ``max_tokens=1``, not run).
    best_of: choices sampled per prompt, of which the ``n`` with the highest mean
      log-probability per token are answered (``None``: ``n``).
    tool_format: the format tool calls are parsed from in each reply
      (:mod:`~maxnnx.serving.tools`), or ``None`` (no tools, or ``tool_choice`` ``none``).
  """

  kind: str
  prompts: tuple[tuple[int, ...], ...]
  params: tuple[SamplingParams, ...]
  n: int = 1
  stream: bool = False
  include_usage: bool = False
  logprobs: int | None = None
  return_token_ids: bool = False
  images: Any = None
  echo: bool = False
  prompt_texts: tuple[str, ...] = ()
  score_only: bool = False
  best_of: int | None = None
  tool_format: str | None = None

  @property
  def samples_per_prompt(self) -> int:
    """Choices sampled per prompt: ``best_of``, else ``n``."""
    return self.best_of or self.n

  def prompt_of(self, choice: int) -> tuple[int, ...]:
    """The prompt the sampled choice ``choice`` (an index into ``params``) continues."""
    return self.prompts[choice // self.samples_per_prompt]


# -- field readers ---------------------------------------------------------------------

_MISSING = object()


def _field(body: Mapping, name: str, kinds: tuple[type, ...], default=None, *,
           what: str | None = None):
  """``body[name]`` if of one of ``kinds`` (``None`` gives ``default``); bools are not ints."""
  value = body.get(name, _MISSING)
  if value is _MISSING or value is None:
    return default
  numeric = int in kinds or float in kinds
  if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds) or (
      numeric and isinstance(value, float) and not math.isfinite(value)):
    raise ApiError(f'{name} must be {what or _describe(kinds)}, got {_json_type(value)}.',
                   param=name, code='invalid_type')
  return value


def _describe(kinds: tuple[type, ...]) -> str:
  names = {bool: 'a boolean', int: 'an integer', float: 'a number', str: 'a string',
           list: 'an array', dict: 'an object'}
  return ' or '.join(names[k] for k in kinds if not (k is int and float in kinds))


def _json_type(value) -> str:
  for kind, name in ((bool, 'a boolean'), (int, 'an integer'), (float, 'a number'),
                     (str, 'a string'), (list, 'an array'), (dict, 'an object')):
    if isinstance(value, kind):
      return f'{name} ({value!r})' if kind in (int, float) else name
  return type(value).__name__


def _number(body, name, default, low, high, *, low_open=False):
  value = _field(body, name, (int, float), default)
  if value is None:
    return None
  if value < low or value > high or (low_open and value == low):
    bound = f'> {low}' if low_open else f'>= {low}'
    raise ApiError(f'{name}={value} is out of range (need {bound} and <= {high}).', param=name,
                   code='invalid_value')
  return float(value)


def _unsupported(body, name, allowed=(None,)):
  """Refuse ``body[name]`` unless it is absent, empty or one of ``allowed``."""
  value = body.get(name)
  if not (value in ({}, []) or any(value is a or value == a for a in allowed)):
    raise ApiError(f'{name} is not supported by this server.', param=name,
                   code='unsupported_parameter')


def _check_model(body, served: ServedModel) -> None:
  model = _field(body, 'model', (str,), '')
  if not model:
    raise ApiError('model is required.', param='model', code='missing_required_parameter')
  if model != served.name:
    raise ApiError(f'The model {model!r} does not exist; this server serves {served.name!r}.',
                   param='model', code='model_not_found')


def _token_ids(value, served: ServedModel, param: str) -> tuple[int, ...]:
  if not value:
    raise ApiError(f'{param} is empty.', param=param, code='invalid_value')
  if not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
    raise ApiError(f'{param} must hold strings or token ids (integers).', param=param,
                   code='invalid_type')
  if min(value) < 0 or max(value) >= served.vocab_size:
    raise ApiError(f'{param} holds token ids outside [0, {served.vocab_size}).', param=param,
                   code='invalid_value')
  return tuple(value)


def _check_length(ids: Sequence[int], served: ServedModel, param: str) -> None:
  if len(ids) >= served.max_model_len:
    raise ApiError(f"This model's maximum context length is {served.max_model_len} tokens; the "
                   f'prompt has {len(ids)}, which leaves no room for output.', param=param,
                   code='context_length_exceeded')


def _sampling(body, served: ServedModel, kind: str, prompts, max_tokens_name: str,
              default_max_tokens: int | None, logprobs: int | None,
              structured: StructuredOutput | None = None) -> tuple[int, list]:
  """``(n, one SamplingParams per choice)`` from the shared sampling fields."""
  controls = _controls(body, served)
  n = _field(body, 'n', (int,), 1)
  if n < 1 or n * len(prompts) > MAX_CHOICES:
    raise ApiError(f'n={n} is out of range (need 1 <= n, and at most {MAX_CHOICES} choices in '
                   'all).', param='n', code='invalid_value')
  max_tokens = _field(body, max_tokens_name, (int,), default_max_tokens)
  if max_tokens is not None and max_tokens <= 0:
    raise ApiError(f'{max_tokens_name}={max_tokens} must be at least 1.', param=max_tokens_name,
                   code='invalid_value')
  temperature = _number(body, 'temperature', 1.0, 0.0, 2.0)
  top_p = _number(body, 'top_p', 1.0, 0.0, 1.0, low_open=True)
  top_k = _field(body, 'top_k', (int,), -1)
  if top_k < -1:
    raise ApiError(f'top_k={top_k} must be -1 or 0 (no cut) or at least 1.', param='top_k',
                   code='invalid_value')
  top_k = min(top_k, served.vocab_size)  # the engine's arrays are int32
  seed = _field(body, 'seed', (int,), None)
  stop = _field(body, 'stop', (str, list), [])
  stop = [stop] if isinstance(stop, str) else stop
  if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
    raise ApiError(f'stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} '
                   'of them.', param='stop', code='invalid_value')
  stop_ids = _field(body, 'stop_token_ids', (list,), [])
  if not all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids):
    raise ApiError('stop_token_ids must be a list of integers.', param='stop_token_ids',
                   code='invalid_type')
  ignore_eos = _field(body, 'ignore_eos', (bool,), False)
  if max_tokens is not None and controls['min_tokens'] > max_tokens:
    raise ApiError(f"min_tokens={controls['min_tokens']} is more than {max_tokens_name}="
                   f'{max_tokens}.', param='min_tokens', code='invalid_value')
  if kind == 'chat':
    stop_ids = [*stop_ids, *served.chat_stop_ids]
  params = []
  for prompt in prompts:
    room = served.max_model_len - len(prompt)
    for j in range(n):
      choice_seed = None if seed is None else (seed + j) % (MAX_SEED + 1)
      try:
        params.append(SamplingParams(
            max_tokens=min(max_tokens or room, room), temperature=temperature,
            top_k=top_k if top_k > 0 else None, top_p=None if top_p >= 1.0 else top_p,
            seed=choice_seed, stop_token_ids=tuple(stop_ids), stop=tuple(stop),
            ignore_eos=ignore_eos, logprobs=logprobs, structured=structured, **controls))
      except ValueError as e:
        raise ApiError(str(e), code='invalid_value') from None
  return n, params


def _controls(body, served: ServedModel) -> dict:
  """The logit controls (bias, penalties, ``min_tokens``) as ``SamplingParams`` fields."""
  controls = {name: _number(body, name, 0.0, -MAX_PENALTY, MAX_PENALTY)
              for name in ('presence_penalty', 'frequency_penalty')}
  controls['repetition_penalty'] = _number(body, 'repetition_penalty', 1.0, 0.0, math.inf,
                                           low_open=True)
  controls['min_tokens'] = _field(body, 'min_tokens', (int,), 0)
  if controls['min_tokens'] < 0:
    raise ApiError(f"min_tokens={controls['min_tokens']} must be >= 0.", param='min_tokens',
                   code='invalid_value')
  controls['logit_bias'] = _logit_bias(_field(body, 'logit_bias', (dict,), {}), served)
  return controls


def _logit_bias(value: Mapping, served: ServedModel) -> dict[int, float]:
  """``{"token id": bias}`` (JSON keys are strings) as ``{int: float}``, checked."""
  bias = {}
  for key, number in value.items():
    token = int(key) if isinstance(key, str) and key.strip().isdigit() else -1
    if not 0 <= token < served.vocab_size:
      raise ApiError(f'logit_bias key {key!r} is not a token id in [0, {served.vocab_size}).',
                     param='logit_bias', code='invalid_value')
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not (
        -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS):
      raise ApiError(f'logit_bias[{key!r}] must be a number in [-{MAX_LOGIT_BIAS:g}, '
                     f'{MAX_LOGIT_BIAS:g}], got {_json_type(number)}.', param='logit_bias',
                     code='invalid_value')
    bias[token] = float(number)
  return bias


GUIDED_FIELDS = {'guided_json': 'json_schema', 'guided_regex': 'regex',
                 'guided_grammar': 'grammar', 'guided_choice': 'grammar'}


def _compiled(param: str, kind: str, spec: str) -> StructuredOutput:
  """``StructuredOutput(kind, spec)``; a grammar that does not compile is a 400 naming
  ``param`` and the problem."""
  try:
    return StructuredOutput(kind, spec)
  except ValueError as e:
    raise ApiError(f'{param} does not compile: {e}', param=param, code='invalid_value') from None


def _guided(body) -> tuple[str, StructuredOutput] | None:
  """``(field, structured output)`` of vLLM's ``guided_json`` / ``guided_regex`` /
  ``guided_grammar`` / ``guided_choice`` (at most one), or ``None``."""
  given = [name for name in GUIDED_FIELDS if body.get(name) is not None]
  if len(given) > 1:
    raise ApiError(f'Give one of {", ".join(given)}, not several.', param=given[1],
                   code='invalid_value')
  if not given:
    return None
  name = given[0]
  if name == 'guided_choice':
    value = _field(body, name, (list,))
    if not value or not all(isinstance(v, str) and v for v in value):
      raise ApiError('guided_choice must be a non-empty array of non-empty strings.',
                     param=name, code='invalid_value')
    return name, _compiled(name, 'grammar', 'start: ' + ' | '.join(map(json.dumps, value)))
  kinds = (dict, str) if name == 'guided_json' else (str,)
  value = _field(body, name, kinds)
  spec = json.dumps(value) if isinstance(value, dict) else value
  return name, _compiled(name, GUIDED_FIELDS[name], spec)


def _response_format(body) -> StructuredOutput | None:
  """The chat API's ``response_format``: ``text`` (``None``), ``json_object`` or
  ``json_schema`` (``{"json_schema": {"name": ..., "schema": {...}}}``)."""
  value = _field(body, 'response_format', (dict,), {'type': 'text'})
  kind = value.get('type')
  if kind == 'text':
    return None
  if kind == 'json_object':
    return StructuredOutput('json_object')
  if kind == 'json_schema':
    spec = value.get('json_schema')
    schema = spec.get('schema') if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
      raise ApiError('response_format json_schema needs {"json_schema": {"name": ..., '
                     '"schema": {...}}}, the schema a JSON object.', param='response_format',
                     code='invalid_value')
    return _compiled('response_format', 'json_schema', json.dumps(schema))
  raise ApiError(f'response_format type must be text, json_object or json_schema; got '
                 f'{kind!r}.', param='response_format', code='invalid_value')


def _structured(body, kind: str) -> StructuredOutput | None:
  """The request's structured output: ``response_format`` (chat) or a ``guided_*`` field."""
  guided = _guided(body)
  fmt = _response_format(body) if kind == 'chat' else None
  if guided is not None and fmt is not None:
    raise ApiError(f'Give response_format or {guided[0]}, not both.', param=guided[0],
                   code='invalid_value')
  return fmt if guided is None else guided[1]


def _check_logprobs(value: int | None, served: ServedModel, param: str) -> int | None:
  if value is not None and not 0 <= value <= served.max_logprobs:
    raise ApiError(f'{param}={value} is out of range (this server returns 0 to '
                   f'{served.max_logprobs}).', param=param, code='invalid_value')
  return value


def _stream_fields(body) -> tuple[bool, bool]:
  stream = _field(body, 'stream', (bool,), False)
  options = _field(body, 'stream_options', (dict,), {})
  include_usage = _field(options, 'include_usage', (bool,), False) if stream else False
  return stream, include_usage


# -- requests ---------------------------------------------------------------------------


def parse_completion(body: Any, served: ServedModel) -> ParsedRequest:
  """Validate a ``/v1/completions`` body.

  ``prompt`` is a string, a list of strings, a list of token ids or a list of such
  lists; each prompt gets ``n`` choices.

  Raises:
    ApiError: (400) for an unknown model, a field of the wrong type or out of
      range, a prompt that leaves no room under the context, or a field this
      server cannot honour.
  """
  body = _object(body)
  _check_model(body, served)
  echo = _field(body, 'echo', (bool,), False)
  _unsupported(body, 'suffix', (None, ''))
  prompt = body.get('prompt')
  if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and
                                 all(isinstance(i, int) for i in prompt)):
    prompt = [prompt]
  if not isinstance(prompt, list) or not prompt:
    raise ApiError('prompt must be a string, a list of strings, a list of token ids or a list '
                   'of such lists.', param='prompt', code='invalid_type')
  prompts = []
  for p in prompt:
    if isinstance(p, str):
      bos = served.tokenizer.bos_id if served.add_bos else None
      ids = ([bos] if bos is not None else []) + list(served.tokenizer.encode(p))
      if not ids:
        raise ApiError('prompt is empty.', param='prompt', code='invalid_value')
      prompts.append(tuple(ids))
    elif isinstance(p, list):
      prompts.append(_token_ids(p, served, 'prompt'))
    else:
      raise ApiError('prompt must be a string, a list of strings, a list of token ids or a '
                     'list of such lists.', param='prompt', code='invalid_type')
    _check_length(prompts[-1], served, 'prompt')
  logprobs = _check_logprobs(_field(body, 'logprobs', (int,), None), served, 'logprobs')
  stream, include_usage = _stream_fields(body)
  if echo and stream:
    raise ApiError('echo is not supported with stream=true by this server; ask without '
                   'streaming.', param='echo', code='unsupported_parameter')
  score_only = _field(body, 'max_tokens', (int,), None) == 0
  if score_only and not echo:
    raise ApiError('max_tokens=0 needs echo=true (the prompt scored, nothing generated).',
                   param='max_tokens', code='invalid_value')
  n = _field(body, 'n', (int,), 1)
  best_of = _field(body, 'best_of', (int,), None)
  if best_of == n:
    best_of = None
  elif best_of is not None:
    if stream:
      raise ApiError('best_of is not supported with stream=true.', param='best_of',
                     code='unsupported_parameter')
    if score_only:
      raise ApiError('best_of needs max_tokens >= 1 (there is nothing to rank).',
                     param='best_of', code='invalid_value')
    if not 1 <= n <= best_of <= MAX_CHOICES // len(prompts):
      raise ApiError(f'best_of={best_of} is out of range (need 1 <= n={n} <= best_of, and '
                     f'at most {MAX_CHOICES} choices in all).', param='best_of',
                     code='invalid_value')
  sampled = dict(body, max_tokens=1) if score_only else body
  structured = _structured(body, 'completion')
  if best_of is not None:  # every sample gets log-probabilities, to be ranked by them
    _, params = _sampling(dict(sampled, n=best_of), served, 'completion', prompts, 'max_tokens',
                          16, 0 if logprobs is None else logprobs, structured)
  else:
    n, params = _sampling(sampled, served, 'completion', prompts, 'max_tokens', 16, logprobs,
                          structured)
  texts = ()
  if echo:
    texts = tuple(p if isinstance(p, str) else served.tokenizer.decode(ids)
                  for p, ids in zip(prompt, prompts))
  return ParsedRequest('completion', tuple(prompts), tuple(params), n, stream, include_usage,
                       logprobs, _field(body, 'return_token_ids', (bool,), False), echo=echo,
                       prompt_texts=texts, score_only=score_only, best_of=best_of)


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
  _check_model(body, served)
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
                       tool_format=fmt)


def _tools(body, served: ServedModel) -> tuple[list | None, str | None, StructuredOutput | None]:
  """``(tools for the template, the format calls are parsed from, the grammar that forces a
  call)`` from ``tools``, ``tool_choice`` and ``parallel_tool_calls``."""
  choice = body.get('tool_choice')
  if body.get('tools') is None:
    if choice not in (None, 'none'):
      raise ApiError('tool_choice needs tools.', param='tool_choice', code='invalid_value')
    return None, None, None
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
  fmt = tool_format(served.template.source)
  if choice in ('none', 'auto'):
    return tools, None if choice == 'none' else fmt, None
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


def _object(body) -> Mapping:
  if not isinstance(body, dict):
    raise ApiError(f'The request body must be a JSON object, got {_json_type(body)}.',
                   code='invalid_type')
  return body


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


def _past_calls(calls, where: str) -> list[dict]:
  """An assistant message's ``tool_calls`` for the template: each call's ``arguments``
  (JSON text in OpenAI's API) as the object templates expect, as transformers renders them."""
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
    return {**value, 'function': {**function, 'arguments': arguments}}

  if not isinstance(calls, list):
    raise ApiError(f'{where}.tool_calls must be an array.', param=f'{where}.tool_calls',
                   code='invalid_type')
  return [call(i, value) for i, value in enumerate(calls)]


# -- streaming text -----------------------------------------------------------------------


class ChoiceStream:
  """One choice's text, tokens and log-probabilities, fed the engine's outputs in order.

  Args:
    index: the choice's index in the response.
    tokenizer: decodes tokens (the text of one token, for log-probabilities).
    params: the choice's :class:`SamplingParams`.
    eos_ids: the engine's end-of-sequence ids.
    tool_format: parse the finished reply's tool calls in this format
      (:mod:`~maxnnx.serving.tools`; the text that may become a call is held back while it
      streams), or ``None``.
  """

  def __init__(self, index: int, tokenizer, params: SamplingParams, eos_ids=(),
               tool_format: str | None = None):
    self.index = index
    self.tokenizer = tokenizer
    self.params = params
    self.stop_ids = stop_ids(params, eos_ids)
    self.text = ''                 # the text sent (streaming) or known safe so far
    self.token_ids: tuple[int, ...] = ()
    self.logprobs: list[TokenLogprobs] = []
    self.finish_reason: str | None = None
    self.num_cached_tokens = 0
    self.text_offset = 0           # completions logprobs: where the next token's text starts
    self.cumulative_logprob = 0.0  # of every generated token, a stop token included
    self.tool_format = tool_format
    self.tool_calls: list[ToolCall] = []  # parsed from the finished reply

  @property
  def finished(self) -> bool:
    """Whether the engine reported the choice finished."""
    return self.finish_reason is not None

  def update(self, out: RequestOutput) -> tuple[str, list[TokenLogprobs]]:
    """Take one output; returns ``(new text to send, new log-probabilities)``."""
    self.token_ids = out.token_ids
    self.num_cached_tokens = out.num_cached_tokens
    new_logprobs = list(out.new_logprobs or ())
    self.cumulative_logprob += sum(lp.logprob for lp in new_logprobs)
    if out.finished:
      self.finish_reason = out.finish_reason
      text = out.text or ''  # without a stop token's text (OutputProcessor)
      if out.finish_reason == 'stop' and out.token_ids and out.token_ids[-1] in self.stop_ids:
        new_logprobs = new_logprobs[:-1]  # nor are a stop token's log-probabilities part of it
      if self.tool_format is not None:
        content, self.tool_calls = parse_tool_calls(text, self.tool_format)
        if self.tool_calls:
          text = content or ''
          self.finish_reason = 'tool_calls' if out.finish_reason == 'stop' else (
              out.finish_reason)
    else:
      text = stable_text(out.text or '', self.params.stop)
      if self.tool_format is not None:
        text = text[:held_back(text, self.tool_format)]
    self.logprobs.extend(new_logprobs)
    if not text.startswith(self.text):  # a tokenizer that rewrites earlier text: send nothing
      if self.tool_calls:
        self.text = text  # the content beside the calls (stripped) is the message's
      return '', new_logprobs
    delta, self.text = text[len(self.text):], text
    return delta, new_logprobs

  def token_text(self, token_id: int) -> str:
    """One token's text."""
    return self.tokenizer.decode([token_id])

  @property
  def mean_logprob(self) -> float:
    """The mean log-probability per generated token (``best_of`` ranks choices by it; needs
    log-probabilities from the engine), ``-inf`` with no token."""
    return self.cumulative_logprob / len(self.token_ids) if self.token_ids else -math.inf


def best_choices(request: ParsedRequest, choices: Sequence[ChoiceStream]) -> list[ChoiceStream]:
  """The choices to answer, in answer order: all of them, or with ``best_of`` the ``n`` of each
  prompt's samples with the highest mean log-probability per token (the earlier sample first
  on a tie)."""
  if request.best_of is None:
    return list(choices)
  per_prompt, best = request.samples_per_prompt, []
  for start in range(0, len(choices), per_prompt):
    samples = choices[start:start + per_prompt]
    best += sorted(samples, key=lambda c: -c.mean_logprob)[:request.n]
  return best


# -- response bodies ------------------------------------------------------------------------


def new_id(kind: str) -> str:
  """A response id: ``cmpl-...`` or ``chatcmpl-...``."""
  return ('chatcmpl-' if kind == 'chat' else 'cmpl-') + uuid.uuid4().hex


def usage(request: ParsedRequest, choices: Sequence[ChoiceStream]) -> dict:
  """OpenAI's ``usage`` object of every sampled choice (each prompt counted once, whatever
  ``n``; with ``best_of`` every sample's tokens count)."""
  prompt = sum(len(p) for p in request.prompts)
  completion = sum(len(c.token_ids) for c in choices)
  cached = sum(c.num_cached_tokens for c in choices[::request.samples_per_prompt])
  return {'prompt_tokens': prompt, 'completion_tokens': completion,
          'total_tokens': prompt + completion,
          'prompt_tokens_details': {'cached_tokens': cached}}


def completion_logprobs(choice: ChoiceStream, logprobs: Sequence[TokenLogprobs]) -> dict:
  """The completions API's ``logprobs`` object for ``logprobs`` (advancing the offsets)."""
  tokens, offsets = [], []
  for lp in logprobs:
    tokens.append(choice.token_text(lp.token_id))
    offsets.append(choice.text_offset)
    choice.text_offset += len(tokens[-1])
  return {'tokens': tokens, 'token_logprobs': [lp.logprob for lp in logprobs],
          'top_logprobs': [{choice.token_text(i): p for i, p in lp.top} for lp in logprobs],
          'text_offset': offsets}


def echo_logprobs(choice: ChoiceStream, prompt: Sequence[int],
                  scores: Sequence[TokenLogprobs], text: str) -> dict:
  """The completions API's ``logprobs`` object of an echoed ``prompt`` (its ``text``): the
  first token has ``null`` log-probabilities (nothing predicts it), ``scores`` give the others
  (:meth:`~maxnnx.serving.Engine.score_prompt`). The generated tokens' offsets then start
  at the end of ``text``."""
  tokens = [choice.token_text(i) for i in prompt]
  offsets, offset = [], 0
  for token in tokens:
    offsets.append(offset)
    offset += len(token)
  choice.text_offset = len(text)
  return {'tokens': tokens, 'token_logprobs': [None] + [lp.logprob for lp in scores],
          'top_logprobs': [None] + [{choice.token_text(i): p for i, p in lp.top}
                                    for lp in scores],
          'text_offset': offsets}


def chat_logprobs(choice: ChoiceStream, logprobs: Sequence[TokenLogprobs]) -> dict:
  """The chat API's ``logprobs`` object:
  ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}``."""
  def entry(token_id, logprob):
    text = choice.token_text(token_id)
    return {'token': text, 'logprob': logprob, 'bytes': list(text.encode('utf-8'))}

  return {'content': [{**entry(lp.token_id, lp.logprob),
                       'top_logprobs': [entry(i, p) for i, p in lp.top]} for lp in logprobs]}


def _token_fields(request: ParsedRequest, choice: ChoiceStream,
                  prompt: Sequence[int]) -> dict:
  if not request.return_token_ids:
    return {}
  return {'token_ids': list(choice.token_ids), 'prompt_token_ids': list(prompt)}


def response_body(request: ParsedRequest, response_id: str, model: str,
                  choices: Sequence[ChoiceStream], *,
                  sampled: Sequence[ChoiceStream] | None = None,
                  prompt_scores: Sequence[Sequence[TokenLogprobs]] | None = None) -> dict:
  """The whole (non-streamed) response of a finished request.

  Args:
    choices: the choices answered, ``n`` per prompt in order (:func:`best_choices`).
    sampled: every choice sampled, for ``usage`` (default ``choices``).
    prompt_scores: with ``echo`` and ``logprobs``, each prompt's
      :meth:`~maxnnx.serving.Engine.score_prompt`.
  """
  created = int(time.time())
  out = []
  for index, c in enumerate(choices):
    which = index // request.n
    prompt = request.prompts[which]
    if request.kind == 'chat':
      lp = chat_logprobs(c, c.logprobs) if request.logprobs is not None else None
      message = {'role': 'assistant', 'content': c.text or None if c.tool_calls else c.text}
      if c.tool_calls:
        message['tool_calls'] = [call.as_dict() for call in c.tool_calls]
      out.append({'index': index, 'message': message,
                  'logprobs': lp, 'finish_reason': c.finish_reason,
                  **_token_fields(request, c, prompt)})
      continue
    text = c.text
    lp = None
    if request.echo:
      text = request.prompt_texts[which] + c.text
      if request.logprobs is not None:
        lp = echo_logprobs(c, prompt, prompt_scores[which], request.prompt_texts[which])
    if request.logprobs is not None:
      generated = completion_logprobs(c, c.logprobs)
      lp = generated if lp is None else {key: lp[key] + generated[key] for key in lp}
    out.append({'index': index, 'text': text, 'logprobs': lp,
                'finish_reason': c.finish_reason, **_token_fields(request, c, prompt)})
  return {'id': response_id, 'object': 'chat.completion' if request.kind == 'chat' else
          'text_completion', 'created': created, 'model': model, 'choices': out,
          'usage': usage(request, choices if sampled is None else sampled)}


def chunk(request: ParsedRequest, response_id: str, model: str, choice: ChoiceStream | None,
          text: str = '', logprobs: Sequence[TokenLogprobs] = (), *, first: bool = False,
          usage_of: Sequence[ChoiceStream] | None = None) -> dict:
  """One streamed chunk: ``choice``'s new ``text`` (and its finish reason once finished),
  or, with ``usage_of``, the closing chunk with no choices and the token counts."""
  kind = 'chat.completion.chunk' if request.kind == 'chat' else 'text_completion'
  body = {'id': response_id, 'object': kind, 'created': int(time.time()), 'model': model}
  if usage_of is not None:
    return {**body, 'choices': [], 'usage': usage(request, usage_of)}
  finish = choice.finish_reason
  extra = (_token_fields(request, choice, request.prompt_of(choice.index))
           if finish is not None else {})
  if request.kind == 'chat':
    delta = {'role': 'assistant', 'content': text} if first else (
        {'content': text} if text or finish is None else {})
    if finish is not None and choice.tool_calls:
      delta['tool_calls'] = [{'index': k, **call.as_dict()}
                             for k, call in enumerate(choice.tool_calls)]
    lp = chat_logprobs(choice, logprobs) if request.logprobs is not None and logprobs else None
    entry = {'index': choice.index, 'delta': delta, 'logprobs': lp, 'finish_reason': finish}
  else:
    lp = (completion_logprobs(choice, logprobs) if request.logprobs is not None and logprobs
          else None)
    entry = {'index': choice.index, 'text': text, 'logprobs': lp, 'finish_reason': finish}
  return {**body, 'choices': [{**entry, **extra}]}

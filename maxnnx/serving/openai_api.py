"""The OpenAI HTTP API's requests: validation, prompts as token ids, sampling parameters.

Nothing here runs a model or opens a socket. :func:`parse_completion` and
:func:`~maxnnx.serving.openai_chat.parse_chat` (messages, tools and images, in
:mod:`~maxnnx.serving.openai_chat`) turn a request body into a :class:`ParsedRequest`
(prompts as token ids, one :class:`~maxnnx.serving.SamplingParams` per choice) or raise an
:class:`ApiError` whose :meth:`~ApiError.body` is OpenAI's error object. The answers are
:mod:`~maxnnx.serving.openai_responses`': :class:`~maxnnx.serving.openai_responses.ChoiceStream`
follows one choice's engine outputs and says which new text is safe to send (never text a
stop string could still take back, never half a UTF-8 character), and the ``*_body`` and
``*_chunk`` functions build the JSON of a whole response and of a streamed chunk.

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
is held back and each call comes in ``delta.tool_calls`` as OpenAI sends it: its header, then
its arguments piece by piece as they become certain). ``tool_choice``
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
from collections.abc import Mapping, Sequence
from typing import Any

from maxnnx.data.chat import ChatTemplate
from maxnnx.inference.sampling import MAX_LOGIT_BIAS, MAX_PENALTY
from maxnnx.inference.structured import StructuredOutput
from maxnnx.serving.params import MAX_SEED, SamplingParams

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
    lora_names: the LoRA adapters served beside the base model; a request names one as its
      ``model``.
    reasoning_parser: how chat replies' reasoning is split off
      (:mod:`~maxnnx.serving.reasoning`), or ``None``.
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
  lora_names: tuple[str, ...] = ()
  reasoning_parser: str | None = None

  @property
  def model_names(self) -> tuple[str, ...]:
    """Every name a request may send as ``model``: the base model's, then the adapters'."""
    return (self.name, *self.lora_names)


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
      (:mod:`~maxnnx.serving.tools`), or ``None`` (no tools, or ``tool_choice`` ``none``;
      a harmony template's replies are always read as ``harmony``, for their channels).
    read_calls: whether tool calls are read from the replies; ``False`` where the format is
      only read for its channels (a harmony reply without tools or with ``tool_choice``
      ``none``: a call message the model writes anyway is dropped, not answered).
    lora: the LoRA adapter the request's ``model`` names, or ``None`` (the base model).
    reasoning_parser: how each chat reply's reasoning is split off, or ``None``.
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
  read_calls: bool = True
  lora: str | None = None
  reasoning_parser: str | None = None

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


def _check_model(body, served: ServedModel) -> str | None:
  """The LoRA adapter ``model`` names (``None``: the base model); a 404 for another name."""
  model = _field(body, 'model', (str,), '')
  if not model:
    raise ApiError('model is required.', param='model', code='missing_required_parameter')
  if model not in served.model_names:
    raise ApiError(f'The model {model!r} does not exist; this server serves '
                   f"{', '.join(repr(n) for n in served.model_names)}.", status=404,
                   type='not_found_error', param='model', code='model_not_found')
  return None if model == served.name else model


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
    ApiError: (404) for an unknown model; (400) for a field of the wrong type or out of
      range, a prompt that leaves no room under the context, or a field this
      server cannot honour.
  """
  body = _object(body)
  lora = _check_model(body, served)
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
                       prompt_texts=texts, score_only=score_only, best_of=best_of, lora=lora)


def _object(body) -> Mapping:
  if not isinstance(body, dict):
    raise ApiError(f'The request body must be a JSON object, got {_json_type(body)}.',
                   code='invalid_type')
  return body

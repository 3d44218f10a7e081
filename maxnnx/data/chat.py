"""Chat templates: load, render in a sandbox, and encode with assistant-only loss masks.

A checkpoint's chat template is a Jinja template stored either as
``chat_template.jinja`` (written by recent ``transformers``) or as the
``chat_template`` field of ``tokenizer_config.json`` (a string, or a list of
``{"name", "template"}`` entries, of which ``default`` is used). Checkpoints
without one can use a built-in template by name (:data:`BUILTIN_TEMPLATES`: ChatML,
Llama 3, Gemma); each model family says which one is its own
(``FamilySpec.chat_template``), so this module never names a family.

Templates are untrusted code: they are rendered in Jinja's
``ImmutableSandboxedEnvironment`` (no attribute access to internals such as
``__class__``, no mutation of the messages), with the globals ``transformers``
provides (``raise_exception``, ``strftime_now``, a ``tojson`` filter) and the
``{% generation %}`` block tag.

Assistant-only loss masks (:func:`encode_chat`)
-----------------------------------------------
The loss mask is 1 on the tokens of the assistant turns' content plus the
end-of-turn token that closes each of them (what TRL's ``assistant_only_loss``
trains on), 0 elsewhere. Two ways to find those tokens:

* **generation markers**: when the template wraps assistant output in
  ``{% generation %}...{% endgeneration %}``, exactly the marked text is trained on.
* **incremental rendering** (every other template): for the ``i``-th message,
  an assistant turn, the conversation is rendered up to message ``i - 1`` with
  ``add_generation_prompt=True`` (the prompt a model sees before it answers)
  and up to message ``i``; the difference is the turn's text, and it is trained
  on without its trailing whitespace (the ``"\\n"`` after ChatML's
  ``<|im_end|>`` or Gemma's ``<end_of_turn>`` is not part of the answer).

The text is then tokenized piece by piece: the boundaries between trained and
untrained text, and every special-token string of the tokenizer (e.g.
``<|im_start|>``), are cut points; special tokens become their single id, the
text between them goes through ``tokenizer.encode``. This is how the model sees
the text at inference (the prompt is tokenized, the answer is generated token
by token after it), though it can differ from tokenizing the whole string at
once where a merge would cross a cut point.

Limits: incremental rendering needs every rendered prefix to be a prefix of the
next one. Templates that render an earlier assistant turn differently once
later turns follow (e.g. dropping its reasoning) break that; :func:`encode_chat`
then raises and such templates need generation markers. Message contents are
not escaped: a special-token string inside a message becomes that special token,
as it does in ``transformers``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

# Separators the {% generation %} tag writes around its output; stripped after rendering.
_GEN_START, _GEN_END = '\x00<generation>\x00', '\x00</generation>\x00'
_GENERATION_TAG = re.compile(r'{%-?\s*generation\s*-?%}')

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")

# Gemma's turns; a message's content may also be a list of {"type": "text", "text": ...}
# and {"type": "image"} parts (Gemma 3), an image becoming <start_of_image>.
GEMMA_TEMPLATE = (
    "{%- macro body(content) %}"
    "{%- if content is string %}{{- content | trim }}"
    "{%- else %}{%- for part in content %}"
    "{%- if part['type'] == 'image' %}{{- '<start_of_image>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
    "{{- bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = body(messages[0]['content']) + '\\n\\n' %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Gemma conversations alternate user/assistant/user/...') }}"
    "{%- endif %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (system if loop.first else '')"
    " + body(message['content']) + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")

BUILTIN_TEMPLATES = {'chatml': CHATML_TEMPLATE, 'llama3': LLAMA3_TEMPLATE,
                     'gemma': GEMMA_TEMPLATE}
"""Fallback templates by name: ``chatml`` (Qwen and others), ``llama3``, ``gemma``."""

def builtin_template(name: str) -> str:
  """The built-in template called ``name`` (``'chatml'``, ``'llama3'``, ``'gemma'``)."""
  if name.lower() not in BUILTIN_TEMPLATES:
    raise ValueError(f'No built-in chat template {name!r}; the built-in ones are '
                     f'{sorted(BUILTIN_TEMPLATES)}.')
  return BUILTIN_TEMPLATES[name.lower()]


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A chat template and the special-token strings it is rendered with.

  Attributes:
    source: the Jinja template text.
    bos_token, eos_token: the ``bos_token`` / ``eos_token`` template variables
      (``''`` when unknown).
    origin: where the template came from (a file, or ``builtin:<name>``).
  """

  source: str
  bos_token: str = ''
  eos_token: str = ''
  origin: str = ''

  @property
  def has_generation_markers(self) -> bool:
    """Whether the template marks assistant output with ``{% generation %}``."""
    return bool(_GENERATION_TAG.search(self.source))

  def render(self, messages: Sequence[Mapping[str, Any]], *,
             add_generation_prompt: bool = False, **kwargs) -> str:
    """The conversation as text (what the model reads), rendered in the sandbox.

    ``kwargs`` are further template variables (``tools=``, ``documents=``, ...).
    """
    text = self._render(messages, add_generation_prompt, kwargs)
    return text.replace(_GEN_START, '').replace(_GEN_END, '')

  def _render(self, messages, add_generation_prompt: bool, kwargs) -> str:
    variables = {'bos_token': self.bos_token, 'eos_token': self.eos_token, **kwargs}
    return _compile(self.source, self.origin).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)

  def _render_for_training(self, messages, add_generation_prompt: bool, kwargs) -> str:
    """:meth:`_render`, a failure of the template (its ``raise_exception``, or an operation
    the record's values do not support) becoming one ``ValueError`` naming the template and
    its line."""
    import jinja2  # noqa: PLC0415
    try:
      return self._render(messages, add_generation_prompt, kwargs)
    except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError) as e:
      line = _template_line(e.__traceback__)
      where = (self.origin or 'the chat template') + (f' line {line}' if line else '')
      raise ValueError(f'{where}: rendering failed ({type(e).__name__}: {e}).') from None

  def check(self) -> ChatTemplate:
    """The template itself, after compiling it: a syntax error is a ``ValueError`` naming
    :attr:`origin` and the template's line."""
    _compile(self.source, self.origin)
    return self


def load_chat_template(path: str, *, builtin: str | None = None, name: str = 'default'
                       ) -> ChatTemplate:
  """The chat template of a checkpoint or tokenizer directory.

  Looks for ``chat_template.jinja``, then ``tokenizer_config.json``'s
  ``chat_template`` (a string, or a list of named templates of which ``name``
  is taken). Without either, the built-in template ``builtin`` is taken
  (:func:`builtin_template`); without ``builtin`` that is an error.
  ``bos_token`` / ``eos_token`` come from ``tokenizer_config.json`` (or
  ``special_tokens_map.json``) beside it.

  Args:
    path: a directory, or a file in it (e.g. its ``tokenizer.json``).
    builtin: the built-in template to fall back on (a family's
      ``FamilySpec.chat_template``).
    name: which of several named templates to take.
  """
  directory = path if os.path.isdir(path) else os.path.dirname(path) or '.'
  config = _read_json(os.path.join(directory, 'tokenizer_config.json'))
  tokens = _read_json(os.path.join(directory, 'special_tokens_map.json'))
  tokens.update({k: v for k, v in config.items() if k in ('bos_token', 'eos_token')})
  bos, eos = _token_string(tokens.get('bos_token')), _token_string(tokens.get('eos_token'))
  jinja_file = os.path.join(directory, 'chat_template.jinja')
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding='utf-8') as f:
      return ChatTemplate(f.read(), bos, eos, jinja_file)
  template = config.get('chat_template')
  origin = os.path.join(directory, 'tokenizer_config.json')
  if isinstance(template, list):
    named = {t.get('name'): t.get('template') for t in template if isinstance(t, dict)}
    if name not in named:
      raise ValueError(f"{origin}: no chat template named {name!r}; it has {sorted(named)}.")
    template = named[name]
  if isinstance(template, str):
    return ChatTemplate(template, bos, eos, origin)
  if template is not None:
    raise ValueError(f'{origin}: chat_template is a {type(template).__name__}, expected a '
                     'string or a list of {"name", "template"} objects.')
  if builtin is None:
    raise FileNotFoundError(f'{directory}: no chat_template.jinja and no chat_template in '
                            'tokenizer_config.json; pass builtin= to use a built-in template '
                            f'({", ".join(sorted(BUILTIN_TEMPLATES))}).')
  return ChatTemplate(builtin_template(builtin), bos, eos, f'builtin:{builtin}')


def template_for(tokenizer, template: ChatTemplate | str) -> ChatTemplate:
  """``template`` as a :class:`ChatTemplate`, a string being a built-in name or Jinja text.

  A template without ``bos_token`` / ``eos_token`` gets them from the tokenizer's ids. The
  template is compiled here, so a syntax error shows before any record is read
  (:meth:`ChatTemplate.check`).
  """
  if isinstance(template, str):
    source = (template if '{' in template else builtin_template(template))
    origin = 'inline' if '{' in template else f'builtin:{template}'
    template = ChatTemplate(source, origin=origin)
  fill = {}
  for field, attr in (('bos_token', 'bos_id'), ('eos_token', 'eos_id')):
    token_id = getattr(tokenizer, attr, None)
    if not getattr(template, field) and token_id is not None:
      fill[field] = special_tokens_by_id(tokenizer).get(token_id) or ''
  return (dataclasses.replace(template, **fill) if fill else template).check()


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding='utf-8') as f:
    data = json.load(f)
  return data if isinstance(data, dict) else {}


def _token_string(value) -> str:
  if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
    value = value.get('content')
  return value if isinstance(value, str) else ''


# --- the sandbox ---------------------------------------------------------------

_COMPILED: dict[str, Any] = {}


def _compile(source: str, origin: str = ''):
  """The template compiled in the sandbox (cached by source); a syntax error is a
  ``ValueError`` naming ``origin`` and the line."""
  import jinja2  # noqa: PLC0415
  if source not in _COMPILED:
    try:
      _COMPILED[source] = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f'{origin or "the chat template"} line {e.lineno}: syntax error in the '
                       f'chat template: {e.message}.') from None
  return _COMPILED[source]


def _template_line(traceback) -> int | None:
  """The template line a rendering error was raised at (Jinja's frames of the template
  carry the template's line numbers), if any."""
  line = None
  while traceback is not None:
    if traceback.tb_frame.f_code.co_filename == '<template>':
      line = traceback.tb_lineno
    traceback = traceback.tb_next
  return line


def _environment():
  import jinja2
  from jinja2 import nodes
  from jinja2.ext import Extension, loopcontrols
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: marks text the model is trained on."""

    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
      return nodes.CallBlock(self.call_method('_mark'), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
      return _GEN_START + caller() + _GEN_END

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[GenerationTag, loopcontrols])
  env.filters['tojson'] = tojson
  env.globals['raise_exception'] = raise_exception
  env.globals['strftime_now'] = strftime_now
  return env


# --- special tokens ------------------------------------------------------------


def special_tokens(tokenizer) -> dict[str, int]:
  """``{string: id}`` of the tokens a rendered template may spell out as one token.

  Hugging Face tokenizers: the added tokens; tiktoken: its special tokens;
  sentencepiece: control and user-defined pieces. Other tokenizers may expose
  a ``special_tokens`` mapping.
  """
  return dict(_specials(tokenizer)[0])


def _specials(tokenizer) -> tuple[dict[str, int], re.Pattern | None]:
  """The special tokens and a regex splitting text at them (cached per tokenizer)."""
  try:
    return _SPECIALS[tokenizer]
  except (KeyError, TypeError):
    pass
  found: dict[str, int] = {}
  backend = getattr(tokenizer, 'backend', None)
  processor = getattr(tokenizer, 'processor', None)
  if backend is not None and hasattr(backend, 'get_added_tokens_decoder'):
    found = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
  elif processor is not None and hasattr(processor, 'serialized_model_proto'):
    found = _sentencepiece_specials(processor)
  elif isinstance(getattr(tokenizer, 'special_tokens', None), Mapping):
    found = dict(tokenizer.special_tokens)
  pattern = None
  if found:
    alternatives = '|'.join(re.escape(t) for t in sorted(found, key=len, reverse=True))
    pattern = re.compile(f'({alternatives})')
  try:
    _SPECIALS[tokenizer] = (found, pattern)
  except TypeError:  # not weakly referenceable: computed again next time
    pass
  return found, pattern


_SPECIALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sentencepiece_specials(processor) -> dict[str, int]:
  """Control and user-defined pieces of a sentencepiece model (whitespace-only ones left
  out), read from its model proto: the Python API tells control pieces only."""
  from sentencepiece import sentencepiece_model_pb2  # noqa: PLC0415
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(processor.serialized_model_proto())
  kinds = (proto.SentencePiece.CONTROL, proto.SentencePiece.USER_DEFINED)
  return {piece.piece: i for i, piece in enumerate(proto.pieces)
          if piece.type in kinds and piece.piece.strip()}


def special_tokens_by_id(tokenizer) -> dict[int, str]:
  """``{id: string}``, the inverse of :func:`special_tokens`."""
  return {i: s for s, i in _specials(tokenizer)[0].items()}


def encode_with_specials(tokenizer, text: str) -> list[int]:
  """``text`` as ids, special-token strings (:func:`special_tokens`) becoming their id."""
  specials, pattern = _specials(tokenizer)
  if pattern is None:
    return list(tokenizer.encode(text)) if text else []
  ids: list[int] = []
  for part in pattern.split(text):
    if part:
      ids.extend([specials[part]] if part in specials else tokenizer.encode(part))
  return ids


# --- records: messages, ShareGPT conversations ---------------------------------

SHAREGPT_ROLES = {'human': 'user', 'user': 'user', 'gpt': 'assistant', 'assistant': 'assistant',
                  'system': 'system', 'tool': 'tool'}
"""ShareGPT's ``"from"`` values and the chat roles they become."""


def sharegpt_messages(conversations, field: str = 'conversations') -> list[dict]:
  """ShareGPT's ``[{"from": "human" | "gpt" | "system", "value": ...}, ...]`` as chat
  messages (``human`` -> ``user``, ``gpt`` -> ``assistant``, :data:`SHAREGPT_ROLES`).
  Entries already in ``{"role", "content"}`` form are kept; anything else is a
  ``ValueError`` naming the entry (``field[i]``)."""
  if not isinstance(conversations, list):
    raise ValueError(f'"{field}" must be a list of {{"from", "value"}} objects, got '
                     f'{type(conversations).__name__}.')
  messages = []
  for i, turn in enumerate(conversations):
    if isinstance(turn, dict) and 'role' in turn and 'from' not in turn:
      messages.append(turn)
      continue
    if not (isinstance(turn, dict) and 'from' in turn and 'value' in turn):
      keys = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
      raise ValueError(f'"{field}"[{i}] must be a {{"from", "value"}} object, got {keys}.')
    role = SHAREGPT_ROLES.get(turn['from'])
    if role is None:
      raise ValueError(f'"{field}"[{i}]: "from": {json.dumps(turn["from"])} is not a ShareGPT '
                       f'role; use one of {", ".join(SHAREGPT_ROLES)}.')
    extra = {k: v for k, v in turn.items() if k not in ('from', 'value')}
    messages.append({**extra, 'role': role, 'content': turn['value']})
  return messages


def check_messages(messages, field: str = 'messages') -> None:
  """Refuse a message list a template could not render as meant: a ``ValueError`` naming
  the message (``field[i]``) unless every message is an object with a string ``role`` and a
  ``content`` that is a string, a list of part objects, or null (missing)."""
  if not isinstance(messages, list):
    raise ValueError(f'"{field}" must be a list of {{"role", "content"}} objects, got '
                     f'{type(messages).__name__}.')
  for i, message in enumerate(messages):
    if not isinstance(message, dict):
      raise ValueError(f'"{field}"[{i}] must be a {{"role", "content"}} object, got '
                       f'{type(message).__name__}.')
    if not isinstance(message.get('role'), str):
      raise ValueError(f'"{field}"[{i}] needs a string "role", got '
                       f'{json.dumps(message.get("role"))}.')
    content = message.get('content')
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
      continue
    if content is not None and not isinstance(content, str):
      raise ValueError(f'"{field}"[{i}].content is {_describe(content)}; expected a string, a '
                       'list of {"type": ...} parts, or null.')


def _describe(value) -> str:
  name, text = type(value).__name__, json.dumps(value, default=repr)
  article = 'an' if name[0] in 'aeiou' else 'a'
  return f'{article} {name} ({text[:40]}{"..." if len(text) > 40 else ""})'


# --- encoding with loss masks --------------------------------------------------


def chat_pieces(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], *,
                train_from: int = 0, **kwargs) -> list[tuple[str, bool]]:
  """The rendered conversation as ``(text, trained)`` pieces (see the module docstring).

  Assistant turns at index ``>= train_from`` are trained on; the pieces join to
  ``template.render(messages)``.
  """
  if template.has_generation_markers:
    return _marked_pieces(template, messages, train_from, kwargs)
  pieces: list[tuple[str, bool]] = []
  done = ''
  for i, message in enumerate(messages):
    if message.get('role') != 'assistant' or i < train_from:
      continue
    prompt = template._render_for_training(messages[:i], True, kwargs)
    full = template._render_for_training(messages[:i + 1], False, kwargs)
    if not (prompt.startswith(done) and full.startswith(prompt)):
      raise ValueError(
          f'{template.origin or "the chat template"}: rendering the conversation up to '
          f'message {i} does not extend the rendering of the messages before it, so the '
          'assistant turns cannot be located by incremental rendering. Use a template that '
          'marks them with {% generation %}...{% endgeneration %}.')
    answer = full[len(prompt):]
    kept = answer.rstrip()
    pieces += [(prompt[len(done):], False), (kept, True)]
    done = prompt + kept
  whole = template._render_for_training(messages, False, kwargs)
  if not whole.startswith(done):
    raise ValueError(f'{template.origin or "the chat template"}: the whole conversation does '
                     'not extend its rendered prefixes; use generation markers.')
  pieces.append((whole[len(done):], False))
  return [(t, m) for t, m in pieces if t]


def _marked_pieces(template, messages, train_from, kwargs) -> list[tuple[str, bool]]:
  skip = ''
  if train_from:  # text of the prompt turns is not trained on, even inside markers
    skip = template._render_for_training(messages[:train_from], False, kwargs)
    skip = skip.replace(_GEN_START, '').replace(_GEN_END, '')
  text = template._render_for_training(messages, False, kwargs)
  pieces, trained, position = [], False, 0
  for part in re.split(f'({re.escape(_GEN_START)}|{re.escape(_GEN_END)})', text):
    if part in (_GEN_START, _GEN_END):
      trained = part == _GEN_START
      continue
    if not part:
      continue
    cut = max(0, min(len(part), len(skip) - position))
    pieces += [(part[:cut], False), (part[cut:], trained)]
    position += len(part)
  return [(t, m) for t, m in pieces if t]


def _encode_pieces(tokenizer, pieces) -> tuple[list[int], list[int]]:
  ids, mask = [], []
  for text, trained in pieces:
    piece_ids = encode_with_specials(tokenizer, text)
    ids += piece_ids
    mask += [int(trained)] * len(piece_ids)
  return ids, mask


def encode_chat(tokenizer, template: ChatTemplate | str, messages: Sequence[Mapping[str, Any]],
                **kwargs) -> tuple[list[int], list[int]]:
  """A conversation as token ids and a per-token assistant-only loss mask.

  Args:
    tokenizer: a :class:`~maxnnx.data.tokenizer.Tokenizer`.
    template: a :class:`ChatTemplate`, a built-in name (``'chatml'``, ``'llama3'``,
      ``'gemma'``) or Jinja text.
    messages: ``[{"role": ..., "content": ...}, ...]``.
    kwargs: further template variables.

  Returns:
    ``(ids, loss_mask)`` of equal length; ``loss_mask[k]`` is 1 when token ``k``
    belongs to an assistant turn's content or the end-of-turn token closing it.
    The template adds BOS (if it does); nothing else is added.
  """
  check_messages(messages)
  template = template_for(tokenizer, template)
  return _encode_pieces(tokenizer, chat_pieces(template, messages, **kwargs))


def encode_prompt_completion(tokenizer, prompt, completion, *,
                             template: ChatTemplate | str | None = None, add_bos: bool = True,
                             add_eos: bool = True, **kwargs) -> tuple[list[int], list[int]]:
  """A ``{"prompt", "completion"}`` record as ids and a completion-only loss mask.

  * ``prompt`` text: ``[BOS] prompt completion [EOS]`` without a template (BOS/EOS
    when ``add_bos`` / ``add_eos`` and the tokenizer has them); the loss covers
    the completion and EOS.
  * ``prompt`` a message list: the conversation ``prompt + completion`` (a message
    list, or text as one assistant message) is rendered with ``template``; the
    loss covers the completion's assistant turns as in :func:`encode_chat`.
  """
  if isinstance(prompt, str):
    if not isinstance(completion, str):
      raise ValueError('A text prompt needs a text completion, got '
                       f'{type(completion).__name__}.')
    bos = getattr(tokenizer, 'bos_id', None) if add_bos else None
    eos = getattr(tokenizer, 'eos_id', None) if add_eos else None
    prompt_ids = ([bos] if bos is not None else []) + list(tokenizer.encode(prompt))
    completion_ids = list(tokenizer.encode(completion)) + ([eos] if eos is not None else [])
    return (prompt_ids + completion_ids,
            [0] * len(prompt_ids) + [1] * len(completion_ids))
  check_messages(prompt, 'prompt')
  if template is None:
    raise ValueError('A conversational prompt (a message list) needs a chat template.')
  if isinstance(completion, str):
    completion = [{'role': 'assistant', 'content': completion}]
  check_messages(completion, 'completion')
  messages = list(prompt) + list(completion)
  template = template_for(tokenizer, template)
  return _encode_pieces(tokenizer, chat_pieces(template, messages, train_from=len(prompt),
                                               **kwargs))

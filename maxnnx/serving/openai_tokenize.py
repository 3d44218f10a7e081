"""The tokenizer endpoints vLLM serves beside the OpenAI API: ``/tokenize``, ``/detokenize`` and
``/tokenizer_info``.

Clients that count or build prompts in token ids use them instead of loading the model's
tokenizer themselves; lm-evaluation-harness' ``local-completions`` model with
``tokenizer_backend=remote`` needs exactly these three (so ``lm_eval`` runs against ``maxnnx
serve`` with neither transformers nor the checkpoint on the client's side).

* ``POST /tokenize`` takes ``{"model", "prompt", "add_special_tokens"}`` (the BOS id first when
  ``add_special_tokens``, the default, and the server adds one to text prompts) or
  ``{"model", "messages", "add_generation_prompt"}`` (rendered with the chat template, as
  ``/v1/chat/completions`` renders them), and answers ``{"count", "max_model_len", "tokens"}``
  (and ``"token_strs"`` with ``"return_token_strs": true``). Special-token strings in the text
  become their ids, as in Hugging Face tokenizers.
* ``POST /detokenize`` takes ``{"model", "tokens"}`` and answers ``{"prompt"}``.
* ``GET /tokenizer_info`` answers the special tokens as strings, the chat template and the
  context length.

``model`` is optional here (vLLM's clients often leave it out), but a wrong name is refused.
"""

from __future__ import annotations

from typing import Any

from maxnnx.data.chat import encode_with_specials, special_tokens_by_id
from maxnnx.serving.openai_api import ApiError, ServedModel, _field, _object, _token_ids

_SPECIAL_NAMES = (('bos_token', 'bos_id'), ('eos_token', 'eos_id'), ('pad_token', 'pad_id'))


def _check_optional_model(body, served: ServedModel) -> None:
  model = _field(body, 'model', (str,), '')
  if model and model not in served.model_names:
    raise ApiError(f'The model {model!r} does not exist; this server serves '
                   f"{', '.join(repr(n) for n in served.model_names)}.",
                   status=404, param='model', code='model_not_found')


def tokenize(body: Any, served: ServedModel) -> dict:
  """The answer of ``POST /tokenize`` for JSON ``body``.

  Raises:
    ApiError: (400) for a body with neither or both of ``prompt`` and ``messages``, a
      prompt that is not a string, or messages the chat template refuses.
  """
  body = _object(body)
  _check_optional_model(body, served)
  has_prompt, has_messages = 'prompt' in body, 'messages' in body
  if has_prompt == has_messages:
    raise ApiError('Give either prompt (a string) or messages (a chat), not both or neither.',
                   param='prompt', code='invalid_value')
  if has_prompt:
    prompt = body['prompt']
    if not isinstance(prompt, str):
      raise ApiError('prompt must be a string.', param='prompt', code='invalid_type')
    ids = encode_with_specials(served.tokenizer, prompt)
    bos = served.tokenizer.bos_id
    if _field(body, 'add_special_tokens', (bool,), True) and served.add_bos and bos is not None:
      ids = [bos, *ids]
  else:
    ids = _encode_messages(body, served)
  out = {'count': len(ids), 'max_model_len': served.max_model_len, 'tokens': [int(i) for i in ids]}
  if _field(body, 'return_token_strs', (bool,), False):
    out['token_strs'] = [served.tokenizer.decode([i]) for i in ids]
  return out


def _encode_messages(body, served: ServedModel) -> list[int]:
  if served.template is None:
    raise ApiError('This model has no chat template; tokenize a prompt instead.',
                   param='messages', code='no_chat_template')
  messages = body['messages']
  if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
    raise ApiError('messages must be a list of {"role", "content"} objects.', param='messages',
                   code='invalid_type')
  try:
    text = served.template.render(
        messages, add_generation_prompt=_field(body, 'add_generation_prompt', (bool,), True))
  except Exception as e:  # the template's own raise_exception, or a template bug
    raise ApiError(f'The chat template refused the messages: {e}', param='messages',
                   code='invalid_value') from None
  return encode_with_specials(served.tokenizer, text)


def detokenize(body: Any, served: ServedModel) -> dict:
  """The answer of ``POST /detokenize`` for JSON ``body``.

  Raises:
    ApiError: (400) for ``tokens`` that are not a non-empty list of ids in the vocabulary.
  """
  body = _object(body)
  _check_optional_model(body, served)
  ids = _token_ids(body.get('tokens'), served, 'tokens')
  return {'prompt': served.tokenizer.decode(list(ids))}


def tokenizer_info(served: ServedModel) -> dict:
  """The answer of ``GET /tokenizer_info``: special tokens as strings, chat template, lengths."""
  tokenizer = served.tokenizer
  by_id = special_tokens_by_id(tokenizer)
  info: dict[str, Any] = {'tokenizer_class': type(tokenizer).__name__,
                          'model_max_length': served.max_model_len,
                          'vocab_size': served.vocab_size}
  for name, attribute in _SPECIAL_NAMES:
    token_id = getattr(tokenizer, attribute, None)
    info[name] = None if token_id is None else by_id.get(token_id, tokenizer.decode([token_id]))
  info['chat_template'] = None if served.template is None else served.template.source
  return info

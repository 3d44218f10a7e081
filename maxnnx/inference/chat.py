"""``chat``: answer conversations with a model and its chat template.

::

  tokenizer = maxnnx.data.load_tokenizer('runs/sft/final')
  replies = chat(model, tokenizer, [[{'role': 'user', 'content': 'Who art thou?'}]])

Each conversation is rendered with the template and its generation prompt
(``add_generation_prompt=True``), its special-token strings encoded as their ids,
and continued by :func:`~maxnnx.inference.generate` until an end-of-turn token
(:func:`~maxnnx.inference.stops.eos_token_ids`) or ``max_new_tokens``. The reply is decoded without
that token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from maxnnx.data.chat import ChatTemplate, encode_with_specials
from maxnnx.data.sft import resolve_tokenizer_and_template
from maxnnx.inference.generate import generate
from maxnnx.inference.stops import eos_token_ids

Conversation = Sequence[Mapping[str, Any]]


def chat(model, tokenizer, conversations: Sequence[Conversation],
         template: ChatTemplate | str | None = None, *, max_new_tokens: int = 64,
         temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
         seed: int = 0, batch_size: int = 32) -> list[str]:
  """The model's reply to each conversation (a list of ``{"role", "content"}`` messages).

  Args:
    model: a :class:`~maxnnx.Transformer`.
    tokenizer: its tokenizer (a :class:`~maxnnx.data.Tokenizer` or a path).
    conversations: the conversations to answer.
    template: a :class:`~maxnnx.data.ChatTemplate`, a built-in name or Jinja text;
      default the template stored beside the tokenizer.
    max_new_tokens, temperature, top_k, top_p, seed: as for :func:`generate`
      (greedy by default).
    batch_size: conversations generated together.
  """
  tokenizer, template = resolve_tokenizer_and_template(tokenizer, template)
  if template is None:
    raise ValueError('chat needs a chat template: the tokenizer directory has none; pass '
                     'template= (a built-in name such as "chatml", or Jinja text).')
  prompts = [encode_with_specials(tokenizer, template.render(c, add_generation_prompt=True))
             for c in conversations]
  stops = eos_token_ids(model.config, tokenizer, end_of_turn=True)
  replies = []
  for start in range(0, len(prompts), batch_size):
    result = generate(model, prompts[start:start + batch_size], max_new_tokens,
                      temperature=temperature, top_k=top_k, top_p=top_p, eos_ids=stops,
                      pad_id=tokenizer.pad_id or 0, seed=seed + start)
    for ids in result.as_lists():
      replies.append(tokenizer.decode([i for i in ids if i not in stops]))
  return replies


__all__ = ['chat']

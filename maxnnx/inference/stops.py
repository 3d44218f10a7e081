"""Which token ids end a generation: decided here, once, for ``generate``, ``chat``, the
serving engine, the chat server and RL rollouts.

A completion ends at the model's ``eos_token_id`` (one id or several, from its config) and
at the tokenizer's end-of-document id. A chat reply or an RL completion also ends at the
tokens that close an assistant turn (:data:`END_OF_TURN`, those the tokenizer has).
"""

from __future__ import annotations

import numpy as np

from maxnnx.data.chat import special_tokens

#: Tokens that close an assistant turn in the common templates (ChatML, Llama 3, Gemma, Phi).
END_OF_TURN = ('<|im_end|>', '<|eot_id|>', '<end_of_turn>', '<|end|>', '<|endoftext|>')

#: Harmony's (GPT-OSS) turn ends: ``<|end|>`` there closes one message of a turn (the
#: reasoning before the answer), so a vocabulary with ``<|channel|>`` and ``<|call|>`` ends
#: its turns at these instead.
HARMONY_END_OF_TURN = ('<|return|>', '<|call|>', '<|endoftext|>')


def eos_token_ids(config=None, tokenizer=None, *, end_of_turn: bool = False) -> tuple[int, ...]:
  """The ids that end a generation, sorted.

  Args:
    config: a :class:`~maxnnx.config.ModelConfig` (or ``None``): its ``eos_token_id``.
    tokenizer: a tokenizer (or ``None``): its ``eos_id``, and with ``end_of_turn`` every
      :data:`END_OF_TURN` token it has (:data:`HARMONY_END_OF_TURN` in a harmony vocabulary).
    end_of_turn: also the tokens that close an assistant turn (chat replies, RL rollouts).
  """
  ids = set()
  if config is not None and config.eos_token_id is not None:
    ids.update(int(i) for i in np.atleast_1d(config.eos_token_id))
  if tokenizer is not None:
    if getattr(tokenizer, 'eos_id', None) is not None:
      ids.add(int(tokenizer.eos_id))
    if end_of_turn:
      specials = special_tokens(tokenizer)
      harmony = '<|channel|>' in specials and '<|call|>' in specials
      ids.update(specials[token] for token in (HARMONY_END_OF_TURN if harmony else END_OF_TURN)
                 if token in specials)
  return tuple(sorted(ids))


def end_of_turn_ids(tokenizer) -> list[int]:
  """The tokenizer's end-of-document id and every :data:`END_OF_TURN` token it has."""
  return list(eos_token_ids(tokenizer=tokenizer, end_of_turn=True))


__all__ = ['END_OF_TURN', 'HARMONY_END_OF_TURN', 'end_of_turn_ids', 'eos_token_ids']

"""The prompts of an RL run: records, tokenized, in an order a checkpoint restores.

A record holds a ``prompt`` (text, or a list of chat messages rendered with the
chat template and its generation prompt) and any other columns, which reward
functions receive as keyword arguments. A chat record ``{"messages": [...]}``
whose last turn is the assistant's is read as its earlier turns for the
prompt and that reply as the column ``answer`` (so the shipped SFT task files
serve as RL prompt files too)::

  {"prompt": "2 + 3 =", "answer": "5"}
  {"prompt": [{"role": "user", "content": "Who says ...?"}], "answer": "ROMEO"}
  {"messages": [{"role": "user", "content": "Who says ...?"},
                {"role": "assistant", "content": "ROMEO"}]}
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from maxnnx.data.chat import ChatTemplate, encode_with_specials, template_for


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One prompt: as the record gave it (``value``), its token ids and its other columns."""

  value: Any
  ids: list[int]
  columns: dict[str, Any]


def _read(path: str) -> list[dict]:
  from maxnnx.data.sft import RecordSource  # noqa: PLC0415
  if not os.path.isfile(path):
    raise FileNotFoundError(f'prompts={path}: no such file.')
  return RecordSource([path], 'parquet' if path.endswith('.parquet') else 'jsonl').records


def split_record(record: dict, where: str = 'record') -> tuple[Any, dict]:
  """``(prompt, columns)`` of one record (see the module docstring)."""
  if not isinstance(record, dict):
    raise ValueError(f'{where}: a prompt record must be a JSON object, got '
                     f'{type(record).__name__}.')
  if 'prompt' in record:
    columns = {k: v for k, v in record.items() if k != 'prompt'}
    return record['prompt'], columns
  messages = record.get('messages')
  if isinstance(messages, list) and messages and messages[-1].get('role') == 'assistant':
    columns = {k: v for k, v in record.items() if k != 'messages'}
    columns.setdefault('answer', messages[-1].get('content', ''))
    return messages[:-1], columns
  raise ValueError(f'{where}: needs a "prompt" (text or chat messages), or "messages" ending '
                   f'with an assistant turn; it has {sorted(record)}.')


class Prompts:
  """Prompt records in a shuffled order, tokenized on first use.

  Args:
    records: a list of records, or a JSONL / JSON-list / Parquet file of them.
    tokenizer: the policy's tokenizer.
    template: the chat template for chat prompts (a :class:`~maxnnx.data.ChatTemplate`,
      a built-in name such as ``'chatml'``, or Jinja text); text prompts are encoded as
      they are, after the BOS id.
    seed: seed of the order (a new permutation each epoch).
    shuffle: ``False`` keeps the file's order.

  ``take(n)`` returns the next ``n`` prompts; ``get_state``/``set_state`` save and
  restore the position (epoch and index).
  """

  def __init__(self, records: Sequence[dict] | str, tokenizer,
               template: ChatTemplate | str | None = None, *, seed: int = 0,
               shuffle: bool = True):
    source = records if isinstance(records, str) else 'records'
    self.records = _read(records) if isinstance(records, str) else list(records)
    if not self.records:
      raise ValueError(f'{source}: no prompt records.')
    self.items = [split_record(r, f'{source} record {i + 1}')
                  for i, r in enumerate(self.records)]
    chats = [i for i, (p, _) in enumerate(self.items) if not isinstance(p, str)]
    if chats and template is None:
      raise ValueError(f'{source} has chat prompts (record {chats[0] + 1}) but no chat template '
                       'was given: pass template= (or use a tokenizer directory that has one).')
    if template is not None:
      template = template_for(tokenizer, template)
    self.tokenizer, self.template = tokenizer, template
    self.seed, self.shuffle = seed, shuffle
    self.epoch, self.index = 0, 0
    self._order = self._permutation(0)
    self._ids: dict[int, list[int]] = {}

  def __len__(self) -> int:
    return len(self.items)

  def _permutation(self, epoch: int) -> np.ndarray:
    if not self.shuffle:
      return np.arange(len(self.items))
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

  def encode(self, prompt) -> list[int]:
    """Token ids of one prompt value (text or chat messages)."""
    if isinstance(prompt, str):
      bos = getattr(self.tokenizer, 'bos_id', None)
      return ([bos] if bos is not None else []) + list(self.tokenizer.encode(prompt))
    text = self.template.render(prompt, add_generation_prompt=True)
    return encode_with_specials(self.tokenizer, text)

  def take(self, n: int) -> list[Prompt]:
    """The next ``n`` prompts (crossing into a new epoch, reshuffled, when needed)."""
    out = []
    for _ in range(n):
      if self.index == len(self.items):
        self.epoch, self.index = self.epoch + 1, 0
        self._order = self._permutation(self.epoch)
      i = int(self._order[self.index])
      self.index += 1
      if i not in self._ids:
        self._ids[i] = self.encode(self.items[i][0])
        if not self._ids[i]:
          raise ValueError(f'Prompt record {i + 1} encodes to no tokens.')
      out.append(Prompt(self.items[i][0], self._ids[i], self.items[i][1]))
    return out

  def get_state(self) -> dict:
    """The position: ``{'epoch', 'index'}``."""
    return {'epoch': self.epoch, 'index': self.index}

  def set_state(self, state: dict) -> None:
    """Go back to a position :meth:`get_state` returned."""
    self.epoch, self.index = int(state['epoch']), int(state['index'])
    self._order = self._permutation(self.epoch)


__all__ = ['Prompt', 'Prompts', 'split_record']

"""A chat reply's reasoning split from its answer, as vLLM's ``--reasoning-parser`` does.

Reasoning models write their thinking between ``<think>`` and ``</think>`` before the answer.
With ``reasoning_parser`` set (``maxnnx serve reasoning_parser=deepseek_r1``) the chat
endpoint returns the thinking as ``message.reasoning_content`` (``delta.reasoning_content``
when streaming) and only what follows ``</think>`` as the content, where tool calls are then
looked for. Two parsers, vLLM's names:

* ``deepseek_r1`` (DeepSeek-R1, QwQ): the template may open ``<think>`` in the prompt, so a
  reply is reasoning until ``</think>``, with or without its own ``<think>``.
* ``qwen3`` (Qwen3): only a reply that opens ``<think>`` reasons; one that does not is all
  content (``enable_thinking=False``).

A reply cut inside its thinking (by ``max_tokens``) is all reasoning with both, so a streamed
reply and the same reply answered whole agree.

GPT-OSS needs neither: its harmony channels are read by :mod:`maxnnx.serving.tools`.
"""

from __future__ import annotations

PARSERS = ('deepseek_r1', 'qwen3')
THINK, END_THINK = '<think>', '</think>'


def check_reasoning_parser(name: str | None) -> str | None:
  """``name`` when it is a parser (empty or ``None``: no parser); else ``ValueError`` naming
  the parsers."""
  if not name:
    return None
  if name not in PARSERS:
    raise ValueError(f'reasoning_parser={name!r}: the parsers are {", ".join(PARSERS)} '
                     '(empty: none).')
  return name


def _partial_marker(text: str) -> int:
  """The length of the longest end of ``text`` that begins ``</think>``."""
  return max((k for k in range(1, len(END_THINK)) if text.endswith(END_THINK[:k])), default=0)


def split_reasoning(text: str, parser: str, finished: bool = False) -> tuple[str, str]:
  """``(reasoning, content)`` of a reply (or of its start, while it streams).

  While the reply grows (not ``finished``), an end of the reasoning that may be the start of
  ``</think>`` is held back, so no reasoning streamed is ever taken back.
  """
  body = text.lstrip()
  if not finished and len(body) < len(THINK) and THINK.startswith(body):
    return '', ''  # may still become '<think>'
  if body.startswith(THINK):
    body = body[len(THINK):]
  elif parser == 'qwen3':
    return '', text  # no thinking block: the reply is the answer
  reasoning, closed, content = body.partition(END_THINK)
  if closed or finished:
    return reasoning, content
  return reasoning[:len(reasoning) - _partial_marker(reasoning)], ''


__all__ = ['END_THINK', 'PARSERS', 'THINK', 'check_reasoning_parser', 'split_reasoning']

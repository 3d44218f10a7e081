"""The OpenAI API's answers: each choice's text as it streams (:class:`ChoiceStream`), the
``best_of`` pick, and the response and chunk bodies of ``/v1/completions`` and
``/v1/chat/completions`` (requests are parsed by :mod:`maxnnx.serving.openai_api`).
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Sequence

from maxnnx.serving.openai_api import ParsedRequest
from maxnnx.serving.output_processor import stable_text, stop_ids
from maxnnx.serving.params import RequestOutput, SamplingParams, TokenLogprobs
from maxnnx.serving.reasoning import split_reasoning
from maxnnx.serving.tools import ToolCall, parse_tool_calls, split_reply, streamed_calls

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
      streams, and each call streams as OpenAI's ``delta.tool_calls``: a first delta with
      its ``index``, ``id``, ``type`` and ``function.name``, then the pieces of its
      ``function.arguments`` as they become certain), or ``None``. A harmony reply's content
      is its final messages' text, and its reasoning (the ``analysis`` messages) streams as
      ``delta.reasoning_content`` and comes back as ``message.reasoning_content``.
    read_calls: read tool calls in ``tool_format``; ``False`` reads the format for its
      content and reasoning only, and a call the reply holds is dropped (a harmony reply
      without tools, or with ``tool_choice`` ``none``).
    streaming: the choice streams; ``False`` reads the reply (stop strings, reasoning, tool
      calls) once, when it finishes, rather than after every token.
    reasoning_parser: split the reply's ``<think>`` block off as its reasoning
      (:mod:`~maxnnx.serving.reasoning`: ``deepseek_r1`` or ``qwen3``), before tool calls are
      looked for in what follows it; ``None``: the reply is all content.
  """

  def __init__(self, index: int, tokenizer, params: SamplingParams, eos_ids=(),
               tool_format: str | None = None, reasoning_parser: str | None = None,
               read_calls: bool = True, streaming: bool = True):
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
    self.read_calls = read_calls
    self.streaming = streaming
    self.reasoning_parser = reasoning_parser
    self.tool_calls: list[ToolCall] = []  # parsed from the finished reply
    self._calls_sent: list[ToolCall] = []  # each started call: its id, name, arguments sent
    self._tool_deltas: list[dict] = []     # not yet taken by a chunk (take_tool_deltas)
    self.reasoning = ''            # the reasoning sent (streaming) or known so far
    self._reasoning_delta = ''     # not yet taken by a chunk (take_reasoning)

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
      text = self._split_reasoning(text, finished=True)
      if self.tool_format is not None:
        content, calls = (parse_tool_calls(text, self.tool_format) if self.read_calls else
                          (split_reply(text, self.tool_format, finished=True)[0], []))
        self.tool_calls = self._send_calls([(c.name, c.arguments) for c in calls], calls)
        self._send_reasoning(split_reply(text, self.tool_format, finished=True)[1])
        text = content or ''  # without calls, the reply itself (harmony: its final text)
        if self.tool_calls:
          self.finish_reason = 'tool_calls' if out.finish_reason == 'stop' else (
              out.finish_reason)
    elif not self.streaming:  # nothing is sent before the end: the reply is read once then
      self.logprobs.extend(new_logprobs)
      return '', new_logprobs
    else:
      text = self._split_reasoning(stable_text(out.text or '', self.params.stop))
      if self.tool_format is not None:
        if self.read_calls:
          self._send_calls(streamed_calls(text, self.tool_format))
        text, reasoning = split_reply(text, self.tool_format)
        self._send_reasoning(reasoning)
    self.logprobs.extend(new_logprobs)
    if not text.startswith(self.text):  # a tokenizer that rewrites earlier text: send nothing
      if out.finished and self.tool_format is not None:
        self.text = text  # the parsed content (beside calls, stripped) is the message's
      return '', new_logprobs
    delta, self.text = text[len(self.text):], text
    return delta, new_logprobs

  def _send_calls(self, calls, finished: Sequence[ToolCall] = ()) -> list[ToolCall]:
    """Queue the deltas that bring the calls sent up to ``calls`` (``(name, arguments)``
    pairs, :func:`~maxnnx.serving.tools.streamed_calls`): a header for each call whose name
    became known, in order, and the arguments' new text. ``finished``: the finished reply's
    calls, returned with the ids their headers went out with."""
    finished = list(finished)
    for k, (name, arguments) in enumerate(calls):
      if name is None:
        break
      if k == len(self._calls_sent):
        call = finished[k] if finished else ToolCall(name, '')
        self._calls_sent.append(dataclasses.replace(call, arguments=''))
        self._tool_deltas.append({'index': k, 'id': call.id, 'type': 'function',
                                  'function': {'name': name, 'arguments': ''}})
      sent = self._calls_sent[k]
      if finished:
        finished[k] = dataclasses.replace(finished[k], id=sent.id)
      if len(arguments) > len(sent.arguments) and arguments.startswith(sent.arguments):
        self._tool_deltas.append({'index': k,
                                  'function': {'arguments': arguments[len(sent.arguments):]}})
        self._calls_sent[k] = dataclasses.replace(sent, arguments=arguments)
    return finished

  def _split_reasoning(self, text: str, finished: bool = False) -> str:
    """``text`` less its reasoning (queued to send) under the reasoning parser."""
    if self.reasoning_parser is None:
      return text
    reasoning, content = split_reasoning(text, self.reasoning_parser, finished)
    self._send_reasoning(reasoning)
    return content

  def _send_reasoning(self, reasoning: str) -> None:
    """Queue the reasoning text after what was sent, when ``reasoning`` goes on from it."""
    if len(reasoning) > len(self.reasoning) and reasoning.startswith(self.reasoning):
      self._reasoning_delta += reasoning[len(self.reasoning):]
      self.reasoning = reasoning

  def take_reasoning(self) -> str:
    """The reasoning text queued since the last call, for a chunk's
    ``delta.reasoning_content``."""
    delta, self._reasoning_delta = self._reasoning_delta, ''
    return delta

  @property
  def has_deltas(self) -> bool:
    """Whether tool-call deltas or reasoning wait for the next chunk."""
    return bool(self._tool_deltas or self._reasoning_delta)

  def take_tool_deltas(self) -> list[dict]:
    """The tool-call deltas queued since the last call (one per call: a header and the
    arguments after it merge), for a chunk's ``delta.tool_calls``."""
    merged: list[dict] = []
    for delta in self._tool_deltas:
      if merged and merged[-1]['index'] == delta['index']:
        merged[-1]['function']['arguments'] += delta['function']['arguments']
      else:
        merged.append(delta)
    self._tool_deltas = []
    return merged

  @property
  def has_tool_deltas(self) -> bool:
    """Whether tool-call deltas wait for the next chunk."""
    return bool(self._tool_deltas)

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
      if c.reasoning:
        message['reasoning_content'] = c.reasoning
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
    if reasoning := choice.take_reasoning():
      delta['reasoning_content'] = reasoning
    if choice.has_tool_deltas:
      delta['tool_calls'] = choice.take_tool_deltas()
    lp = chat_logprobs(choice, logprobs) if request.logprobs is not None and logprobs else None
    entry = {'index': choice.index, 'delta': delta, 'logprobs': lp, 'finish_reason': finish}
  else:
    lp = (completion_logprobs(choice, logprobs) if request.logprobs is not None and logprobs
          else None)
    entry = {'index': choice.index, 'text': text, 'logprobs': lp, 'finish_reason': finish}
  return {**body, 'choices': [{**entry, **extra}]}

"""From sampled tokens to what a client sees: text, stop rules and finish reasons.

Every rule that ends a request lives here, and nowhere else in serving:

* a stop token (:func:`stop_ids`: ``SamplingParams.stop_token_ids``, and the
  end-of-sequence ids unless ``ignore_eos``) ends it with reason ``stop``; the token is kept
  in ``token_ids`` but its text is not in ``text``;
* a stop string ends it with reason ``stop``, ``text`` cut before it;
* a finished grammar (structured outputs) ends it with reason ``stop``;
* ``max_tokens`` or ``max_model_len`` end it with reason ``length``.

Text is detokenized incrementally: each step decodes only the tokens since a few before the
last text that was certain (``prefix_offset``), so a step costs the same whatever the output's
length, and a token that ends inside a UTF-8 character waits for the next (no ``\\ufffd`` in
``text`` mid-stream). When a request finishes, its whole output is decoded once, so the final
``text`` is exactly the tokenizer's. :func:`stable_text` is the part of a streaming ``text``
that no later token can change, which is what a streaming client is sent.
"""

import dataclasses
from collections.abc import Iterable, Sequence

from maxnnx.serving.params import RequestOutput, SamplingParams
from maxnnx.serving.scheduler import Request


def stop_ids(params: SamplingParams, eos_ids: Iterable[int]) -> frozenset[int]:
  """The token ids that end a request: its ``stop_token_ids``, and ``eos_ids`` unless
  ``ignore_eos``."""
  return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                             else frozenset(eos_ids))


def stable_text(text: str, stops: Sequence[str]) -> str:
  """The part of a growing ``text`` that later tokens cannot change: without a trailing
  replacement character (half a UTF-8 sequence) or a tail that could begin a stop string."""
  text = text.rstrip('\ufffd')
  hold = 0
  for stop in stops:
    for k in range(min(len(stop) - 1, len(text)), hold, -1):
      if text.endswith(stop[:k]):
        hold = k
        break
  return text[:len(text) - hold]


@dataclasses.dataclass
class _Decoding:
  """One request's incremental detokenizing: ``output_ids[prefix_offset:read_offset]`` is the
  context decoded again before the new tokens; ``text`` is certain up to ``read_offset``."""

  prefix_offset: int = 0
  read_offset: int = 0
  text: str = ''


class OutputProcessor:
  """Detokenizes each request's output and applies the stop rules (see the module docstring).

  Args:
    tokenizer: ``decode(ids) -> str``, or ``None`` (no text, no stop strings).
    eos_ids: the engine's end-of-sequence ids.
    max_model_len: prompt plus output tokens of one request at most.
  """

  def __init__(self, tokenizer, eos_ids: Iterable[int], max_model_len: int):
    self.tokenizer = tokenizer
    self.eos_ids = frozenset(eos_ids)
    self.max_model_len = max_model_len
    self._decoding: dict[int, _Decoding] = {}

  def stop_ids(self, params: SamplingParams) -> frozenset[int]:
    """The ids that end a request with ``params`` (:func:`stop_ids`)."""
    return stop_ids(params, self.eos_ids)

  def finish_reason(self, request: Request, token: int, grammar_done: bool = False) -> str | None:
    """Take ``request``'s new ``token`` (already appended): update its ``text`` and return
    why it ends (``'stop'``, ``'length'``) or ``None``."""
    params = request.params
    stopped_on_token = token in self.stop_ids(params)
    stop = grammar_done or stopped_on_token
    if self.tokenizer is not None:
      if stop:
        request.text = self.tokenizer.decode(request.output_ids[:-1] if stopped_on_token
                                             else request.output_ids)
      else:
        before = len(request.text or '')
        request.text = self._decode_new(request)
        found = self._first_stop_string(request.text, params.stop, before)
        if found is not None:
          request.text, stop = request.text[:found], True
    if stop:
      self.forget(request.request_id)
      return 'stop'
    if len(request.output_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
      if self.tokenizer is not None:
        request.text = self.tokenizer.decode(request.output_ids)
      self.forget(request.request_id)
      return 'length'
    return None

  def _decode_new(self, request: Request) -> str:
    """The request's text with its newest tokens: only the tokens since ``prefix_offset``
    are decoded; a tail that ends inside a UTF-8 character waits for the next token."""
    state = self._decoding.setdefault(request.request_id, _Decoding())
    ids = request.output_ids
    context = self.tokenizer.decode(ids[state.prefix_offset:state.read_offset])
    extended = self.tokenizer.decode(ids[state.prefix_offset:])
    if len(extended) > len(context) and not extended.endswith('\ufffd'):
      state.text += extended[len(context):]
      state.prefix_offset, state.read_offset = state.read_offset, len(ids)
    return state.text

  @staticmethod
  def _first_stop_string(text: str, stops: Sequence[str], before: int) -> int | None:
    """Where the first stop string in ``text`` begins, looking only where one could end
    after the first ``before`` characters (earlier steps looked at the rest)."""
    starts = [i for i in (text.find(s, max(0, before - len(s) + 1)) for s in stops) if i >= 0]
    return min(starts) if starts else None

  def forget(self, request_id: int) -> None:
    """Drop a request's detokenizing state (finished or cancelled)."""
    self._decoding.pop(request_id, None)

  @staticmethod
  def output(request: Request, new_ids, new_logprobs) -> RequestOutput:
    """The :class:`RequestOutput` of ``request`` after a step gave it ``new_ids``."""
    return RequestOutput(
        request_id=request.request_id, new_token_ids=tuple(new_ids), new_logprobs=new_logprobs,
        token_ids=tuple(request.output_ids), finished=request.finish_reason is not None,
        finish_reason=request.finish_reason, text=request.text,
        num_cached_tokens=request.num_cached_tokens)

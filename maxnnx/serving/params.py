"""What a request asks for (:class:`SamplingParams`) and what the engine hands back."""

import dataclasses

from maxnnx.inference.sampling import control_problems, logit_bias_pairs
from maxnnx.inference.structured import StructuredOutput

MAX_SEED = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request is continued; every request may use its own.

  Attributes:
    max_tokens: tokens to generate at most (finish reason ``length``).
    temperature: 0 for greedy decoding, else the sampling temperature.
    top_k: sample only among the ``top_k`` most likely tokens (``None``: all).
    top_p: sample only from the smallest set of tokens whose probability reaches
      ``top_p`` (``None``: all).
    seed: seed of this request's samples: the same seed gives the same tokens
      whatever else runs beside it. ``None`` derives one from the engine's seed
      and the request id.
    stop_token_ids: ids that end the request (kept in the output; reason ``stop``).
    stop: strings that end the request once the decoded output contains one
      (needs the engine's tokenizer); the output ``text`` is cut before it.
    ignore_eos: do not stop at the model's end-of-sequence id(s).
    logprobs: ``None`` for no log-probabilities; ``n >= 0`` returns, for every
      generated token, its log-probability and the ``n`` most likely tokens'
      (under the model's distribution, before temperature, top-k and top-p).
    scaled_logprobs: report ``logprobs`` under the distribution the token was drawn
      from, ``log_softmax(logits / temperature)`` (still before top-k and top-p), as
      an RL objective compares them; greedy requests use temperature 1.
    logit_bias: ``{token_id: bias}`` added to those logits before sampling, each bias in
      [-100, 100] (OpenAI's rule: -100 bans a token, 100 all but forces it); kept as
      sorted ``(token_id, bias)`` pairs.
    presence_penalty: OpenAI's, in [-2, 2]: subtracted once from the logit of every token
      already generated (positive values favour new tokens).
    frequency_penalty: OpenAI's, in [-2, 2]: subtracted from each token's logit as many
      times as it was generated.
    repetition_penalty: HF / CTRL's, ``> 0`` (1: none): the logit of every token of the
      prompt or the output is divided by it when positive, multiplied when negative.
    min_tokens: the end-of-sequence and ``stop_token_ids`` ids cannot be sampled before
      this many tokens are out (stop strings still apply).
    structured: a :class:`~maxnnx.inference.structured.StructuredOutput` the whole output
      follows (each token is sampled among those its grammar allows; the end-of-sequence
      and stop ids only where the grammar accepts; the request stops once nothing more can
      follow), or ``None``. Needs an engine with a Hugging Face tokenizer.
  """

  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  seed: int | None = None
  stop_token_ids: tuple[int, ...] = ()
  stop: tuple[str, ...] = ()
  ignore_eos: bool = False
  logprobs: int | None = None
  scaled_logprobs: bool = False
  logit_bias: tuple[tuple[int, float], ...] = ()
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  min_tokens: int = 0
  structured: StructuredOutput | None = None

  def __post_init__(self):
    object.__setattr__(self, 'stop_token_ids', tuple(int(i) for i in self.stop_token_ids))
    object.__setattr__(self, 'logit_bias', logit_bias_pairs(self.logit_bias))
    stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
    object.__setattr__(self, 'stop', stop)
    problems = []
    if self.max_tokens < 1:
      problems.append(f'max_tokens={self.max_tokens} (need >= 1)')
    if self.temperature < 0:
      problems.append(f'temperature={self.temperature} (need >= 0)')
    if self.top_k is not None and self.top_k < 1:
      problems.append(f'top_k={self.top_k} (need >= 1 or None)')
    if self.top_p is not None and not 0 < self.top_p <= 1:
      problems.append(f'top_p={self.top_p} (need 0 < top_p <= 1 or None)')
    if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
      problems.append(f'seed={self.seed} (need 0 <= seed < 2**31 or None)')
    if self.logprobs is not None and self.logprobs < 0:
      problems.append(f'logprobs={self.logprobs} (need >= 0 or None)')
    if any(not s for s in stop):
      problems.append('an empty stop string')
    if self.structured is not None and not isinstance(self.structured, StructuredOutput):
      problems.append(f'structured={self.structured!r} (need a StructuredOutput or None)')
    problems += control_problems(self.logit_bias, self.presence_penalty,
                                 self.frequency_penalty, self.repetition_penalty,
                                 self.min_tokens, self.max_tokens)
    if problems:
      raise ValueError(f"Invalid SamplingParams: {', '.join(problems)}.")

  @property
  def penalized(self) -> bool:
    """Whether a presence, frequency or repetition penalty needs the token history."""
    return (self.presence_penalty != 0 or self.frequency_penalty != 0
            or self.repetition_penalty != 1)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
  """Log-probabilities around one generated token.

  Attributes:
    token_id: the generated token.
    logprob: its log-probability under the model.
    top: the ``n`` most likely ``(token_id, logprob)`` pairs, most likely first
      (``n`` = the request's ``SamplingParams.logprobs``).
  """

  token_id: int
  logprob: float
  top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """What one :meth:`~maxnnx.serving.Engine.step` produced for one request.

  Attributes:
    request_id: the id :meth:`~maxnnx.serving.Engine.add_request` returned.
    new_token_ids: tokens generated in this step (empty for a cancelled request).
    new_logprobs: their :class:`TokenLogprobs`, or ``None`` when not requested.
    token_ids: every token generated so far.
    finished: the request is done; no further outputs follow.
    finish_reason: ``stop`` (end-of-sequence id, stop id or stop string),
      ``length`` (``max_tokens`` or the engine's ``max_model_len``),
      ``cancelled``, or ``None`` while running.
    text: the decoded ``token_ids`` (cut before a stop string) when the engine
      has a tokenizer, else ``None``.
    num_cached_tokens: prompt tokens whose keys and values came from the prefix cache.
  """

  request_id: int
  new_token_ids: tuple[int, ...]
  new_logprobs: tuple[TokenLogprobs, ...] | None
  token_ids: tuple[int, ...]
  finished: bool
  finish_reason: str | None
  text: str | None
  num_cached_tokens: int


@dataclasses.dataclass(frozen=True)
class Completion:
  """A finished request, as :meth:`~maxnnx.serving.Engine.generate` returns it.

  Attributes:
    request_id: the engine's id of the request.
    prompt_ids: the prompt.
    token_ids: the generated tokens.
    finish_reason: ``stop``, ``length`` or ``cancelled``.
    logprobs: one :class:`TokenLogprobs` per generated token, or ``None``.
    text: the decoded output when the engine has a tokenizer, else ``None``.
    num_cached_tokens: prompt tokens served from the prefix cache.
  """

  request_id: int
  prompt_ids: tuple[int, ...]
  token_ids: tuple[int, ...]
  finish_reason: str
  logprobs: tuple[TokenLogprobs, ...] | None
  text: str | None
  num_cached_tokens: int

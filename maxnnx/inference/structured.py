"""Structured outputs: grammars that the next token must follow, as a mask over the vocabulary.

A :class:`StructuredOutput` names a grammar (a JSON schema, any JSON object, a regular
expression, or a Lark / EBNF grammar); :func:`grammar_tokenizer` wraps a tokenizer once for
llguidance, which then follows one request's output (:func:`new_matcher`) and says, before
each token, which tokens may come next (:func:`fill_allowed`: one bit per token, 32 tokens per
``int32`` word, as :func:`~maxnnx.inference.sampling.apply_controls` takes them). The
end-of-sequence ids are allowed exactly when the grammar accepts the output so far.

llguidance computes a mask in tens of microseconds from the grammar's lexer and parser
states (no pass over the vocabulary per token), has no dependency of its own, and reads a
Hugging Face ``tokenizer.json`` directly. It is imported when first needed.

JSON grammars are compact (no whitespace between tokens of JSON): a model may otherwise
write whitespace until its length runs out.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np

#: ``StructuredOutput.kind`` values and what their ``spec`` holds.
KINDS = {
  'json_schema': 'a JSON schema (as JSON text)',
  'json_object': 'nothing (any JSON object)',
  'regex': 'a regular expression the whole output matches',
  'grammar': 'a Lark grammar (as llguidance reads it) or a GBNF / EBNF one',
}
_JSON_OPTIONS = {'whitespace_flexible': False}


def _llguidance():
  try:
    import llguidance  # noqa: PLC0415
  except ImportError:
    raise ImportError('Structured outputs need the llguidance package: pip install '
                      'llguidance.') from None
  return llguidance


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
  """A grammar that a request's whole output must follow.

  Attributes:
    kind: one of :data:`KINDS`: ``json_schema``, ``json_object``, ``regex`` or ``grammar``.
    spec: the schema (JSON text), the regular expression or the grammar text; ``''`` for
      ``json_object``.

  Raises:
    ValueError: an unknown kind, or a spec that does not compile (the message names the
      problem as llguidance reports it).
  """

  kind: str
  spec: str = ''

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f'StructuredOutput kind={self.kind!r}: expected one of '
                       f'{", ".join(KINDS)}.')
    if not isinstance(self.spec, str):
      raise ValueError(f'StructuredOutput spec must be text ({KINDS[self.kind]}), got '
                       f'{type(self.spec).__name__}.')
    llg = _llguidance()
    try:
      grammar = self.grammar()
    except ValueError as e:
      raise ValueError(f'{self.kind}: {e}') from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
      raise ValueError(f'{self.kind}: {messages[0].strip()}')

  @classmethod
  def json_schema(cls, schema: dict | str) -> StructuredOutput:
    """Output that is one JSON value valid under ``schema`` (a dict, or its JSON text)."""
    return cls('json_schema', schema if isinstance(schema, str) else json.dumps(schema))

  def grammar(self) -> str:
    """The llguidance grammar of this output (what :func:`new_matcher` compiles).

    Raises:
      ValueError: a spec llguidance cannot read.
    """
    try:
      return self._grammar()
    except ValueError:
      raise
    except Exception as e:  # llguidance's own errors on odd input
      raise ValueError(str(e)) from None

  def _grammar(self) -> str:
    matcher = _llguidance().LLMatcher
    if self.kind == 'json_object':
      return matcher.grammar_from_json_schema({'type': 'object'}, defaults=_JSON_OPTIONS)
    if self.kind == 'json_schema':
      try:
        schema = json.loads(self.spec)
      except json.JSONDecodeError as e:
        raise ValueError(f'the schema is not valid JSON ({e})') from None
      if not isinstance(schema, (dict, bool)):
        raise ValueError(f'a schema is a JSON object, got {type(schema).__name__}')
      return matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if self.kind == 'regex':
      return matcher.grammar_from_regex(self.spec)
    return _llguidance().grammar_from('grammar', self.spec)


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: Sequence[int]):
  """``tokenizer`` as llguidance reads it (built once per tokenizer: about a millisecond per
  thousand tokens), over ``vocab_size`` ids (the model's: ids the tokenizer lacks are never
  allowed), ending at ``eos_ids``.

  Raises:
    ValueError: a tokenizer other than a Hugging Face ``tokenizer.json`` one, or no
      end-of-sequence id.
  """
  backend = getattr(tokenizer, 'backend', None)
  if backend is None or not hasattr(backend, 'to_str'):
    raise ValueError(f'Structured outputs need a Hugging Face tokenizer.json tokenizer; '
                     f'{type(tokenizer).__name__} is not one.')
  if not eos_ids:
    raise ValueError('Structured outputs need an end-of-sequence id (model.config.eos_token_id '
                     "or the tokenizer's eos_token).")
  if backend.get_vocab_size(with_added_tokens=True) > vocab_size:
    raise ValueError(f'The tokenizer has {backend.get_vocab_size(with_added_tokens=True)} '
                     f'tokens, more than the model\'s vocab_size={vocab_size}.')
  return _llguidance().LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                   eos_token=sorted(int(i) for i in eos_ids))


def new_matcher(grammar_tok, structured: StructuredOutput):
  """An llguidance matcher at the start of ``structured``'s grammar.

  Raises:
    ValueError: the grammar does not compile against this tokenizer.
  """
  matcher = _llguidance().LLMatcher(grammar_tok, structured.grammar(), log_level=0)
  if matcher.is_error():
    raise ValueError(f'{structured.kind}: {matcher.get_error().strip()}')
  return matcher


def mask_words(vocab_size: int) -> int:
  """``int32`` words of a token mask over ``vocab_size`` ids (32 ids a word)."""
  return (vocab_size + 31) // 32


def fill_allowed(matcher, mask_BW: np.ndarray, row: int, also: Sequence[int] = ()) -> None:
  """Write into ``mask_BW[row]`` the tokens ``matcher`` allows next (bit ``i % 32`` of word
  ``i // 32`` for token ``i``); ``also`` are allowed too when the grammar accepts the output so
  far (a request's own stop ids)."""
  words = mask_BW[row]
  matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.size * words.itemsize)
  if also and matcher.is_accepting():
    view = words.view(np.uint32)
    for i in also:
      if i < 32 * len(view):
        view[i // 32] |= np.uint32(1 << (i % 32))


def allowed_ids(mask_W: np.ndarray, vocab_size: int) -> np.ndarray:
  """The token ids one row of a mask allows (for tests and debugging)."""
  bits = np.unpackbits(np.ascontiguousarray(mask_W).view(np.uint8), bitorder='little')
  return np.flatnonzero(bits[:vocab_size])


__all__ = ['KINDS', 'StructuredOutput', 'allowed_ids', 'fill_allowed', 'grammar_tokenizer',
           'mask_words', 'new_matcher']

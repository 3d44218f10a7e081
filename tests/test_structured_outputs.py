"""Structured outputs: a grammar's token mask in the engine, with a tiny random model (its
free output is garbage, which makes the constraint visible)."""

import json
import re

import jax.numpy as jnp
import llguidance
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.data import load_tokenizer
from maxnnx.inference.structured import StructuredOutput, allowed_ids, grammar_tokenizer
from maxnnx.serving import Engine, SamplingParams

PERSON = {
  'type': 'object',
  'properties': {
    'name': {'enum': ['ada', 'bob', 'cy']},
    'age': {'type': 'integer', 'minimum': 18, 'maximum': 99},
    'address': {'type': 'object', 'properties': {'zip': {'type': 'integer', 'minimum': 0,
                                                         'maximum': 999},
                                                 'city': {'enum': ['rome', 'oslo']}},
                'required': ['zip', 'city'], 'additionalProperties': False},
    'tags': {'type': 'array', 'items': {'enum': ['x', 'y']}, 'minItems': 1, 'maxItems': 3},
    'ok': {'type': 'boolean'},
  },
  'required': ['name', 'age', 'address', 'tags', 'ok'],
  'additionalProperties': False,
}


def check_schema(value, schema, where='$'):
  """Raise AssertionError where ``value`` breaks ``schema`` (the keywords the tests use)."""
  if 'enum' in schema:
    assert value in schema['enum'], f'{where}: {value!r} not in {schema["enum"]}'
  kind = schema.get('type')
  if kind == 'object':
    assert isinstance(value, dict), f'{where}: {value!r} is not an object'
    props = schema.get('properties', {})
    for key in schema.get('required', []):
      assert key in value, f'{where}: missing {key!r}'
    if schema.get('additionalProperties') is False:
      assert set(value) <= set(props), f'{where}: extra keys {set(value) - set(props)}'
    for key, item in value.items():
      if key in props:
        check_schema(item, props[key], f'{where}.{key}')
  elif kind == 'array':
    assert isinstance(value, list), f'{where}: {value!r} is not an array'
    assert schema.get('minItems', 0) <= len(value) <= schema.get('maxItems', len(value))
    for i, item in enumerate(value):
      check_schema(item, schema.get('items', {}), f'{where}[{i}]')
  elif kind == 'integer':
    assert isinstance(value, int) and not isinstance(value, bool), f'{where}: {value!r}'
    assert schema.get('minimum', value) <= value <= schema.get('maximum', value), where
  elif kind == 'boolean':
    assert isinstance(value, bool), f'{where}: {value!r} is not a boolean'
  elif kind == 'string':
    assert isinstance(value, str), f'{where}: {value!r} is not a string'


def test_the_validator_of_these_tests_can_fail():
  good = {'name': 'ada', 'age': 18, 'address': {'zip': 1, 'city': 'oslo'}, 'tags': ['x'],
          'ok': True}
  check_schema(good, PERSON)
  for bad in ({**good, 'age': 17}, {**good, 'name': 'eve'}, {**good, 'tags': []},
              {**good, 'address': {'zip': 1}}, {**good, 'ok': 1}, {**good, 'more': 1}):
    with pytest.raises(AssertionError):
      check_schema(bad, PERSON)


@pytest.fixture(scope='module')
def tokenizer(chat_checkpoint):
  return load_tokenizer(str(chat_checkpoint))


@pytest.fixture(scope='module')
def model():
  return maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=512, num_layers=1),
                            rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def engine(model, tokenizer):
  return Engine(model, tokenizer, max_batch=2, token_budget=32, page_size=8, max_model_len=128,
                token_buckets=(32,), page_buckets=(16,))


def test_constrained_greedy_tokens_are_the_argmax_over_the_grammars_allowed_tokens(
    model, tokenizer, engine):
  """Each token equals the argmax of the model's own logits (a plain forward pass over the
  prompt and the tokens before it) among the tokens a fresh matcher allows there; beside it
  an unconstrained request runs in the same steps."""
  prompt = tokenizer.encode('Who is there?')
  structured = StructuredOutput.json_schema(PERSON)
  constrained, free = engine.generate(
      [prompt, prompt], [SamplingParams(max_tokens=80, structured=structured),
                         SamplingParams(max_tokens=8, ignore_eos=True)])
  assert constrained.finish_reason == 'stop'
  check_schema(json.loads(constrained.text), PERSON)
  vocab = model.config.vocab_size
  grammar_tok = grammar_tokenizer(tokenizer, vocab, sorted(engine.eos_ids))
  matcher = llguidance.LLMatcher(grammar_tok, structured.grammar())
  ids = list(prompt) + list(constrained.token_ids)
  logits_TV = np.asarray(model(jnp.asarray(ids)[None])[0], np.float32)
  masked_differs = False
  for t, token in enumerate(constrained.token_ids):
    mask_W = np.frombuffer(matcher.compute_bitmask(), np.int32)
    allowed = allowed_ids(mask_W, vocab)
    row = logits_TV[len(prompt) + t - 1]
    assert token == allowed[np.argmax(row[allowed])], t
    masked_differs |= token != int(np.argmax(row))
    assert matcher.consume_token(token)
  assert matcher.is_stopped()  # the output is complete: the engine stopped it there
  assert masked_differs  # the mask changed what greedy decoding would write
  assert free.token_ids == tuple(int(np.argmax(r)) for r in np.asarray(
      model(jnp.asarray(prompt + list(free.token_ids[:-1]))[None])[0])[len(prompt) - 1:])


def test_a_regex_is_matched_whole_and_sampling_stays_inside_it(engine, tokenizer):
  pattern = r'(yes|no) [0-9]{2,4}'
  outs = engine.generate([tokenizer.encode('Well?')] * 4, [
      SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                     structured=StructuredOutput('regex', pattern)) for s in range(4)])
  for out in outs:
    assert re.fullmatch(pattern, out.text), out.text
    assert out.finish_reason == 'stop'


@pytest.mark.parametrize('kind, spec, problem', [
  ('json_schema', '{"type": "strin"}', 'strin'),
  ('json_schema', '{"type": ', 'not valid JSON'),
  ('regex', '[a-', 'regex'),
  ('grammar', 'start: foo', 'foo'),
  ('yaml', '', 'expected one of'),
])
def test_a_grammar_that_does_not_compile_is_one_value_error_naming_it(kind, spec, problem):
  with pytest.raises(ValueError, match=re.escape(problem)):
    StructuredOutput(kind, spec)

"""The output processor on its own (no model): incremental text, stop rules, finish reasons."""

import numpy as np

from maxnnx.serving import Request, SamplingParams
from maxnnx.serving.output_processor import OutputProcessor, stop_ids


class _BytesTokenizer:
  """Token ``i`` is byte ``i``: characters outside ASCII span several tokens. Records how
  many tokens each ``decode`` call was given."""

  eos_id = 0

  def __init__(self):
    self.decoded_lengths = []

  def encode(self, text):
    return list(text.encode())

  def decode(self, ids):
    self.decoded_lengths.append(len(ids))
    return bytes(ids).decode('utf-8', errors='replace')


def _run(processor, text, params, prompt=(1, 2)):
  """Feed ``text``'s bytes one at a time; the request and each step's ``(text, reason)``."""
  request = Request(request_id=0, token_ids=list(prompt), num_prompt=len(prompt), params=params,
                    seed=0)
  steps = []
  for token in text.encode():
    request.token_ids.append(token)
    reason = processor.finish_reason(request, token)
    steps.append((request.text, reason))
    if reason is not None:
      break
  return request, steps


def _random_text(rng, length):
  alphabet = list('abc xyz') + ['é', 'ö', '✓', '日本', '🙂']
  return ''.join(rng.choice(alphabet, length))


def test_incremental_text_never_shows_half_a_character_and_ends_exact():
  """Multi-byte characters split over tokens: the text mid-stream is always a prefix of the
  whole decode without a replacement character, each step decodes a few tokens only, and the
  finished text is the tokenizer's decode of every token."""
  rng = np.random.default_rng(0)
  text = _random_text(rng, 300)
  tokenizer = _BytesTokenizer()
  processor = OutputProcessor(tokenizer, [tokenizer.eos_id], max_model_len=10_000)
  n = len(text.encode())
  request, steps = _run(processor, text, SamplingParams(max_tokens=n))
  assert steps[-1] == (text, 'length') and all(reason is None for _, reason in steps[:-1])
  for partial, _ in steps[:-1]:
    assert '\ufffd' not in partial and text.startswith(partial)
  assert len(steps[-2][0]) >= len(text) - 1  # at most the last character waits
  assert max(tokenizer.decoded_lengths[:-1]) <= 8  # incremental: never the whole output
  assert not processor._decoding  # nothing kept for a finished request


def test_stop_strings_across_tokens_and_stop_tokens_leave_the_text():
  """A stop string split over tokens cuts the text before it; a stop token ends the request
  with its text left out; EOS counts unless ignore_eos."""
  tokenizer = _BytesTokenizer()
  processor = OutputProcessor(tokenizer, [tokenizer.eos_id], max_model_len=10_000)
  _, steps = _run(processor, 'ab öl✓ after', SamplingParams(max_tokens=100, stop=('l✓', 'zz')))
  assert steps[-1] == ('ab ö', 'stop')
  _, steps = _run(processor, 'done! more', SamplingParams(max_tokens=100,
                                                          stop_token_ids=(ord('!'),)))
  assert steps[-1] == ('done', 'stop')
  assert stop_ids(SamplingParams(stop_token_ids=(5,)), [0]) == {0, 5}
  assert stop_ids(SamplingParams(stop_token_ids=(5,), ignore_eos=True), [0]) == {5}


def test_a_length_limit_ends_at_max_model_len():
  """The prompt and output reaching ``max_model_len`` end the request with reason length."""
  processor = OutputProcessor(None, [], max_model_len=6)
  request, steps = _run(processor, 'abcdef', SamplingParams(max_tokens=100), prompt=(1, 2, 3))
  assert [reason for _, reason in steps] == [None, None, 'length']
  assert request.num_tokens == 6 and request.text is None

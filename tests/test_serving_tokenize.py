"""vLLM's tokenizer endpoints (``/tokenize``, ``/detokenize``, ``/tokenizer_info``): what each
answers, against the tokenizer itself, and the one-line errors. The whole harness through them
is ``tests/test_lm_eval_backend.py``'s ``local-completions`` test."""

import os

import pytest

from maxnnx.data import ChatTemplate, load_tokenizer
from maxnnx.data.chat import builtin_template, encode_with_specials
from maxnnx.serving.openai_api import ApiError, ServedModel
from maxnnx.serving.openai_tokenize import detokenize, tokenize, tokenizer_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, 'tests', 'lm_eval_task', 'tokenizer')


@pytest.fixture(scope='module')
def served():
  tokenizer = load_tokenizer(TOKENIZER)
  return ServedModel(name='tiny', tokenizer=tokenizer,
                     template=ChatTemplate(builtin_template('chatml')), max_model_len=64,
                     vocab_size=tokenizer.vocab_size, max_logprobs=5)


def test_tokenize_is_the_tokenizer_with_bos_as_the_server_adds_it(served):
  text = 'Question: what is the answer?\nAnswer: yes'
  ids = served.tokenizer.encode(text)
  bos = served.tokenizer.bos_id
  assert bos is not None and ids
  out = tokenize({'model': 'tiny', 'prompt': text}, served)
  assert out == {'count': len(ids) + 1, 'max_model_len': 64, 'tokens': [bos, *ids]}
  plain = tokenize({'prompt': text, 'add_special_tokens': False}, served)  # model is optional
  assert plain['tokens'] == ids
  no_bos = ServedModel(**{**served.__dict__, 'add_bos': False})
  assert tokenize({'prompt': text}, no_bos)['tokens'] == ids
  strs = tokenize({'prompt': text, 'add_special_tokens': False, 'return_token_strs': True},
                  served)['token_strs']
  assert ''.join(strs) == text


def test_special_token_strings_become_their_ids(served):
  eos = served.tokenizer.eos_id
  info = tokenizer_info(served)
  assert tokenize({'prompt': info['eos_token'], 'add_special_tokens': False},
                  served)['tokens'] == [eos]
  assert info['model_max_length'] == 64 and info['vocab_size'] == served.vocab_size
  assert info['bos_token'] == info['eos_token'] == '<|endoftext|>'
  assert info['chat_template'] == served.template.source


def test_tokenize_messages_renders_the_chat_template(served):
  messages = [{'role': 'user', 'content': 'hi'}]
  text = served.template.render(messages, add_generation_prompt=True)
  out = tokenize({'messages': messages}, served)
  assert out['tokens'] == encode_with_specials(served.tokenizer, text)
  bare = tokenize({'messages': messages, 'add_generation_prompt': False}, served)
  assert len(bare['tokens']) < len(out['tokens'])


def test_detokenize_inverts_tokenize(served):
  text = 'A round trip, with punctuation: yes!'
  ids = tokenize({'prompt': text, 'add_special_tokens': False}, served)['tokens']
  assert detokenize({'tokens': ids}, served) == {'prompt': text}


@pytest.mark.parametrize('call, body, param', [
    (tokenize, {'prompt': 'x', 'messages': []}, 'prompt'),
    (tokenize, {}, 'prompt'),
    (tokenize, {'prompt': [1, 2]}, 'prompt'),
    (tokenize, {'messages': 'hi'}, 'messages'),
    (tokenize, {'prompt': 'x', 'model': 'other'}, 'model'),
    (tokenize, {'prompt': 'x', 'add_special_tokens': 'yes'}, 'add_special_tokens'),
    (detokenize, {'tokens': [1, 10**9]}, 'tokens'),
    (detokenize, {'tokens': 'abc'}, 'tokens'),
    (detokenize, {'tokens': []}, 'tokens'),
])
def test_bad_bodies_are_errors_naming_the_field(served, call, body, param):
  with pytest.raises(ApiError) as info:
    call(body, served)
  assert info.value.param == param, info.value
  assert '\n' not in str(info.value)


def test_a_model_without_chat_template_refuses_messages(served):
  plain = ServedModel(**{**served.__dict__, 'template': None})
  with pytest.raises(ApiError, match='no chat template'):
    tokenize({'messages': [{'role': 'user', 'content': 'hi'}]}, plain)
  assert tokenizer_info(plain)['chat_template'] is None


def test_the_server_answers_the_tokenizer_endpoints(tmp_path):
  """Through ``make_app``'s routes (no engine step is needed: the app is not started)."""
  import shutil

  from starlette.testclient import TestClient

  from maxnnx.serving.server import make_app
  for name in ('config.json', 'model.safetensors'):
    shutil.copy(os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'llama', name), tmp_path / name)
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(os.path.join(TOKENIZER, name), tmp_path / name)
  client = TestClient(make_app(str(tmp_path), model_name='tiny', max_model_len=64))
  tokens = client.post('/tokenize', json={'prompt': 'Answer: four'}).json()['tokens']
  assert client.post('/detokenize', json={'tokens': tokens[1:]}).json() == {
      'prompt': 'Answer: four'}
  assert client.get('/tokenizer_info').json()['eos_token'] == '<|endoftext|>'
  bad = client.post('/detokenize', json={'tokens': [-1]})
  assert bad.status_code == 400 and bad.json()['error']['param'] == 'tokens'
  assert client.post('/tokenize', content=b'{').status_code == 400

"""``maxnnx.chat``: conversations rendered with the template, answered, stopped at end of turn."""

import pytest
from flax import nnx

import maxnnx
from maxnnx.data import load_tokenizer
from maxnnx.data.chat import encode_with_specials
from maxnnx.inference import end_of_turn_ids, eos_token_ids
from maxnnx.serving import Engine

CONVERSATIONS = [
    [{'role': 'user', 'content': 'Who art thou?'}],
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Speak, speak.'}],
]


@pytest.fixture(scope='module')
def model():
  return maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=512, num_layers=1),
                            rngs=nnx.Rngs(3))


def test_replies_match_generation_on_the_rendered_prompt(model, chat_checkpoint):
  tokenizer = load_tokenizer(str(chat_checkpoint))
  replies = maxnnx.chat(model, tokenizer, CONVERSATIONS, max_new_tokens=6)
  stops = end_of_turn_ids(tokenizer)
  assert tokenizer.eos_id in stops and encode_with_specials(tokenizer, '<|im_end|>')[0] in stops
  for conversation, reply in zip(CONVERSATIONS, replies):
    text = '<|im_start|>user\n' + conversation[-1]['content'] + '<|im_end|>\n'
    prompt = encode_with_specials(tokenizer, ''.join(
        ['<|im_start|>system\nBe brief.<|im_end|>\n'] if len(conversation) > 1 else [])
        + text + '<|im_start|>assistant\n')
    alone = maxnnx.generate(model, [prompt], 6, eos_ids=stops).as_lists()[0]
    assert reply == tokenizer.decode([i for i in alone if i not in stops])


def test_a_tokenizer_without_a_template_needs_one(model, tmp_path, chat_checkpoint):
  (tmp_path / 'tokenizer.json').write_bytes((chat_checkpoint / 'tokenizer.json').read_bytes())
  tokenizer = load_tokenizer(str(tmp_path))
  with pytest.raises(ValueError, match='template='):
    maxnnx.chat(model, tokenizer, CONVERSATIONS[:1])
  assert len(maxnnx.chat(model, tokenizer, CONVERSATIONS[:1], 'chatml', max_new_tokens=2)) == 1


def test_the_ids_that_end_a_generation_are_the_configs_the_tokenizers_and_end_of_turn(
    model, chat_checkpoint):
  tokenizer = load_tokenizer(str(chat_checkpoint))
  im_end = encode_with_specials(tokenizer, '<|im_end|>')[0]
  config = model.config.replace(eos_token_id=(7, 9))
  assert eos_token_ids(config) == (7, 9)
  assert eos_token_ids(config, tokenizer) == tuple(sorted({7, 9, tokenizer.eos_id}))
  with_turns = eos_token_ids(config, tokenizer, end_of_turn=True)
  assert {7, 9, tokenizer.eos_id, im_end} <= set(with_turns)
  assert set(with_turns) - {7, 9} == set(end_of_turn_ids(tokenizer))
  assert eos_token_ids() == () and eos_token_ids(model.config.replace(eos_token_id=4)) == (4,)
  engine = Engine(model, tokenizer=tokenizer, page_size=4, max_batch=2, max_model_len=32)
  assert engine.eos_ids == set(eos_token_ids(model.config, tokenizer)) == {tokenizer.eos_id}

"""Chat templates, assistant-only loss masks and packed SFT batches."""

import json
import os

import jinja2
import numpy as np
import pytest

from maxnnx.data import (
    DEFAULT_CORPUS,
    DataConfig,
    encode_chat,
    encode_prompt_completion,
    load_chat_template,
    load_tokenizer,
    make_sft_pipeline,
)
from maxnnx.data.chat import (
    CHATML_TEMPLATE,
    ChatTemplate,
    builtin_template,
    chat_pieces,
    encode_with_specials,
)

CONVERSATION = [
    {'role': 'system', 'content': 'Be brief.'},
    {'role': 'user', 'content': 'Who art thou?'},
    {'role': 'assistant', 'content': 'A king.'},
    {'role': 'user', 'content': 'Of where?'},
    {'role': 'assistant', 'content': 'Of Denmark, good sir.'},
]


@pytest.fixture(scope='module')
def checkpoint(chat_checkpoint):
  return chat_checkpoint


@pytest.fixture(scope='module')
def tokenizer(checkpoint):
  return load_tokenizer(str(checkpoint))


def _write_json(path, value):
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(value, f)


# --- loading -------------------------------------------------------------------


def test_template_from_tokenizer_config_string(checkpoint):
  template = load_chat_template(str(checkpoint / 'tokenizer.json'))
  assert template.source == CHATML_TEMPLATE
  assert (template.bos_token, template.eos_token) == ('<|begin_of_text|>', '<|im_end|>')


def test_template_from_named_list_takes_default(tmp_path):
  _write_json(tmp_path / 'tokenizer_config.json', {
      'bos_token': {'content': '<s>', 'lstrip': False}, 'eos_token': '</s>',
      'chat_template': [{'name': 'tool_use', 'template': 'TOOLS'},
                        {'name': 'default', 'template': '{{ bos_token }}D'}]})
  template = load_chat_template(str(tmp_path))
  assert template.render([]) == '<s>D'
  assert load_chat_template(str(tmp_path), name='tool_use').source == 'TOOLS'
  with pytest.raises(ValueError, match='no chat template named'):
    load_chat_template(str(tmp_path), name='rag')


def test_chat_template_jinja_file_wins(tmp_path):
  _write_json(tmp_path / 'tokenizer_config.json', {'eos_token': '</s>', 'chat_template': 'OLD'})
  (tmp_path / 'chat_template.jinja').write_text('{{ messages[0].content }}{{ eos_token }}')
  template = load_chat_template(str(tmp_path))
  assert template.render([{'role': 'user', 'content': 'hi'}]) == 'hi</s>'


def test_builtin_fallback_and_missing(tmp_path):
  _write_json(tmp_path / 'tokenizer_config.json', {'eos_token': '</s>'})
  with pytest.raises(FileNotFoundError, match='builtin='):
    load_chat_template(str(tmp_path))
  assert load_chat_template(str(tmp_path), builtin='chatml').source == CHATML_TEMPLATE
  assert builtin_template('Llama3') == builtin_template('llama3')
  with pytest.raises(ValueError, match='No built-in chat template'):
    builtin_template('qwen2')  # a family, not a template: its spec names its template


def test_each_family_names_its_builtin_chat_template():
  """Qwen families fall back on ChatML and Gemma families on Gemma's turns; a family with
  none gets none, and every name given is a built-in template."""
  from maxnnx.data.chat import BUILTIN_TEMPLATES
  from maxnnx.models.registry import specs
  names = {name: spec.chat_template for name, spec in specs().items()}
  assert {names[f] for f in ('qwen2', 'qwen3', 'qwen3_moe', 'qwen3_next', 'qwen3_5')} == {
      'chatml'}
  assert {names[f] for f in ('gemma', 'gemma2', 'gemma3', 'gemma4')} == {'gemma'}
  assert names['gpt3'] is None
  assert set(names.values()) - {None} <= set(BUILTIN_TEMPLATES)


# --- the sandbox ---------------------------------------------------------------


@pytest.mark.parametrize('source', [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{% set x = messages.append(1) %}",
    "{{ messages[0].update({'role': 'x'}) }}",
])
def test_sandbox_refuses_unsafe_code(source):
  with pytest.raises(jinja2.exceptions.SecurityError):
    ChatTemplate(source).render([{'role': 'user', 'content': 'x'}])


@pytest.mark.parametrize('source', ['{{ messages.__class__ }}',
                                    '{{ raise_exception.__globals__ }}'])
def test_sandbox_hides_internals(source):
  # Unsafe attributes read as undefined: nothing of the Python object leaks out.
  assert ChatTemplate(source).render([{'role': 'user', 'content': 'x'}]) == ''


def test_template_helpers():
  template = ChatTemplate(
      "{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}"
      "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}|{{ m.role }}"
      "{% endfor %}{% if messages | length > 1 %}{{ raise_exception('too many') }}{% endif %}")
  assert template.render([{'role': 'user', 'content': 'é'}]) == \
      '{"role": "user", "content": "é"}|4|user'
  with pytest.raises(jinja2.exceptions.TemplateError, match='too many'):
    template.render([{'role': 'user', 'content': 'a'}] * 2)


# --- rendering known formats ---------------------------------------------------


def test_chatml_rendering():
  expected = ('<|im_start|>system\nBe brief.<|im_end|>\n'
              '<|im_start|>user\nWho art thou?<|im_end|>\n'
              '<|im_start|>assistant\nA king.<|im_end|>\n'
              '<|im_start|>user\nOf where?<|im_end|>\n'
              '<|im_start|>assistant\n')
  template = ChatTemplate(builtin_template('chatml'))
  assert template.render(CONVERSATION[:4], add_generation_prompt=True) == expected


def test_llama3_rendering():
  expected = ('<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>'
              '<|start_header_id|>user<|end_header_id|>\n\nWho art thou?<|eot_id|>'
              '<|start_header_id|>assistant<|end_header_id|>\n\nA king.<|eot_id|>'
              '<|start_header_id|>user<|end_header_id|>\n\nOf where?<|eot_id|>'
              '<|start_header_id|>assistant<|end_header_id|>\n\n')
  template = ChatTemplate(builtin_template('llama3'), bos_token='<|begin_of_text|>')
  assert template.render(CONVERSATION[:4], add_generation_prompt=True) == expected
  assert template.render(CONVERSATION[:3]) == expected[:expected.index('<|start_header_id|>u', 150)]


def test_gemma_rendering():
  template = ChatTemplate(builtin_template('gemma'), bos_token='<bos>')
  assert template.render(CONVERSATION[:4], add_generation_prompt=True) == (
      '<bos><start_of_turn>user\nBe brief.\n\nWho art thou?<end_of_turn>\n'
      '<start_of_turn>model\nA king.<end_of_turn>\n'
      '<start_of_turn>user\nOf where?<end_of_turn>\n'
      '<start_of_turn>model\n')
  with pytest.raises(jinja2.exceptions.TemplateError, match='alternate'):
    template.render(CONVERSATION[2:])


# --- loss masks ----------------------------------------------------------------


def _trained_text(tokenizer, ids, mask):
  """Decoded runs of trained tokens."""
  runs, run = [], []
  for i, m in zip(ids, mask, strict=True):
    if m:
      run.append(i)
    elif run:
      runs.append(tokenizer.decode(run))
      run = []
  if run:
    runs.append(tokenizer.decode(run))
  return runs


def test_assistant_mask_chatml(tokenizer, checkpoint):
  template = load_chat_template(str(checkpoint))
  ids, mask = encode_chat(tokenizer, template, CONVERSATION)
  assert ids == encode_with_specials(tokenizer, template.render(CONVERSATION))
  assert _trained_text(tokenizer, ids, mask) == ['A king.<|im_end|>',
                                                 'Of Denmark, good sir.<|im_end|>']
  im_end = tokenizer.eos_id
  # Every trained run ends with the end-of-turn token; the "\n" after it is not trained.
  assert [ids[k] for k in range(len(ids)) if mask[k] and not mask[k + 1]] == [im_end] * 2
  assert mask[-1] == 0 and tokenizer.decode(ids[-1:]) == '\n'
  # Exactly the content tokens plus one end-of-turn token per turn.
  contents = [a['content'] for a in CONVERSATION if a['role'] == 'assistant']
  assert sum(mask) == sum(len(tokenizer.encode(c)) + 1 for c in contents)


def test_assistant_mask_llama3(tokenizer):
  ids, mask = encode_chat(tokenizer, 'llama3', CONVERSATION)
  assert ids[0] == tokenizer.bos_id  # <|begin_of_text|> from the tokenizer config
  assert _trained_text(tokenizer, ids, mask) == ['A king.<|eot_id|>',
                                                 'Of Denmark, good sir.<|eot_id|>']
  assert mask[-1] == 1


def test_generation_markers(tokenizer):
  source = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>"
            "{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}")
  template = ChatTemplate(source)
  assert template.has_generation_markers
  assert '\x00' not in template.render(CONVERSATION)
  ids, mask = encode_chat(tokenizer, template, CONVERSATION)
  assert _trained_text(tokenizer, ids, mask) == ['A king.<|im_end|>',
                                                 'Of Denmark, good sir.<|im_end|>']
  ids, mask = encode_prompt_completion(tokenizer, CONVERSATION[:4], CONVERSATION[4:],
                                       template=template)
  assert _trained_text(tokenizer, ids, mask) == ['Of Denmark, good sir.<|im_end|>']


def test_non_incremental_template_is_an_error(tokenizer):
  # Earlier assistant turns lose their text once another message follows.
  source = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
            "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  with pytest.raises(ValueError, match='generation'):
    encode_chat(tokenizer, ChatTemplate(source), CONVERSATION)


def test_prompt_completion_text(tokenizer):
  ids, mask = encode_prompt_completion(tokenizer, 'To be, or not to be:', ' that is the question')
  assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
  prompt_len = 1 + len(tokenizer.encode('To be, or not to be:'))
  assert mask == [0] * prompt_len + [1] * (len(ids) - prompt_len)
  assert tokenizer.decode(ids[prompt_len:-1]) == ' that is the question'


def test_prompt_completion_messages(tokenizer):
  ids, mask = encode_prompt_completion(tokenizer, CONVERSATION[:4], 'Of Denmark, good sir.',
                                       template='chatml')
  assert _trained_text(tokenizer, ids, mask) == ['Of Denmark, good sir.<|im_end|>']
  whole, _ = encode_chat(tokenizer, 'chatml', CONVERSATION)
  assert ids == whole


def test_pieces_join_to_the_rendering():
  template = ChatTemplate(builtin_template('gemma'), bos_token='<bos>')
  pieces = chat_pieces(template, CONVERSATION)
  assert ''.join(t for t, _ in pieces) == template.render(CONVERSATION)
  assert [t for t, trained in pieces if trained] == ['A king.<end_of_turn>',
                                                     'Of Denmark, good sir.<end_of_turn>']


# --- packed SFT batches --------------------------------------------------------


def _records(tmp_path):
  records = [
      {'messages': CONVERSATION},
      {'messages': [{'role': 'user', 'content': 'Speak.'},
                    {'role': 'assistant', 'content': 'I will.'}]},
      {'prompt': 'Now is the winter', 'completion': ' of our discontent'},
      {'prompt': [{'role': 'user', 'content': 'Name a play.'}], 'completion': 'Hamlet.'},
  ]
  path = tmp_path / 'sft.jsonl'
  path.write_text('\n'.join(json.dumps(r) for r in records) + '\n')
  return str(path), records


@pytest.mark.parametrize('packing_mode', ['first_fit', 'none'])
def test_packed_sft_batches(tmp_path, checkpoint, tokenizer, packing_mode):
  path, records = _records(tmp_path)
  config = DataConfig(sources=(path,), packing=packing_mode, shuffle=False, num_epochs=1,
                      overlong='truncate')
  pipe = make_sft_pipeline(config, os.path.join(checkpoint, 'tokenizer.json'), batch_size=2,
                           seq_len=96, seed=0)
  batches = list(pipe)
  expected = {}
  for r in records:
    ids, mask = (encode_chat(tokenizer, 'chatml', r['messages']) if 'messages' in r else
                 encode_prompt_completion(tokenizer, r['prompt'], r['completion'],
                                          template='chatml'))
    expected[tuple(ids[:-1])] = (ids[1:], mask[1:])
  found = 0
  for batch in batches:
    assert set(batch) == {'inputs', 'targets', 'segment_ids', 'positions', 'loss_mask'}
    for row in range(batch['inputs'].shape[0]):
      seg = batch['segment_ids'][row]
      for s in set(seg.tolist()) - {0}:
        where = seg == s
        inputs = tuple(batch['inputs'][row][where].tolist())
        targets, mask = expected[inputs]  # a whole document: documents stay apart
        np.testing.assert_array_equal(batch['targets'][row][where], targets)
        np.testing.assert_array_equal(batch['loss_mask'][row][where], mask)
        np.testing.assert_array_equal(batch['positions'][row][where], np.arange(where.sum()))
        found += 1
      assert (batch['loss_mask'][row][seg == 0] == 0).all()
  assert found == len(records) if packing_mode == 'first_fit' else found == 4
  # Trained targets are exactly the assistant / completion tokens.
  trained = [tokenizer.decode(b['targets'][r][b['loss_mask'][r] == 1])
             for b in batches for r in range(2)]
  assert any('Of Denmark, good sir.<|im_end|>' in t for t in trained)
  assert not any('Who art thou' in t or 'winter' in t for t in trained)


def test_overlong_conversation_is_truncated_and_counted(tmp_path, checkpoint):
  path, records = _records(tmp_path)
  config = DataConfig(sources=(path,), packing='first_fit', shuffle=False, num_epochs=1,
                      overlong='truncate')
  pipe = make_sft_pipeline(config, str(checkpoint), batch_size=1, seq_len=24)
  batches = list(pipe)
  assert all(b['inputs'].shape == (1, 24) for b in batches)
  stats = pipe.stats
  assert stats['overlong'] >= 1 and stats['overlong_truncated'] == stats['overlong']
  assert stats['targets_dropped'] > 0


def test_bad_record_names_its_line(tmp_path, checkpoint):
  path = tmp_path / 'bad.jsonl'
  path.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{"text": "b"}\n')
  with pytest.raises(ValueError, match='bad.jsonl line 2: expected "messages"'):
    make_sft_pipeline(DataConfig(sources=(str(path),), shuffle=False, num_epochs=1),
                      str(checkpoint), batch_size=1, seq_len=16)  # before any batch


def test_split_keeps_loss_mask_aligned(tmp_path, checkpoint, tokenizer):
  path, _ = _records(tmp_path)
  config = DataConfig(sources=(path,), packing='none', shuffle=False, num_epochs=1,
                      overlong='split')
  batches = list(make_sft_pipeline(config, str(checkpoint), batch_size=1, seq_len=16))
  ids, mask = encode_chat(tokenizer, 'chatml', CONVERSATION)
  first_doc = batches[:-(-(len(ids) - 1) // 16)]  # its ceil(targets / 16) pieces
  targets = np.concatenate([b['targets'][0][b['segment_ids'][0] > 0] for b in first_doc])
  loss = np.concatenate([b['loss_mask'][0][b['segment_ids'][0] > 0] for b in first_doc])
  np.testing.assert_array_equal(targets, ids[1:])
  np.testing.assert_array_equal(loss, mask[1:])


def test_sft_pipeline_resumes(tmp_path, checkpoint):
  path, _ = _records(tmp_path)
  config = DataConfig(sources=(path,), num_epochs=None, overlong='truncate')
  make = lambda: make_sft_pipeline(config, str(checkpoint), batch_size=2, seq_len=64, seed=3)
  pipe = make()
  next(pipe)
  state = json.loads(json.dumps(pipe.get_state()))
  expected = [next(pipe) for _ in range(3)]
  resumed = make()
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


def test_trained_sentencepiece_has_single_chatml_pieces(tmp_path):
  from maxnnx.data import SentencePieceTokenizer, train_sentencepiece
  from maxnnx.data.chat import special_tokens
  text = tmp_path / 'text.txt'
  with open(DEFAULT_CORPUS, encoding='utf-8') as f:
    text.write_text(f.read()[:100_000], encoding='utf-8')
  tokenizer = SentencePieceTokenizer(train_sentencepiece(str(text), str(tmp_path / 'sp'), 400))
  specials = special_tokens(tokenizer)
  assert {'<s>', '</s>', '<|im_start|>', '<|im_end|>'} <= set(specials) and '\n' not in specials
  ids, mask = encode_chat(tokenizer, 'chatml', CONVERSATION[1:3])
  assert ids.count(specials['<|im_start|>']) == 2 and ids.count(specials['<|im_end|>']) == 2
  assert _trained_text(tokenizer, ids, mask) == ['A king.<|im_end|>']


# --- ShareGPT records, and data that would train on nothing --------------------

SHAREGPT = {'conversations': [{'from': 'system', 'value': 'Be brief.'},
                              {'from': 'human', 'value': 'Who art thou?'},
                              {'from': 'gpt', 'value': 'A king.'},
                              {'from': 'human', 'value': 'Of where?'},
                              {'from': 'gpt', 'value': 'Of Denmark, good sir.'}]}


def _jsonl(path, records):
  path.write_text(''.join(json.dumps(r) + '\n' for r in records), encoding='utf-8')
  return str(path)


def test_sharegpt_records_train_on_the_gpt_turns_like_messages(tmp_path, checkpoint, tokenizer):
  config = lambda path: DataConfig(sources=(path,), shuffle=False, num_epochs=1)
  batches = {}
  for name, record in (('sharegpt', SHAREGPT), ('messages', {'messages': CONVERSATION})):
    path = _jsonl(tmp_path / f'{name}.jsonl', [record])
    batches[name] = list(make_sft_pipeline(config(path), str(checkpoint), batch_size=1,
                                           seq_len=96))
  assert len(batches['sharegpt']) == len(batches['messages']) == 1
  for key in ('inputs', 'targets', 'loss_mask', 'segment_ids'):
    np.testing.assert_array_equal(batches['sharegpt'][0][key], batches['messages'][0][key])
  batch = batches['sharegpt'][0]
  trained = tokenizer.decode(batch['targets'][0][batch['loss_mask'][0] == 1])
  assert trained == 'A king.<|im_end|>Of Denmark, good sir.<|im_end|>'


def test_sharegpt_unknown_speaker_names_line_and_turn(tmp_path, checkpoint):
  bad = {'conversations': [{'from': 'human', 'value': 'Hi'}, {'from': 'bot', 'value': 'Hey'}]}
  path = _jsonl(tmp_path / 'chat.jsonl', [SHAREGPT, bad])
  with pytest.raises(ValueError, match=r'chat.jsonl line 2: "conversations"\[1\]: "from": '
                                       r'"bot" is not a ShareGPT role'):
    make_sft_pipeline(path, str(checkpoint), batch_size=1, seq_len=96)


def test_chats_without_assistant_turns_are_refused_before_any_batch(tmp_path, checkpoint):
  path = _jsonl(tmp_path / 'users.jsonl', [{'messages': CONVERSATION[:2]}] * 3)
  with pytest.raises(ValueError, match=r'users.jsonl: no record has a token to train on '
                                       r'\(no "assistant" message'):
    make_sft_pipeline(path, str(checkpoint), batch_size=1, seq_len=96)


def test_answers_cut_off_by_seq_len_are_refused_unless_split(tmp_path, checkpoint):
  long_prompt = [{'role': 'user', 'content': 'Who art thou? ' * 20},
                 {'role': 'assistant', 'content': 'A king.'}]
  path = _jsonl(tmp_path / 'long.jsonl', [{'messages': long_prompt}] * 3)
  with pytest.raises(ValueError, match=r'long.jsonl: no record has a trainable \(assistant\) '
                                       r'token within seq_len=16: data.overlong=truncate keeps '
                                       r'the first 16 targets .* set data.overlong=split'):
    make_sft_pipeline(path, str(checkpoint), batch_size=1, seq_len=16)
  split = DataConfig(sources=(path,), overlong='split', num_epochs=1)
  pipe = make_sft_pipeline(split, str(checkpoint), batch_size=1, seq_len=16)
  assert sum(b['loss_mask'].sum() for b in pipe) > 0


def test_non_string_content_names_line_and_message(tmp_path, checkpoint):
  records = [{'messages': CONVERSATION}] * 3 + [
      {'messages': [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 5}]}]
  path = _jsonl(tmp_path / 'chat.jsonl', records)
  with pytest.raises(ValueError, match=r'chat.jsonl line 4: "messages"\[1\].content is an int '
                                       r'\(5\); expected a string'):
    make_sft_pipeline(path, str(checkpoint), batch_size=1, seq_len=96)


def test_template_syntax_error_names_file_and_line(tmp_path, tokenizer):
  bad = ChatTemplate("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}",
                     origin='bad.jinja')
  with pytest.raises(ValueError, match=r"^bad.jinja line 2: syntax error in the chat template: "
                                       r"unexpected '}'"):
    encode_chat(tokenizer, bad, CONVERSATION)


def test_template_failing_on_a_record_is_one_value_error(tmp_path, checkpoint):
  """A template's raise_exception (here Gemma's user/assistant alternation) names the record's
  line and the template's, as a ValueError rather than a raw Jinja error."""
  template = ChatTemplate(builtin_template('gemma'), origin='gemma.jinja')
  path = _jsonl(tmp_path / 'chat.jsonl', [{'messages': CONVERSATION[1:]},
                                          {'messages': CONVERSATION[2:]}])
  pipe = make_sft_pipeline(DataConfig(sources=(path,), shuffle=False, num_epochs=1),
                           str(checkpoint), template, batch_size=1, seq_len=96)
  with pytest.raises(ValueError, match=r'chat.jsonl line 2: gemma.jinja line 1: rendering failed '
                                       r'\(TemplateError: Gemma conversations alternate'):
    list(pipe)

"""Preference (DPO) data: records -> (chosen, rejected) row pairs."""

import json

import numpy as np
import pytest

from maxnnx.data import encode_prompt_completion, load_tokenizer, make_preference_pipeline

TEXT_PAIRS = [
    {'prompt': 'Who comes here?', 'chosen': ' A friend, my lord.', 'rejected': ' Nobody.'},
    {'prompt': 'What news?', 'chosen': ' The king is well.', 'rejected': ' None at all, sir.'},
    {'prompt': 'Speak!', 'chosen': ' I will.', 'rejected': ' No.'},
    {'prompt': 'Where to?', 'chosen': ' To Verona.', 'rejected': ' Away.'},
]


def _write_jsonl(path, records):
  path.write_text(''.join(json.dumps(r) + '\n' for r in records), encoding='utf-8')
  return str(path)


@pytest.fixture(scope='module')
def tokenizer(chat_checkpoint):
  return load_tokenizer(str(chat_checkpoint))


def test_rows_are_chosen_then_rejected_with_completion_masks(tmp_path, tokenizer):
  data = _write_jsonl(tmp_path / 'prefs.jsonl', TEXT_PAIRS)
  pipeline = make_preference_pipeline(f'{data}', tokenizer, batch_size=4, seq_len=24, seed=3)
  batch = next(pipeline)
  assert {k: v.shape for k, v in batch.items()} == {
      k: (4, 24) for k in ('inputs', 'targets', 'segment_ids', 'positions', 'loss_mask')}
  seen = set()
  for pair in range(2):
    for side, row in (('chosen', 2 * pair), ('rejected', 2 * pair + 1)):
      n = int(batch['segment_ids'][row].sum())
      ids = [int(batch['inputs'][row, 0]), *batch['targets'][row, :n].tolist()]
      record = next(r for r in TEXT_PAIRS
                    if encode_prompt_completion(tokenizer, r['prompt'], r[side])[0] == ids)
      _, mask = encode_prompt_completion(tokenizer, record['prompt'], record[side])
      np.testing.assert_array_equal(batch['loss_mask'][row, :n], mask[1:])
      assert not batch['loss_mask'][row, n:].any() and not batch['segment_ids'][row, n:].any()
      np.testing.assert_array_equal(batch['positions'][row, :n], np.arange(n))
      seen.add((record['prompt'], side))
    assert (record['prompt'], 'chosen') in seen  # both rows of a pair come from one record
  assert pipeline.stats == {'pairs': 2, 'truncated': 0}


def test_conversational_records_use_the_template(tmp_path, tokenizer):
  record = {'prompt': [{'role': 'user', 'content': 'Who art thou?'}],
            'chosen': [{'role': 'assistant', 'content': 'A king.'}],
            'rejected': 'A fool.'}
  data = _write_jsonl(tmp_path / 'chat.jsonl', [record, record])
  batch = next(make_preference_pipeline(data, tokenizer, batch_size=2, seq_len=32))
  for row, answer in ((0, 'A king.<|im_end|>'), (1, 'A fool.<|im_end|>')):
    trained = batch['targets'][row][batch['loss_mask'][row] > 0]
    assert tokenizer.decode(trained.tolist()) == answer


def test_long_completion_is_cut_and_counted(tmp_path, tokenizer):
  record = {'prompt': 'Hi', 'chosen': ' word' * 40, 'rejected': ' no'}
  data = _write_jsonl(tmp_path / 'long.jsonl', [record])
  pipeline = make_preference_pipeline(data, tokenizer, batch_size=2, seq_len=16)
  batch = next(pipeline)
  assert batch['segment_ids'][0].all() and batch['loss_mask'][0, -1] == 1
  assert pipeline.stats == {'pairs': 1, 'truncated': 1}


@pytest.mark.parametrize('record, message', [
    ({'prompt': 'x', 'chosen': 'y'}, "missing 'rejected'"),
    ({'prompt': ' word' * 40, 'chosen': ' a', 'rejected': ' b'}, 'raise seq_len'),
])
def test_bad_records_name_their_line(tmp_path, tokenizer, record, message):
  data = _write_jsonl(tmp_path / 'bad.jsonl', [TEXT_PAIRS[0], record])
  with pytest.raises(ValueError, match=rf'bad.jsonl line 2: .*{message}'):
    next(make_preference_pipeline(_unshuffled(data), tokenizer, batch_size=4, seq_len=16))


def test_odd_batch_is_refused(tmp_path, tokenizer):
  data = _write_jsonl(tmp_path / 'prefs.jsonl', TEXT_PAIRS)
  with pytest.raises(ValueError, match='batch_size=3'):
    make_preference_pipeline(data, tokenizer, batch_size=3, seq_len=16)


def test_resumes_from_state(tmp_path, tokenizer):
  data = _write_jsonl(tmp_path / 'prefs.jsonl', TEXT_PAIRS)
  first = make_preference_pipeline(data, tokenizer, batch_size=2, seq_len=24, seed=1)
  next(first)
  state = first.get_state()
  expected = [next(first) for _ in range(3)]
  second = make_preference_pipeline(data, tokenizer, batch_size=2, seq_len=24, seed=1)
  second.set_state(state)
  for want in expected:
    got = next(second)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


def _unshuffled(path):
  from maxnnx.data import DataConfig
  return DataConfig.from_string(path, shuffle=False)


def test_chosen_equal_to_rejected_everywhere_is_refused_before_any_batch(tmp_path, tokenizer):
  same = [{**r, 'rejected': r['chosen']} for r in TEXT_PAIRS]
  data = _write_jsonl(tmp_path / 'same.jsonl', same)
  with pytest.raises(ValueError, match=r'same.jsonl: "chosen" equals "rejected" in every record '
                                       r'\(4\), so DPO has no preference to learn'):
    make_preference_pipeline(data, tokenizer, batch_size=2, seq_len=24)


def test_chosen_equal_to_rejected_in_some_records_is_counted(tmp_path, tokenizer, capsys):
  records = TEXT_PAIRS[:3] + [{**TEXT_PAIRS[3], 'rejected': TEXT_PAIRS[3]['chosen']}]
  data = _write_jsonl(tmp_path / 'prefs.jsonl', records)
  next(make_preference_pipeline(data, tokenizer, batch_size=2, seq_len=24))
  assert ('Warning: ' + data + ': "chosen" equals "rejected" in 1 of 4 records (the first: '
          + data + ' line 4)') in capsys.readouterr().out

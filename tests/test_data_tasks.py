"""The shipped who-speaks-this-line task: reproducible from the corpus, disjoint splits."""

import filecmp

import pytest

from maxnnx.data.tasks import SPEAKER_TASK, accuracy, read_records, write_speaker_task


def test_the_script_rewrites_the_shipped_files(tmp_path):
  written = write_speaker_task(str(tmp_path))
  for split, path in written.items():
    assert filecmp.cmp(path, SPEAKER_TASK[split], shallow=False), split


def test_splits_are_disjoint_and_answers_are_the_speakers():
  train, test = (read_records(SPEAKER_TASK[s]) for s in ('train', 'test'))
  questions = [{r['messages'][0]['content'] for r in rs} for rs in (train, test)]
  assert not questions[0] & questions[1]
  assert len(questions[0]) == len(train) and len(questions[1]) == len(test)
  answers = {r['messages'][1]['content'] for r in train + test}
  assert len(answers) == 8 and 'ROMEO' in answers
  with open(SPEAKER_TASK['train'].replace('speakers_train.jsonl', 'tinyshakespeare.txt')) as f:
    corpus = f.read()
  record = test[0]['messages']
  line = record[0]['content'].split('"')[1]
  assert f"{record[1]['content']}:\n{line}" in corpus


def test_accuracy_is_exact_match():
  records = [{'messages': [{'role': 'user', 'content': 'q'},
                           {'role': 'assistant', 'content': name}]} for name in ('A', 'B')]
  assert accuracy([' A\n', 'C'], records) == 0.5
  with pytest.raises(ValueError, match='1 replies for 2 records'):
    accuracy(['A'], records)


def test_preferences_reject_another_speaker():
  from maxnnx.data.tasks import speaker_preferences
  records = read_records(SPEAKER_TASK['test'])
  pairs = speaker_preferences(records, seed=1)
  assert len(pairs) == len(records)
  for pair, record in zip(pairs, records):
    assert pair['prompt'] == record['messages'][:1]
    assert pair['chosen'] == record['messages'][1]['content'] != pair['rejected']
  assert speaker_preferences(records, seed=1) == pairs

"""The shipped tasks (who speaks this line, which word ends it): reproducible from the corpus,
disjoint splits."""

import filecmp

import pytest

from maxnnx.data.tasks import (
  LAST_WORD_TASK,
  SPEAKER_TASK,
  accuracy,
  main,
  read_records,
  write_speaker_task,
)


def test_the_script_rewrites_the_shipped_files(tmp_path):
  assert main([str(tmp_path)]) == 0
  for name, task in (('speakers', SPEAKER_TASK), ('last_word', LAST_WORD_TASK)):
    for split in ('train', 'test'):
      written = tmp_path / f'{name}_{split}.jsonl'
      assert filecmp.cmp(written, task[split], shallow=False), (name, split)
  assert write_speaker_task(str(tmp_path / 'again'))['test'].endswith('speakers_test.jsonl')


def test_last_words_are_read_off_their_lines():
  train, test = (read_records(LAST_WORD_TASK[s]) for s in ('train', 'test'))
  assert (len(train), len(test)) == (2000, 200)
  lines = [[r['messages'][0]['content'].split('"')[1] for r in rs] for rs in (train, test)]
  assert not set(lines[0]) & set(lines[1]) and len(set(lines[0])) == len(train)
  with open(SPEAKER_TASK['train'].replace('speakers_train.jsonl', 'tinyshakespeare.txt')) as f:
    corpus = f.read()
  for line, record in zip(lines[1], test):
    words, answer = line.split(), record['messages'][1]['content']
    assert 4 <= len(words) <= 8 and answer.isalpha() and f'\n{line}\n' in corpus
    assert words[-1].startswith(answer) and not words[-1][len(answer):].isalpha()


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

"""Small fine-tuning tasks made from the shipped corpus.

**Who speaks this line?**

Each speech of the Shakespeare corpus starts with its speaker's name on a line
of its own. :func:`speaker_task` keeps the speeches of the most frequent
speakers and turns each into a chat::

  user:      Which character says: "Now is the winter of our discontent"?
  assistant: GLOUCESTER

split deterministically (by a hash of the line) into train and held-out
records. The package ships the result as ``speakers_train.jsonl`` and
``speakers_test.jsonl`` (:data:`SPEAKER_TASK`); ``python -m maxnnx.data.tasks
OUT_DIR`` writes them again, byte for byte.

**Which word ends this line?** (:func:`last_word_task`, shipped as
``last_word_train.jsonl`` / ``last_word_test.jsonl``, :data:`LAST_WORD_TASK`)::

  user:      Which word ends this line: "Now is the winter of our discontent"?
  assistant: discontent

Unlike the speaker, the answer can be read off the prompt, so what a model learns on some
lines carries over to lines it never saw: the task on which reinforcement learning
(``maxnnx grpo`` with ``maxnnx.rl.rewards:exact_match``) shows its effect on a small model.

:func:`speaker_preferences` turns the chats into DPO pairs (the right speaker chosen, another
rejected). :func:`accuracy` scores replies against the held-out answers (exact match after
stripping whitespace).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import sys
from collections.abc import Sequence

from maxnnx.data.text import DEFAULT_CORPUS

_CORPUS_DIR = os.path.dirname(DEFAULT_CORPUS)
#: The shipped task files: ``{'train': path, 'test': path}``.
SPEAKER_TASK = {split: os.path.join(_CORPUS_DIR, f'speakers_{split}.jsonl')
                for split in ('train', 'test')}
QUESTION = 'Which character says: "{line}"?'
#: The shipped last-word task files: ``{'train': path, 'test': path}``.
LAST_WORD_TASK = {split: os.path.join(_CORPUS_DIR, f'last_word_{split}.jsonl')
                  for split in ('train', 'test')}
LAST_WORD_QUESTION = 'Which word ends this line: "{line}"?'


def _speeches(text: str) -> list[tuple[str, str]]:
  """``(speaker, first line)`` of every speech (a block ``NAME:\\nline...``)."""
  speeches = []
  for block in text.split('\n\n'):
    lines = block.strip('\n').split('\n')
    if len(lines) >= 2 and lines[0].endswith(':') and lines[1].strip():
      speeches.append((lines[0][:-1], lines[1].strip()))
  return speeches


def speaker_task(corpus: str = DEFAULT_CORPUS, *, speakers: int = 8, min_words: int = 4,
                 test_fraction: float = 0.15) -> tuple[list[dict], list[dict]]:
  """``(train records, test records)`` of the who-speaks-this-line task.

  Args:
    corpus: a text file of ``NAME:`` speeches separated by blank lines.
    speakers: how many of the most frequent speakers to keep.
    min_words: speeches whose first line has fewer words are left out.
    test_fraction: share of the records held out (chosen by a hash of the line).

  Records are chats ``{"messages": [user question, assistant answer]}``, each
  question's line appearing once in the whole task.
  """
  with open(corpus, encoding='utf-8') as f:
    speeches = _speeches(f.read())
  counts = collections.Counter(name for name, _ in speeches)
  kept = {name for name, _ in counts.most_common(speakers)}
  seen, train, test = set(), [], []
  for name, line in speeches:
    if name not in kept or len(line.split()) < min_words or line in seen:
      continue
    seen.add(line)
    record = {'messages': [{'role': 'user', 'content': QUESTION.format(line=line)},
                           {'role': 'assistant', 'content': name}]}
    (test if _split(line, test_fraction) == 'test' else train).append(record)
  return train, test


def _split(key: str, test_fraction: float) -> str:
  """``'test'`` or ``'train'``, chosen by a hash of ``key`` (stable across runs and machines)."""
  bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0x100000000
  return 'test' if bucket < test_fraction else 'train'


def last_word_task(corpus: str = DEFAULT_CORPUS, *, min_words: int = 4, max_words: int = 8,
                   train_size: int = 2000, test_size: int = 200,
                   test_fraction: float = 0.1) -> tuple[list[dict], list[dict]]:
  """``(train records, test records)`` of the which-word-ends-this-line task.

  Args:
    corpus: a text file of ``NAME:`` speeches separated by blank lines.
    min_words, max_words: the range of line lengths kept, in words.
    train_size, test_size: at most this many records per split (the first in corpus order).
    test_fraction: share of the lines held out (chosen by a hash of the line).

  Every line of a speech whose last word, without its trailing punctuation, is made of
  letters becomes a chat ``{"messages": [user question, assistant answer]}``; each line
  appears once in the whole task.
  """
  with open(corpus, encoding='utf-8') as f:
    text = f.read()
  seen, splits = set(), {'train': [], 'test': []}
  sizes = {'train': train_size, 'test': test_size}
  for block in text.split('\n\n'):
    for line in block.strip('\n').split('\n')[1:]:
      line = line.strip()
      words = line.split()
      if not min_words <= len(words) <= max_words or line in seen:
        continue
      answer = re.sub(r'[^A-Za-z]+$', '', words[-1])
      if not answer.isalpha():
        continue
      seen.add(line)
      split = _split(line, test_fraction)
      if len(splits[split]) < sizes[split]:
        splits[split].append(
            {'messages': [{'role': 'user', 'content': LAST_WORD_QUESTION.format(line=line)},
                          {'role': 'assistant', 'content': answer}]})
  return splits['train'], splits['test']


def _write_task(directory: str, name: str, splits: tuple[list[dict], list[dict]]
                ) -> dict[str, str]:
  """Write ``<name>_train.jsonl`` and ``<name>_test.jsonl`` into ``directory``."""
  os.makedirs(directory, exist_ok=True)
  paths = {}
  for split, records in zip(('train', 'test'), splits):
    paths[split] = os.path.join(directory, f'{name}_{split}.jsonl')
    with open(paths[split], 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(r, ensure_ascii=False) + '\n' for r in records)
  return paths


def write_speaker_task(directory: str, **kwargs) -> dict[str, str]:
  """Write ``speakers_train.jsonl`` and ``speakers_test.jsonl`` into ``directory``;
  returns their paths by split. ``kwargs`` go to :func:`speaker_task`."""
  return _write_task(directory, 'speakers', speaker_task(**kwargs))


def write_last_word_task(directory: str, **kwargs) -> dict[str, str]:
  """Write ``last_word_train.jsonl`` and ``last_word_test.jsonl`` into ``directory``;
  returns their paths by split. ``kwargs`` go to :func:`last_word_task`."""
  return _write_task(directory, 'last_word', last_word_task(**kwargs))


def speaker_preferences(records: Sequence[dict], *, seed: int = 0) -> list[dict]:
  """Preference records for DPO from task chats: the prompt is the question, ``chosen``
  the right speaker and ``rejected`` another of the task's speakers (picked with ``seed``)."""
  import random  # noqa: PLC0415
  rng = random.Random(seed)
  names = sorted({r['messages'][-1]['content'] for r in records})
  if len(names) < 2:
    raise ValueError('speaker_preferences needs records of at least two speakers.')
  pairs = []
  for record in records:
    answer = record['messages'][-1]['content']
    wrong = rng.choice([n for n in names if n != answer])
    pairs.append({'prompt': record['messages'][:-1], 'chosen': answer, 'rejected': wrong})
  return pairs


def read_records(path: str) -> list[dict]:
  """The JSON records of a JSONL file."""
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


def accuracy(replies: Sequence[str], records: Sequence[dict]) -> float:
  """Share of ``replies`` equal (whitespace stripped) to their record's last assistant turn."""
  if len(replies) != len(records):
    raise ValueError(f'{len(replies)} replies for {len(records)} records.')
  answers = [r['messages'][-1]['content'].strip() for r in records]
  return sum(a == b.strip() for a, b in zip(answers, replies)) / max(len(records), 1)


def main(argv: list[str] | None = None) -> int:
  """``python -m maxnnx.data.tasks OUT_DIR``: write the task files (both tasks)."""
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1:
    print('usage: python -m maxnnx.data.tasks OUT_DIR', file=sys.stderr)
    return 2
  for write in (write_speaker_task, write_last_word_task):
    for split, path in write(argv[0]).items():
      print(f'{split}: {path} ({len(read_records(path))} records)')
  return 0


if __name__ == '__main__':
  sys.exit(main())

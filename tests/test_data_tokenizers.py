"""Tokenizers: each format is built here, loaded by file type and checked against its library."""

import base64
import json

import numpy as np
import pytest
import sentencepiece as spm
import tiktoken
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from maxnnx.data import (
    DEFAULT_CORPUS,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    load_tokenizer,
    train_sentencepiece,
)
from maxnnx.data.text import sentences

SAMPLES = ['Hello, world!', 'First Citizen:\nBefore we proceed any further, hear me speak.',
           '  spaces,\ttabs and ünïcödé 日本語 🙂', '<|end_of_text|> is just text here', '']


def _corpus_lines(n=400):
  with open(DEFAULT_CORPUS, encoding='utf-8') as f:
    return f.read().split('\n')[:n]


@pytest.fixture
def hf_dir(tmp_path):
  """A byte-level BPE trained here, saved like a Hugging Face checkpoint directory."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=['<pad>', '<s>', '</s>'],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_corpus_lines(), trainer)
  # A post-processor that adds <s>, as Llama's does: encode() must not apply it.
  tok.post_processor = processors.TemplateProcessing(single='<s> $A', special_tokens=[('<s>', 1)])
  tok.save(str(tmp_path / 'tokenizer.json'))
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(
      {'bos_token': {'content': '<s>'}, 'eos_token': '</s>', 'pad_token': '<pad>'}))
  (tmp_path / 'config.json').write_text('{}')
  return tmp_path


def test_hf_tokenizer_matches_the_library_and_round_trips(hf_dir):
  tok = load_tokenizer(str(hf_dir))
  assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
  backend = tokenizers.Tokenizer.from_file(str(hf_dir / 'tokenizer.json'))
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)
  assert tok.vocab_size == backend.get_vocab_size(with_added_tokens=True)
  for text in SAMPLES:
    ids = tok.encode(text)
    assert ids == backend.encode(text, add_special_tokens=False).ids
    assert tok.bos_id not in ids  # no special tokens added
    assert tok.decode(ids) == text
  assert backend.encode('Hello').ids[0] == 1  # the library itself would have added <s>


def test_hf_tokenizer_special_tokens_can_be_named(hf_dir):
  tok = HFTokenizer(str(hf_dir / 'tokenizer.json'), eos_token='<pad>')
  assert tok.eos_id == 0
  with pytest.raises(ValueError, match="bos_token='<bos>' is not in the vocabulary"):
    HFTokenizer(str(hf_dir), bos_token='<bos>')


def _write_tiktoken(path, merges=(b'th', b'he', b'the', b' t', b' th', b' the')):
  ranks = {bytes([i]): i for i in range(256)}
  for token in merges:
    ranks[token] = len(ranks)
  with open(path, 'w') as f:
    for token, rank in ranks.items():
      f.write(f'{base64.b64encode(token).decode()} {rank}\n')
  return ranks


@pytest.mark.parametrize('name', ['bpe.tiktoken', 'tokenizer.model'])
def test_tiktoken_file_matches_the_library(tmp_path, name):
  """A Llama-3-style BPE file (even named tokenizer.model) loads as tiktoken."""
  path = tmp_path / name
  ranks = _write_tiktoken(path)
  tok = load_tokenizer(str(path))
  assert isinstance(tok, TiktokenTokenizer)
  reference = tiktoken.Encoding('ref', pat_str=tok.encoding._pat_str, mergeable_ranks=ranks,
                                special_tokens={'<|begin_of_text|>': 262, '<|end_of_text|>': 263})
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (262, 263, None, 264)
  # BPE by hand: "the" merges t+h -> th -> the (258); " the" ends as " the" (261).
  assert tok.encode('the the') == [258, 261]
  for text in SAMPLES:
    ids = tok.encode(text)
    assert ids == reference.encode(text, disallowed_special=())
    assert 263 not in ids  # special-token strings in data stay plain text
    assert tok.decode(ids) == text


def test_tiktoken_special_tokens_and_bad_files(tmp_path):
  path = tmp_path / 'bpe.tiktoken'
  _write_tiktoken(path)
  tok = TiktokenTokenizer(str(path), special_tokens={'<bos>': 300, '<eos>': 301, '<pad>': 302},
                          bos_token='<bos>', eos_token='<eos>', pad_token='<pad>')
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (300, 301, 302, 303)
  with pytest.raises(ValueError, match='collide with BPE ranks'):
    TiktokenTokenizer(str(path), special_tokens={'<bos>': 5})
  with pytest.raises(ValueError, match="eos_token='<eot>' is not among"):
    TiktokenTokenizer(str(path), eos_token='<eot>')
  bad = tmp_path / 'bad.tiktoken'
  bad.write_text('dGhl 1\nnot-a-line\n')
  with pytest.raises(ValueError, match='line 2: expected'):
    load_tokenizer(str(bad))


def test_sentencepiece_matches_the_library(tmp_path):
  path = train_sentencepiece(DEFAULT_CORPUS, str(tmp_path / 'sp'), 400)
  tok = load_tokenizer(str(tmp_path / 'sp.model'))
  assert isinstance(tok, SentencePieceTokenizer) and isinstance(tok, Tokenizer)
  processor = spm.SentencePieceProcessor(model_file=path)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size == processor.get_piece_size() == 400
  for text in SAMPLES:
    ids = tok.encode(text)
    assert ids == processor.encode(text)
    assert tok.decode(np.asarray(ids)) == text


def test_sentencepiece_trains_on_a_file_of_one_long_line(tmp_path):
  """sentencepiece skips lines over 64 KiB; a 3 MB one-line corpus is cut into shorter
  sentences for it instead of leaving it nothing to train on."""
  with open(DEFAULT_CORPUS, encoding='utf-8') as f:
    text = f.read().replace('\n', ' ')
  one_line = tmp_path / 'one_line.txt'
  one_line.write_text((text * (3_000_000 // len(text) + 1))[:3_000_000], encoding='utf-8')
  tok = load_tokenizer(train_sentencepiece(str(one_line), str(tmp_path / 'sp'), 400))
  assert tok.vocab_size == 400
  sample = text[:2000]
  ids = tok.encode(sample)
  assert tok.decode(np.asarray(ids)) == sample and len(ids) < 0.8 * len(sample)  # merges


def test_long_lines_are_cut_at_spaces_for_the_tokenizer_trainer(tmp_path):
  path = tmp_path / 'text.txt'
  long_words, no_space = ' '.join(['word'] * 30), 'x' * 25
  path.write_text(f'short\n{long_words}\n\n{no_space}\n', encoding='utf-8')
  pieces = list(sentences(str(path), limit=20))
  assert all(len(p) <= 20 for p in pieces)
  assert pieces[0] == 'short' and pieces[-3:] == ['', 'x' * 20, 'x' * 5]
  assert ''.join(pieces[1:-3]) == long_words
  assert all(p.startswith(' ') for p in pieces[2:-3])  # each cut before a space


def test_load_tokenizer_picks_by_directory_contents_and_fails_clearly(tmp_path, hf_dir):
  sp_dir = tmp_path / 'sp_ckpt'
  sp_dir.mkdir()
  train_sentencepiece(DEFAULT_CORPUS, str(sp_dir / 'tokenizer'), 400)
  assert isinstance(load_tokenizer(str(sp_dir)), SentencePieceTokenizer)
  (hf_dir / 'tokenizer.model').write_bytes((sp_dir / 'tokenizer.model').read_bytes())
  assert isinstance(load_tokenizer(str(hf_dir)), HFTokenizer)  # tokenizer.json wins
  (tmp_path / 'empty').mkdir()
  with pytest.raises(FileNotFoundError, match='no tokenizer.json or tokenizer.model'):
    load_tokenizer(str(tmp_path / 'empty'))
  junk = tmp_path / 'junk.model'
  junk.write_bytes(b'\x00\x01 definitely not a model')
  with pytest.raises(ValueError, match='not a tokenizer.json, tiktoken BPE or sentencepiece'):
    load_tokenizer(str(junk))
  with pytest.raises(FileNotFoundError):
    load_tokenizer(str(tmp_path / 'missing.json'))

"""Plain-text corpora: a sentencepiece tokenizer and random training windows.

The simplest real input path: tokenize a UTF-8 text file once, then draw
``[batch, seq_len + 1]`` windows from the token stream with a seeded generator
(the same seed gives the same batches). Inputs are the first ``seq_len`` ids of
a window, targets the last ``seq_len``.
"""

import os

import numpy as np
import sentencepiece as spm

from maxnnx import paths
from maxnnx.data.tokenizer import SentencePieceTokenizer  # noqa: F401  (its old home)

DEFAULT_CORPUS = os.path.join(os.path.dirname(__file__), 'corpus', 'tinyshakespeare.txt')


def read_text(path: str) -> str:
  """The text of a UTF-8 file (a local path or a data URL, see
  :func:`maxnnx.paths.read_data_bytes`), with clear errors for missing, empty or binary files."""
  if paths.is_remote(path):
    raw = paths.read_data_bytes(path)
  else:
    if not os.path.isfile(paths.normalize(path)):
      raise FileNotFoundError(f'{path}: no such text file.')
    raw = paths.read_data_bytes(path)
  try:
    text = raw.decode('utf-8')
  except UnicodeDecodeError as e:
    line = raw[:e.start].count(b'\n') + 1
    raise ValueError(f'{path}: not UTF-8 (byte {e.start}, line {line}).') from None
  if not text.strip():
    raise ValueError(f'{path}: the file is empty.')
  return text


#: Pieces :func:`train_sentencepiece` reserves for chat templates (ChatML's turn markers).
CHAT_PIECES = ('<|im_start|>', '<|im_end|>')


def train_sentencepiece(text_path: str, model_prefix: str, vocab_size: int) -> str:
  """Train a BPE sentencepiece model on ``text_path``; returns the ``.model`` path.

  Byte fallback keeps every input encodable; ids 0-3 are pad, bos, eos and unk. ChatML's
  ``<|im_start|>`` and ``<|im_end|>`` are single pieces (:data:`CHAT_PIECES`), so a model
  pre-trained with it can be fine-tuned on chats with the ``chatml`` template.
  """
  read_text(text_path)  # validate before sentencepiece sees it
  try:
    _train(text_path, model_prefix, vocab_size)
  except RuntimeError as e:
    if 'Vocabulary size is smaller than required' in str(e):
      raise ValueError(f'vocab_size={vocab_size} is too small for {text_path}: it needs room '
                       f'for 256 byte pieces plus every character ({e}).') from None
    raise
  return model_prefix + '.model'


MAX_SENTENCE_CHARS = 1 << 14
"""Longest line the tokenizer trainer is given: sentencepiece skips lines over 64 KiB
(``max_sentence_length``), and a character takes at most 4 bytes, so longer lines are cut
(at a space where one is near) rather than lost."""


def sentences(text_path: str, limit: int = MAX_SENTENCE_CHARS):
  """The lines of ``text_path`` (without their line break), each cut into pieces of at most
  ``limit`` characters, at the last space in the second half of the limit when there is one."""
  with open(text_path, encoding='utf-8', newline='\n') as f:
    for line in f:
      line = line.removesuffix('\n')
      while len(line) > limit:
        cut = line.rfind(' ', limit // 2, limit)
        cut = cut if cut > 0 else limit
        yield line[:cut]
        line = line[cut:]
      yield line


def _train(text_path: str, model_prefix: str, vocab_size: int) -> None:
  spm.SentencePieceTrainer.train(
      sentence_iterator=sentences(text_path), model_prefix=model_prefix,
      vocab_size=vocab_size, model_type='bpe',
      character_coverage=1.0, byte_fallback=True, bos_id=1, eos_id=2, pad_id=0, unk_id=3,
      hard_vocab_limit=False, num_threads=2, minloglevel=2, split_digits=True,
      # Keep the text exactly (line breaks and spacing matter in verse and code).
      normalization_rule_name='identity', remove_extra_whitespaces=False,
      user_defined_symbols=['\n', *CHAT_PIECES], allow_whitespace_only_pieces=True,
      max_sentence_length=1 << 16)


class TokenWindows:
  """Seeded random ``[batch, seq_len + 1]`` windows of a token stream.

  The last ``eval_fraction`` of the stream is held out for :meth:`eval_batches`.
  ``rows=(start, count)`` keeps rows ``start .. start + count - 1`` of every batch
  of ``batch_size`` (training and held-out): one process's share of a global batch
  that every process draws alike. It is a :class:`~maxnnx.data.protocol.DataSource` (an
  iterator of batches) with a position (``get_state``) and a held-out split.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, *, seed: int = 0,
               eval_fraction: float = 0.05, rows: tuple[int, int] | None = None):
    tokens = np.asarray(tokens, np.int32)
    split = int(len(tokens) * (1 - eval_fraction))
    self.train, self.eval = tokens[:split], tokens[split:]
    if len(self.train) <= seq_len + 1 or len(self.eval) <= seq_len + 1:
      raise ValueError(f'The corpus has {len(tokens)} tokens: too few for seq_len={seq_len} '
                       f'with a {eval_fraction:.0%} held-out split. Use a shorter seq_len.')
    self.seq_len, self.batch_size = seq_len, batch_size
    self.rng = np.random.default_rng(seed)
    start, count = (0, batch_size) if rows is None else rows
    if not (0 <= start and count >= 1 and start + count <= batch_size):
      raise ValueError(f'TokenWindows rows={rows}: rows start .. start + count - 1 must lie in '
                       f'a batch of {batch_size}.')
    self._rows = slice(start, start + count)

  def _windows(self, stream, starts):
    return np.stack([stream[s:s + self.seq_len + 1] for s in starts[self._rows]])

  def next(self) -> np.ndarray:
    """The next training batch ``[batch, seq_len + 1]``."""
    starts = self.rng.integers(0, len(self.train) - self.seq_len - 1, self.batch_size)
    return self._windows(self.train, starts)

  def __iter__(self):
    return self

  def __next__(self) -> np.ndarray:
    return self.next()

  def get_state(self) -> dict:
    """The position in the stream (the random generator's state), JSON-serialisable."""
    return {'rng': self.rng.bit_generator.state}

  def set_state(self, state: dict) -> None:
    """Continue exactly after the batch where :meth:`get_state` was taken."""
    self.rng.bit_generator.state = state['rng']

  def eval_batches(self, num_batches: int) -> list[np.ndarray]:
    """Fixed, evenly spaced held-out batches (the same on every call)."""
    count = num_batches * self.batch_size
    starts = np.linspace(0, len(self.eval) - self.seq_len - 1, count).astype(int)
    return [self._windows(self.eval, starts[i::num_batches]) for i in range(num_batches)]

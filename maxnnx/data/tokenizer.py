"""Tokenizers behind one small interface, and ``load_tokenizer`` to pick one by file.

Every tokenizer here has ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``vocab_size`` and the ``bos_id`` / ``eos_id`` / ``pad_id`` special ids (``None``
where the vocabulary has no such token). ``encode`` never adds special tokens
and treats special-token strings in the text as plain text: the data pipeline
adds BOS/EOS itself (``DataConfig.add_bos`` / ``add_eos``), so a document that
happens to contain ``"<|end_of_text|>"`` cannot end itself early.

Three formats are read:

* sentencepiece ``.model`` files (Llama 2, Gemma, Mistral; what ``maxnnx train`` writes);
* Hugging Face ``tokenizer.json`` (the ``tokenizers`` package); the special
  tokens are read from ``tokenizer_config.json`` beside it when present;
* tiktoken-format BPE files (one ``base64(token) rank`` line per token, e.g.
  Llama 3's ``original/tokenizer.model``), with a pre-tokenization pattern
  (default :data:`LLAMA3_PATTERN`) and special tokens numbered after the ranks.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from maxnnx import paths


@runtime_checkable
class Tokenizer(Protocol):
  """What the data pipeline and ``generate`` helpers need from a tokenizer."""

  @property
  def vocab_size(self) -> int:
    """One more than the largest id ``encode`` can return."""

  @property
  def bos_id(self) -> int | None:
    """Beginning-of-document id (``None``: the vocabulary has none)."""

  @property
  def eos_id(self) -> int | None:
    """End-of-document id (``None``: the vocabulary has none)."""

  @property
  def pad_id(self) -> int | None:
    """Padding id (``None``: the vocabulary has none; pipelines pad with 0)."""

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text``, without special tokens."""

  def decode(self, ids) -> str:
    """Text of ``ids``."""


class SentencePieceTokenizer:
  """A sentencepiece ``.model`` file: ``encode(text) -> ids``, ``decode(ids) -> text``."""

  def __init__(self, model_path: str):
    import sentencepiece as spm
    if not os.path.isfile(model_path):
      raise FileNotFoundError(f'{model_path}: no such sentencepiece model.')
    self.path = model_path
    self.processor = spm.SentencePieceProcessor(model_file=model_path)

  @property
  def vocab_size(self) -> int:
    return self.processor.get_piece_size()

  @property
  def bos_id(self) -> int | None:
    return _optional_id(self.processor.bos_id())

  @property
  def eos_id(self) -> int | None:
    return _optional_id(self.processor.eos_id())

  @property
  def pad_id(self) -> int | None:
    return _optional_id(self.processor.pad_id())

  def encode(self, text: str) -> list[int]:
    return self.processor.encode(text)

  def decode(self, ids) -> str:
    return self.processor.decode([int(i) for i in ids])


def _optional_id(i: int) -> int | None:
  return None if i < 0 else i


class _SpecialIds:
  """``bos_id``/``eos_id``/``pad_id`` read from ``self._ids`` (``None`` when absent)."""

  _ids: dict[str, int | None]

  @property
  def bos_id(self) -> int | None:
    return self._ids['bos_token']

  @property
  def eos_id(self) -> int | None:
    return self._ids['eos_token']

  @property
  def pad_id(self) -> int | None:
    return self._ids['pad_token']


_LONG_TEXT = 1 << 14  # characters from which HFTokenizer.encode lets other threads run


class HFTokenizer(_SpecialIds):
  """A Hugging Face ``tokenizer.json`` (read with the ``tokenizers`` package).

  Args:
    path: the ``tokenizer.json`` file, or a checkpoint directory holding it.
    bos_token, eos_token, pad_token: special-token strings; by default they come
      from ``tokenizer_config.json`` (or ``special_tokens_map.json``) beside the
      file. A token the vocabulary lacks is an error.
  """

  def __init__(self, path: str, *, bos_token: str | None = None, eos_token: str | None = None,
               pad_token: str | None = None):
    import tokenizers
    if os.path.isdir(path):
      path = os.path.join(path, 'tokenizer.json')
    if not os.path.isfile(path):
      raise FileNotFoundError(f'{path}: no such tokenizer.json.')
    self.path = path
    try:
      self.backend = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises a bare Exception on bad JSON
      raise ValueError(f'{path}: not a Hugging Face tokenizer.json ({e}).') from None
    names = _special_token_names(os.path.dirname(path))
    given = {'bos_token': bos_token, 'eos_token': eos_token, 'pad_token': pad_token}
    self._ids = {}
    for key, token in given.items():
      token = token if token is not None else names.get(key)
      token_id = None if token is None else self.backend.token_to_id(token)
      if token is not None and token_id is None and given[key] is not None:
        raise ValueError(f'{key}={token!r} is not in the vocabulary of {path}.')
      self._ids[key] = token_id

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    """``text`` as ids; a long text is encoded with the GIL released (``encode_batch``), so
    other threads (a server's event loop) run meanwhile."""
    if len(text) < _LONG_TEXT:
      return self.backend.encode(text, add_special_tokens=False).ids
    return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

  def decode(self, ids) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)


def _special_token_names(directory: str) -> dict[str, str]:
  """``bos_token`` / ``eos_token`` / ``pad_token`` strings from the HF side files."""
  names = {}
  for file in ('special_tokens_map.json', 'tokenizer_config.json'):  # the latter wins
    path = os.path.join(directory, file)
    if not os.path.isfile(path):
      continue
    with open(path, encoding='utf-8') as f:
      data = json.load(f)
    for key in ('bos_token', 'eos_token', 'pad_token'):
      value = data.get(key)
      if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get('content')
      if isinstance(value, str):
        names[key] = value
  return names


# Llama 3's pre-tokenization pattern: contractions, letter runs, 1-3 digit groups,
# punctuation runs, newlines and other whitespace.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL_TOKENS = ('<|begin_of_text|>', '<|end_of_text|>')


class TiktokenTokenizer(_SpecialIds):
  """A tiktoken-format BPE file read from a local path (with the ``tiktoken`` package).

  The file holds one ``base64(token bytes) rank`` pair per line; ranks are the
  token ids and the merge priority. Special tokens get the ids after the
  largest rank, in the order given, unless given as a ``{token: id}`` mapping.
  The defaults reproduce Llama 3 (``<|begin_of_text|>`` = 128000,
  ``<|end_of_text|>`` = 128001 on its 128,000-rank file).

  Args:
    path: the BPE file.
    pattern: the regex splitting text into pre-tokens before BPE (tiktoken's
      ``pat_str``); default :data:`LLAMA3_PATTERN`.
    special_tokens: names (numbered after the ranks) or a ``{name: id}`` mapping.
    bos_token, eos_token, pad_token: which special tokens play those roles
      (``None``: none).
  """

  def __init__(self, path: str, *, pattern: str = LLAMA3_PATTERN,
               special_tokens: Sequence[str] | Mapping[str, int] = LLAMA3_SPECIAL_TOKENS,
               bos_token: str | None = '<|begin_of_text|>',
               eos_token: str | None = '<|end_of_text|>', pad_token: str | None = None):
    import tiktoken
    self.path = path
    ranks = read_tiktoken_ranks(path)
    if isinstance(special_tokens, Mapping):
      specials = dict(special_tokens)
    else:
      first = max(ranks.values()) + 1
      specials = {name: first + i for i, name in enumerate(special_tokens)}
    clash = set(specials.values()) & set(ranks.values())
    if clash:
      raise ValueError(f'special token ids {sorted(clash)} collide with BPE ranks in {path}.')
    self.special_tokens = specials
    self._ids = {}
    for role, token in (('bos_token', bos_token), ('eos_token', eos_token),
                        ('pad_token', pad_token)):
      if token is not None and token not in specials:
        raise ValueError(f'{role}={token!r} is not among the special tokens '
                         f'{sorted(specials)}; pass special_tokens= to add it.')
      self._ids[role] = None if token is None else specials[token]
    self.encoding = tiktoken.Encoding(os.path.basename(path), pat_str=pattern,
                                      mergeable_ranks=ranks, special_tokens=specials)

  @property
  def vocab_size(self) -> int:
    return self.encoding.max_token_value + 1

  def encode(self, text: str) -> list[int]:
    # Special-token strings in the data are encoded as ordinary text.
    return self.encoding.encode(text, allowed_special=set(), disallowed_special=())

  def decode(self, ids) -> str:
    return self.encoding.decode([int(i) for i in ids])


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
  """``{token bytes: rank}`` of a tiktoken BPE file, with errors naming the line."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such tiktoken BPE file.')
  ranks = {}
  with open(path, 'rb') as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        token, rank = line.split()
        ranks[base64.b64decode(token, validate=True)] = int(rank)
      except (ValueError, binascii.Error):
        raise ValueError(f'{path}, line {number}: expected "<base64 token> <rank>", got '
                         f'{line[:60]!r}.') from None
  if not ranks:
    raise ValueError(f'{path}: the tiktoken BPE file is empty.')
  return ranks


def _looks_like_tiktoken(path: str) -> bool:
  with open(path, 'rb') as f:
    head = f.read(4096).split(b'\n')[0].split()
  if len(head) != 2 or not head[1].isdigit():
    return False
  try:
    base64.b64decode(head[0], validate=True)
  except binascii.Error:
    return False
  return True


def load_tokenizer(path: str, **kwargs) -> Tokenizer:
  """The tokenizer stored at ``path``, chosen by what the file is.

  * a directory: its ``tokenizer.json`` (Hugging Face), else its ``tokenizer.model``;
  * ``*.json``: Hugging Face ``tokenizers``;
  * ``*.tiktoken``, or any file of ``base64 rank`` lines: tiktoken BPE;
  * anything else (``*.model``): sentencepiece.

  ``kwargs`` go to the tokenizer class (e.g. ``special_tokens=`` for tiktoken). A directory
  URL (``s3://``, ``hf://org/name``, any fsspec URL) is downloaded once per process first
  (:func:`maxnnx.paths.local_model_dir`).
  """
  if paths.is_remote(path):
    path = (paths.local_model_dir(path) if not str(path).endswith(paths.MODEL_FILE_SUFFIXES)
            else paths.download_data_file(str(path)))
  if os.path.isdir(path):
    for name in ('tokenizer.json', 'tokenizer.model'):
      if os.path.isfile(os.path.join(path, name)):
        return load_tokenizer(os.path.join(path, name), **kwargs)
    raise FileNotFoundError(f'{path}: the directory has no tokenizer.json or tokenizer.model.')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such tokenizer file.')
  if path.endswith('.json'):
    return HFTokenizer(path, **kwargs)
  if path.endswith('.tiktoken') or _looks_like_tiktoken(path):
    return TiktokenTokenizer(path, **kwargs)
  try:
    return SentencePieceTokenizer(path, **kwargs)
  except RuntimeError as e:  # sentencepiece's parse failure
    raise ValueError(f'{path}: not a tokenizer.json, tiktoken BPE or sentencepiece model '
                     f'({e}).') from None

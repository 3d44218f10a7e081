"""Supervised fine-tuning data: chat and prompt/completion records -> packed batches.

Records are JSON objects (JSONL lines, a JSON list, or Parquet rows), either

* ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the chat
  template; the loss covers the assistant turns (:func:`maxnnx.data.chat.encode_chat`);
* ``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...]}``
  (ShareGPT's layout): read as ``messages``, ``human`` being the user and ``gpt`` the
  assistant (:func:`maxnnx.data.chat.sharegpt_messages`);
* ``{"prompt": ..., "completion": ...}``: the loss covers the completion only; the
  prompt is text or a message list
  (:func:`maxnnx.data.chat.encode_prompt_completion`).

Before the pipeline is returned (so before a train step compiles), every record's shape
is checked (a message's ``content`` must be a string, a list of parts or null) and each
source is read until a record with a token to train on within ``seq_len`` turns up; data
in which none has one (no assistant turns, or answers the ``overlong`` policy cuts off) is
refused (:func:`check_sft_sources`). Errors name the file and line of the record.

Each record becomes token ids and a per-id loss mask, then an example of
``inputs = ids[:-1]``, ``targets = ids[1:]`` and ``loss_mask = mask[1:]`` (the
mask shifted like the targets: a target counts when it is an assistant token).
Examples are packed as in pre-training (segment ids and positions keep the
records apart) and the batches follow the contract of
:func:`maxnnx.data.make_pipeline`, with ``loss_mask`` 0 on prompt tokens as well
as on padding.

Image+text records (a vision-language model; ``images_per_row > 0``) put
``{"type": "image", "image": <path | data: URL>}`` parts in a message's content (or
bare ``{"type": "image"}`` parts filled in order from the record's ``"images"`` list,
as TRL's vision datasets do; OpenAI's ``{"type": "image_url", "image_url": {"url":
...}}`` works too). The template writes its marker per image, :class:`ImagePrompt`
expands it to the model's placeholder tokens, and the :class:`ImageProcessor` turns the
images into pixels. Such rows are not packed (one conversation per row, as MaxText
does for multimodal SFT); each batch gains ``pixel_values`` ``[batch,
images_per_row, 3, H, W]``, zero images filling the rows with fewer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import grain
import numpy as np

from maxnnx import paths
from maxnnx.data import packing
from maxnnx.data.chat import (
  ChatTemplate,
  chat_pieces,
  check_messages,
  encode_chat,
  encode_prompt_completion,
  encode_with_specials,
  load_chat_template,
  sharegpt_messages,
  template_for,
)
from maxnnx.data.config import DataConfig
from maxnnx.data.images import ImageProcessor, ImagePrompt, load_image
from maxnnx.data.pipeline import (
  Pipeline,
  _derived_seed,
  _jsonable,
  batch_rows,
  pack_examples,
  pipeline_arguments,
)
from maxnnx.data.sources import resolve_source
from maxnnx.data.tokenizer import Tokenizer, load_tokenizer


class RecordSource:
  """Every JSON object of some JSONL / JSON-list / Parquet files, in order (random access)."""

  def __init__(self, files, kind: str):
    self.records, self.where, self.files = [], [], []
    for path in files:
      for where, record in _read_records(path, kind):
        self.records.append(record)
        self.where.append(f'{path} {where}')
        self.files.append(path)
    if not self.records:
      raise ValueError(f'{", ".join(files)}: no records.')

  def __len__(self) -> int:
    return len(self.records)

  @property
  def name(self) -> str:
    """The source's files, for messages (the first and a count when there are many)."""
    files = list(dict.fromkeys(self.files))
    return ', '.join(files) if len(files) <= 3 else f'{files[0]} and {len(files) - 1} more files'

  def __getitem__(self, index: int) -> dict:
    return self.records[index]

  def describe(self, index: int) -> str:
    """The file and line (or record number) of record ``index``."""
    return self.where[index]

  def directory(self, index: int) -> str:
    """The directory of record ``index``'s file (relative image paths start there)."""
    return os.path.dirname(self.files[index])


def _read_records(path: str, kind: str):
  if kind == 'parquet':
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pq.read_table(pa.BufferReader(paths.read_data_bytes(path)) if paths.is_remote(path)
                          else path)
    for number, record in enumerate(table.to_pylist(), 1):
      yield f'row {number}', record
    return
  if kind != 'jsonl':
    raise ValueError(f'{path}: SFT records are read from JSONL, JSON or Parquet files, '
                     f'not {kind}.')
  try:
    raw = paths.read_data_bytes(path).decode('utf-8')
  except UnicodeDecodeError as e:
    raise ValueError(f'{path}: not UTF-8 (byte {e.start}).') from None
  if raw.lstrip()[:1] == '[':
    try:
      records = json.loads(raw)
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}: not a valid JSON list ({e}).') from None
    for number, record in enumerate(records, 1):
      yield f'record {number}', record
    return
  for number, line in enumerate(raw.split('\n'), 1):
    if line.strip():
      try:
        yield f'line {number}', json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{path} line {number}: not valid JSON ({e.msg}).') from None


def chat_record(record):
  """``record`` with ShareGPT's ``"conversations"`` (``from``/``value`` turns) read as
  ``"messages"`` (:func:`maxnnx.data.chat.sharegpt_messages`); any other record as it is."""
  if isinstance(record, dict) and 'conversations' in record and 'messages' not in record:
    rest = {k: v for k, v in record.items() if k != 'conversations'}
    return {**rest, 'messages': sharegpt_messages(record['conversations'])}
  return record


def check_sft_record(record) -> dict:
  """The record as it is encoded (:func:`chat_record`), after checking its shape without
  rendering or tokenizing it: a ``ValueError`` says what is wrong (the caller names the
  record)."""
  if not isinstance(record, dict):
    raise ValueError(f'expected a JSON object, got {type(record).__name__}.')
  record = chat_record(record)
  if 'messages' in record:
    check_messages(record['messages'])
    return record
  if 'prompt' in record and 'completion' in record:
    prompt, completion = record['prompt'], record['completion']
    if isinstance(prompt, str):
      if not isinstance(completion, str):
        raise ValueError('a text "prompt" needs a text "completion", got '
                         f'{type(completion).__name__}.')
      return record
    check_messages(prompt, 'prompt')
    if not isinstance(completion, str):
      check_messages(completion, 'completion')
    return record
  raise ValueError(f'expected "messages", "conversations" (ShareGPT) or "prompt" and '
                   f'"completion", got keys {sorted(record)}.')


def encode_sft_record(tokenizer, template: ChatTemplate | str | None, record,
                      *, add_bos: bool = True, add_eos: bool = True
                      ) -> tuple[list[int], list[int]]:
  """``(ids, loss_mask)`` of one ``messages`` (or ShareGPT ``conversations``) or
  ``prompt``/``completion`` record.

  ``add_bos`` / ``add_eos`` apply to text prompt/completion records only (a chat
  template adds its own special tokens).
  """
  record = check_sft_record(record)
  if 'messages' in record:
    if template is None:
      raise ValueError('a "messages" record needs a chat template; the tokenizer directory '
                       'has none: pass template= (e.g. "chatml").')
    return encode_chat(tokenizer, template, record['messages'])
  return encode_prompt_completion(tokenizer, record['prompt'], record['completion'],
                                  template=template, add_bos=add_bos, add_eos=add_eos)


@dataclasses.dataclass(frozen=True)
class SFTImages:
  """The image side of image+text SFT: pixels, the prompt's placeholders and room per row
  (``images_per_row`` counts pixel arrays: tiles, for a tiled processor)."""

  processor: ImageProcessor
  prompt: ImagePrompt
  images_per_row: int

  def empty(self) -> np.ndarray:
    """``[0, 3, H, W]``: the images of a text-only record."""
    side = getattr(self.processor, 'tile_size', None)
    height, width = (side, side) if side else (self.processor.height, self.processor.width)
    return np.zeros((0, 3, height, width), np.float32)


def split_images(record: dict) -> tuple[list, list]:
  """``(messages with bare {"type": "image"} parts, the images' sources in order)``.

  A part's source is its ``image`` / ``path`` / ``url`` key (or OpenAI's
  ``image_url.url``); parts without one take the record's ``images`` in order.
  """
  given = list(record.get('images') or [])
  messages, sources = [], []
  for message in record['messages']:
    content = message.get('content')
    if isinstance(content, list):
      parts = []
      for part in content:
        kind = part.get('type') if isinstance(part, dict) else None
        if kind not in ('image', 'image_url'):
          parts.append(part)
          continue
        source = part.get('image') or part.get('path') or part.get('url')
        if kind == 'image_url':
          source = (part.get('image_url') or {}).get('url')
        if source is None:
          if not given:
            raise ValueError('an image part has no source and the record\'s "images" list '
                             'has no image left for it.')
          source = given.pop(0)
        sources.append(source)
        parts.append({'type': 'image'})
      message = {**message, 'content': parts}
    messages.append(message)
  if given:
    raise ValueError(f'the record\'s "images" list has {len(given)} image(s) more than its '
                     'messages have {"type": "image"} parts.')
  return messages, sources


def encode_image_chat(tokenizer, template: ChatTemplate, messages, images: SFTImages,
                      layouts=None) -> tuple[list[int], list[int], int]:
  """``(ids, loss_mask, images)`` of a conversation whose image markers expand to
  placeholders (never trained on, even inside an assistant turn); ``layouts`` are what
  the image processor returned beside the pixels (tiles per image)."""
  ids, mask, count = [], [], 0
  for text, trained in chat_pieces(template, messages):
    text, n = images.prompt.expand(text, layouts, count)
    count += n
    piece = encode_with_specials(tokenizer, text)
    ids += piece
    mask += [int(trained and i != images.prompt.image_token_id) for i in piece]
  return ids, mask, count


class EncodeSFT(grain.transforms.Map):
  """``(source, record index, record)`` -> ``{'ids', 'loss_mask', 'where'}`` (and
  ``'images'`` ``[n, 3, H, W]`` with ``images``)."""

  def __init__(self, tokenizer, template, sources, *, add_bos: bool, add_eos: bool,
               vocab_size: int, images: SFTImages | None = None):
    self.tokenizer, self.template, self.sources = tokenizer, template, sources
    self.add_bos, self.add_eos, self.vocab_size = add_bos, add_eos, vocab_size
    self.images = images

  def map(self, element) -> dict:
    source, index, record = element
    where = self.sources[source].describe(index)
    try:
      record = chat_record(record)
      if self.images is not None and isinstance(record, dict) and 'messages' in record:
        ids, mask, pixels = self._encode_with_images(record, self.sources[source].directory(index))
      else:
        _refuse_images(record)
        ids, mask = encode_sft_record(self.tokenizer, self.template, record,
                                      add_bos=self.add_bos, add_eos=self.add_eos)
        pixels = None if self.images is None else self.images.empty()
    except (ValueError, FileNotFoundError) as e:
      raise ValueError(f'{where}: {e}') from None
    ids = np.asarray(ids, np.int32)
    if ids.size and ids.max() >= self.vocab_size:
      raise ValueError(f'{where}: token id {int(ids.max())} is outside the vocabulary '
                       f'[0, {self.vocab_size}).')
    out = {'ids': ids, 'loss_mask': np.asarray(mask, np.float32), 'where': (source, index)}
    if pixels is not None:
      out['images'] = pixels
      placeholders = np.flatnonzero(ids == self.images.prompt.image_token_id)
      out['image_end'] = int(placeholders[-1]) + 1 if placeholders.size else 0
    return out

  def _encode_with_images(self, record, directory):
    messages, sources = split_images(record)
    images = self.images
    if self.template is None:
      raise ValueError('a "messages" record needs a chat template; the tokenizer directory '
                       'has none: pass template=.')
    pixels, layouts = images.empty(), []
    if sources:
      pixels, layouts = images.processor([load_image(s, directory) for s in sources])
    if len(pixels) > images.images_per_row:
      tiles = ('' if len(pixels) == len(sources)
               else f' in {len(pixels)} pictures (with their tiles or crops)')
      raise ValueError(f'{len(sources)} images{tiles}, more than images_per_row='
                       f'{images.images_per_row}; raise it (TrainConfig.images_per_row too).')
    ids, mask, markers = encode_image_chat(self.tokenizer, self.template, messages, images,
                                           layouts)
    if markers != len(sources):
      raise ValueError(f'the chat template wrote {markers} image marker(s) '
                       f'{images.prompt.marker!r} for {len(sources)} image(s); use a template '
                       'that renders {"type": "image"} parts.')
    return ids, mask, pixels


def _refuse_images(record) -> None:
  """Image parts in a record of a text-only pipeline are an error, not silently dropped."""
  for message in (record.get('messages') or []) if isinstance(record, dict) else []:
    content = message.get('content') if isinstance(message, dict) else None
    if isinstance(content, list) and any(
        isinstance(p, dict) and p.get('type') in ('image', 'image_url') for p in content):
      raise ValueError('the record has images but the pipeline has no image side: pass '
                       'make_sft_pipeline(..., image_processor=, image_prompt=, '
                       'images_per_row=).')


SCAN_RECORDS = 1000
"""How many records of a source :func:`check_sft_sources` encodes at most while looking for
one with a token to train on."""


def check_sft_sources(sources, encode: EncodeSFT, *, seq_len: int, overlong: str,
                      scan: int = SCAN_RECORDS) -> None:
  """Refuse SFT data that would train on nothing, before any batch is made.

  Every record's shape is checked (:func:`check_sft_record`); then each source's records are
  encoded in order until one has a trained target that the ``overlong`` policy keeps within
  ``seq_len`` (for good data, the first). A source without one (among its first ``scan``
  records) is a ``ValueError`` saying why: no assistant turn or completion at all, or every
  answer cut off. A bad record is a ``ValueError`` naming its file and line.
  """
  for number, source in enumerate(sources):
    for index in range(len(source)):
      try:
        check_sft_record(source[index])
      except ValueError as e:
        raise ValueError(f'{source.describe(index)}: {e}') from None
    _check_trainable(number, source, encode, seq_len, overlong, scan)


def _check_trainable(number: int, source: RecordSource, encode: EncodeSFT, seq_len: int,
                     overlong: str, scan: int) -> None:
  earliest = None  # the first trained target of any record, when none is kept
  for index in range(min(len(source), scan)):
    example = encode.map((number, index, source[index]))
    packing.check_image_fits(example, seq_len, overlong, source.describe(index))
    trained = np.flatnonzero(example['loss_mask'][1:])
    kept = packing.kept_targets(len(example['ids']) - 1, seq_len, overlong)
    if trained.size and trained[0] < kept:
      return
    if trained.size:
      earliest = min(int(trained[0]), earliest if earliest is not None else int(trained[0]))
  among = f' among its first {scan} records' if len(source) > scan else ''
  if earliest is None:
    raise ValueError(
        f'{source.name}: no record{among} has a token to train on (no "assistant" message, '
        'no non-empty "completion"); SFT computes its loss on those tokens only, so training '
        'would change nothing. Check the roles ("role": "assistant"; ShareGPT: "from": "gpt").')
  why = (f'data.overlong={overlong} drops every record longer than that, and each one with an '
         'answer is' if overlong == 'drop' else
         f'data.overlong={overlong} keeps the first {seq_len} targets of each record, and the '
         f'earliest answer starts at target {earliest + 1}')
  raise ValueError(f'{source.name}: no record{among} has a trainable (assistant) token within '
                   f'seq_len={seq_len}: {why}. Raise seq_len, or set data.overlong=split.')


def make_sft_pipeline(config: DataConfig | str, tokenizer: Tokenizer | str,
                      template: ChatTemplate | str | None = None, *, batch_size: int,
                      seq_len: int, seed: int = 0, shard_index: int | None = None,
                      shard_count: int | None = None, vocab_size: int | None = None,
                      image_processor: ImageProcessor | None = None,
                      image_prompt: ImagePrompt | None = None, images_per_row: int = 0
                      ) -> Pipeline:
  """Packed SFT batches (the :func:`maxnnx.data.make_pipeline` contract) from records.

  Args:
    config: a :class:`DataConfig` (``sources`` are JSONL / JSON / Parquet record
      files; ``column``, ``pretokenized`` and ``text_split`` are not used), or a
      path string, which gets ``overlong='truncate'``. With ``overlong='truncate'``
      a conversation longer than ``seq_len`` keeps its first ``seq_len``
      targets (counted in ``Pipeline.stats``); ``'split'`` trains on every piece.
    tokenizer: a tokenizer or a path for :func:`load_tokenizer`.
    template: a :class:`ChatTemplate`, a built-in name or Jinja text; default the
      template of the tokenizer's directory (:func:`load_chat_template`), if any.
      Only ``messages`` records and message-list prompts need one.
    batch_size, seq_len, seed, shard_index, shard_count, vocab_size: as for
      :func:`maxnnx.data.make_pipeline`.
    image_processor, image_prompt, images_per_row: image+text records (see the module
      docstring): the checkpoint's :class:`ImageProcessor`, its :class:`ImagePrompt` (both
      from ``maxnnx.models.image_inputs_for(model_config, tokenizer, checkpoint_dir)``) and
      the images a row holds (``TrainConfig.images_per_row``). Rows are then not packed.
  """
  config, shard_index, shard_count = pipeline_arguments(
      'make_sft_pipeline', config, batch_size, seq_len, shard_index, shard_count,
      overlong='truncate')
  images = _sft_images(image_processor, image_prompt, images_per_row)
  tokenizer, template = resolve_tokenizer_and_template(tokenizer, template)
  vocab_size = vocab_size or tokenizer.vocab_size
  sources, ds = record_dataset(config, seed=seed, shard_index=shard_index,
                               shard_count=shard_count)
  encode = EncodeSFT(tokenizer, template, sources, add_bos=config.add_bos,
                     add_eos=config.add_eos, vocab_size=vocab_size, images=images)
  check_sft_sources(sources, encode, seq_len=seq_len, overlong=config.overlong)
  ds = ds.map(encode)
  examples, rows = pack_examples(ds, sources, config, seq_len=seq_len, batch_size=batch_size,
                                 seed=seed, loss_mask=True, images_per_row=images_per_row)
  pad = tokenizer.pad_id or 0
  batches = batch_rows(rows, batch_size, pad, config.worker_count)
  fingerprint = _jsonable({
      'kind': 'sft', 'config': config.to_dict(), 'batch_size': batch_size, 'seq_len': seq_len,
      'seed': seed, 'shard_index': shard_index, 'shard_count': shard_count,
      'vocab_size': vocab_size,
      'template': hashlib.sha256(template.source.encode()).hexdigest()[:16] if template else None,
      'images': None if images is None else repr(images)})
  return Pipeline(batches, examples, fingerprint, config=config, tokenizer=tokenizer,
                  batch_size=batch_size, seq_len=seq_len)


def _sft_images(processor, prompt, images_per_row) -> SFTImages | None:
  if not isinstance(images_per_row, int) or images_per_row < 0:
    raise ValueError(f'images_per_row must be an int >= 0, got {images_per_row!r}.')
  given = [name for name, value in (('image_processor', processor), ('image_prompt', prompt))
           if value is not None]
  if not images_per_row:
    if given:
      raise ValueError(f'{", ".join(given)} given with images_per_row=0; set images_per_row '
                       '(the images each row holds) for image+text SFT.')
    return None
  if len(given) < 2:
    raise ValueError('image+text SFT (images_per_row > 0) needs image_processor= '
                     '(ImageProcessor.from_pretrained(checkpoint)) and image_prompt= '
                     '(e.g. maxnnx.models.image_inputs_for(model_config, tokenizer)[1]).')
  return SFTImages(processor, prompt, images_per_row)


def resolve_tokenizer_and_template(tokenizer: Tokenizer | str,
                                   template: ChatTemplate | str | None):
  """``(tokenizer, template)``: a path loaded, and the template defaulting to the chat
  template stored beside the tokenizer (``None`` when there is none)."""
  if isinstance(tokenizer, str):
    tokenizer = load_tokenizer(tokenizer)
  if template is None and getattr(tokenizer, 'path', None):
    try:
      template = load_chat_template(os.path.dirname(tokenizer.path) or '.')
    except FileNotFoundError:
      template = None
  if template is not None:
    template = template_for(tokenizer, template)
  return tokenizer, template


def record_dataset(config: DataConfig, *, seed: int, shard_index: int, shard_count: int
                   ) -> tuple[list[RecordSource], grain.MapDataset]:
  """``(sources, dataset)``: the records of ``config.sources`` as ``(source, index, record)``
  elements, this shard's share, shuffled per source, repeated ``num_epochs`` and mixed by
  ``config.weights``."""
  sources, datasets = [], []
  for i, spec in enumerate(config.sources):
    resolved = resolve_source(spec, config.kind, split=config.split,
                              config_name=config.config_name)
    source = RecordSource(resolved.files, resolved.kind)
    if len(source) < shard_count:
      raise ValueError(f'data source {spec!r} has {len(source)} records, fewer than '
                       f'shard_count={shard_count}.')
    sources.append(source)
    ds = grain.MapDataset.source(source).map_with_index(_Tag(i, len(source)))
    ds = ds[shard_index::shard_count]
    if config.shuffle:
      ds = ds.shuffle(seed=_derived_seed(seed, i, 2))
    datasets.append(ds.repeat(config.num_epochs))
  ds = datasets[0] if len(datasets) == 1 else grain.MapDataset.mix(datasets, config.weights)
  return sources, ds


class _Tag:
  """Picklable ``(index, record) -> (source, index % length, record)``."""

  def __init__(self, source: int, length: int):
    self.source, self.length = source, length

  def __call__(self, index: int, record):
    return self.source, index % self.length, record

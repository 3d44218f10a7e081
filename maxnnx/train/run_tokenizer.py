"""The model and tokenizer of a run, and a tokenizer trained on its corpus, pinned to it.

:func:`model_and_tokenizer` starts from a preset or a Hugging Face checkpoint with the run's
model changes applied. Without ``tokenizer=``, a text corpus (or the text of JSONL/Parquet
documents) gets a sentencepiece tokenizer trained on it; the run keeps it (``tokenizer.model``
in the run directory) and reuses it while the corpus is the same, so a resumed run reads the
same token ids. A new one waits in a staging directory until the run's config is accepted
(:func:`pin_tokenizer`).
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

from maxnnx import paths

if TYPE_CHECKING:
  from maxnnx.config import MeshConfig
  from maxnnx.train.run_settings import RunRecipe


def _run_model_overrides(run: dict) -> dict:
  """The ModelConfig fields (dotted keys) the flat run keys (``dtype=``, ``scan_layers=``…)
  set."""
  overrides = {'runtime.dtype': run['dtype'], 'runtime.scan_layers': run['scan_layers']}
  for key in ('remat_policy', 'attention_impl'):
    if run[key]:
      overrides[f'runtime.{key}'] = run[key]
  return overrides


def is_checkpoint(model: str) -> bool:
  """Whether ``model=`` names a Hugging Face checkpoint (a directory, or a URL such as
  ``s3://bucket/model`` or ``hf://org/name``, downloaded once per process) rather than a
  preset."""
  return paths.is_remote(model) or os.path.isdir(model)


def run_model_config(run: dict, changes: dict):
  """``(ModelConfig, from_pretrained overrides)``: the preset's or checkpoint's config with
  the flat run keys, then the ``model.*`` keys, applied.

  Args:
    run: the run settings (``model``, ``dtype``, ``scan_layers``...).
    changes: the ``model.*`` settings as a nested dict.
  """
  import maxnnx  # noqa: PLC0415
  from maxnnx.models.pretrained import config_from_pretrained  # noqa: PLC0415
  flat = _run_model_overrides(run)
  if is_checkpoint(run['model']):
    base = config_from_pretrained(run['model'], **flat)
  else:
    base = maxnnx.get_preset(run['model'], **flat)
  cfg = base.replace(**changes) if changes else base  # a nested group keeps its other fields
  return cfg, {**flat, **{name: getattr(cfg, name) for name in changes}}


def model_and_tokenizer(run: dict, changes: dict, out: str, corpus: str | None, *,
                        recipe: RunRecipe, pinned: dict | None = None,
                        data_fields: dict | None = None, options: dict | None = None,
                        mesh: MeshConfig | None = None):
  """``(model, tokenizer, tokenizer record)``: the model to train (a ModelConfig or loaded
  model), its tokenizer (or None), and the tokenizer's fingerprint for the run's config.
  A Hugging Face checkpoint is loaded straight into its shards on ``mesh`` (the run's, unless
  it pipelines: then the Trainer lays the stages out itself).

  A tokenizer trained on a .txt corpus is pinned to the run: reused while the corpus is the
  one ``pinned`` (the stored record) names, else trained afresh into ``<out>/.tokenizer-new/``
  (:func:`tokenizer_staging`) for :func:`pin_tokenizer` to move into place once the run's
  config is accepted. Document data (JSONL, Parquet, a directory) without ``tokenizer=`` gets
  one trained the same way on the text of its documents (``data.column``).
  """
  import maxnnx  # noqa: PLC0415
  from maxnnx.data import load_tokenizer  # noqa: PLC0415
  from maxnnx.train.run_dir import file_fingerprint  # noqa: PLC0415
  cfg, overrides = run_model_config(run, changes)
  cfg = recipe.adjust_model(cfg, options or {}, changes)
  if is_checkpoint(run['model']):
    pipelined = mesh is not None and (mesh.stage > 1 or mesh.dcn_stage > 1)
    model = maxnnx.from_pretrained(run['model'], mesh=None if pipelined else mesh, **overrides)
    if corpus is None:
      return model, None, None
    given = run['tokenizer'] or run['model']
    tokenizer = load_tokenizer(given)
    local = getattr(tokenizer, 'path', None) or given
    return model, tokenizer, {'sha256': file_fingerprint(local),
                              'source': given if paths.is_remote(given) else local}
  if corpus is None:
    return cfg, None, None
  if recipe.records and not run['tokenizer']:
    raise ValueError(f"{recipe.name} reads its records with the model's tokenizer: give "
                     'model=<Hugging Face dir with its tokenizer> (e.g. the final/ of a '
                     'maxnnx train run) or tokenizer=<path>.')
  if run['tokenizer']:
    return cfg, load_tokenizer(run['tokenizer']), {
        'sha256': file_fingerprint(run['tokenizer']), 'source': run['tokenizer']}
  if corpus.endswith('.txt') and not paths.is_remote(corpus) and not os.path.exists(corpus):
    raise FileNotFoundError(f'data={corpus}: no such file.')
  if is_text_file(corpus):
    tokenizer, record = _corpus_tokenizer(cfg.vocab_size, out, corpus, pinned)
  else:
    with tempfile.TemporaryDirectory() as scratch:
      text = _documents_as_text(corpus, data_fields or {}, os.path.join(scratch, 'corpus.txt'))
      tokenizer, record = _corpus_tokenizer(cfg.vocab_size, out, text, pinned)
    record = {**record, 'source': corpus}
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(f'The tokenizer has {tokenizer.vocab_size} tokens but model '
                     f"{run['model']} only {cfg.vocab_size}.")
  if tokenizer.vocab_size < cfg.vocab_size:  # a small corpus: fewer pieces than asked for
    print(f'Note: the tokenizer has {tokenizer.vocab_size} tokens, fewer than the '
          f'{cfg.vocab_size} asked for (a small corpus); model.vocab_size is set to match.')
    cfg = cfg.replace(vocab_size=tokenizer.vocab_size)
  return (cfg.replace(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id), tokenizer,
          record)


def _corpus_tokenizer(vocab_size: int, out: str, corpus: str, pinned: dict | None):
  """The run's sentencepiece tokenizer for ``corpus`` and its record (see above)."""
  from maxnnx.data import SentencePieceTokenizer, train_sentencepiece  # noqa: PLC0415
  from maxnnx.train import distributed  # noqa: PLC0415
  from maxnnx.train.run_dir import file_fingerprint  # noqa: PLC0415
  corpus_sha = file_fingerprint(corpus)
  path = paths.join(out, 'tokenizer.model')
  reuse = bool(pinned and pinned.get('corpus_sha256') == corpus_sha and paths.exists(path)
               and file_fingerprint(path) == pinned.get('sha256'))
  if _process_count() > 1:  # process 0 decides; every process uses its bytes
    reuse = bool(distributed.broadcast_bytes(b'1' if reuse else b'0') == b'1')
  if reuse:
    return SentencePieceTokenizer(paths.local_copy(path)), pinned
  print(f'Training a {vocab_size}-token sentencepiece BPE tokenizer on {corpus} ...')
  staging = tokenizer_staging(out)
  os.makedirs(staging, exist_ok=True)
  candidate = os.path.join(staging, 'tokenizer.model')
  if distributed.is_primary():
    candidate = train_sentencepiece(corpus, os.path.join(staging, 'tokenizer'), vocab_size)
  if _process_count() > 1:  # one tokenizer for every process, trained once
    model_bytes = distributed.broadcast_bytes(
        open(candidate, 'rb').read() if distributed.is_primary() else None)
    if not distributed.is_primary():
      with open(candidate, 'wb') as f:
        f.write(model_bytes)
  record = {'sha256': file_fingerprint(candidate), 'source': corpus, 'corpus_sha256': corpus_sha}
  return SentencePieceTokenizer(candidate), record


def _process_count() -> int:
  """``jax.process_count()`` (imported on first use, like the rest of jax here)."""
  import jax  # noqa: PLC0415
  return jax.process_count()


def _documents_as_text(data: str, data_fields: dict, path: str,
                       max_chars: int = 64 << 20) -> str:
  """Write the text documents of ``data`` (its ``data.column``) to ``path`` for training a
  tokenizer on them: up to ``max_chars`` characters, documents separated by blank lines."""
  from maxnnx.data import DataConfig, resolve_source  # noqa: PLC0415
  from maxnnx.data.sources import InMemorySource  # noqa: PLC0415
  config = DataConfig.from_string(data, **data_fields)
  if config.pretokenized:
    raise ValueError(f'data={data} holds token ids: give its tokenizer with tokenizer=<path>.')
  written = 0
  with open(path, 'w', encoding='utf-8') as f:
    for spec in config.sources:
      resolved = resolve_source(spec, split=config.split, config_name=config.config_name)
      if resolved.kind not in ('text', 'jsonl', 'parquet'):
        raise ValueError(f'data={spec} ({resolved.kind}): give its tokenizer with '
                         'tokenizer=<path> (a sentencepiece model, tokenizer.json or tiktoken '
                         'file); a tokenizer is trained only on text, JSONL and Parquet data.')
      source = InMemorySource(resolved.files, resolved.kind, column=config.column)
      for index in range(len(source)):
        if written >= max_chars:
          return path
        document = source[index]
        f.write(document + '\n\n')
        written += len(document) + 2
  return path


def tokenizer_staging(out: str) -> str:
  """Where a tokenizer trained for the run in ``out`` waits for the run's config to be
  accepted: ``<out>/.tokenizer-new``, or a local directory of this process when ``out`` is a
  URL (sentencepiece writes local files only) or this is not process 0 of a multi-process run
  (which pins nothing)."""
  from maxnnx.train import distributed  # noqa: PLC0415
  if paths.is_remote(out) or not distributed.is_primary():
    return os.path.join(paths.scratch_dir(), '.tokenizer-new')
  return os.path.join(out, '.tokenizer-new')


def pin_tokenizer(out: str) -> None:
  """Move a tokenizer trained for this run into ``out`` (``tokenizer.model``/``.vocab``);
  process 0's job in a multi-process run."""
  from maxnnx.train import distributed  # noqa: PLC0415
  new = tokenizer_staging(out)
  if not distributed.is_primary() or not os.path.isdir(new):
    return
  for name in os.listdir(new):
    if paths.is_remote(out):
      paths.write_bytes(paths.join(out, name), paths.read_bytes(os.path.join(new, name)))
      os.remove(os.path.join(new, name))
    else:
      os.replace(os.path.join(new, name), os.path.join(out, name))
  os.rmdir(new)


def is_text_file(path: str) -> bool:
  """Whether ``path`` is a ``.txt`` corpus (read whole and cut into windows)."""
  return os.path.isfile(path) and path.endswith('.txt')

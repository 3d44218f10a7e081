"""Command line: ``maxnnx train [config.yml] [key=value ...]`` and friends.

With no arguments ``maxnnx train`` trains the ``tiny`` preset on the shipped
Shakespeare corpus: it trains a sentencepiece tokenizer on the corpus, runs the
optimizer with a progress bar (loss, tokens/s, MFU), writes ``metrics.jsonl``,
``loss.png`` and the trained model in Hugging Face format (``final/``), and
ends by printing a generated sample.

Every field of the run's configs is a ``key=value``: :class:`~maxnnx.train.TrainConfig`
fields bare or as ``train.KEY`` (``steps=``, ``learning_rate=``…),
:class:`~maxnnx.config.MeshConfig` as ``mesh.KEY``, :class:`~maxnnx.config.ModelConfig`
as ``model.KEY`` (applied on top of the preset or checkpoint; nested configs are
dotted: ``model.rope.theta=5e5``) and :class:`~maxnnx.data.DataConfig` as
``data.KEY`` (``data.column=content``). Values are parsed by the field's type. A
YAML file (``config=run.yml``, or given first) holds the same keys as nested
mappings or dotted names, and ``key=value`` arguments override it.
``maxnnx train --help`` lists every key with its type, default and meaning.

Other commands: ``generate`` (continue a prompt from a trained run), ``serve`` (an
OpenAI-compatible HTTP server over a Hugging Face checkpoint, :mod:`maxnnx.serving.server`),
``compile`` (lower and compile the train step for the mesh, report per-device
memory, and fail fast when it cannot fit, without allocating any weights) and
``convert`` (Hugging Face <-> orbax checkpoints, scanned <-> per-layer layout).
``maxtext-keys`` lists how MaxText's keys are read (:mod:`maxnnx.maxtext_keys`).

``checkpoint_every=N`` saves to ``<output_dir>/checkpoints``; running the same
command again resumes from the newest complete checkpoint.

``output_dir`` and ``checkpoint_dir`` may be URLs (``gs://bucket/run``, see
:mod:`maxnnx.paths`): what only a local file can hold (the trained tokenizer, the
``final/`` export) is written locally first and copied up. ``model=``, ``data=`` and
``tokenizer=`` are read from local paths.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile

import numpy as np

from maxnnx import paths
from maxnnx.cli_finetune import PRETRAIN, RECIPES, Recipe
from maxnnx.cli_keys import (
    Key,
    UsageError,
    config_keys,
    merge,
    subtree,
    usage_lines,
)
from maxnnx.cli_keys import parse as parse_keys
from maxnnx.config import MeshConfig

# Joining a multi-process run (train, its recipes, compile, generate, serve).
PROCESS_KEYS = {
    'coordinator': ('', 'multi-process run: host:port of process 0\'s coordinator (with '
                    'num_processes and process_id), or auto: jax.distributed finds the cluster '
                    '(SLURM, Kubernetes JobSet, TPU pods); empty: the MAXNNX_COORDINATOR_ADDRESS, '
                    'MAXNNX_NUM_PROCESSES and MAXNNX_PROCESS_ID variables, else one process'),
    'num_processes': (0, 'how many processes take part (with coordinator=host:port)'),
    'process_id': (-1, "this process's rank, 0 .. num_processes - 1 (with coordinator=host:port)"),
}
# Keys of the run itself (the TrainConfig and MeshConfig fields are added below).
RUN_KEYS = {
    'model': ('tiny', 'preset name (see maxnnx.list_presets()) or a local Hugging Face '
              'checkpoint directory to start from'),
    'data': ('', "training data: a UTF-8 .txt file, a JSONL/Parquet/ArrayRecord file or dataset "
             "directory, 'synthetic' (random tokens), or empty for the shipped Shakespeare corpus"),
    'tokenizer': ('', 'tokenizer file or directory (sentencepiece, tokenizer.json, tiktoken); '
                  'default: the checkpoint\'s own, or one trained on a .txt corpus'),
    'output_dir': ('runs/tiny-shakespeare', 'where tokenizer, metrics, plot and model go'),
    'dtype': ('auto', 'compute dtype: auto (bfloat16 on GPUs/TPUs and on CPUs with native '
                      'bf16 (AVX-512 BF16, AMX), else float32; printed at the start), bfloat16 '
                      '(matmuls accumulate in float32) or float32; parameters stay float32'),
    'scan_layers': (False, 'run the layer stack as one scanned block (mesh.stage > 1 sets it)'),
    'remat_policy': ('', 'activation rematerialisation: none, minimal, save_dot_except_mlp, '
                     'save_qkv_proj, save_out_proj, full (empty: the model default)'),
    'attention_impl': ('', 'attention kernel strategy (empty: the model default)'),
    'sample_tokens': (120, 'tokens of the sample printed at the end (0: none)'),
    'resume': ('auto', 'auto: continue the run in output_dir when its stored config matches '
               '(a different one is refused); never: move an earlier run aside to '
               'output_dir/previous/<time>/ and start fresh'),
    **PROCESS_KEYS,
}
TRAIN_OVERRIDES = {  # defaults of the default run that differ from TrainConfig's
    'steps': 600, 'global_batch_size': 16, 'seq_len': 128, 'learning_rate': 3e-3,
    'log_every': 25, 'eval_every': 100, 'checkpoint_every': 200,
}
GENERATE_KEYS = {
    'output_dir': ('runs/tiny-shakespeare', 'a directory written by maxnnx train'),
    'prompt': ('ROMEO:', 'text to continue'),
    'max_new_tokens': (120, "tokens to generate (capped, with a note, to what the model's "
                       'context leaves after the prompt)'),
    'temperature': (0.8, 'sampling temperature (0: greedy)'),
    'top_p': (0.95, 'nucleus sampling mass'),
    'top_k': (0, 'sample among the k most likely tokens (0: all; more than the vocabulary is '
              'clamped to it with a warning)'),
    'seed': (0, 'sampling seed'),
    'quantization': ('none', 'quantize the linear layers for inference: int8, int4, fp8 '
                     '(weights) or w8a8 (int8 weights and activations)'),
    'tensor_parallel': (1, 'devices the model is sharded over (attention heads and MLP width; '
                        "in a multi-process run, every process's devices)"),
    'compile_cache': ('', "directory of JAX's persistent compilation cache (empty: off): a "
                      'second run finds its programs compiled'),
    **PROCESS_KEYS,
}
SERVE_KEYS = {
    'model': ('', 'a Hugging Face checkpoint directory with its tokenizer (and chat template), '
              'e.g. the final/ of a maxnnx train or sft run'),
    'host': ('127.0.0.1', 'address to listen on (0.0.0.0: every interface)'),
    'port': (8000, 'TCP port to listen on'),
    'served_model_name': ('', 'the name clients send as "model" (empty: model= as given)'),
    'max_batch': (8, 'requests computed in one engine step at most'),
    'token_budget': (256, 'tokens computed in one engine step at most (decode tokens plus '
                     'prompt chunks); at least max_batch'),
    'page_size': (16, 'tokens per KV-cache page'),
    'max_pages': (0, 'KV-cache pages in the pool (0: enough for max_batch requests of '
                  'max_model_len tokens)'),
    'max_window_pages': (0, "pages in the sliding layers' own pool, for models mixing "
                         'sliding and full layers (0: twice what max_batch requests hold '
                         'within the window)'),
    'max_model_len': (0, "prompt plus output tokens of one request (0: the model's "
                      'max_position_embeddings)'),
    'max_queue': (64, 'requests waiting beyond the max_batch running ones; more are answered '
                  'with HTTP 429'),
    'max_request_bytes': (8 << 20, 'the longest request body taken (8 MiB; images in chat '
                          'messages travel inline); longer ones are answered with HTTP 413'),
    'prefix_caching': (True, 'reuse the KV-cache pages of prompt prefixes already computed'),
    'max_logprobs': (5, 'the most log-probabilities per token a request may ask for'),
    'add_bos': (True, "start text prompts of /v1/completions with the tokenizer's BOS token"),
    'dtype': ('', "compute dtype (empty: the checkpoint's)"),
    'quantization': ('none', 'quantize the linear layers for inference: int8, int4, fp8 '
                     '(weights) or w8a8 (int8 weights and activations)'),
    'tensor_parallel': (1, 'devices the model is sharded over (attention heads and MLP width); '
                        "the parameters load straight into their shards; in a multi-process "
                        "run, every process's devices: process 0 serves HTTP, the others "
                        'follow its engine'),
    'seed': (0, 'seed of requests that give none'),
    'log_level': ('info', 'uvicorn log level: critical, error, warning, info, debug, trace'),
    'compile_cache': ('', "directory of JAX's persistent compilation cache (empty: off): a "
                      "restarted server finds its engine's step programs compiled"),
    **PROCESS_KEYS,
}
CONVERT_KEYS = {
    'src': ('', 'a Hugging Face directory (config.json + safetensors) or an orbax checkpoint '
            'directory (training or parameter-only)'),
    'dst': ('', 'where to write the converted model (must not hold a checkpoint already)'),
    'format': ('', "output format: 'hf', 'orbax' (empty: the other one than src)"),
    'scan_layers': (False, 'layer layout of an orbax output: stacked (true) or per layer'),
    'dtype': ('', "floating-point dtype of a Hugging Face output: bfloat16, float16 or float32 "
              "(empty: the parameters' own)"),
}


COMPILE_KEYS = {
    'topology': ('', 'compile for this TPU slice instead of the attached devices: a Cloud TPU '
                     "name (v5p-128, v5e-16, v6e-64, v4-32) or a chip grid (v5p:4x4x8); needs "
                     "libtpu on this machine (pip install 'maxnnx[tpu]'), not the TPUs"),
    'topology_slices': (1, 'slices of that topology (multi-slice; the mesh.dcn_* axes span '
                           'them)'),
}

GROUPS = {  # --help heading of each group of keys
    'compile': 'Ahead-of-time target (compile only)',
    'run': 'The run',
    'train': 'TrainConfig (KEY or train.KEY)',
    'mesh': 'MeshConfig (mesh.KEY)',
    'model': ('ModelConfig (model.KEY, applied on top of the preset or checkpoint config; '
              "the defaults shown are ModelConfig's, most presets set their own)"),
    'data': ('DataConfig (data.KEY: for JSONL/Parquet/ArrayRecord data, and for a .txt file or '
             'synthetic data given any data.* key; data= sets data.sources)'),
}
ALIASES = {'train.': ''}  # train.steps is steps, train.mesh.fsdp is mesh.fsdp


def _run_keys() -> dict[str, Key]:
  return {k: Key(d, doc, type(d), 'run') for k, (d, doc) in RUN_KEYS.items()}


def train_keys(recipe: Recipe = PRETRAIN) -> dict[str, Key]:
  """Every key ``maxnnx train`` and ``maxnnx compile`` (or the fine-tuning command of
  ``recipe``) accept: ``{key: Key}``.

  The run keys, the recipe's own keys, then every field of TrainConfig (bare),
  MeshConfig (``mesh.``), ModelConfig (``model.``) and DataConfig (``data.``),
  nested configs as dotted keys.
  """
  from maxnnx.config import ModelConfig  # noqa: PLC0415
  from maxnnx.data import DataConfig  # noqa: PLC0415
  from maxnnx.train.config import TrainConfig  # noqa: PLC0415
  keys = {k: key._replace(default=recipe.run_defaults.get(k, key.default))
          for k, key in _run_keys().items()}
  keys.update({k: Key(d, doc, type(d), recipe.name) for k, (d, doc) in recipe.keys.items()})
  defaults = {**TRAIN_OVERRIDES, **recipe.train_defaults}
  for key, spec in config_keys(TrainConfig, '', 'train', skip=('mesh',)).items():
    keys[key] = spec._replace(default=defaults.get(key, spec.default))
  keys.update(config_keys(MeshConfig, 'mesh.', 'mesh'))
  keys.update(config_keys(ModelConfig, 'model.', 'model', fill=False))
  keys.update(config_keys(DataConfig, 'data.', 'data', fill=False))
  return keys


def _generate_keys() -> dict[str, Key]:
  return {k: Key(d, doc, type(d), 'Keys') for k, (d, doc) in GENERATE_KEYS.items()}


COMMANDS = ('train', 'sft', 'dpo', 'distill', 'grpo', 'generate', 'compile', 'convert', 'serve')


def parse_overrides(args: list[str], keys: dict[str, Key]) -> dict:
  """``[config.yml | config=run.yml] key=value ...`` -> ``{key: typed value}``.

  Run, train and mesh keys come with their defaults; model and data keys only
  when given. Command-line keys override those of the YAML file. MaxText's keys and YAML
  files (``base_config: base.yml``) are read through :mod:`maxnnx.maxtext_keys`.

  Raises:
    UsageError: on an unknown key (naming the nearest one), a malformed value or
      a malformed YAML file, or a MaxText key refused by :mod:`maxnnx.maxtext_keys`.
  """
  from maxnnx import maxtext_keys  # noqa: PLC0415
  maxtext = maxtext_keys.parse(args, keys, ALIASES)  # None unless the args speak MaxText
  return maxtext if maxtext is not None else parse_keys(args, keys, ALIASES)


def _usage(command: str) -> str:
  keys = _command_keys(command)
  head = {'train': 'maxnnx train [config=run.yml] [key=value ...]',
          'compile': 'maxnnx compile [config=run.yml] [key=value ...]  (same keys as train)',
          'generate': 'maxnnx generate [key=value ...]',
          'convert': 'maxnnx convert src=DIR dst=DIR [format=hf|orbax] [scan_layers=...]',
          'serve': 'maxnnx serve model=HF_DIR [host=127.0.0.1] [port=8000] [key=value ...]',
          'sft': 'maxnnx sft model=HF_DIR data=chat.jsonl [key=value ...]',
          'dpo': 'maxnnx dpo model=HF_DIR data=prefs.jsonl [beta=0.1] [key=value ...]',
          'distill': 'maxnnx distill teacher=DIR model=PRESET|DIR [key=value ...]',
          'grpo': 'maxnnx grpo model=HF_DIR prompts=prompts.jsonl reward=file.py:function '
                  '[num_generations=8] [key=value ...]'}[command]
  lines = [f'usage: {head}']
  if command in RECIPES:
    lines += ['', f"{command} takes train's keys plus its own ({command}: below)."]
  if command in ('train', 'compile', *RECIPES):
    lines += ['', 'A YAML file (config=run.yml, or given first) holds the same keys, as nested '
              'mappings',
              '(model: {num_layers: 2}) or dotted names; command-line keys override it.',
              "MaxText's keys and YAML files work too: maxnnx maxtext-keys lists them.",
              'Each key is listed as: name  type = default  meaning.']
  return '\n'.join(lines + usage_lines(keys, GROUPS))


def _plot_loss(history: list[dict], path: str) -> None:
  """``loss.png``: the training (and held-out) loss; RL runs add the mean reward beside it."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # noqa: PLC0415
  rl = any('reward' in m for m in history)
  fig, axes = plt.subplots(1, 2 if rl else 1, figsize=(11 if rl else 6, 3.5), squeeze=False)
  ax = axes[0, 0]
  ax.plot([m['step'] for m in history], [m['loss'] for m in history], label='train')
  evals = [m for m in history if 'eval_loss' in m]
  if evals:
    ax.plot([m['step'] for m in evals], [m['eval_loss'] for m in evals], 'o-', label='held-out')
  ax.set_xlabel('step')
  ax.set_ylabel('policy loss' if rl else 'cross-entropy (nats/token)')
  ax.grid(alpha=0.3)
  ax.legend()
  if rl:
    rewarded = [m for m in history if 'reward' in m]
    axes[0, 1].plot([m['step'] for m in rewarded], [m['reward'] for m in rewarded])
    axes[0, 1].set_xlabel('step')
    axes[0, 1].set_ylabel('mean reward')
    axes[0, 1].grid(alpha=0.3)
  fig.tight_layout()
  with paths.open_file(path, 'wb') as f:
    fig.savefig(f, format='png', dpi=120)
  plt.close(fig)


def _split_options(options: dict, recipe: Recipe = PRETRAIN):
  """``(run options, TrainConfig, model changes, data fields)`` from the parsed keys.

  Model changes and data fields are nested dicts of the ``model.*`` and ``data.*``
  keys given; the recipe's own keys stay in ``options``.
  """
  from maxnnx.train.config import TrainConfig  # noqa: PLC0415
  run = {k: options[k] for k in RUN_KEYS}
  run['output_dir'] = paths.normalize(run['output_dir'])
  fields = {k: v for k, v in options.items()
            if k not in RUN_KEYS and k not in recipe.keys and '.' not in k}
  if fields.get('checkpoint_every') and not fields.get('checkpoint_dir'):
    fields['checkpoint_dir'] = paths.join(run['output_dir'], 'checkpoints')
  train_config = TrainConfig.from_dict({**fields, 'mesh': subtree(options, 'mesh.'),
                                        'lora': subtree(options, 'lora.')})
  model_changes, data_fields = subtree(options, 'model.'), subtree(options, 'data.')
  if 'sources' in data_fields:
    run['data'] = ','.join(data_fields.pop('sources'))
  if not run['tokenizer']:
    run['tokenizer'] = data_fields.get('tokenizer', '')
  _scan_for_stages(run, train_config.mesh, options)
  return run, train_config, model_changes, data_fields


def _scan_for_stages(run: dict, mesh: MeshConfig, options: dict) -> None:
  """Pipeline stages run the scanned layer stack: switch ``scan_layers`` on for them."""
  stages = mesh.stage > 1 or mesh.dcn_stage > 1
  explicit = any(k.startswith('model.') and k.endswith('.scan_layers') for k in options)
  if stages and not run['scan_layers'] and not explicit:
    run['scan_layers'] = True
    print(f'Note: mesh.stage={mesh.stage} pipelines the scanned layer stack; '
          'scan_layers is set to true.')


def _legacy_model_overrides(run: dict) -> dict:
  """The ModelConfig fields the flat run keys (``dtype=``, ``scan_layers=``…) set."""
  overrides = {'dtype': run['dtype'], 'scan_layers': run['scan_layers']}
  if run['remat_policy']:
    overrides['remat_policy'] = run['remat_policy']
  if run['attention_impl']:
    overrides['attention_impl'] = run['attention_impl']
  return overrides


def _model_config(run: dict, changes: dict):
  """``(ModelConfig, from_pretrained overrides)``: the preset's or checkpoint's config with
  the flat run keys, then the ``model.*`` keys, applied."""
  import maxnnx  # noqa: PLC0415
  from maxnnx.models.pretrained import config_from_pretrained  # noqa: PLC0415
  legacy = _legacy_model_overrides(run)
  if os.path.isdir(run['model']):
    base = config_from_pretrained(run['model'], **legacy)
  else:
    base = maxnnx.get_preset(run['model'], **legacy)
  cfg = merge(base, changes) if changes else base
  return cfg, {**legacy, **{name: getattr(cfg, name) for name in changes}}


def _model_and_tokenizer(run: dict, changes: dict, out: str, corpus: str | None,
                         pinned: dict | None = None, data_fields: dict | None = None,
                         recipe: Recipe = PRETRAIN, options: dict | None = None,
                         mesh: MeshConfig | None = None):
  """``(model, tokenizer, tokenizer record)``: the model to train (a ModelConfig or loaded
  model), its tokenizer (or None), and the tokenizer's fingerprint for the run's config.
  A Hugging Face checkpoint is loaded straight into its shards on ``mesh`` (the run's, unless
  it pipelines: then the Trainer lays the stages out itself).

  A tokenizer trained on a .txt corpus is pinned to the run: reused while the corpus is the
  one ``pinned`` (the stored record) names, else trained afresh into ``<out>/.tokenizer-new/``
  (:func:`_tokenizer_staging`) for :func:`_pin_tokenizer` to move into place once the run's
  config is accepted. Document data (JSONL, Parquet, a directory) without ``tokenizer=`` gets
  one trained the same way on the text of its documents (``data.column``).
  """
  import maxnnx  # noqa: PLC0415
  from maxnnx.data import load_tokenizer  # noqa: PLC0415
  from maxnnx.train.run_dir import file_fingerprint  # noqa: PLC0415
  cfg, overrides = _model_config(run, changes)
  cfg = recipe.adjust_model(cfg, options or {}, changes)
  if os.path.isdir(run['model']):
    pipelined = mesh is not None and (mesh.stage > 1 or mesh.dcn_stage > 1)
    model = maxnnx.from_pretrained(run['model'], mesh=None if pipelined else mesh, **overrides)
    if corpus is None:
      return model, None, None
    tokenizer = load_tokenizer(run['tokenizer'] or run['model'])
    source = getattr(tokenizer, 'path', None) or run['tokenizer'] or run['model']
    return model, tokenizer, {'sha256': file_fingerprint(source), 'source': source}
  if corpus is None:
    return cfg, None, None
  if recipe.records and not run['tokenizer']:
    raise UsageError(f"{recipe.name} reads its records with the model's tokenizer: give "
                     'model=<Hugging Face dir with its tokenizer> (e.g. the final/ of a '
                     'maxnnx train run) or tokenizer=<path>.')
  if run['tokenizer']:
    return cfg, load_tokenizer(run['tokenizer']), {
        'sha256': file_fingerprint(run['tokenizer']), 'source': run['tokenizer']}
  if corpus.endswith('.txt') and not os.path.exists(corpus):
    raise FileNotFoundError(f'data={corpus}: no such file.')
  if _is_text_file(corpus):
    tokenizer, record = _corpus_tokenizer(cfg.vocab_size, out, corpus, pinned)
  else:
    with tempfile.TemporaryDirectory() as scratch:
      text = _documents_as_text(corpus, data_fields or {}, os.path.join(scratch, 'corpus.txt'))
      tokenizer, record = _corpus_tokenizer(cfg.vocab_size, out, text, pinned)
    record = {**record, 'source': corpus}
  if tokenizer.vocab_size > cfg.vocab_size:
    raise UsageError(f'The tokenizer has {tokenizer.vocab_size} tokens but model '
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
  staging = _tokenizer_staging(out)
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
    raise UsageError(f'data={data} holds token ids: give its tokenizer with tokenizer=<path>.')
  written = 0
  with open(path, 'w', encoding='utf-8') as f:
    for spec in config.sources:
      resolved = resolve_source(spec)
      if resolved.kind not in ('text', 'jsonl', 'parquet'):
        raise UsageError(f'data={spec} ({resolved.kind}): give its tokenizer with '
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


def _tokenizer_staging(out: str) -> str:
  """Where a tokenizer trained for the run in ``out`` waits for the run's config to be
  accepted: ``<out>/.tokenizer-new``, or a local directory of this process when ``out`` is a
  URL (sentencepiece writes local files only) or this is not process 0 of a multi-process run
  (which pins nothing)."""
  from maxnnx.train import distributed  # noqa: PLC0415
  if paths.is_remote(out) or not distributed.is_primary():
    return os.path.join(paths.scratch_dir(), '.tokenizer-new')
  return os.path.join(out, '.tokenizer-new')


def _pin_tokenizer(out: str) -> None:
  """Move a tokenizer trained for this run into ``out`` (``tokenizer.model``/``.vocab``);
  process 0's job in a multi-process run."""
  from maxnnx.train import distributed  # noqa: PLC0415
  new = _tokenizer_staging(out)
  if not distributed.is_primary() or not os.path.isdir(new):
    return
  for name in os.listdir(new):
    if paths.is_remote(out):
      paths.write_bytes(paths.join(out, name), paths.read_bytes(os.path.join(new, name)))
      os.remove(os.path.join(new, name))
    else:
      os.replace(os.path.join(new, name), os.path.join(out, name))
  os.rmdir(new)


def _is_text_file(path: str) -> bool:
  return os.path.isfile(path) and path.endswith('.txt')


def _training_data(run: dict, data_fields: dict, corpus: str | None, model, tokenizer,
                   train_config):
  """``(data, token count)``: token windows of a .txt corpus, the grain pipeline for
  documents (or for any ``data.*`` key), or ``None`` for the Trainer's synthetic tokens."""
  import jax  # noqa: PLC0415

  from maxnnx.data import DataConfig, TokenWindows, make_pipeline  # noqa: PLC0415
  from maxnnx.data.text import read_text  # noqa: PLC0415
  local_batch = train_config.global_batch_size // jax.process_count()
  if corpus is not None and _is_text_file(corpus) and not data_fields:
    tokens = np.asarray(tokenizer.encode(read_text(corpus)), np.int32)
    # Every process draws the same global batches and keeps its own rows, so a run over
    # several processes trains on what one process would.
    data = TokenWindows(tokens, train_config.seq_len, train_config.global_batch_size,
                        seed=train_config.seed,
                        rows=(jax.process_index() * local_batch, local_batch))
    return data, len(tokens)
  if corpus is None and not (data_fields and run['data'] == 'synthetic'):
    return None, 0
  vocab = (model.vocab_size if hasattr(model, 'vocab_size') else model.config.vocab_size)
  config = DataConfig.from_string(corpus or run['data'], **data_fields)
  return make_pipeline(config, tokenizer, batch_size=local_batch, seq_len=train_config.seq_len,
                       seed=train_config.seed, vocab_size=vocab), 0


def _build_trainer(options: dict, *, need_data: bool = True, run_dir=None,
                   recipe: Recipe = PRETRAIN, devices=None):
  """``(trainer, run options, tokenizer, token count)``; with ``run_dir`` (an opened
  :class:`~maxnnx.train.run_dir.RunDir`) the run's config is checked against the stored one
  before any data is read. ``recipe`` is the command's (data, objective, own keys).
  ``devices`` (abstract ones, for compiling only) replace the attached devices in the mesh;
  the model is then built abstractly from its config."""
  from maxnnx.data import DEFAULT_CORPUS  # noqa: PLC0415
  from maxnnx.train import Trainer  # noqa: PLC0415
  from maxnnx.train.run_dir import check_writable, run_config  # noqa: PLC0415

  run, train_config, model_changes, data_fields = _split_options(options, recipe)
  recipe.prepare(run, options)
  out = run['output_dir']
  if run_dir is None:
    check_writable(out)
  stored = run_dir.stored_config() if run_dir is not None else None
  synthetic = run['data'] == 'synthetic' or not need_data
  corpus = None if synthetic else (run['data'] or DEFAULT_CORPUS)
  if devices is not None:  # compile only: the config is all the abstract model needs
    model, tokenizer, tokenizer_record = _model_config(run, model_changes)[0], None, None
  else:
    model, tokenizer, tokenizer_record = _model_and_tokenizer(
        run, model_changes, out, corpus, (stored or {}).get('tokenizer'), data_fields,
        recipe, options, mesh=train_config.mesh)
  if run_dir is not None:
    model_config = model if hasattr(model, 'to_dict') else model.config
    try:
      run_dir.check_config(run_config(model_config, train_config, tokenizer_record,
                                      objective=recipe.record(options) or None),
                           train_config.checkpoint_dir)
    except ValueError:
      shutil.rmtree(_tokenizer_staging(out), ignore_errors=True)
      raise
    _pin_tokenizer(out)
    if (tokenizer_record and '.tokenizer-new' in getattr(tokenizer, 'path', '')
        and not os.path.exists(tokenizer.path)):  # pinned: moved into out
      tokenizer = type(tokenizer)(paths.local_copy(paths.join(out, 'tokenizer.model')))
  data, num_tokens = None, 0
  if need_data and recipe.records:
    import jax  # noqa: PLC0415
    model_config = model if hasattr(model, 'to_dict') else model.config
    data = recipe.data(options, run['data'], data_fields, tokenizer, model_config, train_config,
                       train_config.global_batch_size // jax.process_count())
  elif need_data:
    data, num_tokens = _training_data(run, data_fields, corpus, model, tokenizer, train_config)
  if train_config.eval_every and not hasattr(data, 'eval_batches'):
    if data is not None:
      print('Note: this data source has no held-out split; eval_every is set to 0.')
    train_config = dataclasses.replace(train_config, eval_every=0)
  objective = recipe.objective(options, model, train_config)
  mesh = None
  if devices is not None:
    from maxnnx import sharding  # noqa: PLC0415
    mesh = sharding.make_mesh(train_config.mesh, devices)
  trainer = Trainer(model, train_config, objective, data=data, mesh=mesh)
  if hasattr(data, 'attach'):  # RL rollouts sample from the trainer's own model
    data.attach(trainer)
  return trainer, run, tokenizer, num_tokens


def train(options: dict, recipe: Recipe = PRETRAIN) -> dict:
  """Run ``maxnnx train`` with parsed ``options``; returns a summary dict.

  The output directory is locked for the run, its stored config checked before resuming
  (:mod:`maxnnx.train.run_dir`), SIGTERM/SIGINT end it with a checkpoint, and a rerun of a
  finished run only writes the final artifacts that are missing.
  """
  from maxnnx.train.run_dir import RunDir  # noqa: PLC0415
  with RunDir(options['output_dir'], resume=options['resume']) as run_dir:
    if run_dir.moved_to:
      print(f'resume=never: moved the earlier run to {run_dir.moved_to}.')
    return _train_in(run_dir, options, recipe)


def _compute_line(trainer) -> str:
  """The compute dtype (and why, for ``dtype=auto``) and the ceiling MFU divides by."""
  from maxnnx.hardware import auto_compute_dtype, resolve_compute_dtype  # noqa: PLC0415
  chosen = trainer.model_config.runtime.dtype
  why = f' (dtype=auto: {auto_compute_dtype()[1]})' if chosen == 'auto' else ''
  return (f'Compute dtype {resolve_compute_dtype(chosen)}{why}; MFU against '
          f'{trainer.peak_flops / 1e12:.4g} TFLOP/s per device, {trainer.peak_source}.')


def _train_in(run_dir, options: dict, recipe: Recipe = PRETRAIN) -> dict:
  import maxnnx  # noqa: PLC0415
  from maxnnx.train.run_dir import checkpoint_steps  # noqa: PLC0415

  trainer, run, tokenizer, num_tokens = _build_trainer(options, run_dir=run_dir, recipe=recipe)
  cfg, out = trainer.config, run['output_dir']
  template = (recipe.template(options, tokenizer, trainer.model_config.family)
              if recipe.records and tokenizer is not None else None)
  source = (f'{num_tokens:,} tokens' if num_tokens else
            'synthetic tokens' if run['data'] == 'synthetic' else
            run['data'] or options.get('prompts', ''))
  print(f"{recipe.name.upper() + ': ' if recipe.records or recipe.name == 'distill' else ''}"
        f"Training {run['model']} ({maxnnx.num_params(trainer.model_config):,} parameters) on "
        f'{source} for {cfg.steps} steps of {cfg.global_batch_size} x {cfg.seq_len} tokens; '
        f'mesh {dict((k, v) for k, v in trainer.mesh.shape.items() if v > 1) or "1 device"}'
        + (f'; {trainer.quantization} quantized training.' if trainer.quantization != 'none'
           else '.'))
  print(_compute_line(trainer))
  try:
    saved = checkpoint_steps(cfg.checkpoint_dir)
    resumed = trainer.restore_checkpoint() if cfg.checkpoint_dir else None
    if resumed is not None:
      print(f'Resuming from the checkpoint of step {resumed} in {cfg.checkpoint_dir}.')
      if trainer.schedule_note:
        print(f'Note: {trainer.schedule_note}')
    elif saved:
      print(f'Every checkpoint in {cfg.checkpoint_dir} is unusable (moved to corrupt-*); '
            'starting from scratch.')
    if cfg.metrics_jsonl is None:
      trainer.config = cfg = dataclasses.replace(
          cfg, metrics_jsonl=paths.join(out, 'metrics.jsonl'))
      run_dir.trim_metrics(cfg.metrics_jsonl, resumed)
    rollouts_jsonl = getattr(trainer.data, 'rollouts_jsonl', None)
    if rollouts_jsonl:
      run_dir.trim_metrics(rollouts_jsonl, resumed)
    history = trainer.fit() if trainer.step_count < cfg.steps else []
  finally:
    trainer.close()
  if trainer.stopped_by:
    where = (f'checkpoint of step {trainer.step_count} saved in {cfg.checkpoint_dir}; run the '
             'same command to resume' if cfg.checkpoint_dir else
             'no checkpoint_dir, so nothing was saved')
    print(f'Stopped by {trainer.stopped_by} after step {trainer.step_count}: {where}.')
    return {'first_loss': None, 'last_loss': None, 'eval_loss': None,
            'stopped_by': trainer.stopped_by}
  model = _export_view(trainer.model, out)
  if not history:
    written = _finish(model, run_dir, options, run_dir.read_metrics(cfg.metrics_jsonl),
                      only_missing=True, tokenizer=tokenizer, template=template)
    print(f'Nothing to train: the checkpoint is at step {trainer.step_count} of {cfg.steps}'
          + (f"; wrote the missing {', '.join(written)}." if written else '.'))
    return {'first_loss': None, 'last_loss': None, 'eval_loss': None}
  _finish(model, run_dir, options, run_dir.read_metrics(cfg.metrics_jsonl) or history,
          tokenizer=tokenizer, template=template)
  trained_tokenizer = paths.exists(paths.join(out, 'tokenizer.model')) and not run['tokenizer']
  print(f'Wrote {out}/: metrics.jsonl, loss.png, final/ (Hugging Face format)'
        + (', tokenizer.model' if trained_tokenizer else '') + '.')
  if run['sample_tokens'] and tokenizer is not None:  # every process: one SPMD program
    print('\nSample:\n' + _sample(model, tokenizer, 'ROMEO:', run['sample_tokens'],
                                  0.8, 0.95, cfg.seed))
  return {'first_loss': history[0]['loss'], 'last_loss': history[-1]['loss'],
          'eval_loss': history[-1].get('eval_loss')}


def _finish(model, run_dir, options: dict, history: list[dict], *, only_missing=False,
            tokenizer=None, template=None) -> list[str]:
  """Write ``final/``, ``loss.png`` and ``train_options.json`` (with ``only_missing``: those
  that are not there yet); returns the names written. ``final/`` appears whole or not at all
  (at a URL: its ``config.json`` is uploaded last), with the run's tokenizer and chat template
  beside the weights. A LoRA run also writes ``adapter/`` (PEFT's format), and ``final/`` holds
  the merged model. Every process calls it with ``model`` from :func:`_export_view`; a model
  that spans processes is written to ``final/`` by all of them (each its layers), the rest by
  process 0 alone."""
  import maxnnx  # noqa: PLC0415
  from maxnnx.processes import barrier  # noqa: PLC0415
  from maxnnx.train import distributed  # noqa: PLC0415
  from maxnnx.train.lora import has_adapters, merge_adapters, save_adapter  # noqa: PLC0415
  from maxnnx.train.run_dir import write_json  # noqa: PLC0415
  out, written = run_dir.directory, []
  final = paths.join(out, 'final')
  adapters = None  # a LoRA model that spans processes: its adapters on every host, then merged
  if has_adapters(model) and _spans_processes(model):
    from flax import nnx  # noqa: PLC0415
    adapters = distributed.host_local_model(model, nnx.LoRAParam)
    model = merge_adapters(model)  # every process, one gathered kernel at a time
  if _spans_processes(model):
    wanted = not (only_missing and paths.exists(paths.join(final, 'config.json')))
    if distributed.broadcast_bytes(b'1' if wanted else b'0') == b'1':  # process 0 decides
      _write_final_together(model, final, tokenizer, template)
      written.append('final/')
  if not distributed.is_primary():
    barrier('run-written')  # stay until process 0 has written everything
    return written
  if adapters is not None or has_adapters(model):  # LoRA: the PEFT adapter, final/ merged
    adapter = paths.join(out, 'adapter')
    source = model if adapters is None else adapters
    if not (only_missing and paths.exists(paths.join(adapter, 'adapter_config.json'))):
      paths.write_dir(adapter, lambda directory: save_adapter(source, directory),
                      last=('adapter_config.json',))
      written.append('adapter/')
    if adapters is None:
      model = merge_adapters(model)
  if not _spans_processes(model) and not (
      only_missing and paths.exists(paths.join(final, 'config.json'))):
    def export(directory):
      maxnnx.save_pretrained(model, directory)
      _save_tokenizer(tokenizer, template, directory)
    paths.write_dir(final, export, last=('config.json',))
    written.append('final/')
  plot = paths.join(out, 'loss.png')
  if history and not (only_missing and paths.exists(plot)):
    _plot_loss(history, plot)
    written.append('loss.png')
  options_path = paths.join(out, 'train_options.json')
  if not (only_missing and paths.exists(options_path)):
    write_json(options_path, options)
    written.append('train_options.json')
  barrier('run-written')
  return written


def _spans_processes(model) -> bool:
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  return any(isinstance(x, jax.Array) and not x.is_fully_addressable
             for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _export_view(model, out: str):
  """The trained model as :func:`_finish` exports it: the model itself with one process, or
  when the processes can write ``final/`` together (a local directory they share; a LoRA
  model is merged there one kernel at a time); else a copy gathered whole onto every process
  (:func:`~maxnnx.train.distributed.host_local_model`)."""
  import jax  # noqa: PLC0415

  from maxnnx.train import distributed  # noqa: PLC0415
  if jax.process_count() == 1 or not paths.is_remote(out):
    return model
  return distributed.host_local_model(model)


def _write_final_together(model, final: str, tokenizer, template) -> None:
  """Every process writes its layers of ``final/`` (``save_pretrained`` of a model that spans
  them) into ``final.tmp``, which process 0 completes with the tokenizer and renames."""
  import maxnnx  # noqa: PLC0415
  from maxnnx.processes import barrier, is_primary  # noqa: PLC0415
  staged = final + '.tmp'
  if is_primary():
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(staged)
  barrier('final-staged')
  maxnnx.save_pretrained(model, staged)  # returns once every process has written
  if is_primary():
    _save_tokenizer(tokenizer, template, staged)
    if os.path.exists(final):
      shutil.rmtree(final)
    os.rename(staged, final)


def _save_tokenizer(tokenizer, template, directory: str) -> None:
  """Copy the tokenizer file (and a ``tokenizer.json``'s config files) into ``directory``
  and write ``template`` (a :class:`~maxnnx.data.ChatTemplate`) as ``chat_template.jinja``."""
  path = getattr(tokenizer, 'path', None)
  if path and os.path.isfile(path):
    if path.endswith('.json'):
      shutil.copyfile(path, os.path.join(directory, 'tokenizer.json'))
      for name in ('tokenizer_config.json', 'special_tokens_map.json'):
        beside = os.path.join(os.path.dirname(path), name)
        if os.path.isfile(beside):
          shutil.copyfile(beside, os.path.join(directory, name))
    else:
      shutil.copyfile(path, os.path.join(directory, 'tokenizer.model'))
  if template is not None:
    with open(os.path.join(directory, 'chat_template.jinja'), 'w', encoding='utf-8') as f:
      f.write(template.source)


def compile_step(options: dict) -> dict:
  """Run ``maxnnx compile``: AOT-compile the train step and report memory; with
  ``topology=``, for the devices of that TPU slice (abstract: nothing runs, a checkpoint's
  weights are not read) instead of the attached ones."""
  from maxnnx.parallel.topology import topology_devices  # noqa: PLC0415
  options = dict(options)
  target, slices = options.pop('topology', ''), options.pop('topology_slices', 1)
  devices = None
  if target:
    devices = topology_devices(target, slices)
    print(f'Compiling for topology={target}: {len(devices)} {devices[0].device_kind} devices'
          + (f' in {slices} slices' if slices > 1 else '') + '.')
  trainer, _, _, _ = _build_trainer(options, need_data=False, devices=devices)
  return trainer.compile()


def _sample(model, tokenizer, prompt, max_new_tokens, temperature, top_p, seed, top_k=0) -> str:
  import maxnnx  # noqa: PLC0415
  ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
  max_new_tokens = _within_context(model.config.max_position_embeddings, len(ids),
                                   max_new_tokens)
  result = maxnnx.generate(model, [ids], max_new_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k or None, eos_ids=[tokenizer.eos_id], seed=seed)
  return prompt + tokenizer.decode(result.as_lists()[0])


def _within_context(limit: int, prompt_tokens: int, max_new_tokens: int) -> int:
  """``max_new_tokens`` capped to what the model's context leaves after the prompt (a note
  says so), as the server caps ``max_tokens``.

  Raises:
    UsageError: the prompt alone fills the context.
  """
  room = limit - prompt_tokens
  if room < 1:
    raise UsageError(f'prompt= has {prompt_tokens} tokens; the model takes {limit} '
                     '(max_position_embeddings), with room for output: shorten it.')
  if max_new_tokens > room:
    print(f'Note: max_new_tokens={max_new_tokens} is capped to {room}: the prompt has '
          f"{prompt_tokens} tokens of the model's {limit} (max_position_embeddings).")
  return min(max_new_tokens, room)


def generate(options: dict) -> str:
  """Run ``maxnnx generate``: continue ``prompt`` with the model in ``output_dir`` (local or
  a URL, whose files are downloaded first)."""
  import maxnnx  # noqa: PLC0415
  from maxnnx.data import SentencePieceTokenizer, load_tokenizer  # noqa: PLC0415
  from maxnnx.inference.quantize import check_mode, quantize_for_inference  # noqa: PLC0415
  from maxnnx.sharding import tensor_parallel_mesh  # noqa: PLC0415
  check_mode(options['quantization'])  # checked before anything loads, as the mesh
  mesh = tensor_parallel_mesh(options['tensor_parallel'])
  _use_compile_cache(options)
  out = paths.normalize(options['output_dir'])
  model_dir, tok_path = paths.join(out, 'final'), paths.join(out, 'tokenizer.model')
  checkpoints = paths.join(out, 'checkpoints')
  if not paths.exists(model_dir) and paths.isdir(checkpoints):
    model = _model_from_checkpoint(checkpoints)  # an unfinished run: its newest checkpoint
  else:
    model = None
  if model is None and not paths.exists(model_dir):
    raise UsageError(f'{model_dir} is missing: is {out} a directory written by maxnnx train?')
  local_model_dir = paths.local_copy(model_dir) if model is None else None
  if paths.exists(tok_path):  # the tokenizer a run trained on its corpus
    tokenizer = SentencePieceTokenizer(paths.local_copy(tok_path))
  elif local_model_dir is not None:  # a run from a checkpoint's tokenizer (sft, dpo...)
    tokenizer = load_tokenizer(local_model_dir)
  else:
    raise UsageError(f'{tok_path} is missing: is {out} a directory written by maxnnx train?')
  if model is None:
    model = maxnnx.from_pretrained(local_model_dir, mesh=mesh)
  elif mesh is not None:
    model = _placed(model, mesh)
  if options['quantization'] != 'none':
    quantize_for_inference(model, options['quantization'])
  text = _sample(model, tokenizer,
                 options['prompt'], options['max_new_tokens'], options['temperature'],
                 options['top_p'], options['seed'], options['top_k'])
  print(text)
  return text


def _placed(model, mesh_config: MeshConfig):
  """``model`` with its state sharded over ``mesh_config``'s devices (from host values, so
  in a multi-process run each process places its own shards of the same values)."""
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from maxnnx.processes import place_host_value  # noqa: PLC0415
  from maxnnx.sharding import make_mesh, state_shardings  # noqa: PLC0415
  state = nnx.state(model)
  shardings = state_shardings(state, make_mesh(mesh_config))
  nnx.update(model, jax.tree.map(lambda value, sharding: place_host_value(
      np.asarray(value), sharding), state, shardings))
  return model


def _model_from_checkpoint(checkpoint_dir: str, scan_layers: bool = False):
  """A model with the parameters of the newest orbax checkpoint in ``checkpoint_dir``."""
  from flax import nnx  # noqa: PLC0415

  import maxnnx  # noqa: PLC0415
  from maxnnx.models.checkpoints import checkpoint_config, load_params  # noqa: PLC0415
  cfg = checkpoint_config(checkpoint_dir).replace(scan_layers=scan_layers)
  return load_params(maxnnx.Transformer(cfg, rngs=nnx.Rngs(0)), checkpoint_dir)


def convert(options: dict) -> str:
  """Run ``maxnnx convert``: Hugging Face <-> orbax, and scanned <-> unscanned layers."""
  import maxnnx  # noqa: PLC0415
  from maxnnx.models.checkpoints import save_params  # noqa: PLC0415
  src, dst = options['src'], options['dst']
  if not src or not dst:
    raise UsageError('convert needs src=<directory> and dst=<directory>.')
  if not paths.isdir(src):
    raise FileNotFoundError(f'src={src}: no such directory.')
  held = _checkpoint_files(dst)
  if held:
    raise UsageError(f'dst={dst} already has a checkpoint ({held}); convert never overwrites '
                     'one: choose a new or empty directory.')
  source = 'hf' if paths.exists(paths.join(src, 'config.json')) else 'orbax'
  target = options['format'] or {'hf': 'orbax', 'orbax': 'hf'}[source]
  if target not in ('hf', 'orbax'):
    raise UsageError(f"format={target!r}: expected 'hf' or 'orbax'.")
  scan = bool(options['scan_layers']) and target == 'orbax'
  dtype = options['dtype'] or None
  if dtype is not None and target != 'hf':
    raise UsageError(f'dtype={dtype} sets the dtype of a Hugging Face output (format=hf); an '
                     'orbax output keeps the parameters as they are.')
  layout = f" ({'scanned' if scan else 'per-layer'} layers)" if target == 'orbax' else ''
  if source == 'hf' and target == 'orbax' and not paths.is_remote(dst):
    # Tensor by tensor: the host never holds the model (save_params_streaming).
    from maxnnx.models.checkpoints import save_params_streaming  # noqa: PLC0415
    from maxnnx.models.pretrained import host_params  # noqa: PLC0415
    save_params_streaming(*host_params(paths.local_copy(src), scan_layers=scan), dst)
    print(f'Converted {src} ({source}) to {dst} ({target}{layout}).')
    return dst
  if source == 'hf':
    model = maxnnx.from_pretrained(paths.local_copy(src), scan_layers=scan)
  else:
    model = _model_from_checkpoint(src, scan_layers=scan)
  if target == 'hf' and paths.is_remote(dst):
    with tempfile.TemporaryDirectory() as scratch:
      maxnnx.save_pretrained(model, os.path.join(scratch, 'hf'), dtype=dtype)
      paths.copy_tree_to(os.path.join(scratch, 'hf'), dst, last=('config.json',))
  elif target == 'hf':
    maxnnx.save_pretrained(model, dst, dtype=dtype)
  else:
    save_params(model, dst)
  print(f'Converted {src} ({source}) to {dst} ({target}{layout}).')
  return dst


def _checkpoint_files(directory: str) -> str:
  """What of a checkpoint ``directory`` holds, as a few names (empty: none): a Hugging Face
  checkpoint's ``config.json`` and ``*.safetensors``, an orbax checkpoint's step directories."""
  if not paths.isdir(directory):
    return ''
  names = sorted(paths.listdir(directory))
  held = [n for n in names if n == 'config.json' or n.endswith('.safetensors') or n.isdigit()]
  return ', '.join(held[:3]) + (', ...' if len(held) > 3 else '')


def _use_compile_cache(options: dict) -> None:
  """Turn on JAX's persistent compilation cache in ``options['compile_cache']``, if set."""
  if options['compile_cache']:
    from maxnnx.train.diagnostics import enable_compile_cache  # noqa: PLC0415
    enable_compile_cache(options['compile_cache'])


def serve(options: dict) -> None:
  """Run ``maxnnx serve``: an OpenAI-compatible HTTP server over the serving engine
  (:mod:`maxnnx.serving.server`) until SIGTERM or Ctrl-C, which let the requests in flight
  finish."""
  model = options['model']
  if not model:
    raise UsageError('serve needs model=<a Hugging Face checkpoint directory with its '
                     'tokenizer>, e.g. model=runs/tiny-shakespeare/final.')
  if not os.path.isdir(model):
    raise FileNotFoundError(f'model={model}: no such directory.')
  from maxnnx.inference.quantize import check_mode  # noqa: PLC0415
  from maxnnx.serving.server import serve as serve_http  # noqa: PLC0415
  check_mode(options['quantization'])
  _use_compile_cache(options)
  serve_http(model, host=options['host'], port=options['port'],
             log_level=options['log_level'], model_name=options['served_model_name'] or None,
             max_queue=options['max_queue'], max_request_bytes=options['max_request_bytes'],
             add_bos=options['add_bos'],
             dtype=options['dtype'] or None, max_batch=options['max_batch'],
             token_budget=options['token_budget'], page_size=options['page_size'],
             max_pages=options['max_pages'] or None,
             max_window_pages=options['max_window_pages'] or None,
             max_model_len=options['max_model_len'] or None,
             prefix_caching=options['prefix_caching'], max_logprobs=options['max_logprobs'],
             seed=options['seed'], tensor_parallel=options['tensor_parallel'],
             quantization=options['quantization'])


def _command_keys(command: str) -> dict[str, Key]:
  if command in ('convert', 'serve'):
    keys = CONVERT_KEYS if command == 'convert' else SERVE_KEYS
    return {k: Key(d, doc, type(d), 'Keys') for k, (d, doc) in keys.items()}
  if command == 'compile':
    return {**{k: Key(d, doc, type(d), 'compile') for k, (d, doc) in COMPILE_KEYS.items()},
            **train_keys(PRETRAIN)}
  return _generate_keys() if command == 'generate' else train_keys(RECIPES.get(command, PRETRAIN))


def main(argv: list[str] | None = None) -> int:
  """Entry point of ``maxnnx`` / ``python -m maxnnx``."""
  from maxnnx.train import TrainingError  # noqa: PLC0415

  argv = sys.argv[1:] if argv is None else argv
  command = argv[0] if argv and not argv[0].startswith('-') and '=' not in argv[0] and not \
      argv[0].endswith(('.yml', '.yaml')) else 'train'
  rest = argv[1:] if argv and argv[0] == command else argv
  if command == 'maxtext-keys':
    from maxnnx.maxtext_keys import listing  # noqa: PLC0415
    print(listing())
    return 0
  if command not in COMMANDS:
    print(f"error: unknown command '{command}'; use one of: {', '.join(COMMANDS)}.",
          file=sys.stderr)
    return 2
  if any(a in ('-h', '--help') for a in rest):
    print(_usage(command))
    return 0
  stdout = sys.stdout
  try:
    options = parse_overrides(rest, _command_keys(command))
    if command in RECIPES or command in ('compile', 'generate', 'serve'):
      _join_processes(options)
    if command in RECIPES:
      train(options, RECIPES[command])
    else:
      {'generate': generate, 'compile': compile_step, 'convert': convert,
       'serve': serve}[command](options)
  except (ValueError, FileNotFoundError, TrainingError) as e:  # UsageError, ConfigError…
    print(f'error: {e}', file=sys.stderr)
    return 2
  except Exception as e:  # a filesystem fault, also when raised inside orbax's writers
    os_error = _os_error_in(e)
    if os_error is None:
      raise
    print(f'error: {_describe_os_error(os_error)}', file=sys.stderr)
    return 1
  finally:
    if sys.stdout is not stdout:  # a silenced process of a multi-process run
      sys.stdout.close()
      sys.stdout = stdout
  return 0


def _join_processes(options: dict) -> None:
  """Join a multi-process run (``coordinator=``, or the ``MAXNNX_*`` variables, or
  ``coordinator=auto``) before anything touches a device; every process but 0 then runs
  silently (its errors still go to stderr)."""
  from maxnnx.train import distributed  # noqa: PLC0415
  coordinator, count, rank = (options['coordinator'], options['num_processes'],
                              options['process_id'])
  explicit = coordinator not in ('', 'auto')
  if explicit and (count < 1 or not 0 <= rank < count):
    raise UsageError(f'coordinator={coordinator} needs num_processes=N (N >= 1) and '
                     f'process_id=I with 0 <= I < N; got num_processes={count}, '
                     f'process_id={rank}.')
  if not explicit and (count > 0 or rank >= 0):
    raise UsageError('num_processes= and process_id= go with coordinator=host:port (the '
                     "address of process 0's coordinator).")
  joined = distributed.initialize(coordinator if explicit else None,
                                  count if explicit else None, rank if explicit else None,
                                  auto=coordinator == 'auto')
  if joined and not distributed.is_primary():
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # native libraries' prints too
    sys.stdout = open(os.devnull, 'w')  # noqa: SIM115 (closed by main)


def _os_error_in(error: BaseException) -> OSError | None:
  """The ``OSError`` that ``error`` is or was raised from, if any."""
  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, OSError):
      return error
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return None


def _describe_os_error(error: OSError) -> str:
  reason = error.strerror or str(error)
  path = error.filename if error.filename is not None else ''
  return f'{reason}: {path}' if path else reason

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

Other commands: ``generate`` (continue a prompt from a trained run), ``eval``
(lm-evaluation-harness tasks on a checkpoint, :mod:`maxnnx.evaluation.harness`), ``serve`` (an
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
import sys
import tempfile

import numpy as np

from maxnnx import paths
from maxnnx.cli_keys import (
  Key,
  UsageError,
  config_keys,
  usage_lines,
)
from maxnnx.cli_keys import parse as parse_keys
from maxnnx.config import EngineConfig, MeshConfig
from maxnnx.config.commands import (
  CompileTarget,
  ConvertConfig,
  EvalConfig,
  GenerateConfig,
  ProcessConfig,
  RunConfig,
  ServeConfig,
)
from maxnnx.recipes import PRETRAIN, RECIPES, Recipe
from maxnnx.train import (
  RUN_TRAIN_DEFAULTS,
  build_trainer,
  run_model_config,
  sample_text,
  split_settings,
)
from maxnnx.train import run as run_training

TRAIN_OVERRIDES = RUN_TRAIN_DEFAULTS  # defaults of the default run that differ from TrainConfig's
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
  return {**config_keys(RunConfig, '', 'run'), **config_keys(ProcessConfig, '', 'run')}


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


def _process_keys() -> dict[str, Key]:
  return config_keys(ProcessConfig, '', 'Keys')


def _generate_keys() -> dict[str, Key]:
  return {**config_keys(GenerateConfig, '', 'Keys'), **_process_keys()}


COMMANDS = ('train', 'sft', 'dpo', 'distill', 'grpo', 'generate', 'compile', 'convert', 'serve',
            'eval')


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
          'eval': 'maxnnx eval model=HF_DIR tasks=NAME[,NAME] [include_path=DIR] [output=DIR] '
                  '[key=value ...]  |  maxnnx eval model=HF_DIR data=FILE',
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


def _split_options(options: dict, recipe: Recipe = PRETRAIN):
  """``(run options, TrainConfig, model changes, data fields)``: see
  :func:`maxnnx.train.split_settings`."""
  return split_settings(options, recipe)


def _model_config(run: dict, changes: dict):
  """``(ModelConfig, from_pretrained overrides)``: see :func:`maxnnx.train.run_model_config`."""
  return run_model_config(run, changes)


def train(options: dict, recipe: Recipe = PRETRAIN) -> dict:
  """Run ``maxnnx train`` (or a fine-tuning command) with parsed ``options``: the library's
  :func:`maxnnx.train.run`, so a notebook gets the same run directory; returns its summary."""
  return run_training(options, recipe=recipe)


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
  trainer, _, _, _ = build_trainer(options, need_data=False, devices=devices)
  return trainer.compile()


def generate(options: dict) -> str:
  """Run ``maxnnx generate``: continue ``prompt`` with the model in ``output_dir`` (local or
  a URL, whose files are downloaded first)."""
  import maxnnx  # noqa: PLC0415
  from maxnnx.data import SentencePieceTokenizer, load_tokenizer  # noqa: PLC0415
  from maxnnx.inference.quantize import check_mode, quantize_for_inference  # noqa: PLC0415
  from maxnnx.kernels.kv_quant import check_kv_cache_dtype  # noqa: PLC0415
  from maxnnx.sharding import tensor_parallel_mesh  # noqa: PLC0415
  check_mode(options['quantization'])  # checked before anything loads, as the mesh
  check_kv_cache_dtype(options['kv_cache_dtype'])
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
  keep = options['quantization'] == 'checkpoint'
  if model is None:
    model = maxnnx.from_pretrained(local_model_dir, mesh=mesh, keep_quantized=keep)
  elif keep:
    raise UsageError(f'quantization=checkpoint keeps the weights of a quantized release, but '
                     f'{out} holds an unfinished run (a training checkpoint); use int8, int4, '
                     'fp8 or w8a8.')
  elif mesh is not None:
    model = _placed(model, mesh)
  if options['quantization'] not in ('none', 'checkpoint'):
    quantize_for_inference(model, options['quantization'])
  controls = {name: options[name] for name in ('presence_penalty', 'frequency_penalty',
                                               'repetition_penalty', 'min_tokens',
                                               'kv_cache_dtype')}
  text = sample_text(model, tokenizer, options['prompt'], options['max_new_tokens'],
                     options['temperature'], options['top_p'], options['seed'], options['top_k'],
                     logit_bias=_logit_bias(options['logit_bias']), **controls)
  print(text)
  return text


def _logit_bias(text: str) -> dict[int, float]:
  """``logit_bias=id:bias,id:bias`` as ``{id: bias}`` (empty: none)."""
  bias = {}
  for item in filter(None, (part.strip() for part in text.split(','))):
    token, _, value = item.partition(':')
    try:
      bias[int(token)] = float(value)
    except ValueError:
      raise UsageError(f'logit_bias={text!r}: expected id:bias pairs separated by commas, '
                       'e.g. logit_bias=5:-100,17:2.5') from None
  return bias


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
  cfg = checkpoint_config(checkpoint_dir).replace(**{'runtime.scan_layers': scan_layers})
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
  source = ('hf' if paths.exists(paths.join(src, 'config.json')) else
            'maxtext' if paths.isdir(paths.join(src, 'items')) else 'orbax')
  if options['maxtext_config'] and source != 'maxtext':
    raise UsageError(f'maxtext_config= describes a MaxText checkpoint; src={src} is a {source} '
                     'one.')
  target = options['format'] or {'hf': 'orbax', 'orbax': 'hf', 'maxtext': 'hf'}[source]
  if target not in ('hf', 'orbax', 'maxtext'):
    raise UsageError(f"format={target!r}: expected 'hf', 'orbax' or 'maxtext'.")
  scan = bool(options['scan_layers']) and target == 'orbax'
  dtype = options['dtype'] or None
  if target == 'maxtext':
    return _convert_to_maxtext(src, source, dst, options)
  if dtype is not None and target != 'hf':
    raise UsageError(f'dtype={dtype} sets the dtype of a Hugging Face output (format=hf); an '
                     'orbax output keeps the parameters as they are.')
  layout = f" ({'scanned' if scan else 'per-layer'} layers)" if target == 'orbax' else ''
  if source == 'hf' and target == 'orbax' and not paths.is_remote(dst):
    # Tensor by tensor: the host never holds the model (save_params_streaming).
    from maxnnx.models.checkpoints import save_params_streaming  # noqa: PLC0415
    from maxnnx.models.pretrained import host_params  # noqa: PLC0415
    save_params_streaming(*host_params(paths.local_copy(src), **{'runtime.scan_layers': scan}),
                          dst)
    print(f'Converted {src} ({source}) to {dst} ({target}{layout}).')
    return dst
  if source == 'maxtext':
    settings = options['maxtext_config'] or None
    if settings and not settings.endswith(('.yml', '.yaml')):
      settings = [item for item in settings.split(',') if item.strip()]
    model = maxnnx.from_maxtext(paths.local_copy(src), settings, scan_layers=scan)
  elif source == 'hf':
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


def _convert_to_maxtext(src: str, source: str, dst: str, options: dict) -> str:
  """``maxnnx convert format=maxtext``: the model as a MaxText parameters-only checkpoint."""
  import maxnnx  # noqa: PLC0415
  from maxnnx.checkpoint.maxtext import write_maxtext  # noqa: PLC0415
  dtype = options['dtype'] or 'float32'
  if dtype not in ('float32', 'bfloat16'):
    raise UsageError(f"dtype={dtype}: a MaxText checkpoint's weight_dtype is float32 or "
                     'bfloat16.')
  if source == 'maxtext':
    raise UsageError(f'src={src} is a MaxText checkpoint already.')
  with tempfile.TemporaryDirectory() as scratch:
    model = (maxnnx.from_pretrained(paths.local_copy(src), dtype='float32') if source == 'hf'
             else _model_from_checkpoint(src))
    maxnnx.save_pretrained(model, os.path.join(scratch, 'hf'), dtype='float32')
    local = os.path.join(scratch, 'maxtext') if paths.is_remote(dst) else dst
    items, settings = write_maxtext(os.path.join(scratch, 'hf'), local,
                                    scan_layers=bool(options['scan_layers']), dtype=dtype)
    if local != dst:
      paths.copy_tree_to(local, dst)
      items = paths.join(dst, '0', 'items')
  print(f'Converted {src} ({source}) to {dst} (maxtext). In MaxText: load_parameters_path={items} '
        + ' '.join(f'{k}={str(v).lower() if isinstance(v, bool) else v}'
                   for k, v in settings.items()))
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


def _checkpoint_model(options: dict, command: str) -> str:
  """``model=`` of a command that serves or scores a checkpoint: given, and a directory or URL."""
  model = options['model']
  if not model:
    raise UsageError(f'{command} needs model=<a Hugging Face checkpoint directory with its '
                     'tokenizer>, e.g. model=runs/tiny-shakespeare/final.')
  if not paths.is_remote(model) and not os.path.isdir(model):
    raise FileNotFoundError(f'model={model}: no such directory.')
  return model


def serve(options: dict) -> None:
  """Run ``maxnnx serve``: an OpenAI-compatible HTTP server over the serving engine
  (:mod:`maxnnx.serving.server`) until SIGTERM or Ctrl-C, which let the requests in flight
  finish."""
  from maxnnx.kernels.kv_quant import check_kv_cache_dtype  # noqa: PLC0415
  check_kv_cache_dtype(options['kv_cache_dtype'])  # before the model loads
  model = _checkpoint_model(options, 'serve')
  from maxnnx.inference.quantize import check_mode  # noqa: PLC0415
  from maxnnx.serving.server import serve as serve_http  # noqa: PLC0415
  check_mode(options['quantization'])
  _use_compile_cache(options)
  serve_http(model, host=options['host'], port=options['port'],
             log_level=options['log_level'], model_name=options['served_model_name'] or None,
             max_queue=options['max_queue'], max_request_bytes=options['max_request_bytes'],
             add_bos=options['add_bos'], dtype=options['dtype'] or None,
             reasoning_parser=options['reasoning_parser'] or None,
             tensor_parallel=options['tensor_parallel'], quantization=options['quantization'],
             **{f.name: options[f.name] for f in dataclasses.fields(EngineConfig)})


def evaluate(options: dict) -> dict:
  """Run ``maxnnx eval``: lm-evaluation-harness ``tasks`` on the checkpoint in ``model``
  (:mod:`maxnnx.evaluation.harness`), printing the harness's table; or, with ``data=``, the
  loss and perplexity per token of a text file. Returns the harness's results (or
  ``{'loss', 'perplexity', 'tokens'}``)."""
  model = _checkpoint_model(options, 'eval')
  if bool(options['tasks']) == bool(options['data']):
    raise UsageError('eval needs tasks=<lm-evaluation-harness task names> or data=<a text '
                     'file>, not both.' if options['tasks'] else
                     'eval needs tasks=<lm-evaluation-harness task names, comma-separated> '
                     '(or data=<a .txt or .jsonl file> for loss and perplexity).')
  if options['include_path'] and not os.path.isdir(options['include_path']):
    raise FileNotFoundError(f"include_path={options['include_path']}: no such directory.")
  from maxnnx.evaluation import require_lm_eval  # noqa: PLC0415
  try:
    require_lm_eval()
  except ImportError as e:
    raise UsageError(str(e)) from None
  from maxnnx.evaluation import harness  # noqa: PLC0415
  if options['data']:
    return _evaluate_text(harness, options)
  limit = options['limit']
  results = harness.evaluate_tasks(
      model, options['tasks'], include_path=options['include_path'], output=options['output'],
      batch_size=options['batch_size'], limit=None if limit <= 0 else
      (limit if limit < 1 else int(limit)), dtype=options['dtype'] or None,
      num_fewshot=None if options['num_fewshot'] < 0 else options['num_fewshot'],
      max_length=options['max_length'] or None, seed=options['seed'],
      tensor_parallel=options['tensor_parallel'])
  from lm_eval.utils import make_table  # noqa: PLC0415
  print(make_table(results))
  if 'groups' in results:
    print(make_table(results, 'groups'))
  if options['output']:
    print(f"Results and per-sample logs written under {options['output']}.")
  return results


def _evaluate_text(harness, options: dict) -> dict:
  """``maxnnx eval data=FILE``: the loss and perplexity per token of the file's texts."""
  import json  # noqa: PLC0415
  import math  # noqa: PLC0415
  path = options['data']
  if not paths.exists(path):
    raise FileNotFoundError(f'data={path}: no such file.')
  with open(paths.local_copy(path), encoding='utf-8') as f:
    if path.endswith('.jsonl'):
      texts = []
      for number, line in enumerate(f, 1):
        if line.strip():
          record = json.loads(line)
          if not isinstance(record, dict) or not isinstance(record.get('text'), str):
            raise UsageError(f'data={path} line {number}: expected an object with a "text" '
                             'string.')
          texts.append(record['text'])
    else:
      texts = [f.read()]
  lm = harness.MaxnnxLM(options['model'], dtype=options['dtype'] or None,
                        batch_size=options['batch_size'], max_length=options['max_length'] or None,
                        tensor_parallel=options['tensor_parallel'])
  loss, tokens = harness.text_loss(lm, texts)
  print(f'{path}: {tokens} tokens, loss {loss:.4f}, perplexity {math.exp(loss):.4f} '
        f'(windows of {lm.max_length} tokens).')
  return {'loss': loss, 'perplexity': math.exp(loss), 'tokens': tokens}


def _command_keys(command: str) -> dict[str, Key]:
  if command == 'serve':  # the server's keys, the engine's, and the processes'
    return {**config_keys(ServeConfig, '', 'Keys'), **config_keys(EngineConfig, '', 'Keys'),
            **_process_keys()}
  if command in ('convert', 'eval'):
    return config_keys(ConvertConfig if command == 'convert' else EvalConfig, '', 'Keys')
  if command == 'compile':
    return {**config_keys(CompileTarget, '', 'compile'), **train_keys(PRETRAIN)}
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
       'serve': serve, 'eval': evaluate}[command](options)
  except (ValueError, FileNotFoundError, TrainingError) as e:  # UsageError, ConfigError…
    print(f'error: {e}', file=sys.stderr)
    return 2
  except Exception as e:  # a filesystem fault, also when raised inside orbax's writers
    os_error = paths.os_error_in(e)
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


def _describe_os_error(error: OSError) -> str:
  reason = error.strerror or str(error)
  path = error.filename if error.filename is not None else ''
  return f'{reason}: {path}' if path else reason

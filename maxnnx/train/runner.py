"""A training run as ``maxnnx train`` does it, callable from Python: :func:`run`.

A run is more than :class:`~maxnnx.train.Trainer.fit`: it owns a directory (locked, its config
checked before a resume, :mod:`maxnnx.train.run_dir`), a tokenizer trained on the corpus and
pinned to the run (:mod:`maxnnx.train.run_tokenizer`), and what it leaves at the end: ``final/``
in Hugging Face format, a LoRA run's ``adapter/``, ``loss.png`` and ``metrics.jsonl``
(:mod:`maxnnx.train.export`). The command line parses its keys into the same settings and calls
:func:`run`, so a notebook cell and ``python -m maxnnx train`` with the same settings write
the same run directory.

Settings are keys as the command line spells them: run keys (:data:`RUN_SETTINGS`),
``TrainConfig`` fields bare, and dotted ``mesh.*``, ``lora.*``, ``model.*`` and ``data.*``
keys. A fine-tuning method is a *recipe* (:class:`RunRecipe`: its own keys, its data and
objective); the default pre-trains.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import shutil
from typing import Any, Protocol

import numpy as np

from maxnnx import paths
from maxnnx.config import MeshConfig, ValidatedConfig, check_expert_split, dotted_fields, subtree
from maxnnx.parallel.pipeline import describe_schedule
from maxnnx.train import export
from maxnnx.train.run_tokenizer import (
    is_text_file,
    model_and_tokenizer,
    pin_tokenizer,
    run_model_config,
    tokenizer_staging,
)

# Joining a multi-process run: read by the command line before anything touches a device.
PROCESS_SETTINGS = {
    'coordinator': ('', 'multi-process run: host:port of process 0\'s coordinator (with '
                    'num_processes and process_id), or auto: jax.distributed finds the cluster '
                    '(SLURM, Kubernetes JobSet, TPU pods); empty: the MAXNNX_COORDINATOR_ADDRESS, '
                    'MAXNNX_NUM_PROCESSES and MAXNNX_PROCESS_ID variables, else one process'),
    'num_processes': (0, 'how many processes take part (with coordinator=host:port)'),
    'process_id': (-1, "this process's rank, 0 .. num_processes - 1 (with coordinator=host:port)"),
}
# Keys of the run itself, ``name -> (default, doc)`` (TrainConfig and MeshConfig have their own).
RUN_SETTINGS = {
    'model': ('tiny', 'preset name (see maxnnx.list_presets()) or a local Hugging Face '
              'checkpoint directory to start from'),
    'data': ('', "training data: a UTF-8 .txt file, a JSONL/Parquet/ArrayRecord file or dataset "
             "directory, a URL fsspec reads (s3://bucket/shards/*.parquet, gs://, https://, "
             "hf://), "
             "'synthetic' (random tokens), or empty for the shipped Shakespeare corpus"),
    'eval_data': ('', 'held-out data evaluated every eval_every steps (eval_batches batches; '
                  'eval_loss and eval_perplexity in metrics.jsonl and loss.png): any format '
                  'and URL data= takes; empty: the held-out tail of a .txt corpus, else none'),
    'eval_split': ('validation|test', 'the split eval_data reads from a directory laid out as a '
                   'Hugging Face Hub dataset (the first it has; data.split names the training '
                   "one, 'train' by default)"),
    'maxtext_config': ('', 'with model=<a MaxText step directory> (MaxText\'s '
                       'load_parameters_path): its settings, a MaxText YAML or key=value pairs '
                       'joined by commas (decoder_block, rope_max_timescale...); the run starts '
                       'from its parameters converted to Hugging Face format'),
    'tokenizer': ('', 'tokenizer file or directory (sentencepiece, tokenizer.json, tiktoken); '
                  'default: the checkpoint\'s own, or one trained on a .txt corpus'),
    'output_dir': ('runs/tiny-shakespeare', 'where tokenizer, metrics, plot and model go'),
    'dtype': ('auto', 'compute dtype: auto (bfloat16 on GPUs/TPUs and on CPUs with native '
                      'bf16 (AVX-512 BF16, AMX), else float32; printed at the start), bfloat16 '
                      '(matmuls accumulate in float32) or float32; parameters stay float32'),
    'scan_layers': (False, 'run the layer stack as one scanned block (mesh.stage > 1 sets it)'),
    'remat_policy': ('', 'activation rematerialisation: none, minimal, save_dot_except_mlp, '
                     'save_qkv_proj, save_out_proj, full, custom (per tensor: '
                     'model.remat_save / model.remat_offload; empty: the model default)'),
    'attention_impl': ('', 'attention kernel strategy (empty: the model default)'),
    'sample_tokens': (120, 'tokens of the sample printed at the end (0: none)'),
    'resume': ('auto', 'auto: continue the run in output_dir when its stored config matches '
               '(a different one is refused); never: move an earlier run aside to '
               'output_dir/previous/<time>/ and start fresh'),
    **PROCESS_SETTINGS,
}
# Defaults of the default run that differ from TrainConfig's.
RUN_TRAIN_DEFAULTS = {
    'steps': 600, 'global_batch_size': 16, 'seq_len': 128, 'learning_rate': 3e-3,
    'log_every': 25, 'eval_every': 100, 'checkpoint_every': 200,
}


class RunRecipe(Protocol):
  """What a training method changes about a run (``maxnnx sft``, ``dpo``, ``distill``...).

  Attributes:
    name: the method's name (its command).
    keys: its own settings, ``name -> (default, doc)``.
    run_defaults: run settings whose defaults differ (``output_dir``...).
    train_defaults: TrainConfig defaults that differ from :data:`RUN_TRAIN_DEFAULTS`.
    records: the data is records read with the run's tokenizer (none is trained).
    label: the prefix of the run's opening line (``'SFT: '``; empty for pre-training).
  """
  name: str
  keys: dict[str, tuple[Any, str]]
  run_defaults: dict[str, Any]
  train_defaults: dict[str, Any]
  records: bool
  label: str

  def attach(self, trainer, data) -> None:
    """What the method adds once the Trainer exists (GRPO: rollouts from its model)."""

  def prepare(self, run: dict, options: dict) -> None:
    """Adjust the run settings before the model and tokenizer are made."""

  def adjust_model(self, cfg, options: dict, changes: dict):
    """The model config to train."""

  def template(self, options: dict, tokenizer, family: str | None = None):
    """The chat template written beside ``final/``'s tokenizer, or ``None``."""

  def data(self, options: dict, spec: str, data_fields: dict, tokenizer, model_config,
           train_config, local_batch: int):
    """The training batches of a records recipe."""

  def objective(self, options: dict, model, train_config):
    """The objective to train (``None``: next-token pre-training)."""

  def record(self, options: dict) -> dict:
    """The recipe's settings a resume must match."""


@dataclasses.dataclass(frozen=True)
class Pretraining:
  """The default recipe: next-token prediction on the run's corpus, nothing added.

  Attributes:
    name: ``'train'``.
    keys: none of its own.
    run_defaults: none changed.
    train_defaults: none changed.
    records: ``False``: the data is a corpus, its tokenizer trained when none is given.
    label: empty.
  """
  name: str = 'train'
  keys: dict[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)
  run_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
  train_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
  records: bool = False
  label: str = ''

  def prepare(self, run: dict, options: dict) -> None:
    """Nothing to adjust."""

  def attach(self, trainer, data) -> None:
    """Nothing to add."""

  def adjust_model(self, cfg, options: dict, changes: dict):
    """``cfg`` unchanged."""
    return cfg

  def template(self, options: dict, tokenizer, family: str | None = None):
    """No chat template."""
    return None

  def data(self, options: dict, spec: str, data_fields: dict, tokenizer, model_config,
           train_config, local_batch: int):
    """Never called: pre-training data is not records."""
    raise NotImplementedError

  def objective(self, options: dict, model, train_config):
    """``None``: the Trainer's pre-training objective."""
    return None

  def record(self, options: dict) -> dict:
    """No settings of its own."""
    return {}


PRETRAINING = Pretraining()


def run_settings(settings: dict[str, Any] | None = None,
                 recipe: RunRecipe = PRETRAINING) -> dict[str, Any]:
  """Every setting of a run, the given ones over the defaults, as ``maxnnx train`` fills them.

  Args:
    settings: keys as the command line spells them (``{'steps': 3, 'model.num_layers': 2,
      'mesh.data': 1}``). A config object stands for all its fields: a ``TrainConfig`` under
      ``'train'``, any other config under its group's name (``'mesh'``, ``'lora'``, ``'data'``,
      ``'model'``: every field replaces the preset's).
    recipe: the training method, whose own keys and defaults join.

  Returns:
    ``{key: value}`` with the run, recipe, TrainConfig and MeshConfig keys at their defaults
    unless given, and the ``model.*`` / ``data.*`` keys given.

  Raises:
    ValueError: an unknown key, naming the nearest known one.
  """
  from maxnnx.train.config import TrainConfig  # noqa: PLC0415
  given = {}
  for key, value in (settings or {}).items():
    if isinstance(value, ValidatedConfig):
      given.update(dotted_fields(value, '' if key == 'train' else f'{key}.'))
    else:
      given[key.removeprefix('train.')] = value  # train.steps is steps, as on the command line
  options = {k: recipe.run_defaults.get(k, d) for k, (d, _) in RUN_SETTINGS.items()}
  options.update({k: d for k, (d, _) in recipe.keys.items()})
  defaults = {**RUN_TRAIN_DEFAULTS, **recipe.train_defaults}
  for key, value in dotted_fields(TrainConfig()).items():
    options[key] = defaults.get(key, value)
  for key in given:
    if key not in options and not key.startswith(('model.', 'data.')):
      near = difflib.get_close_matches(key, options, n=1)
      raise ValueError(f"Unknown setting '{key}'."
                       + (f" Did you mean '{near[0]}'?" if near else '')
                       + ' Settings are run keys, TrainConfig fields and dotted mesh., lora., '
                       'model. and data. keys (maxnnx train --help lists them).')
  options.update(given)
  return options


def split_settings(options: dict, recipe: RunRecipe = PRETRAINING):
  """``(run settings, TrainConfig, model changes, data fields)`` from a run's settings.

  Args:
    options: every setting (:func:`run_settings`).
    recipe: the training method; its own keys stay in ``options``.

  Returns:
    Model changes and data fields as nested dicts of the ``model.*`` and ``data.*`` keys.
  """
  from maxnnx.train.config import TrainConfig  # noqa: PLC0415
  run = {k: options[k] for k in RUN_SETTINGS}
  run['output_dir'] = paths.normalize(run['output_dir'])
  fields = {k: v for k, v in options.items()
            if k not in RUN_SETTINGS and k not in recipe.keys and '.' not in k}
  if fields.get('checkpoint_every') and not fields.get('checkpoint_dir'):
    fields['checkpoint_dir'] = paths.join(run['output_dir'], 'checkpoints')
  train_config = TrainConfig.from_dict({**fields, 'mesh': subtree(options, 'mesh.'),
                                        'lora': subtree(options, 'lora.')})
  model_changes, data_fields = subtree(options, 'model.'), subtree(options, 'data.')
  if 'sources' in data_fields:
    run['data'] = ','.join(data_fields.pop('sources'))
  run['data'] = _local_file_urls(run['data'])
  run['eval_data'] = _local_file_urls(run['eval_data'])
  run['model_label'] = run['model']  # what the headline names: the step directory, not its copy
  run['model'] = _from_maxtext_step(run['model'], run['maxtext_config'])
  if not run['tokenizer']:
    run['tokenizer'] = data_fields.get('tokenizer', '')
  _scan_for_stages(run, train_config.mesh, options)
  return run, train_config, model_changes, data_fields


def _from_maxtext_step(model: str, maxtext_config: str) -> str:
  """``model=`` as the run reads it: a MaxText step directory (``.../checkpoints/<step>``,
  ``items/`` inside; local or at a URL, downloaded first) becomes its Hugging Face conversion,
  written once per process into a local scratch directory; anything else is returned as it
  is."""
  step_dir = model.rstrip('/')
  step_dir = step_dir[:-len('/items')] if step_dir.endswith('/items') else step_dir
  try:
    is_maxtext = (paths.isdir(paths.join(step_dir, 'items'))
                  and not paths.exists(paths.join(step_dir, 'config.json')))
  except Exception:  # a Hub repo id or a URL no file system here reads: not a step directory
    is_maxtext = False
  if not is_maxtext:
    if maxtext_config:
      raise ValueError(f'maxtext_config= describes a MaxText step directory given as model=; '
                       f'model={model} is not one (no items/ inside).')
    return model
  from maxnnx.checkpoint.maxtext import write_hf  # noqa: PLC0415
  settings = maxtext_config or None
  if settings and not settings.endswith(('.yml', '.yaml')):
    settings = [item for item in settings.split(',') if item.strip()]
  target = os.path.join(paths.scratch_dir(), 'maxtext-' + os.path.basename(step_dir))
  if not os.path.exists(os.path.join(target, 'config.json')):
    record = write_hf(paths.local_copy(step_dir), target, settings)
    step = f" (its step {record['step']})" if record['step'] is not None else ''
    print(f'Starting from the MaxText checkpoint {step_dir}{step}: converted to Hugging Face '
          'format for this run.')
  return target


def _local_file_urls(data: str) -> str:
  """``data`` with each ``file://`` source as the local path it names (a .txt corpus is then
  read as one, and libraries that take paths get them)."""
  if 'file://' not in data:
    return data
  return ','.join(paths.normalize(s.strip()) if s.strip().startswith('file://') else s
                  for s in data.split(','))


def _scan_for_stages(run: dict, mesh: MeshConfig, options: dict) -> None:
  """Pipeline stages run the scanned layer stack: switch ``scan_layers`` on for them, and
  print the schedule's bubble."""
  stages = mesh.stage > 1 or mesh.dcn_stage > 1
  explicit = any(k.startswith('model.') and k.endswith('.scan_layers') for k in options)
  if stages and not run['scan_layers'] and not explicit:
    run['scan_layers'] = True
    print(f'Note: mesh.stage={mesh.stage} pipelines the scanned layer stack; '
          'scan_layers is set to true.')
  if stages:
    total = max(mesh.stage, 1) * max(mesh.dcn_stage, 1)
    print(describe_schedule(total, mesh.pipeline_microbatches or total, mesh.pipeline_repeats))


def _training_data(run: dict, data_fields: dict, corpus: str | None, model, tokenizer,
                   train_config):
  """``(data, token count)``: token windows of a .txt corpus, the grain pipeline for
  documents (or for any ``data.*`` key), or ``None`` for the Trainer's synthetic tokens."""
  import jax  # noqa: PLC0415

  from maxnnx.data import DataConfig, TokenWindows, make_pipeline  # noqa: PLC0415
  from maxnnx.data.text import read_text  # noqa: PLC0415
  local_batch = train_config.global_batch_size // jax.process_count()
  if corpus is not None and is_text_file(corpus) and not data_fields:
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


def _held_out_data(run: dict, options: dict, recipe: RunRecipe, data_fields: dict, model,
                   tokenizer, train_config):
  """The held-out batches of ``eval_data=``: read as the training data is (the recipe's records
  pipeline, else the document pipeline), in file order, the same batches at every evaluation."""
  import jax  # noqa: PLC0415

  from maxnnx.data import DataConfig, make_pipeline  # noqa: PLC0415
  from maxnnx.train.batches import HeldOutBatches  # noqa: PLC0415
  spec = run['eval_data']
  if not train_config.eval_every:
    raise ValueError(f'eval_data={spec} is evaluated every eval_every steps: set eval_every '
                     '(it is 0).')
  local_batch = train_config.global_batch_size // jax.process_count()
  fields = {**{k: v for k, v in data_fields.items() if k != 'weights'}, 'shuffle': False,
            'split': run['eval_split']}
  config = model if hasattr(model, 'to_dict') else model.config
  if recipe.records:
    batches = recipe.data(options, spec, fields, tokenizer, config, train_config, local_batch)
  else:
    batches = make_pipeline(DataConfig.from_string(spec, **fields), tokenizer,
                            batch_size=local_batch, seq_len=train_config.seq_len,
                            seed=train_config.seed, vocab_size=config.vocab_size)
  return HeldOutBatches(batches, f'eval_data={spec}')


def _check_expert_split(model_config, mesh_config) -> None:
  """The Trainer's check of the expert strategy against the model's experts, made before the
  run directory is written to."""
  import jax  # noqa: PLC0415

  from maxnnx.sharding import mesh_shape  # noqa: PLC0415
  if mesh_config.expert_parallel_strategy != 'all_to_all':
    return
  try:
    ici, dcn = mesh_shape(mesh_config, jax.device_count())
  except ValueError:  # a mesh of fewer devices than there are: the Trainer checks it on them
    return
  check_expert_split(mesh_config.expert_parallel_strategy, model_config.moe.num_experts,
                     ici['expert'] * dcn['expert'])


def _model_tokenizer_checked(run, model_changes, data_fields, corpus, options, recipe,
                             train_config, run_dir, devices):
  """:func:`model_and_tokenizer`, the config checked against ``run_dir``'s stored one and the
  trained tokenizer pinned once it is accepted."""
  from maxnnx.train.run_dir import run_config  # noqa: PLC0415
  out = run['output_dir']
  stored = run_dir.stored_config() if run_dir is not None else None
  if devices is not None:  # compile only: the config is all the abstract model needs
    return run_model_config(run, model_changes)[0], None, None
  model, tokenizer, tokenizer_record = model_and_tokenizer(
      run, model_changes, out, corpus, recipe=recipe, pinned=(stored or {}).get('tokenizer'),
      data_fields=data_fields, options=options, mesh=train_config.mesh)
  if run_dir is not None:
    config = model if hasattr(model, 'to_dict') else model.config
    _check_expert_split(config, train_config.mesh)  # before run_config.json is written
    try:
      run_dir.check_config(run_config(config, train_config, tokenizer_record,
                                      objective=recipe.record(options) or None),
                           train_config.checkpoint_dir)
    except ValueError:
      shutil.rmtree(tokenizer_staging(out), ignore_errors=True)
      raise
    pin_tokenizer(out)
    if (tokenizer_record and '.tokenizer-new' in getattr(tokenizer, 'path', '')
        and not os.path.exists(tokenizer.path)):  # pinned: moved into out
      tokenizer = type(tokenizer)(paths.local_copy(paths.join(out, 'tokenizer.model')))
  return model, tokenizer, tokenizer_record


def build_trainer(options: dict, *, need_data: bool = True, run_dir=None,
                  recipe: RunRecipe = PRETRAINING, devices=None):
  """The run's :class:`~maxnnx.train.Trainer`, its model, tokenizer and data made.

  Args:
    options: every setting (:func:`run_settings`).
    need_data: read the data (``False``: compile only).
    run_dir: an opened :class:`~maxnnx.train.run_dir.RunDir`: the run's config is checked
      against the stored one before any data is read.
    recipe: the training method (data, objective, own keys).
    devices: abstract devices (compiling only) that replace the attached ones in the mesh;
      the model is then built abstractly from its config.

  Returns:
    ``(trainer, run settings, tokenizer, token count)``.
  """
  from maxnnx.data import DEFAULT_CORPUS  # noqa: PLC0415
  from maxnnx.train import Trainer  # noqa: PLC0415
  from maxnnx.train.run_dir import check_writable  # noqa: PLC0415

  run, train_config, model_changes, data_fields = split_settings(options, recipe)
  recipe.prepare(run, options)
  if run_dir is None:
    check_writable(run['output_dir'])
  synthetic = run['data'] == 'synthetic' or not need_data
  corpus = None if synthetic else (run['data'] or DEFAULT_CORPUS)
  model, tokenizer, _ = _model_tokenizer_checked(run, model_changes, data_fields, corpus,
                                                 options, recipe, train_config, run_dir, devices)
  data, num_tokens = None, 0
  if need_data and recipe.records:
    import jax  # noqa: PLC0415
    config = model if hasattr(model, 'to_dict') else model.config
    data = recipe.data(options, run['data'], data_fields, tokenizer, config, train_config,
                       train_config.global_batch_size // jax.process_count())
  elif need_data:
    data, num_tokens = _training_data(run, data_fields, corpus, model, tokenizer, train_config)
  eval_data = (_held_out_data(run, options, recipe, data_fields, model, tokenizer, train_config)
               if need_data and run['eval_data'] else None)
  if train_config.eval_every and eval_data is None and not hasattr(data, 'eval_batches'):
    if data is not None and train_config.target_eval_loss is not None:
      raise ValueError(f'target_eval_loss={train_config.target_eval_loss:g} needs held-out '
                       f"data: give eval_data= (data={run['data']} has no held-out split).")
    if data is not None:
      print('Note: this data source has no held-out split (give one with eval_data=); '
            'eval_every is set to 0.')
    train_config = dataclasses.replace(train_config, eval_every=0, target_eval_loss=None)
  objective = recipe.objective(options, model, train_config)
  mesh = None
  if devices is not None:
    from maxnnx import sharding  # noqa: PLC0415
    mesh = sharding.make_mesh(train_config.mesh, devices)
  trainer = Trainer(model, train_config, objective, data=data, eval_data=eval_data, mesh=mesh)
  recipe.attach(trainer, data)  # e.g. GRPO's rollouts sample from the trainer's own model
  return trainer, run, tokenizer, num_tokens


def run(settings: dict[str, Any] | None = None, *, recipe: RunRecipe = PRETRAINING,
        **keys: Any) -> dict:
  """Train as ``maxnnx train`` does, from Python: the same settings write the same directory.

  The output directory is locked for the run and its stored config checked before resuming
  (:mod:`maxnnx.train.run_dir`); a tokenizer is trained on a text corpus and pinned to the
  run; SIGTERM/SIGINT end it with a checkpoint; at the end ``final/`` (Hugging Face format,
  with the tokenizer), ``loss.png`` and a LoRA run's ``adapter/`` are written, and a rerun of a
  finished run only writes what is missing.

  Args:
    settings: keys as the command line spells them, or config objects
      (:func:`run_settings`): ``{'model': 'tiny', 'steps': 40, 'model.num_layers': 2}``.
    recipe: the training method (``maxnnx.recipes``); default: pre-training.
    **keys: more bare keys (``steps=40, output_dir='runs/a'``), over ``settings``.

  Returns:
    ``{'first_loss', 'last_loss', 'eval_loss'}`` (``None`` when nothing was trained), with
    ``'reached_target'`` (:attr:`~maxnnx.train.Trainer.reached_target`) after training, and
    ``'stopped_by'`` when a signal ended the run early.
  """
  from maxnnx.train.run_dir import RunDir  # noqa: PLC0415
  options = run_settings({**(settings or {}), **keys}, recipe)
  with RunDir(options['output_dir'], resume=options['resume']) as run_dir:
    if run_dir.moved_to:
      print(f'resume=never: moved the earlier run to {run_dir.moved_to}.')
    return train_in(run_dir, options, recipe)


def _compute_line(trainer) -> str:
  """The compute dtype (and why, for ``dtype=auto``) and the ceiling MFU divides by."""
  from maxnnx.hardware import auto_compute_dtype, resolve_compute_dtype  # noqa: PLC0415
  chosen = trainer.model_config.runtime.dtype
  why = f' (dtype=auto: {auto_compute_dtype()[1]})' if chosen == 'auto' else ''
  return (f'Compute dtype {resolve_compute_dtype(chosen)}{why}; MFU against '
          f'{trainer.peak_flops / 1e12:.4g} TFLOP/s per device, {trainer.peak_source}.')


def _headline(trainer, run: dict, options: dict, recipe: RunRecipe, num_tokens: int) -> str:
  import maxnnx  # noqa: PLC0415
  cfg = trainer.config
  source = (f'{num_tokens:,} tokens' if num_tokens else
            'synthetic tokens' if run['data'] == 'synthetic' else
            run['data'] or options.get('prompts', ''))
  return (f"{recipe.label}Training {run.get('model_label', run['model'])} "
          f"({maxnnx.num_params(trainer.model_config):,} parameters) "
          f'on {source} for {cfg.steps} steps of {cfg.global_batch_size} x {cfg.seq_len} '
          f'tokens; mesh '
          f'{dict((k, v) for k, v in trainer.mesh.shape.items() if v > 1) or "1 device"}'
          + (f'; {trainer.quantization} quantized training.' if trainer.quantization != 'none'
             else '.'))


def _fit(trainer, run_dir, out: str) -> list[dict]:
  """Restore the newest checkpoint, point the metrics at the run directory and train."""
  from maxnnx.train.run_dir import checkpoint_steps  # noqa: PLC0415
  cfg = trainer.config
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
    return trainer.fit() if trainer.step_count < cfg.steps else []
  finally:
    trainer.close()


def train_in(run_dir, options: dict, recipe: RunRecipe = PRETRAINING) -> dict:
  """Build the trainer, train and write the run's artifacts into an opened run directory.

  Args:
    run_dir: the opened :class:`~maxnnx.train.run_dir.RunDir` of ``options['output_dir']``.
    options: every setting (:func:`run_settings`).
    recipe: the training method.

  Returns:
    The summary :func:`run` returns.
  """
  trainer, run, tokenizer, num_tokens = build_trainer(options, run_dir=run_dir, recipe=recipe)
  out = run['output_dir']
  template = (recipe.template(options, tokenizer, trainer.model_config.family)
              if recipe.records and tokenizer is not None else None)
  print(_headline(trainer, run, options, recipe, num_tokens))
  print(_compute_line(trainer))
  history = _fit(trainer, run_dir, out)
  cfg = trainer.config
  if trainer.stopped_by:
    where = (f'checkpoint of step {trainer.step_count} saved in {cfg.checkpoint_dir}; run the '
             'same command to resume' if cfg.checkpoint_dir else
             'no checkpoint_dir, so nothing was saved')
    print(f'Stopped by {trainer.stopped_by} after step {trainer.step_count}: {where}.')
    return {'first_loss': None, 'last_loss': None, 'eval_loss': None,
            'stopped_by': trainer.stopped_by}
  model = export.export_view(trainer.model, out)
  if not history:
    written = export.write_final(model, run_dir, options, run_dir.read_metrics(cfg.metrics_jsonl),
                                 only_missing=True, tokenizer=tokenizer, template=template)
    print(f'Nothing to train: the checkpoint is at step {trainer.step_count} of {cfg.steps}'
          + (f"; wrote the missing {', '.join(written)}." if written else '.'))
    return {'first_loss': None, 'last_loss': None, 'eval_loss': None}
  if trainer.reached_target:
    reached = trainer.reached_target
    print(f"Stopped at step {reached['step']} of {cfg.steps}: the held-out loss "
          f"{reached['eval_loss']:.4f} reached target_eval_loss={reached['target']:g}.")
  export.write_final(model, run_dir, options, run_dir.read_metrics(cfg.metrics_jsonl) or history,
                     tokenizer=tokenizer, template=template)
  trained_tokenizer = paths.exists(paths.join(out, 'tokenizer.model')) and not run['tokenizer']
  print(f'Wrote {out}/: metrics.jsonl, loss.png, final/ (Hugging Face format)'
        + (', tokenizer.model' if trained_tokenizer else '') + '.')
  if run['sample_tokens'] and tokenizer is not None:  # every process: one SPMD program
    print('\nSample:\n' + sample_text(model, tokenizer, 'ROMEO:', run['sample_tokens'],
                                      0.8, 0.95, cfg.seed))
  return {'first_loss': history[0]['loss'], 'last_loss': history[-1]['loss'],
          'eval_loss': history[-1].get('eval_loss'), 'reached_target': trainer.reached_target}


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float,
                top_p: float, seed: int, top_k: int = 0, **controls) -> str:
  """``prompt`` continued by ``model`` (the sample a run prints, and ``maxnnx generate``).

  Args:
    model: a :class:`~maxnnx.Transformer`.
    tokenizer: its tokenizer (the prompt starts with its BOS token).
    prompt: the text to continue.
    max_new_tokens: tokens to sample, capped (with a note) to what the context leaves.
    temperature: sampling temperature (0: greedy).
    top_p: nucleus sampling mass.
    seed: sampling seed.
    top_k: sample among the k most likely tokens (0: all).
    **controls: ``logit_bias``, ``presence_penalty``, ``frequency_penalty``,
      ``repetition_penalty``, ``min_tokens``, as :func:`~maxnnx.generate` takes them.

  Raises:
    ValueError: the prompt alone fills the model's context, or a control is out of range.
  """
  import maxnnx  # noqa: PLC0415
  ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
  max_new_tokens = _within_context(model.config.max_position_embeddings, len(ids),
                                   max_new_tokens)
  result = maxnnx.generate(model, [ids], max_new_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k or None, eos_ids=[tokenizer.eos_id], seed=seed,
                           **controls)
  return prompt + tokenizer.decode(result.as_lists()[0])


def _within_context(limit: int, prompt_tokens: int, max_new_tokens: int) -> int:
  """``max_new_tokens`` capped to what the model's context leaves after the prompt (a note
  says so), as the server caps ``max_tokens``."""
  room = limit - prompt_tokens
  if room < 1:
    raise ValueError(f'prompt= has {prompt_tokens} tokens; the model takes {limit} '
                     '(max_position_embeddings), with room for output: shorten it.')
  if max_new_tokens > room:
    print(f'Note: max_new_tokens={max_new_tokens} is capped to {room}: the prompt has '
          f"{prompt_tokens} tokens of the model's {limit} (max_position_embeddings).")
  return min(max_new_tokens, room)

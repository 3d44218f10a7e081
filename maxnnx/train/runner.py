"""A training run as ``maxnnx train`` does it, callable from Python: :func:`run`.

A run is more than :class:`~maxnnx.train.Trainer.fit`: it owns a directory (locked, its config
checked before a resume, :mod:`maxnnx.train.run_dir`), a tokenizer trained on the corpus and
pinned to the run (:mod:`maxnnx.train.run_tokenizer`), and what it leaves at the end: ``final/``
in Hugging Face format, a LoRA run's ``adapter/``, ``loss.png`` and ``metrics.jsonl``
(:mod:`maxnnx.train.export`). The command line parses its keys into the same settings and calls
:func:`run`, so a notebook cell and ``python -m maxnnx train`` with the same settings write
the same run directory.

The settings, keys as the command line spells them, and the *recipe* of a fine-tuning method
(:class:`~maxnnx.train.run_settings.RunRecipe`) are described in
:mod:`maxnnx.train.run_settings`; the default recipe pre-trains.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import numpy as np

from maxnnx import paths
from maxnnx.config import ModelConfig, check_expert_split
from maxnnx.data.protocol import HasEvalBatches
from maxnnx.inference.stops import eos_token_ids
from maxnnx.train import export
from maxnnx.train.run_settings import (
    PRETRAINING,
    RunRecipe,
    run_settings,
    split_settings,
)
from maxnnx.train.run_tokenizer import (
    is_text_file,
    model_and_tokenizer,
    pin_tokenizer,
    run_model_config,
    tokenizer_staging,
)


def _model_config(model) -> ModelConfig:
  """The config of ``model``: a :class:`~maxnnx.config.ModelConfig` (compiling only) or a
  model built from one."""
  return model if isinstance(model, ModelConfig) else model.config


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
  config = DataConfig.from_string(corpus or run['data'], **data_fields)
  return make_pipeline(config, tokenizer, batch_size=local_batch, seq_len=train_config.seq_len,
                       seed=train_config.seed, vocab_size=_model_config(model).vocab_size), 0


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
  config = _model_config(model)
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
  factor = model_config.moe.ragged_buffer_factor
  if mesh_config.expert_parallel_strategy != 'all_to_all':
    check_expert_split(mesh_config.expert_parallel_strategy, 0, 1, factor)
    return
  try:
    ici, dcn = mesh_shape(mesh_config, jax.device_count())
  except ValueError:  # a mesh of fewer devices than there are: the Trainer checks it on them
    return
  check_expert_split(mesh_config.expert_parallel_strategy, model_config.moe.num_experts,
                     ici['expert'] * dcn['expert'], factor)


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
    config = _model_config(model)
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
    config = _model_config(model)
    data = recipe.data(options, run['data'], data_fields, tokenizer, config, train_config,
                       train_config.global_batch_size // jax.process_count())
  elif need_data:
    data, num_tokens = _training_data(run, data_fields, corpus, model, tokenizer, train_config)
  eval_data = (_held_out_data(run, options, recipe, data_fields, model, tokenizer, train_config)
               if need_data and run['eval_data'] else None)
  if train_config.eval_every and eval_data is None and not isinstance(data, HasEvalBatches):
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


def _maxtext_full_state(run: dict):
  """``maxtext_full_state``: what hands a fresh trainer MaxText's optimizer state (a function
  of the trainer returning the line to print), else ``None``."""
  if not run.get('maxtext_full_state'):
    return None
  from maxnnx.checkpoint.maxtext import load_optimizer_state  # noqa: PLC0415
  step_dir = run['model_label'].rstrip('/')
  step_dir = step_dir[:-len('/items')] if step_dir.endswith('/items') else step_dir
  settings = run['maxtext_config'] or None
  if settings and not settings.endswith(('.yml', '.yaml')):
    settings = [item for item in settings.split(',') if item.strip()]

  def start(trainer) -> str:
    step = load_optimizer_state(trainer, paths.local_copy(step_dir), settings)
    return f"Continuing MaxText's training state at step {step}: its adamw moments and step."
  return start


def _fit(trainer, run_dir, out: str, start=None) -> list[dict]:
  """Restore the newest checkpoint (else hand the trainer ``start``'s state), point the
  metrics at the run directory and train."""
  from maxnnx.train.run_dir import checkpoint_steps  # noqa: PLC0415
  cfg = trainer.config
  try:
    saved = checkpoint_steps(cfg.checkpoint_dir)
    resumed = trainer.restore_checkpoint() if cfg.checkpoint_dir else None
    if resumed is not None:
      print(f'Resuming from the checkpoint of step {resumed} in {trainer.restored_from}.')
      for note in (trainer.schedule_note, trainer.batch_note):
        if note:
          print(f'Note: {note}')
    elif saved:
      print(f'Every checkpoint in {cfg.checkpoint_dir} is unusable (moved to corrupt-*); '
            'starting from scratch.')
    if resumed is None and start is not None:
      print(start(trainer))
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
  history = _fit(trainer, run_dir, out, _maxtext_full_state(run))
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
                           top_k=top_k or None, eos_ids=eos_token_ids(model.config, tokenizer),
                           seed=seed, **controls)
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

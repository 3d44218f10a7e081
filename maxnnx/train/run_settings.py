"""The settings of a training run, as ``maxnnx train`` spells them, and its *recipe*.

Settings are keys as the command line spells them: run keys (:data:`RUN_SETTINGS`, the fields
of :class:`~maxnnx.config.commands.RunConfig` and ``ProcessConfig``),
``TrainConfig`` fields bare, and dotted ``mesh.*``, ``lora.*``, ``model.*`` and ``data.*``
keys. :func:`run_settings` fills in the defaults and refuses unknown keys;
:func:`split_settings` turns them into the run's settings, its ``TrainConfig`` and the model
changes and data fields. A fine-tuning method is a :class:`RunRecipe` (its own keys, its data and
objective); the default, :data:`PRETRAINING`, pre-trains. :mod:`maxnnx.train.runner` runs
what these describe.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Protocol

from maxnnx import paths
from maxnnx.config import MeshConfig, ValidatedConfig, dotted_fields, subtree
from maxnnx.config.base import settings_table
from maxnnx.config.commands import ProcessConfig, RunConfig
from maxnnx.parallel.pipeline import describe_schedule

# Joining a multi-process run: read by the command line before anything touches a device.
PROCESS_SETTINGS = settings_table(ProcessConfig)
# Keys of the run itself, ``name -> (default, doc)`` (TrainConfig and MeshConfig have their own).
RUN_SETTINGS = {**settings_table(RunConfig), **PROCESS_SETTINGS}
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
  wants_checkpoints = fields.get('checkpoint_every') or fields.get('enable_emergency_checkpoint')
  if wants_checkpoints and not fields.get('checkpoint_dir'):
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


__all__ = ['PRETRAINING', 'PROCESS_SETTINGS', 'RUN_SETTINGS', 'RUN_TRAIN_DEFAULTS', 'Pretraining',
           'RunRecipe', 'run_settings', 'split_settings']

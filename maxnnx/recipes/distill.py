"""``maxnnx distill``: distil a frozen teacher into the trained student on pre-training data.

The objective is :class:`~maxnnx.train.distillation.DistillationObjective`, whose signature
gives ``divergence``, ``temperature``, ``jsd_beta`` and ``hard_label_weight`` their
defaults. ``teacher=`` is a Hugging Face directory, a ``maxnnx train`` output directory, an
orbax checkpoint or a preset; the student takes its tokenizer and vocabulary unless set.
"""

from __future__ import annotations

import functools
import os
from types import MappingProxyType

from maxnnx.cli_keys import UsageError
from maxnnx.recipes.base import Recipe, signature_keys

OBJECTIVE_KEYS = ('divergence', 'temperature', 'jsd_beta', 'hard_label_weight')
TEACHER_DOC = ('the teacher: a Hugging Face dir, a maxnnx train output dir, an orbax checkpoint '
               'or a preset; its tokenizer is the default tokenizer=')


@functools.cache
def _objective_keys() -> dict:
  from maxnnx.train.distillation import DistillationObjective  # noqa: PLC0415
  return signature_keys(DistillationObjective, OBJECTIVE_KEYS)


class Distill(Recipe):
  """Knowledge distillation from ``teacher=``."""

  name = 'distill'
  run_defaults = MappingProxyType({'output_dir': 'runs/distill'})
  train_defaults = MappingProxyType({'steps': 300})

  @property
  def keys(self):
    """``teacher`` and the DistillationObjective's settings."""
    return {'teacher': ('', TEACHER_DOC), **_objective_keys()}

  def prepare(self, run, options):
    """Refuse a run without ``teacher=``; the teacher's tokenizer unless ``tokenizer=``."""
    if not options['teacher']:
      raise UsageError('distill needs teacher=<Hugging Face dir, run output dir, orbax '
                       'checkpoint or preset>.')
    if not run['tokenizer']:
      run['tokenizer'] = teacher_tokenizer(options['teacher']) or ''

  def adjust_model(self, cfg, options, changes):
    """The student's config with the teacher's vocabulary unless ``model.vocab_size`` is set."""
    if 'vocab_size' in changes:
      return cfg
    return cfg.replace(vocab_size=teacher_config(options['teacher']).vocab_size)

  def objective(self, options, model, train_config):
    """:class:`~maxnnx.train.distillation.DistillationObjective` with the loaded teacher."""
    from maxnnx.train.distillation import DistillationObjective  # noqa: PLC0415
    teacher = load_teacher(options['teacher'])
    student_vocab = (model.vocab_size if hasattr(model, 'vocab_size')
                     else model.config.vocab_size)
    if teacher.config.vocab_size != student_vocab:
      raise UsageError(
          f"teacher={options['teacher']} has a vocabulary of {teacher.config.vocab_size} "
          f'tokens and the student {student_vocab}: distillation compares their '
          'distributions token by token, so both must use the same tokenizer (drop '
          'model.vocab_size, or pick a student built for the teacher\'s tokenizer).')
    return DistillationObjective(teacher, **{k: options[k] for k in OBJECTIVE_KEYS})


def _teacher_dir(teacher: str) -> str | None:
  """The Hugging Face directory behind ``teacher`` (itself, or a run's ``final/``)."""
  for candidate in (teacher, os.path.join(teacher, 'final')):
    if os.path.isfile(os.path.join(candidate, 'config.json')):
      return candidate
  return None


def teacher_tokenizer(teacher: str) -> str | None:
  """The tokenizer file stored with ``teacher`` (a checkpoint or run directory), if any."""
  for directory in filter(None, (_teacher_dir(teacher), teacher)):
    for name in ('tokenizer.json', 'tokenizer.model'):
      if os.path.isfile(os.path.join(directory, name)):
        return os.path.join(directory, name)
  return None


def teacher_config(teacher: str):
  """The teacher's ModelConfig without loading its weights."""
  import maxnnx  # noqa: PLC0415
  from maxnnx.models.checkpoints import checkpoint_config  # noqa: PLC0415
  from maxnnx.models.pretrained import config_from_pretrained  # noqa: PLC0415
  hf_dir = _teacher_dir(teacher)
  if hf_dir:
    return config_from_pretrained(hf_dir)
  if os.path.isdir(teacher):
    return checkpoint_config(teacher)
  return maxnnx.get_preset(teacher)


def load_teacher(teacher: str):
  """The teacher model: from a Hugging Face or run directory, an orbax checkpoint, or a
  preset (randomly initialised, with a warning)."""
  from flax import nnx  # noqa: PLC0415

  import maxnnx  # noqa: PLC0415
  from maxnnx.models.checkpoints import load_params  # noqa: PLC0415
  hf_dir = _teacher_dir(teacher)
  if hf_dir:
    return maxnnx.from_pretrained(hf_dir)
  if os.path.isdir(teacher):
    return load_params(maxnnx.Transformer(teacher_config(teacher), rngs=nnx.Rngs(0)), teacher)
  print(f'Warning: teacher={teacher} is a preset: its weights are random.')
  return maxnnx.Transformer(maxnnx.get_preset(teacher), rngs=nnx.Rngs(1))


RECIPE = Distill()

"""``maxnnx grpo``: reinforcement learning from Python reward functions.

The data are rollouts of the policy being trained (:class:`~maxnnx.rl.Rollouts`) over the
prompt records of ``prompts=``, scored by ``reward=``; the objective is
:class:`~maxnnx.rl.GRPOObjective` (``loss_type=grpo|dr_grpo|dapo|gspo``). Every field of
:class:`~maxnnx.rl.GRPOConfig` is a key with its default and doc; every completion is
appended to ``<output_dir>/rollouts.jsonl``. The rollouts sample from the Trainer's own
model, so they are attached to it once it exists.
"""

from __future__ import annotations

import dataclasses
import functools
from types import MappingProxyType

from maxnnx import paths
from maxnnx.cli_keys import UsageError, config_keys
from maxnnx.recipes.base import RecordsRecipe, require_policy

#: GRPOConfig fields the run sets itself rather than a key.
DERIVED = ('rollouts_jsonl',)
OWN_KEYS = {
    'prompts': ('', 'prompt records (JSONL, JSON or Parquet): {"prompt": text or chat '
                'messages, ...}; other columns go to the reward functions'),
    'reward': ('', 'reward function(s): path/to/file.py:function or module:function, '
               'comma-separated'),
    'reward_weights': ('', 'one weight per reward function, comma-separated (default 1 each)'),
}


@functools.cache
def _config_keys() -> dict:
  from maxnnx.rl import GRPOConfig  # noqa: PLC0415
  return {k: (key.default, key.doc)
          for k, key in config_keys(GRPOConfig, '', 'grpo', skip=DERIVED).items()}


class GRPO(RecordsRecipe):
  """Group relative policy optimisation on rollouts of the policy."""

  name = 'grpo'
  run_defaults = MappingProxyType({'output_dir': 'runs/grpo', 'sample_tokens': 0})
  train_defaults = MappingProxyType({'steps': 100, 'learning_rate': 1e-5, 'warmup_steps': 0,
                                     'eval_every': 0, 'checkpoint_every': 50,
                                     'global_batch_size': 32, 'log_every': 1})
  unrecorded = ('reward_timeout_s',)

  def own_keys(self):
    """``prompts``, ``reward``, ``reward_weights`` and every GRPOConfig field."""
    return {**OWN_KEYS, **_config_keys()}

  def prepare(self, run, options):
    """Refuse ``eval_data=``: a policy-gradient loss on fresh rollouts has no held-out value."""
    del options
    if run.get('eval_data'):
      raise UsageError(f"eval_data={run['eval_data']}: grpo has no held-out loss (its loss is "
                       'on fresh rollouts); score the policy with reward= on held-out prompts '
                       'instead, or drop eval_data.')

  def data(self, options, spec, data_fields, tokenizer, model_config, train_config,
           local_batch):
    """The rollouts of the policy (:func:`grpo_rollouts`; :meth:`attach` connects them)."""
    del data_fields, local_batch
    return grpo_rollouts(options, spec, tokenizer,
                         self.template(options, tokenizer, model_config.family), train_config)

  def objective(self, options, model, train_config):
    """:class:`~maxnnx.rl.GRPOObjective` (with a frozen reference when ``beta > 0``)."""
    from maxnnx.rl.grpo import grpo_objective, reference_policy  # noqa: PLC0415
    require_policy(model, 'grpo starts from a trained policy: model=<Hugging Face dir or a '
                   "run's final/> (a preset would sample random text).")
    config = grpo_config(options)
    return grpo_objective(config, reference_policy(model, config, train_config))

  def attach(self, trainer, data):
    """The rollouts sample from the trainer's own model, through its policy view."""
    data.attach(trainer.policy_view())


def grpo_config(options: dict):
  """The :class:`~maxnnx.rl.GRPOConfig` of a ``grpo`` command's keys."""
  from maxnnx.rl import GRPOConfig  # noqa: PLC0415
  fields = [f.name for f in dataclasses.fields(GRPOConfig) if f.name not in DERIVED]
  try:
    return GRPOConfig(**{k: options[k] for k in fields},
                      rollouts_jsonl=paths.join(options['output_dir'], 'rollouts.jsonl'))
  except ValueError as e:
    raise UsageError(str(e)) from None


def grpo_rollouts(options: dict, spec: str, tokenizer, template, train_config):
  """The :class:`~maxnnx.rl.Rollouts` of a ``grpo`` command (not yet attached)."""
  from maxnnx.rl import Prompts, Rewards, make_rollouts  # noqa: PLC0415
  prompts = options['prompts'] or spec
  if not prompts:
    raise UsageError('grpo needs prompts=<JSONL, JSON or Parquet file of {"prompt": ...} '
                     'records (other columns go to the reward functions)>.')
  if not options['reward']:
    raise UsageError('grpo needs reward=path/to/file.py:function (several: comma-separated; '
                     'weights with reward_weights=).')
  specs = [r.strip() for r in options['reward'].split(',') if r.strip()]
  weights = None
  if options['reward_weights']:
    try:
      weights = [float(w) for w in str(options['reward_weights']).split(',')]
    except ValueError:
      raise UsageError(f"reward_weights={options['reward_weights']!r}: give numbers separated "
                       'by commas, one per reward function.') from None
  config = grpo_config(options)
  try:
    rewards = Rewards(specs, weights)
  except (ValueError, FileNotFoundError) as e:
    raise UsageError(str(e)) from None
  return make_rollouts(config, Prompts(prompts, tokenizer, template, seed=train_config.seed),
                       rewards, tokenizer, seed=train_config.seed)


RECIPE = GRPO()

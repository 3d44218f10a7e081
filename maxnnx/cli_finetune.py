"""The fine-tuning commands of the CLI: ``sft``, ``dpo`` and ``distill`` as recipes of ``train``.

Each command is ``maxnnx train`` with a different objective and data (same keys,
run directory, checkpoints, resume, metrics and meshes), described by a
:class:`Recipe`: its own keys, the defaults it changes, how it reads its data and
the objective it trains.

* ``sft``: records ``{"messages": [...]}`` or ``{"prompt", "completion"}``
  (:func:`maxnnx.data.make_sft_pipeline`), loss on the assistant tokens, with the
  checkpoint's chat template (or ``template=``).
* ``dpo``: records ``{"prompt", "chosen", "rejected"}``
  (:func:`maxnnx.data.make_preference_pipeline`) and
  :class:`~maxnnx.train.preference.DPOObjective`; the reference is the starting
  policy, frozen (with ``lora.rank > 0``: the same weights with the adapters off).

``sft`` and ``dpo`` (and ``train``) take ``lora.*`` keys
(:class:`~maxnnx.train.lora.LoraConfig`): the Trainer adds the adapters and trains
only them, and the run writes ``adapter/`` in PEFT's format next to the merged
``final/``.
* ``grpo``: prompt records (``prompts=``) and Python reward functions (``reward=``); the
  data are rollouts of the policy being trained (:class:`~maxnnx.rl.Rollouts`) and the
  objective :class:`~maxnnx.rl.GRPOObjective` (``loss_type=grpo|dr_grpo|dapo|gspo``); every
  completion is appended to ``rollouts.jsonl``.
* ``distill``: the pre-training data and
  :class:`~maxnnx.train.distillation.DistillationObjective` with ``teacher=``
  (a Hugging Face directory, a ``maxnnx train`` output directory, an orbax
  checkpoint or a preset) whose tokenizer the student uses by default.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from maxnnx import paths
from maxnnx.cli_keys import UsageError

TEMPLATE_DOC = ("chat template: empty for the checkpoint's own (chat_template.jinja or "
                "tokenizer_config.json), a built-in name (chatml, llama3, gemma), or a .jinja file")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """What a training command changes about ``maxnnx train``.

  Attributes:
    name: the command.
    keys: its own keys, ``name -> (default, doc)``.
    run_defaults: run keys whose defaults differ (``output_dir``…).
    train_defaults: TrainConfig defaults that differ from ``train``'s.
    records: the data is records (chat, preference) read with the run's tokenizer,
      which must then come from ``tokenizer=`` or the checkpoint (none is trained).
  """
  name: str
  keys: dict[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)
  run_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
  train_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
  records: bool = False

  def prepare(self, run: dict, options: dict) -> None:
    """Adjust the run keys before the model and tokenizer are made (``distill``: the
    teacher's tokenizer by default)."""
    if self.name == 'distill':
      if not options['teacher']:
        raise UsageError('distill needs teacher=<Hugging Face dir, run output dir, orbax '
                         'checkpoint or preset>.')
      if not run['tokenizer']:
        run['tokenizer'] = teacher_tokenizer(options['teacher']) or ''

  def adjust_model(self, cfg, options: dict, changes: dict):
    """The student's config (``distill``: the teacher's vocabulary unless set)."""
    if self.name != 'distill' or 'vocab_size' in changes:
      return cfg
    teacher_cfg = teacher_config(options['teacher'])
    return cfg.replace(vocab_size=teacher_cfg.vocab_size)

  def template(self, options: dict, tokenizer, family: str | None = None):
    """The run's chat template (a :class:`~maxnnx.data.ChatTemplate`, or ``None``):
    ``template=`` (a built-in name, Jinja text or a ``.jinja`` file), else the one stored
    beside the tokenizer, else the built-in template of the model's ``family`` if any."""
    from maxnnx.data import ChatTemplate  # noqa: PLC0415
    from maxnnx.data.chat import builtin_template  # noqa: PLC0415
    from maxnnx.data.sft import resolve_tokenizer_and_template  # noqa: PLC0415
    value = options.get('template', '')
    if value.endswith('.jinja') or (value and os.path.isfile(value)):
      if not os.path.isfile(value):
        raise FileNotFoundError(f'template={value}: no such file.')
      with open(value, encoding='utf-8') as f:
        value = ChatTemplate(f.read(), origin=value)
    template = resolve_tokenizer_and_template(tokenizer, value or None)[1]
    if template is None and family:
      try:
        builtin_template(family)
      except ValueError:
        return None
      template = resolve_tokenizer_and_template(tokenizer, family)[1]
    return template

  def data(self, options: dict, spec: str, data_fields: dict, tokenizer, model_config,
           train_config, local_batch: int):
    """The training batches of a records recipe (``grpo``: rollouts of the policy, which the
    CLI attaches to the trainer once it exists)."""
    from maxnnx.data import DataConfig, make_preference_pipeline, make_sft_pipeline  # noqa
    if self.name == 'grpo':
      return grpo_rollouts(options, spec, tokenizer, self.template(options, tokenizer,
                                                                   model_config.family),
                           train_config)
    if not spec:
      raise UsageError(f'{self.name} needs data=<records file or directory> (JSONL, JSON or '
                       'Parquet).')
    make = make_sft_pipeline if self.name == 'sft' else make_preference_pipeline
    fields = {'overlong': 'truncate', **data_fields} if self.name == 'sft' else data_fields
    config = DataConfig.from_string(spec, **fields)
    images = {}
    if self.name == 'sft' and train_config.images_per_row:
      images = image_sft_options(options.get('model', ''), tokenizer, model_config,
                                 train_config.images_per_row)
    return make(config, tokenizer, self.template(options, tokenizer, model_config.family),
                batch_size=local_batch, seq_len=train_config.seq_len, seed=train_config.seed,
                vocab_size=model_config.vocab_size, **images)

  def objective(self, options: dict, model, train_config):
    """The objective to train (``None``: the pre-training one)."""
    if self.name == 'dpo':
      from flax import nnx  # noqa: PLC0415

      from maxnnx.train.preference import DPOObjective  # noqa: PLC0415
      if not isinstance(model, nnx.Module):
        raise UsageError('dpo starts from a trained policy: model=<Hugging Face dir> (a '
                         'preset would be a random policy and reference).')
      settings = {'beta': options['beta'], 'loss_type': options['loss_type'],
                  'label_smoothing': options['label_smoothing']}
      if train_config.lora.enabled:  # the reference: the same weights with the adapters off
        from maxnnx.train.lora import without_adapters_logps  # noqa: PLC0415
        return DPOObjective(**settings, reference_fn=without_adapters_logps)
      return DPOObjective(**settings, reference=nnx.clone(model))
    if self.name == 'grpo':
      from flax import nnx  # noqa: PLC0415

      from maxnnx.rl.grpo import grpo_objective, reference_policy  # noqa: PLC0415
      if not isinstance(model, nnx.Module):
        raise UsageError('grpo starts from a trained policy: model=<Hugging Face dir or a run\'s '
                         'final/> (a preset would sample random text).')
      config = grpo_config(options)
      return grpo_objective(config, reference_policy(model, config, train_config))
    if self.name == 'distill':
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
      return DistillationObjective(teacher, temperature=options['temperature'],
                                   divergence=options['divergence'],
                                   jsd_beta=options['jsd_beta'],
                                   hard_label_weight=options['hard_label_weight'])
    return None

  def record(self, options: dict) -> dict:
    """The recipe's keys, for the run's stored config (a resume must match them)."""
    return {k: options[k] for k in self.keys if k not in UNRECORDED}


GRPO_FIELDS = ('loss_type', 'num_generations', 'max_new_tokens', 'temperature', 'top_k', 'top_p',
               'beta', 'epsilon', 'epsilon_high', 'num_iterations', 'dynamic_sampling',
               'max_refills', 'sampler', 'reward_timeout_s')
# Keys that change how a run is watched, not what it trains: left out of the stored config.
UNRECORDED = ('reward_timeout_s',)


def grpo_config(options: dict):
  """The :class:`~maxnnx.rl.GRPOConfig` of a ``grpo`` command's keys."""
  from maxnnx.rl import GRPOConfig  # noqa: PLC0415
  try:
    return GRPOConfig(**{k: options[k] for k in GRPO_FIELDS},
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


PRETRAIN = Recipe('train')
SFT = Recipe(
    'sft', keys={'template': ('', TEMPLATE_DOC)},
    run_defaults={'output_dir': 'runs/sft', 'sample_tokens': 0},
    train_defaults={'steps': 200, 'learning_rate': 1e-4,
                    'eval_every': 0, 'checkpoint_every': 100},
    records=True)
DPO = Recipe(
    'dpo', keys={
        'template': ('', TEMPLATE_DOC),
        'beta': (0.1, 'DPO temperature beta: how far the policy may move from the reference'),
        'loss_type': ('sigmoid', 'sigmoid (DPO), ipo or hinge'),
        'label_smoothing': (0.0, 'probability that a preference label is wrong (sigmoid loss '
                            'only; conservative DPO)'),
    },
    run_defaults={'output_dir': 'runs/dpo', 'sample_tokens': 0},
    train_defaults={'steps': 100, 'learning_rate': 1e-5, 'eval_every': 0,
                    'checkpoint_every': 50},
    records=True)
DISTILL = Recipe(
    'distill', keys={
        'teacher': ('', 'the teacher: a Hugging Face dir, a maxnnx train output dir, an orbax '
                    'checkpoint or a preset; its tokenizer is the default tokenizer='),
        'divergence': ('forward_kl', 'forward_kl, reverse_kl or jsd'),
        'temperature': (1.0, 'softmax temperature of both models (the loss is scaled by T^2)'),
        'jsd_beta': (0.5, 'weight of the teacher in the jsd mixture'),
        'hard_label_weight': (0.0, 'weight of the next-token cross-entropy mixed into the loss'),
    },
    run_defaults={'output_dir': 'runs/distill'},
    train_defaults={'steps': 300})

GRPO = Recipe(
    'grpo', keys={
        'prompts': ('', 'prompt records (JSONL, JSON or Parquet): {"prompt": text or chat '
                    'messages, ...}; other columns go to the reward functions'),
        'reward': ('', 'reward function(s): path/to/file.py:function or module:function, '
                   'comma-separated'),
        'reward_weights': ('', 'one weight per reward function, comma-separated (default 1 each)'),
        'reward_timeout_s': (60.0, 'seconds a reward function has to return before the run '
                             'stops, naming it'),
        'template': ('', TEMPLATE_DOC),
        'loss_type': ('grpo', 'grpo, dr_grpo, dapo or gspo'),
        'num_generations': (8, 'completions per prompt (global_batch_size must be a multiple)'),
        'max_new_tokens': (64, 'completion budget (seq_len holds prompt + completion)'),
        'temperature': (1.0, 'sampling temperature (the loss uses the same distribution)'),
        'top_k': (0, 'sample among the top_k tokens (0: all)'),
        'top_p': (1.0, 'nucleus sampling mass (1: off)'),
        'beta': (0.0, 'KL penalty to the reference (the starting policy; with lora.rank > 0 '
                 'the base)'),
        'epsilon': (0.2, 'lower clip range of the importance ratio'),
        'epsilon_high': (0.0, 'upper clip range (0: epsilon; dapo: 0.28)'),
        'num_iterations': (1, 'optimizer steps per rollout batch'),
        'dynamic_sampling': ('auto', 'replace groups whose rewards are all equal: auto (dapo '
                             'only), on or off'),
        'max_refills': (4, 'extra rollouts at most to fill a batch under dynamic sampling'),
        'sampler': ('generate', 'how rollouts sample: generate (one static batch) or engine '
                    "(the serving engine's continuous batching and prefix cache)"),
    },
    run_defaults={'output_dir': 'runs/grpo', 'sample_tokens': 0},
    train_defaults={'steps': 100, 'learning_rate': 1e-5, 'warmup_steps': 0, 'eval_every': 0,
                    'checkpoint_every': 50, 'global_batch_size': 32, 'log_every': 1},
    records=True)

RECIPES = {r.name: r for r in (PRETRAIN, SFT, DPO, DISTILL, GRPO)}


def image_sft_options(checkpoint: str, tokenizer, model_config, images_per_row: int) -> dict:
  """``make_sft_pipeline`` keywords of image+text SFT (``images_per_row=`` > 0): the image
  processor of the checkpoint's ``preprocessor_config.json`` and the family's image prompt
  (:func:`maxnnx.data.images.image_inputs_for`)."""
  from maxnnx.data.images import image_inputs_for  # noqa: PLC0415
  if not model_config.vision.num_layers:
    raise UsageError('images_per_row > 0 trains on images: the model needs a vision tower '
                     '(a multimodal checkpoint, e.g. Gemma 3 4B, or a preset with one).')
  try:
    processor, prompt = image_inputs_for(model_config, tokenizer, checkpoint or None)
  except ValueError as e:
    raise UsageError(f'images_per_row: {e}') from None
  return {'image_processor': processor, 'image_prompt': prompt,
          'images_per_row': images_per_row}

"""MaxText's config keys on maxnnx's command line: one table from its names to ours.

A MaxText user brings a YAML that starts with ``base_config: "base.yml"`` and keys such as
``per_device_batch_size=4 model_name=llama3.1-8b ici_fsdp_parallelism=8``. :data:`MAXTEXT_KEYS`
says, for each MaxText key, what it becomes here: a maxnnx key (with the value converted where
the meaning differs: a per-device batch times the devices is a global batch), a setting made
from several MaxText keys together (``run_name`` + ``base_output_directory`` is the run
directory), a knob with no effect here (accepted with a one-line note), or a refusal naming
why. A refused key given at MaxText's own default is accepted: it changes nothing.

MaxText's vocabulary is used when a YAML has ``base_config`` or any key is MaxText's alone;
MaxText's defaults that shape the run (:data:`MAXTEXT_DEFAULTS`: its optimizer, schedule,
mesh, layer scan and remat, and its default model) then apply under the keys given. Two
different names for one setting (``max_target_length=`` and ``seq_len=``) must agree; the same
key on the command line overrides the YAML's. ``docs/from_maxtext.md`` holds the table.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from maxnnx.cli_keys import Key, UsageError, convert, nearest_hint, read_yaml, resolve
from maxnnx.maxtext_key_table import (
  DEFAULT_MODEL,
  DEFAULT_MODEL_KEYS,
  MAXTEXT_DEFAULTS,
  MAXTEXT_KEYS,
  MAXTEXT_MODEL_NAMES,
  REMAT_LOCATIONS,
  REMAT_TENSORS,
  WARMUP_FRACTION,
  Rule,
  activation_name,
)
from maxnnx.presets import MAXTEXT_ALIASES, MAXTEXT_REFUSED


def model_preset(name: str) -> str:
  """The maxnnx preset MaxText's ``model_name`` stands for.

  Raises:
    UsageError: a name maxnnx refuses (with the reason) or does not know.
  """
  from maxnnx.models.registry import PRESETS  # noqa: PLC0415
  if name == 'default':
    return DEFAULT_MODEL
  if name in MAXTEXT_REFUSED:
    raise UsageError(f'model_name={name}: {MAXTEXT_REFUSED[name]}.')
  preset = MAXTEXT_ALIASES.get(name, name)
  if preset not in PRESETS:
    hint = nearest_hint(name, [*MAXTEXT_MODEL_NAMES, *PRESETS])
    raise UsageError(f"model_name={name}: unknown model.{hint}")
  return preset


# ---------------------------------------------------------------------------------------------
# Reading a command line in MaxText's vocabulary.


def _is_maxnnx(name: str, keys: dict[str, Key], aliases: dict[str, str]) -> bool:
  try:
    resolve(name, keys, aliases)
  except UsageError:
    return False
  return True


def _yaml_pairs(path: str, seen: tuple[str, ...] = ()) -> tuple[list, bool]:
  """``(pairs, is MaxText's)`` of a YAML file; a ``base_config`` other than MaxText's
  ``base.yml`` is read first (relative to the file), as MaxText does."""
  pairs = read_yaml(path)
  base = dict(pairs).get('base_config')
  if base is None:
    return pairs, False
  below = os.path.join(os.path.dirname(path), str(base))
  if os.path.basename(str(base)) != 'base.yml' and os.path.isfile(below):
    if below in seen:
      raise UsageError(f'{path}: base_config={base} includes itself.')
    parent, _ = _yaml_pairs(below, (*seen, path))
    pairs = parent + pairs
  return pairs, True


def _split_args(args: list[str]) -> tuple[list, list, bool]:
  """``(YAML pairs, command-line pairs, a YAML is MaxText's)``."""
  from_yaml, from_cli, maxtext = [], [], False
  for arg in args:
    name, has_value, value = arg.partition('=')
    if not has_value and arg.endswith(('.yml', '.yaml')):
      path = arg
    elif has_value and name == 'config':
      path = value
    elif has_value:
      from_cli.append((name, value))
      continue
    else:
      raise UsageError(f"expected key=value, got '{arg}'. Run with --help for the keys.")
    pairs, is_maxtext = _yaml_pairs(path)
    from_yaml.extend(pairs)
    maxtext = maxtext or is_maxtext
  return from_yaml, from_cli, maxtext


def uses_maxtext(args: list[str], keys: dict[str, Key], aliases: dict[str, str]) -> bool:
  """Whether ``args`` speak MaxText: a YAML with ``base_config``, or a key that is MaxText's
  alone (``per_device_batch_size``)."""
  if 'global_batch_size' not in keys:  # generate, serve, convert: their own keys only
    return False
  from_yaml, from_cli, maxtext = _split_args(args)
  return maxtext or any(name in MAXTEXT_KEYS and not _is_maxnnx(name, keys, aliases)
                        for name, _ in from_yaml + from_cli)


class _Settings:
  """The maxnnx settings a command line makes: ``{canonical key: (source key, value)}``;
  two different source keys setting one key differently is an error."""

  def __init__(self):
    self.values: dict[str, tuple[str, Any]] = {}

  def set(self, target: str, value: Any, source: str) -> None:
    held = self.values.get(target)
    if held is not None and held[0] != source and held[1] != value:
      raise UsageError(f'{held[0]} and {source} both set {target}, to {held[1]!r} and '
                       f'{value!r}: give one of them (or the same value).')
    self.values[target] = (source, value)


def _device_count(settings: _Settings) -> int:
  """The devices ``per_device_batch_size`` multiplies; refused before a multi-process run
  has joined (counting them would start JAX's backend first)."""
  coordinator = settings.values.get('coordinator', ('', ''))[1]
  if coordinator or any(os.environ.get(v) for v in ('MAXNNX_COORDINATOR_ADDRESS',
                                                    'MAXNNX_NUM_PROCESSES')):
    raise UsageError('per_device_batch_size= in a multi-process run: give global_batch_size= '
                     '(per_device_batch_size x every device of every process).')
  import jax  # noqa: PLC0415
  return jax.device_count()


def _derived(given: dict[str, Any], settings: _Settings, defaults: dict[str, Any]) -> None:
  """The settings made from several MaxText keys (the ``derive`` rules) of ``given``."""
  def source(*names):
    return '+'.join(n for n in names if n in given) or names[0]

  if 'run_name' in given or 'base_output_directory' in given:
    base, name = given.get('base_output_directory', ''), given.get('run_name', '')
    out = os.path.join(base or 'runs', name) if name else base
    if out:
      settings.set('output_dir', out, source('base_output_directory', 'run_name'))
  loads = [key for key in ('load_parameters_path', 'load_full_state_path') if given.get(key)]
  for key in loads:
    step_dir = given[key].rstrip('/')
    step_dir = step_dir[:-len('/items')] if step_dir.endswith('/items') else step_dir
    settings.set('model', step_dir, key)
    settings.set('maxtext_config', _checkpoint_settings(given), key)
    if key == 'load_full_state_path':
      settings.set('maxtext_full_state', True, key)
  if not loads and given.get('model_name', 'default') != 'default':
    settings.set('model', model_preset(given['model_name']), 'model_name')
  if 'per_device_batch_size' in given:
    per_device, devices = given['per_device_batch_size'], _device_count(settings)
    total = per_device * devices
    if total < 1 or total != int(total):
      raise UsageError(f'per_device_batch_size={per_device} x {devices} devices = {total}: '
                       'the global batch must be a whole number of sequences, at least 1.')
    settings.set('global_batch_size', int(total), 'per_device_batch_size')
  if 'steps' in given:
    steps = given['steps']
    if steps == -1:
      schedule = settings.values.get('learning_rate_schedule_steps', ('', None))[1]
      if schedule is None:
        raise UsageError('steps=-1 takes the number of steps from '
                         'learning_rate_schedule_steps=, which is not given.')
      steps = schedule
    settings.set('steps', steps, 'steps')
  fraction = given.get('warmup_steps_fraction', WARMUP_FRACTION)
  length = (settings.values.get('learning_rate_schedule_steps', ('', None))[1]
            or settings.values.get('steps', ('', defaults.get('steps')))[1])
  if length and ('warmup_steps_fraction' in given or 'warmup_steps' not in settings.values):
    settings.set('warmup_steps', round(fraction * length), 'warmup_steps_fraction')
  _remat_locations(given, settings)
  if 'mlp_activations' in given:
    activation, gated = activation_name(given['mlp_activations'])
    settings.set('model.mlp_activation', activation, 'mlp_activations')
    settings.set('model.mlp_gated', gated, 'mlp_activations')
  if 'enable_checkpointing' in given or 'checkpoint_period' in given:
    period = given.get('checkpoint_period', MAXTEXT_KEYS['checkpoint_period'].default)
    every = period if given.get('enable_checkpointing', True) else 0
    settings.set('checkpoint_every', every, source('enable_checkpointing', 'checkpoint_period'))
  if given.get('enable_tensorboard'):
    out = settings.values.get('output_dir', ('', defaults.get('output_dir')))[1]
    settings.set('tensorboard_dir', os.path.join(out, 'tensorboard'), 'enable_tensorboard')
  _data(given, settings)


def _checkpoint_settings(given: dict[str, Any]) -> str:
  """``maxtext_config=``: what the conversion of ``load_parameters_path`` reads that the
  tensors' shapes cannot say, from the keys given, else from ``model_name``'s preset."""
  from maxnnx.checkpoint.maxtext import BLOCKS, MAXTEXT_DEFAULTS  # noqa: PLC0415
  chosen: dict[str, Any] = {}
  if given.get('model_name', 'default') != 'default':
    import maxnnx  # noqa: PLC0415
    preset = maxnnx.get_preset(model_preset(given['model_name']))
    block = {family: block for block, family in BLOCKS.items()}.get(preset.family)
    if block is None:
      raise UsageError(f"load_parameters_path with model_name={given['model_name']}: a run "
                       f'starts from MaxText checkpoints of the {", ".join(BLOCKS)} decoder '
                       f'blocks; this is a {preset.family} model.')
    chosen = {'decoder_block': block, 'normalization_layer_epsilon': preset.norm_eps,
              'rope_max_timescale': preset.rope.theta,
              'sliding_window_size': preset.attention.sliding_window or 0,
              'num_experts_per_tok': preset.moe.num_experts_per_tok,
              **_family_settings(preset)}
  chosen.update({k: given[k] for k in MAXTEXT_DEFAULTS if k in given})
  return ','.join(f'{k}={v}' for k, v in chosen.items())


def _family_settings(preset) -> dict[str, Any]:
  """The MaxText settings of a DeepSeek-V3, Gemma 2/3, GPT-OSS or Llama 4 preset that its
  conversion reads beside the common ones (routing and rotary keys, soft caps, layer
  patterns), as MaxText's model YAML of that name sets them."""
  rope, moe = preset.rope, preset.moe
  if preset.family == 'deepseek_v3':
    return {'routed_score_func': 'sigmoid', 'routed_scaling_factor': moe.router_scaling_factor,
            'n_routing_groups': moe.router_groups, 'topk_routing_group': moe.router_topk_groups,
            'rope_type': 'yarn', 'rope_factor': rope.factor,
            'original_max_position_embeddings': rope.original_max_position_embeddings,
            'beta_fast': rope.beta_fast, 'beta_slow': rope.beta_slow, 'mscale': rope.mscale,
            'max_position_embeddings': preset.max_position_embeddings}
  if preset.family in ('gemma2', 'gemma3'):
    out = {'attn_logits_soft_cap': preset.attention.logit_softcap or 0.0,
           'final_logits_soft_cap': preset.final_logit_softcap or 0.0}
    if preset.local_rope is not None:
      out['local_rope_max_timescale'] = preset.local_rope.theta
    if rope.scaling == 'linear':
      out['rope_linear_scaling_factor'] = rope.factor
    return out
  if preset.family == 'gpt_oss':
    return {'rope_type': 'yarn', 'rope_factor': rope.factor,
            'original_max_position_embeddings': rope.original_max_position_embeddings,
            'beta_fast': rope.beta_fast, 'beta_slow': rope.beta_slow, 'rope_interleave': False,
            'rope_truncate': rope.truncate, 'rope_attention_scaling': True,
            'max_position_embeddings': preset.max_position_embeddings,
            'mlp_activations_limit': moe.swiglu_limit}
  if preset.family == 'llama4':
    return {'rope_type': 'llama3.1', 'nope_layer_interval': 4,
            'interleave_moe_layer_step': moe.layer_step,
            'use_qk_norm': preset.attention.qk_norm == 'l2',
            'temperature_tuning': preset.attention.temperature_tuning,
            'chunk_attn_window_size': preset.attention.chunk_size or 0}
  return {}


def _remat_locations(given: dict[str, Any], settings: _Settings) -> None:
  """``model.runtime.remat_save`` / ``model.runtime.remat_offload`` from MaxText's per-tensor
  locations."""
  keys = [k for k in REMAT_TENSORS if k in given]
  if not keys:
    return
  chosen = {'device': [], 'offload': []}
  for key in keys:
    where = given[key]
    if where not in REMAT_LOCATIONS:
      raise UsageError(f'{key}={where!r}: expected one of {", ".join(REMAT_LOCATIONS)}.')
    if where != 'remat':
      chosen[where].extend(REMAT_TENSORS[key])
  policy = settings.values.get('remat_policy', ('', 'full'))[1]
  if (chosen['device'] or chosen['offload']) and policy != 'custom':
    raise UsageError(f'{"+".join(keys)}: per-tensor remat locations apply with '
                     f'remat_policy=custom, but remat_policy={policy!r}.')
  for where, target in (('device', 'model.runtime.remat_save'),
                         ('offload', 'model.runtime.remat_offload')):
    if chosen[where]:
      settings.set(target, tuple(dict.fromkeys(chosen[where])), '+'.join(keys))


def _data(given: dict[str, Any], settings: _Settings) -> None:
  """``data=`` from ``dataset_type`` and the path keys of that type."""
  kind = given.get('dataset_type')
  paths = {'grain': given.get('grain_train_files'),
           'hf': given.get('hf_train_files') or given.get('hf_path')}
  if kind == 'tfds':
    raise UsageError('dataset_type=tfds: maxnnx has no TFDS reader; export the split to '
                     'JSONL/Parquet/ArrayRecord and give dataset_type=grain '
                     'grain_train_files=<files> (or data=<path>).')
  if kind == 'synthetic':
    settings.set('data', 'synthetic', 'dataset_type')
  elif kind is not None and kind not in paths:
    raise UsageError(f"dataset_type={kind!r}: expected 'synthetic', 'hf' or 'grain'.")
  path = paths.get(kind) if kind else (paths['grain'] or paths['hf'])
  path = path or given.get('dataset_path')
  if path and kind != 'synthetic':
    if ';' in path:
      raise UsageError(f'{path}: weighted mixtures of patterns are data.sources= and '
                       'data.weights= here.')
    settings.set('data', path, 'dataset_path' if path == given.get('dataset_path') else
                 {'grain': 'grain_train_files', 'hf': 'hf_train_files'}.get(kind or 'grain'))


def _maxtext_value(name: str, raw: Any) -> tuple[Rule, Any]:
  rule = MAXTEXT_KEYS[name]
  if rule.kind is tuple[str, ...] and isinstance(raw, str) and not raw.strip().startswith('['):
    raw = f'[{raw}]'  # mlp_activations=silu,linear and mlp_activations=[silu, linear]
  return rule, convert(name, raw, rule.kind)


def parse(args: list[str], keys: dict[str, Key], aliases: dict[str, str],
          printer: Callable[[str], None] = print) -> dict[str, Any] | None:
  """``args`` read in MaxText's vocabulary: ``{canonical maxnnx key: typed value}`` as
  :func:`maxnnx.cli_keys.parse` returns, or ``None`` when they do not speak MaxText.

  Raises:
    UsageError: a refused MaxText key (with the reason), a key neither vocabulary knows
      (naming the nearest of both), or two keys setting one thing differently.
  """
  if not uses_maxtext(args, keys, aliases):
    return None
  from_yaml, from_cli, _ = _split_args(args)
  values = {k: key.default for k, key in keys.items() if key.fill}
  values.update({k: v for k, v in MAXTEXT_DEFAULTS.items() if k in keys})
  settings, given, noted = _Settings(), {}, set()
  for name, raw in from_yaml + from_cli:
    if name in MAXTEXT_KEYS:
      rule, value = _maxtext_value(name, raw)
      if rule.action == 'derive':
        given[name] = value
      elif rule.action == 'map':
        if rule.target not in keys and not _is_maxnnx(rule.target, keys, aliases):
          raise UsageError(f'{name}= is a key of the other commands (maxnnx compile): '
                           f'{rule.target}.')
        target = resolve(rule.target, keys, aliases)
        settings.set(target, rule.to(value) if rule.to else value, name)
      elif rule.action == 'noop' and name not in noted and value != rule.default:
        noted.add(name)
        printer(f"Note: MaxText's {name} has no effect here: {rule.note}.")
      elif rule.action == 'refuse' and value != rule.default:
        raise UsageError(f'{name}={raw!r} has no maxnnx equivalent: {rule.note}.')
    elif _is_maxnnx(name, keys, aliases):
      canonical = resolve(name, keys, aliases)
      settings.set(canonical, convert(canonical, raw, keys[canonical].kind), name)
    else:
      hint = nearest_hint(name, [*keys, *MAXTEXT_KEYS])
      raise UsageError(f"unknown key '{name}' (neither maxnnx's nor a MaxText key this table "
                       f"takes).{hint or ' Run maxnnx maxtext-keys for the table.'}")
  _derived(given, settings, values)
  if 'model' not in settings.values:  # MaxText's default model, under the sizes given
    values['model'] = DEFAULT_MODEL
    for name in DEFAULT_MODEL_KEYS:
      rule = MAXTEXT_KEYS[name]
      target = resolve(rule.target, keys, aliases)
      values.setdefault(target, rule.to(rule.default) if rule.to else rule.default)
  for target, (_, value) in settings.values.items():
    values[target] = convert(target, value, keys[target].kind)
  return values


# ---------------------------------------------------------------------------------------------
# The table as text: `maxnnx maxtext-keys` and docs/from_maxtext.md.


def _cell(value: Any) -> str:
  return repr(value) if isinstance(value, str) else str(value)


def table_rows() -> list[tuple[str, str, str, str]]:
  """``(MaxText key, MaxText default, what it becomes here, note)`` for every key."""
  words = {'noop': 'no effect here', 'refuse': 'refused unless at its default'}
  rows = []
  for name, rule in MAXTEXT_KEYS.items():
    becomes = words.get(rule.action, rule.target)
    rows.append((name, _cell(rule.default), becomes, rule.note))
  return rows


def table_markdown() -> str:
  """The key table of ``docs/from_maxtext.md`` (a test keeps the file in step)."""
  lines = ['| MaxText key | MaxText default | maxnnx | note |', '|---|---|---|---|']
  for name, default, becomes, note in table_rows():
    becomes = becomes if ' ' in becomes else f'`{becomes}`'
    lines.append(f'| `{name}` | `{default}` | {becomes} | {note} |'.replace(' |  |', ' | |'))
  return '\n'.join(lines) + '\n'


def models_markdown() -> str:
  """MaxText's model names and what each is here, for ``docs/from_maxtext.md``."""
  lines = ['| MaxText model_name | maxnnx |', '|---|---|']
  for name in MAXTEXT_MODEL_NAMES:
    if name in MAXTEXT_REFUSED:
      lines.append(f'| `{name}` | refused: {MAXTEXT_REFUSED[name]} |')
    else:
      what = ("MaxText's default model: `llama2-7b` with base.yml's sizes"
              if name == 'default' else f'`{model_preset(name)}`')
      lines.append(f'| `{name}` | {what} |')
  return '\n'.join(lines) + '\n'


def listing() -> str:
  """``maxnnx maxtext-keys``: the table as plain text, then the model names."""
  lines = ["MaxText's keys in maxnnx (key  MaxText default -> maxnnx  note):", '']
  for name, default, becomes, note in table_rows():
    lines.append(f'  {name:<36} {default:<14} -> {becomes}' + (f'  ({note})' if note else ''))
  lines += ['', "MaxText's model names (model_name=):", '']
  for name in MAXTEXT_MODEL_NAMES:
    what = (f'refused: {MAXTEXT_REFUSED[name]}' if name in MAXTEXT_REFUSED
            else DEFAULT_MODEL + " with base.yml's sizes" if name == 'default'
            else model_preset(name))
    lines.append(f'  {name:<28} {what}')
  return '\n'.join(lines)

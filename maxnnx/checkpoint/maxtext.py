"""Checkpoints that MaxText wrote, read into maxnnx.

MaxText saves one orbax item, ``items``, per step directory. Its trainers (Linen, and the NNX
trainer, which writes the same layout plus an ``nnx_aux`` subtree of random-number state) hold
the weights under ``params/params/...`` beside ``opt_state`` and ``step``; its
parameters-only checkpoints (``generate_param_only_checkpoint``) hold them under
``params/params/...`` (Linen) or at the top level with every leaf wrapped as ``{"value": x}``
(NNX). A scanned model stacks each layer's arrays on axis 1 (``param_scan_axis``), also after
the expert axis of MoE weights; an unscanned one names them ``layers_0 ... layers_{L-1}``.

The ``llama2``, ``mistral``, ``mixtral``, ``deepseek`` (DeepSeek-V3), ``gemma``, ``gemma2``
and ``gemma3`` decoder blocks are read (what ``tests/maxtext_fixtures/LAYOUT.md`` documents,
with MaxText's own fixtures). The weights become the Hugging Face tensors of the matching
family (:func:`write_hf`), which :func:`maxnnx.from_maxtext` then loads as it loads any
checkpoint. Kernels are ``[in, out]`` with the heads split (``[embed, heads, head_dim]``),
where torch weights are ``[out, in]``; beyond that each block's conventions are undone in its
function of :mod:`maxnnx.checkpoint.maxtext_blocks`: the llama-style query kernel carries the
attention's ``1 / sqrt(head_dim)``, ``rope_type=llama3.1`` rotates interleaved pairs, Gemma
stores its norms as ``1 + w`` and its embedding times sqrt(d_model), and a tied head's logits
are MaxText's own.

What the shapes cannot say comes from MaxText's settings (its YAML or ``key=value`` list, with
MaxText's defaults, :data:`MAXTEXT_DEFAULTS`): ``decoder_block``, ``num_experts_per_tok``,
``normalization_layer_epsilon``, ``rope_max_timescale``, ``sliding_window_size``,
``max_target_length``; for DeepSeek also ``model_name`` (MaxText picks V3 routing by it), the
routing keys and the yarn keys.

A full training state also holds adamw's moments and the step: :func:`hf_moments` converts
them as the parameters, and :func:`load_optimizer_state` hands them to a
:class:`~maxnnx.train.Trainer` (MaxText's ``load_full_state_path``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from maxnnx.checkpoint.manager import CheckpointError
from maxnnx.checkpoint.maxtext_blocks import (
  BLOCKS,
  _bfloat16,
  _deepseek_checkpoint,
  _f32,
  _gpt_oss_checkpoint,
  _llama4_checkpoint,
  _llama_checkpoint,
  _map,
  _to_numpy,
)
from maxnnx.checkpoint.maxtext_gemma import _gemma_checkpoint

#: MaxText's defaults (its ``configs/base.yml``) for the settings a conversion reads.
MAXTEXT_DEFAULTS = {'decoder_block': 'llama2', 'model_name': 'default', 'num_experts_per_tok': 1,
                    'normalization_layer_epsilon': 1e-5, 'rope_max_timescale': 10_000,
                    'rope_min_timescale': 1, 'sliding_window_size': 0,
                    'max_target_length': 2048, 'rope_type': 'default',
                    'max_position_embeddings': 163_840,
                    # DeepSeek routing
                    'routed_scaling_factor': 1.0, 'routed_score_func': '',
                    'n_routing_groups': -1, 'topk_routing_group': -1,
                    # yarn rotary scaling
                    'original_max_position_embeddings': 4096, 'rope_factor': 40.0,
                    'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0, 'rope_interleave': True,
                    'rope_truncate': True, 'rope_attention_scaling': False,
                    # llama3.1 rotary scaling
                    'rope_use_scale': True,
                    # Gemma and tied embeddings
                    'normalize_embedding_logits': True, 'rope_linear_scaling_factor': 1.0,
                    'local_rope_max_timescale': -1, 'attn_logits_soft_cap': 0.0,
                    'final_logits_soft_cap': 0.0,
                    # GPT-OSS
                    'inhomogeneous_layer_cycle_interval': 1, 'mlp_activations_limit': -1.0,
                    # Llama 4
                    'nope_layer_interval': -1, 'interleave_moe_layer_step': 1,
                    'use_qk_norm': False, 'temperature_tuning': False,
                    'chunk_attn_window_size': 0}



def read_settings(items: list[str] | dict | str | None) -> dict[str, Any]:
  """MaxText's settings for a conversion: ``items`` is a dict, a list of ``key=value``
  strings, a MaxText YAML path, or ``None``; MaxText's defaults fill what is not given."""
  settings = dict(MAXTEXT_DEFAULTS)
  if items is None:
    return settings
  if isinstance(items, str):
    import yaml  # noqa: PLC0415
    with open(items) as f:
      items = {k: v for k, v in (yaml.safe_load(f) or {}).items() if k != 'base_config'}
  if not isinstance(items, dict):
    pairs = {}
    for item in items:
      key, sep, value = str(item).partition('=')
      if not sep:
        raise ValueError(f'MaxText setting {item!r}: expected key=value.')
      pairs[key.strip()] = value.strip()
    items = pairs
  for key, value in items.items():
    if key in MAXTEXT_DEFAULTS and isinstance(value, str):
      value = _typed(key, value, MAXTEXT_DEFAULTS[key])
    settings[key] = value
  return settings


def _typed(key: str, value: str, default: Any) -> Any:
  """``value`` (a string) as the type of MaxText's default for ``key``."""
  if isinstance(default, bool):
    if value.lower() not in ('true', 'false', '1', '0'):
      raise ValueError(f'MaxText setting {key}={value!r}: expected true or false.')
    return value.lower() in ('true', '1')
  if isinstance(default, (int, float)):
    try:
      return type(default)(float(value))
    except ValueError:
      raise ValueError(f'MaxText setting {key}={value!r}: expected a number.') from None
  return value


def _restore(step_dir: str) -> dict:
  import orbax.checkpoint as ocp  # noqa: PLC0415
  items = os.path.join(os.path.abspath(step_dir), 'items')
  if not os.path.isdir(items):
    raise CheckpointError(f'{step_dir}: not a MaxText step directory (no items/ inside; give '
                          'the step directory, e.g. .../checkpoints/2).')
  try:
    tree = ocp.PyTreeCheckpointer().restore(items)
  except Exception as e:  # orbax's and tensorstore's own errors
    raise CheckpointError(f'{step_dir}: orbax cannot read it ({type(e).__name__}: '
                          f'{str(e).splitlines()[0] if str(e) else ""}).') from None
  return tree


def _unwrap(tree):
  """NNX parameters-only checkpoints wrap every leaf as ``{"value": x}``."""
  if isinstance(tree, dict):
    if set(tree) == {'value'} and not isinstance(tree['value'], dict):
      return tree['value']
    return {k: _unwrap(v) for k, v in tree.items()}
  return tree


def maxtext_params(step_dir: str) -> tuple[dict, dict]:
  """``(parameters, record)`` of a MaxText step directory: the nested parameter tree (NumPy,
  as stored) and ``{'step': int | None, 'layout': ..., 'full_state': bool}``.

  Raises:
    CheckpointError: not a MaxText checkpoint (naming what is missing).
  """
  tree = _restore(step_dir)
  if isinstance(tree.get('params'), dict) and 'params' in tree['params']:
    params, layout = tree['params']['params'], 'params/params'
  elif 'decoder' in tree and 'token_embedder' in tree:
    params, layout = _unwrap({k: tree[k] for k in ('decoder', 'token_embedder')}), 'nnx'
  else:
    raise CheckpointError(f'{step_dir}: no MaxText parameters in it (expected params/params/... '
                          f'or decoder/ and token_embedder/; found {sorted(tree)}).')
  step = tree.get('step')
  params = _to_numpy(params)
  return params, {'step': None if step is None else int(np.asarray(step)), 'layout': layout,
                  'full_state': 'opt_state' in tree}


def hf_checkpoint(params: dict, settings: dict) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """``(config.json dict, {tensor name: float32 array})`` of the Hugging Face checkpoint that
  holds MaxText ``params`` (a tree from :func:`maxtext_params`) under ``settings``
  (:func:`read_settings`).

  Raises:
    CheckpointError: a decoder block or setting this reader does not cover, or a tree that
      does not look like the block's.
  """
  block = settings['decoder_block']
  if block not in BLOCKS:
    raise CheckpointError(f'decoder_block={block}: MaxText checkpoints of the '
                          f"{', '.join(BLOCKS)} blocks are read so far.")
  if int(settings['rope_min_timescale']) != 1:
    raise CheckpointError(f"rope_min_timescale={settings['rope_min_timescale']}: MaxText "
                          'rotary embeddings with a minimum timescale other than 1 are not read.')
  if block == 'deepseek':
    return _deepseek_checkpoint(params, settings)
  if block.startswith('gemma'):
    return _gemma_checkpoint(params, settings)
  if block == 'gpt_oss':
    return _gpt_oss_checkpoint(params, settings)
  if block == 'llama4':
    return _llama4_checkpoint(params, settings)
  return _llama_checkpoint(params, settings)


def maxtext_tree(config: dict, tensors: dict[str, np.ndarray], *, scan_layers: bool = True
                 ) -> tuple[dict, dict[str, Any]]:
  """The inverse of :func:`hf_checkpoint`: ``(MaxText parameter tree, MaxText settings)`` of a
  Hugging Face Llama / Mistral / Mixtral checkpoint (``config.json`` dict, float32 tensors).

  The tree is MaxText's Linen layout (``decoder/...``, ``token_embedder/...``), scanned (each
  layer's arrays stacked on axis 1) or ``layers_0 ...``; the settings are the MaxText keys its
  run needs beside the tensors' shapes (``decoder_block``, ``rope_max_timescale``...).

  Raises:
    CheckpointError: a family or feature MaxText's blocks here do not hold.
  """
  family = config.get('model_type')
  # Written so far: the blocks whose layout maxtext_tree builds (reading covers more).
  blocks = {'llama': 'llama2', 'mistral': 'mistral', 'mixtral': 'mixtral'}
  if family not in blocks:
    raise CheckpointError(f"model_type={family!r}: MaxText checkpoints are written for the "
                          f"{', '.join(blocks)} families.")
  scaling = config.get('rope_scaling') or {}
  if scaling and scaling.get('rope_type', scaling.get('type')) not in (None, 'default'):
    raise CheckpointError(f'rope_scaling={scaling}: MaxText rotary scalings are not written yet.')
  head_dim = int(config.get('head_dim') or config['hidden_size'] // config['num_attention_heads'])
  d_model, heads = int(config['hidden_size']), int(config['num_attention_heads'])
  kv_heads = int(config.get('num_key_value_heads') or heads)
  layers = []
  for i in range(int(config['num_hidden_layers'])):
    p = f'model.layers.{i}.'
    t = {k[len(p):]: _f32(v) for k, v in tensors.items() if k.startswith(p)}
    layers.append(_maxtext_layer(t, config, (d_model, heads, kv_heads, head_dim)))
  decoder: dict[str, Any] = {'decoder_norm': {'scale': _f32(tensors['model.norm.weight'])}}
  if scan_layers:
    decoder['layers'] = _map_many(lambda *xs: np.stack(xs, axis=1), layers)
  else:
    decoder.update({f'layers_{i}': layer for i, layer in enumerate(layers)})
  tied = config.get('tie_word_embeddings', False) or 'lm_head.weight' not in tensors
  if not tied:
    decoder['logits_dense'] = {'kernel': _f32(tensors['lm_head.weight']).T}
  tree = {'decoder': decoder,
          'token_embedder': {'embedding': _f32(tensors['model.embed_tokens.weight'])}}
  settings = {'decoder_block': blocks[family], 'scan_layers': scan_layers,
              'base_emb_dim': d_model, 'base_num_query_heads': heads,
              'base_num_kv_heads': kv_heads, 'head_dim': head_dim,
              'base_num_decoder_layers': int(config['num_hidden_layers']),
              'vocab_size': int(config['vocab_size']),
              'normalization_layer_epsilon': float(config.get('rms_norm_eps', 1e-5)),
              'rope_max_timescale': float(config.get('rope_theta', 10_000)),
              'logits_via_embedding': bool(tied)}
  if tied:  # MaxText divides tied logits by sqrt(d_model) unless told not to
    settings['normalize_embedding_logits'] = False
  if family == 'mixtral':
    settings.update(num_experts=int(config['num_local_experts']),
                    num_experts_per_tok=int(config['num_experts_per_tok']),
                    base_moe_mlp_dim=int(config['intermediate_size']))
  else:
    settings['base_mlp_dim'] = int(config['intermediate_size'])
  if family == 'mistral' and config.get('sliding_window'):
    settings['sliding_window_size'] = int(config['sliding_window'])
  return tree, settings


def _maxtext_layer(t: dict[str, np.ndarray], config: dict, shape: tuple[int, ...]) -> dict:
  """One decoder layer's MaxText tree from its HF tensors ``t`` (named without the
  ``model.layers.<i>.`` prefix); ``shape``: ``(d_model, heads, kv_heads, head_dim)``. The
  query kernel takes MaxText's ``1 / sqrt(head_dim)`` in."""
  d_model, heads, kv_heads, head_dim = shape
  attention = {
      'query': {'kernel': (t['self_attn.q_proj.weight'].T / math.sqrt(head_dim)).reshape(
          d_model, heads, head_dim)},
      'key': {'kernel': t['self_attn.k_proj.weight'].T.reshape(d_model, kv_heads, head_dim)},
      'value': {'kernel': t['self_attn.v_proj.weight'].T.reshape(d_model, kv_heads, head_dim)},
      'out': {'kernel': t['self_attn.o_proj.weight'].T.reshape(heads, head_dim, d_model)}}
  layer = {'self_attention': attention,
           'pre_self_attention_layer_norm': {'scale': t['input_layernorm.weight']},
           'post_self_attention_layer_norm': {'scale': t['post_attention_layernorm.weight']}}
  if config.get('model_type') == 'mixtral':
    count = int(config['num_local_experts'])
    e = 'block_sparse_moe.experts.{}.{}.weight'
    layer['MoeBlock_0'] = {
        'gate': {'kernel': t['block_sparse_moe.gate.weight'].T},
        'wi_0': np.stack([t[e.format(j, 'w1')].T for j in range(count)]),
        'wi_1': np.stack([t[e.format(j, 'w3')].T for j in range(count)]),
        'wo': np.stack([t[e.format(j, 'w2')].T for j in range(count)])}
  else:
    layer['mlp'] = {'wi_0': {'kernel': t['mlp.gate_proj.weight'].T},
                    'wi_1': {'kernel': t['mlp.up_proj.weight'].T},
                    'wo': {'kernel': t['mlp.down_proj.weight'].T}}
  return layer


def _map_many(fn, trees: list):
  """``fn`` over the leaves of trees of one structure."""
  if isinstance(trees[0], dict):
    return {k: _map_many(fn, [t[k] for t in trees]) for k in trees[0]}
  return fn(*trees)


def write_maxtext(hf_dir: str, directory: str, *, scan_layers: bool = True,
                  dtype: str = 'float32') -> tuple[str, dict[str, Any]]:
  """Write the Hugging Face checkpoint in ``hf_dir`` as a MaxText parameters-only checkpoint:
  ``directory/0/items`` holds ``{'params': {'params': tree}}`` (what MaxText's
  ``load_parameters_path`` restores) in ``dtype`` (MaxText's ``weight_dtype``). Returns
  ``(the items path, the MaxText settings of the model)``."""
  import json  # noqa: PLC0415

  import orbax.checkpoint as ocp  # noqa: PLC0415

  from maxnnx.checkpoint.safetensors import read_safetensors_dir  # noqa: PLC0415
  with open(os.path.join(hf_dir, 'config.json')) as f:
    config = json.load(f)
  tensors = {name: array for name, (_, array) in read_safetensors_dir(hf_dir).items()}
  tree, settings = maxtext_tree(config, tensors, scan_layers=scan_layers)
  tree = _map(lambda x: np.asarray(x, dtype=np.dtype(dtype) if dtype != 'bfloat16'
                                   else _bfloat16()), tree)
  items = os.path.join(os.path.abspath(directory), '0', 'items')
  ocp.PyTreeCheckpointer().save(items, {'params': {'params': tree}})
  settings['weight_dtype'] = dtype
  return items, settings


def write_hf(step_dir: str, directory: str, settings=None) -> dict:
  """Write the Hugging Face checkpoint of MaxText step directory ``step_dir`` into
  ``directory`` (``config.json`` + ``model.safetensors``); returns :func:`maxtext_params`'s
  record. ``settings``: MaxText's YAML path, ``key=value`` list or dict."""
  import json  # noqa: PLC0415

  from maxnnx.checkpoint.safetensors import write_safetensors  # noqa: PLC0415
  params, record = maxtext_params(step_dir)
  config, tensors = hf_checkpoint(params, read_settings(settings))
  os.makedirs(directory, exist_ok=True)
  write_safetensors(os.path.join(directory, 'model.safetensors'), tensors)
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(config, f, indent=2)
  return record


def _ones_like(tree):
  return _map(lambda x: np.ones(np.shape(x), np.float32), tree)


def _item(tree: dict, key: int):
  """``tree[key]`` of an orbax-restored sequence (a list, or a dict keyed by ``'0'``...)."""
  return tree[key] if isinstance(tree, (list, tuple)) else tree.get(str(key), tree.get(key))


def hf_moments(step_dir: str, settings=None) -> dict[str, Any]:
  """MaxText's adamw moments of a full training state as Hugging Face tensors.

  Returns ``{'config', 'params', 'mu', 'nu', 'step', 'count'}``: the HF config and tensors of
  the parameters (:func:`hf_checkpoint`), the moments by the same names, the state's
  ``step`` and the adam ``count`` (``opt_state/0/count``).

  Every conversion of :func:`hf_checkpoint` is affine per element, ``hf = a * maxtext + b``
  (a transpose or permutation, the query's sqrt(head_dim), Gemma's ``- 1`` and
  ``/ sqrt(d_model)``), so the gradient in HF's coordinates is MaxText's divided by ``a``:
  ``mu`` becomes ``mu / a`` and ``nu`` ``nu / a**2`` (``a`` is read off the conversion of a
  tree of ones). That is the same optimizer state in the other coordinates; it is not the
  same update where ``a != 1``, since Adam's step does not scale with the parameter (see
  ``docs/from_maxtext.md``).

  Raises:
    CheckpointError: no optimizer state (a parameters-only checkpoint), an optimizer other
      than MaxText's adamw, or an output head HF holds and MaxText does not (a tied head
      written out: it has no moments of its own).
  """
  tree = _restore(step_dir)
  opt = tree.get('opt_state')
  adam = _item(opt, 0) if opt else None
  if not adam or 'params' not in (tree.get('params') or {}):
    raise CheckpointError(f'{step_dir}: no optimizer state in it (a parameters-only '
                          'checkpoint); give load_parameters_path= for its parameters.')
  if not isinstance(adam, dict) or not {'mu', 'nu', 'count'} <= set(adam):
    raise CheckpointError(f'{step_dir}: opt_state/0 is not an adam state (mu, nu, count): '
                          "MaxText's opt_type=adamw state is read.")
  settings = read_settings(settings)
  params = _to_numpy(tree['params']['params'])

  def convert(t):
    return hf_checkpoint(t, settings)

  config, tensors = convert(params)
  zero = convert(_map(np.zeros_like, params))[1]
  one = convert(_ones_like(params))[1]
  if 'logits_dense' not in params['decoder'] and 'lm_head.weight' in tensors:
    raise CheckpointError(f'{step_dir}: a tied embedding that HF writes as its own head '
                          '(the bfloat16 logits of logits_via_embedding): its optimizer state '
                          'has no HF counterpart; give load_parameters_path= instead.')
  moments = {}
  for name in ('mu', 'nu'):
    tree_m = _to_numpy(adam[name]['params'])
    got = convert(tree_m)[1]
    power = 2 if name == 'mu' else 3
    moments[name] = {k: (got[k] - zero[k]) / (one[k] - zero[k]) ** power for k in tensors}
  step = tree.get('step')
  return {'config': config, 'params': tensors, **moments,
          'step': int(np.asarray(step if step is not None else adam['count'])),
          'count': int(np.asarray(adam['count']))}


def _in_model_layout(config: dict, tensors: dict, model_config) -> dict[tuple, np.ndarray]:
  """HF ``tensors`` as ``{parameter path: array}`` of a maxnnx model of ``model_config``."""
  import json  # noqa: PLC0415
  import tempfile  # noqa: PLC0415

  from maxnnx.checkpoint.safetensors import write_safetensors  # noqa: PLC0415
  from maxnnx.models.pretrained import host_params  # noqa: PLC0415
  with tempfile.TemporaryDirectory() as scratch:
    write_safetensors(os.path.join(scratch, 'model.safetensors'),
                      {k: np.asarray(v, np.float32) for k, v in tensors.items()})
    with open(os.path.join(scratch, 'config.json'), 'w') as f:
      json.dump(config, f)
    _, params = host_params(scratch, **{'runtime.scan_layers': model_config.runtime.scan_layers})
    return {tuple(path): np.asarray(array, np.float32) for path, array in params}


def load_optimizer_state(trainer, step_dir: str, settings=None) -> int:
  """Continue MaxText's run: ``trainer`` (a :class:`~maxnnx.train.Trainer` of the model
  converted from ``step_dir``, with an adamw optimizer) takes MaxText's adam moments and step
  counts from the full training state in ``step_dir``; returns the step.

  The moments are :func:`hf_moments`'s, in the model's layout; every ``count`` of the
  optimizer's state (adam's and the schedule's) becomes MaxText's, and the trainer counts the
  step as taken, so the next update is MaxText's next one.

  Raises:
    CheckpointError: see :func:`hf_moments`; or moments that do not fit the trainer's
      optimizer (another optimizer, another model).
  """
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  if jax.process_count() > 1:  # the moments are placed from one host's copy
    raise CheckpointError(f'{step_dir}: continuing a MaxText optimizer state runs in one '
                          'process so far; give load_parameters_path= for a multi-process run.')
  state = hf_moments(step_dir, settings)
  cfg = trainer.model_config
  moments = {name: _in_model_layout(state['config'], state[name], cfg) for name in ('mu', 'nu')}
  optimizer = trainer.optimizer
  current = nnx.state(optimizer)
  placed = {'mu': set(), 'nu': set()}

  def replace(path, leaf):
    keys = [getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k))) for k in path]
    keys = [k for k in keys if k != 'value']
    if keys and keys[-1] == 'count':
      return np.asarray(state['count'], np.asarray(leaf).dtype)
    if keys == ['step']:
      return np.asarray(state['step'], np.asarray(leaf).dtype)
    for name in ('mu', 'nu'):
      if name in keys:
        param = tuple(keys[keys.index(name) + 1:])
        if param not in moments[name]:
          raise CheckpointError(f'{step_dir}: MaxText has no {name} for the parameter '
                                f"{'/'.join(map(str, param))} of this model.")
        value = moments[name][param]
        if value.shape != np.shape(leaf):
          raise CheckpointError(f"{step_dir}: {name} of {'/'.join(map(str, param))} is "
                                f'{value.shape}, the optimizer holds {np.shape(leaf)}.')
        placed[name].add(param)
        return value.astype(np.asarray(leaf).dtype)
    return leaf

  new = jax.tree_util.tree_map_with_path(replace, jax.device_get(current))
  missing = sorted(set(moments['mu']) - placed['mu'])
  if missing:
    raise CheckpointError(f"{step_dir}: the trainer's optimizer holds no adam moments for "
                          f"{', '.join('/'.join(map(str, p)) for p in missing[:3])} (an "
                          'optimizer other than adamw, or frozen parameters).')
  nnx.update(optimizer, new)
  trainer.count_steps_taken(state['step'])
  return state['step']


__all__ = ['BLOCKS', 'MAXTEXT_DEFAULTS', 'hf_checkpoint', 'hf_moments', 'load_optimizer_state',
           'maxtext_params', 'maxtext_tree', 'read_settings', 'write_hf', 'write_maxtext']

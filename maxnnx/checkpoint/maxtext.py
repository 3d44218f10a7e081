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
function here: the llama-style query kernel carries the attention's ``1 / sqrt(head_dim)``,
``rope_type=llama3.1`` rotates interleaved pairs, Gemma stores its norms as ``1 + w`` and its
embedding times sqrt(d_model), and a tied head's logits are MaxText's own.

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

#: HF's ``rope_scaling`` of MaxText's ``rope_type=llama3.1`` with ``rope_use_scale``: the
#: constants ``LLaMARotaryEmbedding._apply_scaling_factor`` (``layers/embeddings.py``) fixes.
LLAMA31_SCALING = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                   'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}

#: The decoder blocks read, and the Hugging Face family each becomes.
BLOCKS = {'llama2': 'llama', 'mistral': 'mistral', 'mixtral': 'mixtral',
          'deepseek': 'deepseek_v3', 'gemma': 'gemma', 'gemma2': 'gemma2', 'gemma3': 'gemma3',
          'gpt_oss': 'gpt_oss', 'llama4': 'llama4'}


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


def _to_numpy(tree):
  if isinstance(tree, dict):
    return {k: _to_numpy(v) for k, v in tree.items()}
  return np.asarray(tree)


def _layers(decoder: dict, group: str = 'layers', required: bool = True) -> list[dict]:
  """Per-layer parameter trees of ``decoder/<group>`` (stacked on axis 1 when scanned) or
  ``decoder/<group>_0 ...``."""
  if group in decoder:
    stacked = decoder[group]
    count = _first_leaf(stacked).shape[1]
    return [_map(lambda x, i=i: np.take(x, i, axis=1), stacked) for i in range(count)]
  prefix = group + '_'
  names = [k for k in decoder if k.startswith(prefix) and k[len(prefix):].isdigit()]
  names.sort(key=lambda k: int(k[len(prefix):]))
  if not names and required:
    raise CheckpointError(f'MaxText decoder without layers (neither {group}/ nor {prefix}0/).')
  return [decoder[name] for name in names]


def _first_leaf(tree):
  while isinstance(tree, dict):
    tree = next(iter(tree.values()))
  return tree


def _map(fn, tree):
  return {k: _map(fn, v) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)


def _f32(x) -> np.ndarray:
  return np.asarray(x, np.float32)


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
  # layers/attentions.py init_rotary_embedding: LLaMARotaryEmbedding by model name or rope_type
  llama31 = (str(settings['model_name']).startswith('llama3.1')
             or str(settings['rope_type']).startswith('llama3.1'))
  if settings['rope_type'] != 'default' and not llama31:
    raise CheckpointError(f"rope_type={settings['rope_type']}: for the {block} block MaxText's "
                          'default and llama3.1 rotary embeddings are read (yarn: deepseek).')
  if float(settings['rope_linear_scaling_factor']) != 1.0:
    raise CheckpointError('rope_linear_scaling_factor other than 1: read for gemma3 only.')
  decoder = params['decoder']
  layers = _layers(decoder)
  embedding = _f32(params['token_embedder']['embedding'])
  vocab, d_model = embedding.shape
  first = layers[0]
  query = first['self_attention']['query']['kernel']
  _, heads, head_dim = query.shape
  kv_heads = first['self_attention']['key']['kernel'].shape[1]
  moe = 'MoeBlock_0' in first
  tensors, tied = _embedding_and_head(params, settings)
  for i, layer in enumerate(layers):
    p, attn = f'model.layers.{i}.', layer['self_attention']
    q = _f32(attn['query']['kernel']) * math.sqrt(head_dim)  # MaxText folds 1/sqrt(hd) in
    k = _f32(attn['key']['kernel'])
    if llama31:  # interleaved pairs (x0, x1), (x2, x3)... -> HF's halves (evens, then odds)
      q, k = (np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1) for x in (q, k))
    tensors[p + 'self_attn.q_proj.weight'] = q.reshape(d_model, -1).T
    tensors[p + 'self_attn.k_proj.weight'] = k.reshape(d_model, -1).T
    tensors[p + 'self_attn.v_proj.weight'] = _f32(attn['value']['kernel']).reshape(d_model, -1).T
    tensors[p + 'self_attn.o_proj.weight'] = _f32(attn['out']['kernel']).reshape(-1, d_model).T
    tensors[p + 'input_layernorm.weight'] = _f32(layer['pre_self_attention_layer_norm']['scale'])
    tensors[p + 'post_attention_layernorm.weight'] = _f32(
        layer['post_self_attention_layer_norm']['scale'])
    if moe:
      block_moe = layer['MoeBlock_0']
      tensors[p + 'block_sparse_moe.gate.weight'] = _f32(block_moe['gate']['kernel']).T
      for j in range(block_moe['wi_0'].shape[0]):
        e = p + f'block_sparse_moe.experts.{j}.'
        tensors[e + 'w1.weight'] = _f32(block_moe['wi_0'][j]).T
        tensors[e + 'w3.weight'] = _f32(block_moe['wi_1'][j]).T
        tensors[e + 'w2.weight'] = _f32(block_moe['wo'][j]).T
    else:
      mlp = layer['mlp']
      tensors[p + 'mlp.gate_proj.weight'] = _f32(mlp['wi_0']['kernel']).T
      tensors[p + 'mlp.up_proj.weight'] = _f32(mlp['wi_1']['kernel']).T
      tensors[p + 'mlp.down_proj.weight'] = _f32(mlp['wo']['kernel']).T
  if moe != (block == 'mixtral'):
    raise CheckpointError(f'decoder_block={block}, but the checkpoint\'s layers '
                          f"{'have' if moe else 'have no'} MoeBlock_0: give MaxText's settings "
                          'of the run that wrote it (config=...).')
  mlp_dim = (layers[0]['MoeBlock_0']['wi_0'].shape[-1] if moe
             else layers[0]['mlp']['wi_0']['kernel'].shape[-1])
  config = {'model_type': BLOCKS[block], 'architectures': [], 'vocab_size': int(vocab),
            'hidden_size': int(d_model), 'intermediate_size': int(mlp_dim),
            'num_hidden_layers': len(layers), 'num_attention_heads': int(heads),
            'num_key_value_heads': int(kv_heads), 'head_dim': int(head_dim),
            'rms_norm_eps': float(settings['normalization_layer_epsilon']),
            'rope_theta': float(settings['rope_max_timescale']), 'hidden_act': 'silu',
            'max_position_embeddings': int(settings['max_target_length']),
            'tie_word_embeddings': tied, 'torch_dtype': 'float32'}
  if block == 'mistral' and int(settings['sliding_window_size']):
    config['sliding_window'] = int(settings['sliding_window_size'])
  if llama31 and settings['rope_use_scale']:
    config['rope_scaling'] = LLAMA31_SCALING
  if moe:
    config.update(num_local_experts=int(layers[0]['MoeBlock_0']['wi_0'].shape[0]),
                  num_experts_per_tok=int(settings['num_experts_per_tok']))
  return config, tensors


def _embedding_and_head(params: dict, settings: dict, embed_scale: float = 1.0,
                        norm_offset: float = 0.0) -> tuple[dict[str, np.ndarray], bool]:
  """The embedding, final norm and output head by their Hugging Face names, and whether HF's
  head is tied to its embedding.

  ``embed_scale``: the factor HF's family multiplies embeddings by (Gemma's sqrt(d_model), which
  MaxText stores folded into the table). With ``logits_via_embedding`` MaxText's logits are
  ``y @ bfloat16(table).T`` (``layers/embeddings.py`` ``attend_on_embedding`` casts the table
  to bfloat16 whatever ``dtype`` is), divided by sqrt(d_model) when
  ``normalize_embedding_logits`` (its default, ``layers/decoders.py``). HF's head is tied only
  when that is exactly its ``embedding.T``; otherwise it is written out.
  """
  decoder = params['decoder']
  table = _f32(params['token_embedder']['embedding'])
  tensors = {'model.embed_tokens.weight': table / np.float32(embed_scale),
             'model.norm.weight': _f32(decoder['decoder_norm']['scale']) - norm_offset}
  if 'logits_dense' in decoder:
    tensors['lm_head.weight'] = _f32(decoder['logits_dense']['kernel']).T
    return tensors, False
  head_scale = math.sqrt(table.shape[1]) if settings['normalize_embedding_logits'] else 1.0
  rounded = table.astype(_bfloat16()).astype(np.float32)
  if abs(head_scale - embed_scale) > 1e-9 or not np.array_equal(rounded, table):
    tensors['lm_head.weight'] = rounded / np.float32(head_scale)
    return tensors, False
  return tensors, True


def _linear(kernel) -> np.ndarray:
  """A MaxText kernel ``[in..., out...]`` with its input axis first as a torch weight
  ``[out, in]`` (the output axes flattened)."""
  kernel = _f32(kernel)
  return kernel.reshape(kernel.shape[0], -1).T


def _yarn_scaling(settings: dict) -> dict[str, Any]:
  """HF's ``rope_scaling`` for MaxText's ``rope_type=yarn`` (``YarnRotaryEmbedding``, and the
  MLA softmax scale of ``attention_mla.py``).

  MaxText multiplies the softmax scale by ``(0.1 * mscale * ln(rope_factor) + 1) ** 2`` when
  ``max_position_embeddings > original_max_position_embeddings`` (HF: ``mscale_all_dim``),
  and scales cos/sin by ``0.1 * ln(rope_factor) + 1`` only with ``rope_attention_scaling``
  (HF: ``attention_factor``, given here so that HF's own default ratio does not apply).
  """
  factor = float(settings['rope_factor'])
  original = int(settings['original_max_position_embeddings'])
  longer = int(settings['max_position_embeddings']) > original
  attention_factor = (0.1 * math.log(factor) + 1.0 if settings['rope_attention_scaling']
                      and factor > 1 else 1.0)
  return {'type': 'yarn', 'rope_type': 'yarn', 'factor': factor,
          'original_max_position_embeddings': original,
          'beta_fast': float(settings['beta_fast']), 'beta_slow': float(settings['beta_slow']),
          'mscale': float(settings['mscale']),
          'mscale_all_dim': float(settings['mscale']) if longer else 0.0,
          'truncate': bool(settings['rope_truncate']), 'attention_factor': attention_factor}


def _attention(tensors: dict, prefix: str, attn: dict, query_scale: float,
               norm_offset: float = 0.0) -> None:
  """q/k/v/o projections (and q/k norms) of a MaxText ``Attention`` as HF's ``self_attn.*``;
  the query kernel multiplied by ``query_scale``."""
  tensors[prefix + 'q_proj.weight'] = _linear(_f32(attn['query']['kernel']) * query_scale)
  tensors[prefix + 'k_proj.weight'] = _linear(attn['key']['kernel'])
  tensors[prefix + 'v_proj.weight'] = _linear(attn['value']['kernel'])
  out = _f32(attn['out']['kernel'])
  tensors[prefix + 'o_proj.weight'] = out.reshape(-1, out.shape[-1]).T
  for ours, theirs in (('query_norm', 'q_norm'), ('key_norm', 'k_norm')):
    if ours in attn:
      tensors[prefix + theirs + '.weight'] = _f32(attn[ours]['scale']) - norm_offset


def _gemma_layers(decoder: dict, block: str) -> list[dict]:
  """Gemma's per-layer trees with one set of names. Gemma 2's MaxText layer holds a local
  then a global layer (``*_local``, ``*_global``): two HF layers. Gemma 3 scans blocks of its
  6-layer pattern (``layers/layers_0 … layers_5``, stacked) and keeps the rest in
  ``layers_remainder/layers_k``."""
  if block == 'gemma2':
    out = []
    for layer in _layers(decoder):
      for kind in ('_local', '_global'):
        out.append({k[:-len(kind)]: v for k, v in layer.items() if k.endswith(kind)})
    return out
  if block == 'gemma3':
    return _cycle_layers(decoder)
  return _layers(decoder)


def _cycle_layers(decoder: dict) -> list[dict]:
  """Layers of a block scanned in cycles of a pattern (Gemma 3, GPT-OSS): scanned,
  ``layers/layers_0 … layers_{n-1}`` hold the n layers of a cycle, each stacked over the cycles
  on axis 1 (layer ``cycle * n + k``), and ``layers_remainder/layers_k`` any layers after the
  last whole cycle; unscanned, ``layers_0 …``."""
  if 'layers' not in decoder and 'layers_remainder' not in decoder:
    return _layers(decoder)
  out = []
  for cycle in _layers(decoder, 'layers', False):
    out.extend(_layers(cycle))
  if 'layers_remainder' in decoder:
    out.extend(_layers(decoder['layers_remainder']))
  return out


def _gemma_checkpoint(params: dict, settings: dict) -> tuple[dict, dict[str, np.ndarray]]:
  """``decoder_block=gemma|gemma2|gemma3`` as HF's Gemma families.

  MaxText stores Gemma's norms as HF's ``1 + w`` and the embedding multiplied by
  sqrt(d_model) (``param_mapping.py`` ``GEMMA3_MAXTEXT_TO_HF_PARAM_HOOK_FN``:
  ``scale_rmsnorm``, ``pad_and_scale_embedding``). Gemma 1 and 2 fold the query's
  ``1 / sqrt(head_dim)`` into its kernel (``query_pre_attn_scalar`` unset); Gemma 3 normalises
  q and k per head, then multiplies the query by ``query_pre_attn_scalar`` = ``head_dim **
  -0.5`` (gemma3-4b/12b) or ``(emb_dim // heads) ** -0.5`` (gemma3-27b), from the model name
  (``models/gemma3.py`` ``get_query_pre_attn_scalar``).
  """
  block = settings['decoder_block']
  decoder = params['decoder']
  layers = _gemma_layers(decoder, block)
  first = layers[0]
  _, heads, head_dim = first['self_attention']['query']['kernel'].shape
  kv_heads = first['self_attention']['key']['kernel'].shape[1]
  d_model = params['token_embedder']['embedding'].shape[1]
  if block == 'gemma3':
    name = str(settings['model_name'])
    scalars = {'gemma3-4b': head_dim, 'gemma3-12b': head_dim, 'gemma3-27b': d_model // heads}
    if name not in scalars:
      raise CheckpointError(f'decoder_block=gemma3 with model_name={name}: MaxText takes the '
                            'query scale of Gemma 3 from the model name (gemma3-4b, gemma3-12b '
                            "or gemma3-27b); give the run's model_name.")
    query_pre_attn_scalar, query_scale = scalars[name], 1.0
  else:
    query_pre_attn_scalar, query_scale = head_dim, math.sqrt(head_dim)
  tensors, tied = _embedding_and_head(params, settings, math.sqrt(d_model), 1.0)
  sandwich = block != 'gemma'
  for i, layer in enumerate(layers):
    p = f'model.layers.{i}.'
    _attention(tensors, p + 'self_attn.', layer['self_attention'], query_scale, 1.0)
    norms = {'pre_self_attention_norm': 'input_layernorm',
             'post_self_attention_norm': 'post_attention_layernorm',
             'pre_ffw_norm': 'pre_feedforward_layernorm',
             'post_ffw_norm': 'post_feedforward_layernorm'}
    if not sandwich:
      norms = {'pre_self_attention_norm': 'input_layernorm',
               'pre_ffw_norm': 'post_attention_layernorm'}
    for ours, theirs in norms.items():
      if ours not in layer:
        raise CheckpointError(f'decoder_block={block}: layer {i} has no {ours} (MaxText '
                              'use_post_attn_norm/use_post_ffw_norm false is not read).')
      tensors[p + theirs + '.weight'] = _f32(layer[ours]['scale']) - 1.0
    mlp = layer['mlp']
    tensors[p + 'mlp.gate_proj.weight'] = _f32(mlp['wi_0']['kernel']).T
    tensors[p + 'mlp.up_proj.weight'] = _f32(mlp['wi_1']['kernel']).T
    tensors[p + 'mlp.down_proj.weight'] = _f32(mlp['wo']['kernel']).T
  theta = float(settings['rope_max_timescale'])
  local = float(settings['local_rope_max_timescale'])
  config = {'model_type': BLOCKS[block] if block != 'gemma3' else 'gemma3_text',
            'architectures': [], 'vocab_size': int(tensors['model.embed_tokens.weight'].shape[0]),
            'hidden_size': int(d_model), 'intermediate_size': int(
                first['mlp']['wi_0']['kernel'].shape[-1]),
            'num_hidden_layers': len(layers), 'num_attention_heads': int(heads),
            'num_key_value_heads': int(kv_heads), 'head_dim': int(head_dim),
            'rms_norm_eps': float(settings['normalization_layer_epsilon']),
            'rope_theta': theta, 'hidden_activation': 'gelu_pytorch_tanh',
            'max_position_embeddings': int(settings['max_target_length']),
            'tie_word_embeddings': tied, 'torch_dtype': 'float32'}
  if sandwich:
    window = int(settings['sliding_window_size'])
    if not window:
      raise CheckpointError(f'decoder_block={block} without sliding_window_size: give the '
                            "run's sliding_window_size (MaxText's local layers need it).")
    pattern = 2 if block == 'gemma2' else 6
    config.update(
        sliding_window=window, query_pre_attn_scalar=int(query_pre_attn_scalar),
        attn_logit_softcapping=float(settings['attn_logits_soft_cap']) or None,
        final_logit_softcapping=float(settings['final_logits_soft_cap']) or None,
        layer_types=['full_attention' if (i + 1) % pattern == 0 else 'sliding_attention'
                     for i in range(len(layers))])
  if block == 'gemma3':
    factor = float(settings['rope_linear_scaling_factor'])
    config['rope_local_base_freq'] = local if local > 0 else theta
    if factor != 1.0:
      config['rope_scaling'] = {'rope_type': 'linear', 'factor': factor}
  elif local > 0 and local != theta:
    raise CheckpointError(f'decoder_block={block} with local_rope_max_timescale={local}: a '
                          'separate local rotary base is read for gemma3 only.')
  elif float(settings['rope_linear_scaling_factor']) != 1.0:
    raise CheckpointError('rope_linear_scaling_factor other than 1: read for gemma3 only.')
  return config, tensors


def _gpt_oss_checkpoint(params: dict, settings: dict) -> tuple[dict, dict[str, np.ndarray]]:
  """``decoder_block=gpt_oss`` as HF's ``gpt_oss`` (``param_mapping.py``
  ``GPT_OSS_MAXTEXT_TO_HF_PARAM_MAPPING``): biased q/k/v/o and one sink logit per head
  (``GptOssAttention``; the query is multiplied by ``head_dim ** -0.5`` at run time, no kernel
  carries it), a biased router and biased experts (``GptOssMlp``) whose ``wi_0``/``wi_1``
  interleave into HF's ``gate_up_proj`` (gate on even columns) and which HF stores
  ``[in, out]`` as MaxText does. Layer ``i`` is sliding when ``i`` is even (MaxText's
  ``models/gpt_oss.py`` pattern, scanned in cycles of ``inhomogeneous_layer_cycle_interval``).
  """
  if settings['rope_type'] != 'yarn':
    raise CheckpointError(f"decoder_block=gpt_oss with rope_type={settings['rope_type']}: read "
                          'with yarn (rope_type=yarn, as gpt-oss-20b/120b).')
  limit = float(settings['mlp_activations_limit'])
  window = int(settings['sliding_window_size'])
  if limit <= 0 or not window:
    raise CheckpointError('decoder_block=gpt_oss needs the run\'s mlp_activations_limit and '
                          'sliding_window_size (gpt-oss: 7.0 and 128).')
  layers = _cycle_layers(params['decoder'])
  tensors, tied = _embedding_and_head(params, settings)
  first = layers[0]['GptOssAttention']
  _, heads, head_dim = first['query']['kernel'].shape
  kv_heads = first['key']['kernel'].shape[1]
  for i, layer in enumerate(layers):
    p, attn, moe = f'model.layers.{i}.', layer['GptOssAttention'], layer['GptOssMlp']
    _attention(tensors, p + 'self_attn.', attn, 1.0)
    for name in ('query', 'key', 'value', 'out'):
      tensors[p + f'self_attn.{name[0]}_proj.bias'] = _f32(attn[name]['bias']).reshape(-1)
    tensors[p + 'self_attn.sinks'] = _f32(attn['sinks'])
    tensors[p + 'input_layernorm.weight'] = _f32(layer['pre_self_attention_layer_norm']['scale'])
    tensors[p + 'post_attention_layernorm.weight'] = _f32(
        layer['post_self_attention_layer_norm']['scale'])
    tensors[p + 'mlp.router.weight'] = _f32(moe['gate']['kernel']).T
    tensors[p + 'mlp.router.bias'] = _f32(moe['gate']['bias'])
    gate_up = np.stack([_f32(moe['wi_0']), _f32(moe['wi_1'])], axis=-1)
    tensors[p + 'mlp.experts.gate_up_proj'] = gate_up.reshape(*gate_up.shape[:-2], -1)
    bias = np.stack([_f32(moe['wi_0_bias']), _f32(moe['wi_1_bias'])], axis=-1)
    tensors[p + 'mlp.experts.gate_up_proj_bias'] = bias.reshape(*bias.shape[:-2], -1)
    tensors[p + 'mlp.experts.down_proj'] = _f32(moe['wo'])
    tensors[p + 'mlp.experts.down_proj_bias'] = _f32(moe['wo_bias'])
  scaling = _yarn_scaling(settings)
  scaling.pop('mscale'), scaling.pop('mscale_all_dim')  # MLA's softmax scale; not gpt_oss's
  embedding = tensors['model.embed_tokens.weight']
  config = {'model_type': 'gpt_oss', 'architectures': ['GptOssForCausalLM'],
            'vocab_size': int(embedding.shape[0]), 'hidden_size': int(embedding.shape[1]),
            'intermediate_size': int(layers[0]['GptOssMlp']['wi_0'].shape[-1]),
            'num_hidden_layers': len(layers),
            'num_attention_heads': int(heads), 'num_key_value_heads': int(kv_heads),
            'head_dim': int(head_dim), 'attention_bias': True, 'sliding_window': window,
            'layer_types': ['full_attention' if i % 2 else 'sliding_attention'
                            for i in range(len(layers))],
            'num_local_experts': int(layers[0]['GptOssMlp']['wi_0'].shape[0]),
            'num_experts_per_tok': int(settings['num_experts_per_tok']),
            'swiglu_limit': limit, 'rms_norm_eps': float(settings['normalization_layer_epsilon']),
            'rope_theta': float(settings['rope_max_timescale']), 'rope_scaling': scaling,
            'max_position_embeddings': int(settings['max_position_embeddings']),
            'hidden_act': 'silu', 'tie_word_embeddings': tied, 'torch_dtype': 'float32'}
  if settings['rope_interleave']:
    raise CheckpointError('decoder_block=gpt_oss with rope_interleave=true: read with rotary '
                          'halves (rope_interleave=false, as gpt-oss).')
  return config, tensors


def _llama4_checkpoint(params: dict, settings: dict) -> tuple[dict, dict[str, np.ndarray]]:
  """``decoder_block=llama4`` as HF's ``llama4_text`` (``models/llama4.py``): layer ``i`` is
  MoE when ``(i + 1) % interleave_moe_layer_step == 0`` (``Llama4MoEBlock_0``: routed experts
  and a shared one) and without rotary embedding when ``(i + 1) % nope_layer_interval == 0``
  (those attend fully, the others in chunks of ``chunk_attn_window_size``); the query is
  multiplied by ``head_dim ** -0.5`` at run time (no kernel carries it), and with
  ``use_qk_norm`` the rotary layers' q/k get a weightless L2 norm. Rotary pairs are
  interleaved in both MaxText (``rope_type=llama3.1``) and HF's Llama 4, so q/k are not
  permuted; HF's experts are ``[in, out]`` with gate then up halves in ``gate_up_proj``.
  """
  if not str(settings['rope_type']).startswith('llama3.1'):
    raise CheckpointError(f"decoder_block=llama4 with rope_type={settings['rope_type']}: read "
                          'with the llama3.1 rotary embedding (rope_type=llama3.1, as Llama 4).')
  layers = _cycle_layers(params['decoder'])
  tensors, tied = _embedding_and_head(params, settings)
  first = layers[0]['self_attention']
  _, heads, head_dim = first['query']['kernel'].shape
  kv_heads = first['key']['kernel'].shape[1]
  dense_dim = moe_dim = experts = 0
  for i, layer in enumerate(layers):
    p = f'model.layers.{i}.'
    _attention(tensors, p + 'self_attn.', layer['self_attention'], 1.0)
    tensors[p + 'input_layernorm.weight'] = _f32(layer['pre_self_attention_layer_norm']['scale'])
    tensors[p + 'post_attention_layernorm.weight'] = _f32(
        layer['post_self_attention_layer_norm']['scale'])
    f = p + 'feed_forward.'
    if 'Llama4MoEBlock_0' in layer:
      routed = layer['Llama4MoEBlock_0']['MoeBlock_0']
      shared = layer['Llama4MoEBlock_0']['shared_experts']
      tensors[f + 'router.weight'] = _f32(routed['gate']['kernel']).T
      tensors[f + 'experts.gate_up_proj'] = np.concatenate(
          [_f32(routed['wi_0']), _f32(routed['wi_1'])], axis=-1)
      tensors[f + 'experts.down_proj'] = _f32(routed['wo'])
      experts, moe_dim = routed['wi_0'].shape[0], routed['wi_0'].shape[-1]
      mlp, m = shared, f + 'shared_expert.'
    else:
      mlp, m = layer['mlp'], f
      dense_dim = mlp['wi_0']['kernel'].shape[-1]
    tensors[m + 'gate_proj.weight'] = _f32(mlp['wi_0']['kernel']).T
    tensors[m + 'up_proj.weight'] = _f32(mlp['wi_1']['kernel']).T
    tensors[m + 'down_proj.weight'] = _f32(mlp['wo']['kernel']).T
  nope = int(settings['nope_layer_interval'])
  uses_rope = [int(nope <= 0 or (i + 1) % nope != 0) for i in range(len(layers))]
  chunk = int(settings['chunk_attn_window_size'])
  embedding = tensors['model.embed_tokens.weight']
  config = {'model_type': 'llama4_text', 'architectures': ['Llama4ForCausalLM'],
            'vocab_size': int(embedding.shape[0]), 'hidden_size': int(embedding.shape[1]),
            'intermediate_size': int(moe_dim or dense_dim),
            'intermediate_size_mlp': int(dense_dim or moe_dim),
            'num_hidden_layers': len(layers), 'num_attention_heads': int(heads),
            'num_key_value_heads': int(kv_heads), 'head_dim': int(head_dim),
            'num_local_experts': int(experts), 'num_experts_per_tok':
            int(settings['num_experts_per_tok']),
            'interleave_moe_layer_step': int(settings['interleave_moe_layer_step']),
            'no_rope_layers': uses_rope, 'use_qk_norm': bool(settings['use_qk_norm']),
            'attn_temperature_tuning': bool(settings['temperature_tuning']),
            'floor_scale': 8192, 'attn_scale': 0.1,
            'attention_chunk_size': chunk if chunk > 0 else None,
            'rms_norm_eps': float(settings['normalization_layer_epsilon']),
            'rope_theta': float(settings['rope_max_timescale']),
            'max_position_embeddings': int(settings['max_target_length']),
            'hidden_act': 'silu', 'tie_word_embeddings': tied, 'torch_dtype': 'float32'}
  if settings['rope_use_scale']:
    config['rope_scaling'] = LLAMA31_SCALING
  return config, tensors


def _deepseek_checkpoint(params: dict, settings: dict) -> tuple[dict, dict[str, np.ndarray]]:
  """``decoder_block=deepseek`` (DeepSeek-V3: ``model_name=deepseek3-…``) as HF's
  ``deepseek_v3``: multi-head latent attention, ``dense_layers`` then ``moe_layers`` with a
  shared expert and sigmoid routing with a correction bias.

  MaxText's MLA applies its softmax scale to the query explicitly (``attention_mla.py``
  ``mla_query_projection``), so no kernel carries it; its MLA kernels map to HF's by transpose
  (``param_mapping.py`` ``DEEPSEEK_MAXTEXT_TO_HF_PARAM_MAPPING``), rotary pairs interleaved in
  both (``rope_interleave``).
  """
  if not str(settings['model_name']).startswith('deepseek3'):
    raise CheckpointError(
        f"decoder_block=deepseek with model_name={settings['model_name']}: MaxText routes "
        'DeepSeek-V3-style (the bias picks the experts, the unbiased scores weight them) only '
        "for model names starting 'deepseek3' (layers/moe.py get_topk); give the run's "
        'model_name (e.g. model_name=deepseek3-671b).')
  if settings['routed_score_func'] != 'sigmoid':
    raise CheckpointError(f"routed_score_func={settings['routed_score_func']!r}: the deepseek "
                          "block is read with DeepSeek-V3's sigmoid routing; give "
                          'routed_score_func=sigmoid (the setting of the run that wrote it).')
  if settings['rope_type'] != 'yarn' or not settings['rope_interleave']:
    raise CheckpointError(f"rope_type={settings['rope_type']} rope_interleave="
                          f"{settings['rope_interleave']}: the deepseek block is read with yarn "
                          'and interleaved rotary pairs (rope_type=yarn rope_interleave=true).')
  decoder = params['decoder']
  dense, moe = _layers(decoder, 'dense_layers', False), _layers(decoder, 'moe_layers', False)
  if not moe:
    raise CheckpointError('decoder_block=deepseek, but the checkpoint has no moe_layers: give '
                          "MaxText's settings of the run that wrote it (config=...).")
  tensors, tied = _embedding_and_head(params, settings)
  attn0 = moe[0]['self_attention']
  if 'wq_a' not in attn0:
    raise CheckpointError('deepseek block without wq_a (q_lora_rank=0, DeepSeek-V2-style '
                          'queries): not read yet.')
  heads = attn0['wq_b']['kernel'].shape[1]
  kv_lora_rank = attn0['kv_norm']['scale'].shape[0]
  rope_dim = attn0['wkv_a']['kernel'].shape[-1] - kv_lora_rank
  qk_head_dim = attn0['wq_b']['kernel'].shape[-1]
  v_head_dim = attn0['out']['kernel'].shape[1]
  nope_dim = qk_head_dim - rope_dim
  moe_dim, experts = moe[0]['DeepSeekMoeBlock_0']['MoeBlock_0']['wi_0'].shape[-1], 0
  for i, layer in enumerate(dense + moe):
    p, attn = f'model.layers.{i}.', layer['self_attention']
    tensors[p + 'input_layernorm.weight'] = _f32(layer['pre_self_attention_layer_norm']['scale'])
    tensors[p + 'post_attention_layernorm.weight'] = _f32(
        layer['post_self_attention_layer_norm']['scale'])
    a = p + 'self_attn.'
    tensors[a + 'q_a_proj.weight'] = _linear(attn['wq_a']['kernel'])
    tensors[a + 'q_a_layernorm.weight'] = _f32(attn['q_norm']['scale'])
    tensors[a + 'q_b_proj.weight'] = _linear(attn['wq_b']['kernel'])
    tensors[a + 'kv_a_proj_with_mqa.weight'] = _linear(attn['wkv_a']['kernel'])
    tensors[a + 'kv_a_layernorm.weight'] = _f32(attn['kv_norm']['scale'])
    tensors[a + 'kv_b_proj.weight'] = _linear(attn['wkv_b']['kernel'])
    tensors[a + 'o_proj.weight'] = _f32(attn['out']['kernel']).reshape(-1, tensors[
        'model.norm.weight'].shape[0]).T
    if i < len(dense):
      mlp, m = layer['mlp'], p + 'mlp.'
    else:
      block = layer['DeepSeekMoeBlock_0']
      routed, mlp, m = block['MoeBlock_0'], block['shared_experts'], p + 'mlp.shared_experts.'
      tensors[p + 'mlp.gate.weight'] = _f32(routed['gate']['kernel']).T
      if 'bias' in routed['gate']:
        tensors[p + 'mlp.gate.e_score_correction_bias'] = _f32(routed['gate']['bias'])
      experts = routed['wi_0'].shape[0]
      for j in range(experts):
        e = p + f'mlp.experts.{j}.'
        tensors[e + 'gate_proj.weight'] = _f32(routed['wi_0'][j]).T
        tensors[e + 'up_proj.weight'] = _f32(routed['wi_1'][j]).T
        tensors[e + 'down_proj.weight'] = _f32(routed['wo'][j]).T
    tensors[m + 'gate_proj.weight'] = _f32(mlp['wi_0']['kernel']).T
    tensors[m + 'up_proj.weight'] = _f32(mlp['wi_1']['kernel']).T
    tensors[m + 'down_proj.weight'] = _f32(mlp['wo']['kernel']).T
  shared_dim = moe[0]['DeepSeekMoeBlock_0']['shared_experts']['wi_0']['kernel'].shape[-1]
  embedding = tensors['model.embed_tokens.weight']
  groups = int(settings['n_routing_groups'])
  config = {'model_type': 'deepseek_v3', 'architectures': ['DeepseekV3ForCausalLM'],
            'vocab_size': int(embedding.shape[0]), 'hidden_size': int(embedding.shape[1]),
            'intermediate_size': int(dense[0]['mlp']['wi_0']['kernel'].shape[-1] if dense
                                     else moe_dim),
            'moe_intermediate_size': int(moe_dim), 'num_hidden_layers': len(dense) + len(moe),
            'num_attention_heads': int(heads), 'num_key_value_heads': int(heads),
            'q_lora_rank': int(attn0['wq_a']['kernel'].shape[-1]),
            'kv_lora_rank': int(kv_lora_rank), 'qk_rope_head_dim': int(rope_dim),
            'qk_nope_head_dim': int(nope_dim), 'v_head_dim': int(v_head_dim),
            'head_dim': int(rope_dim), 'n_routed_experts': int(experts),
            'n_shared_experts': int(shared_dim // moe_dim),
            'num_experts_per_tok': int(settings['num_experts_per_tok']),
            'first_k_dense_replace': len(dense), 'norm_topk_prob': True,
            'routed_scaling_factor': float(settings['routed_scaling_factor']),
            'n_group': groups if groups > 0 else 1,
            'topk_group': int(settings['topk_routing_group']) if groups > 0 else 1,
            'topk_method': 'noaux_tc', 'scoring_func': 'sigmoid', 'hidden_act': 'silu',
            'rms_norm_eps': float(settings['normalization_layer_epsilon']),
            'rope_theta': float(settings['rope_max_timescale']), 'rope_interleave': True,
            'rope_scaling': _yarn_scaling(settings), 'attention_bias': False,
            'max_position_embeddings': int(settings['max_position_embeddings']),
            'num_nextn_predict_layers': 0, 'tie_word_embeddings': tied,
            'torch_dtype': 'float32'}
  if shared_dim % moe_dim:
    raise CheckpointError(f'deepseek shared experts of width {shared_dim}: not a multiple of '
                          f'the routed experts\' {moe_dim}.')
  return config, tensors


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
    attention = {
        'query': {'kernel': (t['self_attn.q_proj.weight'].T / math.sqrt(head_dim)).reshape(
            d_model, heads, head_dim)},
        'key': {'kernel': t['self_attn.k_proj.weight'].T.reshape(d_model, kv_heads, head_dim)},
        'value': {'kernel': t['self_attn.v_proj.weight'].T.reshape(d_model, kv_heads, head_dim)},
        'out': {'kernel': t['self_attn.o_proj.weight'].T.reshape(heads, head_dim, d_model)}}
    layer = {'self_attention': attention,
             'pre_self_attention_layer_norm': {'scale': t['input_layernorm.weight']},
             'post_self_attention_layer_norm': {'scale': t['post_attention_layernorm.weight']}}
    if family == 'mixtral':
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
    layers.append(layer)
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


def _bfloat16():
  import ml_dtypes  # noqa: PLC0415
  return ml_dtypes.bfloat16


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
    _, params = host_params(scratch, scan_layers=model_config.runtime.scan_layers)
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

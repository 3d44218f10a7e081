"""MaxText's parameters as Hugging Face tensors, one function per decoder block.

:func:`maxnnx.checkpoint.maxtext.hf_checkpoint` turns the parameter tree of a MaxText
checkpoint (:func:`maxnnx.checkpoint.maxtext.maxtext_params`) into a Hugging Face
``config.json`` and its tensors; each block (llama-style, gpt_oss, llama4, deepseek here,
gemma in :mod:`maxnnx.checkpoint.maxtext_gemma`) has a function of its own that undoes its
conventions (see :mod:`maxnnx.checkpoint.maxtext`), with the helpers of this module.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from maxnnx.checkpoint.manager import CheckpointError

#: HF's ``rope_scaling`` of MaxText's ``rope_type=llama3.1`` with ``rope_use_scale``: the
#: constants ``LLaMARotaryEmbedding._apply_scaling_factor`` (``layers/embeddings.py``) fixes.
LLAMA31_SCALING = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                   'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}

#: The decoder blocks read, and the Hugging Face family each becomes.
BLOCKS = {'llama2': 'llama', 'mistral': 'mistral', 'mixtral': 'mixtral',
          'deepseek': 'deepseek_v3', 'gemma': 'gemma', 'gemma2': 'gemma2', 'gemma3': 'gemma3',
          'gpt_oss': 'gpt_oss', 'llama4': 'llama4'}


def _bfloat16():
  import ml_dtypes  # noqa: PLC0415
  return ml_dtypes.bfloat16


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


def _llama_checkpoint(params: dict, settings: dict) -> tuple[dict, dict[str, np.ndarray]]:
  """``llama2`` / ``mistral`` / ``mixtral`` as HF's families of those names (default or
  llama3.1 rotary embeddings; MaxText's ``1/sqrt(head_dim)`` taken back out of the query)."""
  block = settings['decoder_block']
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
    _attention_norms(tensors, p, layer)
    if moe:
      block_moe = layer['MoeBlock_0']
      tensors[p + 'block_sparse_moe.gate.weight'] = _f32(block_moe['gate']['kernel']).T
      for j in range(block_moe['wi_0'].shape[0]):
        e = p + f'block_sparse_moe.experts.{j}.'
        tensors[e + 'w1.weight'] = _f32(block_moe['wi_0'][j]).T
        tensors[e + 'w3.weight'] = _f32(block_moe['wi_1'][j]).T
        tensors[e + 'w2.weight'] = _f32(block_moe['wo'][j]).T
    else:
      _dense_mlp(tensors, p + 'mlp.', layer['mlp'])
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


def _attention_norms(tensors: dict, prefix: str, layer: dict) -> None:
  """A layer's norms before and after attention as HF's ``input_layernorm`` and
  ``post_attention_layernorm`` under ``prefix`` (``model.layers.<i>.``)."""
  tensors[prefix + 'input_layernorm.weight'] = _f32(layer['pre_self_attention_layer_norm']['scale'])
  tensors[prefix + 'post_attention_layernorm.weight'] = _f32(
      layer['post_self_attention_layer_norm']['scale'])


def _dense_mlp(tensors: dict, prefix: str, mlp: dict) -> None:
  """A gated MLP (``wi_0`` gate, ``wi_1`` up, ``wo`` down) as HF's ``gate_proj`` /
  ``up_proj`` / ``down_proj`` under ``prefix``."""
  tensors[prefix + 'gate_proj.weight'] = _f32(mlp['wi_0']['kernel']).T
  tensors[prefix + 'up_proj.weight'] = _f32(mlp['wi_1']['kernel']).T
  tensors[prefix + 'down_proj.weight'] = _f32(mlp['wo']['kernel']).T


def _cycled_stack(params: dict, settings: dict, attention: str):
  """``(layers, tensors, tied, (heads, kv_heads, head_dim))`` of a block whose layers scan in
  cycles (GPT-OSS, Llama 4): the layers in order, the embedding and head tensors, whether the
  head is tied, and the head counts read off the first layer's ``attention`` module."""
  layers = _cycle_layers(params['decoder'])
  tensors, tied = _embedding_and_head(params, settings)
  first = layers[0][attention]
  _, heads, head_dim = first['query']['kernel'].shape
  return layers, tensors, tied, (heads, first['key']['kernel'].shape[1], head_dim)


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
  layers, tensors, tied, (heads, kv_heads, head_dim) = _cycled_stack(params, settings,
                                                                     'GptOssAttention')
  for i, layer in enumerate(layers):
    p, attn, moe = f'model.layers.{i}.', layer['GptOssAttention'], layer['GptOssMlp']
    _attention(tensors, p + 'self_attn.', attn, 1.0)
    for name in ('query', 'key', 'value', 'out'):
      tensors[p + f'self_attn.{name[0]}_proj.bias'] = _f32(attn[name]['bias']).reshape(-1)
    tensors[p + 'self_attn.sinks'] = _f32(attn['sinks'])
    _attention_norms(tensors, p, layer)
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
  layers, tensors, tied, (heads, kv_heads, head_dim) = _cycled_stack(params, settings,
                                                                     'self_attention')
  dense_dim = moe_dim = experts = 0
  for i, layer in enumerate(layers):
    p = f'model.layers.{i}.'
    _attention(tensors, p + 'self_attn.', layer['self_attention'], 1.0)
    _attention_norms(tensors, p, layer)
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
    _dense_mlp(tensors, m, mlp)
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


def _check_deepseek_settings(settings: dict) -> None:
  """Refuse MaxText settings the deepseek block is not read with, naming the one to give."""
  if not str(settings['model_name']).startswith('deepseek3'):
    raise CheckpointError(
        f"decoder_block=deepseek with model_name={settings['model_name']}: MaxText routes "
        'DeepSeek-V3-style (the bias picks the experts, the unbiased scores weight them) only '
        "for model names starting 'deepseek3' (layers/moe.py get_topk); give the run's "
        'model_name (e.g. model_name=deepseek3-671b).')
  wrong = [f'{key}={settings[key]}' for key, wanted in (('routed_score_func', 'sigmoid'),
             ('rope_type', 'yarn'), ('rope_interleave', True)) if settings[key] != wanted]
  if wrong:
    raise CheckpointError(f"{' '.join(wrong)}: the deepseek block is read with DeepSeek-V3's "
                          'sigmoid routing, yarn and interleaved rotary pairs; give '
                          'routed_score_func=sigmoid rope_type=yarn rope_interleave=true.')


def _deepseek_routed_experts(tensors: dict, prefix: str, routed: dict) -> int:
  """Add one MoE layer's router (and its correction bias) and routed experts to ``tensors``
  under ``prefix`` (``model.layers.<i>.mlp.``); returns the number of experts."""
  tensors[prefix + 'gate.weight'] = _f32(routed['gate']['kernel']).T
  if 'bias' in routed['gate']:
    tensors[prefix + 'gate.e_score_correction_bias'] = _f32(routed['gate']['bias'])
  for j in range(routed['wi_0'].shape[0]):
    e = prefix + f'experts.{j}.'
    tensors[e + 'gate_proj.weight'] = _f32(routed['wi_0'][j]).T
    tensors[e + 'up_proj.weight'] = _f32(routed['wi_1'][j]).T
    tensors[e + 'down_proj.weight'] = _f32(routed['wo'][j]).T
  return routed['wi_0'].shape[0]


def _mla(tensors: dict, prefix: str, attn: dict) -> None:
  """A layer's multi-head latent attention as HF's ``self_attn.*`` under ``prefix``: the
  kernels transposed, the output one to ``[d_model, heads * v_head_dim]``."""
  tensors[prefix + 'q_a_proj.weight'] = _linear(attn['wq_a']['kernel'])
  tensors[prefix + 'q_a_layernorm.weight'] = _f32(attn['q_norm']['scale'])
  tensors[prefix + 'q_b_proj.weight'] = _linear(attn['wq_b']['kernel'])
  tensors[prefix + 'kv_a_proj_with_mqa.weight'] = _linear(attn['wkv_a']['kernel'])
  tensors[prefix + 'kv_a_layernorm.weight'] = _f32(attn['kv_norm']['scale'])
  tensors[prefix + 'kv_b_proj.weight'] = _linear(attn['wkv_b']['kernel'])
  tensors[prefix + 'o_proj.weight'] = _f32(attn['out']['kernel']).reshape(-1, tensors[
      'model.norm.weight'].shape[0]).T


def _deepseek_checkpoint(params: dict, settings: dict) -> tuple[dict, dict[str, np.ndarray]]:
  """``decoder_block=deepseek`` (DeepSeek-V3: ``model_name=deepseek3-…``) as HF's
  ``deepseek_v3``: multi-head latent attention, ``dense_layers`` then ``moe_layers`` with a
  shared expert and sigmoid routing with a correction bias.

  MaxText's MLA applies its softmax scale to the query explicitly (``attention_mla.py``
  ``mla_query_projection``), so no kernel carries it; its MLA kernels map to HF's by transpose
  (``param_mapping.py`` ``DEEPSEEK_MAXTEXT_TO_HF_PARAM_MAPPING``), rotary pairs interleaved in
  both (``rope_interleave``).
  """
  _check_deepseek_settings(settings)
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
    p = f'model.layers.{i}.'
    _attention_norms(tensors, p, layer)
    _mla(tensors, p + 'self_attn.', layer['self_attention'])
    if i < len(dense):
      mlp, m = layer['mlp'], p + 'mlp.'
    else:
      block = layer['DeepSeekMoeBlock_0']
      mlp, m = block['shared_experts'], p + 'mlp.shared_experts.'
      experts = _deepseek_routed_experts(tensors, p + 'mlp.', block['MoeBlock_0'])
    _dense_mlp(tensors, m, mlp)
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

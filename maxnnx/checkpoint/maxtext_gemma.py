"""MaxText's Gemma blocks (``decoder_block=gemma|gemma2|gemma3``) as Hugging Face tensors.

One of the block readers of :func:`maxnnx.checkpoint.maxtext.hf_checkpoint`, beside those of
:mod:`maxnnx.checkpoint.maxtext_blocks`, whose shared helpers it uses.
"""

from __future__ import annotations

import math

import numpy as np

from maxnnx.checkpoint.manager import CheckpointError
from maxnnx.checkpoint.maxtext_blocks import (
  BLOCKS,
  _attention,
  _cycle_layers,
  _dense_mlp,
  _embedding_and_head,
  _f32,
  _layers,
)

#: Gemma's layer norms in MaxText, by their Hugging Face names: with the sandwich norms of
#: Gemma 2 and 3, and Gemma 1's two.
_SANDWICH_NORMS = {'pre_self_attention_norm': 'input_layernorm',
                   'post_self_attention_norm': 'post_attention_layernorm',
                   'pre_ffw_norm': 'pre_feedforward_layernorm',
                   'post_ffw_norm': 'post_feedforward_layernorm'}
_GEMMA1_NORMS = {'pre_self_attention_norm': 'input_layernorm',
                 'pre_ffw_norm': 'post_attention_layernorm'}


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


def _gemma_checkpoint(params: dict, settings: dict) -> tuple[dict, dict[str, np.ndarray]]:
  """``decoder_block=gemma|gemma2|gemma3`` as HF's Gemma families.

  MaxText stores Gemma's norms as HF's ``1 + w`` and the embedding multiplied by
  sqrt(d_model) (``param_mapping.py`` ``GEMMA3_MAXTEXT_TO_HF_PARAM_HOOK_FN``:
  ``scale_rmsnorm``, ``pad_and_scale_embedding``). Gemma 1 and 2 fold the query's
  ``1 / sqrt(head_dim)`` into its kernel (``query_pre_attn_scalar`` unset); Gemma 3 normalises
  q and k per head, then multiplies the query by ``query_pre_attn_scalar`` (see
  :func:`_query_scales`).
  """
  block = settings['decoder_block']
  layers = _gemma_layers(params['decoder'], block)
  first = layers[0]
  _, heads, head_dim = first['self_attention']['query']['kernel'].shape
  kv_heads = first['self_attention']['key']['kernel'].shape[1]
  d_model = params['token_embedder']['embedding'].shape[1]
  query_pre_attn_scalar, query_scale = _query_scales(settings, head_dim, d_model // heads)
  tensors, tied = _embedding_and_head(params, settings, math.sqrt(d_model), 1.0)
  norms = _GEMMA1_NORMS if block == 'gemma' else _SANDWICH_NORMS
  for i, layer in enumerate(layers):
    p = f'model.layers.{i}.'
    _attention(tensors, p + 'self_attn.', layer['self_attention'], query_scale, 1.0)
    for ours, theirs in norms.items():
      if ours not in layer:
        raise CheckpointError(f'decoder_block={block}: layer {i} has no {ours} (MaxText '
                              'use_post_attn_norm/use_post_ffw_norm false is not read).')
      tensors[p + theirs + '.weight'] = _f32(layer[ours]['scale']) - 1.0
    _dense_mlp(tensors, p + 'mlp.', layer['mlp'])
  config = {'model_type': BLOCKS[block] if block != 'gemma3' else 'gemma3_text',
            'architectures': [], 'vocab_size': int(tensors['model.embed_tokens.weight'].shape[0]),
            'hidden_size': int(d_model), 'intermediate_size': int(
                first['mlp']['wi_0']['kernel'].shape[-1]),
            'num_hidden_layers': len(layers), 'num_attention_heads': int(heads),
            'num_key_value_heads': int(kv_heads), 'head_dim': int(head_dim),
            'rms_norm_eps': float(settings['normalization_layer_epsilon']),
            'rope_theta': float(settings['rope_max_timescale']),
            'hidden_activation': 'gelu_pytorch_tanh',
            'max_position_embeddings': int(settings['max_target_length']),
            'tie_word_embeddings': tied, 'torch_dtype': 'float32'}
  if block != 'gemma':
    config.update(_sliding_layers(settings, len(layers), query_pre_attn_scalar))
  config.update(_gemma_rope(settings))
  return config, tensors


def _query_scales(settings: dict, head_dim: int, width_per_head: int) -> tuple[int, float]:
  """``(query_pre_attn_scalar, factor on the query kernel)``. Gemma 1 and 2: ``head_dim``,
  and ``sqrt(head_dim)`` taken back out of the kernel. Gemma 3: ``head_dim`` (gemma3-4b/12b)
  or ``emb_dim // heads`` (gemma3-27b) by the model name (``models/gemma3.py``
  ``get_query_pre_attn_scalar``), the kernel as it is."""
  if settings['decoder_block'] != 'gemma3':
    return head_dim, math.sqrt(head_dim)
  name = str(settings['model_name'])
  scalars = {'gemma3-4b': head_dim, 'gemma3-12b': head_dim, 'gemma3-27b': width_per_head}
  if name not in scalars:
    raise CheckpointError(f'decoder_block=gemma3 with model_name={name}: MaxText takes the '
                          'query scale of Gemma 3 from the model name (gemma3-4b, gemma3-12b '
                          "or gemma3-27b); give the run's model_name.")
  return scalars[name], 1.0


def _sliding_layers(settings: dict, num_layers: int, query_pre_attn_scalar: int) -> dict:
  """The ``config.json`` keys of Gemma 2 and 3's local and global layers (one global layer in
  2, or in 6) and their soft-caps."""
  block = settings['decoder_block']
  window = int(settings['sliding_window_size'])
  if not window:
    raise CheckpointError(f'decoder_block={block} without sliding_window_size: give the '
                          "run's sliding_window_size (MaxText's local layers need it).")
  pattern = 2 if block == 'gemma2' else 6
  return dict(
      sliding_window=window, query_pre_attn_scalar=int(query_pre_attn_scalar),
      attn_logit_softcapping=float(settings['attn_logits_soft_cap']) or None,
      final_logit_softcapping=float(settings['final_logits_soft_cap']) or None,
      layer_types=['full_attention' if (i + 1) % pattern == 0 else 'sliding_attention'
                   for i in range(num_layers)])


def _gemma_rope(settings: dict) -> dict:
  """Gemma 3's local rotary base and linear scaling as ``config.json`` keys; refused for
  Gemma 1 and 2, which have neither."""
  block = settings['decoder_block']
  theta = float(settings['rope_max_timescale'])
  local = float(settings['local_rope_max_timescale'])
  factor = float(settings['rope_linear_scaling_factor'])
  if block == 'gemma3':
    keys = {'rope_local_base_freq': local if local > 0 else theta}
    if factor != 1.0:
      keys['rope_scaling'] = {'rope_type': 'linear', 'factor': factor}
    return keys
  if local > 0 and local != theta:
    raise CheckpointError(f'decoder_block={block} with local_rope_max_timescale={local}: a '
                          'separate local rotary base is read for gemma3 only.')
  if factor != 1.0:
    raise CheckpointError('rope_linear_scaling_factor other than 1: read for gemma3 only.')
  return {}

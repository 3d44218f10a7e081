"""Gemma 4 (text): Gemma 3's sandwich-normed block with wider global layers, value norms,
layer scalars and, in the MoE variant, experts beside the dense MLP.

What it changes in Gemma 3, all expressed as :class:`ModelConfig` fields:

* norms multiply by ``w`` (not ``1 + w``), queries are not scaled
  (``attention.query_scale=1``: the q/k norms fix their size), and values are normalised
  too, without a weight (``attention.value_norm``);
* the full-attention layers have their own shapes (``attention.global_layers``): heads of
  ``global_head_dim``, fewer key/value heads and, with ``attention_k_eq_v``, no
  value projection (the values are the un-normed keys); their rotary embedding is
  ``proportional`` (a quarter of the frequency pairs of a full-width rotation turn);
* each block's output is multiplied by a learned ``layer_scalar`` (``layer_scale``);
* the MoE variant (``enable_moe_block``) keeps every layer's dense MLP and adds 128
  experts beside it (``moe.dense_branch``), routed from the residual stream through
  a weightless RMS norm with a learned scale (``moe.router_input_norm``), softmax
  top-k renormalised, then scaled per expert (``moe.per_expert_scale``);
* the small E2B/E4B models give every layer its own per-token input
  (``per_layer_input_dim``, :mod:`maxnnx.layers.per_layer_inputs`) and let their last
  layers attend with the keys and values of earlier ones (``num_kv_shared_layers``;
  E2B doubles those layers' MLP, ``kv_shared_mlp_dim``).

Checkpoint layout beyond Gemma 3: ``self_attn.v_proj`` is absent in full layers with
``attention_k_eq_v``; per layer ``layer_scalar`` ``[1]``; MoE layers hold
``router.{proj.weight, scale, per_expert_scale}``, ``experts.gate_up_proj``
``[experts, 2 * moe_intermediate, hidden]`` (gate rows first), ``experts.down_proj``
``[experts, hidden, moe_intermediate]`` and the norms ``post_feedforward_layernorm_1``,
``pre_feedforward_layernorm_2``, ``post_feedforward_layernorm_2``; with per-layer inputs,
``embed_tokens_per_layer``, ``per_layer_model_projection`` and ``per_layer_projection_norm``
in the model and ``per_layer_input_gate``, ``per_layer_projection`` and
``post_per_layer_input_norm`` in every layer; the KV-sharing layers have no ``k_proj``,
``v_proj``, ``k_norm`` (or ``v_norm``).

Not supported (refused with an error naming the key): bidirectional attention (the
vision variant's ``use_bidirectional_attention``).
"""

import numpy as np

from maxnnx.config import GlobalAttentionConfig, ModelConfig, MoEConfig
from maxnnx.models import gemma
from maxnnx.models.gemma import gemma_fields, gemma_to_hf
from maxnnx.models.gemma2 import SANDWICH_NORM_NAMES
from maxnnx.models.hf import (
  Family,
  HFConfig,
  PretrainedError,
  TensorDict,
  layer_types_to_hf,
  rope_to_hf,
)
from maxnnx.models.registry import FamilySpec, merge

GLOBAL_EVERY = 6  # transformers' default layer pattern: 5 sliding layers, then a full one
# How the MoE variant routes (set in dense models too, where it changes nothing).
MOE_STYLE = {'router_input_norm': True, 'per_expert_scale': True, 'dense_branch': True}

# -- Hugging Face mapping ----------------------------------------------------------------------


def _layer_types(hf: HFConfig) -> tuple:
  """``layer_types``, else 5 sliding : 1 full; the last layer is always full (as transformers
  forces it)."""
  num_layers = hf.require('num_hidden_layers')
  types = list(hf.layer_types() or ('sliding' if (i + 1) % GLOBAL_EVERY else 'full'
                                     for i in range(num_layers)))
  types[-1] = 'full'
  return tuple(types)


def _global_attention(hf: HFConfig, layer_types: tuple) -> GlobalAttentionConfig:
  """The full layers' shapes, from ``per_layer_config`` (transformers >= 5.2 saves) or
  ``global_head_dim`` / ``num_global_key_value_heads`` (the Hub releases)."""
  values_from_keys = bool(hf.get('attention_k_eq_v', False))
  per_layer = hf.data.get('per_layer_config')
  if per_layer:
    full = {i for i, t in enumerate(layer_types) if t == 'full'}
    overrides = {int(k): v for k, v in per_layer.items()}
    shapes = {tuple(sorted(v.items())) for k, v in overrides.items() if k in full}
    if set(overrides) != full or len(shapes) != 1:
      raise PretrainedError(f'{hf.path}: per_layer_config must give every full-attention '
                            f'layer ({sorted(full)}) the same overrides and no other layer '
                            f'any; got {per_layer}.')
    unknown = set(overrides[min(full)]) - {'head_dim', 'num_key_value_heads'}
    if unknown:
      raise PretrainedError(f'{hf.path}: per_layer_config overrides {sorted(unknown)} are not '
                            'supported (only head_dim and num_key_value_heads).')
    head_dim = overrides[min(full)].get('head_dim')
    kv_heads = overrides[min(full)].get('num_key_value_heads')
  else:
    head_dim = hf.get('global_head_dim', 512)
    kv_heads = hf.get('num_global_key_value_heads') if values_from_keys else None
  return GlobalAttentionConfig(head_dim=head_dim, num_kv_heads=kv_heads,
                               values_from_keys=values_from_keys)


def _refuse_unsupported(hf: HFConfig) -> None:
  value = hf.get('use_bidirectional_attention')
  if value is not None:
    raise PretrainedError(
        f"{hf.path}: use_bidirectional_attention={value!r} is not supported by maxnnx's "
        'gemma4 family (the vision model attends bidirectionally over images); the text '
        'models load.')


def _layer_sharing(hf: HFConfig, mlp_dim: int, vocab_size: int) -> dict:
  """Per-layer inputs and key/value sharing (the E2B/E4B models)."""
  shared = hf.get('num_kv_shared_layers', 0) or 0
  ple_vocab = hf.get('vocab_size_per_layer_input', vocab_size)
  return dict(per_layer_input_dim=hf.get('hidden_size_per_layer_input', 0) or 0,
              per_layer_input_vocab_size=None if ple_vocab == vocab_size else ple_vocab,
              num_kv_shared_layers=shared,
              kv_shared_mlp_dim=2 * mlp_dim if shared and hf.get('use_double_wide_mlp')
              else None)


def config_from_hf(hf: HFConfig) -> ModelConfig:
  _refuse_unsupported(hf)
  fields = gemma_fields(hf)
  layer_types = _layer_types(hf)
  fields.update(norm_scale_offset=0.0, rope=hf.rope('full_attention'),
                local_rope=hf.rope('sliding_attention'))
  moe = MoEConfig(**MOE_STYLE)
  if hf.get('enable_moe_block', False):
    moe = moe.replace(num_experts=hf.require('num_experts'),
                      num_experts_per_tok=hf.require('top_k_experts'),
                      mlp_dim=hf.require('moe_intermediate_size'))
  attention = {'qk_norm': 'head', 'query_scale': 1.0, 'value_norm': True,
               'sliding_window': hf.require('sliding_window'),
               'global_layers': _global_attention(hf, layer_types)}
  return ModelConfig(
      family='gemma4', **merge(fields, {'attention': attention}), post_norm=True,
      layer_scale=True, final_logit_softcap=hf.get('final_logit_softcapping'),
      layer_types=layer_types, moe=moe,
      **_layer_sharing(hf, fields['mlp_dim'], fields['vocab_size']))


def _check_convertible(cfg: ModelConfig) -> None:
  """What the transformers Gemma 4 text classes cannot express."""
  moe, g = cfg.moe, cfg.attention.global_layers
  gemma4_moe = (moe.dense_branch and moe.router_input_norm and moe.per_expert_scale
                and moe.router_score == 'softmax' and moe.router_norm_topk
                and moe.first_k_dense_layers == 0 and moe.layer_step == 1
                and not moe.num_shared_experts and moe.router_scaling_factor == 1.0
                and moe.router_groups == 1 and not moe.router_score_bias
                and not moe.router_bias and not moe.expert_bias)
  problems = [name for name, ok in (
      ('norm_scale_offset=0 (norms multiply by w)', cfg.norm_scale_offset == 0.0),
      ('pre_norm and post_norm', cfg.pre_norm and cfg.post_norm),
      ("attention.qk_norm='head', attention.value_norm and layer_scale",
       cfg.attention.qk_norm == 'head' and cfg.attention.value_norm and cfg.layer_scale),
      ('attention.query_scale=1', cfg.resolved_query_scale == 1.0),
      ('no attention logit soft-cap', cfg.attention.logit_softcap is None),
      ('sliding and full layers, the last one full',
       set(cfg.resolved_layer_types) <= {'sliding', 'full'}
       and cfg.resolved_layer_types[-1] == 'full'),
      ('attention.global_layers.num_kv_heads only with values_from_keys',
       g.values_from_keys or g.num_kv_heads in (None, cfg.num_kv_heads)),
      ('kv_shared_mlp_dim of mlp_dim or twice it',
       cfg.kv_shared_mlp_dim in (None, cfg.mlp_dim, 2 * cfg.mlp_dim)),
      ('a Gemma 4 MoE (dense branch, normed router input, per-expert scales, softmax top-k '
       'renormalised, in every layer)', not moe.num_experts or gemma4_moe)) if not ok]
  if problems:
    raise PretrainedError(f'A gemma4 model needs {"; ".join(problems)}.')


def config_to_hf(cfg: ModelConfig) -> dict:
  _check_convertible(cfg)
  head_dim, kv_heads, values_from_keys = cfg.attention_shape('full')
  out = {**gemma_to_hf(cfg, 'gemma4_text', 'Gemma4ForCausalLM'),
         'final_logit_softcapping': cfg.final_logit_softcap,
         'sliding_window': cfg.attention.sliding_window, 'layer_types': layer_types_to_hf(cfg),
         'rope_parameters': {'full_attention': rope_to_hf(cfg.rope),
                             'sliding_attention': rope_to_hf(cfg.local_rope or cfg.rope)},
         'global_head_dim': head_dim, 'attention_k_eq_v': values_from_keys,
         'hidden_size_per_layer_input': cfg.per_layer_input_dim,
         'vocab_size_per_layer_input': cfg.per_layer_input_vocab_size or cfg.vocab_size,
         'num_kv_shared_layers': cfg.num_kv_shared_layers,
         'use_double_wide_mlp': cfg.kv_shared_mlp_dim == 2 * cfg.mlp_dim,
         'enable_moe_block': cfg.moe.num_experts > 0}
  if values_from_keys:
    out['num_global_key_value_heads'] = kv_heads
  if cfg.moe.num_experts:
    out.update(num_experts=cfg.moe.num_experts, top_k_experts=cfg.moe.num_experts_per_tok,
               moe_intermediate_size=cfg.resolved_moe_mlp_dim)
  return out


# Our names inside a MoE layer -> the checkpoint's (one per tensor, layer prefix apart).
_MOE_RENAMES = {'moe.router.weight': 'router.proj.weight', 'moe.router.input_scale': 'router.scale',
                'moe.router.expert_scale': 'router.per_expert_scale',
                'moe.experts.down_proj': 'experts.down_proj'}


def _expert_layers(cfg: ModelConfig) -> list[tuple[str, tuple[int, int, int]]]:
  """``(tensor prefix, (experts, d_model, expert width))`` of every layer; none without
  experts."""
  if not cfg.moe.num_experts:
    return []
  shape = (cfg.moe.num_experts, cfg.d_model, cfg.resolved_moe_mlp_dim)
  return [(f'model.layers.{i}', shape) for i in range(cfg.num_layers)]


def unfuse(tensors: TensorDict, cfg: ModelConfig) -> TensorDict:
  """Checkpoint MoE tensors -> ours: renames, ``gate_up_proj`` ``[E, 2F, D]`` split into
  ``gate_proj`` / ``up_proj`` ``[E, D, F]``, ``down_proj`` ``[E, D, F]`` -> ``[E, F, D]``."""
  out = dict(tensors)
  for prefix, (e, d, f) in _expert_layers(cfg):
    for ours, theirs in _MOE_RENAMES.items():
      if f'{prefix}.{theirs}' in out:
        out[f'{prefix}.{ours}'] = out.pop(f'{prefix}.{theirs}')
    key = f'{prefix}.experts.gate_up_proj'
    if key in out:
      source, array = out.pop(key)
      if array.shape != (e, 2 * f, d):
        raise PretrainedError(f"{source}: tensor '{key}' has shape {array.shape}, the config "
                              f'implies {(e, 2 * f, d)} (experts, 2 * intermediate, hidden).')
      array = np.asarray(array).transpose(0, 2, 1)
      out[f'{prefix}.moe.experts.gate_proj'] = (source, array[..., :f])
      out[f'{prefix}.moe.experts.up_proj'] = (source, array[..., f:])
    down = f'{prefix}.moe.experts.down_proj'
    if down in out:
      source, array = out[down]
      out[down] = (source, np.asarray(array).reshape(e, d, f).transpose(0, 2, 1))
  return out


def fuse(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Inverse of :func:`unfuse` for export (the exporter writes stacked tensors flat)."""
  out = dict(tensors)
  for prefix, (e, d, f) in _expert_layers(cfg):
    if f'{prefix}.moe.experts.gate_proj' not in out:  # a layer another process writes
      continue
    gate = out.pop(f'{prefix}.moe.experts.gate_proj').reshape(e, d, f)
    up = out.pop(f'{prefix}.moe.experts.up_proj').reshape(e, d, f)
    out[f'{prefix}.experts.gate_up_proj'] = np.concatenate([gate, up], -1).transpose(0, 2, 1)
    down = out.pop(f'{prefix}.moe.experts.down_proj').reshape(e, f, d)
    out[f'{prefix}.moe.experts.down_proj'] = down.transpose(0, 2, 1)
    for ours, theirs in _MOE_RENAMES.items():
      out[f'{prefix}.{theirs}'] = np.ascontiguousarray(out.pop(f'{prefix}.{ours}'))
  return out


# -- Presets -----------------------------------------------------------------------------------


def _gemma4(d_model: int, num_layers: int, num_heads: int, num_kv_heads: int, mlp_dim: int,
            global_layers: dict, global_every: int = GLOBAL_EVERY, sliding_window: int = 1024,
            context: int = 262_144, **fields) -> ModelConfig:
  """A Gemma 4 config: heads of 256 (512 in the global layers), ``global_every - 1``
  sliding layers per global one (the last layer global)."""
  layer_types = tuple('full' if (i + 1) % global_every == 0 else 'sliding'
                      for i in range(num_layers))
  return SPEC.config(vocab_size=262_144, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=256,
                     mlp_dim=mlp_dim, max_position_embeddings=context,
                     layer_types=layer_types,
                     attention={'sliding_window': sliding_window,
                                'global_layers': {'head_dim': 512, **global_layers}},
                     bos_token_id=2, eos_token_id=1, pad_token_id=0, **fields)


def gemma4_31b() -> ModelConfig:
  """Gemma 4 31B (dense; the text model): 30.7B parameters."""
  return _gemma4(5376, 60, 32, 16, 21_504, {'num_kv_heads': 4, 'values_from_keys': True})


def gemma4_26b_a4b() -> ModelConfig:
  """Gemma 4 26B-A4B (text): 25.2B parameters, 3.8B active: 128 experts (top 8) beside
  every layer's dense MLP."""
  return _gemma4(2816, 30, 16, 8, 2112, {'num_kv_heads': 2, 'values_from_keys': True},
                 moe={'num_experts': 128, 'num_experts_per_tok': 8, 'mlp_dim': 704})


def _gemma4_small(d_model: int, num_layers: int, num_kv_heads: int, mlp_dim: int,
                  global_every: int, num_kv_shared_layers: int,
                  kv_shared_mlp_dim: int | None) -> ModelConfig:
  """Gemma 4 E2B/E4B (text): 8 heads, window 512, 128k context, per-layer inputs of 256,
  the last layers sharing keys and values; their global layers keep a value projection."""
  return _gemma4(d_model, num_layers, 8, num_kv_heads, mlp_dim, {}, global_every, 512, 131_072,
                 per_layer_input_dim=256, num_kv_shared_layers=num_kv_shared_layers,
                 kv_shared_mlp_dim=kv_shared_mlp_dim)


def gemma4_e2b() -> ModelConfig:
  """Gemma 4 E2B (text): 35 layers (4 sliding : 1 global), the last 20 reusing keys and
  values with doubled MLPs: 4.63B parameters, 1.88B outside the two embedding tables (the
  card's 5.1B / 2.3B "effective" add the vision and audio encoders)."""
  return _gemma4_small(1536, 35, 1, 6144, 5, 20, 12_288)


def gemma4_e4b() -> ModelConfig:
  """Gemma 4 E4B (text): 42 layers (5 sliding : 1 global), the last 18 reusing keys and
  values: 7.46B parameters, 3.97B outside the two embedding tables (the card's 8B / 4.5B
  add the vision and audio encoders)."""
  return _gemma4_small(2560, 42, 2, 10_240, 6, 18, None)


def tiny_gemma4() -> ModelConfig:
  """A tiny Gemma 4 MoE (wide global layers whose values are their keys, experts beside
  the MLP; 4 layers, window 8) for tests and tutorials."""
  return SPEC.config(vocab_size=512, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=32, mlp_dim=128, max_position_embeddings=512,
                     layer_types=('sliding', 'full', 'sliding', 'full'),
                     attention={'sliding_window': 8, 'global_layers': {
                         'head_dim': 64, 'num_kv_heads': 1, 'values_from_keys': True}},
                     moe={'num_experts': 4, 'num_experts_per_tok': 2, 'mlp_dim': 64})


SPEC = FamilySpec(
    name='gemma4',
    description='Gemma 3 with `w` norms, unscaled queries, value norms, learned layer '
                'scalars and wider global layers (whose values are their keys in 31B and '
                '26B-A4B); the MoE variant adds routed experts beside the dense MLP, the '
                'E2B/E4B models per-layer inputs and keys/values shared across layers.',
    hf=Family('gemma4', ('gemma4_text',), 'Gemma4ForCausalLM', config_from_hf, config_to_hf,
              defaults={**gemma.GEMMA_DEFAULTS, 'sliding_window': 512,
                        'max_position_embeddings': 131_072, 'final_logit_softcapping': None,
                        'hidden_size_per_layer_input': 256},
              module_names={**SANDWICH_NORM_NAMES,
                            'dense_post_norm': 'post_feedforward_layernorm_1',
                            'moe_pre_norm': 'pre_feedforward_layernorm_2',
                            'moe_post_norm': 'post_feedforward_layernorm_2',
                            'per_layer_inputs': 'model', 'per_layer_input': ''},
              unfuse=unfuse, fuse=fuse),
    # Gemma's differences but its `1 + w` norms (Gemma 4 multiplies by w, Llama's default).
    differences={**{k: v for k, v in gemma.DIFFERENCES.items() if k != 'norm_scale_offset'},
                 'post_norm': True,
                 'attention': {'qk_norm': 'head', 'query_scale': 1.0, 'value_norm': True},
                 'layer_scale': True, 'final_logit_softcap': 30.0,
                 'rope': {'theta': 1_000_000.0, 'scaling': 'proportional',
                          'partial_rotary_factor': 0.25},
                 'local_rope': {'theta': 10_000.0},
                 'moe': MOE_STYLE},
    presets={'gemma4-31b': gemma4_31b, 'gemma4-26b-a4b': gemma4_26b_a4b,
             'gemma4-e2b': gemma4_e2b, 'gemma4-e4b': gemma4_e4b, 'tiny-gemma4': tiny_gemma4},
    chat_template='gemma')

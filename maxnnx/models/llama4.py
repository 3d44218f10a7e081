"""Llama 4 (text): Llama with chunked local attention, NoPE layers and top-1 sigmoid experts.

What it changes in Llama, all expressed as :class:`ModelConfig` fields:

* three of every four layers are ``chunked`` (a query sees only the keys of its own
  chunk of ``attention_chunk_size`` positions) and rotate q/k; the fourth attends
  fully with no rotary embedding (``nope_layers``) and multiplies its queries by a
  position-dependent temperature (``attn_temperature_tuning``);
* rotary pairs are adjacent dims (``rope_interleave``); Scout's q/k get an L2 norm
  without weights in the rotary layers (``qk_norm='l2'``);
* feed-forward blocks are MoE layers (all of them in Scout, every second one in
  Maverick; the others are dense MLPs of width ``intermediate_size_mlp``): top-1
  of the routed experts by a sigmoid of the router logit, which scales the
  expert's *input* (``router_weights_on_input``), plus one shared expert.

Checkpoint layout: per MoE layer, ``feed_forward.experts.gate_up_proj``
``[experts, hidden, 2 * intermediate]`` (gate, then up, on the last axis),
``feed_forward.experts.down_proj`` ``[experts, intermediate, hidden]``,
``feed_forward.router.weight`` and ``feed_forward.shared_expert.{gate,up,down}_proj``.
The multimodal ``llama4`` checkpoints (with a vision tower) are not loaded here.
"""

import numpy as np

from maxnnx.config import ModelConfig, MoEConfig, RopeConfig
from maxnnx.models.hf import (
  Family,
  HFConfig,
  PretrainedError,
  TensorDict,
  common_to_hf,
  layer_types_to_hf,
)
from maxnnx.models.moe_hf import moe_layout
from maxnnx.models.registry import FamilySpec

NOPE_EVERY = 4  # transformers' no_rope_layer_interval default


def config_from_hf(hf: HFConfig) -> ModelConfig:
  num_layers = hf.require('num_hidden_layers')
  uses_rope = hf.get('no_rope_layers') or [
      int((i + 1) % hf.get('no_rope_layer_interval', NOPE_EVERY) != 0) for i in range(num_layers)]
  if len(uses_rope) < num_layers:
    raise PretrainedError(f'{hf.path}: no_rope_layers has {len(uses_rope)} entries for '
                          f'{num_layers} layers.')
  chunk = hf.get('attention_chunk_size')
  layer_types = hf.layer_types() or tuple(
      'chunked' if rope else 'full' for rope in uses_rope[:num_layers])
  if chunk is None:  # transformers then attends fully in every layer
    layer_types = ('full',) * num_layers
  step = hf.get('interleave_moe_layer_step', 1)
  moe_layers = hf.get('moe_layers')
  moe_layers = set(range(step - 1, num_layers, step) if moe_layers is None else moe_layers)
  is_moe = [i in moe_layers for i in range(num_layers)]
  fields = hf.common_fields()
  fields['mlp_dim'] = hf.get('intermediate_size_mlp', 16_384)
  bias = bool(hf.get('attention_bias', False))
  return ModelConfig(
      family='llama4', **fields, qkv_bias=bias, out_bias=bias, rope_interleave=True,
      qk_norm='l2' if hf.get('use_qk_norm', True) else 'none',
      attention_chunk_size=chunk, layer_types=layer_types,
      nope_layers=tuple(i for i in range(num_layers) if not uses_rope[i]),
      attn_temperature_tuning=bool(hf.get('attn_temperature_tuning', True)),
      attn_temperature_floor=float(hf.get('floor_scale', 8192)),
      attn_temperature_scale=float(hf.get('attn_scale', 0.1)),
      moe=MoEConfig(num_experts=hf.get('num_local_experts', 16) if any(is_moe) else 0,
                    num_experts_per_tok=hf.get('num_experts_per_tok', 1),
                    mlp_dim=hf.require('intermediate_size'), num_shared_experts=1,
                    router_score='sigmoid', router_norm_topk=False,
                    router_weights_on_input=True, **moe_layout(is_moe, hf.path)))


def _check_convertible(cfg: ModelConfig) -> None:
  """What the transformers Llama 4 classes cannot express."""
  moe = cfg.moe
  problems = [name for name, ok in (
      ('rope_interleave=True', cfg.rope_interleave),
      ("qk_norm 'l2' or 'none'", cfg.qk_norm in ('l2', 'none')),
      ('qkv_bias == out_bias', cfg.qkv_bias == cfg.out_bias),
      ("full or chunked layers", set(cfg.resolved_layer_types) <= {'full', 'chunked'}),
      ('one shared expert, sigmoid routing weights on the expert inputs, not renormalised',
       not moe.num_experts or (moe.num_shared_experts == 1 and moe.router_score == 'sigmoid'
                               and moe.router_weights_on_input and not moe.router_norm_topk
                               and moe.router_scaling_factor == 1.0 and moe.router_groups == 1
                               and not moe.router_score_bias and not moe.router_bias
                               and not moe.expert_bias and moe.swiglu_limit is None))) if not ok]
  if problems:
    raise PretrainedError(f'A llama4 model needs {"; ".join(problems)}.')


def config_to_hf(cfg: ModelConfig) -> dict:
  _check_convertible(cfg)
  uses_rope = [int(i not in cfg.nope_layers) for i in range(cfg.num_layers)]
  floor = cfg.attn_temperature_floor
  return {**common_to_hf(cfg, 'llama4_text', 'Llama4ForCausalLM'),
          'intermediate_size': cfg.resolved_moe_mlp_dim, 'intermediate_size_mlp': cfg.mlp_dim,
          'num_local_experts': max(cfg.moe.num_experts, 1),
          'num_experts_per_tok': cfg.moe.num_experts_per_tok,
          'moe_layers': [i for i, m in enumerate(cfg.moe_layers) if m],
          'no_rope_layers': uses_rope, 'layer_types': layer_types_to_hf(cfg),
          'attention_chunk_size': cfg.attention_chunk_size,
          'use_qk_norm': cfg.qk_norm == 'l2', 'attention_bias': cfg.qkv_bias,
          'attn_temperature_tuning': cfg.attn_temperature_tuning,
          'floor_scale': int(floor) if float(floor).is_integer() else floor,
          'attn_scale': cfg.attn_temperature_scale,
          'router_aux_loss_coef': 0.001}  # a training setting (TrainConfig): HF's default


def _moe_layers(cfg: ModelConfig) -> list[int]:
  return [i for i, m in enumerate(cfg.moe_layers) if m]


def unfuse(tensors: TensorDict, cfg: ModelConfig) -> TensorDict:
  """Split each MoE layer's ``gate_up_proj`` ``[E, D, 2F]`` into our gate and up halves."""
  out = dict(tensors)
  e, d, f = cfg.moe.num_experts, cfg.d_model, cfg.resolved_moe_mlp_dim
  for i in _moe_layers(cfg):
    key = f'model.layers.{i}.feed_forward.experts.gate_up_proj'
    if key not in out:
      continue  # the loader then reports the split names as missing
    source, array = out.pop(key)
    if array.shape != (e, d, 2 * f):
      raise PretrainedError(f"{source}: tensor '{key}' has shape {array.shape}, the config "
                            f'implies {(e, d, 2 * f)} (experts, hidden, 2 * intermediate).')
    array = np.asarray(array)
    prefix = key.rsplit('.', 1)[0]
    out[f'{prefix}.gate_proj'] = (source, array[..., :f])
    out[f'{prefix}.up_proj'] = (source, array[..., f:])
  return out


def fuse(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Inverse of :func:`unfuse` for export (the exporter writes stacked tensors flat)."""
  out = dict(tensors)
  e, d, f = cfg.moe.num_experts, cfg.d_model, cfg.resolved_moe_mlp_dim
  for i in _moe_layers(cfg):
    prefix = f'model.layers.{i}.feed_forward.experts'
    if f'{prefix}.gate_proj' not in out:  # a layer another process writes
      continue
    gate = out.pop(f'{prefix}.gate_proj').reshape(e, d, f)
    up = out.pop(f'{prefix}.up_proj').reshape(e, d, f)
    out[f'{prefix}.gate_up_proj'] = np.concatenate([gate, up], axis=-1)
    out[f'{prefix}.down_proj'] = out[f'{prefix}.down_proj'].reshape(e, f, d)
  return out


# -- Presets -----------------------------------------------------------------------------------

# 8k pre-training context stretched 16x with band-wise rope scaling (Scout).
SCOUT_ROPE = RopeConfig(theta=500_000.0, scaling='llama3', factor=16.0, low_freq_factor=1.0,
                        high_freq_factor=1.0, original_max_position_embeddings=8192)


def _llama4(num_experts: int, moe_every: int, max_position_embeddings: int, rope: RopeConfig,
            qk_norm: str) -> ModelConfig:
  num_layers = 48
  return SPEC.config(
      vocab_size=202_048, d_model=5120, num_layers=num_layers, num_heads=40, num_kv_heads=8,
      mlp_dim=16_384, max_position_embeddings=max_position_embeddings,
      norm_eps=1e-5, rope=rope, qk_norm=qk_norm, attention_chunk_size=8192,
      layer_types=tuple('full' if (i + 1) % NOPE_EVERY == 0 else 'chunked'
                        for i in range(num_layers)),
      nope_layers=tuple(i for i in range(num_layers) if (i + 1) % NOPE_EVERY == 0),
      moe={'num_experts': num_experts, 'mlp_dim': 8192, 'first_k_dense_layers': moe_every - 1,
           'layer_step': moe_every},
      bos_token_id=200_000, eos_token_id=(200_001, 200_007, 200_008), pad_token_id=200_018)


def llama4_scout_17b_16e() -> ModelConfig:
  """Llama 4 Scout 17B-16E (text): 107.8B parameters, 17.2B active (16 experts, top-1,
  in every layer); the multimodal release adds a 0.9B vision tower (109B in all)."""
  return _llama4(16, 1, 10_485_760, SCOUT_ROPE, 'l2')


def llama4_maverick_17b_128e() -> ModelConfig:
  """Llama 4 Maverick 17B-128E (text): 400B parameters, 17B active (128 experts, top-1,
  in every second layer; no q/k norm, unscaled rope)."""
  return _llama4(128, 2, 1_048_576, RopeConfig(theta=500_000.0), 'none')


def tiny_llama4() -> ModelConfig:
  """A tiny Llama 4 (every mechanism, 4 layers, chunks of 8) for tests and tutorials on a CPU."""
  return SPEC.config(vocab_size=512, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=32, mlp_dim=256, max_position_embeddings=512, norm_eps=1e-5,
                     attention_chunk_size=8, qk_norm='l2',
                     layer_types=('chunked', 'chunked', 'chunked', 'full'), nope_layers=(3,),
                     attn_temperature_floor=4.0,
                     moe={'num_experts': 4, 'mlp_dim': 128, 'first_k_dense_layers': 1,
                          'layer_step': 2})


SPEC = FamilySpec(
    name='llama4',
    description='Llama with chunked local attention in 3 of 4 layers, NoPE full-attention '
                'layers with temperature tuning, interleaved rotary pairs, L2 q/k norms '
                '(Scout) and top-1 sigmoid experts plus a shared expert.',
    hf=Family('llama4', ('llama4_text',), 'Llama4ForCausalLM', config_from_hf, config_to_hf,
              defaults={'rms_norm_eps': 1e-5, 'max_position_embeddings': 131_072,
                        'rope_theta': 500_000.0, 'num_key_value_heads': 8, 'head_dim': 128},
              module_names={'mlp': 'feed_forward', 'shared_experts': 'shared_expert'},
              unfuse=unfuse, fuse=fuse),
    differences={'rope_interleave': True, 'attn_temperature_tuning': True,
                 'rope': {'theta': 500_000.0},
                 'moe': {'num_experts_per_tok': 1, 'num_shared_experts': 1,
                         'router_score': 'sigmoid', 'router_norm_topk': False,
                         'router_weights_on_input': True}},
    presets={'llama4-17b-16e': llama4_scout_17b_16e, 'llama4-17b-128e': llama4_maverick_17b_128e,
             'tiny-llama4': tiny_llama4})

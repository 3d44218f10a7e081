"""Llama 4 (text): Llama with chunked local attention, NoPE layers and top-1 sigmoid experts.

What it changes in Llama, all expressed as :class:`ModelConfig` fields:

* three of every four layers are ``chunked`` (a query sees only the keys of its own
  chunk of ``attention.chunk_size`` positions) and rotate q/k; the fourth attends
  fully with no rotary embedding (``attention.nope_layers``) and multiplies its queries
  by a position-dependent temperature (``attention.temperature_tuning``);
* rotary pairs are adjacent dims (``rope_interleave``); Scout's q/k get an L2 norm
  without weights in the rotary layers (``attention.qk_norm='l2'``);
* feed-forward blocks are MoE layers (all of them in Scout, every second one in
  Maverick; the others are dense MLPs of width ``intermediate_size_mlp``): top-1
  of the routed experts by a sigmoid of the router logit, which scales the
  expert's *input* (``router_weights_on_input``), plus one shared expert.

Checkpoint layout: per MoE layer, ``feed_forward.experts.gate_up_proj``
``[experts, hidden, 2 * intermediate]`` (gate, then up, on the last axis),
``feed_forward.experts.down_proj`` ``[experts, intermediate, hidden]``,
``feed_forward.router.weight`` and ``feed_forward.shared_expert.{gate,up,down}_proj``.

Multimodal checkpoints (``model_type: llama4``, ``Llama4ForConditionalGeneration``) nest
``text_config`` and ``vision_config`` and hold ``language_model.*``, ``vision_model.*`` and
``multi_modal_projector.*``: the tower is the shared ViT (:mod:`maxnnx.layers.vision`)
with no patch bias, a class token after the patches, a LayerNorm before the blocks and 2-D
rotary embeddings; the pixel-shuffle projector folds 2x2 patches into one token per
``<|patch|>`` placeholder, whose tokens attend causally like text. Images are tiles of
``image_size`` pixels (the processor's tiling plus one global tile).
"""

import os
import re

import numpy as np

from maxnnx.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig, VisionConfig
from maxnnx.data.images import TiledImageProcessor, TiledImagePrompt
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
  cfg = _text_config_from_hf(hf.text_config())  # flat (llama4_text) or nested
  vision = hf.data.get('vision_config')
  if not vision:
    return cfg
  return cfg.replace(vision=_vision_from_hf(HFConfig(vision, f'{hf.path} (vision_config)'), hf))


def _vision_from_hf(v: HFConfig, top: HFConfig) -> VisionConfig:
  hidden, ratio = v.require('hidden_size'), float(v.get('pixel_shuffle_ratio', 0.5))
  side = v.require('image_size') // v.require('patch_size')
  fold = round(1 / ratio)
  dims = {k: v.require(k) for k in ('projector_input_dim', 'projector_output_dim',
                                     'vision_output_dim')}
  if len(set(dims.values())) != 1:
    raise PretrainedError(f'{v.path}: projector_input_dim, projector_output_dim and '
                          f'vision_output_dim must be equal (the adapter is square), got {dims}.')
  if v.require('intermediate_size') != hidden * fold * fold:
    raise PretrainedError(f'{v.path}: intermediate_size ({v.require("intermediate_size")}) '
                          f'must be hidden_size / pixel_shuffle_ratio**2 = {hidden * fold**2}.')
  rope = v.get('rope_parameters') or {}
  return VisionConfig(
      num_layers=v.require('num_hidden_layers'), hidden_size=hidden,
      intermediate_size=v.require('intermediate_size'),
      num_heads=v.require('num_attention_heads'), image_size=v.require('image_size'),
      patch_size=v.require('patch_size'), num_channels=v.get('num_channels', 3),
      norm_eps=1e-5, activation='gelu', tokens_per_image=(side // fold)**2,
      image_token_id=top.data.get('image_token_index', top.data.get('image_token_id', 200_092)),
      patch_bias=False, class_token=True, pre_norm=True,
      rope_theta=float(rope.get('rope_theta', v.get('rope_theta', 10_000.0))),
      projector='pixel_shuffle', pixel_shuffle_ratio=ratio,
      adapter_dim=dims['projector_output_dim'], bidirectional=False)


def _text_config_from_hf(hf: HFConfig) -> ModelConfig:
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
      family='llama4', **fields, rope_interleave=True, layer_types=layer_types,
      attention=AttentionConfig(
          qkv_bias=bias, out_bias=bias, qk_norm='l2' if hf.get('use_qk_norm', True) else 'none',
          chunk_size=chunk, nope_layers=tuple(i for i in range(num_layers) if not uses_rope[i]),
          temperature_tuning=bool(hf.get('attn_temperature_tuning', True)),
          temperature_floor=float(hf.get('floor_scale', 8192)),
          temperature_scale=float(hf.get('attn_scale', 0.1))),
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
      ("attention.qk_norm 'l2' or 'none'", cfg.attention.qk_norm in ('l2', 'none')),
      ('attention.qkv_bias == attention.out_bias',
       cfg.attention.qkv_bias == cfg.attention.out_bias),
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
  text = _text_config_to_hf(cfg)
  v = cfg.vision
  if not v.num_layers:
    return text
  if (v.projector, v.class_token, v.pre_norm, v.patch_bias, v.bidirectional) != (
      'pixel_shuffle', True, True, False, False) or v.rope_theta is None:
    raise PretrainedError('A llama4 vision tower is a pixel-shuffle ViT with a class token, a '
                          'LayerNorm before the blocks, no patch bias, 2-D rotary embeddings '
                          'and causal image tokens.')
  del text['architectures']
  fold = round(1 / v.pixel_shuffle_ratio)
  vision = {'model_type': 'llama4_vision_model', 'hidden_size': v.hidden_size,
            'intermediate_size': v.hidden_size * fold * fold, 'num_hidden_layers': v.num_layers,
            'num_attention_heads': v.num_heads, 'image_size': v.image_size,
            'patch_size': v.patch_size, 'num_channels': v.num_channels,
            'pixel_shuffle_ratio': v.pixel_shuffle_ratio, 'hidden_act': 'gelu',
            'norm_eps': v.norm_eps, 'projector_input_dim': v.adapter_dim,
            'projector_output_dim': v.adapter_dim, 'vision_output_dim': v.adapter_dim,
            'multi_modal_projector_bias': False,
            'rope_parameters': {'rope_type': 'default', 'rope_theta': v.rope_theta}}
  return {'architectures': ['Llama4ForConditionalGeneration'], 'model_type': 'llama4',
          'text_config': text, 'vision_config': vision, 'image_token_index': v.image_token_id,
          'tie_word_embeddings': cfg.tie_word_embeddings, 'dtype': text['dtype']}


def _text_config_to_hf(cfg: ModelConfig) -> dict:
  _check_convertible(cfg)
  uses_rope = [int(i not in cfg.attention.nope_layers) for i in range(cfg.num_layers)]
  floor = cfg.attention.temperature_floor
  return {**common_to_hf(cfg, 'llama4_text', 'Llama4ForCausalLM'),
          'intermediate_size': cfg.resolved_moe_mlp_dim, 'intermediate_size_mlp': cfg.mlp_dim,
          'num_local_experts': max(cfg.moe.num_experts, 1),
          'num_experts_per_tok': cfg.moe.num_experts_per_tok,
          'moe_layers': [i for i, m in enumerate(cfg.moe_layers) if m],
          'no_rope_layers': uses_rope, 'layer_types': layer_types_to_hf(cfg),
          'attention_chunk_size': cfg.attention.chunk_size,
          'use_qk_norm': cfg.attention.qk_norm == 'l2', 'attention_bias': cfg.attention.qkv_bias,
          'attn_temperature_tuning': cfg.attention.temperature_tuning,
          'floor_scale': int(floor) if float(floor).is_integer() else floor,
          'attn_scale': cfg.attention.temperature_scale,
          'router_aux_loss_coef': 0.001}  # a training setting (TrainConfig): HF's default


def _moe_layers(cfg: ModelConfig) -> list[int]:
  return [i for i, m in enumerate(cfg.moe_layers) if m]


# The multimodal checkpoint's names -> ours (``Family.hf_name`` of our paths), first match
# wins; ``{i}`` is a layer number.
_MULTIMODAL_NAMES = (
    ('language_model.model.', 'model.'), ('language_model.lm_head.', 'lm_head.'),
    ('vision_model.patch_embedding.linear.', 'vision_tower.embeddings.patch_embedding.'),
    ('vision_model.class_embedding', 'vision_tower.embeddings.class_embedding'),
    ('vision_model.positional_embedding_vlm', 'vision_tower.embeddings.position_embedding.weight'),
    ('vision_model.layernorm_pre.', 'vision_tower.pre_layernorm.'),
    ('vision_model.layernorm_post.', 'vision_tower.post_layernorm.'),
    ('vision_model.model.layers.{i}.input_layernorm.',
     'vision_tower.encoder_layers.{i}.layer_norm1.'),
    ('vision_model.model.layers.{i}.post_attention_layernorm.',
     'vision_tower.encoder_layers.{i}.layer_norm2.'),
    ('vision_model.model.layers.{i}.self_attn.o_proj.',
     'vision_tower.encoder_layers.{i}.self_attn.out_proj.'),
    ('vision_model.model.layers.{i}.self_attn.', 'vision_tower.encoder_layers.{i}.self_attn.'),
    ('vision_model.model.layers.{i}.mlp.', 'vision_tower.encoder_layers.{i}.feed_forward.'),
    ('vision_model.vision_adapter.mlp.fc1.', 'multi_modal_projector.adapter_fc1.'),
    ('vision_model.vision_adapter.mlp.fc2.', 'multi_modal_projector.adapter_fc2.'),
    ('multi_modal_projector.linear_1.', 'multi_modal_projector.linear_1.'),
)


def _renamer(pairs):
  rules = [(re.compile('^' + re.escape(a).replace(r'\{i\}', r'(\d+)')), b) for a, b in pairs]

  def rename(name: str) -> str:
    for pattern, template in rules:
      match = pattern.match(name)
      if match:
        return template.replace('{i}', match.group(1) if match.groups() else '') + name[
            match.end():]
    return name
  return rename


_from_multimodal = _renamer(_MULTIMODAL_NAMES)
_to_multimodal = _renamer([(b, a) for a, b in _MULTIMODAL_NAMES])


def to_peft(name: str, cfg: ModelConfig) -> str:
  """Our name -> the multimodal model's (transformers keeps the checkpoint's names in
  memory)."""
  return _to_multimodal(name) if cfg.vision.num_layers else name


def from_peft(name: str, cfg: ModelConfig) -> str:
  """Inverse of :func:`to_peft`."""
  return _from_multimodal(name) if cfg.vision.num_layers else name


def unfuse(tensors: TensorDict, cfg: ModelConfig) -> TensorDict:
  """Multimodal checkpoints: their names to ours. Then split each MoE layer's
  ``gate_up_proj`` ``[E, D, 2F]`` into our gate and up halves."""
  if cfg.vision.num_layers:
    tensors = {_from_multimodal(name): value for name, value in tensors.items()}
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
    prefix = key.rsplit('.', 1)[0]  # slices stay views (or lazy, for a quantized release)
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
  if cfg.vision.num_layers:
    out = {_to_multimodal(name): array for name, array in out.items()}
  return out


# -- Presets -----------------------------------------------------------------------------------

# 8k pre-training context stretched 16x with band-wise rope scaling (Scout).
SCOUT_ROPE = RopeConfig(theta=500_000.0, scaling='llama3', factor=16.0, low_freq_factor=1.0,
                        high_freq_factor=1.0, original_max_position_embeddings=8192)


# Scout's and Maverick's vision tower: 34 ViT blocks of width 1408 over 336x336 tiles of
# 14x14 patches, pixel-shuffled to 144 tokens per tile (0.88B parameters with the projector).
LLAMA4_VISION = {'num_layers': 34, 'hidden_size': 1408, 'intermediate_size': 5632,
                 'num_heads': 16, 'image_size': 336, 'patch_size': 14, 'norm_eps': 1e-5,
                 'activation': 'gelu', 'tokens_per_image': 144, 'image_token_id': 200_092,
                 'patch_bias': False, 'class_token': True, 'pre_norm': True,
                 'rope_theta': 10_000.0, 'projector': 'pixel_shuffle',
                 'pixel_shuffle_ratio': 0.5, 'adapter_dim': 4096, 'bidirectional': False}


def _llama4(num_experts: int, moe_every: int, max_position_embeddings: int, rope: RopeConfig,
            qk_norm: str) -> ModelConfig:
  num_layers = 48
  return SPEC.config(vision=LLAMA4_VISION,
      vocab_size=202_048, d_model=5120, num_layers=num_layers, num_heads=40, num_kv_heads=8,
      mlp_dim=16_384, max_position_embeddings=max_position_embeddings,
      norm_eps=1e-5, rope=rope,
      layer_types=tuple('full' if (i + 1) % NOPE_EVERY == 0 else 'chunked'
                        for i in range(num_layers)),
      attention={'qk_norm': qk_norm, 'chunk_size': 8192, 'nope_layers': tuple(
          i for i in range(num_layers) if (i + 1) % NOPE_EVERY == 0)},
      moe={'num_experts': num_experts, 'mlp_dim': 8192, 'first_k_dense_layers': moe_every - 1,
           'layer_step': moe_every},
      bos_token_id=200_000, eos_token_id=(200_001, 200_007, 200_008), pad_token_id=200_018)


def llama4_scout_17b_16e() -> ModelConfig:
  """Llama 4 Scout 17B-16E with its vision tower: 108.6B parameters (107.8B text, 17.2B
  active: 16 experts, top-1, in every layer; ``vision={'num_layers': 0}`` for the text
  model alone)."""
  return _llama4(16, 1, 10_485_760, SCOUT_ROPE, 'l2')


def llama4_maverick_17b_128e() -> ModelConfig:
  """Llama 4 Maverick 17B-128E with its vision tower: 401B parameters (400B text, 17B
  active: 128 experts, top-1, in every second layer; no q/k norm, unscaled rope)."""
  return _llama4(128, 2, 1_048_576, RopeConfig(theta=500_000.0), 'none')


def tiny_llama4() -> ModelConfig:
  """A tiny Llama 4 (every mechanism, 4 layers, chunks of 8) for tests and tutorials on a CPU."""
  return SPEC.config(vocab_size=512, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=32, mlp_dim=256, max_position_embeddings=512, norm_eps=1e-5,
                     layer_types=('chunked', 'chunked', 'chunked', 'full'),
                     attention={'chunk_size': 8, 'qk_norm': 'l2', 'nope_layers': (3,),
                                'temperature_floor': 4.0},
                     moe={'num_experts': 4, 'mlp_dim': 128, 'first_k_dense_layers': 1,
                          'layer_step': 2})


def tiny_llama4_vision() -> ModelConfig:
  """:func:`tiny_llama4` with a tiny Llama 4 vision tower: 32x32 tiles of 4x4 patches,
  pixel-shuffled to 16 tokens per tile (placeholder id 511, the last); the MLP is 4x the
  width, as Llama 4 checkpoints require."""
  vision = {**LLAMA4_VISION, 'num_layers': 2, 'hidden_size': 64, 'intermediate_size': 256,
            'num_heads': 4, 'image_size': 32, 'patch_size': 4, 'tokens_per_image': 16,
            'image_token_id': 511, 'adapter_dim': 64}
  return tiny_llama4().replace(vision=VisionConfig(**vision))


def image_inputs(model_config: ModelConfig, tokenizer, directory: str | None = None,
                 pan_and_scan: bool = False) -> tuple[TiledImageProcessor, TiledImagePrompt]:
  """Llama 4's tiled image processor (the checkpoint's ``preprocessor_config.json`` if
  ``directory`` has one, else tiles of the tower's image size) and image prompt
  (:class:`~maxnnx.data.images.TiledImagePrompt`: ``<|image|>`` becomes the tiles'
  placeholders between ``<|image_start|>`` and ``<|image_end|>``). ``pan_and_scan`` does not
  apply (tiles play its part)."""
  del pan_and_scan
  v = model_config.vision
  if directory and os.path.isfile(os.path.join(directory, 'preprocessor_config.json')):
    processor = TiledImageProcessor.from_pretrained(directory)
  else:
    processor = TiledImageProcessor(tile_size=v.image_size)
  return processor, TiledImagePrompt.from_tokenizer(tokenizer, v, model='Llama 4')


SPEC = FamilySpec(
    name='llama4',
    image_inputs=image_inputs,
    description='Llama with chunked local attention in 3 of 4 layers, NoPE full-attention '
                'layers with temperature tuning, interleaved rotary pairs, L2 q/k norms '
                '(Scout) and top-1 sigmoid experts plus a shared expert.',
    hf=Family('llama4', ('llama4_text', 'llama4'), 'Llama4ForCausalLM', config_from_hf,
              config_to_hf,
              defaults={'rms_norm_eps': 1e-5, 'max_position_embeddings': 131_072,
                        'rope_theta': 500_000.0, 'num_key_value_heads': 8, 'head_dim': 128},
              module_names={'mlp': 'feed_forward', 'shared_experts': 'shared_expert'},
              unfuse=unfuse, fuse=fuse, to_peft=to_peft, from_peft=from_peft),
    differences={'rope_interleave': True, 'attention': {'temperature_tuning': True},
                 'rope': {'theta': 500_000.0},
                 'moe': {'num_experts_per_tok': 1, 'num_shared_experts': 1,
                         'router_score': 'sigmoid', 'router_norm_topk': False,
                         'router_weights_on_input': True}},
    presets={'llama4-17b-16e': llama4_scout_17b_16e, 'llama4-17b-128e': llama4_maverick_17b_128e,
             'tiny-llama4': tiny_llama4, 'tiny-llama4-vision': tiny_llama4_vision})

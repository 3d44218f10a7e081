"""Gemma 3: Gemma 2's block with per-head q/k norms, no soft-caps by default, 5 local :
1 global layers, and a separate rotary base for local layers; with images, a SigLIP
vision tower and a pooling projector (:mod:`maxnnx.layers.vision`).

The 4B/12B/27B presets are the language model of the multimodal checkpoints
(``text_config``); their 262208-token vocabulary includes the image tokens.

Multimodal checkpoints (``model_type: gemma3``, ``Gemma3ForConditionalGeneration``)
nest ``text_config`` and ``vision_config`` and prefix their tensors: the Hub files hold
``language_model.model.*``, ``vision_tower.vision_model.*`` and ``multi_modal_projector.*``;
transformers 5 writes ``vision_tower.*`` without ``vision_model``, and names the
modules ``model.language_model.*``, ``model.vision_tower.*`` in memory. All load; export
writes what transformers 5 writes.
"""

import os
import re

import numpy as np

from maxnnx.config import ModelConfig, RopeConfig, VisionConfig
from maxnnx.data.images import ImageProcessor, ImagePrompt
from maxnnx.models import gemma
from maxnnx.models.gemma import GEMMA_DEFAULTS, gemma_fields
from maxnnx.models.gemma2 import SANDWICH_NORM_NAMES, sandwich_fields, sandwich_to_hf
from maxnnx.models.hf import Family, HFConfig, PretrainedError, TensorDict, rope_to_hf
from maxnnx.models.registry import FamilySpec, merge

# SigLIP's defaults (transformers' SiglipVisionConfig), for keys a vision_config leaves out.
SIGLIP_DEFAULTS = {'hidden_size': 768, 'intermediate_size': 3072, 'num_hidden_layers': 12,
                   'num_attention_heads': 12, 'num_channels': 3, 'image_size': 224,
                   'patch_size': 16, 'layer_norm_eps': 1e-6,
                   'hidden_act': 'gelu_pytorch_tanh'}

# -- Hugging Face mapping ----------------------------------------------------------------------


def _text_config_from_hf(hf: HFConfig) -> ModelConfig:
  fields = gemma_fields(hf)
  fields['rope'] = hf.rope('full_attention')
  if 'rope_parameters' in hf.data and 'sliding_attention' in hf.data['rope_parameters']:
    local_rope = hf.rope('sliding_attention')
  else:  # older configs: rope_local_base_freq, never scaled
    local_rope = fields['rope'].replace(theta=float(hf.get('rope_local_base_freq', 10_000.0)),
                                        scaling='none', factor=None)
  fields = merge(merge(fields, sandwich_fields(hf, 6)), {'attention': {'qk_norm': 'head'}})
  return ModelConfig(family='gemma3', **fields, local_rope=local_rope)


def _vision_from_hf(data: dict, top: HFConfig) -> VisionConfig:
  v = HFConfig(data, f'{top.path} (vision_config)', SIGLIP_DEFAULTS)
  if v.get('vision_use_head', False):
    raise PretrainedError(f'{v.path}: vision_use_head=true (a pooling head) is not used by '
                          'Gemma 3 and not supported.')
  image_id = top.data.get('image_token_index', top.data.get('image_token_id', 262_144))
  return VisionConfig(
      num_layers=v.require('num_hidden_layers'), hidden_size=v.require('hidden_size'),
      intermediate_size=v.require('intermediate_size'),
      num_heads=v.require('num_attention_heads'), image_size=v.require('image_size'),
      patch_size=v.require('patch_size'), num_channels=v.require('num_channels'),
      norm_eps=float(v.require('layer_norm_eps')), activation=v.activation(),
      tokens_per_image=top.get('mm_tokens_per_image', 256), image_token_id=image_id)


def config_from_hf(hf: HFConfig) -> ModelConfig:
  if 'text_config' not in hf.data:  # a text-only checkpoint (gemma3_text)
    return _text_config_from_hf(hf)
  cfg = _text_config_from_hf(hf.text_config())
  return cfg.replace(vision=_vision_from_hf(hf.data.get('vision_config') or {}, hf))


def config_to_hf(cfg: ModelConfig) -> dict:
  out = sandwich_to_hf(cfg, 'gemma3_text', 'Gemma3ForCausalLM')
  out['rope_parameters'] = {'full_attention': rope_to_hf(cfg.rope),
                            'sliding_attention': rope_to_hf(cfg.local_rope or cfg.rope)}
  v = cfg.vision
  if not v.num_layers:
    return out
  del out['architectures']
  vision = {'model_type': 'siglip_vision_model', 'hidden_size': v.hidden_size,
            'intermediate_size': v.intermediate_size, 'num_hidden_layers': v.num_layers,
            'num_attention_heads': v.num_heads, 'image_size': v.image_size,
            'patch_size': v.patch_size, 'num_channels': v.num_channels,
            'layer_norm_eps': v.norm_eps, 'vision_use_head': False,
            'hidden_act': {'gelu_tanh': 'gelu_pytorch_tanh', 'gelu': 'gelu', 'silu': 'silu',
                           'relu': 'relu'}[v.activation]}
  return {'architectures': ['Gemma3ForConditionalGeneration'], 'model_type': 'gemma3',
          'text_config': out, 'vision_config': vision, 'mm_tokens_per_image': v.tokens_per_image,
          'image_token_index': v.image_token_id, 'tie_word_embeddings': cfg.tie_word_embeddings,
          'dtype': out['dtype']}


# Checkpoint prefixes of the multimodal model -> ours (the text-only layout), first match wins.
_MULTIMODAL_PREFIXES = (('model.language_model.', 'model.'), ('language_model.model.', 'model.'),
                        ('language_model.lm_head.', 'lm_head.'),
                        ('vision_tower.vision_model.', 'model.vision_tower.'),
                        ('model.vision_tower.vision_model.', 'model.vision_tower.'),
                        ('vision_tower.', 'model.vision_tower.'),
                        ('multi_modal_projector.', 'model.multi_modal_projector.'))
_PATCH_WEIGHT = 'model.vision_tower.embeddings.patch_embedding.weight'
_PROJECTION = 'model.multi_modal_projector.mm_input_projection_weight'
_OURS_ONLY = re.compile(r'model\.(vision_tower|multi_modal_projector)\.')


def unfuse(tensors: TensorDict, cfg: ModelConfig) -> TensorDict:
  """Multimodal checkpoints: strip the prefixes, and flatten the patch convolution
  ``[hidden, C, p, p]`` into a linear map ``[hidden, C * p * p]``."""
  if not cfg.vision.num_layers:
    return tensors
  out = {}
  for name, value in tensors.items():
    for theirs, ours in _MULTIMODAL_PREFIXES:
      if name.startswith(theirs):
        name = ours + name[len(theirs):]
        break
    out[name] = value
  if _PATCH_WEIGHT in out:
    source, array = out[_PATCH_WEIGHT]
    out[_PATCH_WEIGHT] = (source, np.asarray(array).reshape(array.shape[0], -1))
  return out


def fuse(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Inverse of :func:`unfuse`, writing the layout transformers 5 saves."""
  if not cfg.vision.num_layers:
    return tensors
  v = cfg.vision
  out = {}
  for name, array in tensors.items():
    if name == _PATCH_WEIGHT:
      array = array.reshape(v.hidden_size, v.num_channels, v.patch_size, v.patch_size)
    elif name == _PROJECTION:  # a plain [hidden, d_model] parameter, written flat
      array = array.reshape(v.hidden_size, cfg.d_model)
    if _OURS_ONLY.match(name):
      name = name[len('model.'):]
    elif name.startswith('model.'):
      name = 'language_model.' + name
    elif name.startswith('lm_head.'):
      name = 'language_model.' + name
    out[name] = array
  return out


def to_peft(name: str, cfg: ModelConfig) -> str:
  """Our name -> transformers 5's in-memory name: the text model under
  ``model.language_model.``, the tower and projector as ours."""
  if cfg.vision.num_layers and name.startswith('model.') and not _OURS_ONLY.match(name):
    return 'model.language_model.' + name[len('model.'):]
  return name


def from_peft(name: str, cfg: ModelConfig) -> str:
  """Inverse of :func:`to_peft`; transformers 4's names (``language_model.model.``,
  ``vision_tower.vision_model.``) too."""
  if cfg.vision.num_layers:
    for theirs, ours in _MULTIMODAL_PREFIXES:
      if name.startswith(theirs):
        return ours + name[len(theirs):]
  return name


# -- Presets -----------------------------------------------------------------------------------

GLOBAL_ROPE_LONG = RopeConfig(theta=1_000_000.0, scaling='linear', factor=8.0)


# The multimodal models' vision tower: SigLIP So400m on 896x896 images (VisionConfig's
# defaults: 27 blocks of width 1152, patches of 14) pooled to 256 tokens per image.
SIGLIP_SO400M = {'num_layers': 27, 'image_token_id': 262_144}


def _gemma3(vocab_size: int, d_model: int, num_layers: int, num_heads: int, num_kv_heads: int,
            head_dim: int, mlp_dim: int, query_pre_attn_scalar: int, sliding_window: int,
            max_position_embeddings: int, rope: RopeConfig,
            vision: dict | None = None) -> ModelConfig:
  """A Gemma 3 config; layer ``i`` is global iff ``(i + 1) % 6 == 0``."""
  layer_types = tuple('full' if (i + 1) % 6 == 0 else 'sliding' for i in range(num_layers))
  return SPEC.config(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     mlp_dim=mlp_dim, max_position_embeddings=max_position_embeddings,
                     attention={'query_scale': query_pre_attn_scalar**-0.5,
                                'sliding_window': sliding_window},
                     layer_types=layer_types, rope=rope, vision=vision or {})


def gemma3_1b() -> ModelConfig:
  """Gemma 3 1B (text only, 32k context, unscaled global rope)."""
  return _gemma3(262_144, 1152, 26, 4, 1, 256, 6912, 256, 512, 32_768,
                 RopeConfig(theta=1_000_000.0))


def gemma3_4b() -> ModelConfig:
  """Gemma 3 4B with its vision tower (4.30B parameters; ``vision={'num_layers': 0}`` for the
  3.88B language model alone)."""
  return _gemma3(262_208, 2560, 34, 8, 4, 256, 10_240, 256, 1024, 131_072, GLOBAL_ROPE_LONG,
                 SIGLIP_SO400M)


def gemma3_12b() -> ModelConfig:
  """Gemma 3 12B with its vision tower (12.19B parameters)."""
  return _gemma3(262_208, 3840, 48, 16, 8, 256, 15_360, 256, 1024, 131_072, GLOBAL_ROPE_LONG,
                 SIGLIP_SO400M)


def gemma3_27b() -> ModelConfig:
  """Gemma 3 27B with its vision tower (27.43B parameters; queries scaled by 168 ** -0.5)."""
  return _gemma3(262_208, 5376, 62, 32, 16, 128, 21_504, 168, 1024, 131_072, GLOBAL_ROPE_LONG,
                 SIGLIP_SO400M)


def tiny_gemma3_vision() -> ModelConfig:
  """A tiny Gemma 3 with a vision tower (64x64 images, 8x8 patches pooled to 16 tokens;
  placeholder id 511) for tests and tutorials on a CPU."""
  return SPEC.config(vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, mlp_dim=128, max_position_embeddings=256,
                     attention={'sliding_window': 16, 'query_scale': 16**-0.5},
                     layer_types=('sliding', 'full'),
                     rope=RopeConfig(theta=1_000_000.0),
                     vision={'num_layers': 2, 'hidden_size': 32, 'intermediate_size': 64,
                             'num_heads': 4, 'image_size': 64, 'patch_size': 8,
                             'tokens_per_image': 16, 'image_token_id': 511})


GEMMA3_CROPS = ('Here is the original image {image} and here are some crops to help you see '
                'better {crops}')


def image_prompt(tokenizer, vision: VisionConfig) -> ImagePrompt:
  """Gemma 3's image prompt: the template's ``<start_of_image>`` becomes a blank line, the
  start-of-image token, ``tokens_per_image`` placeholders, the end-of-image token and a
  blank line; an image with pan-and-scan crops is written with its crops after it."""
  return ImagePrompt.from_tokenizer(
      tokenizer, vision, marker='<start_of_image>',
      expansion='\n\n<start_of_image>{image}<end_of_image>\n\n', crops_format=GEMMA3_CROPS,
      model='Gemma 3')


def image_inputs(model_config: ModelConfig, tokenizer, directory: str | None = None,
                 pan_and_scan: bool = False) -> tuple[ImageProcessor, ImagePrompt]:
  """Gemma 3's image processor (the checkpoint's ``preprocessor_config.json`` if
  ``directory`` has one, else the tower's image size with SigLIP's normalisation) and image
  prompt. Pan-and-scan is off unless asked, as in transformers' ``Gemma3Processor``."""
  v = model_config.vision
  if directory and os.path.isfile(os.path.join(directory, 'preprocessor_config.json')):
    processor = ImageProcessor.from_pretrained(directory, pan_and_scan=pan_and_scan)
  else:
    processor = ImageProcessor(height=v.image_size, width=v.image_size,
                               pan_and_scan=pan_and_scan)
  return processor, image_prompt(tokenizer, v)


SPEC = FamilySpec(
    name='gemma3',
    description='Gemma with norms before and after each sub-block, per-head q/k norms, '
                '5 sliding-window layers per global one and a separate rotary base for them.',
    hf=Family('gemma3', ('gemma3_text', 'gemma3'), 'Gemma3ForCausalLM', config_from_hf,
              config_to_hf,
              # transformers' Gemma3TextConfig defaults (the Hub's text_config leaves most out)
              defaults={**GEMMA_DEFAULTS, 'sliding_window': 4096, 'rope_theta': 1_000_000.0,
                        'query_pre_attn_scalar': 256, 'max_position_embeddings': 131072,
                        'vocab_size': 262_208, 'num_attention_heads': 8,
                        'num_key_value_heads': 4, 'head_dim': 256, 'hidden_size': 2304,
                        'intermediate_size': 9216, 'num_hidden_layers': 26},
              module_names={**SANDWICH_NORM_NAMES, 'vision_tower': 'model.vision_tower',
                            'multi_modal_projector': 'model.multi_modal_projector',
                            'encoder_layers': 'encoder.layers'},
              unfuse=unfuse, fuse=fuse, to_peft=to_peft, from_peft=from_peft),
    differences={**gemma.DIFFERENCES, 'post_norm': True, 'attention': {'qk_norm': 'head'},
                 'local_rope': {'theta': 10_000.0}},
    image_inputs=image_inputs,
    presets={'gemma3-1b': gemma3_1b, 'gemma3-4b': gemma3_4b, 'gemma3-12b': gemma3_12b,
             'gemma3-27b': gemma3_27b, 'tiny-gemma3-vision': tiny_gemma3_vision},
    chat_template='gemma')

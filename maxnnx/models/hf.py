"""Shared machinery for Hugging Face interop: config reading and tensor naming.

A family (``models/llama.py``, ``models/gemma2.py``…) is a :class:`Family`:
how its ``config.json`` maps to a :class:`ModelConfig` and back, and how its
module names differ from ours. Tensor names and layouts are derived from our
module tree, so most families state only a few names:

* our module path ``layers.3.attn.q_proj`` becomes ``model.layers.3.self_attn.q_proj``
  through :attr:`Family.module_names`;
* a ``kernel`` ``[in..., out...]`` is stored by Hugging Face as a ``weight``
  ``[out, in]`` (flattened), norms' ``scale`` as ``weight``, biases as they are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from maxnnx.config import ConfigError, LayerType, ModelConfig, RopeConfig


class PretrainedError(ValueError):
  """A Hugging Face directory cannot be loaded or a model cannot be exported."""


_ROPE_TYPES = {'default': 'none', 'linear': 'linear', 'llama3': 'llama3', 'yarn': 'yarn',
               'longrope': 'longrope', 'su': 'longrope', 'proportional': 'proportional'}
_ROPE_KEYS = ('factor', 'original_max_position_embeddings', 'low_freq_factor', 'high_freq_factor',
              'beta_fast', 'beta_slow', 'mscale', 'mscale_all_dim', 'truncate', 'attention_factor',
              'short_factor', 'long_factor')
_ACTIVATIONS = {'silu': 'silu', 'swish': 'silu', 'gelu_pytorch_tanh': 'gelu_tanh',
                'gelu_new': 'gelu_tanh', 'gelu_fast': 'gelu_tanh', 'gelu': 'gelu', 'relu': 'relu'}
_LAYER_TYPES = {'full_attention': 'full', 'sliding_attention': 'sliding',
                'chunked_attention': 'chunked', 'linear_attention': 'linear'}


class HFConfig:
  """A ``config.json`` with family defaults and errors that name the file and key."""

  def __init__(self, data: dict[str, Any], path: str, defaults: dict[str, Any] | None = None):
    self.data, self.path, self.defaults = data, path, defaults or {}

  def get(self, key: str, default: Any = None) -> Any:
    """``data[key]`` if present and not null, else the family default, else ``default``."""
    value = self.data.get(key)
    if value is None:
      value = self.defaults.get(key, default)
    return value

  def require(self, key: str) -> Any:
    value = self.get(key)
    if value is None:
      raise PretrainedError(f"{self.path}: required key '{key}' is missing.")
    return value

  def text_config(self) -> HFConfig:
    """A multimodal config's ``text_config`` (the top level's token ids and tying filled in
    where it leaves them out), or this config itself when it is flat."""
    if 'text_config' not in self.data:
      return self
    text = dict(self.data.get('text_config') or {})
    for key in ('tie_word_embeddings', 'bos_token_id', 'eos_token_id', 'pad_token_id'):
      if self.data.get(key) is not None and text.get(key) is None:
        text[key] = self.data[key]
    return HFConfig(text, f'{self.path} (text_config)', self.defaults)

  def rope(self, layer_type: str | None = None) -> RopeConfig:
    """The rotary config, from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (older Hub configs). ``layer_type`` picks one entry of a
    per-layer-type ``rope_parameters`` (Gemma 3)."""
    params = self.data.get('rope_parameters')
    if params and layer_type is not None and layer_type in params:
      params = params[layer_type]
    if params:
      theta, scaling = params.get('rope_theta'), params
    else:
      theta, scaling = self.get('rope_theta'), self.data.get('rope_scaling') or {}
    theta = theta if theta is not None else self.defaults.get('rope_theta', 10_000.0)
    rope_type = scaling.get('rope_type') or scaling.get('type') or 'default'
    if rope_type not in _ROPE_TYPES:
      raise PretrainedError(f"{self.path}: rope type '{rope_type}' is not supported "
                            f'(supported: {", ".join(sorted(_ROPE_TYPES))}).')
    fields = {k: scaling[k] for k in _ROPE_KEYS if scaling.get(k) is not None}
    if _ROPE_TYPES[rope_type] != 'none' and 'original_max_position_embeddings' not in fields:
      original = self.data.get('original_max_position_embeddings')
      if original is not None:
        fields['original_max_position_embeddings'] = original
    for key in ('short_factor', 'long_factor'):
      if key in fields:
        fields[key] = tuple(float(f) for f in fields[key])
    for key in ('factor', 'low_freq_factor', 'high_freq_factor', 'beta_fast', 'beta_slow',
                'mscale', 'mscale_all_dim', 'attention_factor'):
      if key in fields:
        fields[key] = float(fields[key])
    partial = scaling.get('partial_rotary_factor') or self.get('partial_rotary_factor', 1.0)
    try:
      return RopeConfig(theta=float(theta), scaling=_ROPE_TYPES[rope_type],
                        partial_rotary_factor=float(partial), **fields)
    except ConfigError as e:
      raise PretrainedError(f'{self.path}: {e}') from None

  def activation(self, key: str | None = None) -> str:
    """Our ``mlp_activation`` for the config's activation name (read from ``key``, by
    default ``hidden_activation`` or ``hidden_act``)."""
    if key is not None:
      name = self.require(key)
    else:
      name = self.get('hidden_activation') or self.get('hidden_act') or 'silu'
    if name not in _ACTIVATIONS:
      raise PretrainedError(f"{self.path}: activation '{name}' is not supported "
                            f'(supported: {", ".join(sorted(_ACTIVATIONS))}).')
    return _ACTIVATIONS[name]

  def layer_types(self) -> tuple[LayerType, ...] | None:
    """``layer_types`` as ours (``full``, ``sliding``, ``chunked``, ``linear``) if listed."""
    names = self.data.get('layer_types')
    if names is None:
      return None
    unknown = sorted(set(names) - set(_LAYER_TYPES))
    if unknown:
      raise PretrainedError(f'{self.path}: unsupported layer_types {unknown}.')
    return tuple(_LAYER_TYPES[n] for n in names)

  def common_fields(self) -> dict[str, Any]:
    """The fields every decoder family's config spells the same way."""
    num_heads = self.require('num_attention_heads')
    head_dim = self.get('head_dim')
    if head_dim == self.require('hidden_size') // num_heads:
      head_dim = None  # the default; keeps configs equal whether or not the key is written
    return dict(
        vocab_size=self.require('vocab_size'),
        d_model=self.require('hidden_size'),
        num_layers=self.require('num_hidden_layers'),
        num_heads=num_heads,
        num_kv_heads=self.get('num_key_value_heads', num_heads),
        head_dim=head_dim,
        mlp_dim=self.require('intermediate_size'),
        max_position_embeddings=self.get('max_position_embeddings', 4096),
        norm_eps=float(self.get('rms_norm_eps', 1e-6)),
        tie_word_embeddings=bool(self.get('tie_word_embeddings', False)),
        mlp_activation=self.activation(),
        rope=self.rope(),
        bos_token_id=self.data.get('bos_token_id'),
        eos_token_id=self.data.get('eos_token_id'),
        pad_token_id=self.data.get('pad_token_id'),
    )


def rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
  """``rope_parameters`` entry (transformers 5 layout) for ``rope``."""
  inverse = {'none': 'default', 'linear': 'linear', 'llama3': 'llama3', 'yarn': 'yarn',
             'longrope': 'longrope', 'proportional': 'proportional'}
  out: dict[str, Any] = {'rope_type': inverse[rope.scaling], 'rope_theta': rope.theta}
  if rope.partial_rotary_factor != 1.0:
    out['partial_rotary_factor'] = rope.partial_rotary_factor
  if rope.scaling == 'none':
    return out
  keys = {'linear': ('factor',),
          'llama3': ('factor', 'low_freq_factor', 'high_freq_factor',
                     'original_max_position_embeddings'),
          'yarn': ('factor', 'original_max_position_embeddings', 'beta_fast', 'beta_slow',
                   'mscale', 'mscale_all_dim', 'attention_factor', 'truncate'),
          'longrope': ('factor', 'original_max_position_embeddings', 'attention_factor',
                       'short_factor', 'long_factor'),
          'proportional': ('factor',)}[rope.scaling]
  for key in keys:
    value = getattr(rope, key)
    if value is not None:
      out[key] = list(value) if isinstance(value, tuple) else value
  return out


def common_to_hf(cfg: ModelConfig, model_type: str, architecture: str) -> dict[str, Any]:
  """The ``config.json`` keys every decoder family shares."""
  activation = {'silu': 'silu', 'gelu_tanh': 'gelu_pytorch_tanh', 'gelu': 'gelu',
                'relu': 'relu'}[cfg.mlp_activation]
  return {
      'architectures': [architecture],
      'model_type': model_type,
      'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.d_model,
      'intermediate_size': cfg.mlp_dim,
      'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.num_kv_heads,
      'head_dim': cfg.resolved_head_dim,
      'max_position_embeddings': cfg.max_position_embeddings,
      'rms_norm_eps': cfg.norm_eps,
      'tie_word_embeddings': cfg.tie_word_embeddings,
      'hidden_act': activation,
      'rope_parameters': rope_to_hf(cfg.rope),
      'dtype': cfg.runtime.param_dtype,
      # Written even when None, so transformers does not fall back to its defaults.
      'bos_token_id': cfg.bos_token_id,
      'eos_token_id': list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple)
                      else cfg.eos_token_id,
      'pad_token_id': cfg.pad_token_id,
  }


def layer_types_to_hf(cfg: ModelConfig) -> list[str]:
  names = {ours: theirs for theirs, ours in _LAYER_TYPES.items()}
  return [names[t] for t in cfg.resolved_layer_types]


TensorDict = dict[str, tuple[str, np.ndarray]]  # HF name -> (source file, array)


@dataclasses.dataclass(frozen=True)
class Family:
  """How one model family maps to and from Hugging Face.

  Attributes:
    name: our family name (``ModelConfig.family``).
    model_types: ``model_type`` values of ``config.json`` this family loads.
    architecture: the transformers class written into exported configs.
    config_from_hf: ``HFConfig -> ModelConfig``.
    config_to_hf: ``ModelConfig -> dict`` (a transformers-5 ``config.json``).
    defaults: config values the transformers class assumes when a key is absent.
    module_names: our module name -> HF module name (unlisted names are equal; ``''``
      drops the level, for a module whose parameters HF keeps in its parent).
    unfuse: optional hook splitting fused HF tensors into per-projection ones.
    fuse: optional inverse of ``unfuse`` for export.
    fused_modules: for a family whose checkpoints fuse projections, ``ModelConfig ->
      {fused module suffix: ((part module suffix, output rows), ...)}`` in row order
      (e.g. ``'self_attn.qkv_proj'`` of ``self_attn.q_proj``, ``k_proj``, ``v_proj``);
      LoRA adapters of the parts are written and read fused (``maxnnx.train.lora.fused``).
    conv1d: the checkpoint's projections are GPT-2 ``Conv1D`` modules (``[in, out]``
      weights), whose PEFT adapters say ``fan_in_fan_out: true``.
    mtp: multi-token-prediction modules are stored DeepSeek-style, as extra
      layers after the stack (see :func:`hf_layer_path`).
    to_peft: optional ``(our tensor name, config) -> the name of that tensor in the
      transformers model in memory``, where it differs (a multimodal model nests its text
      model); PEFT adapters name modules that way.
    from_peft: optional inverse of ``to_peft``, also taking the names older transformers
      versions gave (adapters made with them load).
  """

  name: str
  model_types: tuple[str, ...]
  architecture: str
  config_from_hf: Callable[[HFConfig], ModelConfig]
  config_to_hf: Callable[[ModelConfig], dict[str, Any]]
  defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
  module_names: dict[str, str] = dataclasses.field(default_factory=dict)
  unfuse: Callable[[TensorDict, ModelConfig], TensorDict] | None = None
  fuse: Callable[[dict[str, np.ndarray], ModelConfig], dict[str, np.ndarray]] | None = None
  fused_modules: Callable[[ModelConfig], dict[str, tuple[tuple[str, int], ...]]] | None = None
  conv1d: bool = False
  mtp: bool = False
  to_peft: Callable[[str, ModelConfig], str] | None = None
  from_peft: Callable[[str, ModelConfig], str] | None = None

  def hf_name(self, path: tuple) -> str:
    """HF tensor name of our (unscanned) parameter path, e.g.
    ``('layers', 0, 'attn', 'q_proj', 'kernel')``."""
    names = dict(BASE_MODULE_NAMES, **self.module_names)
    *modules, leaf = path
    parts = [str(p) if isinstance(p, int) else names.get(p, p) for p in modules]
    parts.append(LEAF_NAMES.get(leaf, leaf))
    return '.'.join(p for p in parts if p)  # a module named '' has no level of its own


BASE_MODULE_NAMES = {
    'embed': 'model.embed_tokens', 'layers': 'model.layers', 'final_norm': 'model.norm',
    'lm_head': 'lm_head', 'attn': 'self_attn', 'mlp': 'mlp',
    'attn_pre_norm': 'input_layernorm', 'mlp_pre_norm': 'post_attention_layernorm',
}
LEAF_NAMES = {'kernel': 'weight', 'scale': 'weight', 'embedding': 'weight', 'bias': 'bias'}
# MTP module parts -> their names inside the Hub's extra layer (DeepSeek V3 layout).
MTP_MODULE_NAMES = {'embed_norm': ('enorm',), 'hidden_norm': ('hnorm',), 'proj': ('eh_proj',),
                    'final_norm': ('shared_head', 'norm')}
# Copies of the main embedding / output head that Hub MTP layers also store.
MTP_SHARED_COPIES = {'embed_tokens.weight': 'model.embed_tokens.weight',
                     'shared_head.head.weight': 'lm_head.weight'}


def hf_layer_path(path: tuple, num_layers: int) -> tuple:
  """Our parameter path with MTP module ``k`` placed as Hub layer ``num_layers + k``:
  ``('mtp', 0, 'block', 'attn', …)`` -> ``('layers', num_layers, 'attn', …)`` and
  ``('mtp', 0, 'proj', 'kernel')`` -> ``('layers', num_layers, 'eh_proj', 'kernel')``.
  Other paths are returned unchanged."""
  if path[0] != 'mtp':
    return path
  _, k, module, *rest = path
  layer = ('layers', num_layers + k)
  return (*layer, *rest) if module == 'block' else (*layer, *MTP_MODULE_NAMES[module], *rest)


IGNORED_HF_TENSORS = re.compile(r'.*rotary_emb\.inv_freq$|.*\.masked_bias$|.*\.attn\.bias$')


def load_config_json(directory: str) -> tuple[dict[str, Any], str]:
  """The parsed ``config.json`` of ``directory`` (its text model's, if nested)."""
  if not os.path.isdir(directory):
    raise PretrainedError(f'{directory}: not a directory. from_pretrained expects a local '
                          'Hugging Face checkpoint directory (config.json + *.safetensors).')
  path = os.path.join(directory, 'config.json')
  if not os.path.exists(path):
    raise PretrainedError(f'{path}: missing. A Hugging Face checkpoint directory needs '
                          'config.json next to its *.safetensors files.')
  try:
    with open(path) as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise PretrainedError(f'{path}: not valid JSON ({e}).') from None
  if not isinstance(data, dict) or 'model_type' not in data:
    raise PretrainedError(f"{path}: no 'model_type' key; is this a transformers config?")
  return data, path

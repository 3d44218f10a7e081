"""Adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

A PEFT LoRA adapter of a causal LM stores, for each adapted ``nn.Linear`` of
the Hugging Face model, ``base_model.model.<module>.lora_A.weight`` ``[r, in]``
and ``base_model.model.<module>.lora_B.weight`` ``[out, r]``, with
``W' = W + (lora_alpha / r) B A`` in PyTorch's ``[out, in]`` layout. Our
adapters are ``A [in, r]`` and ``B [r, out]`` on a ``[in, out]`` kernel (inputs
and outputs flattened in the same order as the kernel's Hugging Face export), so
PEFT's tensors are our ``A`` and ``B`` transposed. Module names come from the
family's Hugging Face mapping (:meth:`maxnnx.models.hf.Family.hf_name`).

:func:`save_adapter` writes one that ``peft.PeftModel.from_pretrained(base, dir)``
loads; :func:`load_adapter` reads one made by PEFT (rank and ``lora_alpha`` from
its config, targets from its tensors) onto a base model.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxnnx.checkpoint.safetensors import read_safetensors, write_safetensors
from maxnnx.models.hf import Family, PretrainedError, hf_layer_path
from maxnnx.models.registry import FAMILIES
from maxnnx.train.lora.adapters import (
  adapted_modules,
  adapter_weights,
  apply_lora,
  candidate_modules,
  lora_config_of,
)
from maxnnx.train.lora.config import LoraConfig
from maxnnx.train.lora.fused import fuse_adapters, unfuse_adapters

CONFIG_FILE = 'adapter_config.json'
WEIGHTS_FILE = 'adapter_model.safetensors'
PREFIX = 'base_model.model.'
# adapter_config.json keys written with their plain-LoRA values.
_PLAIN = {'bias': 'none', 'use_rslora': False, 'use_dora': False, 'modules_to_save': None,
          'layers_to_transform': None}
# Keys whose set values change what the adapter computes beyond W + (alpha / r) B A
# (refused on load). Which modules and layers carry tensors is read from the tensors;
# per-module ranks and alphas (rank_pattern / alpha_pattern) are read.
_CHANGES_FUNCTION = ('use_dora', 'modules_to_save', 'lora_bias', 'layer_replication',
                     'target_parameters', 'trainable_token_indices', 'use_qalora',
                     'alora_invocation_tokens', 'use_bdlora')


def _family(cfg) -> Family:
  family = FAMILIES.get(cfg.family)
  if family is None:
    raise PretrainedError(f"ModelConfig.family '{cfg.family}' has no Hugging Face mapping; "
                          f'known: {", ".join(sorted(FAMILIES))}.')
  return family


def hf_module_name(family: Family, cfg, path: tuple) -> str:
  """The Hugging Face module name of our unscanned module ``path``
  (``('layers', 0, 'attn', 'q_proj')`` -> ``model.layers.0.self_attn.q_proj``; a
  multimodal Gemma 3's is ``model.language_model.layers.0.self_attn.q_proj``, as in the
  transformers model PEFT wraps), before any fusing (Phi-3's ``q_proj`` is part of its
  checkpoint's ``qkv_proj``)."""
  name = family.hf_name(hf_layer_path((*path, 'kernel'), cfg.num_layers))
  if family.to_peft is not None:
    name = family.to_peft(name, cfg)
  return name.removesuffix('.weight')


def _canonical_module(family: Family, cfg, module: str) -> str:
  """An adapter file's module name as :func:`hf_module_name` writes it (older transformers
  versions named a multimodal model's modules differently)."""
  if family.from_peft is None:
    return module
  name = family.from_peft(module + '.weight', cfg)
  return family.to_peft(name, cfg).removesuffix('.weight')


def _peft_adapters(model: nnx.Module) -> tuple[dict, dict[str, int]]:
  """``({module: (A [r, in], B [out, r])}, rank factors)`` under the checkpoint's module
  names, fused where the family fuses (see :func:`~maxnnx.train.lora.fused.fuse_adapters`)."""
  cfg = model.config
  family = _family(cfg)
  adapters = {hf_module_name(family, cfg, path): (a_IR.T, b_RO.T)
              for path, (a_IR, b_RO) in adapter_weights(model).items()}
  if family.fused_modules is None:
    return adapters, {}
  return fuse_adapters(adapters, family.fused_modules(cfg))


def peft_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
  """The adapter tensors of ``model`` under PEFT's names and layouts."""
  tensors = {}
  for name, (a, b) in _peft_adapters(model)[0].items():
    tensors[PREFIX + name + '.lora_A.weight'] = np.ascontiguousarray(a)
    tensors[PREFIX + name + '.lora_B.weight'] = np.ascontiguousarray(b)
  return tensors


def save_adapter(model: nnx.Module, directory: str, *,
                 base_model_name_or_path: str | None = None) -> list[str]:
  """Write ``model``'s adapters as a PEFT LoRA adapter directory; returns the file names.

  ``adapter_config.json`` records ``r``, ``lora_alpha``, ``lora_dropout`` and the
  Hugging Face names of the adapted modules (``target_modules``). Where the
  checkpoint fuses projections (Phi-3's ``qkv_proj``, GPT-2's ``c_attn``) the
  parts' adapters are written as one of a ``k`` times larger rank and alpha
  (``rank_pattern`` / ``alpha_pattern``), which is exact (see
  :mod:`maxnnx.train.lora.fused`). ``base_model_name_or_path`` is written as
  given (PEFT reads it only when asked to load the base itself). Files are
  replaced atomically.
  """
  config = lora_config_of(model)
  family = _family(model.config)
  adapters, factors = _peft_adapters(model)
  tensors = peft_tensors(model)
  targets = sorted({name.rsplit('.', 1)[-1] for name in adapters})
  peft_config = {
      'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': config.rank,
      'lora_alpha': config.alpha, 'lora_dropout': config.dropout, 'target_modules': targets,
      'base_model_name_or_path': base_model_name_or_path, 'inference_mode': True,
      'init_lora_weights': True, 'fan_in_fan_out': family.conv1d,
      'rank_pattern': {leaf: k * config.rank for leaf, k in sorted(factors.items())},
      'alpha_pattern': {leaf: k * config.alpha for leaf, k in sorted(factors.items())},
      **_PLAIN,
  }
  os.makedirs(directory, exist_ok=True)
  write_safetensors(os.path.join(directory, WEIGHTS_FILE), tensors, {'format': 'pt'})
  tmp = os.path.join(directory, CONFIG_FILE + '.tmp')
  with open(tmp, 'w') as f:
    json.dump(peft_config, f, indent=2)
  os.replace(tmp, os.path.join(directory, CONFIG_FILE))
  return [CONFIG_FILE, WEIGHTS_FILE]


def read_peft_config(directory: str) -> dict:
  """``adapter_config.json`` of a PEFT LoRA adapter, checked for what we can load."""
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.exists(path):
    raise PretrainedError(f'{path}: missing; a PEFT adapter directory holds {CONFIG_FILE} and '
                          f'{WEIGHTS_FILE}.')
  with open(path) as f:
    data = json.load(f)
  if data.get('peft_type') != 'LORA':
    raise PretrainedError(f"{path}: peft_type is {data.get('peft_type')!r}; only LoRA adapters "
                          "('LORA') load.")
  for key in _CHANGES_FUNCTION:
    if data.get(key):
      raise PretrainedError(f'{path}: {key}={data[key]!r} is not supported; only plain LoRA '
                            f'adapters load (W + lora_alpha / r * B A).')
  if data.get('bias', 'none') != 'none':
    raise PretrainedError(f"{path}: bias={data['bias']!r} is not supported (only 'none').")
  return data


def _pattern_value(patterns: dict, name: str, default):
  """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key that matches the end
  of the module name (as whole modules, or as a regular expression), else ``default``."""
  for key, value in (patterns or {}).items():
    if re.fullmatch(rf'(.*\.)?(?:{key})', name):
      return value
  return default


def _read_pairs(tensors: dict, source: str) -> dict[str, dict[str, np.ndarray]]:
  """``{module: {'lora_A': ..., 'lora_B': ...}}`` of an adapter's tensors, checked."""
  pairs: dict[str, dict[str, np.ndarray]] = {}
  for name, array in tensors.items():
    module, _, kind = name.removesuffix('.weight').rpartition('.')
    if kind not in ('lora_A', 'lora_B') or not name.endswith('.weight'):
      raise PretrainedError(f"{source}: tensor '{name}' is not a LoRA A/B weight.")
    pairs.setdefault(module.removeprefix(PREFIX), {})[kind] = np.asarray(array)
  for module, pair in pairs.items():
    if len(pair) != 2:
      raise PretrainedError(f'{source}: {PREFIX}{module} has only {sorted(pair)}; LoRA needs '
                            'both lora_A and lora_B.')
  if not pairs:
    raise PretrainedError(f'{source}: no LoRA tensors.')
  return pairs


def load_adapter(model: nnx.Module, directory: str, *, base_quantization: str = 'none'
                 ) -> nnx.Module:
  """``model`` (a base model) with the PEFT LoRA adapter of ``directory`` applied.

  Each module's rank and scale come from ``adapter_config.json`` (``r`` and
  ``lora_alpha``, or its ``rank_pattern`` / ``alpha_pattern`` entry; ``use_rslora``
  scales by ``lora_alpha / sqrt(r)``); the adapted modules are those that have
  tensors. Modules of a smaller rank are padded with zero rows and columns to the
  largest (exact), and a module whose scale differs from the others has it folded
  into its ``B``. A fused module of the checkpoint (Phi-3's ``qkv_proj``) gives
  each of our projections its rows (:mod:`maxnnx.train.lora.fused`). In a
  scanned layer stack every layer gets adapters, zero where the file has none
  (exactly no adapter). ``base_quantization`` keeps the base int8 or int4
  (QLoRA). The file's ``lora_dropout`` (a training setting) is not used.
  ``model`` is left unchanged.

  Raises:
    PretrainedError: an unsupported adapter config, a tensor for a module this
      model does not have, or a tensor of the wrong shape (named with the file).
  """
  data = read_peft_config(directory)
  cfg = model.config
  family = _family(cfg)
  if data.get('fan_in_fan_out') and not family.conv1d:
    raise PretrainedError(f'{os.path.join(directory, CONFIG_FILE)}: fan_in_fan_out=True is for '
                          f"GPT-2's Conv1D projections, which {cfg.family} does not have.")
  weights_path = os.path.join(directory, WEIGHTS_FILE)
  if not os.path.exists(weights_path):
    raise PretrainedError(f'{weights_path}: missing (safetensors only; adapter_model.bin is '
                          'never read).')
  adapters = {}
  for module, pair in _read_pairs(read_safetensors(weights_path), weights_path).items():
    a, b = pair['lora_A'], pair['lora_B']
    rank = int(_pattern_value(data.get('rank_pattern'), module, data['r']))
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
      raise PretrainedError(f'{weights_path}: {PREFIX}{module} has lora_A {a.shape} and lora_B '
                            f'{b.shape}; its rank is {rank} (lora_A [r, in], lora_B [out, r]).')
    alpha = float(_pattern_value(data.get('alpha_pattern'), module,
                                 data.get('lora_alpha', data['r'])))
    scale = alpha / (math.sqrt(rank) if data.get('use_rslora') else rank)
    adapters[_canonical_module(family, cfg, module)] = (a, b, scale)
  if family.fused_modules is not None:
    adapters = unfuse_adapters(adapters, family.fused_modules(cfg), weights_path)
  by_name = {hf_module_name(family, cfg, path): path
             for path, _ in candidate_modules(_unscanned_view(model))}
  for module in adapters:
    if module not in by_name:
      raise PretrainedError(f"{weights_path}: the adapter adapts '{PREFIX}{module}', which is "
                            f'not a projection of this {cfg.family} model.')
  rank = max(a.shape[0] for a, _, _ in adapters.values())
  scale = max(s for _, _, s in adapters.values())
  loaded: dict[tuple, dict[str, np.ndarray]] = {}
  for module, (a, b, s) in adapters.items():
    pad = rank - a.shape[0]
    b = b if s == scale else b * np.asarray(s / scale, b.dtype)
    loaded[by_name[module]] = {'lora_A': np.pad(a, [(0, pad), (0, 0)]),
                               'lora_B': np.pad(b, [(0, 0), (0, pad)])}
  config = LoraConfig(rank=rank, alpha=scale * rank,
                      targets=tuple(sorted({path[-1] for path in loaded})),
                      base_quantization=base_quantization)
  adapted = apply_lora(model, config)
  _fill(adapted, loaded, weights_path)
  return adapted


def _unscanned_view(model: nnx.Module) -> nnx.Module:
  """An abstract unscanned model of ``model``'s config (for its per-layer module paths)."""
  from maxnnx.models.transformer import Transformer  # noqa: PLC0415
  cfg = model.config.replace(**{'runtime.scan_layers': False})
  return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def _fill(adapted: nnx.Module, loaded: dict, source: str) -> None:
  """Set ``adapted``'s A and B from PEFT tensors (transposed); zeros where none were given."""
  for module, rows in adapted_modules(adapted):
    for attr, kind in (('kernel_lora_a', 'lora_A'), ('kernel_lora_b', 'lora_B')):
      var = getattr(module, attr)
      per_layer = tuple(var.shape[-2:])
      values = []
      for path in rows:
        if path in loaded:
          array = loaded[path][kind].T
          if array.shape != per_layer:
            raise PretrainedError(f"{source}: {kind} of {'.'.join(map(str, path))} has shape "
                                  f'{array.T.shape}, this model needs {per_layer[::-1]} '
                                  f'(rank {adapted.lora_config.rank}).')
          values.append(array)
        else:
          values.append(np.zeros(per_layer))
      value = np.stack(values) if var.ndim == 3 else values[0]
      new = jnp.asarray(value, var.dtype)
      sharding = getattr(var[...], 'sharding', None)
      if isinstance(sharding, jax.sharding.NamedSharding):
        new = jax.device_put(new, sharding)
      var.set_value(new)


__all__ = ['CONFIG_FILE', 'PREFIX', 'WEIGHTS_FILE', 'hf_module_name', 'load_adapter',
           'peft_tensors', 'read_peft_config', 'save_adapter']

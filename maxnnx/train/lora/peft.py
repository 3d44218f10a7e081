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

CONFIG_FILE = 'adapter_config.json'
WEIGHTS_FILE = 'adapter_model.safetensors'
PREFIX = 'base_model.model.'
# adapter_config.json keys written with their plain-LoRA values.
_PLAIN = {'bias': 'none', 'fan_in_fan_out': False, 'use_rslora': False, 'use_dora': False,
          'modules_to_save': None, 'rank_pattern': {}, 'alpha_pattern': {},
          'layers_to_transform': None}
# Keys whose set values change what the adapter computes beyond W + (alpha / r) B A
# (refused on load). Which modules and layers carry tensors is read from the tensors.
_CHANGES_FUNCTION = ('use_dora', 'fan_in_fan_out', 'modules_to_save', 'rank_pattern',
                     'alpha_pattern', 'lora_bias', 'layer_replication', 'target_parameters',
                     'trainable_token_indices', 'use_qalora', 'alora_invocation_tokens',
                     'use_bdlora')


def _family(cfg) -> Family:
  family = FAMILIES.get(cfg.family)
  if family is None:
    raise PretrainedError(f"ModelConfig.family '{cfg.family}' has no Hugging Face mapping; "
                          f'known: {", ".join(sorted(FAMILIES))}.')
  if family.fuse is not None:
    raise PretrainedError(f'{cfg.family} stores some projections fused in Hugging Face format '
                          '(e.g. qkv_proj), which per-projection adapters do not map onto; '
                          'merge the adapters (merge_adapters) and save the model instead.')
  return family


def hf_module_name(family: Family, cfg, path: tuple) -> str:
  """The Hugging Face module name of our unscanned module ``path``
  (``('layers', 0, 'attn', 'q_proj')`` -> ``model.layers.0.self_attn.q_proj``)."""
  name = family.hf_name(hf_layer_path((*path, 'kernel'), cfg.num_layers))
  return name.removesuffix('.weight')


def peft_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
  """The adapter tensors of ``model`` under PEFT's names and layouts."""
  cfg = model.config
  family = _family(cfg)
  tensors = {}
  for path, (a_IR, b_RO) in adapter_weights(model).items():
    name = PREFIX + hf_module_name(family, cfg, path)
    tensors[name + '.lora_A.weight'] = np.ascontiguousarray(a_IR.T)
    tensors[name + '.lora_B.weight'] = np.ascontiguousarray(b_RO.T)
  return tensors


def save_adapter(model: nnx.Module, directory: str, *,
                 base_model_name_or_path: str | None = None) -> list[str]:
  """Write ``model``'s adapters as a PEFT LoRA adapter directory; returns the file names.

  ``adapter_config.json`` records ``r``, ``lora_alpha``, ``lora_dropout`` and the
  Hugging Face names of the adapted modules (``target_modules``);
  ``base_model_name_or_path`` is written as given (PEFT reads it only when asked
  to load the base itself). Files are replaced atomically.
  """
  config = lora_config_of(model)
  cfg = model.config
  family = _family(cfg)
  tensors = peft_tensors(model)
  targets = sorted({hf_module_name(family, cfg, path).rsplit('.', 1)[-1]
                    for path in adapter_weights(model)})
  peft_config = {
      'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': config.rank,
      'lora_alpha': config.alpha, 'lora_dropout': config.dropout, 'target_modules': targets,
      'base_model_name_or_path': base_model_name_or_path, 'inference_mode': True,
      'init_lora_weights': True, **_PLAIN,
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


def load_adapter(model: nnx.Module, directory: str, *, base_quantization: str = 'none'
                 ) -> nnx.Module:
  """``model`` (a base model) with the PEFT LoRA adapter of ``directory`` applied.

  The rank and scale come from ``adapter_config.json``; the adapted modules are
  those that have tensors. In a scanned layer stack every layer gets adapters,
  zero where the file has none (exactly no adapter). ``base_quantization`` keeps
  the base int8 or int4 (QLoRA). The file's ``lora_dropout`` (a training
  setting) is not used; ``use_rslora`` adapters load with their scale
  ``lora_alpha / sqrt(r)`` as ``alpha = lora_alpha * sqrt(r)``. ``model`` is left
  unchanged.

  Raises:
    PretrainedError: an unsupported adapter config, a tensor for a module this
      model does not have, or a tensor of the wrong shape (named with the file).
  """
  data = read_peft_config(directory)
  cfg = model.config
  family = _family(cfg)
  weights_path = os.path.join(directory, WEIGHTS_FILE)
  if not os.path.exists(weights_path):
    raise PretrainedError(f'{weights_path}: missing (safetensors only; adapter_model.bin is '
                          'never read).')
  tensors = read_safetensors(weights_path)
  by_name = {}
  for path, _ in candidate_modules(_unscanned_view(model)):
    by_name[PREFIX + hf_module_name(family, cfg, path)] = path
  loaded: dict[tuple, dict[str, np.ndarray]] = {}
  for name, array in tensors.items():
    module, _, kind = name.removesuffix('.weight').rpartition('.')
    if kind not in ('lora_A', 'lora_B') or not name.endswith('.weight'):
      raise PretrainedError(f"{weights_path}: tensor '{name}' is not a LoRA A/B weight.")
    if module not in by_name:
      raise PretrainedError(f"{weights_path}: tensor '{name}' adapts '{module}', which is not a "
                            f'projection of this {cfg.family} model.')
    loaded.setdefault(by_name[module], {})[kind] = np.asarray(array)
  for path, pair in loaded.items():
    if len(pair) != 2:
      raise PretrainedError(f"{weights_path}: {'.'.join(map(str, path))} has only "
                            f'{sorted(pair)}; LoRA needs both lora_A and lora_B.')
  if not loaded:
    raise PretrainedError(f'{weights_path}: no LoRA tensors.')
  rank = int(data['r'])
  alpha = float(data.get('lora_alpha', rank))
  if data.get('use_rslora'):  # rank-stabilised: scale alpha / sqrt(r), i.e. our alpha * sqrt(r)
    alpha *= math.sqrt(rank)
  config = LoraConfig(rank=rank, alpha=alpha,
                      targets=tuple(sorted({path[-1] for path in loaded})),
                      base_quantization=base_quantization)
  adapted = apply_lora(model, config)
  _fill(adapted, loaded, weights_path)
  return adapted


def _unscanned_view(model: nnx.Module) -> nnx.Module:
  """An abstract unscanned model of ``model``'s config (for its per-layer module paths)."""
  from maxnnx.models.transformer import Transformer  # noqa: PLC0415
  cfg = model.config.replace(scan_layers=False)
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

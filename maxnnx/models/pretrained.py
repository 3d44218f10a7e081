"""``from_pretrained`` / ``save_pretrained``: Hugging Face directories <-> maxnnx models.

Loading reads ``config.json`` (either the transformers-5 ``rope_parameters``
layout or the older ``rope_theta`` + ``rope_scaling`` one), builds the model's
abstract shape without allocating, validates every safetensors file, maps and
checks every tensor, and only then materialises parameters: a missing, extra,
mis-shaped or truncated tensor is one error naming the file and tensor.

Parameters are materialised one at a time, straight into their shards
(``jax.make_array_from_callback``): each tensor is read from the memory-mapped
file, converted to the parameter's layout and dtype, placed, and its file pages
are released before the next, so the host holds the placed parameters plus
about one tensor (one stacked tensor for scanned layers), never a second copy
of the model. With a mesh, each process places only the shards its own devices
hold.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from maxnnx.checkpoint.safetensors import (
  SafetensorsError,
  read_safetensors_dir,
  release_pages,
  write_sharded,
)
from maxnnx.config import ConfigError, MeshConfig, ModelConfig
from maxnnx.layers.linear import DenseGeneral
from maxnnx.models.hf import (
  IGNORED_HF_TENSORS,
  MTP_SHARED_COPIES,
  Family,
  HFConfig,
  PretrainedError,
  hf_layer_path,
  load_config_json,
)
from maxnnx.models.registry import FAMILIES
from maxnnx.models.transformer import Transformer, layer_stacks
from maxnnx.sharding import logical_rules, make_mesh, state_shardings

logger = logging.getLogger(__name__)

def family_for_model_type(model_type: str, path: str = 'config.json') -> Family:
  """The :class:`Family` that loads ``model_type``."""
  for family in FAMILIES.values():
    if model_type in family.model_types:
      return family
  known = sorted(t for f in FAMILIES.values() for t in f.model_types)
  raise PretrainedError(f"{path}: model_type '{model_type}' is not supported. "
                        f'Supported: {", ".join(known)}.')


def config_from_pretrained(directory: str, **overrides: Any) -> ModelConfig:
  """The :class:`ModelConfig` of a Hugging Face directory (no weights read).

  ``overrides`` replace config fields, e.g. ``dtype='bfloat16'``, ``scan_layers=True``.
  """
  data, path = load_config_json(directory)
  family = family_for_model_type(data['model_type'], path)
  try:
    cfg = family.config_from_hf(HFConfig(data, path, family.defaults))
    return cfg.replace(**overrides) if overrides else cfg
  except ConfigError as e:
    raise PretrainedError(f'{path}: {e}') from None


def from_pretrained(directory: str, *, dtype: str | None = None, param_dtype: str | None = None,
                    scan_layers: bool | None = None, mesh: MeshConfig | Mesh | None = None,
                    rules: dict | None = None, **overrides: Any) -> Transformer:
  """Load a local Hugging Face checkpoint directory as a :class:`Transformer`.

  Args:
    directory: holds ``config.json`` and ``*.safetensors`` (one file, or shards
      with ``model.safetensors.index.json``). Tokenizer files are not needed,
      and pickle checkpoints (``*.bin``) are never read.
    dtype: compute dtype (default: the config's, ``float32``).
    param_dtype: dtype parameters are stored in (default ``float32``).
    scan_layers: build the layer stack scanned (default: unscanned).
    mesh: place every parameter straight into its shards on this mesh (a
      :class:`~maxnnx.config.MeshConfig`, built over the visible devices, or a
      ``jax.sharding.Mesh``), by the logical-axis ``rules`` (default: the
      mesh config's, see :func:`maxnnx.sharding.logical_rules`). Without one,
      parameters go to the default device (uncommitted, as ``jnp.asarray``
      places them).
    rules: logical axis -> mesh axes, overriding the default rules.
    **overrides: any other :class:`ModelConfig` field. ``mtp_num_layers``
      (or ``mtp={'num_layers': n}``)
      chooses how many multi-token-prediction layers to load (DeepSeek V3);
      by default those the checkpoint holds (a transformers-saved checkpoint
      holds none, whatever ``num_nextn_predict_layers`` says). With fewer, the
      rest are skipped with a log line.

  Raises:
    PretrainedError: unsupported ``model_type``, a missing file, or a tensor
      that is missing, unexpected or of the wrong shape (named with its file).
    SafetensorsError: a truncated or corrupt safetensors file.
  """
  for key, value in (('dtype', dtype), ('param_dtype', param_dtype), ('scan_layers', scan_layers)):
    if value is not None:
      overrides[key] = value
  cfg = config_from_pretrained(directory, **overrides)
  family = FAMILIES[cfg.family]
  tensors = read_safetensors_dir(directory)
  mtp_chosen = any(key in overrides for key in ('mtp_num_layers', 'mtp.num_layers', 'mtp'))
  cfg, skipped = _choose_mtp_layers(cfg, family, tensors, mtp_chosen, directory)
  if family.unfuse is not None:
    tensors = family.unfuse(tensors, cfg)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  n_in = _kernel_input_dims(abstract)
  sources = {}
  used = set()
  for path, shape in _unscanned_param_shapes(abstract_state, cfg).items():
    name = family.hf_name(hf_layer_path(path, cfg.num_layers))
    if name not in tensors:
      raise PretrainedError(f"{directory}: tensor '{name}' is missing (needed for "
                            f"{'.'.join(map(str, path))} of a {cfg.family} model).")
    source, array = tensors[name]
    used.add(name)
    kernel_n_in = n_in[_module_key(path)] if path[-1] == 'kernel' else None
    _check_hf_shape(array, shape, kernel_n_in, name, source)
    sources[path] = (array, shape, kernel_n_in)
  used |= _check_mtp_copies(tensors, cfg)
  unexpected = sorted(n for n in tensors if n not in used and not IGNORED_HF_TENSORS.match(n)
                      and not (cfg.tie_word_embeddings and n == 'lm_head.weight')
                      and not skipped.match(n))
  if unexpected:
    shown = ', '.join(unexpected[:5]) + (' …' if len(unexpected) > 5 else '')
    raise PretrainedError(f'{directory}: {len(unexpected)} tensor(s) that a {cfg.family} model '
                          f'with this config.json does not have: {shown}.')
  shardings = _shardings(abstract_state, mesh, rules)
  state = _place_params(sources, abstract_state, cfg, shardings)
  return nnx.merge(graphdef, state)


def save_pretrained(model: Transformer, directory: str, *, max_shard_bytes: int = 5 * 1024**3
                    ) -> list[str]:
  """Write ``model`` as a Hugging Face directory that transformers loads.

  Writes ``config.json`` (transformers-5 layout) and ``model.safetensors`` (or
  shards plus an index) in the parameters' dtype. Existing files of the same
  names are replaced atomically, each only once its new version is complete.
  Returns the written file names.
  """
  cfg = model.config
  family = FAMILIES.get(cfg.family)
  if family is None:
    raise PretrainedError(f"ModelConfig.family '{cfg.family}' has no Hugging Face mapping; "
                          f'known: {", ".join(sorted(FAMILIES))}.')
  if jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
    raise PretrainedError('This model carries LoRA adapters: save merge_adapters(model) '
                          '(maxnnx.train.lora) for the merged weights, or the adapters alone '
                          'with save_adapter.')
  if cfg.mtp.num_layers and not family.mtp:
    raise PretrainedError(f'{cfg.family} checkpoints have no multi-token-prediction layers; '
                          'save a model with mtp.num_layers=0 (model.mtp is then dropped).')
  hf_config = family.config_to_hf(cfg)
  n_in = _kernel_input_dims(model)
  tensors = {}
  state = nnx.state(model, nnx.Param)
  for path, array in _unscanned_param_values(state, cfg).items():
    kernel_n_in = n_in[_module_key(path)] if path[-1] == 'kernel' else None
    name = family.hf_name(hf_layer_path(path, cfg.num_layers))
    tensors[name] = _ours_to_hf(np.asarray(array), kernel_n_in, path[-1])
  for k in range(cfg.mtp.num_layers):  # the Hub layout repeats the shared embedding and head
    for suffix, main in MTP_SHARED_COPIES.items():
      main = 'model.embed_tokens.weight' if cfg.tie_word_embeddings else main
      tensors[f'model.layers.{cfg.num_layers + k}.{suffix}'] = tensors[main]
  if family.fuse is not None:
    tensors = family.fuse(tensors, cfg)
  os.makedirs(directory, exist_ok=True)
  files = write_sharded(directory, tensors, max_shard_bytes)
  tmp = os.path.join(directory, 'config.json.tmp')
  with open(tmp, 'w') as f:
    json.dump(hf_config, f, indent=2)
  os.replace(tmp, os.path.join(directory, 'config.json'))
  return ['config.json', *files]


# -- multi-token prediction ----------------------------------------------------------------------


def _choose_mtp_layers(cfg: ModelConfig, family: Family, tensors, explicit: bool, directory: str
                       ) -> tuple[ModelConfig, re.Pattern]:
  """``cfg`` with the MTP layers to load, and a pattern of stored layers to skip."""
  pattern = re.compile(r'model\.layers\.(\d+)\.')
  stored = len({int(m.group(1)) for n in tensors if (m := pattern.match(n))
                and int(m.group(1)) >= cfg.num_layers}) if family.mtp else 0
  wanted = cfg.mtp.num_layers
  if wanted > stored:
    if explicit:
      holds = (f'holds multi-token-prediction tensors for {stored} layer(s)' if family.mtp
               else f'is a {cfg.family} checkpoint, which has no multi-token-prediction layers')
      raise PretrainedError(f'{directory}: mtp.num_layers={wanted} but the checkpoint {holds}; '
                            f'pass mtp_num_layers={stored} or fewer.')
    logger.info('%s: config.json declares %d multi-token-prediction layer(s) but the '
                'checkpoint holds tensors for %d; loading those.', directory, wanted, stored)
    cfg = cfg.replace(mtp={'num_layers': stored})
  elif wanted < stored:
    logger.info('%s: skipping %d of the checkpoint\'s %d multi-token-prediction layer(s) '
                '(mtp.num_layers=%d).', directory, stored - wanted, stored, wanted)
  first_skipped = cfg.num_layers + cfg.mtp.num_layers
  skipped = '|'.join(str(i) for i in range(first_skipped, cfg.num_layers + stored)) or '(?!)'
  return cfg, re.compile(rf'model\.layers\.({skipped})\.')


def _check_mtp_copies(tensors, cfg: ModelConfig) -> set[str]:
  """Names of the embedding/head copies in loaded MTP layers; the model shares the
  main ones, so a copy that differs is reported."""
  names = set()
  for k in range(cfg.mtp.num_layers):
    for suffix, main in MTP_SHARED_COPIES.items():
      main = 'model.embed_tokens.weight' if cfg.tie_word_embeddings else main
      name = f'model.layers.{cfg.num_layers + k}.{suffix}'
      if name in tensors:
        names.add(name)
        if not np.array_equal(np.asarray(tensors[name][1]), np.asarray(tensors[main][1])):
          logger.warning('%s: %s differs from %s; the MTP module uses the main model\'s '
                         '(shared, as DeepSeek V3 trains it).', tensors[name][0], name, main)
  return names


# -- tensor layout ------------------------------------------------------------------------------


def _module_key(path: tuple) -> tuple:
  """Module path without layer indices or the leaf name (same for every layer)."""
  return tuple(p for p in path[:-1] if not isinstance(p, int))


def _kernel_input_dims(model) -> dict[tuple, int]:
  """How many leading kernel dims are inputs, per DenseGeneral module."""
  return {_stack_as_layers(tuple(p for p in path if not isinstance(p, int))): len(node.in_shape)
          for path, node in nnx.iter_graph(model) if isinstance(node, DenseGeneral)}


def _stack_as_layers(key: tuple) -> tuple:
  """Scanned ``dense_layers`` hold HF ``layers`` too (see ``layer_stacks``)."""
  return ('layers', *key[1:]) if key[:1] == ('dense_layers',) else key


def _stacks(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """Scanned stack attribute -> (first layer, number of layers)."""
  if not cfg.runtime.scan_layers:
    return {}
  return {name: (start, count) for name, start, count, _ in layer_stacks(cfg)}


def _check_hf_shape(array: np.ndarray, shape: tuple, n_in: int | None, name: str,
                    source: str) -> None:
  """The HF tensor ``array`` can become a parameter of ``shape`` (nothing is read)."""
  if n_in is not None:  # HF Linear weight [out, in] -> kernel [in..., out...]
    expected = (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))
    if array.shape != expected:
      raise PretrainedError(f"{source}: tensor '{name}' has shape {array.shape}, the config "
                            f'implies {expected}.')
  elif int(np.prod(array.shape)) != int(np.prod(shape)) or (
      array.ndim == 2 and array.shape != shape):
    raise PretrainedError(f"{source}: tensor '{name}' has shape {array.shape}, the config "
                          f'implies {shape}.')


def _hf_to_ours(array: np.ndarray, shape: tuple, n_in: int | None, out: np.ndarray) -> None:
  """Write the HF tensor ``array`` into ``out`` (of ``shape``) in our layout and dtype."""
  if n_in is not None:  # HF Linear weight [out, in] -> kernel [in..., out...]
    out[...] = np.asarray(array).T.reshape(shape)
  else:
    out[...] = np.asarray(array).reshape(shape)


def _ours_to_hf(array: np.ndarray, n_in: int | None, leaf: str) -> np.ndarray:
  """Kernels become ``[out, in]`` matrices, the embedding table stays
  ``[vocab, d]``, and every other tensor (biases, norm scales) is flat."""
  if n_in is not None:
    rows = int(np.prod(array.shape[:n_in]))
    return np.ascontiguousarray(array.reshape(rows, -1).T)
  return array if leaf == 'embedding' else array.reshape(-1)


def _unscanned_param_shapes(abstract_state, cfg: ModelConfig) -> dict[tuple, tuple]:
  """Shape of every parameter, with stacked layers listed per layer index."""
  shapes, stacks = {}, _stacks(cfg)
  for path, var in nnx.to_flat_state(abstract_state):
    if not isinstance(var, nnx.Param):
      continue
    if path[0] in stacks:
      start, count = stacks[path[0]]
      for i in range(start, start + count):
        shapes[('layers', i, *path[1:])] = tuple(var.shape[1:])
    else:
      shapes[tuple(path)] = tuple(var.shape)
  return shapes


def _unscanned_param_values(state, cfg: ModelConfig) -> dict[tuple, np.ndarray]:
  values, stacks = {}, _stacks(cfg)
  for path, var in nnx.to_flat_state(state):
    array = np.asarray(jax.device_get(var[...]))
    if path[0] in stacks:
      start, count = stacks[path[0]]
      for i in range(count):
        values[('layers', start + i, *path[1:])] = array[i]
    else:
      values[tuple(path)] = array
  return values


def _shardings(abstract_state, mesh: MeshConfig | Mesh | None, rules: dict | None):
  """Where each variable goes: a ``NamedSharding`` per variable, or None (the first device)."""
  if mesh is None:
    return None
  if isinstance(mesh, MeshConfig):
    rules = logical_rules(mesh) if rules is None else rules
    mesh = make_mesh(mesh)
  return dict(nnx.to_flat_state(state_shardings(abstract_state, mesh, rules)))


def _place_params(sources: dict, abstract_state, cfg: ModelConfig, shardings: dict | None):
  """The model's state, each parameter converted from its HF tensor(s) and placed on its shards
  one at a time (see the module doc); other variables (MoE routing statistics) start at zero."""
  flat, stacks = [], _stacks(cfg)

  def place(host: np.ndarray, path) -> jax.Array:
    if shardings is None:  # uncommitted on the default device, as jnp.asarray makes them
      return jax.device_put(host)
    return jax.make_array_from_callback(host.shape, shardings[path].get_value(),
                                        lambda index: host[index])

  for path, var in nnx.to_flat_state(abstract_state):
    if not isinstance(var, nnx.Param):
      flat.append((path, var.replace(place(np.zeros(var.shape, var.dtype), path))))
      continue
    host = np.empty(var.shape, var.dtype)
    if path[0] in stacks:
      start, count = stacks[path[0]]
      parts = [(host[i], sources[('layers', start + i, *path[1:])]) for i in range(count)]
    else:
      parts = [(host, sources[tuple(path)])]
    for out, (array, shape, n_in) in parts:
      _hf_to_ours(array, shape, n_in, out)
      release_pages(array)
    flat.append((path, var.replace(place(host, path))))
    del host, parts
  return nnx.from_flat_state(flat)


def _to_model_layout(values: dict[tuple, np.ndarray], abstract_state, cfg: ModelConfig, convert):
  """Fill ``abstract_state`` from per-layer ``values`` (stacking if scanned)."""
  flat, stacks = [], _stacks(cfg)
  for path, var in nnx.to_flat_state(abstract_state):
    if not isinstance(var, nnx.Param):  # e.g. MoE routing statistics: start at zero
      flat.append((path, var.replace(jnp.zeros(var.shape, var.dtype))))
      continue
    if path[0] in stacks:
      start, count = stacks[path[0]]
      array = np.stack([values[('layers', i, *path[1:])] for i in range(start, start + count)])
    else:
      array = values[tuple(path)]
    flat.append((path, var.replace(convert(array))))
  return nnx.from_flat_state(flat)


__all__ = ['FAMILIES', 'PretrainedError', 'SafetensorsError', 'config_from_pretrained',
           'from_pretrained', 'save_pretrained']

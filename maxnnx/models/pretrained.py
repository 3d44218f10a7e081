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

Quantized releases (block-wise FP8, MXFP4, compressed-tensors; see
:mod:`maxnnx.checkpoint.quantized`) are checked against their
``quantization_config`` and dequantized the same way, tensor by tensor. With
``keep_quantized=True`` the linear layers' weights stay as stored instead: each
kernel becomes a qwix ``QArray`` of the checkpoint's own values (fp8, int8 or
int4) and scales, transposed into the kernel's layout on the host one byte (or
half a byte) per value, so no float copy of a quantized kernel is ever made.
The release's scale blocks map onto the kernel's axes exactly: a block of
``[rows, cols]`` becomes a tile of the output and input axes (of ``gcd(n, block)``
values where the block does not divide the axis, or where it spans several
heads of a multi-axis kernel unevenly), its scale repeated over the tiles it
covers, so the kernel computes ``values * scale`` in float32, the very numbers
a dequantizing load holds.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from maxnnx import paths
from maxnnx.checkpoint.quantized import (
  Dequantized,
  QuantizationError,
  dequantize_checkpoint,
  quantize_tensors,
  release,
)
from maxnnx.checkpoint.safetensors import (
  SafetensorsError,
  host_buffer,
  plan_shards,
  read_safetensors_dir,
  row_chunks,
  write_safetensors,
  write_sharded,
)
from maxnnx.config import ConfigError, MeshConfig, ModelConfig
from maxnnx.layers.dropout import DropoutSeed
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
from maxnnx.models.kept_quantized import (
  QuantizedHost,
  mark_quantized,
  quantized_experts,
  quantized_kernel,
  scale_sharding,
)
from maxnnx.models.mtp_tensors import check_mtp_copies, choose_mtp_layers
from maxnnx.models.registry import FAMILIES
from maxnnx.models.transformer import Transformer, layer_stacks
from maxnnx.processes import allgather_bytes, barrier, host_value, is_primary, place_host_value
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

  ``overrides`` replace config fields as :meth:`ModelConfig.replace` takes them, e.g.
  ``runtime={'dtype': 'bfloat16'}`` or ``**{'runtime.scan_layers': True}``.
  """
  data, path = load_config_json(paths.local_model_dir(directory))
  family = family_for_model_type(data['model_type'], path)
  try:
    cfg = family.config_from_hf(HFConfig(data, path, family.defaults))
    return cfg.replace(**overrides) if overrides else cfg
  except ConfigError as e:
    raise PretrainedError(f'{path}: {e}') from None


def from_pretrained(directory: str, *, dtype: str | None = None, param_dtype: str | None = None,
                    scan_layers: bool | None = None, mesh: MeshConfig | Mesh | None = None,
                    rules: dict | None = None, keep_quantized: bool = False,
                    **overrides: Any) -> Transformer:
  """Load a local Hugging Face checkpoint directory as a :class:`Transformer`.

  Args:
    directory: holds ``config.json`` and ``*.safetensors`` (one file, or shards
      with ``model.safetensors.index.json``). Tokenizer files are not needed,
      and pickle checkpoints (``*.bin``) are never read. A URL (``s3://``, ``gs://``,
      ``hf://org/name``, any fsspec URL) is downloaded once per process first
      (:func:`maxnnx.paths.local_model_dir`).
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
    keep_quantized: keep the linear layers' weights of a quantized release (fp8 blocks,
      fbgemm_fp8, compressed-tensors fp8/int8/int4) and its MXFP4 experts as they are
      stored, for inference:
      each kernel is a qwix ``QArray`` of the stored values and scales (see the module
      doc), its layer marked as :func:`~maxnnx.inference.quantize.quantize_for_inference`
      marks one, and the model computes the dequantizing load's numbers. Routed experts
      stored one tensor per expert in such a form (DeepSeek's releases) and MXFP4 experts
      (GPT-OSS) are kept too, as ``[experts, in, out]`` QArrays; other tensors (embeddings,
      norms, the head) load as without it.
    **overrides: any other :class:`ModelConfig` field (dotted keys as
      ``**{'attention.sliding_window': 512}``, or a dict per group). ``mtp={'num_layers': n}``
      chooses how many multi-token-prediction layers to load (DeepSeek V3);
      by default those the checkpoint holds (a transformers-saved checkpoint
      holds none, whatever ``num_nextn_predict_layers`` says). With fewer, the
      rest are skipped with a log line.

  Raises:
    PretrainedError: unsupported ``model_type``, a missing file, or a tensor
      that is missing, unexpected or of the wrong shape (named with its file).
    SafetensorsError: a truncated or corrupt safetensors file.
  """
  if keep_quantized not in (True, False):
    raise ValueError(f'keep_quantized={keep_quantized!r}: expected True or False.')
  for key, value in (('dtype', dtype), ('param_dtype', param_dtype), ('scan_layers', scan_layers)):
    if value is not None:
      overrides[f'runtime.{key}'] = value
  cfg, graphdef, abstract_state, sources = _read_sources(paths.local_model_dir(directory),
                                                         overrides)
  shardings = _shardings(abstract_state, mesh, rules)
  state = _place_params(sources, abstract_state, cfg, shardings, keep_quantized)
  model = nnx.merge(graphdef, state)
  if keep_quantized and not mark_quantized(model):
    raise PretrainedError(
        f'keep_quantized=True: {directory} holds no weight stored in a form kept quantized '
        '(fp8 blocks, fbgemm_fp8, compressed-tensors, MXFP4 experts); load it without '
        'keep_quantized (dequantized), or quantize it with quantize_for_inference.')
  return model


def from_maxtext(step_dir: str, settings=None, **kwargs: Any) -> Transformer:
  """A :class:`Transformer` with the parameters of a step directory MaxText wrote
  (``.../checkpoints/<step>``: a training state or parameters only, scanned or not; see
  :mod:`maxnnx.checkpoint.maxtext` for the blocks read). ``settings`` are MaxText's settings of
  that run (its YAML path, a ``key=value`` list or a dict; MaxText's defaults otherwise);
  ``kwargs`` go to :func:`from_pretrained` (``dtype``, ``scan_layers``, ``mesh``...)."""
  import tempfile  # noqa: PLC0415

  from maxnnx.checkpoint.maxtext import write_hf  # noqa: PLC0415
  with tempfile.TemporaryDirectory() as scratch:
    write_hf(step_dir, scratch, settings)
    return from_pretrained(scratch, **kwargs)


def host_params(directory: str, **overrides: Any):
  """``(config, iterator)`` over a Hugging Face checkpoint's parameters in the model's layout,
  one at a time: the iterator yields ``(path, NumPy array)`` for every parameter of
  :class:`Transformer` (stacked when ``scan_layers``), converted from the memory-mapped
  tensors as :func:`from_pretrained` does, without building the model (``maxnnx convert``
  streams them into an orbax checkpoint). The checkpoint is checked in full first.
  """
  # checks everything
  cfg, _, abstract_state, sources = _read_sources(paths.local_model_dir(directory), overrides)
  return cfg, ((path, host) for path, var, host in _host_params(sources, abstract_state, cfg)
               if isinstance(var, nnx.Param))


def _read_sources(directory: str, overrides: dict):
  """Config, abstract model and every parameter's checked source tensor(s) of a checkpoint."""
  cfg = config_from_pretrained(directory, **overrides)
  family = FAMILIES[cfg.family]
  data, config_path = load_config_json(directory)
  try:  # quantized releases: every weight checked against its scales, read lazily
    tensors = dequantize_checkpoint(read_safetensors_dir(directory),
                                    data.get('quantization_config'), config_path)
  except QuantizationError as e:
    raise PretrainedError(str(e)) from None
  mtp_chosen = any(key in overrides for key in ('mtp.num_layers', 'mtp'))
  cfg, skipped = choose_mtp_layers(cfg, family, tensors, mtp_chosen, directory)
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
  used |= check_mtp_copies(tensors, cfg)
  unexpected = sorted(n for n in tensors if n not in used and not IGNORED_HF_TENSORS.match(n)
                      and not (cfg.tie_word_embeddings and n == 'lm_head.weight')
                      and not skipped.match(n))
  if unexpected:
    shown = ', '.join(unexpected[:5]) + (' …' if len(unexpected) > 5 else '')
    raise PretrainedError(f'{directory}: {len(unexpected)} tensor(s) that a {cfg.family} model '
                          f'with this config.json does not have: {shown}.')
  return cfg, graphdef, abstract_state, sources


EXPORT_DTYPES = {'bfloat16': ml_dtypes.bfloat16, 'float16': np.float16, 'float32': np.float32}


def save_pretrained(model: Transformer, directory: str, *, max_shard_bytes: int = 5 * 1024**3,
                    dtype: str | None = None,
                    quantization_config: dict[str, Any] | None = None) -> list[str]:
  """Write ``model`` as a Hugging Face directory that transformers loads.

  Writes ``config.json`` (transformers-5 layout) and ``model.safetensors`` (or
  shards plus an index) in the parameters' dtype, or in ``dtype`` (``bfloat16``,
  ``float16`` or ``float32``; ``config.json`` says so too). Existing files of the
  same names are replaced atomically, each only once its new version is complete.
  Returns the written file names.

  ``quantization_config`` writes the weights quantized, in a release format
  (``{'quant_method': 'fp8', 'weight_block_size': [128, 128]}`` as DeepSeek V3,
  or ``{'quant_method': 'mxfp4'}`` as GPT-OSS; see
  :func:`maxnnx.checkpoint.quantized.quantize_tensors` for which tensors), and
  ``config.json`` carries it. Pass the ``quantization_config`` of the release a
  model was loaded from to send a fine-tuned model back in its own format:
  unchanged weights get back their bytes.

  A model whose parameters span several processes (a multi-process run) is saved by
  all of them: every process calls it with the same ``directory`` (shared by the
  processes), each parameter is gathered one
  layer at a time, process ``p`` writes the decoder layers ``i`` with
  ``i % num_processes == p`` into shard files of its own, and process 0 also the
  embedding, head, norms, the index and ``config.json``; no process holds more
  than its share of the model.
  """
  family = _saveable_family(model, dtype)
  cfg = model.config
  hf_config = family.config_to_hf(cfg)
  if dtype is not None:
    hf_config['dtype'] = dtype
  state = nnx.state(model, nnx.Param)
  together = any(isinstance(x, jax.Array) and not x.is_fully_addressable
                 for x in jax.tree.leaves(state))
  processes = jax.process_count() if together else 1
  keep = None
  if together:  # each process writes its share of the layers (see _writer_of)
    keep = lambda path: _writer_of(path, cfg, processes) == jax.process_index()  # noqa: E731
  tensors = _hf_tensors(model, state, family, dtype, keep)
  if quantization_config is not None:
    try:
      tensors = quantize_tensors(tensors, quantization_config)
    except QuantizationError as e:
      raise PretrainedError(f'save_pretrained quantization_config: {e}') from None
    hf_config['quantization_config'] = dict(quantization_config)
  os.makedirs(directory, exist_ok=True)
  if together:
    files = _write_process_shards(directory, tensors, max_shard_bytes)
  else:
    files = write_sharded(directory, tensors, max_shard_bytes)
  if not together or is_primary():
    _write_json(os.path.join(directory, 'config.json'), hf_config)
  if together:
    barrier('save_pretrained')  # every file is written when any process returns
  return ['config.json', *files]


def _saveable_family(model: Transformer, dtype: str | None):
  """The model's family mapping, after refusing what :func:`save_pretrained` cannot write:
  an unknown ``dtype``, a family without a mapping, LoRA adapters, MTP layers the family's
  checkpoints do not have."""
  if dtype is not None and dtype not in EXPORT_DTYPES:
    raise ValueError(f"save_pretrained dtype={dtype!r}: expected one of "
                     f"{', '.join(EXPORT_DTYPES)} (or None: the parameters' own).")
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
  return family


def _hf_tensors(model: Transformer, state, family, dtype: str | None, keep) -> dict:
  """The parameters ``state`` of ``model`` as Hugging Face tensors by name, in ``dtype``
  (``None``: their own), with the MTP layers' copies of the shared embedding and head and
  fused where the family fuses; ``keep(path)`` picks the parameters this process writes
  (``None``: all)."""
  cfg = model.config
  n_in = _kernel_input_dims(model)
  tensors = {}
  for path, array in _unscanned_param_values(state, cfg, keep).items():
    kernel_n_in = n_in[_module_key(path)] if path[-1] == 'kernel' else None
    name = family.hf_name(hf_layer_path(path, cfg.num_layers))
    tensor = _ours_to_hf(np.asarray(array), kernel_n_in, path[-1])
    if dtype is not None and (np.issubdtype(tensor.dtype, np.floating)
                              or tensor.dtype == ml_dtypes.bfloat16):
      tensor = tensor.astype(EXPORT_DTYPES[dtype])
    tensors[name] = tensor
  for k in range(cfg.mtp.num_layers):  # the Hub layout repeats the shared embedding and head
    for suffix, main in MTP_SHARED_COPIES.items():
      main = 'model.embed_tokens.weight' if cfg.tie_word_embeddings else main
      if main in tensors:  # (process 0's in a multi-process save, like the MTP layers)
        tensors[f'model.layers.{cfg.num_layers + k}.{suffix}'] = tensors[main]
  if family.fuse is not None:
    tensors = family.fuse(tensors, cfg)
  return tensors


def _write_json(path: str, data: dict) -> None:
  """Write ``data`` to ``path`` beside it first, then rename it over any old file."""
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(data, f, indent=2)
  os.replace(tmp, path)


# -- multi-token prediction ----------------------------------------------------------------------


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
  """Write the HF tensor ``array`` into ``out`` (of ``shape``, contiguous) in our layout and
  dtype. A tensor of the file is copied :data:`CHUNK_BYTES` of rows at a time, its pages
  released after each, so the file's pages and the converted copy are never both whole in
  memory (for the largest tensor, an embedding, that was 0.16x of a quantized checkpoint)."""
  if isinstance(array, Dequantized):  # computed whole when read
    values = np.asarray(array)
    out[...] = values.T.reshape(shape) if n_in is not None else values.reshape(shape)
    return
  if n_in is not None:  # HF Linear weight [out, in] -> kernel [in..., out...]
    target = out.reshape(int(np.prod(shape[:n_in])), -1).T  # a view, [out, in]
  else:
    target = out.reshape(array.shape)
  if array.ndim == 0:
    target[...] = array
    return
  for rows in row_chunks(array.shape[0], array.nbytes // max(1, array.shape[0])):
    target[rows] = array[rows]
    release(array)


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


def _unscanned_param_values(state, cfg: ModelConfig, keep=None) -> dict[tuple, np.ndarray]:
  """``{unscanned path: host array}`` of ``state``, only the paths ``keep(path)`` accepts.

  A parameter that spans several processes is gathered one layer at a time (every process
  takes part in every gather, then keeps only its own layers).
  """
  values, stacks = {}, _stacks(cfg)
  keep = keep or (lambda path: True)
  for path, var in nnx.to_flat_state(state):
    array = var[...]
    spans_processes = isinstance(array, jax.Array) and not array.is_fully_addressable
    if path[0] in stacks:
      start, count = stacks[path[0]]
      whole = None if spans_processes else host_value(array)
      for i in range(count):
        layer_path = ('layers', start + i, *path[1:])
        layer = host_value(array[i]) if spans_processes else whole[i]
        if keep(layer_path):
          values[layer_path] = layer
    elif keep(tuple(path)):
      values[tuple(path)] = host_value(array)
    elif spans_processes:
      host_value(array)  # the others gather it: take part
  return values


def _writer_of(path: tuple, cfg: ModelConfig, processes: int) -> int:
  """The process that writes the tensor of unscanned ``path`` in a multi-process save:
  decoder layer ``i`` goes to process ``i % processes``, everything else to process 0."""
  if path[0] == 'layers' and path[1] < cfg.num_layers:
    return path[1] % processes
  return 0


def _write_process_shards(directory: str, tensors: dict[str, np.ndarray],
                          max_shard_bytes: int) -> list[str]:
  """This process's share of a multi-process save: its tensors in its own shard files,
  numbered after the files of the processes before it; process 0 writes the index."""
  shards = plan_shards(tensors, max_shard_bytes)
  counts = [int(c) for c in allgather_bytes(str(len(shards)).encode())]
  first, total = sum(counts[:jax.process_index()]), sum(counts)
  names = [f'model-{first + i + 1:05d}-of-{total:05d}.safetensors' for i in range(len(shards))]
  weight_map = {}
  for name, shard in zip(names, shards):
    write_safetensors(os.path.join(directory, name), shard, {'format': 'pt'})
    weight_map.update({t: name for t in shard})
  mine = json.dumps({'weight_map': weight_map,
                     'total_size': sum(t.nbytes for t in tensors.values())})
  everyone = [json.loads(part) for part in allgather_bytes(mine.encode())]
  if is_primary():
    merged = {}
    for part in everyone:
      merged.update(part['weight_map'])
    index = {'metadata': {'total_size': sum(part['total_size'] for part in everyone)},
             'weight_map': dict(sorted(merged.items()))}
    _write_json(os.path.join(directory, 'model.safetensors.index.json'), index)
  all_names = [f'model-{i + 1:05d}-of-{total:05d}.safetensors' for i in range(total)]
  return ['model.safetensors.index.json', *all_names]


def _shardings(abstract_state, mesh: MeshConfig | Mesh | None, rules: dict | None):
  """Where each variable goes: a ``NamedSharding`` per variable, or None (the first device)."""
  if mesh is None:
    return None
  if isinstance(mesh, MeshConfig):
    rules = logical_rules(mesh) if rules is None else rules
    mesh = make_mesh(mesh)
  return dict(nnx.to_flat_state(state_shardings(abstract_state, mesh, rules)))


def _place_params(sources: dict, abstract_state, cfg: ModelConfig, shardings: dict | None,
                  keep_quantized: bool = False):
  """The model's state, each parameter converted from its HF tensor(s) and placed on its shards
  one at a time (see the module doc); other variables (MoE routing statistics) start at zero."""
  placed = []
  for path, var, host in _host_params(sources, abstract_state, cfg, keep_quantized):
    sharding = None if shardings is None else shardings[path].get_value()
    if isinstance(host, QuantizedHost):
      import qwix  # noqa: PLC0415  (a slow import, for kept-quantized loads only)
      value = qwix.QArray(place_host_value(host.qvalue, sharding),
                          place_host_value(host.scale, scale_sharding(sharding, host.scale)),
                          qtype=jnp.dtype(host.qvalue.dtype))
    else:
      value = place_host_value(host, sharding)
    placed.append((path, var.replace(value)))
    del host  # before the generator converts the next one: one host buffer at a time
  return nnx.from_flat_state(placed)


def _host_params(sources: dict, abstract_state, cfg: ModelConfig, keep_quantized: bool = False):
  """``(path, abstract variable, host value)`` of every variable, made one at a time: each
  parameter converted from its HF tensor(s), whose file pages are then released; other
  variables (MoE routing statistics) zeros. With ``keep_quantized``, a kernel whose tensors
  are all stored
  :class:`~maxnnx.checkpoint.quantized.BlockScaled` comes as a :class:`QuantizedHost`."""
  stacks = _stacks(cfg)
  for path, var in nnx.to_flat_state(abstract_state):
    if not isinstance(var, nnx.Param):
      yield path, var, _initial_value(path, var, stacks)
      continue
    if path[0] in stacks:
      start, count = stacks[path[0]]
      layers = [sources[('layers', start + i, *path[1:])] for i in range(count)]
    else:
      layers = [sources[tuple(path)]]
    if keep_quantized and (quantized := quantized_kernel(layers, path[0] in stacks)
                           or quantized_experts(layers, path[0] in stacks)):
      yield path, var, quantized
      del quantized
      continue
    host = host_buffer(var.shape, var.dtype)  # see host_buffer: malloc's heap would drift
    parts = list(zip(host if path[0] in stacks else [host], layers))
    for out, (array, shape, n_in) in parts:
      _hf_to_ours(array, shape, n_in, out)
      release(array)
    del parts
    yield path, var, host
    del host


def _initial_value(path: tuple, var, stacks: dict) -> np.ndarray:
  """A non-parameter variable's starting value: a layer's dropout seed is its index
  (:mod:`maxnnx.layers.dropout`), anything else (MoE routing statistics) zeros."""
  if isinstance(var, DropoutSeed):
    if path[0] in stacks:
      start, count = stacks[path[0]]
      return np.arange(start, start + count, dtype=var.dtype)
    return np.asarray(path[1], var.dtype)  # ('layers', i, 'dropout_seed')
  return np.zeros(var.shape, var.dtype)


def _to_model_layout(values: dict[tuple, np.ndarray], abstract_state, cfg: ModelConfig, convert):
  """Fill ``abstract_state`` from per-layer ``values`` (stacking if scanned)."""
  flat, stacks = [], _stacks(cfg)
  for path, var in nnx.to_flat_state(abstract_state):
    if not isinstance(var, nnx.Param):  # MoE routing statistics, dropout seeds
      flat.append((path, var.replace(jnp.asarray(_initial_value(path, var, stacks)))))
      continue
    if path[0] in stacks:
      start, count = stacks[path[0]]
      array = np.stack([values[('layers', i, *path[1:])] for i in range(start, start + count)])
    else:
      array = values[tuple(path)]
    flat.append((path, var.replace(convert(array))))
  return nnx.from_flat_state(flat)


__all__ = ['FAMILIES', 'PretrainedError', 'SafetensorsError', 'config_from_pretrained',
           'from_maxtext', 'from_pretrained', 'host_params', 'save_pretrained']

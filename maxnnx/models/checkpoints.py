"""Model parameters in and out of orbax checkpoints (for fine-tuning and ``maxnnx convert``).

A training checkpoint holds ``(model, optimizer)``; :func:`load_params` reads
only the model's parameters from it, in whichever layer layout the model has:
a checkpoint of a scanned model (layers stacked on a leading axis) loads into
an unscanned one and the other way round. :func:`save_params` writes a
parameter-only checkpoint in the same format.
"""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxnnx.checkpoint.manager import CheckpointError, CheckpointManager, read_meta, restore_params
from maxnnx.config import ModelConfig
from maxnnx.models.pretrained import _stacks, _to_model_layout, _unscanned_param_values
from maxnnx.models.transformer import Transformer


def checkpoint_config(checkpoint_dir: str, step: int | None = None) -> ModelConfig:
  """The :class:`ModelConfig` stored with an orbax checkpoint."""
  meta = read_meta(checkpoint_dir, step)
  if 'model_config' not in meta:
    raise CheckpointError(f'{checkpoint_dir}: checkpoint step {meta["step"]} has no model config.')
  return ModelConfig.from_stored_dict(meta['model_config'])


def _abstract_params(cfg: ModelConfig) -> nnx.State:
  return nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)


def load_params(model: Transformer, checkpoint_dir: str, step: int | None = None) -> Transformer:
  """Replace ``model``'s parameters by those of an orbax checkpoint; returns ``model``.

  Only the parameters are read (not the optimizer state). The checkpoint may
  be of the scanned or the unscanned layout; the values land in ``model``'s
  own layout, dtype and shardings.

  Raises:
    CheckpointError: no checkpoint, or one of a model with other parameter shapes.
  """
  saved_cfg = checkpoint_config(checkpoint_dir, step)
  saved_abstract = _abstract_params(saved_cfg)
  pure, _ = restore_params(checkpoint_dir, nnx.to_pure_dict(saved_abstract), step)
  saved_state = jax.tree.map(lambda x: x, saved_abstract)
  nnx.replace_by_pure_dict(saved_state, pure)
  values = _unscanned_param_values(saved_state, saved_cfg)

  target = nnx.state(model, nnx.Param)
  cfg = model.config
  flat = dict(nnx.to_flat_state(target))
  stacks = _stacks(cfg)  # scanned stacks (a dense prefix has its own): listed per layer
  for path, var in flat.items():
    start, count = stacks.get(path[0], (None, 0))
    keys = [('layers', start + i, *path[1:]) for i in range(count)] if count else [path]
    shape = tuple(var.shape[1:]) if count else tuple(var.shape)
    for key in keys:
      if key not in values:
        raise CheckpointError(f"{checkpoint_dir}: no parameter {'.'.join(map(str, key))} for "
                              'this model (different architecture or num_layers?).')
      if tuple(values[key].shape) != shape:
        raise CheckpointError(f"{checkpoint_dir}: parameter {'.'.join(map(str, key))} has shape "
                              f'{tuple(values[key].shape)}, the model needs {shape}.')
  new = _to_model_layout(values, target, cfg, np.asarray)
  placed = [(path, var.replace(jax.device_put(jnp.asarray(var[...], flat[path].dtype),
                                              flat[path][...].sharding)))
            for path, var in nnx.to_flat_state(new)]
  nnx.update(model, nnx.from_flat_state(placed))
  return model


def save_params(model: Transformer, checkpoint_dir: str, step: int = 0) -> str:
  """Write ``model``'s parameters as an orbax checkpoint that :func:`load_params` reads.

  Returns the directory. The layer layout written is the model's
  (``model.config.runtime.scan_layers``).
  """
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  manager = CheckpointManager(checkpoint_dir, async_save=False)
  try:
    if not manager.save(step, {0: params}, None, {'model_config': model.config.to_dict(),
                                                  'params_only': True}):
      raise CheckpointError(f'{checkpoint_dir} already has a checkpoint of step {step}; choose '
                            'an empty directory.')
    manager.wait()
  finally:
    manager.close()
  return checkpoint_dir


def save_params_streaming(cfg: ModelConfig, params, checkpoint_dir: str, *, step: int = 0,
                          group_bytes: int = 16 * 2**20) -> str:
  """Write the checkpoint :func:`save_params` writes, from ``(path, NumPy array)`` pairs
  (:func:`~maxnnx.models.pretrained.host_params`) that arrive one at a time, without a model:
  parameters are handed to orbax in groups of about ``group_bytes`` (orbax's partial save),
  so the host holds one group, not the model. Returns the directory.

  The step is assembled beside the others (``.<step>.streaming/``, removed afterwards,
  also on failure) and renamed into place once complete, so a run stopped half-way leaves
  no step that looks finished. Needs a
  local ``checkpoint_dir`` (a bucket URL takes :func:`save_params`).

  Raises:
    CheckpointError: ``checkpoint_dir`` already has that step.
  """
  directory = os.path.abspath(checkpoint_dir)
  final, scratch = os.path.join(directory, str(step)), os.path.join(directory, f'.{step}.streaming')
  if os.path.exists(final):
    raise CheckpointError(f'{checkpoint_dir} already has a checkpoint of step {step}; choose '
                          'an empty directory.')
  shutil.rmtree(scratch, ignore_errors=True)  # a stopped earlier attempt
  try:
    _stream_into(cfg, params, os.path.join(scratch, str(step)), step, group_bytes)
    os.replace(os.path.join(scratch, str(step)), final)
  finally:  # finished or failed, nothing is left beside the steps
    shutil.rmtree(scratch, ignore_errors=True)
  return checkpoint_dir


def _stream_into(cfg: ModelConfig, params, staged: str, step: int, group_bytes: int) -> None:
  """Write the step of :func:`save_params_streaming` into ``staged``."""
  import orbax.checkpoint as ocp  # noqa: PLC0415
  from orbax.checkpoint.experimental.v1 import partial  # noqa: PLC0415

  from maxnnx.checkpoint.manager import FORMAT_VERSION, host_checksum  # noqa: PLC0415
  group, size, sums, saved = {}, 0, {}, False
  for path, array in params:
    sums[jax.tree_util.keystr((jax.tree_util.DictKey(0), *map(jax.tree_util.DictKey, path)))] = \
        host_checksum(array)
    node = group
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = array
    size += array.nbytes
    if size >= group_bytes:
      partial.save(staged, {0: group})
      group, size, saved = {}, 0, True
  if group or not saved:
    partial.save(staged, {0: group})
  del group
  partial.finalize(staged)
  record = {'model_config': cfg.to_dict(), 'params_only': True, 'step': int(step),
            'format': FORMAT_VERSION, 'checksums': {'state': sums}}
  checkpointer = ocp.Checkpointer(ocp.JsonCheckpointHandler())
  try:
    checkpointer.save(os.path.join(staged, 'meta'), args=ocp.args.JsonSave(record))
  finally:
    checkpointer.close()


__all__ = ['checkpoint_config', 'load_params', 'save_params', 'save_params_streaming']

"""Model parameters in and out of orbax checkpoints (for fine-tuning and ``maxnnx convert``).

A training checkpoint holds ``(model, optimizer)``; :func:`load_params` reads
only the model's parameters from it, in whichever layer layout the model has:
a checkpoint of a scanned model (layers stacked on a leading axis) loads into
an unscanned one and the other way round. :func:`save_params` writes a
parameter-only checkpoint in the same format.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxnnx.checkpoint.manager import CheckpointError, CheckpointManager, read_meta, restore_params
from maxnnx.config import ModelConfig
from maxnnx.models.pretrained import _to_model_layout, _unscanned_param_values
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
  for path, var in flat.items():
    per_layer = cfg.runtime.scan_layers and path[0] == 'layers'
    keys = [(path[0], i, *path[1:]) for i in range(cfg.num_layers)] if per_layer else [path]
    shape = tuple(var.shape[1:]) if per_layer else tuple(var.shape)
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


__all__ = ['checkpoint_config', 'load_params', 'save_params']

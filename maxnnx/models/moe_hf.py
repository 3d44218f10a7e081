"""Hugging Face helpers shared by the Mixture-of-Experts families.

Hub checkpoints store each expert as its own ``Linear`` (``experts.{e}.gate_proj.weight``
``[mlp, d_model]``); our :class:`~maxnnx.layers.moe.Experts` stack them as
``[experts, d_model, mlp]``. :func:`expert_hooks` builds the ``unfuse``/``fuse``
pair that converts between the two, and :func:`moe_layout` turns a per-layer
MoE/dense pattern into ``moe.first_k_dense_layers`` + ``moe.layer_step``.
"""

from collections.abc import Sequence

import numpy as np

from maxnnx.config import ModelConfig
from maxnnx.models.hf import PretrainedError, TensorDict

# our expert projection -> HF name inside experts.{e}
SWIGLU_NAMES = {'gate_proj': 'gate_proj', 'up_proj': 'up_proj', 'down_proj': 'down_proj'}


def moe_layout(is_moe: Sequence[bool], path: str) -> dict:
  """``MoEConfig`` fields ``first_k_dense_layers`` and ``layer_step`` reproducing ``is_moe``
  per layer."""
  moe = [i for i, m in enumerate(is_moe) if m]
  if not moe:
    return dict(first_k_dense_layers=0, layer_step=1)
  k = moe[0]
  step = moe[1] - moe[0] if len(moe) > 1 else 1
  layout = dict(first_k_dense_layers=k, layer_step=step)
  rebuilt = [i >= k and (i - k) % step == 0 for i in range(len(is_moe))]
  if rebuilt != list(is_moe):
    raise PretrainedError(f'{path}: MoE layers {moe} are not a dense prefix followed by every '
                          'n-th layer; maxnnx cannot represent this layout.')
  return layout


def expert_hooks(module: str, names: dict[str, str] = SWIGLU_NAMES):
  """``(unfuse, fuse)`` hooks between per-expert HF tensors and stacked ones.

  Args:
    module: the HF name of the MoE block inside a layer (``mlp``, ``block_sparse_moe``).
    names: our projection name -> the HF name of each expert's ``Linear``.
  """

  def layers(cfg: ModelConfig):
    mtp = range(cfg.num_layers, cfg.num_layers + cfg.mtp.num_layers) if cfg.moe.num_experts else []
    return [i for i, m in enumerate(cfg.moe_layers) if m] + list(mtp)  # MTP blocks are MoE

  def unfuse(tensors: TensorDict, cfg: ModelConfig) -> TensorDict:
    out = dict(tensors)
    for i in layers(cfg):
      prefix = f'model.layers.{i}.{module}.experts'
      for ours, theirs in names.items():
        keys = [f'{prefix}.{e}.{theirs}.weight' for e in range(cfg.moe.num_experts)]
        if not all(k in out for k in keys):
          continue  # the loader then reports the stacked name as missing
        pieces = [out.pop(k) for k in keys]
        shapes = {p[1].shape for p in pieces}
        if len(shapes) != 1:
          raise PretrainedError(f'{pieces[0][0]}: experts of layer {i} have different '
                                f'{theirs} shapes {sorted(shapes)}.')
        stacked = np.stack([np.asarray(p[1]) for p in pieces]).transpose(0, 2, 1)
        out[f'{prefix}.{ours}'] = (pieces[0][0], stacked)
    return out

  def fuse(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    out = dict(tensors)
    for i in layers(cfg):
      prefix = f'model.layers.{i}.{module}.experts'
      for ours, theirs in names.items():
        d, f = cfg.d_model, cfg.resolved_moe_mlp_dim
        shape = (cfg.moe.num_experts, f, d) if ours == 'down_proj' else (cfg.moe.num_experts, d, f)
        if f'{prefix}.{ours}' not in out:  # a layer another process writes
          continue
        stacked = out.pop(f'{prefix}.{ours}').reshape(shape)  # written flat by the exporter
        for e in range(cfg.moe.num_experts):
          out[f'{prefix}.{e}.{theirs}.weight'] = np.ascontiguousarray(stacked[e].T)
    return out

  return unfuse, fuse

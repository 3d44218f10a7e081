"""Hugging Face helpers shared by the Mixture-of-Experts families.

Hub checkpoints store each expert as its own ``Linear`` (``experts.{e}.gate_proj.weight``
``[mlp, d_model]``); our :class:`~maxnnx.layers.moe.Experts` stack them as
``[experts, d_model, mlp]``. :func:`expert_hooks` builds the ``unfuse``/``fuse``
pair that converts between the two, and :func:`moe_layout` turns a per-layer
MoE/dense pattern into ``moe.first_k_dense_layers`` + ``moe.layer_step``.

The stacked tensors a load sees are :class:`ExpertStack` views, read expert by expert when the
loader converts them: stacking every layer's experts up front held the whole MoE part of a
checkpoint (dequantized, for an fp8 release) in memory before the first parameter was placed.
"""

import math
from collections.abc import Sequence

import numpy as np

from maxnnx.checkpoint.quantized import release
from maxnnx.config import ModelConfig
from maxnnx.models.hf import PretrainedError, TensorDict


class ExpertStack:
  """Per-expert HF ``Linear`` weights ``[out, in]`` seen as one ``[experts, in, out]`` array,
  read only when indexed or converted.

  Attributes:
    pieces: the per-expert weights (memory-mapped arrays or
      :class:`~maxnnx.checkpoint.quantized.Dequantized` views).
    shape: ``(experts, in, out)``.
    dtype: the pieces' dtype.
  """

  def __init__(self, pieces: list):
    self.pieces = pieces
    out, inputs = pieces[0].shape
    self.shape = (len(pieces), inputs, out)
    self.dtype = np.dtype(pieces[0].dtype)

  @property
  def ndim(self) -> int:
    """Number of axes (3)."""
    return 3

  @property
  def size(self) -> int:
    """Number of values."""
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    """Bytes of the stacked array."""
    return self.size * self.dtype.itemsize

  def __getitem__(self, experts) -> np.ndarray:
    """The experts ``experts`` (an index or a slice of the first axis), stacked."""
    if isinstance(experts, int):
      return np.asarray(self.pieces[experts]).T
    return np.stack([np.asarray(p).T for p in self.pieces[experts]])

  def __array__(self, dtype=None, copy=None):
    array = self[:]
    return array if dtype is None else array.astype(dtype, copy=False)

  def release(self) -> None:
    """Drop the resident file pages of every piece."""
    for piece in self.pieces:
      release(piece)

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
        out[f'{prefix}.{ours}'] = (pieces[0][0], ExpertStack([p[1] for p in pieces]))
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

"""A quantized release's weights kept as stored (``from_pretrained(keep_quantized=True)``).

Each kept kernel becomes a qwix ``QArray`` of the file's own values and scales: fp8 blocks
(as tiles that divide the kernel's axes, a block's scale repeated over the tiles it spans),
per-channel fp8/int8, packed int4, DeepSeek's per-expert fp8 blocks stacked per projection,
and GPT-OSS's MXFP4 experts (4-bit floats with a power-of-two scale per 32 inputs). No float
copy of a kept kernel is made.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from maxnnx.checkpoint.quantized import MX_GROUP, MXStored, release
from maxnnx.checkpoint.safetensors import host_buffer, row_chunks
from maxnnx.layers.linear import DenseGeneral


class QuantizedHost(NamedTuple):
  """A kernel kept quantized, on the host: stored values and scales in the kernel's layout."""

  qvalue: np.ndarray
  scale: np.ndarray


def quantized_kernel(layers: list, stacked: bool) -> QuantizedHost | None:
  """The kernel of ``layers``' HF tensors (one per stacked layer) with their stored values and
  scales, if every one is a linear weight stored
  :class:`~maxnnx.checkpoint.quantized.BlockScaled` in the same blocks."""
  forms = [getattr(array, 'stored', None) for array, _, _ in layers]
  _, shape, n_in = layers[0]
  if n_in is None or any(f is None or f.block != forms[0].block for f in forms):
    return None
  in_dims, out_dims = shape[:n_in], shape[n_in:]
  cols, rows = math.prod(in_dims), math.prod(out_dims)
  (t_out, out_scale), (t_in, in_scale) = (_tile(out_dims, forms[0].block[0]),
                                          _tile(in_dims, forms[0].block[1]))
  lead = (len(layers),) if stacked else ()
  qvalue, scale = None, np.empty(lead + in_scale + out_scale, np.float32)
  for i, (form, (array, _, _)) in enumerate(zip(forms, layers)):
    for chunk in row_chunks(rows, 4 * cols):  # (int4 is unpacked through int32)
      values = form.values(chunk)
      if qvalue is None:
        qvalue = host_buffer(lead + shape, values.dtype)
      elif values.dtype != qvalue.dtype:
        return None  # layers stored in different types: loaded in float
      # [out, in] rows of the file -> columns of the [in, out] kernel (a view of qvalue)
      (qvalue[i] if stacked else qvalue).reshape(cols, rows).T[chunk] = values
      del values
      release(array)
    br, bc = form.block
    by_tile = form.scale[(np.arange(rows // t_out) * t_out) // br][
        :, (np.arange(cols // t_in) * t_in) // bc]
    (scale[i] if stacked else scale)[...] = by_tile.T.reshape(in_scale + out_scale)
    release(array)
  return QuantizedHost(qvalue, scale)


def _mx_experts(layers: list, stacked: bool) -> QuantizedHost | None:
  """Routed experts ``[(layers,) experts, in, out]`` stored as MXFP4
  (:class:`~maxnnx.checkpoint.quantized.MXStored`): float4_e2m1fn values (a byte each on the
  host) and a power-of-two float32 scale per 32 inputs of an output channel."""
  forms = [getattr(array, 'stored', None) for array, _, _ in layers]
  if not all(isinstance(f, MXStored) for f in forms):
    return None
  _, shape, _ = layers[0]
  lead = (len(layers),) if stacked else ()
  qvalue = host_buffer(lead + shape, ml_dtypes.float4_e2m1fn)
  scale = np.empty(lead + shape[:-2] + (shape[-2] // MX_GROUP, shape[-1]), np.float32)
  for i, (form, (array, _, _)) in enumerate(zip(forms, layers)):
    for e in range(shape[0]):  # an expert at a time
      one = MXStored(form.blocks[e], form.scales[e])
      (qvalue[i] if stacked else qvalue)[e] = one.codes()
      (scale[i] if stacked else scale)[e] = one.scale()
      release(array)
  return QuantizedHost(qvalue, scale)


def quantized_experts(layers: list, stacked: bool) -> QuantizedHost | None:
  """Routed experts ``[(layers,) experts, in, out]`` from per-expert HF weights that are all
  stored :class:`~maxnnx.checkpoint.quantized.BlockScaled` in the same blocks, with one scale
  per expert, output channel and tile of inputs (the form ``qwix.ragged_dot`` takes)."""
  if layers[0][2] is None and len(layers[0][1]) == 3:
    return _mx_experts(layers, stacked) if not hasattr(layers[0][0], 'pieces') else (
        _block_experts(layers, stacked))
  return None


def _block_experts(layers: list, stacked: bool) -> QuantizedHost | None:
  """See :func:`quantized_experts`: the experts of ``ExpertStack`` views."""
  if not all(hasattr(array, 'pieces') for array, _, _ in layers):  # an ExpertStack
    return None
  forms = [[getattr(piece, 'stored', None) for piece in array.pieces] for array, _, _ in layers]
  block = forms[0][0].block if forms[0][0] is not None else None
  if any(f is None or f.block != block for per_layer in forms for f in per_layer):
    return None
  _, shape, _ = layers[0]
  experts, cols, rows = shape
  t_in, _ = _tile((cols,), block[1])
  lead = (len(layers),) if stacked else ()
  qvalue, scale = None, np.empty(lead + (experts, cols // t_in, rows), np.float32)
  for i, (per_layer, (array, _, _)) in enumerate(zip(forms, layers)):
    for e, form in enumerate(per_layer):
      values = form.values(slice(None))
      if qvalue is None:
        qvalue = host_buffer(lead + shape, values.dtype)
      elif values.dtype != qvalue.dtype:
        return None  # stored in different types: loaded in float
      (qvalue[i] if stacked else qvalue)[e] = values.T
      del values
      by_tile = form.scale[np.arange(rows) // block[0]][:, (np.arange(cols // t_in) * t_in)
                                                         // block[1]]
      (scale[i] if stacked else scale)[e] = by_tile.T
      release(array)
  return QuantizedHost(qvalue, scale)


def _tile(dims: tuple[int, ...], block: int) -> tuple[int, tuple[int, ...]]:
  """``(tile, scale shape)``: the largest ``tile`` dividing ``block`` and the flattened
  ``dims`` whose tiles are whole slices of the trailing axes or of one axis, and the shape a
  scale of one value per tile has over ``dims`` (what qwix broadcasts)."""
  common = math.gcd(math.prod(dims), block)
  for tile in sorted((t for t in range(1, common + 1) if common % t == 0), reverse=True):
    left, scale = tile, []
    for n in reversed(dims):
      if left == 1:
        scale.append(n)
      elif left % n == 0:
        scale.append(1)
        left //= n
      elif n % left == 0:
        scale.append(n // left)
        left = 1
      else:
        break
    else:
      if left == 1:
        return tile, tuple(reversed(scale))
  raise AssertionError('a tile of 1 always fits')  # pragma: no cover


def scale_sharding(sharding, scale: np.ndarray):
  """The kernel's sharding for its (smaller) scale: an axis stays split where the scale's
  length divides over its mesh axes, and is replicated where it does not."""
  if sharding is None:
    return None
  spec = tuple(sharding.spec) + (None,) * (scale.ndim - len(sharding.spec))

  def fits(entry, n):
    names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    return n % math.prod(sharding.mesh.shape[a] for a in names) == 0

  return NamedSharding(sharding.mesh, PartitionSpec(
      *(entry if fits(entry, n) else None for entry, n in zip(spec, scale.shape))))


def mark_quantized(model) -> int:
  """Mark every layer whose kernel loaded as a ``QArray`` with its mode (``fp8``, ``int8`` or
  ``int4``, weights only), as ``quantize_for_inference`` does; the number of weights kept
  quantized (routed experts, which need no mark, included)."""
  modes = {'float8_e4m3fn': 'fp8', 'float8_e5m2': 'fp8', 'int8': 'int8', 'int4': 'int4'}
  for _, module in nnx.iter_graph(model):
    if isinstance(module, DenseGeneral) and not isinstance(module.kernel[...], jax.Array):
      module.inference_quantization = modes[jnp.dtype(module.kernel[...].qtype).name]
  return sum(not isinstance(var[...], jax.Array)
             for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)))

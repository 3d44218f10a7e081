"""Quantized Hugging Face checkpoints: dequantized tensor by tensor as they load, quantized on save.

``config.json``'s ``quantization_config`` names the format; each is checked in
full before anything is read (dtypes, scale shapes, a scale for every quantized
weight), and a format not listed is refused naming its ``quant_method``:

* ``fp8`` (DeepSeek V3/R1/V3.1/V3.2, Kimi K2, the Qwen ``-FP8`` releases):
  ``W.weight`` float8_e4m3fn with ``W.weight_scale_inv`` (float32, bfloat16 or
  e8m0), one scale per ``weight_block_size`` block of the last two axes; the
  last block of a row or column may be partial. ``w = q * scale[i // br, j // bc]``.
* ``fbgemm_fp8`` (Llama 4's FP8 release): ``W.weight`` float8 with a
  per-row ``W.weight_scale`` that broadcasts against it.
* ``compressed-tensors`` (what vLLM users serve), formats ``float-quantized``,
  ``naive-quantized`` and ``int-quantized`` (``W.weight`` fp8 or int8) and
  ``pack-quantized`` (``W.weight_packed`` int32: each row one little-endian bit
  stream of ``num_bits``-bit values stored plus ``2 ** (num_bits - 1)``), with
  ``W.weight_scale`` per tensor, per output channel or per group of
  ``group_size`` inputs, symmetric (a ``weight_zero_point`` is refused).
* ``mxfp4`` (GPT-OSS): ``X_blocks`` uint8 ``[..., rows, groups, 16]`` (two
  e2m1 values per byte, low nibble first) with ``X_scales`` uint8
  ``[..., rows, groups]`` (e8m0: ``2 ** (s - 127)`` per 32 values); the
  dequantized ``[..., rows, groups * 32]`` is stored transposed, as
  transformers keeps GPT-OSS's experts (``[experts, in, out]``).

A quantized tensor becomes a :class:`Dequantized` view: it has the float
tensor's shape and is computed only when read, so a loader that converts one
tensor at a time holds one dequantized tensor at a time. A 2-D weight of the
fp8, fbgemm_fp8 and compressed-tensors formats also describes its stored form
(:class:`BlockScaled`: the stored values and one scale per block), from which
``from_pretrained(keep_quantized=True)`` builds a quantized kernel without
dequantizing it. Static activation
scales (``input_scale``) are read and dropped: maxnnx computes in float.

:func:`quantize_tensors` writes the ``fp8`` and ``mxfp4`` formats back. Its
rules are the releases' own (a block's scale is its largest magnitude over
448; an MX scale is ``floor(log2(amax)) - 2``), and a weight that was loaded
and not changed gets back the bytes it was loaded from (see
:func:`quantize_fp8_blocks`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from maxnnx.checkpoint.safetensors import release_pages

TensorDict = dict[str, tuple[str, Any]]  # name -> (file, array)

FP8_MAX = 448.0  # largest float8_e4m3fn magnitude
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
MX_GROUP = 32  # values per MX scale
_FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16),
                 np.dtype(ml_dtypes.float8_e8m0fnu))


class QuantizationError(ValueError):
  """A quantized checkpoint that is not what its ``quantization_config`` says, or a format
  maxnnx does not read."""


@dataclasses.dataclass(frozen=True)
class BlockScaled:
  """A 2-D weight as stored: ``w[i, j] = values[i, j] * scale[i // block[0], j // block[1]]``,
  computed in float32 (the last block of a row or column may be partial).

  Every format :func:`dequantize_checkpoint` reads for linear layers, except MXFP4, is this
  rule: fp8 blocks (``weight_block_size``), per row (fbgemm_fp8, compressed-tensors
  ``channel``: ``block = (1, cols)``), per group of inputs (``(1, group_size)``) and per tensor
  (``(rows, cols)``).

  Attributes:
    values: ``values(rows)`` returns the stored values of the rows in the slice ``rows``
      (``[n, cols]``) as float8, int8 or int4, read from the file (packed words unpacked), so
      that a loader can take a weight a few rows at a time.
    scale: ``[ceil(rows / block[0]), ceil(cols / block[1])]`` float32.
    block: ``(rows, cols)`` of a block.
  """

  values: Callable[[slice], np.ndarray]
  scale: np.ndarray
  block: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class MXStored:
  """MXFP4 experts as stored: ``blocks`` ``[..., rows, groups, 16]`` (two e2m1 codes a byte, low
  nibble first) and e8m0 ``scales`` ``[..., rows, groups]``; the weight they stand for is
  ``[..., groups * 32, rows]`` (see :func:`dequantize_mxfp4`).

  Attributes:
    blocks: the packed codes (a memory-mapped array or a view of one).
    scales: the exponents.
  """

  blocks: np.ndarray
  scales: np.ndarray

  def codes(self) -> np.ndarray:
    """float4_e2m1fn ``[..., groups * 32, rows]``: the stored values, unpacked, in the layout of
    the weight."""
    blocks = np.asarray(self.blocks)
    out = np.empty(blocks.shape[:-1] + (blocks.shape[-1] * 2,), np.uint8)
    out[..., 0::2], out[..., 1::2] = blocks & 0x0F, blocks >> 4
    out = out.reshape(blocks.shape[:-2] + (-1,)).view(ml_dtypes.float4_e2m1fn)
    return np.swapaxes(out, -1, -2)

  def scale(self) -> np.ndarray:
    """float32 ``[..., groups, rows]``: ``2 ** (s - 127)``, one per 32 values of a row."""
    exponents = np.asarray(self.scales).astype(np.int32) - 127
    return np.swapaxes(np.ldexp(np.float32(1), exponents).astype(np.float32), -1, -2)


class Dequantized:
  """A quantized tensor seen as the float32 array it stands for, computed when read.

  It has ``shape``, ``ndim`` and ``dtype`` like an array; ``np.asarray`` computes
  it; indexing gives another lazy view. :meth:`release` hands back the file
  pages of the stored parts (see :func:`~maxnnx.checkpoint.safetensors.release_pages`).

  Attributes:
    shape: the dequantized shape.
    parts: the stored arrays it is computed from.
    stored: the stored form: a :class:`BlockScaled` (a 2-D weight), an :class:`MXStored`
      (MXFP4 experts, also after selecting output columns), or ``None``.
  """

  dtype = np.dtype(np.float32)

  def __init__(self, shape: tuple[int, ...], compute: Callable[[], np.ndarray],
               parts: tuple[np.ndarray, ...], stored: BlockScaled | MXStored | None = None):
    self.shape = tuple(int(n) for n in shape)
    self._compute = compute
    self.parts = parts
    self.stored = stored

  @property
  def ndim(self) -> int:
    """Number of axes."""
    return len(self.shape)

  @property
  def size(self) -> int:
    """Number of values."""
    return math.prod(self.shape)

  def __array__(self, dtype=None, copy=None):
    array = self._compute()
    return array if dtype is None else array.astype(dtype, copy=False)

  def __getitem__(self, index) -> Dequantized:
    shape = np.broadcast_to(np.zeros((), np.float32), self.shape)[index].shape
    stored = None
    if (isinstance(self.stored, MXStored) and isinstance(index, tuple) and len(index) == 2
        and index[0] is Ellipsis and isinstance(index[1], slice)):
      columns = index[1]  # output columns are the stored rows (GPT-OSS's gate/up interleave)
      stored = MXStored(self.stored.blocks[..., columns, :, :], self.stored.scales[..., columns, :])
    return Dequantized(shape, lambda: self._compute()[index], self.parts, stored)

  def release(self) -> None:
    """Drop the resident file pages of the stored parts."""
    for part in self.parts:
      release_pages(part)


def release(array) -> None:
  """Release the file pages behind a memory-mapped array, a :class:`Dequantized` view or any
  lazy view with a ``release`` method."""
  if hasattr(array, 'release'):
    array.release()
  else:
    release_pages(array)


# -- the formats' rules, in NumPy ---------------------------------------------------------------


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray,
                          block: tuple[int, int]) -> np.ndarray:
  """``weight * scale_inv[i // block[0], j // block[1]]`` over the last two axes, float32."""
  rows, cols = weight.shape[-2:]
  scale = np.asarray(scale_inv).astype(np.float32)
  scale = np.repeat(np.repeat(scale, block[0], axis=-2)[..., :rows, :], block[1], axis=-1)
  return np.asarray(weight).astype(np.float32) * scale[..., :cols]


def quantize_fp8_blocks(values: np.ndarray, block: tuple[int, int],
                        scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
  """``(float8_e4m3fn weight, scale_inv)`` of ``values`` per ``block`` of the last two axes.

  A block's scale is its largest magnitude over 448 (DeepSeek's rule). Where a
  neighbour of that float32 scale (within 4 ulps) reproduces every value of the
  block exactly, that neighbour is taken instead: dequantized weights that were
  not changed since loading then get back the scales (and codes) they came from,
  byte for byte, though ``amax / 448`` of a rounded product can miss the stored
  scale by an ulp.
  """
  values = np.asarray(values, np.float32)
  rows, cols = values.shape[-2:]
  br, bc = block
  grid = (-(-rows // br), -(-cols // bc))
  padded = np.zeros(values.shape[:-2] + (grid[0] * br, grid[1] * bc), np.float32)
  padded[..., :rows, :cols] = values
  blocks = padded.reshape(values.shape[:-2] + (grid[0], br, grid[1], bc))
  amax = np.abs(blocks).max(axis=(-3, -1))
  base = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)

  def codes(scale):
    q = (blocks / scale[..., :, None, :, None]).astype(ml_dtypes.float8_e4m3fn)
    exact = (q.astype(np.float32) * scale[..., :, None, :, None] == blocks).all(axis=(-3, -1))
    return q, exact

  chosen_q, chosen = codes(base)
  chosen_scale, found = base.copy(), chosen.copy()
  for step in (1, -1, 2, -2, 3, -3, 4, -4):
    if found.all():
      break
    candidate = base.view(np.int32) + np.int32(step)
    candidate = np.where(found, base.view(np.int32), candidate).view(np.float32)
    q, exact = codes(candidate)
    take = exact & ~found
    chosen_scale = np.where(take, candidate, chosen_scale)
    chosen_q = np.where(take[..., :, None, :, None], q, chosen_q)
    found |= take
  weight = chosen_q.reshape(padded.shape)[..., :rows, :cols]
  return np.ascontiguousarray(weight), chosen_scale.astype(scale_dtype)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """MXFP4 ``blocks`` ``[..., R, G, 16]`` and e8m0 ``scales`` ``[..., R, G]`` -> float32
  ``[..., G * 32, R]`` (transposed, as transformers keeps GPT-OSS's experts)."""
  blocks, scales = np.asarray(blocks), np.asarray(scales)
  out = np.empty(blocks.shape[:-1] + (blocks.shape[-1] * 2,), np.float32)
  out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
  out[..., 1::2] = FP4_VALUES[blocks >> 4]
  out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127)
  out = out.reshape(blocks.shape[:-2] + (blocks.shape[-2] * blocks.shape[-1] * 2,))
  return np.ascontiguousarray(np.swapaxes(out, -1, -2))


def quantize_mxfp4(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Inverse of :func:`dequantize_mxfp4`: ``values`` ``[..., C, R]`` (C a multiple of 32)
  -> ``(blocks [..., R, C/32, 16], scales [..., R, C/32])``, both uint8.

  The OCP MX rule: a group's scale is ``2 ** (floor(log2(amax)) - 2)``, and each value
  is clipped to +-6 and rounded to the nearest e2m1 value (ties to the even code).
  """
  rows_last = np.swapaxes(np.asarray(values, np.float32), -1, -2)
  if rows_last.shape[-1] % MX_GROUP:
    raise QuantizationError(f'MXFP4 needs a multiple of {MX_GROUP} values per row, '
                            f'got {rows_last.shape[-1]}.')
  groups = rows_last.reshape(rows_last.shape[:-1] + (-1, MX_GROUP))
  amax = np.abs(groups).max(axis=-1)
  exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
  exponent = np.clip(exponent, -127, 127).astype(np.int32)
  scaled = np.clip(np.ldexp(groups, -exponent[..., None]), -6.0, 6.0)
  # the cast rounds to the nearest e2m1 value, ties to the even code, and keeps the sign of 0
  code = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & np.uint8(0x0F)
  packed = code[..., 0::2] | (code[..., 1::2] << 4)
  return packed.astype(np.uint8), (exponent + 127).astype(np.uint8)


def unpack_int32(packed: np.ndarray, bits: int, columns: int) -> np.ndarray:
  """compressed-tensors ``pack-quantized`` words -> signed integers ``[..., columns]``.

  Each row is one little-endian bit stream: value ``i`` holds bits
  ``[i * bits, (i + 1) * bits)``, stored plus ``2 ** (bits - 1)``.
  """
  words = np.ascontiguousarray(np.asarray(packed).astype('<u4'))
  stream = np.unpackbits(words.view(np.uint8), axis=-1, bitorder='little')
  fields = stream[..., :columns * bits].reshape(words.shape[:-1] + (columns, bits))
  unsigned = fields.astype(np.int32) @ (1 << np.arange(bits, dtype=np.int32))
  return unsigned - (1 << (bits - 1))


# -- reading a checkpoint -----------------------------------------------------------------------


def dequantize_checkpoint(tensors: TensorDict, quant: Mapping[str, Any] | None,
                          where: str) -> TensorDict:
  """``tensors`` with every quantized weight replaced by its :class:`Dequantized` view and
  its scales removed, after checking all of them against ``quant`` (``config.json``'s
  ``quantization_config``, or None). ``where`` names the config in errors."""
  if not quant or quant.get('dequantize') is True and not _stored_quantized(tensors):
    _refuse_quantized_without_config(tensors, where)
    return tensors
  method = quant.get('quant_method')
  readers = {'fp8': _read_fp8_blocks, 'fbgemm_fp8': _read_scaled,
             'compressed-tensors': _read_compressed, 'mxfp4': _read_mxfp4}
  if method not in readers:
    raise QuantizationError(
        f"{where}: quantization_config.quant_method '{method}' is not a format maxnnx reads "
        f"(it reads {', '.join(readers)}); dequantize the checkpoint first.")
  out = readers[method](dict(tensors), quant, where)
  if not any(isinstance(array, Dequantized) for _, array in out.values()):
    raise QuantizationError(
        f"{where}: quantization_config says quant_method '{method}' but no tensor is stored "
        'quantized; if the weights were saved dequantized, remove quantization_config (or set '
        '"dequantize": true in it).')
  for name in [n for n in out if n.endswith(('.input_scale', '.input_scale_ub'))]:
    del out[name]  # static activation scales: maxnnx computes in float
  return out


def _stored_quantized(tensors: TensorDict) -> bool:
  return any(n.endswith(('_scale_inv', '_scale', '_blocks', '_packed')) for n in tensors)


def _refuse_quantized_without_config(tensors: TensorDict, where: str) -> None:
  for name, (source, array) in tensors.items():
    if np.dtype(array.dtype) in _FP8_DTYPES or name.endswith(('_scale_inv', '_blocks')):
      raise QuantizationError(
          f"{source}: tensor '{name}' is quantized ({array.dtype}) but {where} has no "
          'quantization_config saying how; add the one the checkpoint was released with.')


def _scale_of(tensors: TensorDict, name: str, suffix: str, what: str, where: str):
  key = f'{name}{suffix}'
  if key not in tensors:
    source = tensors[name][0]
    raise QuantizationError(
        f"{source}: tensor '{name}' is {tensors[name][1].dtype} but '{key}' is missing, though "
        f'{where} says the weights are {what}; without it the weights would load wrong. '
        'Restore the scale tensors (or the checkpoint as released).')
  source, scale = tensors.pop(key)
  if np.dtype(scale.dtype) not in _SCALE_DTYPES:
    raise QuantizationError(f"{source}: scale '{key}' has dtype {scale.dtype}; expected one of "
                            'float32, bfloat16, float16, float8_e8m0fnu.')
  return source, scale


def _read_fp8_blocks(tensors: TensorDict, quant: Mapping, where: str) -> TensorDict:
  block = quant.get('weight_block_size')
  if (not isinstance(block, (list, tuple)) or len(block) != 2
      or not all(isinstance(b, int) and b > 0 for b in block)):
    raise QuantizationError(f'{where}: quantization_config.weight_block_size is {block!r}; '
                            'the fp8 format needs two positive block sizes [rows, cols].')
  block = (block[0], block[1])
  scaled = [n[:-len('_scale_inv')] for n in tensors if n.endswith('.weight_scale_inv')]
  for name in scaled:
    if name not in tensors:
      raise QuantizationError(f"{tensors[name + '_scale_inv'][0]}: scale '{name}_scale_inv' "
                              f"has no weight '{name}'.")
  for name in sorted(n for n, (_, a) in tensors.items() if np.dtype(a.dtype) in _FP8_DTYPES):
    source, weight = tensors[name]
    scale_source, scale = _scale_of(tensors, name, '_scale_inv', 'fp8 per block', where)
    grid = tuple(-(-n // b) for n, b in zip(weight.shape[-2:], block))
    if weight.ndim < 2 or scale.shape != weight.shape[:-2] + grid:
      raise QuantizationError(
          f"{scale_source}: scale '{name}_scale_inv' has shape {scale.shape}; a weight of "
          f'shape {weight.shape} in blocks of {list(block)} (weight_block_size) needs '
          f'{weight.shape[:-2] + grid}.')
    stored = (BlockScaled(lambda rows, w=weight: np.asarray(w[rows]), _float32(scale), block)
              if weight.ndim == 2 else None)
    tensors[name] = (source, Dequantized(
        weight.shape, lambda w=weight, s=scale: dequantize_fp8_blocks(w, s, block),
        (weight, scale), stored))
  leftover = [n for n in tensors if n.endswith('_scale_inv')]
  if leftover:
    raise QuantizationError(f"{tensors[leftover[0]][0]}: scale '{leftover[0]}' belongs to a "
                            'weight that is not float8; the checkpoint is inconsistent.')
  return tensors


def _read_scaled(tensors: TensorDict, quant: Mapping, where: str) -> TensorDict:
  """Weights with a ``weight_scale`` that broadcasts against them (fbgemm_fp8)."""
  for name in sorted(n for n, (_, a) in tensors.items() if np.dtype(a.dtype) in _FP8_DTYPES):
    source, weight = tensors[name]
    scale_source, scale = _scale_of(tensors, name, '_scale', 'fp8 per row', where)
    _check_broadcast(weight.shape, scale.shape, f'{name}_scale', scale_source)
    tensors[name] = (source, Dequantized(
        weight.shape, lambda w=weight, s=scale: np.asarray(w).astype(np.float32)
        * np.asarray(s).astype(np.float32), (weight, scale),
        _broadcast_blocks(lambda rows, w=weight: np.asarray(w[rows]), weight.shape, scale)))
  return tensors


def _check_broadcast(weight_shape, scale_shape, scale_name, source):
  padded = (1,) * (len(weight_shape) - len(scale_shape)) + tuple(scale_shape)
  if len(padded) != len(weight_shape) or any(s not in (1, w) for s, w in
                                             zip(padded, weight_shape)):
    raise QuantizationError(f"{source}: scale '{scale_name}' has shape {tuple(scale_shape)}, "
                            f'which does not fit a weight of shape {tuple(weight_shape)}.')


def _read_compressed(tensors: TensorDict, quant: Mapping, where: str) -> TensorDict:
  fmt = quant.get('format')
  known = ('float-quantized', 'naive-quantized', 'int-quantized', 'pack-quantized')
  if fmt not in known:
    raise QuantizationError(f"{where}: compressed-tensors format '{fmt}' is not read by maxnnx "
                            f"(it reads {', '.join(known)}); dequantize the checkpoint first.")
  groups = list((quant.get('config_groups') or {}).values())
  weights = [g.get('weights') or {} for g in groups]
  if len(weights) != 1:
    raise QuantizationError(f'{where}: compressed-tensors checkpoints with {len(weights)} '
                            'config_groups are not read yet (one group is).')
  scheme = weights[0]
  strategy, bits = scheme.get('strategy'), int(scheme.get('num_bits', 8))
  if strategy not in ('tensor', 'channel', 'group') or scheme.get('symmetric') is False:
    raise QuantizationError(
        f"{where}: compressed-tensors weights with strategy '{strategy}'"
        f"{'' if scheme.get('symmetric', True) else ', asymmetric'} are not read yet "
        '(symmetric tensor, channel and group strategies are).')
  group_size = scheme.get('group_size') if strategy == 'group' else None
  stored = [n for n in tensors if n.endswith('.weight_packed')] if fmt == 'pack-quantized' else [
      n for n, (_, a) in tensors.items() if n.endswith('.weight') and (
          np.dtype(a.dtype) in _FP8_DTYPES or np.dtype(a.dtype) == np.int8)]
  for stored_name in sorted(stored):
    name = stored_name.removesuffix('_packed')
    if f'{name}_zero_point' in tensors:
      raise QuantizationError(f"{tensors[stored_name][0]}: '{name}_zero_point' (asymmetric "
                              'weights) is not read yet.')
    source, values = tensors.pop(stored_name)
    tensors[name] = (source, values)  # replaced by its dequantized view below
    scale_source, scale = _scale_of(tensors, name, '_scale',
                                    f'compressed-tensors {strategy}-quantized', where)
    if fmt == 'pack-quantized':
      shape_name = f'{name}_shape'
      if shape_name not in tensors:
        raise QuantizationError(f"{source}: '{shape_name}' (the unpacked shape) is missing.")
      shape = tuple(int(n) for n in np.asarray(tensors.pop(shape_name)[1]))
      unpack = lambda v=values, c=shape[-1]: unpack_int32(v, bits, c)  # noqa: E731
      narrow = {4: ml_dtypes.int4, 8: np.int8}.get(bits)
      stored_values = None if narrow is None else (
          lambda rows, v=values, c=shape[-1], t=narrow: unpack_int32(v[rows], bits, c).astype(t))
    else:
      shape = tuple(values.shape)
      unpack = lambda v=values: np.asarray(v)  # noqa: E731
      stored_values = lambda rows, v=values: np.asarray(v[rows])  # noqa: E731
    expected = _compressed_scale_shape(shape, strategy, group_size)
    if int(np.prod(scale.shape)) != int(np.prod(expected)):
      raise QuantizationError(f"{scale_source}: scale '{name}_scale' has shape {scale.shape}; "
                              f'{strategy} quantization of {shape} needs {expected}.')
    stored = None
    if stored_values is not None and len(shape) == 2:
      block = {'tensor': shape, 'channel': (1, shape[1]), 'group': (1, group_size)}[strategy]
      stored = _broadcast_blocks(stored_values, shape, np.asarray(scale).reshape(expected),
                                 block)
    tensors[name] = (source, Dequantized(
        shape, lambda u=unpack, s=scale, e=expected, g=group_size: _apply_scale(u(), s, e, g),
        (values, scale), stored))
  return tensors


def _float32(scale) -> np.ndarray:
  return np.asarray(scale).astype(np.float32)


def _broadcast_blocks(values: Callable[[slice], np.ndarray], shape: tuple[int, ...], scale,
                      block: tuple[int, int] | None = None) -> BlockScaled | None:
  """The :class:`BlockScaled` form of a 2-D weight whose scale has one value per row, per
  column or per tensor (``block`` then follows from the shapes), or per ``block``."""
  if len(shape) != 2:
    return None
  scale = _float32(scale)
  scale = scale.reshape((1,) * (2 - scale.ndim) + scale.shape[-2:])
  if block is None:
    block = (shape[0] // scale.shape[0], shape[1] // scale.shape[1])
  return BlockScaled(values, scale, block)


def _compressed_scale_shape(shape, strategy, group_size) -> tuple[int, ...]:
  if strategy == 'tensor':
    return (1,)
  if strategy == 'channel':
    return (shape[0], 1)
  return (shape[0], -(-shape[1] // group_size))


def _apply_scale(values: np.ndarray, scale: np.ndarray, scale_shape, group_size) -> np.ndarray:
  scale = np.asarray(scale).astype(np.float32).reshape(scale_shape)
  if group_size:
    scale = np.repeat(scale, group_size, axis=-1)[..., :values.shape[-1]]
  return values.astype(np.float32) * scale


def _read_mxfp4(tensors: TensorDict, quant: Mapping, where: str) -> TensorDict:
  for blocks_name in sorted(n for n in tensors if n.endswith('_blocks')):
    name = blocks_name.removesuffix('_blocks')
    source, blocks = tensors.pop(blocks_name)
    if f'{name}_scales' not in tensors:
      raise QuantizationError(f"{source}: '{blocks_name}' has no '{name}_scales'; the MXFP4 "
                              'weights cannot be dequantized without their scales.')
    scale_source, scales = tensors.pop(f'{name}_scales')
    if (blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.ndim < 3
        or blocks.shape[-1] != MX_GROUP // 2 or blocks.shape[:-1] != scales.shape):
      raise QuantizationError(
          f"{source}: MXFP4 '{blocks_name}' {blocks.shape} {blocks.dtype} and '{name}_scales' "
          f'{scales.shape} {scales.dtype} do not fit: expected uint8 [..., rows, groups, 16] '
          'and uint8 [..., rows, groups].')
    shape = blocks.shape[:-3] + (blocks.shape[-2] * MX_GROUP, blocks.shape[-3])
    tensors[name] = (source, Dequantized(
        shape, lambda b=blocks, s=scales: dequantize_mxfp4(b, s), (blocks, scales),
        MXStored(blocks, scales)))
  leftover = [n for n in tensors if n.endswith('_scales')]
  if leftover:
    raise QuantizationError(f"{tensors[leftover[0]][0]}: '{leftover[0]}' has no blocks "
                            'tensor beside it.')
  return tensors


# -- writing a checkpoint -----------------------------------------------------------------------


def quantize_tensors(tensors: dict[str, np.ndarray], quant: Mapping[str, Any]
                     ) -> dict[str, np.ndarray]:
  """``tensors`` (a Hugging Face checkpoint in float) in the format ``quant`` names.

  ``fp8``: every 2-D ``model.layers.*.weight`` of a linear layer (not a norm, not
  the MoE router ``mlp.gate``, and none whose name contains an entry of
  ``modules_to_not_convert``) becomes float8_e4m3fn plus ``weight_scale_inv``
  (in the dtype ``scale_dtype`` names, default float32), as DeepSeek's releases
  are laid out. ``mxfp4``: each ``mlp.experts.gate_up_proj`` and
  ``mlp.experts.down_proj`` becomes ``_blocks`` and ``_scales``, as GPT-OSS's.
  """
  method = quant.get('quant_method')
  skip = tuple(quant.get('modules_to_not_convert') or ())
  out = dict(tensors)
  if method == 'fp8':
    block = tuple(quant.get('weight_block_size') or (128, 128))
    scale_dtype = {'float32': np.float32, 'bfloat16': ml_dtypes.bfloat16}[
        quant.get('scale_dtype', 'float32')]
    for name, array in tensors.items():
      if (name.startswith('model.layers.') and name.endswith('.weight') and array.ndim == 2
          and 'norm' not in name and not name.endswith('mlp.gate.weight')
          and not any(s in name for s in skip)):
        out[name], out[f'{name}_scale_inv'] = quantize_fp8_blocks(array, block, scale_dtype)
    return out
  if method == 'mxfp4':
    for name in tensors:
      if name.endswith(('mlp.experts.gate_up_proj', 'mlp.experts.down_proj')) and not any(
          s in name for s in skip):
        out[f'{name}_blocks'], out[f'{name}_scales'] = quantize_mxfp4(out.pop(name))
    return out
  raise QuantizationError(f"quantization_config.quant_method '{method}': maxnnx writes 'fp8' "
                          "(block-wise) and 'mxfp4'.")


__all__ = ['BlockScaled', 'Dequantized', 'MXStored', 'QuantizationError', 'dequantize_checkpoint',
           'dequantize_fp8_blocks', 'dequantize_mxfp4', 'quantize_fp8_blocks', 'quantize_mxfp4',
           'quantize_tensors', 'release', 'unpack_int32']

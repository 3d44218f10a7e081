"""torchvision's antialiased resize of uint8 images, bit for bit, in NumPy.

transformers' torchvision-backed image processors (Llama 4's is the only backend it has)
resize ``uint8`` tensors with ``torchvision.transforms.v2.functional.resize(...,
antialias=True)``, which on CPU runs PyTorch's integer resampler: per axis, a filter
(triangle for bilinear, Keys' cubic with ``a = -0.5`` for bicubic) stretched by the
downscale factor, weights computed in float64, normalised to sum to one, then rounded to
int16 at the largest precision (up to 22 bits) that keeps the biggest weight below
``2**15``. Each output value is ``(sum(weight * pixel) + 2**(precision-1)) >>
precision`` clamped to 0..255. The width is resampled first, its uint8 result then
resampled along the height; an axis whose size does not change is left alone.

Pillow's filters have the same shapes but 22-bit int32 weights, so they land one level
away on a few percent of pixels; :func:`resize_uint8` lands on torchvision's.
"""

from __future__ import annotations

import math

import numpy as np

_BILINEAR, _BICUBIC = 2, 3  # preprocessor_config.json's resample numbers


def _triangle(x: np.ndarray) -> np.ndarray:
  x = np.abs(x)
  return np.where(x < 1.0, 1.0 - x, 0.0)


def _keys_cubic(x: np.ndarray) -> np.ndarray:
  a = -0.5
  x = np.abs(x)
  near = ((a + 2) * x - (a + 3)) * x * x + 1
  far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
  return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


# resample number -> (filter, its support in input pixels at scale 1)
_FILTERS = {_BILINEAR: (_triangle, 2), _BICUBIC: (_keys_cubic, 4)}


def axis_weights(in_size: int, out_size: int, resample: int = _BILINEAR
                 ) -> tuple[np.ndarray, np.ndarray, int]:
  """One axis's resampling plan: ``(first input index [out], int16 weights [out, taps],
  precision)``; output ``i`` reads inputs ``first[i] + j`` for the nonzero weights."""
  if resample not in _FILTERS:
    raise ValueError(f'resample={resample}: the torchvision resize handles bilinear (2) and '
                     'bicubic (3).')
  filter_fn, interp_size = _FILTERS[resample]
  scale = in_size / out_size
  support = interp_size * 0.5 * scale if scale >= 1.0 else interp_size * 0.5
  taps = int(math.ceil(support)) * 2 + 1
  invscale = 1.0 / scale if scale >= 1.0 else 1.0
  center_O = scale * (np.arange(out_size) + 0.5)
  # C++ casts to int64 truncate toward zero.
  first_O = np.maximum(np.trunc(center_O - support + 0.5).astype(np.int64), 0)
  last_O = np.minimum(np.trunc(center_O + support + 0.5).astype(np.int64), in_size)
  count_O = np.clip(last_O - first_O, 0, taps)
  j_K = np.arange(taps)
  used_OK = j_K[None, :] < count_O[:, None]
  raw_OK = filter_fn(((j_K[None, :] + first_O[:, None]) - center_O[:, None] + 0.5) * invscale)
  raw_OK = np.where(used_OK, raw_OK, 0.0)
  total_O = np.zeros(out_size)
  for j in range(taps):  # summed in order, as the reference does
    total_O = total_O + raw_OK[:, j]
  safe_O = np.where(total_O != 0.0, total_O, 1.0)
  weights_OK = np.where(total_O[:, None] != 0.0, raw_OK / safe_O[:, None], 0.0)
  biggest = float(weights_OK.max()) if weights_OK.size else 0.0
  precision = 0
  while precision < 22 and int(0.5 + biggest * (1 << (precision + 1))) < (1 << 15):
    precision += 1
  scaled = weights_OK * (1 << precision)
  rounded = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5))
  return first_O, rounded.astype(np.int64), precision


def _resample_axis(pixels: np.ndarray, out_size: int, axis: int, resample: int) -> np.ndarray:
  moved = np.moveaxis(pixels, axis, 0).astype(np.int64)
  in_size = moved.shape[0]
  first_O, weights_OK, precision = axis_weights(in_size, out_size, resample)
  shape = (-1,) + (1,) * (moved.ndim - 1)
  acc = np.full((out_size,) + moved.shape[1:], 1 << (precision - 1) if precision else 0,
                np.int64)
  for j in range(weights_OK.shape[1]):
    index_O = np.minimum(first_O + j, in_size - 1)  # a zero weight wherever this clips
    acc += weights_OK[:, j].reshape(shape) * moved[index_O]
  out = np.clip(acc >> precision, 0, 255).astype(np.uint8)
  return np.moveaxis(out, 0, axis)


def resize_uint8(pixels_HWC: np.ndarray, height: int, width: int,
                 resample: int = _BILINEAR) -> np.ndarray:
  """``pixels_HWC`` (uint8, ``[H, W]`` or ``[H, W, C]``) resized to ``[height, width(, C)]``
  exactly as ``torchvision.transforms.v2.functional.resize(..., antialias=True)`` does on
  CPU. ``resample``: 2 bilinear, 3 bicubic."""
  pixels = np.asarray(pixels_HWC)
  if pixels.dtype != np.uint8:
    raise TypeError(f'resize_uint8 takes uint8 pixels, got {pixels.dtype}.')
  if height < 1 or width < 1:
    raise ValueError(f'resize_uint8: the size must be positive, got {height}x{width}.')
  if pixels.shape[1] != width:
    pixels = _resample_axis(pixels, width, 1, resample)
  if pixels.shape[0] != height:
    pixels = _resample_axis(pixels, height, 0, resample)
  return pixels

"""Image preprocessing for vision-language models: files or arrays to ``pixel_values``.

:class:`ImageProcessor` does what a checkpoint's ``preprocessor_config.json`` says, as the
transformers image processors do with their Pillow backend: convert to RGB (transparent
pixels become white), optionally cut an elongated image into crops (Gemma 3's
pan-and-scan: the whole image plus 2 or more crops along its long side), resize each to
``size`` with Pillow, rescale (``* 1/255``) and normalise (``(x - mean) / std``). The
result is ``[N, 3, H, W]`` float32, ready for ``model(ids, pixel_values=...)`` and
``maxnnx.generate``. Resized pixels depend on the Pillow major version (bicubic changed
in Pillow 13); the transformers references were made with the pinned one.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from collections.abc import Sequence

import numpy as np
from PIL import Image

# Pillow's resampling filters by the numbers preprocessor_config.json stores.
RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS,
            2: Image.Resampling.BILINEAR, 3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX,
            5: Image.Resampling.HAMMING}


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
  """Resize, rescale and normalise images (see the module docstring).

  Attributes:
    height, width: output size in pixels.
    resample: Pillow filter number (2 = bilinear, 3 = bicubic).
    rescale_factor: multiplier of the 0..255 pixel values.
    mean, std: per-channel normalisation.
    do_resize, do_rescale, do_normalize: which steps run.
    pan_and_scan: cut elongated images into crops (Gemma 3); the settings below
      decide when and how many.
    pan_and_scan_min_crop_size: crops are at least this many pixels on each side.
    pan_and_scan_max_num_crops: at most this many crops per image.
    pan_and_scan_min_ratio: only images whose long side exceeds this multiple of the
      short one are cut.
  """

  height: int = 896
  width: int = 896
  resample: int = 2
  rescale_factor: float = 1 / 255
  mean: tuple[float, ...] = (0.5, 0.5, 0.5)
  std: tuple[float, ...] = (0.5, 0.5, 0.5)
  do_resize: bool = True
  do_rescale: bool = True
  do_normalize: bool = True
  pan_and_scan: bool = False
  pan_and_scan_min_crop_size: int = 256
  pan_and_scan_max_num_crops: int = 4
  pan_and_scan_min_ratio: float = 1.2

  @classmethod
  def from_pretrained(cls, directory: str, **overrides) -> ImageProcessor:
    """The processor of a checkpoint directory's ``preprocessor_config.json``."""
    path = os.path.join(directory, 'preprocessor_config.json')
    if not os.path.exists(path):
      raise FileNotFoundError(f'{path}: missing; a vision checkpoint keeps its image '
                              'processor settings there.')
    with open(path) as f:
      data = json.load(f)
    size = data.get('size') or {}
    if 'height' not in size or 'width' not in size:
      raise ValueError(f"{path}: 'size' must give height and width, got {size}.")
    if data.get('resample', 2) not in RESAMPLE:
      raise ValueError(f"{path}: unknown resample {data['resample']}; known: {sorted(RESAMPLE)}.")
    fields = dict(height=size['height'], width=size['width'], resample=data.get('resample', 2),
                  rescale_factor=data.get('rescale_factor', 1 / 255),
                  mean=tuple(data.get('image_mean') or cls.mean),
                  std=tuple(data.get('image_std') or cls.std),
                  pan_and_scan=bool(data.get('do_pan_and_scan')))
    for key in ('do_resize', 'do_rescale', 'do_normalize'):
      if data.get(key) is not None:
        fields[key] = bool(data[key])
    for ours, theirs in (('pan_and_scan_min_crop_size', 'pan_and_scan_min_crop_size'),
                         ('pan_and_scan_max_num_crops', 'pan_and_scan_max_num_crops'),
                         ('pan_and_scan_min_ratio', 'pan_and_scan_min_ratio_to_activate')):
      if data.get(theirs) is not None:
        fields[ours] = data[theirs]
    return cls(**{**fields, **overrides})

  def __call__(self, images: Sequence[Image.Image | np.ndarray | str]
               ) -> tuple[np.ndarray, list[int]]:
    """``(pixel_values [N, 3, height, width] float32, crops per image)``.

    ``images`` are Pillow images, ``[H, W, 3]`` uint8 arrays or file paths. With
    pan-and-scan, image ``i`` contributes itself then its ``crops[i]`` crops.
    """
    out, crops = [], []
    for image in images:
      rgb = _as_rgb(image)
      pieces = self.crops(rgb) if self.pan_and_scan else []
      crops.append(len(pieces))
      out.extend(self._one(piece) for piece in [rgb, *pieces])
    return np.stack(out), crops

  def crops(self, image: Image.Image) -> list[Image.Image]:
    """Gemma 3's pan-and-scan crops of ``image`` (none for a near-square one)."""
    width, height = image.size
    long_is_width = width >= height
    long, short = (width, height) if long_is_width else (height, width)
    if long / short < self.pan_and_scan_min_ratio:
      return []
    count = int(math.floor(long / short + 0.5))
    count = min(int(math.floor(long / self.pan_and_scan_min_crop_size)), count)
    count = min(self.pan_and_scan_max_num_crops, max(2, count))
    across, down = (count, 1) if long_is_width else (1, count)
    crop_w, crop_h = math.ceil(width / across), math.ceil(height / down)
    if min(crop_w, crop_h) < self.pan_and_scan_min_crop_size:
      return []
    return [image.crop((x, y, min(x + crop_w, width), min(y + crop_h, height)))
            for y, x in itertools.product(range(0, crop_h * down, crop_h),
                                          range(0, crop_w * across, crop_w))]

  def _one(self, image: Image.Image) -> np.ndarray:
    if self.do_resize:
      image = image.resize((self.width, self.height), resample=RESAMPLE[self.resample])
    pixels = np.asarray(image)
    if self.do_rescale:
      pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
    pixels = pixels.astype(np.float32)
    if self.do_normalize:
      mean = np.asarray(self.mean, np.float32)
      std = np.asarray(self.std, np.float32)
      pixels = (pixels - mean) / std
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _as_rgb(image) -> Image.Image:
  if isinstance(image, (str, os.PathLike)):
    with Image.open(image) as opened:
      opened.load()
      return _as_rgb(opened.copy())
  if isinstance(image, np.ndarray):
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] not in (3, 4):
      raise ValueError('image arrays must be [H, W, 3 or 4] uint8, got '
                       f'{image.dtype} {image.shape}.')
    image = Image.fromarray(image)
  if not isinstance(image, Image.Image):
    raise TypeError(f'expected a Pillow image, a uint8 array or a path, got {type(image)}.')
  if image.mode == 'RGB':
    return image
  # Transparent pixels become white, as the transformers processors make them.
  rgba = image.convert('RGBA')
  white = Image.new('RGBA', rgba.size, (255, 255, 255))
  return Image.alpha_composite(white, rgba).convert('RGB')

"""Image preprocessing for vision-language models: files or arrays to ``pixel_values``.

:class:`ImageProcessor` does what a checkpoint's ``preprocessor_config.json`` says, as the
transformers image processors do: convert to RGB (transparent pixels become white),
optionally cut an elongated image into crops (Gemma 3's pan-and-scan: the whole image
plus 2 or more crops along its long side), resize each to ``size``, rescale (``* 1/255``)
and normalise (``(x - mean) / std``). The result is ``[N, 3, H, W]`` float32, ready for
``model(ids, pixel_values=...)`` and ``maxnnx.generate``. The resize is Pillow's (as
transformers' Pillow backend; pixels depend on the Pillow major version, bicubic changed
in Pillow 13) or, with ``resize_backend='torchvision'``, torchvision's reproduced exactly
(:mod:`maxnnx.data.resample`; no torch needed).

:class:`ImagePrompt` says how an image appears in the text: the chat template writes a
``marker`` per image (Gemma 3: ``<start_of_image>``), which becomes the sequence the
model reads, the image's placeholder tokens among them. :func:`load_image` reads an
image from a path, a ``data:`` URL or raw bytes (as chat records and the OpenAI API
give them).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import itertools
import json
import math
import os
import re
from collections.abc import Sequence

import ml_dtypes
import numpy as np
from PIL import Image

from maxnnx.data.resample import resize_uint8

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
    resize_backend: ``'pillow'`` resizes as transformers' Pillow backend
      (``Gemma3ImageProcessorPil``); ``'torchvision'`` as its torchvision backend, the one
      transformers picks when torchvision is installed (bilinear and bicubic only; up to
      4 levels of 255 apart from Pillow's bicubic).
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
  resize_backend: str = 'pillow'

  def __post_init__(self):
    if self.resize_backend not in ('pillow', 'torchvision'):
      raise ValueError(f"resize_backend={self.resize_backend!r}: use 'pillow' or 'torchvision'.")
    if self.resize_backend == 'torchvision' and self.resample not in (2, 3):
      raise ValueError(f"resample={self.resample} with resize_backend='torchvision': the "
                       'torchvision resize here is bilinear (2) or bicubic (3).')

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
    if not self.do_resize:
      pixels = np.asarray(image)
    elif self.resize_backend == 'torchvision':
      pixels = resize_uint8(np.asarray(image), self.height, self.width, self.resample)
    else:
      pixels = np.asarray(image.resize((self.width, self.height),
                                       resample=RESAMPLE[self.resample]))
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


def load_image(source, base_dir: str | None = None) -> Image.Image:
  """An RGB Pillow image from a path (relative ones under ``base_dir``), a ``data:`` URL
  (``data:image/png;base64,...``), bytes, a ``{'bytes': ...}`` / ``{'path': ...}`` dict (a
  Hugging Face datasets image column), a Pillow image or a ``[H, W, 3|4]`` uint8 array."""
  if isinstance(source, dict):
    if source.get('bytes') is not None:
      return load_image(source['bytes'])
    if source.get('path'):
      return load_image(source['path'], base_dir)
    raise ValueError(f"an image dict needs 'bytes' or 'path', got keys {sorted(source)}.")
  if isinstance(source, (bytes, bytearray)):
    try:
      with Image.open(io.BytesIO(source)) as opened:
        opened.load()
        return _as_rgb(opened.copy())
    except OSError as e:
      raise ValueError(f'image bytes are not a readable image ({e}).') from None
  if isinstance(source, str) and source.startswith('data:'):
    header, _, payload = source.partition(',')
    if not header.endswith(';base64') or not payload:
      raise ValueError(f'a data URL image must be data:image/...;base64,<data>; got '
                       f'{source[:40]!r}...')
    try:
      return load_image(base64.b64decode(payload, validate=True))
    except binascii.Error as e:
      raise ValueError(f'the data URL image is not valid base64 ({e}).') from None
  if isinstance(source, (str, os.PathLike)):
    path = os.fspath(source)
    if '://' in path:
      raise ValueError(f'{path}: images are read from local files or data: URLs, not URLs.')
    if base_dir and not os.path.isabs(path):
      path = os.path.join(base_dir, path)
    if not os.path.isfile(path):
      raise FileNotFoundError(f'{path}: no such image file.')
    return _as_rgb(path)
  return _as_rgb(source)


@dataclasses.dataclass(frozen=True)
class ImagePrompt:
  """How an image appears in the text (see the module docstring).

  Attributes:
    marker: what the chat template writes where an image goes.
    expansion: what the model reads instead: for Gemma 3, a blank line, the
      start-of-image token, ``tokens_per_image`` placeholders, the end-of-image token
      and a blank line.
    image_token_id: the placeholder id (``ModelConfig.vision.image_token_id``).
    crops_format: what an image with pan-and-scan crops becomes: ``{image}`` is the whole
      image's expansion, ``{crops}`` the crops' expansions joined by spaces (Gemma 3:
      ``'Here is the original image {image} and here are some crops to help you see
      better {crops}'``); ``None`` for a prompt that cannot place crops.
  """

  marker: str
  expansion: str
  image_token_id: int
  crops_format: str | None = None

  @classmethod
  def from_tokenizer(cls, tokenizer, vision, *, marker: str, expansion: str,
                     crops_format: str | None = None, model: str = 'the model') -> ImagePrompt:
    """The prompt whose ``expansion`` (``{image}`` standing for the run of
    ``vision.tokens_per_image`` placeholders) replaces each ``marker``; the placeholder's
    string is looked up in ``tokenizer`` by ``vision.image_token_id``, and every special
    token the expansion names must be the tokenizer's (``ValueError`` naming the missing
    ones and ``model``)."""
    specials = image_placeholder(tokenizer, vision, (marker, *_special_names(expansion)),
                                     model)
    return cls(marker=marker,
               expansion=expansion.format(image=specials * vision.tokens_per_image),
               image_token_id=vision.image_token_id, crops_format=crops_format)

  def expand(self, text: str, layouts: Sequence | None = None, first: int = 0
             ) -> tuple[str, int]:
    """``(text with every marker expanded, number of images)``. ``layouts`` are what the
    image processor returned beside the pixels (here, crops per image: an image with
    crops is written with them, in the processor's order); ``first`` is the index of the
    text's first image among them."""
    pieces = text.split(self.marker)
    out = [pieces[0]]
    for k, piece in enumerate(pieces[1:]):
      index = first + k
      crops = int(layouts[index]) if layouts is not None and index < len(layouts) else 0
      out += [self._with_crops(crops), piece]
    return ''.join(out), len(pieces) - 1

  def _with_crops(self, crops: int) -> str:
    if not crops:
      return self.expansion
    if self.crops_format is None:
      raise ValueError('this image prompt cannot place pan-and-scan crops; load the image '
                       'processor with pan_and_scan=False.')
    return self.crops_format.format(image=self.expansion,
                                    crops=' '.join([self.expansion] * crops))


@dataclasses.dataclass(frozen=True)
class TiledImagePrompt(ImagePrompt):
  """Llama 4's prompt: the template's ``<|image|>`` becomes ``<|image_start|>``, then for an
  image of several tiles each tile's placeholders row by row (``<|tile_x_separator|>``
  between tiles of a row, ``<|tile_y_separator|>`` after each row), then ``<|image|>`` and
  the global tile's placeholders (the only tile's, for a one-tile image), then
  ``<|image_end|>``.

  Attributes:
    start, end, tile_x, tile_y: those tokens' strings.
    tokens_per_tile: placeholders per tile.
  """

  start: str = '<|image_start|>'
  end: str = '<|image_end|>'
  tile_x: str = '<|tile_x_separator|>'
  tile_y: str = '<|tile_y_separator|>'
  tokens_per_tile: int = 144

  @classmethod
  def from_tokenizer(cls, tokenizer, vision, *, marker: str = '<|image|>',
                     model: str = 'the model') -> TiledImagePrompt:
    """The tiled prompt for ``vision``, the placeholder's string found in ``tokenizer``
    (``ValueError`` naming the missing tokens and ``model``)."""
    patch = image_placeholder(tokenizer, vision,
                                  (marker, cls.start, cls.end, cls.tile_x, cls.tile_y), model)
    return cls(marker=marker, expansion=patch, image_token_id=vision.image_token_id,
               tokens_per_tile=vision.tokens_per_image)

  def expand(self, text: str, layouts: Sequence | None = None, first: int = 0
             ) -> tuple[str, int]:
    """``(text with image ``first + k``'s marker expanded by its ``(rows, columns)`` of
    tiles, number of images)``."""
    pieces = text.split(self.marker)
    count = len(pieces) - 1
    if count and (layouts is None or len(layouts) < first + count):
      raise ValueError(f'{first + count} image markers but tile layouts for '
                       f'{0 if layouts is None else len(layouts)} images.')
    tile = self.expansion * self.tokens_per_tile
    out = [pieces[0]]
    for k, piece in enumerate(pieces[1:]):
      rows, columns = layouts[first + k]
      image = self.start
      if rows * columns > 1:
        row = self.tile_x.join([tile] * columns) + self.tile_y
        image += row * rows
      out.append(image + self.marker + tile + self.end + piece)
    return ''.join(out), count


def _supported_canvases(max_patches: int, tile: int) -> list[tuple[int, int]]:
  """Canvases ``(height, width)`` of up to ``max_patches`` tiles, grouped by aspect ratio
  in the order transformers' Llama 4 processor breaks ties in."""
  by_ratio: dict[float, list[tuple[int, int]]] = {}
  for n in range(max_patches, 0, -1):
    for a in sorted(d for d in range(1, n + 1) if n % d == 0):
      by_ratio.setdefault(a / (n // a), []).append((a, n // a))
  return [(a * tile, b * tile) for group in by_ratio.values() for a, b in group]


@dataclasses.dataclass(frozen=True)
class TiledImageProcessor:
  """Llama 4's image processor: the canvas of at most ``max_patches`` tiles that needs the
  least resizing, the image resized into it without distortion (never enlarged past one
  tile per side, unless ``resize_to_max_canvas``) and padded with zeros at the bottom and
  right, cut into ``tile_size`` tiles row by row, plus (for several tiles) the whole image
  squeezed into one global tile. Rescale and normalise round to bfloat16, as the reference
  does; the output is ``[tiles, 3, tile_size, tile_size]`` float32 and each image's
  ``(rows, columns)`` of tiles.

  Resizing is torchvision's antialiased uint8 resize, reproduced exactly
  (:func:`maxnnx.data.resample.resize_uint8`), since that is what transformers' Llama 4
  processor runs.

  Attributes:
    tile_size: side of a tile in pixels.
    max_patches: most tiles per image (the global tile not counted).
    resize_to_max_canvas: enlarge to the largest fitting canvas.
    resample: filter number (2 = bilinear, 3 = bicubic).
    rescale_factor, mean, std: as :class:`ImageProcessor`.
  """

  tile_size: int = 336
  max_patches: int = 16
  resize_to_max_canvas: bool = False
  resample: int = 2
  rescale_factor: float = 1 / 255
  mean: tuple[float, ...] = (0.5, 0.5, 0.5)
  std: tuple[float, ...] = (0.5, 0.5, 0.5)

  @classmethod
  def from_pretrained(cls, directory: str, **overrides) -> TiledImageProcessor:
    """The processor of a Llama 4 checkpoint's ``preprocessor_config.json``."""
    data = _read_preprocessor_config(directory)
    size = data.get('size') or {}
    if size.get('height') != size.get('width') or not size.get('height'):
      raise ValueError(f"{directory}: Llama 4 tiles are square; 'size' is {size}.")
    fields = dict(tile_size=size['height'], max_patches=data.get('max_patches', 16),
                  resize_to_max_canvas=bool(data.get('resize_to_max_canvas', False)),
                  resample=data.get('resample', 2),
                  rescale_factor=data.get('rescale_factor', 1 / 255),
                  mean=tuple(data.get('image_mean') or cls.mean),
                  std=tuple(data.get('image_std') or cls.std))
    if fields['resample'] not in (2, 3):
      raise ValueError(f"{directory}: resample {fields['resample']} is not one torchvision's "
                       'uint8 resize reproduces here; use 2 (bilinear) or 3 (bicubic).')
    return cls(**{**fields, **overrides})

  def canvas(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((canvas height, width), (resized height, width))`` of an image of that size."""
    f32, tile = np.float32, self.tile_size
    canvases = _supported_canvases(self.max_patches, tile)
    scales = [min(f32(cw) / f32(width), f32(ch) / f32(height)) for ch, cw in canvases]
    up = [s for s in scales if s >= 1]
    chosen = (max(up) if self.resize_to_max_canvas else min(up)) if up else max(scales)
    target = min((c for c, s in zip(canvases, scales) if s == chosen),
                 key=lambda c: c[0] * c[1])
    # The reference computes with float32 where a size came from its target tensor.
    if self.resize_to_max_canvas:
      th, tw = f32(target[0]), f32(target[1])
    else:
      th = f32(target[0]) if target[0] < max(height, tile) else max(height, tile)
      tw = f32(target[1]) if target[1] < max(width, tile) else max(width, tile)
    sw = tw / f32(width) if isinstance(tw, f32) else tw / width
    sh = th / f32(height) if isinstance(th, f32) else th / height
    if isinstance(sw, f32) or isinstance(sh, f32):
      narrower = f32(sw) < f32(sh)
    else:
      narrower = sw < sh
    if narrower:
      scaled = f32(height) * sw if isinstance(sw, f32) else height * sw
      new = (min(math.floor(scaled), int(th)), int(tw))
    else:
      scaled = f32(width) * sh if isinstance(sh, f32) else width * sh
      new = (int(th), min(math.floor(scaled), int(tw)))
    return target, (max(new[0], 1), max(new[1], 1))

  def __call__(self, images: Sequence[Image.Image | np.ndarray | str]
               ) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """``(pixel_values [tiles, 3, tile, tile] float32, (rows, columns) per image)``."""
    out, layouts = [], []
    tile = self.tile_size
    for image in images:
      rgb = np.asarray(_as_rgb(image))
      (ch, cw), (nh, nw) = self.canvas(*rgb.shape[:2])
      canvas = np.zeros((ch, cw, 3), np.uint8)
      canvas[:nh, :nw] = resize_uint8(rgb, nh, nw, self.resample)
      pixels = self._normalise(canvas)
      rows, columns = ch // tile, cw // tile
      out += [pixels[:, r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]
              for r in range(rows) for c in range(columns)]
      if rows * columns > 1:
        out.append(self._normalise(resize_uint8(rgb, tile, tile, self.resample)))
      layouts.append((rows, columns))
    return np.stack(out), layouts

  def _normalise(self, pixels_HWC: np.ndarray) -> np.ndarray:
    """``[3, H, W]`` float32 of uint8 pixels, each step rounded to bfloat16."""
    bf16 = ml_dtypes.bfloat16
    x = (pixels_HWC.astype(np.float32) * np.float32(self.rescale_factor)).astype(bf16)
    mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
    x = (x.astype(np.float32) - mean).astype(bf16)
    x = (x.astype(np.float32) / std).astype(bf16)
    return np.ascontiguousarray(x.astype(np.float32).transpose(2, 0, 1))


def _read_preprocessor_config(directory: str) -> dict:
  path = os.path.join(directory, 'preprocessor_config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: missing; a vision checkpoint keeps its image '
                            'processor settings there.')
  with open(path) as f:
    return json.load(f)


def load_image_processor(directory: str, **overrides):
  """The image processor a checkpoint's ``preprocessor_config.json`` names: a
  :class:`TiledImageProcessor` for Llama 4, else an :class:`ImageProcessor`."""
  kind = str(_read_preprocessor_config(directory).get('image_processor_type', ''))
  if kind.startswith('Llama4'):
    return TiledImageProcessor.from_pretrained(directory, **overrides)
  return ImageProcessor.from_pretrained(directory, **overrides)


def _special_names(text: str) -> list[str]:
  """The ``<...>`` token names in a prompt's expansion (``{image}`` left out)."""
  return re.findall(r'<[^<>{}\s]+>', text)


def image_placeholder(tokenizer, vision, required: Sequence[str], model: str) -> str:
  """The placeholder's string (``vision.image_token_id``) in ``tokenizer``, after checking
  that every token of ``required`` is one of its special tokens (``ValueError`` naming the
  missing ones and ``model``)."""
  from maxnnx.data.chat import special_tokens  # noqa: PLC0415
  specials = special_tokens(tokenizer)
  placeholder = {i: s for s, i in specials.items()}.get(vision.image_token_id)
  missing = [repr(t) for t in dict.fromkeys(required) if t not in specials]
  if placeholder is None:
    missing.append(f'a special token of id {vision.image_token_id} '
                   '(ModelConfig.vision.image_token_id)')
  if missing:
    raise ValueError(f"the tokenizer lacks {model}'s image tokens: {', '.join(missing)}; use "
                     "the checkpoint's own tokenizer.")
  return placeholder

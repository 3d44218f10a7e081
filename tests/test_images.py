"""Image preprocessing against transformers' Gemma 3 image processors.

``tests/fixtures/images`` holds three small PNGs (landscape, portrait, RGBA square),
``gemma3_processor.npz``, what ``Gemma3ImageProcessorPil`` made of them
(``make_vision_fixtures.py images``): 32x32 with pan-and-scan, and 40x48 bicubic, and
``gemma3_processor_torchvision.npz``, the same from the torchvision ``Gemma3ImageProcessor``
(``make_vision_fixtures.py llama4_images``).
"""

import os

import numpy as np
import pytest
from conftest import FIXTURES
from PIL import Image

import maxnnx
from maxnnx.data.images import ImageProcessor

IMAGES = os.path.join(os.path.dirname(FIXTURES), 'images')
NAMES = ['landscape.png', 'portrait.png', 'square_rgba.png']


def _reference():
  return np.load(os.path.join(IMAGES, 'gemma3_processor.npz'))


def test_pan_and_scan_matches_transformers():
  """The checkpoint's preprocessor_config.json (pan-and-scan on, crops of >= 8 pixels, at most
  3): the same crops and pixel values to 1e-5."""
  processor = ImageProcessor.from_pretrained(os.path.join(FIXTURES, 'gemma3_vision'))
  assert processor.pan_and_scan and (processor.height, processor.width) == (32, 32)
  pixels, crops = processor([os.path.join(IMAGES, n) for n in NAMES])
  ref = _reference()
  assert crops == ref['scan_crops'].tolist() == [3, 3, 0]
  assert pixels.shape == ref['scan_pixels'].shape and pixels.dtype == np.float32
  np.testing.assert_allclose(pixels, ref['scan_pixels'], rtol=0, atol=1e-5)


def test_plain_bicubic_resize_matches_transformers():
  """Pillow images in, 40x48 bicubic out (RGBA converted to RGB)."""
  processor = ImageProcessor(height=40, width=48, resample=3)
  pixels, crops = processor([Image.open(os.path.join(IMAGES, n)) for n in NAMES])
  assert crops == [0, 0, 0]
  np.testing.assert_allclose(pixels, _reference()['plain_pixels'], rtol=0, atol=1e-5)


@pytest.mark.parametrize('setting', ['scan', 'plain'])
def test_the_torchvision_backend_matches_transformers_torchvision_processor(setting):
  """``resize_backend='torchvision'`` = ``Gemma3ImageProcessor`` (torchvision) to 1e-5 with
  pan-and-scan at 32x32 and bicubic at 40x48, where Pillow's bicubic is up to 4 levels off."""
  ref = np.load(os.path.join(IMAGES, 'gemma3_processor_torchvision.npz'))
  if setting == 'scan':
    processor = ImageProcessor.from_pretrained(os.path.join(FIXTURES, 'gemma3_vision'),
                                               resize_backend='torchvision')
  else:
    processor = ImageProcessor(height=40, width=48, resample=3, resize_backend='torchvision')
  pixels, crops = processor([os.path.join(IMAGES, n) for n in NAMES])
  want = ref[f'{setting}_pixels']
  assert pixels.shape == want.shape
  np.testing.assert_allclose(pixels, want, rtol=0, atol=1e-5)
  if setting == 'plain':
    pillow, _ = ImageProcessor(height=40, width=48, resample=3)(
        [os.path.join(IMAGES, n) for n in NAMES])
    assert np.abs(pillow - want).max() > 1e-2
  with pytest.raises(ValueError, match='resize_backend'):
    ImageProcessor(resize_backend='cv2')
  with pytest.raises(ValueError, match='bicubic'):
    ImageProcessor(resample=1, resize_backend='torchvision')


def test_processed_images_drive_the_model():
  """Processor output goes straight into a vision checkpoint (one image, no crops)."""
  directory = os.path.join(FIXTURES, 'gemma3_vision')
  processor = ImageProcessor.from_pretrained(directory, pan_and_scan=False)
  pixels, _ = processor([os.path.join(IMAGES, 'landscape.png')])
  model = maxnnx.from_pretrained(directory)
  v = model.config.vision
  ids = np.array([[5, 297] + [v.image_token_id] * v.tokens_per_image + [298, 6]])
  logits = np.asarray(model(ids, pixel_values=pixels))
  assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and np.isfinite(logits).all()


def test_bad_images_and_configs_are_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match='preprocessor_config.json'):
    ImageProcessor.from_pretrained(str(tmp_path))
  (tmp_path / 'preprocessor_config.json').write_text('{"size": {"shortest_edge": 224}}')
  with pytest.raises(ValueError, match='height and width'):
    ImageProcessor.from_pretrained(str(tmp_path))
  with pytest.raises(ValueError, match='uint8'):
    ImageProcessor()([np.zeros((4, 4, 3), np.float32)])

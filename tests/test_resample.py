"""resize_uint8 against torchvision's antialiased uint8 resize (the committed outputs of
``make_vision_fixtures.py llama4_images``)."""

import os

import numpy as np
import pytest

from maxnnx.data.resample import axis_weights, resize_uint8

RESIZES = os.path.join(os.path.dirname(__file__), 'fixtures', 'images', 'torchvision_resize.npz')


@pytest.mark.parametrize('resample,name', [(2, 'bilinear'), (3, 'bicubic')])
def test_every_value_equals_torchvision(resample, name):
  """Shrinking, enlarging, both at once, one axis, a 23x shrink and 1-pixel sides."""
  ref = np.load(RESIZES)
  cases = sorted(int(k.split('_')[1]) for k in ref.files if k.startswith('input_'))
  assert len(cases) == 6
  for i in cases:
    want = ref[f'{name}_{i}']
    got = resize_uint8(ref[f'input_{i}'], want.shape[0], want.shape[1], resample)
    assert got.dtype == np.uint8 and got.shape == want.shape
    np.testing.assert_array_equal(got, want, err_msg=f'case {i}')


def test_weights_are_the_filter_normalised_then_rounded():
  """Each output's weights sum to 2**precision up to rounding and follow the triangle
  filter stretched by the shrink factor (a float64 computation of the same thing)."""
  rng = np.random.default_rng()
  n_in, n_out = int(rng.integers(20, 80)), int(rng.integers(3, 19))
  first, weights, precision = axis_weights(n_in, n_out, 2)
  assert 14 <= precision <= 22
  scale = n_in / n_out
  for i in range(n_out):
    center = scale * (i + 0.5)
    taps = np.arange(n_in)
    w = np.maximum(0.0, 1.0 - np.abs((taps + 0.5 - center) / scale))
    w /= w.sum()
    row = np.zeros(n_in)
    count = min(weights.shape[1], n_in - first[i])
    row[first[i]:first[i] + count] = weights[i, :count] / 2.0 ** precision
    np.testing.assert_allclose(row, w, atol=2.0 ** -precision)


def test_an_unchanged_size_is_the_image_itself_and_bad_input_is_named():
  rng = np.random.default_rng()
  image = rng.integers(0, 256, (9, 13, 3), dtype=np.uint8)
  np.testing.assert_array_equal(resize_uint8(image, 9, 13), image)
  with pytest.raises(TypeError, match='uint8'):
    resize_uint8(image.astype(np.float32), 4, 4)
  with pytest.raises(ValueError, match='bilinear'):
    resize_uint8(image, 4, 4, resample=1)
  with pytest.raises(ValueError, match='positive'):
    resize_uint8(image, 0, 4)

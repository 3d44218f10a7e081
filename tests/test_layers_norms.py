"""RMSNorm and LayerNorm against NumPy float64 references."""

import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from flax import nnx

from maxnnx.layers.norms import LayerNorm, RMSNorm


def _rng(seed=0):
  return np.random.default_rng(seed)


def test_rms_norm_matches_reference():
  """Plain RMSNorm is x / sqrt(mean(x²) + eps) * w over the last dim."""
  rng = _rng(0)
  norm = RMSNorm(32, axes=('norm',), eps=1e-5, rngs=nnx.Rngs(0))
  w = rng.normal(size=32)
  norm.scale[...] = jnp.asarray(w, jnp.float32)
  x = rng.normal(size=(2, 5, 32)) * 3.0
  y = norm(jnp.asarray(x, jnp.float32))
  assert y.shape == x.shape and y.dtype == jnp.float32
  ref.assert_close(y, ref.rms_norm(x, w, 1e-5))


def test_rms_norm_eps_matters():
  """eps is added to the mean square (visible on tiny inputs), not to the root."""
  rng = _rng(1)
  norm = RMSNorm(8, axes=('norm',), eps=1e-2, rngs=nnx.Rngs(0))
  x = rng.normal(size=(3, 8)) * 0.05
  ref.assert_close(norm(jnp.asarray(x, jnp.float32)), ref.rms_norm(x, np.ones(8), 1e-2))


def test_rms_norm_gemma_offset():
  """scale_offset=1.0 multiplies by (1 + w), and w starts at zero."""
  rng = _rng(2)
  norm = RMSNorm(16, axes=('norm',), scale_offset=1.0, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(np.asarray(norm.scale[...]), np.zeros(16))
  w = rng.normal(size=16)
  norm.scale[...] = jnp.asarray(w, jnp.float32)
  x = rng.normal(size=(4, 16))
  ref.assert_close(norm(jnp.asarray(x, jnp.float32)), ref.rms_norm(x, w, 1e-6, offset=1.0))


def test_rms_norm_multi_dim_normalises_dims_together():
  """A (heads, head_dim) RMSNorm uses one statistic over both dims, per token."""
  rng = _rng(3)
  norm = RMSNorm((4, 8), axes=('heads', 'head_dim'), rngs=nnx.Rngs(0))
  w = rng.normal(size=(4, 8))
  norm.scale[...] = jnp.asarray(w, jnp.float32)
  # Heads with very different magnitudes: per-head statistics would differ.
  x = rng.normal(size=(2, 3, 4, 8)) * np.array([0.1, 1.0, 5.0, 20.0])[:, None]
  y = norm(jnp.asarray(x, jnp.float32))
  ref.assert_close(y, ref.rms_norm(x, w, 1e-6, ndims=2))
  per_head = ref.rms_norm(x, w, 1e-6, ndims=1)
  assert not np.allclose(np.asarray(y), per_head, rtol=1e-2)


def test_rms_norm_computes_in_float32_and_casts_back():
  """A bfloat16 RMSNorm returns bfloat16 close to the float64 reference."""
  rng = _rng(4)
  norm = RMSNorm(32, axes=('norm',), dtype=jnp.bfloat16, param_dtype=jnp.float32,
                 rngs=nnx.Rngs(0))
  x = rng.normal(size=(2, 32)) * 100.0
  y = norm(jnp.asarray(x, jnp.bfloat16))
  assert y.dtype == jnp.bfloat16 and norm.scale[...].dtype == jnp.float32
  x_bf16 = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
  ref.assert_close(y, ref.rms_norm(x_bf16, np.ones(32), 1e-6), rtol=1e-2, atol=1e-2)


def test_rms_norm_scale_has_logical_axes():
  """The scale Param carries the axis names it was built with."""
  norm = RMSNorm((4, 8), axes=('heads', 'head_dim'), rngs=nnx.Rngs(0))
  assert norm.scale.get_metadata()['out_sharding'] == ('heads', 'head_dim')


def test_layer_norm_matches_reference():
  """LayerNorm is (x - mean) / sqrt(var + eps) * w + b over the last dim."""
  rng = _rng(5)
  norm = LayerNorm(24, axes=('norm',), eps=1e-5, rngs=nnx.Rngs(0))
  w, b = rng.normal(size=24), rng.normal(size=24)
  norm.scale[...] = jnp.asarray(w, jnp.float32)
  norm.bias[...] = jnp.asarray(b, jnp.float32)
  x = rng.normal(size=(3, 4, 24)) * 2.0 + 7.0  # large mean: centring matters
  ref.assert_close(norm(jnp.asarray(x, jnp.float32)), ref.layer_norm(x, w, b, 1e-5))


def test_layer_norm_with_offset():
  """LayerNorm with scale_offset=1.0 multiplies by (1 + w)."""
  rng = _rng(6)
  norm = LayerNorm(16, axes=('norm',), scale_offset=1.0, rngs=nnx.Rngs(0))
  w, b = rng.normal(size=16), rng.normal(size=16)
  norm.scale[...] = jnp.asarray(w, jnp.float32)
  norm.bias[...] = jnp.asarray(b, jnp.float32)
  x = rng.normal(size=(5, 16))
  ref.assert_close(norm(jnp.asarray(x, jnp.float32)),
                   ref.layer_norm(x, w, b, 1e-5, offset=1.0))


@pytest.mark.parametrize('cls', [RMSNorm, LayerNorm])
def test_norm_param_dtype(cls):
  """param_dtype sets the stored dtype; dtype sets the output dtype."""
  norm = cls(8, axes=('norm',), dtype=jnp.float32, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert norm.scale[...].dtype == jnp.bfloat16
  assert norm(jnp.ones((2, 8), jnp.float32)).dtype == jnp.float32

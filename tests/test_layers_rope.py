"""Rotary embeddings: frequencies of every scaling method and the rotation itself."""

import math

import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest

from maxnnx.config import ConfigError, RopeConfig
from maxnnx.layers.rope import RotaryEmbedding, apply_rope


def _rotate(emb, x, positions):
  """maxnnx: cos/sin of the positions, then apply_rope, as float64 NumPy."""
  cos, sin = emb.cos_sin(jnp.asarray(positions, jnp.int32))
  return ref.f64(apply_rope(jnp.asarray(x, jnp.float32), cos, sin))


def _inputs(seed, head_dim, max_pos=40, shape=(2, 6, 3)):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape + (head_dim,))
  positions = rng.integers(0, max_pos, size=shape[:2])
  return x, positions


def _check(cfg, head_dim, max_position_embeddings, inv_freq, attention_factor, positions=None,
           seed=0):
  """Frequencies, attention factor and rotated values all match the reference."""
  emb = RotaryEmbedding.from_config(cfg, head_dim, max_position_embeddings)
  np.testing.assert_allclose(emb.inv_freq, inv_freq, rtol=1e-12)
  assert emb.attention_factor == pytest.approx(attention_factor, rel=1e-12)
  if positions is None:
    x, positions = _inputs(seed, head_dim)
  else:
    x, _ = _inputs(seed, head_dim, shape=np.shape(positions) + (3,))
  ref.assert_close(_rotate(emb, x, positions),
                   ref.apply_rope(x, positions, inv_freq, attention_factor), atol=1e-5)


def test_default_rope():
  """Default rope: inv_freq = theta^(-2i/d) and rotate-half pairs (i, i + d/2)."""
  _check(RopeConfig(theta=10_000.0), 16, 128, ref.default_inv_freq(10_000.0, 16), 1.0)


def test_default_rope_other_theta():
  """theta is the base of the frequency progression."""
  _check(RopeConfig(theta=500.0), 8, 128, ref.default_inv_freq(500.0, 8), 1.0, seed=1)


def test_linear_rope():
  """Linear scaling divides every frequency by factor."""
  cfg = RopeConfig(scaling='linear', factor=4.0)
  _check(cfg, 16, 128, ref.linear_inv_freq(10_000.0, 16, 4.0), 1.0, seed=2)


def test_llama3_rope_covers_all_three_bands():
  """Llama 3.1: short wavelengths kept, long ones / factor, the middle band smoothed."""
  cfg = RopeConfig(theta=500_000.0, scaling='llama3', factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192)
  expected = ref.llama3_inv_freq(500_000.0, 16, 8.0, 1.0, 4.0, 8192)
  base = ref.default_inv_freq(500_000.0, 16)
  wavelen = 2 * math.pi / base
  assert (wavelen < 8192 / 4).any() and (wavelen > 8192).any()
  assert ((wavelen >= 8192 / 4) & (wavelen <= 8192)).any()
  _check(cfg, 16, 131_072, expected, 1.0, seed=3)


def test_yarn_rope():
  """YaRN: ramp blend of interpolation/extrapolation, attention factor 0.1 ln(s) + 1."""
  cfg = RopeConfig(scaling='yarn', factor=4.0, original_max_position_embeddings=4096)
  expected = ref.yarn_inv_freq(10_000.0, 32, 4.0, 4096, 32.0, 1.0, truncate=True)
  base = ref.default_inv_freq(10_000.0, 32)
  ratio = base / expected
  # The ramp really blends: some dims untouched, some fully interpolated, some between.
  assert np.isclose(ratio, 1).any() and np.isclose(ratio, 4).any()
  assert ((ratio > 1.01) & (ratio < 3.99)).any()
  _check(cfg, 32, 16_384, expected, 0.1 * math.log(4.0) + 1.0, seed=4)


def test_yarn_rope_without_truncation():
  """truncate=False keeps the fractional correction range."""
  cfg = RopeConfig(scaling='yarn', factor=8.0, original_max_position_embeddings=2048,
                   beta_fast=16.0, beta_slow=2.0, truncate=False)
  expected = ref.yarn_inv_freq(10_000.0, 32, 8.0, 2048, 16.0, 2.0, truncate=False)
  _check(cfg, 32, 16_384, expected, 0.1 * math.log(8.0) + 1.0, seed=5)


def test_yarn_rope_factor_defaults_to_context_ratio():
  """YaRN without factor uses max_position_embeddings / original."""
  cfg = RopeConfig(scaling='yarn', original_max_position_embeddings=1024)
  expected = ref.yarn_inv_freq(10_000.0, 16, 8.0, 1024)
  _check(cfg, 16, 8192, expected, ref.yarn_attention_factor(8.0), seed=6)


def test_yarn_rope_deepseek_mscale():
  """With mscale and mscale_all_dim the factor is mscale(s, m) / mscale(s, m_all)."""
  cfg = RopeConfig(scaling='yarn', factor=40.0, original_max_position_embeddings=4096,
                   mscale=1.0, mscale_all_dim=0.5)
  expected_att = (0.1 * 1.0 * math.log(40.0) + 1) / (0.1 * 0.5 * math.log(40.0) + 1)
  assert ref.yarn_attention_factor(40.0, 1.0, 0.5) == pytest.approx(expected_att)
  expected = ref.yarn_inv_freq(10_000.0, 16, 40.0, 4096)
  _check(cfg, 16, 163_840, expected, expected_att, seed=7)


def test_yarn_rope_explicit_attention_factor():
  """An explicit attention_factor overrides the derived one."""
  cfg = RopeConfig(scaling='yarn', factor=4.0, original_max_position_embeddings=4096,
                   attention_factor=0.75)
  _check(cfg, 16, 16_384, ref.yarn_inv_freq(10_000.0, 16, 4.0, 4096), 0.75, seed=8)


def test_yarn_without_original_is_rejected_or_works():
  """YaRN without original_max_position_embeddings: a ConfigError, not a TypeError later."""
  try:
    cfg = RopeConfig(scaling='yarn', factor=4.0)
  except ConfigError:
    return
  emb = RotaryEmbedding.from_config(cfg, 16, 4096)
  assert len(emb.inv_freq) == 8


def _longrope_cfg(seed):
  rng = np.random.default_rng(seed)
  short, long = rng.uniform(1.0, 3.0, size=8), rng.uniform(2.0, 20.0, size=8)
  cfg = RopeConfig(scaling='longrope', original_max_position_embeddings=32,
                   short_factor=tuple(short), long_factor=tuple(long))
  return cfg, short, long


def test_longrope_short_factors_within_original_context():
  """LongRoPE uses short factors while max position + 1 <= original (boundary included)."""
  cfg, short, long = _longrope_cfg(9)
  short_inv, _ = ref.longrope_inv_freq(10_000.0, 16, short, long)
  att = math.sqrt(1 + math.log(128 / 32) / math.log(32))
  positions = np.array([[0, 5, 31, 2], [1, 30, 7, 3]])  # max + 1 == 32 == original
  _check(cfg, 16, 128, short_inv, att, positions=positions, seed=9)


def test_longrope_long_factors_beyond_original_context():
  """LongRoPE switches to long factors once max position + 1 > original."""
  cfg, short, long = _longrope_cfg(10)
  short_inv, long_inv = ref.longrope_inv_freq(10_000.0, 16, short, long)
  att = ref.longrope_attention_factor(128, 32)
  positions = np.array([[0, 5, 32, 2], [1, 30, 7, 3]])  # max + 1 == 33
  emb = RotaryEmbedding.from_config(cfg, 16, 128)
  np.testing.assert_allclose(emb.long_inv_freq, long_inv, rtol=1e-12)
  x, _ = _inputs(10, 16, shape=(2, 4, 3))
  ref.assert_close(_rotate(emb, x, positions), ref.apply_rope(x, positions, long_inv, att),
                   atol=1e-5)
  assert not np.allclose(_rotate(emb, x, positions), ref.apply_rope(x, positions, short_inv, att))


def test_longrope_no_extension_has_unit_attention_factor():
  """LongRoPE with max_position_embeddings == original has attention factor 1."""
  cfg, _, _ = _longrope_cfg(11)
  assert RotaryEmbedding.from_config(cfg, 16, 32).attention_factor == 1.0


def test_longrope_wrong_factor_count_raises():
  """short/long factor lists must have rotary_dim / 2 entries."""
  cfg = RopeConfig(scaling='longrope', original_max_position_embeddings=32,
                   short_factor=(1.0,) * 3, long_factor=(1.0,) * 3)
  with pytest.raises(ValueError, match='short_factor'):
    RotaryEmbedding.from_config(cfg, 16, 128)


@pytest.mark.parametrize('scaling', ['none', 'linear'])
def test_partial_rotary_rotates_only_leading_dims(scaling):
  """partial_rotary_factor=0.5: only the first head_dim/2 dims rotate, the rest pass."""
  factor = 2.0 if scaling == 'linear' else None
  cfg = RopeConfig(scaling=scaling, factor=factor, partial_rotary_factor=0.5)
  emb = RotaryEmbedding.from_config(cfg, 16, 128)
  assert emb.rotary_dim == 8
  inv = ref.default_inv_freq(10_000.0, 8) / (factor or 1.0)
  x, positions = _inputs(12, 16)
  got = _rotate(emb, x, positions)
  np.testing.assert_array_equal(got[..., 8:], np.asarray(x, np.float32)[..., 8:])
  ref.assert_close(got, ref.apply_rope(x, positions, inv), atol=1e-5)


def test_cos_sin_shape_and_dtype():
  """cos_sin gives [B, T, rotary_dim // 2] float32 tables."""
  emb = RotaryEmbedding.from_config(RopeConfig(partial_rotary_factor=0.5), 16, 64)
  cos, sin = emb.cos_sin(jnp.zeros((2, 5), jnp.int32))
  assert cos.shape == sin.shape == (2, 5, 4) and cos.dtype == jnp.float32


def test_rope_preserves_pair_norms():
  """Rotation keeps the norm of every rotated pair (i, i + d/2) and of the head."""
  emb = RotaryEmbedding.from_config(RopeConfig(), 16, 128)
  x, positions = _inputs(13, 16)
  got = _rotate(emb, x, positions)
  pair_norm = lambda a: np.hypot(a[..., :8], a[..., 8:])
  ref.assert_close(pair_norm(got), pair_norm(x), atol=1e-5)
  assert not np.allclose(got, x, atol=1e-2)  # and it did rotate


def test_rope_position_zero_is_identity():
  """At position 0 default rope leaves q and k unchanged."""
  emb = RotaryEmbedding.from_config(RopeConfig(), 16, 128)
  x, _ = _inputs(14, 16)
  ref.assert_close(_rotate(emb, x, np.zeros(x.shape[:2], int)), x, atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
  """q(m)·k(n) after default rope equals q(m+s)·k(n+s) for any shift s."""
  rng = np.random.default_rng(15)
  emb = RotaryEmbedding.from_config(RopeConfig(), 16, 128)
  q, k = rng.normal(size=(1, 1, 1, 16)), rng.normal(size=(1, 1, 1, 16))

  def score(m, n):
    return float(np.sum(_rotate(emb, q, [[m]]) * _rotate(emb, k, [[n]])))

  for m, n in [(5, 2), (9, 9), (3, 11)]:
    base = score(m, n)
    for shift in (1, 7, 20):
      assert score(m + shift, n + shift) == pytest.approx(base, rel=1e-5, abs=1e-5)
  assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)  # not trivially constant


def test_rope_keeps_input_dtype():
  """apply_rope computes in float32 and returns the input dtype."""
  emb = RotaryEmbedding.from_config(RopeConfig(), 8, 64)
  cos, sin = emb.cos_sin(jnp.arange(4, dtype=jnp.int32)[None])
  assert apply_rope(jnp.ones((1, 4, 2, 8), jnp.bfloat16), cos, sin).dtype == jnp.bfloat16

"""Rotary position embeddings: default, linear, Llama 3.1, YaRN, LongRoPE and proportional.

Frequencies are computed once in NumPy float64 from a :class:`RopeConfig` and
kept as constants; ``cos``/``sin`` are computed per call from the token
positions, so packed sequences (positions restarting per document) and KV-cache
decoding need nothing special. Rotation uses the "rotate half" layout of
Hugging Face checkpoints: dimension ``i`` pairs with ``i + rotary_dim / 2``.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxnnx.config import RopeConfig


def _base_inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
  return 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def _llama3_inv_freq(cfg: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
  original = cfg.original_max_position_embeddings
  low_wavelen = original / cfg.low_freq_factor
  high_wavelen = original / cfg.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / cfg.factor, inv_freq)
  if cfg.high_freq_factor == cfg.low_freq_factor:  # Llama 4 Scout: no band to smooth
    return scaled
  smooth = (original / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
  smoothed = (1 - smooth) * inv_freq / cfg.factor + smooth * inv_freq
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled)


def _proportional_inv_freq(cfg: RopeConfig, head_dim: int) -> np.ndarray:
  """Gemma 4's full layers: the whole head rotates (pairs ``i``, ``i + head_dim / 2``),
  but only the first ``partial_rotary_factor`` of the pairs turn, at the frequencies
  they would have in a full-width rotation; the rest have frequency 0 (cos 1, sin 0)."""
  turning = int(cfg.partial_rotary_factor * head_dim // 2)
  inv_freq = np.zeros(head_dim // 2, np.float64)
  inv_freq[:turning] = 1.0 / cfg.theta ** (np.arange(0, 2 * turning, 2, dtype=np.float64)
                                            / head_dim)
  return inv_freq / (cfg.factor if cfg.factor is not None else 1.0)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: RopeConfig, rotary_dim: int, factor: float) -> tuple[np.ndarray, float]:
  """YaRN: blend interpolated and extrapolated frequencies over a ramp."""
  original = cfg.original_max_position_embeddings

  def correction_dim(rotations):
    return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))

  low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
  if cfg.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, rotary_dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
  extrapolation_weight = 1 - ramp
  pos_freqs = cfg.theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
  interpolated, extrapolated = 1 / (factor * pos_freqs), 1 / pos_freqs
  inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
  if cfg.attention_factor is not None:
    attention_factor = cfg.attention_factor
  elif cfg.mscale and cfg.mscale_all_dim:
    attention_factor = _yarn_mscale(factor, cfg.mscale) / _yarn_mscale(factor, cfg.mscale_all_dim)
  else:
    attention_factor = _yarn_mscale(factor)
  return inv_freq, attention_factor


@dataclasses.dataclass(frozen=True)
class RotaryEmbedding:
  """Precomputed rotary frequencies for one :class:`RopeConfig`.

  Attributes:
    rotary_dim: number of leading head dimensions that rotate.
    inv_freq: ``[rotary_dim // 2]`` inverse frequencies.
    long_inv_freq: LongRoPE only: frequencies used once any position in the call
      reaches ``long_threshold`` (the original context length).
    attention_factor: multiplier of cos and sin (YaRN / LongRoPE magnitude fix).
  """

  rotary_dim: int
  inv_freq: tuple[float, ...]
  attention_factor: float = 1.0
  long_inv_freq: tuple[float, ...] | None = None
  long_threshold: int | None = None

  def __post_init__(self):
    # Tuples keep the object hashable, so it can sit in a module's static graph.
    for name in ('inv_freq', 'long_inv_freq'):
      value = getattr(self, name)
      if value is not None:
        object.__setattr__(self, name, tuple(float(f) for f in np.asarray(value)))

  @classmethod
  def from_config(cls, cfg: RopeConfig, head_dim: int,
                  max_position_embeddings: int) -> 'RotaryEmbedding':
    """Frequencies for ``cfg`` on heads of width ``head_dim``."""
    if cfg.scaling == 'proportional':
      return cls(head_dim, _proportional_inv_freq(cfg, head_dim))
    rotary_dim = int(head_dim * cfg.partial_rotary_factor)
    inv_freq = _base_inv_freq(cfg.theta, rotary_dim)
    original = cfg.original_max_position_embeddings
    default_factor = max_position_embeddings / original if original else 1.0
    factor = cfg.factor if cfg.factor is not None else default_factor
    if cfg.scaling == 'none':
      return cls(rotary_dim, inv_freq)
    if cfg.scaling == 'linear':
      return cls(rotary_dim, inv_freq / factor)
    if cfg.scaling == 'llama3':
      return cls(rotary_dim, _llama3_inv_freq(cfg, inv_freq))
    if cfg.scaling == 'yarn':
      yarn_freq, attention_factor = _yarn(cfg, rotary_dim, factor)
      return cls(rotary_dim, yarn_freq, attention_factor)
    if cfg.scaling == 'longrope':
      n = rotary_dim // 2
      for name in ('short_factor', 'long_factor'):
        if len(getattr(cfg, name)) != n:
          raise ValueError(f'RopeConfig.{name} has {len(getattr(cfg, name))} entries; '
                           f'rotary_dim {rotary_dim} needs {n}.')
      if cfg.attention_factor is not None:
        attention_factor = cfg.attention_factor
      elif factor <= 1.0:
        attention_factor = 1.0
      else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
      return cls(rotary_dim, inv_freq / np.asarray(cfg.short_factor, np.float64), attention_factor,
                 long_inv_freq=inv_freq / np.asarray(cfg.long_factor, np.float64),
                 long_threshold=original)
    raise ValueError(f'Unknown rope scaling {cfg.scaling!r}.')

  def cos_sin(self, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``cos`` and ``sin``, each ``[B, T, rotary_dim // 2]`` float32."""
    inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
    if self.long_inv_freq is not None:
      # LongRoPE switches to its long factors for the whole call once the
      # longest position seen exceeds the original context.
      use_long = jnp.max(positions_BT) + 1 > self.long_threshold
      inv_freq = jnp.where(use_long, jnp.asarray(self.long_inv_freq, jnp.float32), inv_freq)
    angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles) * self.attention_factor, jnp.sin(angles) * self.attention_factor


def deinterleave(x: jax.Array) -> jax.Array:
  """``(x0, x1, x2, x3…)`` -> ``(x0, x2…, x1, x3…)``: interleaved rotary pairs to halves.

  Rotating the adjacent pairs ``(x0, x1), (x2, x3)…`` (``rope_interleave``
  checkpoints) equals rotating the halves of the deinterleaved vector; applied to
  queries and keys alike it leaves every ``q . k`` unchanged.
  """
  return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def apply_rope(x_BTNH: jax.Array, cos_BTR: jax.Array, sin_BTR: jax.Array) -> jax.Array:
  """Rotate the leading ``2 * R`` dims of every head; the rest pass through.

  Args:
    x_BTNH: queries or keys ``[batch, time, heads, head_dim]``.
    cos_BTR, sin_BTR: from :meth:`RotaryEmbedding.cos_sin`, ``R = rotary_dim // 2``.
  """
  rotary_dim = 2 * cos_BTR.shape[-1]
  x_rot, x_pass = x_BTNH[..., :rotary_dim], x_BTNH[..., rotary_dim:]
  x1, x2 = jnp.split(x_rot.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos_BTR[:, :, None, :], sin_BTR[:, :, None, :]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return jnp.concatenate([rotated.astype(x_BTNH.dtype), x_pass], axis=-1)

"""Gated DeltaNet: linear attention with a per-head recurrent state (Qwen3-Next, Qwen3.5).

A drop-in token mixer for a :class:`~maxnnx.layers.block.DecoderBlock` (the block's
``attn``), called like :class:`~maxnnx.layers.attention.Attention`:

1. the input projections, in the checkpoints' layout (``linear_attn.projections``):
   ``grouped`` (Qwen3-Next) has ``in_proj_qkvz`` and ``in_proj_ba``, holding per key
   head ``[q, k, v, z]`` and ``[b, a]`` for its group of value heads; ``split``
   (Qwen3.5) has ``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``, ``in_proj_b``
   and ``in_proj_a``;
2. q, k, v pass through a causal depthwise convolution (``conv1d``, ``K`` taps, then
   SiLU); q and k are L2-normalised and q scaled by ``key_head_dim ** -0.5``;
3. the gated delta rule (``cfg.runtime.gated_delta_impl``, :mod:`maxnnx.kernels.gated_delta`)
   runs with decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and write strength
   ``beta = sigmoid(b)``;
4. each value head's output is RMS-normalised, multiplied by ``silu(z)`` and
   projected back by ``out_proj``.

Rotary tables and windows are ignored. Document boundaries (segment ids) reset the
state and the convolution, and padding (segment 0) is zeroed, so packed and
left-padded rows compute each document alone. For decoding, :meth:`init_cache`
allocates the convolution's last ``K - 1`` inputs and the ``[heads, K, V]`` state:
the cache does not grow with the sequence. There is no paged cache (the serving
engine refuses these layers).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.config import ModelConfig
from maxnnx.kernels.lookup import kernel_for
from maxnnx.kernels.masks import AttentionMask
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.norms import RMSNorm
from maxnnx.layers.params import logical_param


class DepthwiseConv(nnx.Module):
  """Causal per-channel convolution over time: ``y_t = sum_i w[:, i] * x_{t - K + 1 + i}``.

  Attributes:
    weight: ``[channels, K]`` (a ``Conv1d(groups=channels)`` weight without its middle axis).
  """

  def __init__(self, channels: int, taps: int, *, param_dtype, rngs: nnx.Rngs):
    self.weight = logical_param(nnx.initializers.normal(taps**-0.5), rngs.params(),
                                (channels, taps), param_dtype, (None, None))

  def __call__(self, x_BTC: jax.Array, history_BPC: jax.Array, same_BTP: jax.Array | None):
    """``[B, T, C]`` outputs of ``x`` preceded by ``history`` (``P = K - 1`` inputs).

    ``same_BTP`` (optional) says, per output and tap ``i < P`` reaching back
    ``P - i`` tokens, whether that input belongs to the output's document.
    """
    taps = self.weight.shape[1]
    window_BSC = jnp.concatenate([history_BPC.astype(x_BTC.dtype), x_BTC], axis=1)
    length = x_BTC.shape[1]
    w_CK = self.weight[...].astype(jnp.float32)
    out = jnp.zeros(x_BTC.shape, jnp.float32)
    for i in range(taps):  # tap i reads the input taps - 1 - i tokens back
      tap_BTC = window_BSC[:, i:i + length].astype(jnp.float32)
      if same_BTP is not None and i < taps - 1:
        tap_BTC = tap_BTC * same_BTP[:, :, i, None]
      out = out + tap_BTC * w_CK[:, i]
    return out


class GatedDeltaNet(nnx.Module):
  """Gated DeltaNet token mixer (see the module docstring).

  Attributes:
    in_proj_qkvz: ``[d_model] -> [key_heads, 2 * key_dim + 2 * group * value_dim]``
      (``grouped``; ``group`` value heads per key head).
    in_proj_ba: ``[d_model] -> [key_heads, 2 * group]`` (``grouped``).
    in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: ``[d_model] -> [channels]``,
      ``[value_heads, value_dim]``, ``[value_heads]`` twice (``split``).
    conv1d: :class:`DepthwiseConv` over the ``2 * key_heads * key_dim + value_heads * value_dim``
      q/k/v channels.
    dt_bias, A_log: ``[value_heads]`` decay parameters.
    norm: RMSNorm over ``value_dim`` (no offset), gated by ``silu(z)``.
    out_proj: ``[value_heads, value_dim] -> [d_model]``.
    kernel: the gated-delta-rule strategy (``cfg.runtime.gated_delta_impl``).
    conv_state, ssm_state: ``nnx.Cache`` ``[B, K - 1, channels]`` and
      ``[B, value_heads, key_dim, value_dim]`` (float32) after :meth:`init_cache`.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    la = cfg.linear_attn
    self.key_heads, self.value_heads = la.num_key_heads, la.num_value_heads
    self.key_dim, self.value_dim = la.key_head_dim, la.value_head_dim
    group = self.value_heads // self.key_heads
    self.group = group
    dense = dict(dtype=cfg.jnp_dtype(), param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)
    d = cfg.d_model
    self.channels = 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    self.split = la.projections == 'split'
    if self.split:
      self.in_proj_qkv = DenseGeneral((d,), (self.channels,), axes=('embed', None), **dense)
      self.in_proj_z = DenseGeneral((d,), (self.value_heads, self.value_dim),
                                    axes=('embed', 'heads', 'head_dim'), **dense)
      self.in_proj_b = DenseGeneral((d,), (self.value_heads,), axes=('embed', 'heads'), **dense)
      self.in_proj_a = DenseGeneral((d,), (self.value_heads,), axes=('embed', 'heads'), **dense)
    else:
      self.in_proj_qkvz = DenseGeneral(
          (d,), (self.key_heads, 2 * self.key_dim + 2 * group * self.value_dim),
          axes=('embed', 'kv_heads', None), **dense)
      self.in_proj_ba = DenseGeneral((d,), (self.key_heads, 2 * group),
                                     axes=('embed', 'kv_heads', None), **dense)
    self.conv1d = DepthwiseConv(self.channels, la.conv_kernel_size,
                                param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)
    param_dtype = cfg.jnp_dtype('param_dtype')
    self.dt_bias = logical_param(nnx.initializers.ones, rngs.params(), (self.value_heads,),
                                 param_dtype, (None,))
    self.A_log = logical_param(  # noqa: N815 (the checkpoints' name)
        lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0)),
        rngs.params(), (self.value_heads,), param_dtype, (None,))
    self.norm = RMSNorm(self.value_dim, axes=('head_dim',), eps=cfg.norm_eps,
                        dtype=cfg.jnp_dtype(), param_dtype=param_dtype, rngs=rngs)
    self.out_proj = DenseGeneral((self.value_heads, self.value_dim), (d,),
                                 axes=('heads', 'head_dim', 'embed'), **dense)
    self.kernel = kernel_for(cfg, 'gated_delta')
    self.conv_state = nnx.data(None)
    self.ssm_state = nnx.data(None)

  def _grouped_projections(self, x_BTD):
    """``(cat(q, k, v) [B, T, channels], z [B, T, Hv, Dv], b, a [B, T, Hv])`` of the
    per-key-head interleaved projections."""
    batch, length, _ = x_BTD.shape
    kd, vd, g = self.key_dim, self.value_dim, self.group
    qkvz = self.in_proj_qkvz(x_BTD)
    ba = self.in_proj_ba(x_BTD)
    q, k = qkvz[..., :kd], qkvz[..., kd:2 * kd]
    v = qkvz[..., 2 * kd:2 * kd + g * vd]
    z = qkvz[..., 2 * kd + g * vd:].reshape(batch, length, self.value_heads, vd)
    b = ba[..., :g].reshape(batch, length, self.value_heads)
    a = ba[..., g:].reshape(batch, length, self.value_heads)
    mixed_BTC = jnp.concatenate([q.reshape(batch, length, -1), k.reshape(batch, length, -1),
                                 v.reshape(batch, length, -1)], axis=-1)
    return mixed_BTC, z, b, a

  def _split_projections(self, x_BTD):
    """The same four tensors from the separate projections."""
    return (self.in_proj_qkv(x_BTD), self.in_proj_z(x_BTD), self.in_proj_b(x_BTD),
            self.in_proj_a(x_BTD))

  def init_cache(self, batch: int, max_length: int, dtype) -> None:
    """Allocate the decoding state of ``batch`` rows (its size does not depend on
    ``max_length``)."""
    del max_length
    taps = self.conv1d.weight.shape[1]
    self.conv_state = nnx.Cache(jnp.zeros((batch, taps - 1, self.channels), dtype))
    self.ssm_state = nnx.Cache(jnp.zeros((batch, self.value_heads, self.key_dim,
                                          self.value_dim), jnp.float32))

  def __call__(self, x_BTD: jax.Array, cos_sin, mask: AttentionMask | None, *,
               sliding_window=None, cache_index: jax.Array | None = None,
               paged=None) -> jax.Array:
    """Output ``[B, T, d_model]``; ``cos_sin`` and ``sliding_window`` are not used."""
    del cos_sin, sliding_window
    if paged is not None:
      raise NotImplementedError('Gated DeltaNet layers have no paged cache; the serving '
                                'engine cannot run this model yet.')
    batch, length, _ = x_BTD.shape
    taps = self.conv1d.weight.shape[1]
    segments_BT = (jnp.ones((batch, length), jnp.int32) if mask is None
                   else mask.q_segment_ids)
    x_BTD = x_BTD * (segments_BT != 0)[..., None].astype(x_BTD.dtype)  # padding reads as 0
    kd, vd, g = self.key_dim, self.value_dim, self.group
    mixed_BTC, z, b, a = (self._split_projections(x_BTD) if self.split
                          else self._grouped_projections(x_BTD))

    decoding = cache_index is not None
    if decoding:
      if self.conv_state is None:
        raise ValueError('Decoding needs a cache: call model.init_cache(batch, max_length).')
      history = self.conv_state[...]
      same = None  # decoding continues each row's document
      reset_BT = jnp.zeros((batch, length), bool)
      state = self.ssm_state[...]
    else:
      history = jnp.zeros((batch, taps - 1, self.channels), mixed_BTC.dtype)
      back = jnp.arange(taps - 1, 0, -1)  # tap i reaches back taps - 1 - i tokens
      src = jnp.arange(length)[:, None] - back[None]
      src_segments = jnp.where(src >= 0, segments_BT[:, jnp.clip(src, 0)], -1)
      same = (src_segments == segments_BT[:, :, None]).astype(jnp.float32)
      reset_BT = jnp.concatenate([jnp.ones((batch, 1), bool),
                                  segments_BT[:, 1:] != segments_BT[:, :-1]], axis=1)
      state = None
    conv_BTC = jax.nn.silu(self.conv1d(mixed_BTC, history, same))
    if decoding:
      window = jnp.concatenate([history.astype(mixed_BTC.dtype), mixed_BTC], axis=1)
      self.conv_state[...] = window[:, -(taps - 1):].astype(self.conv_state.dtype)

    keys = self.key_heads * kd
    q_BTHK = _l2_normalise(conv_BTC[..., :keys].reshape(batch, length, self.key_heads, kd))
    k_BTHK = _l2_normalise(conv_BTC[..., keys:2 * keys].reshape(batch, length, self.key_heads,
                                                                kd))
    v_BTHV = conv_BTC[..., 2 * keys:].reshape(batch, length, self.value_heads, vd)
    if g > 1:  # each key head serves `group` consecutive value heads
      q_BTHK, k_BTHK = jnp.repeat(q_BTHK, g, axis=2), jnp.repeat(k_BTHK, g, axis=2)
    q_BTHK = q_BTHK * kd**-0.5
    decay_BTH = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
    beta_BTH = jax.nn.sigmoid(b.astype(jnp.float32))
    out_BTHV, final = self.kernel(q_BTHK, k_BTHK, v_BTHV, decay_BTH, beta_BTH, reset_BT, state)
    if decoding:
      self.ssm_state[...] = final
    normed = self.norm(out_BTHV.astype(x_BTD.dtype)).astype(jnp.float32)
    gated = (normed * jax.nn.silu(z.astype(jnp.float32))).astype(x_BTD.dtype)
    return self.out_proj(gated)


def _l2_normalise(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """``x / sqrt(sum(x²) + eps)`` over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)

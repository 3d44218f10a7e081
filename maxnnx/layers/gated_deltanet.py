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
the cache does not grow with the sequence.

For the serving engine, :meth:`GatedDeltaNet.init_paged_cache` allocates the same two
states for a number of *slots* instead of batch rows: each running request owns one
slot (``PagedBatch.state_slots_B``), a request whose row starts at position 0 starts
from a zero state, and every step carries each slot's state on through the tokens its
row computes (a prefill chunk, or one decode token). Slot 0 is scratch, for empty
rows. A state summarises the whole prefix and cannot be cut at a page boundary, so
such a model is served without prefix caching.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.config import ModelConfig
from maxnnx.kernels.lookup import kernel_for
from maxnnx.kernels.paged_attention import PagedBatch
from maxnnx.layers.layer_call import LayerCall
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
      ``[B, value_heads, key_dim, value_dim]`` (float32) after :meth:`init_cache`; the
      same per slot (``B`` = slots) after :meth:`init_paged_cache`.
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
    conv, ssm = self._zero_states(batch, dtype)
    self.conv_state, self.ssm_state = nnx.Cache(conv), nnx.Cache(ssm)

  def init_paged_cache(self, num_pages: int, page_size: int, dtype, *,
                       num_slots: int) -> None:
    """Allocate the serving engine's ``num_slots`` states (slot 0 is scratch); no pages
    (``num_pages`` and ``page_size`` size the attention layers' pools).

    The states carry logical names: on a mesh with ``tensor``, the delta rule's state
    splits over the value heads like ``out_proj``.
    """
    del num_pages, page_size
    conv, ssm = self._zero_states(num_slots, dtype)
    self.conv_state = nnx.Cache(conv, out_sharding=(None, None, None), eager_sharding=False)
    self.ssm_state = nnx.Cache(ssm, out_sharding=(None, 'heads', None, None),
                               eager_sharding=False)

  def _zero_states(self, rows: int, dtype):
    """``(conv [rows, K - 1, channels] in dtype, delta rule [rows, Hv, Dk, Dv] float32)``."""
    taps = self.conv1d.weight.shape[1]
    return (jnp.zeros((rows, taps - 1, self.channels), dtype),
            jnp.zeros((rows, self.value_heads, self.key_dim, self.value_dim), jnp.float32))

  def __call__(self, x_BTD: jax.Array, call: LayerCall) -> jax.Array:
    """Output ``[B, T, d_model]``; of ``call`` (a :class:`~maxnnx.layers.layer_call.LayerCall`)
    it reads ``mask`` (its query segments: padding), ``cache_index`` and ``paged``.

    ``call.paged``: the serving engine's flat tokens (``x`` is ``[1, T, d_model]``), each
    row continuing its slot's state (see the module docstring).
    """
    call.refuse('GatedDeltaNet', 'chunk_size', 'nope', 'shared_kv', 'return_kv')
    mask, cache_index, paged = call.mask, call.cache_index, call.paged
    batch, length, _ = x_BTD.shape
    taps = self.conv1d.weight.shape[1]
    segments_BT = (jnp.ones((batch, length), jnp.int32) if mask is None
                   else mask.q_segment_ids)
    x_BTD = x_BTD * (segments_BT != 0)[..., None].astype(x_BTD.dtype)  # padding reads as 0
    mixed_BTC, z, b, a = (self._split_projections(x_BTD) if self.split
                          else self._grouped_projections(x_BTD))
    decay_BTH = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
    beta_BTH = jax.nn.sigmoid(b.astype(jnp.float32))

    if paged is not None:
      if self.conv_state is None:
        raise ValueError('paged=... needs the state slots: call model.init_paged_cache(...).')
      out_BTHV = self._paged_rule(mixed_BTC[0], decay_BTH[0], beta_BTH[0], paged)[None]
      return self._output(out_BTHV, z, x_BTD.dtype)

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
    out_BTHV, final = self.kernel(*self._queries_keys_values(conv_BTC), decay_BTH, beta_BTH,
                                  reset_BT, state)
    if decoding:
      self.ssm_state[...] = final
    return self._output(out_BTHV, z, x_BTD.dtype)

  def _queries_keys_values(self, conv_BTC):
    """``(q, k [B, T, value_heads, key_dim], v [B, T, value_heads, value_dim])`` of the
    convolution's output: q and k L2-normalised and repeated per value head, q scaled."""
    batch, length, _ = conv_BTC.shape
    kd, vd, keys = self.key_dim, self.value_dim, self.key_heads * self.key_dim
    q_BTHK = _l2_normalise(conv_BTC[..., :keys].reshape(batch, length, self.key_heads, kd))
    k_BTHK = _l2_normalise(conv_BTC[..., keys:2 * keys].reshape(batch, length, self.key_heads,
                                                                kd))
    v_BTHV = conv_BTC[..., 2 * keys:].reshape(batch, length, self.value_heads, vd)
    if self.group > 1:  # each key head serves `group` consecutive value heads
      q_BTHK = jnp.repeat(q_BTHK, self.group, axis=2)
      k_BTHK = jnp.repeat(k_BTHK, self.group, axis=2)
    return q_BTHK * kd**-0.5, k_BTHK, v_BTHV

  def _output(self, out_BTHV, z_BTHV, dtype):
    """Each value head's output RMS-normalised, gated by ``silu(z)``, projected back."""
    normed = self.norm(out_BTHV.astype(dtype)).astype(jnp.float32)
    gated = (normed * jax.nn.silu(z_BTHV.astype(jnp.float32))).astype(dtype)
    return self.out_proj(gated)

  def _paged_rule(self, mixed_TC, decay_TH, beta_TH, paged: PagedBatch) -> jax.Array:
    """``[T, value_heads, value_dim]``: the convolution and the delta rule of each row of
    ``paged``, from its slot's states (zero for a row starting at position 0), which are
    then replaced by the states after the row's last token."""
    num_tokens, taps = mixed_TC.shape[0], self.conv1d.weight.shape[1]
    conv_SPC, ssm_SHKV = self.conv_state[...], self.ssm_state[...]
    out_THV = None
    for group in paged.row_groups():  # the rows gathered max_q wide, then one-token rows
      slots_R = group.state_slots_B
      fresh_R11 = (group.kv_lens_B == group.q_lens_B)[:, None, None]
      valid_RQ = jnp.arange(group.max_q)[None] < group.q_lens_B[:, None]
      x_RQC = group.gather_rows(mixed_TC)  # padded at each row's end: read by no real token
      history_RPC = jnp.where(fresh_R11, 0, conv_SPC[slots_R]).astype(x_RQC.dtype)
      conv_RQC = jax.nn.silu(self.conv1d(x_RQC, history_RPC, None))
      window_RSC = jnp.concatenate([history_RPC, x_RQC], axis=1)
      last_inputs_RP = group.q_lens_B[:, None] + jnp.arange(taps - 1)[None]
      conv_SPC = conv_SPC.at[slots_R].set(jnp.take_along_axis(
          window_RSC, last_inputs_RP[..., None], axis=1).astype(conv_SPC.dtype))
      q_RQHK, k_RQHK, v_RQHV = self._queries_keys_values(conv_RQC)
      # Padding neither decays nor writes: the state stays as the row's last token left it.
      k_RQHK = jnp.where(valid_RQ[..., None, None], k_RQHK, 0.0)
      decay_RQH = jnp.where(valid_RQ[..., None], group.gather_rows(decay_TH), 0.0)
      beta_RQH = jnp.where(valid_RQ[..., None], group.gather_rows(beta_TH), 0.0)
      state_RHKV = jnp.where(fresh_R11[..., None], 0.0, ssm_SHKV[slots_R])
      out_RQHV, final_RHKV = self.kernel(q_RQHK, k_RQHK, v_RQHV, decay_RQH, beta_RQH, None,
                                         state_RHKV)
      ssm_SHKV = ssm_SHKV.at[slots_R].set(final_RHKV)
      out_THV = group.scatter_rows(out_RQHV, num_tokens, into=out_THV)
    self.conv_state[...], self.ssm_state[...] = conv_SPC, ssm_SHKV
    return out_THV


def _l2_normalise(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """``x / sqrt(sum(x²) + eps)`` over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)

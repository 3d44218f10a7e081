"""Multi-head attention with GQA/MQA, q/k norms, sinks, rotary embeddings and a KV cache.

Per layer, the caller's :class:`~maxnnx.layers.layer_call.LayerCall` gives the rotary
``(cos, sin)`` (``None`` for NoPE layers), a sliding window or a chunk size (Llama 4's local
attention), and the KV cache slot or paged batch.

Two caches exist side by side: the contiguous one of :meth:`Attention.init_cache`
(``[B, S]`` slots per row, used by ``maxnnx.generate``) and the paged one of
:meth:`Attention.init_paged_cache` (a pool of pages shared by every request, used
by the serving engine). Either may be quantized (``kv_cache_dtype`` ``int8`` or ``fp8``:
:mod:`maxnnx.kernels.kv_quant`): keys and values are stored with a float32 scale per token and
KV head beside them, quantized as they are written and dequantized as they are read. A paged
call gets a :class:`~maxnnx.kernels.paged_attention.PagedBatch` that says where this step's
tokens go; the layer writes their keys and values into the pages and calls the
paged-attention strategy (``cfg.runtime.paged_attention_impl``). Nothing here knows
about requests or scheduling.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxnnx.config import LayerType, ModelConfig
from maxnnx.kernels.kv_quant import (
  QUANTIZED_KV_DTYPES,
  QuantizedPages,
  dequantize_kv,
  kv_storage_dtype,
  quantize_kv,
)
from maxnnx.kernels.lookup import kernel_for
from maxnnx.kernels.options import AttentionOptions
from maxnnx.layers.context_parallel import attend, attend_and_max_logits
from maxnnx.layers.layer_call import LayerCall
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.norm_factory import make_norm
from maxnnx.layers.params import logical_param
from maxnnx.layers.qk_clip import MaxLogits
from maxnnx.layers.rope import apply_rope, deinterleave
from maxnnx.sharding import constrain

Q_AXES = ('activation_batch', 'activation_length', 'activation_heads', None)
# Keys/values are gathered along the sequence under context parallelism (split along it
# with the ring strategy: see maxnnx.layers.context_parallel).
KV_AXES = ('activation_batch', 'activation_kv_length', 'activation_kv_heads', None)
OUT_AXES = ('activation_batch', 'activation_length', 'activation_embed')


class Attention(nnx.Module):
  """Self-attention block: project, normalise q/k, rotate, attend, project back.

  Attributes:
    q_proj: ``[d_model] -> [heads, head_dim]``.
    k_proj, v_proj: ``[d_model] -> [kv_heads, head_dim]``; ``v_proj`` is ``None`` when
      the values are the key projection (``attention.global_layers.values_from_keys``), both are
      ``None`` in a layer that attends with another layer's keys and values (``kv_shared``).
    o_proj: ``[heads, head_dim] -> [d_model]``.
    q_norm, k_norm: optional RMSNorms (per head or over the whole projection).
    sinks: ``[heads]`` learned attention-sink logits (``cfg.attention.sinks``) or ``None``.
    max_logits: :class:`~maxnnx.layers.qk_clip.MaxLogits` ``[heads]``, each head's largest
      logit in the last forward pass, when ``cfg.runtime.record_max_logits`` (QK-clip reads
      it); ``None`` otherwise.
    kernel: the attention strategy (``cfg.runtime.attention_impl``), shown in treescope.
    paged_kernel: the paged-attention strategy (``cfg.runtime.paged_attention_impl``).
    cache_k, cache_v: ``nnx.Cache`` ``[B, S, kv_heads, head_dim]`` once
      :meth:`init_cache` has been called; ``None`` otherwise.
    pages_k, pages_v: ``nnx.Cache`` ``[num_pages, page_size, kv_heads, head_dim]``
      once :meth:`init_paged_cache` has been called; ``None`` otherwise.
    cache_k_scale, cache_v_scale, pages_k_scale, pages_v_scale: the float32 scales
      (``[B, S, kv_heads]``, ``[num_pages, page_size, kv_heads]``) of a quantized cache or
      pool; ``None`` for a float one.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer_type: LayerType = 'full',
               kv_shared: bool = False):
    """``layer_type`` picks the layer's shapes (:meth:`ModelConfig.attention_shape`);
    ``kv_shared`` builds a layer without key/value projections, norms or cache, which is
    called with ``shared_kv`` (``ModelConfig.num_kv_shared_layers``)."""
    d, h = cfg.d_model, cfg.num_heads
    hd, kv, values_from_keys = cfg.attention_shape(layer_type)
    dense = dict(dtype=cfg.jnp_dtype(), param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)
    # With an output gate, each head's projection is [query, gate] (Qwen3-Next).
    q_width = 2 * hd if cfg.attention.output_gate else hd
    self.q_proj = DenseGeneral((d,), (h, q_width), axes=('embed', 'heads', 'head_dim'),
                               use_bias=cfg.attention.qkv_bias, **dense)
    self.output_gate = cfg.attention.output_gate
    self.k_proj = (None if kv_shared else
                   DenseGeneral((d,), (kv, hd), axes=('embed', 'kv_heads', 'head_dim'),
                                use_bias=cfg.attention.qkv_bias, **dense))
    self.v_proj = (None if values_from_keys or kv_shared else
                   DenseGeneral((d,), (kv, hd), axes=('embed', 'kv_heads', 'head_dim'),
                                use_bias=cfg.attention.qkv_bias, **dense))
    self.value_norm_eps = cfg.norm_eps if cfg.attention.value_norm else None
    self.o_proj = DenseGeneral((h, hd), (d,), axes=('heads', 'head_dim', 'embed'),
                               use_bias=cfg.attention.out_bias, **dense)
    if cfg.attention.qk_norm == 'head':
      self.q_norm = make_norm(cfg, (hd,), ('head_dim',), rngs=rngs)
      self.k_norm = make_norm(cfg, (hd,), ('head_dim',), rngs=rngs)
    elif cfg.attention.qk_norm == 'projection':
      self.q_norm = make_norm(cfg, (h, hd), ('heads', 'head_dim'), rngs=rngs)
      self.k_norm = make_norm(cfg, (kv, hd), ('kv_heads', 'head_dim'), rngs=rngs)
    else:  # 'l2' has no parameters: see _normalise
      self.q_norm = self.k_norm = None
    if kv_shared:
      self.k_norm = None
    self.qk_l2_norm_eps = cfg.norm_eps if cfg.attention.qk_norm == 'l2' else None
    self.interleaved = cfg.rope_interleave
    self.temperature = ((cfg.attention.temperature_floor, cfg.attention.temperature_scale)
                        if cfg.attention.temperature_tuning else None)
    self.sinks = (logical_param(nnx.initializers.normal(cfg.initializer_range), rngs.params(),
                                (h,), cfg.jnp_dtype('param_dtype'), ('heads',))
                  if cfg.attention.sinks else None)
    self.kernel = kernel_for(cfg, 'attention')
    self.paged_kernel = kernel_for(cfg, 'paged_attention')
    self.scale = cfg.resolved_query_scale
    self.softcap = cfg.attention.logit_softcap
    self.cache_k = nnx.data(None)
    self.cache_v = nnx.data(None)
    self.pages_k = nnx.data(None)
    self.pages_v = nnx.data(None)
    self.cache_k_scale = self.cache_v_scale = nnx.data(None)
    self.pages_k_scale = self.pages_v_scale = nnx.data(None)
    self.max_logits = (MaxLogits(jnp.zeros((h,), jnp.float32), combine='max')
                       if cfg.runtime.record_max_logits else nnx.data(None))

  def init_cache(self, batch: int, max_length: int, dtype, kv_cache_dtype: str = 'auto') -> None:
    """Allocate an empty KV cache for ``batch`` rows of ``max_length`` tokens (none in a
    ``kv_shared`` layer: it reads another layer's), in ``dtype``, or quantized
    (``kv_cache_dtype`` ``int8`` or ``fp8``) with its scales."""
    if self.k_proj is None:
      return
    kv_heads, head_dim = self.k_proj.out_shape
    shape = (batch, max_length, kv_heads, head_dim)
    storage = kv_storage_dtype(kv_cache_dtype)
    self.cache_k = nnx.Cache(jnp.zeros(shape, storage or dtype))
    self.cache_v = nnx.Cache(jnp.zeros(shape, storage or dtype))
    if storage is not None:
      self.cache_k_scale = nnx.Cache(jnp.zeros(shape[:-1], jnp.float32))
      self.cache_v_scale = nnx.Cache(jnp.zeros(shape[:-1], jnp.float32))

  def init_paged_cache(self, num_pages: int, page_size: int, dtype,
                       kv_cache_dtype: str = 'auto') -> None:
    """Allocate an empty pool of ``num_pages`` pages of ``page_size`` tokens, in ``dtype``,
    or quantized (``kv_cache_dtype`` ``int8`` or ``fp8``) with a float32 scale per token and
    kv head beside the pages.

    The pools carry the logical names ``(None, None, 'kv_heads', None)``: on a mesh
    with ``tensor`` they split over the kv heads like the projections that fill them (the
    scales alike). A ``kv_shared`` layer has none.
    """
    if self.k_proj is None:
      return
    kv_heads, head_dim = self.k_proj.out_shape
    shape = (num_pages, page_size, kv_heads, head_dim)
    storage = kv_storage_dtype(kv_cache_dtype)
    names = {'out_sharding': (None, None, 'kv_heads', None), 'eager_sharding': False}
    self.pages_k = nnx.Cache(jnp.zeros(shape, storage or dtype), **names)
    self.pages_v = nnx.Cache(jnp.zeros(shape, storage or dtype), **names)
    if storage is not None:
      names = {'out_sharding': (None, None, 'kv_heads'), 'eager_sharding': False}
      self.pages_k_scale = nnx.Cache(jnp.zeros(shape[:-1], jnp.float32), **names)
      self.pages_v_scale = nnx.Cache(jnp.zeros(shape[:-1], jnp.float32), **names)

  def _normalise(self, q_BTNH, k_BTKH, cos_sin, positions_BT, nope=None):
    """q/k norms, rotary embedding and the NoPE temperature, in the checkpoints' order.

    The ``l2`` norm is applied in rotary layers only (it commutes with the
    rotation); the temperature multiplies the queries of layers without one.
    ``cos_sin=None`` is a layer without rotation; a traced ``nope`` flag (scanned
    stacks mixing NoPE and rotary layers) chooses between both at run time.
    ``k_BTKH=None`` (a ``kv_shared`` layer) normalises the queries alone.
    """
    def each(fn, q, k):
      return fn(q), (None if k is None else fn(k))

    if self.q_norm is not None:
      q_BTNH = self.q_norm(q_BTNH)
      k_BTKH = None if k_BTKH is None else self.k_norm(k_BTKH)
    plain = q_BTNH, k_BTKH
    if cos_sin is None or nope is not None:
      plain = (self._temperature(q_BTNH, positions_BT), k_BTKH)
      if cos_sin is None:  # NoPE layers and learned positions rotate nothing
        return plain
    if self.interleaved:
      q_BTNH, k_BTKH = each(deinterleave, q_BTNH, k_BTKH)
    q_BTNH, k_BTKH = each(lambda x: apply_rope(x, *cos_sin), q_BTNH, k_BTKH)
    if self.qk_l2_norm_eps is not None:
      q_BTNH, k_BTKH = each(lambda x: _unit_rms(x, self.qk_l2_norm_eps), q_BTNH, k_BTKH)
    if nope is None:
      return q_BTNH, k_BTKH
    return each(lambda pair: jnp.where(nope, *pair), (plain[0], q_BTNH),
                None if k_BTKH is None else (plain[1], k_BTKH))

  def _temperature(self, q_BTNH, positions_BT):
    """Queries of a NoPE layer times ``1 + scale * log1p(floor((pos + 1) / floor))``."""
    if self.temperature is None:
      return q_BTNH
    floor, strength = self.temperature
    scale_BT = 1.0 + strength * jnp.log1p(
        jnp.floor((positions_BT.astype(jnp.float32) + 1.0) / floor))
    return (q_BTNH * scale_BT[..., None, None]).astype(q_BTNH.dtype)

  def __call__(self, x_BTD: jax.Array, call: LayerCall) -> jax.Array | tuple[jax.Array, tuple]:
    """Attention output ``[B, T, d_model]``, as ``call`` (a
    :class:`~maxnnx.layers.layer_call.LayerCall`) says.

    ``call.cos_sin`` is the layer's rotary ``(cos, sin)``, or ``None`` to rotate
    nothing (models with learned absolute positions, NoPE layers).
    ``call.sliding_window`` and ``call.chunk_size`` restrict the keys each query sees
    (``ModelConfig.attention.sliding_window``, ``attention.chunk_size``).
    ``call.nope`` (a traced bool, scanned stacks only) says whether this layer skips
    the rotation that ``cos_sin`` would apply.

    With ``call.cache_index`` (decoding), this step's keys and values are written
    into the cache at that slot and the queries attend over the whole cache;
    ``call.mask`` then describes the cache slots as keys.

    With ``call.paged`` (serving), ``x`` is ``[1, T, d_model]``: the flat tokens of
    every scheduled request. Their keys and values are written into the page
    pool at ``paged.slots_T`` and each token attends over its request's pages;
    ``call.mask`` is not used.

    ``call.return_kv`` also returns the keys and values the kernel attended over (this
    call's, the whole cache when decoding, the page pools when paged), which a
    ``kv_shared`` layer of the same type then receives as ``call.shared_kv`` in the same
    mode: ``(out, (k, v))``.
    """
    if call.paged is not None:
      return self._paged(x_BTD, call)
    mask, cos_sin, nope, cache_index = call.mask, call.cos_sin, call.nope, call.cache_index
    q_BTNH, gate_BTNH = self._query(x_BTD)
    positions_BT = None if mask is None else mask.q_positions
    if call.shared_kv is not None:
      q_BTNH, _ = self._normalise(q_BTNH, None, cos_sin, positions_BT, nope)
      k_BTKH, v_BTKH = (a.astype(q_BTNH.dtype) for a in call.shared_kv)
    else:
      k_BTKH, v_BTKH = self._keys_values(x_BTD)
      q_BTNH, k_BTKH = self._normalise(q_BTNH, k_BTKH, cos_sin, positions_BT, nope)
      if cache_index is not None:
        k_BTKH, v_BTKH = self._write_cache(k_BTKH, v_BTKH, cache_index, q_BTNH.dtype)
    q_BTNH = checkpoint_name(constrain(q_BTNH, Q_AXES), 'query_proj')
    k_BTKH = checkpoint_name(constrain(k_BTKH, KV_AXES), 'key_proj')
    v_BTKH = checkpoint_name(constrain(v_BTKH, KV_AXES), 'value_proj')
    options = self._options(call.sliding_window, call.chunk_size)
    if self.max_logits is not None and cache_index is None and mask is not None:
      out_BTNH, self.max_logits[...] = attend_and_max_logits(self.kernel, q_BTNH, k_BTKH,
                                                             v_BTKH, mask, options)
    else:
      out_BTNH = attend(self.kernel, q_BTNH, k_BTKH, v_BTKH, mask, options)
    out_BTNH = self._gate(out_BTNH, gate_BTNH)
    out_BTNH = checkpoint_name(constrain(out_BTNH, Q_AXES), 'attention_out')
    out_BTD = checkpoint_name(constrain(self.o_proj(out_BTNH), OUT_AXES), 'out_proj')
    return (out_BTD, (k_BTKH, v_BTKH)) if call.return_kv else out_BTD

  def _write_cache(self, k_BTKH, v_BTKH, cache_index, dtype):
    """Write this step's keys and values at ``cache_index``; the whole cache, in ``dtype``."""
    if self.cache_k is None:
      raise ValueError('Decoding needs a KV cache: call model.init_cache(batch, max_length).')
    start = (0, cache_index, 0, 0)
    if self.cache_k_scale is None:
      self.cache_k[...] = jax.lax.dynamic_update_slice(
          self.cache_k[...], k_BTKH.astype(self.cache_k.dtype), start)
      self.cache_v[...] = jax.lax.dynamic_update_slice(
          self.cache_v[...], v_BTKH.astype(self.cache_v.dtype), start)
      return self.cache_k[...].astype(dtype), self.cache_v[...].astype(dtype)
    name = QUANTIZED_KV_DTYPES[self.cache_k.dtype]
    out = []
    for cache, scales, new_BTKH in ((self.cache_k, self.cache_k_scale, k_BTKH),
                                    (self.cache_v, self.cache_v_scale, v_BTKH)):
      values_BTKH, scales_BTK = quantize_kv(new_BTKH, name)
      cache[...] = jax.lax.dynamic_update_slice(cache[...], values_BTKH, start)
      scales[...] = jax.lax.dynamic_update_slice(scales[...], scales_BTK, start[:3])
      out.append(dequantize_kv(cache[...], scales[...], dtype))
    return tuple(out)

  def _options(self, sliding_window, chunk_size) -> AttentionOptions:
    sinks_N = None if self.sinks is None else self.sinks[...]
    return AttentionOptions(scale=self.scale, softcap=self.softcap,
                            sliding_window=sliding_window, sinks_N=sinks_N,
                            chunk_size=chunk_size)

  def _paged(self, x_1TD, call: LayerCall):
    """``[1, T, d_model]`` (and the page pools with ``call.return_kv``): the flat tokens'
    attention over their requests' pages, after writing their keys and values there."""
    paged, cos_sin, nope, shared_kv = call.paged, call.cos_sin, call.nope, call.shared_kv
    q_1TNH, gate_1TNH = self._query(x_1TD)
    positions_1T = paged.positions(x_1TD.shape[1])[None] if self.temperature else None
    if shared_kv is not None:  # the page pools of the layer this one shares with
      q_1TNH, _ = self._normalise(q_1TNH, None, cos_sin, positions_1T, nope)
      pages_k, pages_v = shared_kv
    else:
      if self.pages_k is None:
        raise ValueError('Paged attention needs a page pool: call '
                         'model.init_paged_cache(num_pages, page_size).')
      k_1TKH, v_1TKH = self._keys_values(x_1TD)
      q_1TNH, k_1TKH = self._normalise(q_1TNH, k_1TKH, cos_sin, positions_1T, nope)
      pages_k = paged.write(self._pool(self.pages_k, self.pages_k_scale), k_1TKH[0])
      pages_v = paged.write(self._pool(self.pages_v, self.pages_v_scale), v_1TKH[0])
      for pages, pool, scales in ((pages_k, self.pages_k, self.pages_k_scale),
                                  (pages_v, self.pages_v, self.pages_v_scale)):
        if scales is None:
          pool[...] = pages
        else:
          pool[...], scales[...] = pages.values, pages.scales
    options = self._options(call.sliding_window, call.chunk_size)
    out_TNH = self.paged_kernel(q_1TNH[0], pages_k, pages_v, paged, options)
    out_1TD = self.o_proj(self._gate(out_TNH[None].astype(q_1TNH.dtype), gate_1TNH))
    return (out_1TD, (pages_k, pages_v)) if call.return_kv else out_1TD

  @staticmethod
  def _pool(pages, scales):
    """A page pool as the paged strategies take it: the pages, or with ``scales``
    (quantized) a :class:`~maxnnx.kernels.kv_quant.QuantizedPages`."""
    return pages[...] if scales is None else QuantizedPages(pages[...], scales[...])

  def _keys_values(self, x_BTD):
    """The projected keys and values ``[B, T, kv_heads, head_dim]`` (values normalised
    with ``attention.value_norm``; before the key norm and rotation)."""
    k_BTKH = self.k_proj(x_BTD)
    v_BTKH = k_BTKH if self.v_proj is None else self.v_proj(x_BTD)
    if self.value_norm_eps is not None:
      v_BTKH = _unit_rms(v_BTKH, self.value_norm_eps)
    return k_BTKH, v_BTKH

  def _query(self, x_BTD):
    """The queries ``[B, T, heads, head_dim]`` and, with an output gate, the gate logits."""
    q_BTNX = self.q_proj(x_BTD)
    if not self.output_gate:
      return q_BTNX, None
    head_dim = q_BTNX.shape[-1] // 2
    return q_BTNX[..., :head_dim], q_BTNX[..., head_dim:]

  @staticmethod
  def _gate(out_BTNH, gate_BTNH):
    """``out * sigmoid(gate)`` per head and channel (no gate: ``out``)."""
    if gate_BTNH is None:
      return out_BTNH
    return (out_BTNH * jax.nn.sigmoid(gate_BTNH.astype(jnp.float32))).astype(out_BTNH.dtype)


def _unit_rms(x: jax.Array, eps: float) -> jax.Array:
  """``x / sqrt(mean(x², over the last axis) + eps)`` in float32, cast back (no scale)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
          ).astype(x.dtype)

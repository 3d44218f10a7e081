"""The KV caches a :class:`~maxnnx.Transformer` allocates in its layers: a contiguous cache for
``generate`` (:meth:`KVCaches.init_cache`) and page pools for the serving engine
(:meth:`KVCaches.init_paged_cache`), either in the compute dtype or quantized
(``kv_cache_dtype``, :mod:`maxnnx.kernels.kv_quant`)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from maxnnx.kernels.kv_quant import check_kv_cache_dtype
from maxnnx.layers.attention import Attention
from maxnnx.layers.gated_deltanet import GatedDeltaNet


class KVCaches:
  """Cache allocation of the Transformer (a mixin: it reads ``config``, ``vision_tower`` and
  ``cache_blocks_in_order()`` of the model)."""

  def init_cache(self, batch: int, max_length: int, dtype=None, *,
                 kv_cache_dtype: str = 'auto') -> None:
    """Allocate an empty KV cache of ``max_length`` slots for ``batch`` rows.

    ``kv_cache_dtype`` ``int8`` or ``fp8`` stores the attention layers' keys and values
    quantized (:mod:`maxnnx.kernels.kv_quant`); recurrent states stay in ``dtype``.
    """
    dtype = dtype or self.config.jnp_dtype()
    scanned = self.config.runtime.scan_layers
    blocks = self.cache_blocks_in_order()
    quantized = self._kv_quantization(blocks, kv_cache_dtype)

    def init(block):
      extra = {} if isinstance(block.attn, GatedDeltaNet) else quantized
      block.attn.init_cache(batch, max_length, dtype, **extra)

    for block in blocks:
      if scanned:
        nnx.vmap(init, in_axes=0, out_axes=0)(block)
      else:
        init(block)
    self.cache_segment_ids = nnx.Cache(jnp.zeros((batch, max_length), jnp.int32))
    self.cache_positions = nnx.Cache(jnp.zeros((batch, max_length), jnp.int32))
    self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))
    if self.vision_tower is not None:
      self.cache_blocks = nnx.Cache(jnp.full((batch, max_length), -1, jnp.int32))

  def init_paged_cache(self, num_pages: int, page_size: int, dtype=None, *,
                       num_slots: int = 0, window_pages: int | None = None,
                       kv_cache_dtype: str = 'auto') -> None:
    """Allocate every layer's pool of ``num_pages`` KV pages of ``page_size`` tokens, and
    ``num_slots`` recurrent states in layers that keep one per request (Gated DeltaNet).

    ``window_pages``: the pool size of the sliding layers instead (unscanned models mixing
    sliding and full layers; their pages come from a pool of their own, read through
    ``PagedBatch.window_page_table_BM``).

    ``kv_cache_dtype`` ``int8`` or ``fp8`` makes the attention layers' pools quantized
    (:mod:`maxnnx.kernels.kv_quant`); recurrent states stay in ``dtype``.

    The pools and states are ``nnx.Cache`` variables of the token-mixing layers, read and
    written by ``hidden_states(..., paged=batch)``; which page and slot hold what is the
    caller's business (see :mod:`maxnnx.serving`).
    """
    dtype = dtype or self.config.jnp_dtype()
    scanned = self.config.runtime.scan_layers
    blocks = self.cache_blocks_in_order()
    for block in blocks:
      if not hasattr(block.attn, 'init_paged_cache'):
        raise NotImplementedError(
            f'{type(block.attn).__name__} has no paged KV cache (init_paged_cache); paged '
            'serving needs attention layers that take a PagedBatch.')
    if 'linear' in self.config.resolved_layer_types and num_slots < 1:
      raise ValueError('Gated DeltaNet layers keep a state per request: init_paged_cache '
                       'needs num_slots >= 1 (one per running request, plus scratch slot 0).')

    if window_pages is not None and scanned:
      raise ValueError('window_pages needs unscanned layers (scan_layers=False).')
    quantized = self._kv_quantization(blocks, kv_cache_dtype)

    def init(block, pages):
      extra = {'num_slots': num_slots} if isinstance(block.attn, GatedDeltaNet) else quantized
      block.attn.init_paged_cache(pages, page_size, dtype, **extra)

    for i, block in enumerate(blocks):
      if scanned:
        nnx.vmap(lambda block: init(block, num_pages), in_axes=0, out_axes=0,
                 transform_metadata={nnx.PARTITION_NAME: 'layers'})(block)
      elif window_pages is not None and self.config.resolved_layer_types[i] == 'sliding':
        init(block, window_pages)
      else:
        init(block, num_pages)

  def _kv_quantization(self, blocks, kv_cache_dtype: str) -> dict:
    """The keyword the attention layers' cache allocation takes for ``kv_cache_dtype``
    (none for ``auto``); a one-line error when a layer keeps a cache it cannot quantize."""
    if check_kv_cache_dtype(kv_cache_dtype) == 'auto':
      return {}
    for block in blocks:
      if not isinstance(block.attn, (Attention, GatedDeltaNet)):
        raise ValueError(
            f'kv_cache_dtype={kv_cache_dtype!r} quantizes multi-head/GQA attention caches; '
            f"this {self.config.family} model's {type(block.attn).__name__} layers keep theirs "
            'in float: use kv_cache_dtype=auto.')
    return {'kv_cache_dtype': kv_cache_dtype}

"""Multi-head latent attention (DeepSeek V2/V3) with a compressed KV cache.

Keys and values are rebuilt from one small latent per token:
``c = norm(x · W_kv_a)[:kv_lora_rank]`` (shared by all heads), plus one shared
rotary key part ``k_rope`` of ``qk_rope_head_dim``. Per head,
``[k_nope, v] = c · W_kv_b`` and ``k = [k_nope, k_rope]``. Queries are optionally
low-rank too (``q_lora_rank``): ``q = norm(x · W_q_a) · W_q_b``; only their last
``qk_rope_head_dim`` dims are rotated.

When decoding, the cache holds ``c`` and the rotated ``k_rope``
(``kv_lora_rank + qk_rope_head_dim`` numbers per token instead of
``2 * heads * head_dim``); full keys and values are rebuilt from it each step.
The serving engine's paged cache holds the same two parts in pages
(:meth:`MLA.init_paged_cache`).
Any attention kernel works: values are zero-padded to the query/key width when
narrower (and sliced back), so the kernel sees one head width.

With ``mla.index_topk`` (DeepSeek V3.2's sparse attention), a
:class:`~maxnnx.layers.indexer.LightningIndexer` picks the keys each query keeps and
the kernel gets them as ``AttentionOptions.key_mask_BTS``; decoding caches the
indexer's keys beside the latents, and the paged cache holds them in pages of their own
(``pages_index_keys``): each request's queries choose among its gathered keys.

With YaRN scaling and ``mscale_all_dim``, the softmax scale is multiplied by
``mscale(factor, mscale_all_dim) ** 2`` as DeepSeek does (unless
``cfg.attention.query_scale`` is given explicitly).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxnnx.config import ModelConfig
from maxnnx.kernels.lookup import kernel_for
from maxnnx.kernels.options import AttentionOptions
from maxnnx.kernels.paged_attention import PagedBatch
from maxnnx.layers.attention import KV_AXES, OUT_AXES, Q_AXES
from maxnnx.layers.context_parallel import attend, attend_and_max_logits
from maxnnx.layers.indexer import (
  IndexerLoss,
  LightningIndexer,
  attention_target,
  indexer_kl_loss,
)
from maxnnx.layers.layer_call import LayerCall
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.norms import RMSNorm
from maxnnx.layers.qk_clip import MaxLogits
from maxnnx.layers.rope import apply_rope, deinterleave
from maxnnx.sharding import constrain

# DeepSeek's low-rank norms use this epsilon whatever the model's norm_eps is.
LORA_NORM_EPS = 1e-6


def mla_query_scale(cfg: ModelConfig) -> float:
  """Softmax scale of MLA: ``qk_head_dim ** -0.5``, times the YaRN ``mscale ** 2``."""
  if cfg.attention.query_scale is not None:
    return cfg.attention.query_scale
  scale = (cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim) ** -0.5
  rope = cfg.rope
  if rope.scaling == 'yarn' and rope.mscale_all_dim:
    factor = rope.factor or cfg.max_position_embeddings / rope.original_max_position_embeddings
    if factor > 1:
      scale *= (0.1 * rope.mscale_all_dim * math.log(factor) + 1.0) ** 2
  return scale


class MLA(nnx.Module):
  """Multi-head latent attention; same call signature as :class:`~maxnnx.layers.Attention`.

  Attributes:
    q_proj: ``[d_model] -> [heads, qk_head_dim]`` (when ``q_lora_rank`` is None).
    q_a_proj, q_a_layernorm, q_b_proj: low-rank queries (when ``q_lora_rank`` is set).
    kv_a_proj_with_mqa: ``[d_model] -> [kv_lora_rank + qk_rope_head_dim]``.
    kv_a_layernorm: RMSNorm of the latent.
    kv_b_proj: ``[kv_lora_rank] -> [heads, qk_nope_head_dim + v_head_dim]``.
    o_proj: ``[heads, v_head_dim] -> [d_model]``.
    kernel: the attention strategy (``cfg.runtime.attention_impl``).
    indexer: the DeepSeek Sparse Attention :class:`~maxnnx.layers.indexer.LightningIndexer`
      (``mla.index_topk`` set), or ``None``.
    cache_latent, cache_k_rope: ``nnx.Cache`` ``[B, S, kv_lora_rank]`` and
      ``[B, S, qk_rope_head_dim]`` after :meth:`init_cache` (and ``cache_index_keys``
      ``[B, S, index_head_dim]`` with an indexer).
    pages_latent, pages_k_rope: ``nnx.Cache`` ``[num_pages, page_size, kv_lora_rank]``
      and ``[num_pages, page_size, qk_rope_head_dim]`` after :meth:`init_paged_cache`.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, h = cfg.d_model, cfg.num_heads
    mla = cfg.mla
    self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    self.kv_lora_rank = mla.kv_lora_rank
    qk = self.nope + self.rope
    dense = dict(dtype=cfg.jnp_dtype(), param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)
    norm = dict(eps=LORA_NORM_EPS, dtype=cfg.jnp_dtype(),
                param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)
    if cfg.mla.q_lora_rank is None:
      self.q_proj = DenseGeneral((d,), (h, qk), axes=('embed', 'heads', 'head_dim'), **dense)
      self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
    else:
      r = cfg.mla.q_lora_rank
      self.q_proj = None
      self.q_a_proj = DenseGeneral((d,), (r,), axes=('embed', 'q_lora'),
                                   use_bias=cfg.attention.qkv_bias, **dense)
      self.q_a_layernorm = RMSNorm(r, axes=('q_lora',), **norm)
      self.q_b_proj = DenseGeneral((r,), (h, qk), axes=('q_lora', 'heads', 'head_dim'), **dense)
    self.kv_a_proj_with_mqa = DenseGeneral((d,), (self.kv_lora_rank + self.rope,),
                                           axes=('embed', 'kv_lora'),
                                           use_bias=cfg.attention.qkv_bias, **dense)
    self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, axes=('kv_lora',), **norm)
    self.kv_b_proj = DenseGeneral((self.kv_lora_rank,), (h, self.nope + self.v_dim),
                                  axes=('kv_lora', 'heads', 'head_dim'), **dense)
    self.o_proj = DenseGeneral((h, self.v_dim), (d,), axes=('heads', 'head_dim', 'embed'),
                               use_bias=cfg.attention.out_bias, **dense)
    self.kernel = kernel_for(cfg, 'attention')
    self.scale = mla_query_scale(cfg)
    self.softcap = cfg.attention.logit_softcap
    self.interleaved = cfg.rope_interleave
    self.indexer = (LightningIndexer(cfg, rngs=rngs) if cfg.mla.index_topk is not None
                    else nnx.data(None))
    self.cache_latent = nnx.data(None)
    self.cache_k_rope = nnx.data(None)
    self.cache_index_keys = nnx.data(None)
    self.pages_latent = nnx.data(None)
    self.pages_k_rope = nnx.data(None)
    self.pages_index_keys = nnx.data(None)
    self.max_logits = (MaxLogits(jnp.zeros((h,), jnp.float32), combine='max')
                       if cfg.runtime.record_max_logits else nnx.data(None))
    self.indexer_training = mla.indexer_training
    self.indexer_loss = (IndexerLoss(jnp.zeros((), jnp.float32))
                         if mla.indexer_training != 'off' else nnx.data(None))

  def init_cache(self, batch: int, max_length: int, dtype) -> None:
    """Allocate an empty compressed cache (latent + rotated key part)."""
    self.cache_latent = nnx.Cache(jnp.zeros((batch, max_length, self.kv_lora_rank), dtype))
    self.cache_k_rope = nnx.Cache(jnp.zeros((batch, max_length, self.rope), dtype))
    if self.indexer is not None:
      self.cache_index_keys = nnx.Cache(
          jnp.zeros((batch, max_length, self.indexer.head_dim), dtype))

  def init_paged_cache(self, num_pages: int, page_size: int, dtype) -> None:
    """Allocate an empty pool of pages holding the latent and the rotated key part (and
    the indexer's keys, with one)."""
    self.pages_latent = nnx.Cache(jnp.zeros((num_pages, page_size, self.kv_lora_rank), dtype))
    self.pages_k_rope = nnx.Cache(jnp.zeros((num_pages, page_size, self.rope), dtype))
    if self.indexer is not None:
      self.pages_index_keys = nnx.Cache(
          jnp.zeros((num_pages, page_size, self.indexer.head_dim), dtype))

  def __call__(self, x_BTD: jax.Array, call: LayerCall) -> jax.Array:
    """Attention output ``[B, T, d_model]`` (see :class:`~maxnnx.layers.Attention`); of
    ``call`` (a :class:`~maxnnx.layers.layer_call.LayerCall`) it reads ``cos_sin``, ``mask``,
    ``sliding_window``, ``cache_index`` and ``paged``.

    With ``call.paged``, the pages hold the compressed cache; each request's latents are
    gathered, expanded to keys and values and attended with the layer's dense kernel.
    """
    call.refuse('MLA', 'chunk_size', 'nope', 'shared_kv', 'return_kv')
    cos_sin, mask, sliding_window = call.cos_sin, call.mask, call.sliding_window
    cache_index, paged = call.cache_index, call.paged
    q_BTNQ, latent_BTL, k_rot_BT1R, q_lora_BTR = self._project(x_BTD, cos_sin)
    if paged is not None:
      index = (None if self.indexer is None else
               (self.indexer.keys(x_BTD, cos_sin),
                *self.indexer.queries(x_BTD, q_lora_BTR, cos_sin)))
      return self._paged(q_BTNQ, latent_BTL, k_rot_BT1R, paged, sliding_window, index)
    index_keys_BSD = None if self.indexer is None else self.indexer.keys(x_BTD, cos_sin)
    if cache_index is not None:
      if self.cache_latent is None:
        raise ValueError('Decoding needs a KV cache: call model.init_cache(batch, max_length).')
      self.cache_latent[...] = jax.lax.dynamic_update_slice(
          self.cache_latent[...], latent_BTL.astype(self.cache_latent.dtype), (0, cache_index, 0))
      self.cache_k_rope[...] = jax.lax.dynamic_update_slice(
          self.cache_k_rope[...], k_rot_BT1R[:, :, 0].astype(self.cache_k_rope.dtype),
          (0, cache_index, 0))
      latent_BTL = self.cache_latent[...].astype(x_BTD.dtype)
      k_rot_BT1R = self.cache_k_rope[...][:, :, None].astype(x_BTD.dtype)
      if self.indexer is not None:
        self.cache_index_keys[...] = jax.lax.dynamic_update_slice(
            self.cache_index_keys[...], index_keys_BSD.astype(self.cache_index_keys.dtype),
            (0, cache_index, 0))
        index_keys_BSD = self.cache_index_keys[...]
    key_mask_BTS = index_BTS = None
    if self.indexer is not None:
      visible_BTS = mask.dense(sliding_window)
      if self.indexer_loss is not None and cache_index is None:  # training the indexer
        # One scoring pass, from a detached input: its loss trains the indexer alone, and the
        # selection (no gradient) takes the same scores.
        index_BTS = self._index_scores(x_BTD, q_lora_BTR, cos_sin, visible_BTS)
        if self.indexer_training == 'sparse':  # the warm-up stage attends densely
          key_mask_BTS = self.indexer.top_keys(index_BTS, visible_BTS)
      else:
        key_mask_BTS = self.indexer.select(x_BTD, q_lora_BTR, cos_sin, index_keys_BSD,
                                           visible_BTS)
    out_BTNV = self._attend(q_BTNQ, latent_BTL, k_rot_BT1R, mask, sliding_window, key_mask_BTS,
                            record=cache_index is None and mask is not None, index_BTS=index_BTS)
    return checkpoint_name(constrain(self.o_proj(out_BTNV), OUT_AXES), 'out_proj')

  def _index_scores(self, x_BTD, q_lora_BTR, cos_sin, visible_BTS):
    """The indexer's differentiable scores ``[B, T, S]`` from a detached input, so that its
    loss trains the indexer alone (DeepSeek V3.2)."""
    x_BTD, q_lora_BTR = jax.lax.stop_gradient(x_BTD), jax.lax.stop_gradient(q_lora_BTR)
    q_BTHD, weights_BTH = self.indexer.queries(x_BTD, q_lora_BTR, cos_sin)
    return self.indexer.scores(q_BTHD, weights_BTH, self.indexer.keys(x_BTD, cos_sin),
                               visible_BTS)

  def _project(self, x_BTD, cos_sin):
    """Rotated queries ``[B, T, N, qk]``, latents ``[B, T, L]``, key parts ``[B, T, 1, R]``
    and the normalised low-rank query ``[B, T, q_lora_rank]`` (``None`` without one)."""
    q_lora_BTR = None
    if self.q_proj is not None:
      q_BTNQ = self.q_proj(x_BTD)
    else:
      q_lora_BTR = self.q_a_layernorm(self.q_a_proj(x_BTD))
      q_BTNQ = self.q_b_proj(q_lora_BTR)
    q_nope, q_rot = q_BTNQ[..., :self.nope], q_BTNQ[..., self.nope:]
    kv_a_BTC = self.kv_a_proj_with_mqa(x_BTD)
    latent_BTL = self.kv_a_layernorm(kv_a_BTC[..., :self.kv_lora_rank])
    k_rot_BT1R = kv_a_BTC[..., None, self.kv_lora_rank:]
    if self.interleaved:
      q_rot, k_rot_BT1R = deinterleave(q_rot), deinterleave(k_rot_BT1R)
    q_rot = apply_rope(q_rot, *cos_sin)
    k_rot_BT1R = apply_rope(k_rot_BT1R, *cos_sin)
    q_BTNQ = jnp.concatenate([q_nope, q_rot.astype(q_nope.dtype)], axis=-1)
    return q_BTNQ, latent_BTL, k_rot_BT1R, q_lora_BTR

  def _attend(self, q_BTNQ, latent_BSL, k_rot_BS1R, mask, sliding_window, key_mask_BTS=None,
              record: bool = False, index_BTS=None):
    """Rebuild keys and values from the latents and attend: ``[B, T, N, v_head_dim]``; with
    ``record`` (a training or prefill pass), also fill :attr:`max_logits` if there is one, and
    with ``index_BTS`` (the indexer's scores) :attr:`indexer_loss`, over the keys attended."""
    kv_BSNX = self.kv_b_proj(latent_BSL)
    k_nope, v_BSNV = kv_BSNX[..., :self.nope], kv_BSNX[..., self.nope:]
    k_rot_BSNR = jnp.broadcast_to(k_rot_BS1R, k_nope.shape[:3] + (self.rope,))
    k_BSNQ = jnp.concatenate([k_nope, k_rot_BSNR.astype(k_nope.dtype)], axis=-1)
    width = max(self.nope + self.rope, self.v_dim)  # kernels take one head width

    def pad(a):
      return jnp.pad(a, [(0, 0)] * 3 + [(0, width - a.shape[-1])]) if a.shape[-1] < width else a

    q_BTNQ, k_BSNQ, v_BSNQ = pad(q_BTNQ), pad(k_BSNQ), pad(v_BSNV)
    q_BTNQ = checkpoint_name(constrain(q_BTNQ, Q_AXES), 'query_proj')
    k_BSNQ = checkpoint_name(constrain(k_BSNQ, KV_AXES), 'key_proj')
    v_BSNQ = checkpoint_name(constrain(v_BSNQ, KV_AXES), 'value_proj')
    options = AttentionOptions(scale=self.scale, softcap=self.softcap,
                               sliding_window=sliding_window, key_mask_BTS=key_mask_BTS)
    if index_BTS is not None:
      over_BTS = options.visible(mask)
      self.indexer_loss[...] = indexer_kl_loss(
          index_BTS, attention_target(q_BTNQ, k_BSNQ, over_BTS, self.scale), over_BTS)
    if record and self.max_logits is not None:
      out, self.max_logits[...] = attend_and_max_logits(self.kernel, q_BTNQ, k_BSNQ, v_BSNQ,
                                                        mask, options)
    else:
      out = attend(self.kernel, q_BTNQ, k_BSNQ, v_BSNQ, mask, options)
    return checkpoint_name(constrain(out[..., :self.v_dim], Q_AXES), 'attention_out')

  def _paged(self, q_1TNQ, latent_1TL, k_rot_1T1R, paged: PagedBatch, sliding_window,
             index=None):
    """``[1, T, d_model]``: the flat tokens' attention over their requests' pages.
    ``index``: the indexer's ``(keys [1, T, D], queries [1, T, H, D], weights [1, T, H])``
    of these tokens (sparse MLA), or ``None``."""
    if self.pages_latent is None:
      raise ValueError('Paged attention needs a page pool: call '
                       'model.init_paged_cache(num_pages, page_size).')
    self.pages_latent[...] = paged.write(self.pages_latent[...], latent_1TL[0])
    self.pages_k_rope[...] = paged.write(self.pages_k_rope[...], k_rot_1T1R[0, :, 0])
    dtype = q_1TNQ.dtype
    pages_latent, pages_k_rope = self.pages_latent[...], self.pages_k_rope[...]
    if index is not None:
      index_keys_1TD, index_q_1THD, index_w_1TH = index
      self.pages_index_keys[...] = paged.write(self.pages_index_keys[...], index_keys_1TD[0])
      pages_index_keys = self.pages_index_keys[...]

    def attend_rows(group: PagedBatch):
      latent_BSL = group.gather_pages(pages_latent).astype(dtype)
      k_rot_BS1R = group.gather_pages(pages_k_rope)[:, :, None].astype(dtype)
      mask = group.row_mask(latent_BSL.shape[1])
      key_mask_BQS = None
      if index is not None:  # each row's queries choose among its own gathered keys
        key_mask_BQS = self.indexer.choose(
            group.gather_rows(index_q_1THD[0]), group.gather_rows(index_w_1TH[0]),
            group.gather_pages(pages_index_keys), mask.dense(sliding_window))
      return self._attend(group.gather_rows(q_1TNQ[0]), latent_BSL, k_rot_BS1R, mask,
                          sliding_window, key_mask_BQS)

    out_TNV = paged.map_row_groups(attend_rows, q_1TNQ.shape[1])
    return self.o_proj(out_TNV[None])


def indexer_losses(model) -> list[jax.Array]:
  """The :class:`~maxnnx.layers.indexer.IndexerLoss` of every MLA layer of ``model`` that
  trains its indexer (``[]`` when none does); traceable."""
  return [m.indexer_loss[...] for _, m in nnx.iter_modules(model)
          if isinstance(m, MLA) and m.indexer_loss is not None]

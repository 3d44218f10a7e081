"""Multi-head attention with GQA/MQA, q/k norms, sinks, rotary embeddings and a KV cache."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxnnx.config import ModelConfig
from maxnnx.kernels.lookup import kernel_for
from maxnnx.kernels.masks import AttentionMask
from maxnnx.kernels.options import AttentionOptions
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.norm_factory import make_norm
from maxnnx.layers.params import logical_param
from maxnnx.layers.rope import apply_rope
from maxnnx.sharding import constrain

Q_AXES = ('activation_batch', 'activation_length', 'activation_heads', None)
# Keys/values are gathered along the sequence under context parallelism.
KV_AXES = ('activation_batch', 'activation_kv_length', 'activation_kv_heads', None)
OUT_AXES = ('activation_batch', 'activation_length', 'activation_embed')


class Attention(nnx.Module):
  """Self-attention block: project, normalise q/k, rotate, attend, project back.

  Attributes:
    q_proj: ``[d_model] -> [heads, head_dim]``.
    k_proj, v_proj: ``[d_model] -> [kv_heads, head_dim]``.
    o_proj: ``[heads, head_dim] -> [d_model]``.
    q_norm, k_norm: optional RMSNorms (per head or over the whole projection).
    sinks: ``[heads]`` learned attention-sink logits (``cfg.attention_sinks``) or ``None``.
    kernel: the attention strategy (``cfg.runtime.attention_impl``), shown in treescope.
    cache_k, cache_v: ``nnx.Cache`` ``[B, S, kv_heads, head_dim]`` once
      :meth:`init_cache` has been called; ``None`` otherwise.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, hd, h, kv = cfg.d_model, cfg.resolved_head_dim, cfg.num_heads, cfg.num_kv_heads
    dense = dict(dtype=cfg.jnp_dtype(), param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)
    self.q_proj = DenseGeneral((d,), (h, hd), axes=('embed', 'heads', 'head_dim'),
                               use_bias=cfg.qkv_bias, **dense)
    self.k_proj = DenseGeneral((d,), (kv, hd), axes=('embed', 'kv_heads', 'head_dim'),
                               use_bias=cfg.qkv_bias, **dense)
    self.v_proj = DenseGeneral((d,), (kv, hd), axes=('embed', 'kv_heads', 'head_dim'),
                               use_bias=cfg.qkv_bias, **dense)
    self.o_proj = DenseGeneral((h, hd), (d,), axes=('heads', 'head_dim', 'embed'),
                               use_bias=cfg.out_bias, **dense)
    if cfg.qk_norm == 'head':
      self.q_norm = make_norm(cfg, (hd,), ('head_dim',), rngs=rngs)
      self.k_norm = make_norm(cfg, (hd,), ('head_dim',), rngs=rngs)
    elif cfg.qk_norm == 'projection':
      self.q_norm = make_norm(cfg, (h, hd), ('heads', 'head_dim'), rngs=rngs)
      self.k_norm = make_norm(cfg, (kv, hd), ('kv_heads', 'head_dim'), rngs=rngs)
    else:
      self.q_norm = self.k_norm = None
    self.sinks = (logical_param(nnx.initializers.normal(cfg.initializer_range), rngs.params(),
                                (h,), cfg.jnp_dtype('param_dtype'), ('heads',))
                  if cfg.attention_sinks else None)
    self.kernel = kernel_for(cfg, 'attention')
    self.scale = cfg.resolved_query_scale
    self.softcap = cfg.attn_logit_softcap
    self.cache_k = nnx.data(None)
    self.cache_v = nnx.data(None)

  def init_cache(self, batch: int, max_length: int, dtype) -> None:
    """Allocate an empty KV cache for ``batch`` rows of ``max_length`` tokens."""
    kv_heads, head_dim = self.k_proj.out_shape
    shape = (batch, max_length, kv_heads, head_dim)
    self.cache_k = nnx.Cache(jnp.zeros(shape, dtype))
    self.cache_v = nnx.Cache(jnp.zeros(shape, dtype))

  def __call__(self, x_BTD: jax.Array, cos_sin: tuple[jax.Array, jax.Array] | None,
               mask: AttentionMask, *, sliding_window: int | jax.Array | None = None,
               cache_index: jax.Array | None = None) -> jax.Array:
    """Attention output ``[B, T, d_model]``.

    ``cos_sin`` is the layer's rotary ``(cos, sin)``, or ``None`` to rotate
    nothing (models with learned absolute positions).

    With ``cache_index`` (decoding), this step's keys and values are written
    into the cache at that slot and the queries attend over the whole cache;
    ``mask`` then describes the cache slots as keys.
    """
    q_BTNH, k_BTKH, v_BTKH = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
    if self.q_norm is not None:
      q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
    if cos_sin is not None:  # None: positions were added to the embeddings instead
      q_BTNH = apply_rope(q_BTNH, *cos_sin)
      k_BTKH = apply_rope(k_BTKH, *cos_sin)
    if cache_index is not None:
      if self.cache_k is None:
        raise ValueError('Decoding needs a KV cache: call model.init_cache(batch, max_length).')
      start = (0, cache_index, 0, 0)
      self.cache_k[...] = jax.lax.dynamic_update_slice(
          self.cache_k[...], k_BTKH.astype(self.cache_k.dtype), start)
      self.cache_v[...] = jax.lax.dynamic_update_slice(
          self.cache_v[...], v_BTKH.astype(self.cache_v.dtype), start)
      k_BTKH = self.cache_k[...].astype(q_BTNH.dtype)
      v_BTKH = self.cache_v[...].astype(q_BTNH.dtype)
    q_BTNH = checkpoint_name(constrain(q_BTNH, Q_AXES), 'query_proj')
    k_BTKH = checkpoint_name(constrain(k_BTKH, KV_AXES), 'key_proj')
    v_BTKH = checkpoint_name(constrain(v_BTKH, KV_AXES), 'value_proj')
    sinks_N = None if self.sinks is None else self.sinks[...]
    options = AttentionOptions(scale=self.scale, softcap=self.softcap,
                               sliding_window=sliding_window, sinks_N=sinks_N)
    out_BTNH = self.kernel(q_BTNH, k_BTKH, v_BTKH, mask, options)
    out_BTNH = checkpoint_name(constrain(out_BTNH, Q_AXES), 'attention_out')
    return checkpoint_name(constrain(self.o_proj(out_BTNH), OUT_AXES), 'out_proj')

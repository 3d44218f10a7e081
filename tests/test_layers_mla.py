"""Multi-head latent attention: the cache is compressed, the YaRN softmax scale, and DeepSeek
V3.2's sparse attention against float64 scores and a dense masked reference."""

import dataclasses
import math
import os

import jax.numpy as jnp
import numpy as np
from conftest import FIXTURES
from flax import nnx

import maxnnx
from maxnnx.kernels.masks import AttentionMask
from maxnnx.layers.layer_call import LayerCall
from maxnnx.layers.mla import MLA, mla_query_scale


def test_cache_holds_the_latent_and_rope_key_only():
  model = maxnnx.from_pretrained(os.path.join(FIXTURES, 'deepseek_v2'))
  cfg = model.config
  model.init_cache(2, 16)
  attn = model.layers[0].attn
  assert isinstance(attn, MLA)
  assert attn.cache_latent.shape == (2, 16, cfg.mla.kv_lora_rank)
  assert attn.cache_k_rope.shape == (2, 16, cfg.mla.qk_rope_head_dim)
  assert not hasattr(attn, 'cache_k')
  full = 2 * cfg.num_heads * (cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim)
  assert cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim < full


def test_yarn_mscale_scales_the_softmax():
  cfg = maxnnx.config_from_pretrained(os.path.join(FIXTURES, 'deepseek_v3'))
  mscale = 0.1 * 0.8 * math.log(4.0) + 1.0   # mscale_all_dim 0.8, factor 4
  assert math.isclose(mla_query_scale(cfg), 24**-0.5 * mscale**2)
  assert math.isclose(mla_query_scale(cfg.replace(**{'attention.query_scale': 0.5})), 0.5)


# -- DeepSeek Sparse Attention (V3.2) ---------------------------------------------------------


def _f64(x):
  return np.asarray(x, np.float64)


def _numpy_indexer_scores(indexer, x_BTD, q_lora_BTR, cos, sin):
  """The lightning indexer's scores ``[B, T, S]`` in float64, from its parameters."""
  def dense(module, x):
    return np.tensordot(_f64(x), _f64(module.kernel[...]), axes=1)

  def rotate(v, rope_dim):
    rot, rest = v[..., :rope_dim], v[..., rope_dim:]
    x1, x2 = rot[..., :rope_dim // 2], rot[..., rope_dim // 2:]
    c, s = _f64(cos)[:, :, None], _f64(sin)[:, :, None]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)

  k = dense(indexer.wk, x_BTD)
  k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
  k = k * _f64(indexer.k_norm.scale[...]) + _f64(indexer.k_norm.bias[...])
  k = rotate(k[:, :, None], indexer.rope_dim)[:, :, 0]
  q = rotate(dense(indexer.wq_b, q_lora_BTR), indexer.rope_dim)
  scores = np.maximum(np.einsum('bthd,bsd->bths', q, k) / np.sqrt(indexer.head_dim), 0.0)
  weights = dense(indexer.weights_proj, x_BTD) / np.sqrt(indexer.heads)
  return np.einsum('bth,bths->bts', weights, scores)


def test_sparse_attention_equals_dense_attention_over_the_selected_keys():
  """The indexer keeps each query's top-k visible keys by its float64 scores, and sparse MLA
  equals the same (dense) MLA with every other key masked out."""
  model = maxnnx.from_pretrained(os.path.join(FIXTURES, 'deepseek_v32'))
  attn = model.layers[1].attn
  topk = model.config.mla.index_topk
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 24, model.config.d_model)), jnp.float32)
  segments = jnp.asarray([[1] * 24, [0] * 5 + [1] * 19], jnp.int32)  # row 1 left-padded
  positions = jnp.asarray([list(range(24)), [0] * 5 + list(range(19))], jnp.int32)
  mask = AttentionMask.causal(segments, positions)
  cos_sin = model._cos_sin(positions)['full']
  _, _, _, q_lora = attn._project(x, cos_sin)
  scores = _numpy_indexer_scores(attn.indexer, x, q_lora, *cos_sin)
  visible = np.asarray(mask.dense())
  selected = np.asarray(attn.indexer.select(x, q_lora, cos_sin, attn.indexer.keys(x, cos_sin),
                                            jnp.asarray(visible)))
  for b, t in np.ndindex(*visible.shape[:2]):
    if not visible[b, t].any():
      continue  # padding
    keys = np.flatnonzero(visible[b, t])
    best = keys[np.argsort(-scores[b, t, keys], kind='stable')[:topk]]
    np.testing.assert_array_equal(np.flatnonzero(selected[b, t]), np.sort(best))
  assert (selected.sum(-1) < visible.sum(-1)).any()  # the selection drops keys

  call = LayerCall(cos_sin=cos_sin, mask=mask)
  sparse = attn(x, call)
  dense_attn = nnx.merge(nnx.graphdef(MLA(model.config.replace(**{'mla.index_topk': None}),
                                          rngs=nnx.Rngs(0))),
                         nnx.filter_state(nnx.state(attn), lambda path, _: 'indexer' not in path))
  original = dense_attn.kernel
  dense_attn.kernel = _with_key_mask(original, jnp.asarray(selected))
  masked = dense_attn(x, call)
  valid = np.asarray(segments != 0)
  np.testing.assert_allclose(np.asarray(sparse)[valid], np.asarray(masked)[valid], atol=1e-5)
  dense_attn.kernel = original
  assert np.abs(np.asarray(dense_attn(x, call)) - np.asarray(sparse))[valid].max() > 1e-2


def _with_key_mask(kernel, key_mask_BTS):
  """``kernel`` called with ``key_mask_BTS`` ANDed into every mask (the reference)."""
  def call(q, k, v, mask, options):
    return kernel(q, k, v, mask, dataclasses.replace(options, key_mask_BTS=key_mask_BTS))
  return nnx.data(call)

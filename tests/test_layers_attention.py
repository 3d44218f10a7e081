"""XlaAttention, AttentionMask and the Attention module against NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from flax import nnx

from maxnnx.config import ModelConfig, RopeConfig
from maxnnx.kernels.attention import XlaAttention, get_attention_kernel
from maxnnx.kernels.masks import AttentionMask
from maxnnx.kernels.options import AttentionOptions
from maxnnx.layers.attention import Attention
from maxnnx.layers.layer_call import LayerCall
from maxnnx.layers.rope import RotaryEmbedding

PACKED_SEGMENTS = np.array([[1, 1, 1, 2, 2, 3, 3, 3]])
PACKED_POSITIONS = np.array([[0, 1, 2, 0, 1, 0, 1, 2]])
DOC2 = slice(3, 5)


def _qkv(seed, b=2, t=8, s=None, heads=4, kv_heads=2, head_dim=8):
  rng = np.random.default_rng(seed)
  s = t if s is None else s
  return (rng.normal(size=(b, t, heads, head_dim)), rng.normal(size=(b, s, kv_heads, head_dim)),
          rng.normal(size=(b, s, kv_heads, head_dim)))


@jax.jit
def _jit_kernel(q, k, v, mask, scale, softcap, window):
  return XlaAttention()(q, k, v, mask, AttentionOptions(scale, softcap, window))


def _kernel(q, k, v, mask, scale=0.35, softcap=None, window=None):
  """XlaAttention under jit; scale, softcap and window are traced (one compile per shape)."""
  q, k, v = (jnp.asarray(a, jnp.float32) for a in (q, k, v))
  as_array = lambda a, dtype: None if a is None else jnp.asarray(a, dtype)
  return ref.f64(_jit_kernel(q, k, v, mask, as_array(scale, jnp.float32),
                             as_array(softcap, jnp.float32), as_array(window, jnp.int32)))


def _mask(seg, pos, kv_seg=None, kv_pos=None):
  kv_seg = seg if kv_seg is None else kv_seg
  kv_pos = pos if kv_pos is None else kv_pos
  return AttentionMask(*(jnp.asarray(a, jnp.int32) for a in (seg, pos, kv_seg, kv_pos)))


def _causal(b, t):
  return np.ones((b, t), int), np.broadcast_to(np.arange(t), (b, t))


# -- kernel ----------------------------------------------------------------------


@pytest.mark.parametrize('heads,kv_heads', [(4, 4), (4, 2), (6, 3), (4, 1)])
def test_kernel_matches_reference_gqa_mqa(heads, kv_heads):
  """MHA, GQA and MQA: query head h attends with kv head h // (heads / kv_heads)."""
  q, k, v = _qkv(0, heads=heads, kv_heads=kv_heads)
  seg, pos = _causal(2, 8)
  expected = ref.attention(q, k, v, ref.visible(seg, pos, seg, pos), 0.35)
  ref.assert_close(_kernel(q, k, v, _mask(seg, pos)), expected)


def test_kernel_gqa_grouping_is_contiguous():
  """With 4 heads on 2 kv heads, heads 0,1 read kv head 0 and heads 2,3 kv head 1."""
  q, k, v = _qkv(1, heads=4, kv_heads=2)
  q[:, :, 1] = q[:, :, 0]
  q[:, :, 2] = q[:, :, 0]
  seg, pos = _causal(2, 8)
  out = _kernel(q, k, v, _mask(seg, pos))
  ref.assert_close(out[:, :, 1], out[:, :, 0], atol=1e-6)
  assert not np.allclose(out[:, :, 2], out[:, :, 0], atol=1e-3)


def test_kernel_softcap():
  """Soft-capping applies cap * tanh(s / cap) to the scaled scores before masking."""
  q, k, v = _qkv(2)
  q *= 4.0  # large scores so the cap bites
  seg, pos = _causal(2, 8)
  allowed = ref.visible(seg, pos, seg, pos)
  expected = ref.attention(q, k, v, allowed, 0.35, softcap=2.0)
  ref.assert_close(_kernel(q, k, v, _mask(seg, pos), softcap=2.0), expected)
  assert not np.allclose(expected, ref.attention(q, k, v, allowed, 0.35), atol=1e-2)


@pytest.mark.parametrize('scale', [1.0, 8**-0.5, 0.05])
def test_kernel_query_scale(scale):
  """The scale multiplies q·k before the softmax."""
  q, k, v = _qkv(3)
  seg, pos = _causal(2, 8)
  expected = ref.attention(q, k, v, ref.visible(seg, pos, seg, pos), scale)
  ref.assert_close(_kernel(q, k, v, _mask(seg, pos), scale=scale), expected)


@pytest.mark.parametrize('window', [1, 3, 8])
def test_kernel_sliding_window(window):
  """Sliding window: key visible iff 0 <= q_pos - k_pos < window."""
  q, k, v = _qkv(4)
  seg, pos = _causal(2, 8)
  expected = ref.attention(q, k, v, ref.visible(seg, pos, seg, pos, window), 0.35)
  ref.assert_close(_kernel(q, k, v, _mask(seg, pos), window=window), expected)


def test_window_one_attends_only_to_itself():
  """A window of 1 leaves only the query's own key: the output is its value."""
  q, k, v = _qkv(5, heads=2, kv_heads=2)
  seg, pos = _causal(2, 8)
  ref.assert_close(_kernel(q, k, v, _mask(seg, pos), window=1), v, atol=1e-6)


def test_traced_window_equals_static_window():
  """A jnp int window under jit gives the same output as a static Python int."""
  q, k, v = _qkv(6)
  seg, pos = _causal(2, 8)
  mask = _mask(seg, pos)
  static = XlaAttention()(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                          jnp.asarray(v, jnp.float32), mask,
                          AttentionOptions(scale=0.35, sliding_window=4))
  traced = _kernel(q, k, v, mask, window=4)
  ref.assert_close(traced, static, rtol=1e-6, atol=1e-7)
  assert not np.allclose(static, _kernel(q, k, v, mask), atol=1e-3)


def test_mask_dense_matches_reference_rule():
  """AttentionMask.dense implements same-segment, non-padding, causal, in-window."""
  rng = np.random.default_rng(7)
  seg = np.array([[1, 1, 2, 2, 2, 0, 0], [0, 0, 1, 1, 1, 1, 1]])
  pos = rng.integers(0, 6, size=seg.shape)
  kv_seg = np.array([[1, 2, 0, 1, 2, 2, 1, 0, 2], [1, 1, 0, 1, 1, 1, 0, 1, 1]])
  kv_pos = rng.integers(0, 6, size=kv_seg.shape)
  mask = _mask(seg, pos, kv_seg, kv_pos)
  for window in (None, 2, 3):
    np.testing.assert_array_equal(np.asarray(mask.dense(window)),
                                  ref.visible(seg, pos, kv_seg, kv_pos, window))


@pytest.mark.parametrize('chunk', [1, 3, 5])
def test_kernel_chunked_attention(chunk):
  """Chunked attention: a key is visible iff causal and in the query's chunk of positions,
  in packed rows too (chunks count from each document's position 0)."""
  q, k, v = _qkv(12, b=1)
  seg, pos = PACKED_SEGMENTS, PACKED_POSITIONS
  mask = _mask(seg, pos)
  expected = ref.attention(q, k, v, ref.visible(seg, pos, seg, pos, chunk=chunk), 0.35)
  f32 = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
  for chunk_size in (chunk, jnp.int32(chunk)):  # static and traced
    out = jax.jit(lambda q, k, v, c: XlaAttention()(q, k, v, mask, AttentionOptions(
        scale=0.35, chunk_size=c)))(*f32, chunk_size)
    ref.assert_close(ref.f64(out), expected)
  np.testing.assert_array_equal(np.asarray(mask.dense(None, chunk)),
                                ref.visible(seg, pos, seg, pos, chunk=chunk))
  np.testing.assert_array_equal(np.asarray(mask.dense(2, chunk)),
                                ref.visible(seg, pos, seg, pos, 2, chunk))


def test_kernel_queries_against_longer_cache():
  """Queries [T] attend over S != T keys described by the mask (decode layout)."""
  q, k, v = _qkv(8, t=2, s=10)
  kv_seg = np.array([[1] * 6 + [0] * 4, [1] * 6 + [0] * 4])
  kv_pos = np.broadcast_to(np.arange(10), (2, 10))
  seg, pos = np.ones((2, 2), int), np.array([[4, 5], [4, 5]])
  expected = ref.attention(q, k, v, ref.visible(seg, pos, kv_seg, kv_pos), 0.35)
  ref.assert_close(_kernel(q, k, v, _mask(seg, pos, kv_seg, kv_pos)), expected)


def test_padding_keys_get_no_weight():
  """Keys in segment 0 never contribute: huge values there leave outputs unchanged."""
  q, k, v = _qkv(9, b=1)
  seg = np.array([[0, 0, 1, 1, 1, 1, 0, 1]])  # left padding and a hole
  pos = np.array([[0, 0, 0, 1, 2, 3, 0, 4]])
  real = seg[0] != 0
  v_big, k_big = v.copy(), k.copy()
  v_big[:, ~real] = 1e6
  k_big[:, ~real] = 50.0  # would dominate the softmax if it leaked in
  mask = _mask(seg, pos)
  base = _kernel(q, k, v, mask)
  ref.assert_close(_kernel(q, k_big, v_big, mask)[:, real], base[:, real], rtol=1e-6, atol=1e-7)
  expected = ref.attention(q, k, v, ref.visible(seg, pos, seg, pos), 0.35)
  ref.assert_close(base[:, real], expected[:, real])


def test_kernel_packed_documents_are_isolated():
  """In a packed row, document 2's outputs equal attending over document 2 alone."""
  q, k, v = _qkv(10, b=1)
  packed = _kernel(q, k, v, _mask(PACKED_SEGMENTS, PACKED_POSITIONS))
  seg2, pos2 = _causal(1, 2)
  alone = _kernel(q[:, DOC2], k[:, DOC2], v[:, DOC2], _mask(seg2, pos2))
  ref.assert_close(packed[:, DOC2], alone)
  allowed = ref.visible(PACKED_SEGMENTS, PACKED_POSITIONS, PACKED_SEGMENTS, PACKED_POSITIONS)
  ref.assert_close(packed, ref.attention(q, k, v, allowed, 0.35))


def test_get_attention_kernel_unknown_name():
  """An unknown attention_impl names the known implementations."""
  assert isinstance(get_attention_kernel('xla'), XlaAttention)
  with pytest.raises(ValueError, match='xla'):
    get_attention_kernel('flash-nope')


# -- module ----------------------------------------------------------------------


def _cfg(**overrides):
  base = dict(vocab_size=32, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
              mlp_dim=64, max_position_embeddings=64)
  base.update(overrides)
  return ModelConfig.from_dict(base)


def _module(cfg, seed=0):
  attn = Attention(cfg, rngs=nnx.Rngs(seed))
  ref.randomize_params(attn, np.random.default_rng(seed + 100))
  return attn


@nnx.jit(static_argnames=('rotary', 'window'))
def _jit_module(attn, x, seg, pos, rotary, window):
  return attn(x, LayerCall(cos_sin=rotary.cos_sin(pos), mask=AttentionMask.causal(seg, pos),
                           sliding_window=window))


def _run(attn, cfg, x, seg, pos, window=None):
  rotary = RotaryEmbedding.from_config(cfg.rope, cfg.resolved_head_dim,
                                       cfg.max_position_embeddings)
  seg, pos = jnp.asarray(seg, jnp.int32), jnp.asarray(pos, jnp.int32)
  return ref.f64(_jit_module(attn, jnp.asarray(x, jnp.float32), seg, pos, rotary, window))


def _reference(attn, cfg, x, seg, pos, window=None):
  inv_freq, att = ref.rope_tables(cfg.rope, cfg.resolved_head_dim, cfg.max_position_embeddings,
                                  pos)
  return ref.attention_module(
      x, nnx.to_pure_dict(nnx.state(attn, nnx.Param)), positions=pos, segment_ids=seg,
      inv_freq=inv_freq, attention_factor=att, scale=cfg.resolved_query_scale,
      softcap=cfg.attention.logit_softcap, window=window, qk_norm=cfg.attention.qk_norm,
      norm_eps=cfg.norm_eps, norm_offset=cfg.norm_scale_offset)


MODULE_CASES = {
    'gqa': {},
    'mha_bias': dict(num_kv_heads=4, **{'attention.qkv_bias': True, 'attention.out_bias': True}),
    'mqa_softcap_scale': dict(num_kv_heads=1, **{'attention.logit_softcap': 3.0,
                                                 'attention.query_scale': 0.5}),
    'head_qk_norm_gemma': dict(**{'attention.qk_norm': 'head'}, norm_scale_offset=1.0),
    'projection_qk_norm': dict(**{'attention.qk_norm': 'projection'}, num_kv_heads=4),
    'partial_rope': dict(rope=RopeConfig(theta=500.0, partial_rotary_factor=0.5)),
    'yarn': dict(rope=RopeConfig(scaling='yarn', factor=4.0,
                                 original_max_position_embeddings=16)),
}


@pytest.mark.parametrize('case', list(MODULE_CASES))
def test_attention_module_matches_reference(case):
  """Attention = project, (q/k norm), rope, softmax attention, output projection."""
  cfg = _cfg(**MODULE_CASES[case])
  attn = _module(cfg)
  rng = np.random.default_rng(11)
  x = rng.normal(size=(2, 8, 32))
  seg, pos = _causal(2, 8)
  ref.assert_close(_run(attn, cfg, x, seg, pos), _reference(attn, cfg, x, seg, pos))


def test_attention_module_sliding_window_matches_reference():
  """The module passes its sliding window through to the kernel."""
  cfg = _cfg()
  attn = _module(cfg, seed=1)
  x = np.random.default_rng(12).normal(size=(1, 12, 32))
  seg, pos = _causal(1, 12)
  got = _run(attn, cfg, x, seg, pos, window=3)
  ref.assert_close(got, _reference(attn, cfg, x, seg, pos, window=3))
  assert not np.allclose(got, _run(attn, cfg, x, seg, pos), atol=1e-3)


@pytest.mark.parametrize('window', [None, 2])
def test_attention_module_packed_equals_document_alone(window):
  """Packed segments with restarting positions: document 2 is computed as if alone."""
  cfg = _cfg(**{'attention.qk_norm': 'head'})
  attn = _module(cfg, seed=2)
  rng = np.random.default_rng(13)
  x = rng.normal(size=(1, 8, 32))
  packed = _run(attn, cfg, x, PACKED_SEGMENTS, PACKED_POSITIONS, window)
  seg2, pos2 = _causal(1, 2)
  ref.assert_close(packed[:, DOC2], _run(attn, cfg, x[:, DOC2], seg2, pos2, window))
  # Rewriting documents 1 and 3 does not move document 2 at all.
  x_other = x.copy()
  x_other[:, :3] = rng.normal(size=(1, 3, 32)) * 10
  x_other[:, 5:] = rng.normal(size=(1, 3, 32)) * 10
  other = _run(attn, cfg, x_other, PACKED_SEGMENTS, PACKED_POSITIONS, window)
  ref.assert_close(other[:, DOC2], packed[:, DOC2], rtol=1e-6, atol=1e-7)
  for doc in (slice(0, 3), slice(5, 8)):
    n = doc.stop - doc.start
    alone = _run(attn, cfg, x[:, doc], *_causal(1, n), window)
    ref.assert_close(packed[:, doc], alone)


def test_attention_module_projection_axes():
  """q/k/v/o kernels carry logical axis names per dimension."""
  attn = Attention(_cfg(**{'attention.qkv_bias': True}), rngs=nnx.Rngs(0))
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(attn, nnx.Param)))
  assert tuple(specs['q_proj']['kernel']) == ('embed', 'heads', 'head_dim')
  assert tuple(specs['k_proj']['kernel']) == ('embed', 'kv_heads', 'head_dim')
  assert tuple(specs['v_proj']['kernel']) == ('embed', 'kv_heads', 'head_dim')
  assert tuple(specs['o_proj']['kernel']) == ('heads', 'head_dim', 'embed')
  assert attn.q_proj.bias.get_metadata()['out_sharding'] == ('heads', 'head_dim')
  assert attn.q_proj.kernel.shape == (32, 4, 8) and attn.k_proj.kernel.shape == (32, 2, 8)


# -- attention sinks ---------------------------------------------------------------


@pytest.mark.parametrize('window', [None, 2])
def test_kernel_sinks_match_reference(window):
  """Each head's sink joins its softmax as a value-less key (GQA, packed documents, window)."""
  q, k, v = _qkv(14, b=1, heads=4, kv_heads=2)
  sinks = np.random.default_rng(15).normal(size=4) * 2
  allowed = ref.visible(PACKED_SEGMENTS, PACKED_POSITIONS, PACKED_SEGMENTS, PACKED_POSITIONS,
                        window)
  expected = ref.attention(q, k, v, allowed, 0.35, sinks_N=sinks)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  got = XlaAttention()(f32(q), f32(k), f32(v), _mask(PACKED_SEGMENTS, PACKED_POSITIONS),
                       AttentionOptions(scale=0.35, sliding_window=window, sinks_N=f32(sinks)))
  ref.assert_close(got, expected)
  assert not np.allclose(expected, ref.attention(q, k, v, allowed, 0.35), atol=1e-2)


def test_attention_module_sinks():
  """Sinks are a [heads] parameter passed to the kernel; at -1e4 they vanish."""
  cfg = _cfg(**{'attention.sinks': True})
  attn = _module(cfg, seed=3)
  rng = np.random.default_rng(16)
  attn.sinks[...] = jnp.asarray(rng.normal(size=4), jnp.float32)
  assert attn.sinks.get_metadata()['out_sharding'] == ('heads',)
  x = rng.normal(size=(1, 8, 32))
  for seg, pos in (_causal(1, 8), (PACKED_SEGMENTS, PACKED_POSITIONS)):
    got = _run(attn, cfg, x, seg, pos, window=3)
    ref.assert_close(got, _reference(attn, cfg, x, seg, pos, window=3))
  attn.sinks[...] = jnp.full((4,), -1e4, jnp.float32)
  without = _run(attn, cfg, x, seg, pos, window=3)
  assert not np.allclose(without, got, atol=1e-2)
  plain = nnx.to_pure_dict(nnx.state(attn, nnx.Param))
  del plain['sinks']
  inv_freq, att = ref.rope_tables(cfg.rope, cfg.resolved_head_dim, cfg.max_position_embeddings,
                                  pos)
  ref.assert_close(without, ref.attention_module(
      x, plain, positions=pos, segment_ids=seg, inv_freq=inv_freq, attention_factor=att,
      scale=cfg.resolved_query_scale, window=3))


def test_attention_module_sinks_refused_by_kernel_without_them():
  """A strategy that declares no sinks refuses them under kernel_on_unsupported='error'."""
  from maxnnx.kernels import KernelUnsupportedError
  cfg = _cfg(**{'attention.sinks': True, 'runtime.attention_impl': 'jax_nn',
                'runtime.kernel_on_unsupported': 'error'})
  with pytest.raises(KernelUnsupportedError, match='attention sinks are not supported'):
    _run(_module(cfg), cfg, np.zeros((1, 4, 32)), *_causal(1, 4))

"""``xla_flash`` where the query blocks are uneven, and the per-head max logits (QK-clip's
record) it tracks as it attends: against ``xla`` and float64 NumPy."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import equations

from maxnnx.kernels import AttentionMask, AttentionOptions, BlockwiseAttention, XlaAttention
from maxnnx.kernels.attention_auto import AutoAttention
from maxnnx.kernels.attention_blockwise import block_plan
from maxnnx.kernels.masks import index_order_matches_positions

LENGTH, HEAD_DIM = 18, 8  # blocks of 4 rows: 4 query blocks of 4, 5, 5 and 4 rows
KERNEL = BlockwiseAttention(block_size=4, on_unsupported='error')


def _layout(reordered: bool):
  """``[2, 18]`` segment ids and positions: two packed documents with padding at the end,
  in index order (blocks skip) or shuffled (what context-parallel load balancing gives: the
  run-time check fails and the all-keys fallback runs)."""
  seg = np.array([[1] * 10 + [2] * 6 + [0] * 2, [1] * 18])
  pos = np.array([[*range(10), *range(6), 0, 0], [*range(18)]])
  if reordered:
    order = np.random.default_rng(0).permutation(LENGTH)
    seg, pos = seg[:, order], pos[:, order]
  mask = AttentionMask.causal(jnp.asarray(seg, jnp.int32), jnp.asarray(pos, jnp.int32))
  for per_index in (False, True):
    assert bool(index_order_matches_positions(mask, step_per_index=per_index)) != reordered
  return mask


def _inputs(seed, heads=4, kv_heads=2):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(2, LENGTH, heads, HEAD_DIM)) * 2
  k, v = (rng.normal(size=(2, LENGTH, kv_heads, HEAD_DIM)) * 2 for _ in range(2))
  return rng, *(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def _numpy_visible(mask, window=None, chunk=None, key_mask=None):
  """float64-side reference of which keys each query sees ``[B, T, S]``."""
  seg, pos = np.asarray(mask.q_segment_ids), np.asarray(mask.q_positions)
  q_seg, k_seg, q_pos, k_pos = seg[:, :, None], seg[:, None], pos[:, :, None], pos[:, None]
  allowed = (q_seg == k_seg) & (k_seg != 0) & (k_pos <= q_pos)
  if window is not None:
    allowed &= q_pos - k_pos < window
  if chunk is not None:
    allowed &= q_pos // chunk == k_pos // chunk
  return allowed if key_mask is None else allowed & np.asarray(key_mask)


def _numpy_max_logits(q, k, allowed, scale):
  """float64 ``max over visible (b, t, s) of scale * q . k`` per query head."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  scores = np.einsum('btnh,bsnh->bnts', q, k) * scale
  return np.where(allowed[:, None], scores, -np.inf).max(axis=(0, 2, 3))


def _assert_close(actual, expected, rel=1e-5):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  scale = max(float(np.max(np.abs(expected))), 1e-6)
  np.testing.assert_allclose(actual, expected, atol=rel * scale, rtol=0)


def test_uneven_blocks_fallback_scores_one_padded_block_at_a_time():
  """18 rows in blocks of 4, 5, 5, 4: the skipping branch scores each block against its
  keys; the fallback branch loops over one padded [5 x 18] block (unrolled, its four
  [4 or 5 x 18] blocks may all be alive at once)."""
  assert block_plan(LENGTH, LENGTH, block_size=4, max_blocks=8, window=None) == (
      (0, 4, 0, 4), (4, 9, 0, 9), (9, 14, 0, 14), (14, 18, 0, 18))
  _, q, k, _ = _inputs(1)
  v = jnp.ones(k.shape[:3] + (3,))  # a v head size no score matmul has
  mask, options = _layout(False), AttentionOptions(scale=0.3)
  jaxpr = jax.make_jaxpr(lambda q, k, v: KERNEL(q, k, v, mask, options))(q, k, v)
  score_shapes = sorted(eqn.outvars[0].aval.shape[-2:] for eqn in equations(jaxpr.jaxpr)
                        if eqn.primitive.name == 'dot_general'
                        and eqn.outvars[0].aval.shape[-1] != 3)
  assert score_shapes == [(4, 4), (4, 18), (5, 9), (5, 14), (5, 18)]


@pytest.mark.parametrize('reordered', [False, True], ids=['skipping', 'fallback'])
def test_uneven_blocks_match_xla_with_sinks_softcap_and_key_mask(reordered):
  """Uneven query blocks, GQA, soft-capping, sinks and a sparse key mask, on both branches:
  the output and the q, k, v and sink gradients equal autodiff of ``xla``'s (the fallback's
  padding rows add nothing)."""
  rng, q, k, v = _inputs(2 + reordered)
  mask = _layout(reordered)
  keys_BTS = jnp.asarray((rng.random((2, LENGTH, LENGTH)) < 0.6) | np.eye(LENGTH, dtype=bool))
  real = np.asarray(mask.q_segment_ids != 0)[..., None, None]
  weights = jnp.asarray(rng.normal(size=q.shape) * real, jnp.float32)
  sinks = jnp.asarray(rng.normal(size=4), jnp.float32)

  def loss(kernel, q, k, v, sinks):
    options = AttentionOptions(scale=0.3, softcap=1.5, sinks_N=sinks, key_mask_BTS=keys_BTS)
    out = kernel(q, k, v, mask, options)
    return jnp.sum(out * weights), out

  grad = lambda kernel: jax.jit(jax.value_and_grad(  # noqa: E731
      functools.partial(loss, kernel), argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
  (_, got), got_grads = grad(KERNEL)
  (_, expected), expected_grads = grad(XlaAttention())
  _assert_close(np.where(real, got, 0), np.where(real, expected, 0))
  for g, e in zip(got_grads, expected_grads):
    _assert_close(g, e)
  assert float(jnp.abs(expected_grads[3]).max()) > 1e-3


@pytest.mark.parametrize('reordered', [False, True], ids=['skipping', 'fallback'])
@pytest.mark.parametrize('bounds', [
    {}, {'softcap': 0.5}, {'sliding_window': 3}, {'chunk_size': 5}, {'key_mask': True}],
    ids=['causal', 'softcap', 'window', 'chunk', 'key_mask'])
def test_max_logits_equal_numpy_and_leave_the_output_and_gradients(bounds, reordered):
  """The per-head max logit ``xla_flash`` tracks in its blocks equals float64 NumPy's over
  the visible keys (before the soft-cap), uneven blocks and either branch; the output and
  the q, k, v gradients equal ``xla``'s, and no gradient flows through the max logits."""
  rng, q, k, v = _inputs(4 + reordered)
  mask, bounds = _layout(reordered), dict(bounds)
  keys_BTS = None
  if bounds.pop('key_mask', False):
    keys_BTS = jnp.asarray((rng.random((2, LENGTH, LENGTH)) < 0.5) | np.eye(LENGTH, dtype=bool))
  options = AttentionOptions(scale=0.3, key_mask_BTS=keys_BTS, **bounds)
  real = np.asarray(mask.q_segment_ids != 0)[..., None, None]
  weights = jnp.asarray(rng.normal(size=q.shape) * real, jnp.float32)

  def with_max(q, k, v):
    out, max_N = KERNEL.attend_and_max_logits(q, k, v, mask, options)
    return jnp.sum(out * weights) + jnp.sum(max_N), (out, max_N)

  def plain(q, k, v):
    out = XlaAttention()(q, k, v, mask, options)
    return jnp.sum(out * weights), (out, None)

  grads, (out, max_N) = jax.jit(jax.grad(with_max, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  ref_grads, (ref_out, _) = jax.jit(jax.grad(plain, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  allowed = _numpy_visible(mask, bounds.get('sliding_window'), bounds.get('chunk_size'),
                           keys_BTS)
  np.testing.assert_allclose(max_N, _numpy_max_logits(q, k, allowed, 0.3), rtol=1e-5)
  _assert_close(np.where(real, out, 0), np.where(real, ref_out, 0))
  for g, e in zip(grads, ref_grads):
    _assert_close(g, e)


def test_only_strategies_that_track_max_logits_return_them():
  """``xla`` (and the other strategies) leave the max logits to the caller (``None``);
  ``auto`` returns those of the strategy it picks (``xla_flash`` on CPU); a call
  ``xla_flash`` cannot serve (image blocks) falls back to ``xla`` without them."""
  _, q, k, v = _inputs(6)
  mask, options = _layout(False), AttentionOptions(scale=0.3)
  out, max_N = XlaAttention().attend_and_max_logits(q, k, v, mask, options)
  assert max_N is None
  auto_out, auto_max = AutoAttention().attend_and_max_logits(q, k, v, mask, options)
  _assert_close(auto_out, out)
  expected = _numpy_max_logits(q, k, _numpy_visible(mask), 0.3)
  np.testing.assert_allclose(auto_max, expected, rtol=1e-5)
  blocks = jnp.full(mask.q_segment_ids.shape, -1, jnp.int32)
  with_blocks = dataclasses.replace(mask, q_blocks=blocks, kv_blocks=blocks)
  fallback = dataclasses.replace(KERNEL, on_unsupported='fallback')
  out, max_N = fallback.attend_and_max_logits(q, k, v, with_blocks, options)
  assert max_N is None
  _assert_close(out, XlaAttention()(q, k, v, with_blocks, options))

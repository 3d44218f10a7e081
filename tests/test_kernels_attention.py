"""Attention strategies agree with the ``xla`` reference, and refuse or fall back as declared."""

import dataclasses
import functools
import logging
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxpr_walk import equations

import maxnnx
from maxnnx.config import ConfigError, ModelConfig
from maxnnx.kernels import (
  ATTENTION_IMPLEMENTATIONS,
  AttentionCapabilities,
  AttentionKernel,
  AttentionMask,
  AttentionOptions,
  AttentionRequest,
  BlockwiseAttention,
  KernelUnsupportedError,
  PallasFlashAttention,
  XlaAttention,
  get_attention_kernel,
)
from maxnnx.kernels.attention_blockwise import block_plan, covered_by
from maxnnx.kernels.attention_pallas import index_order_matches_positions
from maxnnx.kernels.capabilities import current_platform, reset_warnings


def _pallas_interpret(on_unsupported='error'):
  return PallasFlashAttention(name='pallas_interpret', interpret=True,
                              on_unsupported=on_unsupported)


# Variants worth testing besides the registered strategies: the Pallas kernel in the
# Pallas interpreter (runs on any platform).
EXTRA_KERNELS = {'pallas_interpret': _pallas_interpret}
# Test-sized settings of registered strategies: blocks of 4 rows cut the 16-token scenarios
# into 4 query blocks.
TEST_SETTINGS = {'xla_flash': dict(block_size=4)}
STRATEGIES = [*ATTENTION_IMPLEMENTATIONS, *EXTRA_KERNELS]


def _kernel(name, on_unsupported='error'):
  """The strategy ``name`` (registered or extra) under ``on_unsupported``, at test sizes."""
  if name in EXTRA_KERNELS:
    return EXTRA_KERNELS[name](on_unsupported)
  kernel = get_attention_kernel(name, on_unsupported=on_unsupported)
  return dataclasses.replace(kernel, **TEST_SETTINGS.get(name, {}))


# name -> (heads, kv_heads, q_len, kv_len, v_head_dim, options)
SCENARIOS = {
    'gqa_causal': (4, 2, 16, 16, 8, {}),
    'mqa_causal': (4, 1, 16, 16, 8, {}),
    'packed_padded': (4, 2, 16, 16, 8, {'packed': True}),
    'window': (4, 2, 16, 16, 8, {'window': 5}),
    'traced_window': (4, 2, 16, 16, 8, {'window': 5, 'traced': True}),
    'softcap': (4, 2, 16, 16, 8, {'softcap': 1.5}),
    'sinks': (4, 2, 16, 16, 8, {'sinks': True}),
    'decode': (4, 2, 2, 16, 8, {}),
    'mla_v_dim': (4, 4, 16, 16, 12, {}),
    'chunked': (4, 2, 16, 16, 8, {'chunk': 5, 'packed': True}),
    'traced_chunk': (4, 2, 16, 16, 8, {'chunk': 5, 'traced': True}),
}
BF16_SCENARIOS = ('gqa_causal', 'packed_padded')
HEAD_DIM = 8


def _rng(*key):
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _case(scenario, dtype, rng):
  """q, k, v, mask, options and the per-row weights of the test loss."""
  heads, kv_heads, t, s, v_dim, opts = SCENARIOS[scenario]
  q = rng.normal(size=(2, t, heads, HEAD_DIM))
  k = rng.normal(size=(2, s, kv_heads, HEAD_DIM))
  v = rng.normal(size=(2, s, kv_heads, v_dim))
  if opts.get('packed'):
    seg = np.array([[1] * 5 + [2] * 7 + [3] * 4, [0] * 3 + [1] * 9 + [2] * 4])
    pos = np.array([[*range(5), *range(7), *range(4)], [0] * 3 + [*range(9), *range(4)]])
    mask = AttentionMask.causal(jnp.asarray(seg, jnp.int32), jnp.asarray(pos, jnp.int32))
  elif t != s:  # decode: a cache of s slots, filled up to the queries, row 1 left-padded
    kv_seg = np.array([[1] * 11 + [0] * 5, [0] * 4 + [1] * 7 + [0] * 5])
    kv_pos = np.array([[*range(16)], [0] * 4 + [*range(12)]])
    q_pos = np.array([[9, 10], [5, 6]])
    mask = AttentionMask(jnp.ones((2, t), jnp.int32), jnp.asarray(q_pos, jnp.int32),
                         jnp.asarray(kv_seg, jnp.int32), jnp.asarray(kv_pos, jnp.int32))
  else:
    pos = np.broadcast_to(np.arange(t), (2, t))
    mask = AttentionMask.causal(jnp.ones((2, t), jnp.int32), jnp.asarray(pos, jnp.int32))
  window = opts.get('window')
  options = AttentionOptions(
      scale=HEAD_DIM ** -0.5, softcap=opts.get('softcap'),
      sliding_window=jnp.int32(window) if opts.get('traced') and window else window,
      sinks_N=jnp.asarray(rng.normal(size=heads), dtype) if opts.get('sinks') else None,
      chunk_size=(jnp.int32(opts['chunk']) if opts.get('traced') else opts['chunk'])
      if 'chunk' in opts else None)
  weights = rng.normal(size=(2, t, heads, v_dim)) * np.asarray(mask.q_segment_ids != 0)[..., None,
                                                                                          None]
  q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
  return q, k, v, mask, options, jnp.asarray(weights, jnp.float32)


def _fwd_and_grad(kernel, q, k, v, mask, options, weights):
  """Output and d(sum(out * weights))/d(q, k, v), jitted (a traced window stays traced)."""
  window = options.sliding_window

  def loss(q, k, v, window):
    out = kernel(q, k, v, mask, dataclasses.replace(options, sliding_window=window))
    return jnp.sum(out.astype(jnp.float32) * weights), out

  grad_fn = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
  if isinstance(window, jax.Array):
    grads, out = jax.jit(grad_fn)(q, k, v, window)
  else:
    grads, out = jax.jit(grad_fn, static_argnums=3)(q, k, v, window)
  return out, grads


def _assert_close(actual, expected, rel):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  scale = max(float(np.max(np.abs(expected))), 1e-6)
  np.testing.assert_allclose(actual, expected, atol=rel * scale, rtol=0)


def _reasons(kernel, q, k, v, options):
  return kernel.unsupported_reasons(AttentionRequest.of(q, k, v, options))


def _supports(kernel, q, k, v, options):
  return not _reasons(kernel, q, k, v, options)


def _cannot_run_here(kernel, dtype) -> list[str]:
  """Why ``kernel`` refuses even the plainest call in ``dtype`` here (platform, dtype,
  missing package): its declared reasons, empty when it runs here."""
  q, k, v, _, options, _ = _case('gqa_causal', dtype, _rng('probe'))
  return _reasons(kernel, q, k, v, options)


# The default suite runs, per strategy, the scenarios that differ most for it; other
# combinations are marked slow. A strategy without an entry here (a newly registered one)
# runs DEFAULT_FAST in float32 by default.
FAST = {('jax_nn', s, 'float32') for s in ('packed_padded', 'traced_window', 'softcap',
                                            'sinks', 'decode', 'mla_v_dim', 'chunked')} | {
    ('pallas_interpret', 'chunked', 'float32'), ('tokamax_xla', 'traced_chunk', 'float32'),
    ('xla_flash', 'chunked', 'float32'), ('xla_flash', 'traced_chunk', 'float32')} | {
    ('tokamax_xla', s, 'float32') for s in ('packed_padded', 'softcap', 'decode', 'sinks')} | {
    ('xla_flash', s, 'float32') for s in ('packed_padded', 'window', 'traced_window', 'softcap',
                                          'sinks', 'decode', 'mla_v_dim')} | {
    ('tokamax', 'gqa_causal', 'float32'), ('tokamax_xla_chunked', 'packed_padded', 'float32'),
    ('xla_flash', 'gqa_causal', 'bfloat16'), ('xla_flash', 'packed_padded', 'bfloat16'),
    ('pallas_interpret', 'packed_padded', 'float32'), ('jax_nn', 'packed_padded', 'bfloat16'),
    ('tokamax_xla', 'gqa_causal', 'bfloat16')}
DEFAULT_FAST = ('packed_padded', 'decode')
_TUNED = {name for name, _, _ in FAST}


def _is_fast(name, scenario, dtype):
  if name in _TUNED:
    return (name, scenario, dtype) in FAST
  return dtype == 'float32' and scenario in DEFAULT_FAST


CASES = [(name, scenario, 'float32') for name in STRATEGIES for scenario in SCENARIOS]
CASES += [(name, scenario, 'bfloat16') for name in STRATEGIES for scenario in BF16_SCENARIOS]
CASES = [pytest.param(*case, marks=() if _is_fast(*case) else pytest.mark.slow)
         for case in CASES]


@pytest.mark.parametrize('name,scenario,dtype', CASES)
def test_strategy_matches_xla(name, scenario, dtype):
  """Forward and gradients agree with ``xla`` in f32 (from f32 inputs) and bf16 (vs f32 xla).

  Every registered strategy is checked. One that cannot run here at all (its declared
  platforms, dtypes or a missing package) is skipped with its own reasons; a scenario it
  declares unsupported must raise under ``on_unsupported='error'``.
  """
  kernel = _kernel(name)
  cannot = _cannot_run_here(kernel, getattr(jnp, dtype))
  if cannot:
    pytest.skip(f"attention_impl '{name}' cannot run here: {'; '.join(cannot)}")
  q, k, v, mask, options, weights = _case(scenario, getattr(jnp, dtype), _rng(name, scenario))
  if not _supports(kernel, q, k, v, options):
    with pytest.raises(KernelUnsupportedError, match=f"attention_impl '{kernel.name}'"):
      _fwd_and_grad(kernel, q, k, v, mask, options, weights)
    return
  out, grads = _fwd_and_grad(kernel, q, k, v, mask, options, weights)
  assert out.dtype == q.dtype
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  options32 = dataclasses.replace(
      options, sinks_N=None if options.sinks_N is None else options.sinks_N.astype(jnp.float32))
  ref_out, ref_grads = _fwd_and_grad(XlaAttention(), *f32, mask, options32, weights)
  rel = 1e-5 if dtype == 'float32' else 2e-2
  valid = np.asarray(weights != 0)
  _assert_close(np.where(valid, out.astype(jnp.float32), 0), np.where(valid, ref_out, 0), rel)
  for grad, ref_grad in zip(grads, ref_grads):
    _assert_close(grad, ref_grad, 10 * rel)


def test_declared_capabilities_cover_the_scenarios():
  """The CPU strategies really differ: each refuses something xla does (no vacuous passes)."""
  cases = {s: _case(s, jnp.float32, _rng(s)) for s in SCENARIOS}
  names = ('jax_nn', 'xla_flash', 'tokamax', 'tokamax_xla', 'pallas_interpret')
  refused = {name: [s for s, (q, k, v, _, options, _) in cases.items()
                    if not _supports(_kernel(name), q, k, v, options)]
             for name in names}
  assert refused['jax_nn'] == ['softcap', 'sinks', 'mla_v_dim']
  assert refused['xla_flash'] == []
  assert refused['tokamax'] == refused['tokamax_xla'] == ['sinks']
  assert refused['pallas_interpret'] == ['window', 'traced_window', 'softcap', 'sinks', 'decode',
                                         'mla_v_dim', 'chunked', 'traced_chunk']


def _not_on_this_platform() -> list[str]:
  """Registered strategies whose declared platforms exclude this one (read at collection)."""
  platform = current_platform()
  return [name for name, factory in ATTENTION_IMPLEMENTATIONS.items()
          if platform not in factory().capabilities.platforms]


@pytest.mark.parametrize('name', _not_on_this_platform())
def test_strategies_for_other_platforms_refuse_or_fall_back(name, caplog):
  """A strategy declared for other platforms raises under 'error' naming this platform, and
  equals xla (with one warning) under 'fallback'."""
  reset_warnings()
  q, k, v, mask, options, _ = _case('gqa_causal', jnp.bfloat16, _rng(name))
  with pytest.raises(KernelUnsupportedError, match=f"platform '{current_platform()}'"):
    get_attention_kernel(name, on_unsupported='error')(q, k, v, mask, options)
  kernel = get_attention_kernel(name)
  assert kernel.on_unsupported == 'fallback'
  with caplog.at_level(logging.WARNING, logger='maxnnx.kernels'):
    out = kernel(q, k, v, mask, options)
    kernel(q, k, v, mask, options)
  np.testing.assert_array_equal(out, XlaAttention()(q, k, v, mask, options))
  warnings = [r for r in caplog.records if name in r.getMessage()]
  assert len(warnings) == 1 and "with 'xla' instead" in warnings[0].getMessage()


def test_unsupported_feature_falls_back_once_with_a_warning(caplog):
  """jax_nn has no soft-cap: the fallback equals xla and warns once; 'error' names the feature."""
  reset_warnings()
  q, k, v, mask, options, _ = _case('softcap', jnp.float32, _rng('softcap-fallback'))
  with pytest.raises(KernelUnsupportedError, match='soft-capping'):
    get_attention_kernel('jax_nn', on_unsupported='error')(q, k, v, mask, options)
  kernel = get_attention_kernel('jax_nn')
  with caplog.at_level(logging.WARNING, logger='maxnnx.kernels'):
    outs = [kernel(q, k, v, mask, options) for _ in range(3)]
  np.testing.assert_array_equal(outs[0], XlaAttention()(q, k, v, mask, options))
  assert [r.levelno for r in caplog.records] == [logging.WARNING]
  assert 'soft-capping' in caplog.records[0].getMessage()


def test_backend_not_implemented_follows_the_policy(caplog):
  """A backend's NotImplementedError at trace time is an unsupported call, not a crash."""

  class Refusing(AttentionKernel):
    @property
    def capabilities(self):
      return XlaAttention().capabilities

    def attend(self, *args, **kwargs):
      raise NotImplementedError('shape not tiled')

  reset_warnings()
  q, k, v, mask, options, _ = _case('gqa_causal', jnp.float32, _rng('refusing'))
  with pytest.raises(KernelUnsupportedError, match='shape not tiled'):
    Refusing(name='refusing', on_unsupported='error')(q, k, v, mask, options)
  with caplog.at_level(logging.WARNING, logger='maxnnx.kernels'):
    out = Refusing(name='refusing')(q, k, v, mask, options)
  np.testing.assert_array_equal(out, XlaAttention()(q, k, v, mask, options))
  assert 'shape not tiled' in caplog.records[0].getMessage()


def test_tokamax_default_order_reports_what_it_skipped(caplog):
  """tokamax's own order drops to XLA on CPU silently; ours logs that it did."""
  if jax.default_backend() != 'cpu':
    pytest.skip('checks the CPU behaviour')
  reset_warnings()
  q, k, v, mask, options, _ = _case('gqa_causal', jnp.float32, _rng('tokamax-order'))
  with caplog.at_level(logging.INFO, logger='maxnnx.kernels'):
    get_attention_kernel('tokamax')(q, k, v, mask, options)
    get_attention_kernel('tokamax_xla')(q, k, v, mask, options)
  messages = [(r.levelno, r.getMessage()) for r in caplog.records]
  assert messages[0][0] == logging.WARNING
  assert 'triton' in messages[0][1] and "using tokamax 'xla'" in messages[0][1]
  assert messages[1] == (logging.INFO, "attention_impl 'tokamax_xla' runs tokamax "
                                       "implementation 'xla'.")


def test_pallas_checks_index_order_at_run_time(caplog):
  """Positions out of index order make the flash kernel wrong, so xla runs instead."""
  reset_warnings()
  rng = _rng('pallas-order')
  q, k, v = (jnp.asarray(rng.normal(size=(1, 8, 2, HEAD_DIM)), jnp.float32) for _ in range(3))
  seg = jnp.asarray([[2, 2, 2, 2, 1, 1, 1, 1]], jnp.int32)  # decreasing ids
  pos = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 3]], jnp.int32)
  mask = AttentionMask.causal(seg, pos)
  options = AttentionOptions(scale=0.3)
  kernel = PallasFlashAttention(interpret=True, on_unsupported='error')
  with caplog.at_level(logging.WARNING, logger='maxnnx.kernels'):
    out = jax.jit(lambda q, k, v: kernel(q, k, v, mask, options))(q, k, v)
  np.testing.assert_allclose(out, XlaAttention()(q, k, v, mask, options), atol=1e-6)
  assert 'not in index order' in caplog.records[0].getMessage()


@pytest.mark.parametrize('seg,pos,expected,per_index', [
    ([1, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 2], True, True),     # packed
    ([0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 2, 3], True, True),     # left padding
    ([1, 1, 0, 1, 2, 2], [0, 1, 0, 2, 0, 1], True, False),    # padding inside a document
    ([1, 1, 1, 1, 2, 2], [0, 1, 4, 6, 0, 1], True, True),     # positions skip ahead
    ([2, 2, 1, 1, 1, 1], [0, 1, 0, 1, 2, 3], False, False),  # ids decrease
    ([1, 1, 1, 1, 1, 1], [0, 2, 1, 3, 4, 5], False, False),  # positions out of order
    ([1, 1, 1, 1, 1, 1], [0, 1, 1, 2, 3, 4], False, False),  # repeated position
])
def test_index_order_matches_positions(seg, pos, expected, per_index):
  """The run-time guard of the Pallas kernel accepts exactly the index-ordered layouts;
  ``step_per_index`` (``xla_flash`` with a window) also wants positions to rise at least
  one per index."""
  seg_BT, pos_BT = jnp.asarray([seg], jnp.int32), jnp.asarray([pos], jnp.int32)
  mask = AttentionMask.causal(seg_BT, pos_BT)
  assert bool(index_order_matches_positions(mask)) is expected
  assert bool(index_order_matches_positions(mask, step_per_index=True)) is per_index
  index_causal = ((seg_BT[0, :, None] == seg_BT[0, None, :]) & (seg_BT[0, None, :] != 0)
                  & (jnp.arange(6)[None, :] <= jnp.arange(6)[:, None]))
  real_rows = np.asarray(seg_BT[0] != 0)
  same = np.array_equal(np.asarray(mask.dense()[0])[real_rows], np.asarray(index_causal)[real_rows])
  assert same or not expected


def test_block_plan_skips_the_causal_upper_triangle():
  """512 tokens in 128-row blocks score 10 of 16 block pairs; windows and decode as documented."""
  plan = block_plan(512, 512, block_size=128, max_blocks=8, window=None)
  assert plan == ((0, 128, 0, 128), (128, 256, 0, 256), (256, 384, 0, 384), (384, 512, 0, 512))
  assert covered_by(plan, 512, 512).mean() == 10 / 16
  assert covered_by(plan, 512, 512)[np.tri(512, dtype=bool)].all()  # every causal pair
  windowed = block_plan(512, 512, block_size=128, max_blocks=8, window=100)
  assert windowed[2] == (256, 384, 157, 384)
  assert len(block_plan(4096, 4096, block_size=128, max_blocks=8, window=None)) == 8
  assert block_plan(2, 512, block_size=128, max_blocks=8, window=None) == ((0, 2, 0, 512),)
  assert block_plan(200, 200, block_size=128, max_blocks=8, window=None) == ((0, 200, 0, 200),)


def _reordered_case(rng):
  """A packed row in the order context-parallel load balancing gives it (not index-causal)."""
  order = np.array([0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
  seg = np.array([[1] * 9 + [2] * 7] * 2)[:, order]
  pos = np.array([[*range(9), *range(7)]] * 2)[:, order]
  mask = AttentionMask.causal(jnp.asarray(seg, jnp.int32), jnp.asarray(pos, jnp.int32))
  q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 2, HEAD_DIM)), jnp.float32) for _ in range(3))
  return q, k, v, mask


@pytest.mark.parametrize('reordered', [False, True])
def test_blockwise_skips_only_what_the_mask_hides(reordered):
  """In index order the skipped blocks hold no visible key; reordered tokens take one block.

  Either way the output and gradients equal ``xla``'s; reordered rows would be
  wrong if the kernel skipped blocks by index.
  """
  rng = _rng('blockwise-order', reordered)
  if reordered:
    q, k, v, mask = _reordered_case(rng)
  else:
    q, k, v, mask, _, _ = _case('packed_padded', jnp.float32, rng)
    q, k, v = q[:, :, :2], k, v
  allowed = np.asarray(mask.dense())
  plan = block_plan(16, 16, block_size=4, max_blocks=8, window=None)
  hidden_keys_visible = (allowed & ~covered_by(plan, 16, 16)).any()
  assert hidden_keys_visible == reordered
  kernel = BlockwiseAttention(block_size=4, on_unsupported='error')
  weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * (mask.q_segment_ids != 0)[
      ..., None, None]
  options = AttentionOptions(scale=0.3)
  out, grads = _fwd_and_grad(kernel, q, k, v, mask, options, weights)
  ref_out, ref_grads = _fwd_and_grad(XlaAttention(), q, k, v, mask, options, weights)
  valid = np.asarray(weights != 0)
  _assert_close(np.where(valid, out, 0), np.where(valid, ref_out, 0), 1e-5)
  for grad, ref_grad in zip(grads, ref_grads):
    _assert_close(grad, ref_grad, 1e-5)


def _random_layout(rng, length):
  """Segment ids and positions of one row: packed documents with padding, position gaps
  and, at random, a shuffled order (what context-parallel load balancing gives)."""
  seg = np.sort(rng.integers(0, 4, size=length))
  seg[rng.random(length) < 0.15] = 0  # padding anywhere
  pos = np.zeros(length, np.int64)
  for doc in np.unique(seg[seg != 0]):
    where = np.flatnonzero(seg == doc)
    pos[where] = np.cumsum(rng.integers(1, 3, size=len(where))) - 1
  order = rng.permutation(length) if rng.random() < 0.3 else np.arange(length)
  return seg[order], pos[order]


@pytest.mark.parametrize('bounds, key_mask', [
    (dict(), False), (dict(sliding_window=3), False), (dict(chunk_size=5), False),
    (dict(), True)])
def test_blockwise_order_check_is_sound_and_exact(bounds, key_mask):
  """Where the O(B T) check lets blocks be skipped, no visible key (dense NumPy mask) lies
  outside the plan's blocks; on every layout (skipping or not) the output and gradients
  equal ``xla``'s, also under an extra sparse key mask."""
  rng = _rng('blockwise-sound', tuple(bounds), key_mask)
  kernel, options = BlockwiseAttention(block_size=4), AttentionOptions(scale=0.3, **bounds)
  window = bounds.get('sliding_window', bounds.get('chunk_size'))
  plan = block_plan(16, 16, block_size=4, max_blocks=8, window=window)

  @functools.partial(jax.jit, static_argnums=0)  # the mask is an argument: one compilation
  def step(kernel, q, k, v, mask, weights, keys_BTS):
    def loss(q, k, v):
      out = kernel(q, k, v, mask, dataclasses.replace(options, key_mask_BTS=keys_BTS))
      return jnp.sum(out * weights), out
    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  skipped = 0
  for _ in range(12):
    seg, pos = (jnp.asarray(np.stack(a), jnp.int32)
                for a in zip(*(_random_layout(rng, 16) for _ in range(2))))
    mask = AttentionMask.causal(seg, pos)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 2, HEAD_DIM)), jnp.float32) for _ in range(3))
    seg_np, pos_np = np.asarray(seg)[:, :, None], np.asarray(pos)[:, :, None]
    dense = ((seg_np == seg_np.transpose(0, 2, 1)) & (seg_np.transpose(0, 2, 1) != 0)
             & (pos_np.transpose(0, 2, 1) <= pos_np))
    if 'sliding_window' in bounds:
      dense &= pos_np - pos_np.transpose(0, 2, 1) < window
    if 'chunk_size' in bounds:
      dense &= pos_np // window == pos_np.transpose(0, 2, 1) // window
    keys_BTS = None
    if key_mask:  # a random selection that keeps each query's own key
      keys_BTS = (rng.random((2, 16, 16)) < 0.5) | np.eye(16, dtype=bool)
      dense &= keys_BTS
      keys_BTS = jnp.asarray(keys_BTS)
    if bool(index_order_matches_positions(mask, step_per_index=window is not None)):
      skipped += 1
      assert not (dense & ~covered_by(plan, 16, 16)).any()
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * (seg != 0)[..., None, None]
    (_, out), grads = step(kernel, q, k, v, mask, weights, keys_BTS)
    (_, ref_out), ref_grads = step(XlaAttention(), q, k, v, mask, weights, keys_BTS)
    valid = np.asarray(weights != 0)
    _assert_close(np.where(valid, out, 0), np.where(valid, ref_out, 0), 1e-5)
    for grad, ref_grad in zip(grads, ref_grads):
      _assert_close(grad, ref_grad, 1e-5)
  assert 0 < skipped < 12  # both branches were taken


def test_blockwise_scores_only_the_planned_blocks():
  """The forward's score matmuls are [4 rows x 4, 8, 12, 16 keys] (skipping), plus one
  [4 x 16] in the run-time fallback branch's loop over the same four query blocks (never one
  [16 x 16]: at 4,096 tokens and 128 heads that is the 8 GiB the blocks avoid)."""
  q, k, _, mask, options, _ = _case('gqa_causal', jnp.float32, _rng('blockwise-shapes'))
  v = jnp.ones(k.shape[:3] + (3,))  # a v head size no score matmul has
  kernel = BlockwiseAttention(block_size=4)
  jaxpr = jax.make_jaxpr(lambda q, k, v: kernel(q, k, v, mask, options))(q, k, v)
  score_shapes = sorted(eqn.outvars[0].aval.shape[-2:] for eqn in equations(jaxpr.jaxpr)
                        if eqn.primitive.name == 'dot_general'
                        and eqn.outvars[0].aval.shape[-1] != 3)
  assert score_shapes == [(4, 4), (4, 8), (4, 12), (4, 16), (4, 16)]


def test_blockwise_fallback_loop_matches_xla_with_sinks_and_softcap():
  """Reordered tokens take the fallback (a loop over query blocks, each over all keys): its
  output and the q, k, v and sink gradients equal autodiff of ``xla``'s, soft-capped."""
  rng = _rng('blockwise-fallback-sinks')
  q, k, v, mask = _reordered_case(rng)
  q = jnp.concatenate([q, q[:, :, ::-1]], axis=2)  # 4 query heads over 2 KV heads
  weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

  def loss(kernel, q, k, v, sinks):
    options = AttentionOptions(scale=0.3, softcap=1.5, sinks_N=sinks)
    return jnp.sum(kernel(q, k, v, mask, options) * weights)

  sinks = jnp.asarray(rng.normal(size=4), jnp.float32)
  grad = lambda kernel: jax.jit(jax.value_and_grad(  # noqa: E731
      functools.partial(loss, kernel), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
  (got, got_grads), (expected, expected_grads) = grad(BlockwiseAttention(block_size=4)), grad(
      XlaAttention())
  _assert_close(got, expected, 1e-5)
  for g, e in zip(got_grads, expected_grads):
    _assert_close(g, e, 1e-5)


def test_blockwise_sink_gradients_match_xla():
  """The sinks' gradient (not in the generic q/k/v check) equals autodiff of ``xla``."""
  q, k, v, mask, options, weights = _case('sinks', jnp.float32, _rng('blockwise-sinks'))

  def loss(kernel, sinks):
    out = kernel(q, k, v, mask, dataclasses.replace(options, sinks_N=sinks))
    return jnp.sum(out * weights)

  sinks = options.sinks_N
  got = jax.jit(jax.grad(lambda s: loss(BlockwiseAttention(block_size=4), s)))(sinks)
  expected = jax.jit(jax.grad(lambda s: loss(XlaAttention(), s)))(sinks)
  _assert_close(got, expected, 1e-5)
  assert float(jnp.abs(expected).max()) > 1e-3


def test_unknown_names_and_policies_give_clear_errors():
  """Unknown strategy names list the known ones; unknown policies name the valid ones."""
  with pytest.raises(ValueError, match="Unknown attention_impl 'flash'.*cudnn.*jax_nn.*tokamax"):
    get_attention_kernel('flash')
  with pytest.raises(ValueError, match="on_unsupported must be one of .*'maybe'"):
    get_attention_kernel('xla', on_unsupported='maybe')
  with pytest.raises(ValueError, match='implementations must be'):
    get_attention_kernel('tokamax').__class__(implementations=('fastest',))
  with pytest.raises(ConfigError, match='kernel_on_unsupported'):
    ModelConfig.from_dict({'runtime.kernel_on_unsupported': 'ignore'})


def test_every_registered_strategy_declares_capabilities():
  """Each registered name builds a kernel of that name with a full capability declaration."""
  for name, factory in ATTENTION_IMPLEMENTATIONS.items():
    kernel = factory()
    assert kernel.name == name
    assert isinstance(kernel.capabilities, AttentionCapabilities)


def _tiny_logits(attention_impl, ids, segment_ids=None, positions=None, **overrides):
  cfg = maxnnx.get_preset('tiny', **{'runtime.attention_impl': attention_impl}, **overrides)
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))
  assert model.layers[0].attn.kernel.name == attention_impl
  return nnx.jit(lambda m, i, s, p: m(i, segment_ids=s, positions=p))(model, ids, segment_ids,
                                                                        positions)


@pytest.mark.parametrize('impl', ['jax_nn', 'tokamax_xla', 'xla_flash'] + [
    pytest.param(i, marks=pytest.mark.slow)
    for i in ('tokamax', 'tokamax_xla_chunked', 'pallas_interpret')])
def test_tiny_model_logits_match_xla(impl, monkeypatch):
  """The tiny preset gives the same logits (packed rows) with each CPU strategy as with xla."""
  monkeypatch.setitem(ATTENTION_IMPLEMENTATIONS, 'pallas_interpret',
                      lambda: PallasFlashAttention(name='pallas_interpret', interpret=True))
  rng = _rng('tiny', impl)
  ids = jnp.asarray(rng.integers(0, 512, size=(2, 16)), jnp.int32)
  seg = jnp.asarray([[1] * 7 + [2] * 9, [1] * 16], jnp.int32)
  pos = jnp.asarray([[*range(7), *range(9)], [*range(16)]], jnp.int32)
  expected = _tiny_logits('xla', ids, seg, pos)
  actual = _tiny_logits(impl, ids, seg, pos, **{'runtime.kernel_on_unsupported': 'error'})
  _assert_close(actual, expected, 1e-5)


def test_tiny_model_strict_policy_raises_on_cpu_for_gpu_strategy():
  """With kernel_on_unsupported='error', a GPU-only strategy fails loudly on CPU."""
  if jax.default_backend() != 'cpu':
    pytest.skip('checks the CPU behaviour')
  ids = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(KernelUnsupportedError, match="attention_impl 'cudnn'.*platform 'cpu'"):
    _tiny_logits('cudnn', ids, **{'runtime.kernel_on_unsupported': 'error'})


def _request(**changes):
  base = dict(platform='gpu', dtype='bfloat16', q_length=2048, kv_length=2048, num_heads=8,
              num_kv_heads=2, head_dim=64, v_head_dim=64, window='none', softcap=False,
              sinks=False)
  return AttentionRequest(**{**base, **changes})


@pytest.mark.parametrize('changes,expected', [
    ({}, 'cudnn'),
    ({'window': 'traced'}, 'cudnn'),
    ({'dtype': 'float32'}, 'xla_flash'),  # cuDNN runs bf16/f16 only
    ({'softcap': True}, 'xla_flash'),
    ({'sinks': True}, 'xla_flash'),
    ({'v_head_dim': 32}, 'xla_flash'),  # MLA-style value heads: not cuDNN
    ({'q_length': 16384, 'kv_length': 16384}, 'xla_flash'),  # dense mask past the limit
    ({'q_length': 1, 'kv_length': 32768}, 'cudnn'),  # a decode step
    ({'platform': 'cpu'}, 'xla_flash'),
    ({'platform': 'tpu'}, 'xla_flash'),
])
def test_auto_attention_chooses_by_platform_and_capabilities(changes, expected):
  """``auto``: cuDNN for what it can serve on a GPU, else xla_flash, else the xla reference."""
  request = _request(**changes)
  chosen = get_attention_kernel('auto').choose(request)
  assert chosen.name == expected
  assert not chosen.unsupported_reasons(request)


def test_auto_attention_runs_the_chosen_strategy_here(caplog):
  """On this machine ``auto`` computes exactly what the strategy it names computes."""
  reset_warnings()
  q, k, v, mask, options, _ = _case('gqa_causal', jnp.float32, _rng('auto', 'here'))
  with caplog.at_level(logging.INFO, logger='maxnnx.kernels'):
    out = get_attention_kernel('auto')(q, k, v, mask, options)
  chosen = get_attention_kernel('auto').choose(AttentionRequest.of(q, k, v, options))
  np.testing.assert_array_equal(out, chosen(q, k, v, mask, options))
  assert f"attention_impl 'auto' runs '{chosen.name}'" in caplog.text
  assert 'instead' not in caplog.text  # a choice, not a fallback warning

"""Ring attention (``mesh.context_parallel_strategy=ring``) on 8 simulated CPU devices.

The ring function under ``shard_map`` equals a float64 NumPy attention on the same tokens,
in the plain and the load-balanced token order, with grouped heads, packed documents,
windows and sinks; its gradients equal the all-gather strategy's.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cli_losses
from jax.sharding import NamedSharding
from numpy_reference import attention, visible

from maxnnx.checkpoint.run_lock import LOCK_NAME
from maxnnx.config import ConfigError, MeshConfig
from maxnnx.kernels import AttentionMask, AttentionOptions, BlockwiseAttention, XlaAttention
from maxnnx.layers.attention import Q_AXES
from maxnnx.layers.context_parallel import attend, attend_and_max_logits
from maxnnx.sharding import logical_rules, make_mesh, spec_for, use_mesh
from maxnnx.train.batches import context_permutation

BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 4, 32, 4, 2, 8


def _inputs(balanced: bool, packed: bool, seed=0):
  """Random q/k/v and the mask of rows in the trainer's token order (load-balanced over 4
  context shards or not); packed rows hold two documents with positions restarting."""
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(BATCH, LENGTH, HEADS, HEAD_DIM)).astype(np.float32)
  k = rng.normal(size=(BATCH, LENGTH, KV_HEADS, HEAD_DIM)).astype(np.float32)
  v = rng.normal(size=(BATCH, LENGTH, KV_HEADS, HEAD_DIM)).astype(np.float32)
  positions = np.tile(np.arange(LENGTH, dtype=np.int32), (BATCH, 1))
  segments = np.ones((BATCH, LENGTH), np.int32)
  if packed:
    split = 11
    segments[:, split:] = 2
    positions[:, split:] -= split
    segments[0, -3:] = 0  # padding at the end of one row
  order = context_permutation(LENGTH, 4) if balanced else np.arange(LENGTH)
  assert balanced == (not np.array_equal(order, np.arange(LENGTH)))
  return q[:, order], k[:, order], v[:, order], segments[:, order], positions[:, order]


def _ring(q, k, v, segments, positions, options, mesh_config, run=attend,
          kernel=None):
  """The output of ``run`` (``attend``) under ``mesh_config`` and its compiled HLO text."""
  mesh = make_mesh(mesh_config)
  mask = AttentionMask.causal(jnp.asarray(segments), jnp.asarray(positions))
  seq = NamedSharding(mesh, spec_for(Q_AXES, logical_rules(mesh_config), mesh, q.shape))
  q, k, v = (jax.device_put(a, seq) for a in (q, k, v))
  with use_mesh(mesh, logical_rules(mesh_config),
                context_parallel_strategy=mesh_config.context_parallel_strategy):
    kernel = kernel or XlaAttention()
    step = jax.jit(lambda q, k, v, m: run(kernel, q, k, v, m, options))
    compiled = step.lower(q, k, v, mask).compile()
    return compiled(q, k, v, mask), compiled.as_text()


RING = MeshConfig(data=2, context=4, context_parallel_strategy='ring')
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
CASES = {
    'causal': dict(balanced=False, packed=False, options={}),
    'balanced': dict(balanced=True, packed=False, options={}),
    'balanced_packed': dict(balanced=True, packed=True, options={}),
    'window_softcap_sinks': dict(balanced=True, packed=True,
                                 options=dict(sliding_window=5, softcap=3.0, sinks_N=SINKS)),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_ring_equals_float64_reference(case):
  spec = CASES[case]
  q, k, v, segments, positions = _inputs(spec['balanced'], spec['packed'])
  options = AttentionOptions(scale=HEAD_DIM ** -0.5, **spec['options'])
  out, hlo = _ring(q, k, v, segments, positions, options, RING)
  # Three hand-overs of k, v and the key mask fields in one loop body, no gathers.
  assert 'collective-permute' in hlo and 'all-gather' not in hlo
  allowed = visible(segments, positions, segments, positions, options.sliding_window)
  expected = attention(q, k, v, allowed, options.scale, options.softcap, options.sinks_N)
  real = allowed.any(-1) | (options.sinks_N is not None)  # rows that see something
  np.testing.assert_allclose(np.asarray(out)[real], expected[real], rtol=2e-5, atol=2e-6)


def test_ring_keeps_the_ring_and_records_max_logits_densely():
  """QK-clip's recording under ``ring``: the output is the ring's (the kernel, ``xla_flash``,
  whose own max logits cover one shard's keys, is not called) and the max logits come from
  the dense pass, equal to float64 NumPy's over the visible keys."""
  q, k, v, segments, positions = _inputs(balanced=True, packed=True)
  options = AttentionOptions(scale=HEAD_DIM ** -0.5)
  (out, max_N), hlo = _ring(q, k, v, segments, positions, options, RING,
                            run=attend_and_max_logits, kernel=BlockwiseAttention())
  assert 'collective-permute' in hlo
  allowed = visible(segments, positions, segments, positions, None)
  expected = attention(q, k, v, allowed, options.scale, None, None)
  real = allowed.any(-1)
  np.testing.assert_allclose(np.asarray(out)[real], expected[real], rtol=2e-5, atol=2e-6)
  scores = np.einsum('btnh,bsnh->bnts', np.float64(q), np.repeat(np.float64(k), 2, axis=2))
  top = np.where(allowed[:, None], scores * options.scale, -np.inf).max(axis=(0, 2, 3))
  np.testing.assert_allclose(max_N, top, rtol=1e-5)


def test_ring_gradients_equal_all_gather():
  q, k, v, segments, positions = _inputs(balanced=True, packed=True)
  options = AttentionOptions(scale=HEAD_DIM ** -0.5, sinks_N=jnp.asarray(SINKS))
  mask = AttentionMask.causal(jnp.asarray(segments), jnp.asarray(positions))
  cotangent = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)
  real = jnp.asarray(visible(segments, positions, segments, positions).any(-1))

  def grads(strategy):
    mesh_config = MeshConfig(data=2, context=4, context_parallel_strategy=strategy)

    def loss(q, k, v, sinks):
      out = attend(XlaAttention(), q, k, v, mask, AttentionOptions(options.scale, sinks_N=sinks))
      return jnp.sum(jnp.where(real[..., None, None], out * cotangent, 0.0))

    with use_mesh(make_mesh(mesh_config), logical_rules(mesh_config),
                  context_parallel_strategy=strategy):
      return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, options.sinks_N)

  for ring, gathered in zip(grads('ring'), grads('all_gather')):
    np.testing.assert_allclose(np.asarray(ring), np.asarray(gathered), rtol=1e-4, atol=1e-5)


def test_ring_refuses_a_sequence_that_does_not_split():
  q, k, v, segments, positions = _inputs(balanced=False, packed=False)
  options = AttentionOptions(scale=1.0)
  mesh_config = MeshConfig(data=1, context=8, context_parallel_strategy='ring')
  with pytest.raises(ConfigError, match='seq_len that is a multiple of 8'):
    _ring(q[:, :20], k[:, :20], v[:, :20], segments[:, :20], positions[:, :20], options,
          mesh_config)


def _sequence_gathers(hlo: str, seq_len: int) -> int:
  """All-gathers in ``hlo`` that assemble a ``[B, seq_len, heads, head_dim]`` array along the
  sequence (keys or values gathered from the context shards)."""
  pattern = rf'= f32\[\d+,{seq_len},\d+,\d+\]\{{[\d,]*\}} all-gather\(.*dimensions=\{{1\}}'
  return len(re.findall(pattern, hlo))


@pytest.mark.slow  # 45 s: three CLI runs
def test_cli_ring_trains_like_one_device(tmp_path, capsys):
  """``mesh.context_parallel_strategy=ring`` on data=2 x context=4 (load-balanced, sliding and
  full layers): every step's loss equals one device's, and the compiled train step passes
  keys and values around the ring where the all-gather strategy gathers them."""
  common = ['train', 'model=tiny', 'model.num_layers=2', 'model.attention.sliding_window=8',
            'model.layer_types=sliding,full', 'data=synthetic', 'steps=3', 'log_every=1',
            'global_batch_size=8', 'seq_len=32', 'sample_tokens=0', 'eval_every=0',
            'checkpoint_every=0', 'dtype=float32']
  context = ['mesh.data=2', 'mesh.context=4', 'dump_hlo=true']
  losses = cli_losses(tmp_path, capsys, common, {
      'one': ['mesh.data=1'], 'ring': [*context, 'mesh.context_parallel_strategy=ring'],
      'all_gather': context})
  np.testing.assert_allclose(losses['ring'], losses['one'], rtol=1e-4)
  np.testing.assert_allclose(losses['all_gather'], losses['one'], rtol=1e-4)
  hlo = {name: (tmp_path / name / 'hlo' / 'train_step.optimized.hlo.txt').read_text()
         for name in ('ring', 'all_gather')}
  assert hlo['ring'].count('collective-permute(') > 0
  assert _sequence_gathers(hlo['ring'], 32) == 0
  assert hlo['all_gather'].count('collective-permute(') == 0
  assert _sequence_gathers(hlo['all_gather'], 32) > 0


def test_cli_refuses_ring_over_an_uneven_split_before_writing(tmp_path, capsys):
  from maxnnx import cli  # noqa: PLC0415
  out = tmp_path / 'run'
  out.mkdir()
  (out / 'notes.txt').write_text('kept')
  code = cli.main(['train', 'model=tiny', 'data=synthetic', 'steps=1', 'seq_len=30',
                   'mesh.data=2', 'mesh.context=4', 'mesh.context_parallel_strategy=ring',
                   f'output_dir={out}'])
  err = capsys.readouterr().err.strip()
  assert code == 2
  assert err.splitlines() == [err] and 'use a seq_len that is a multiple of 4' in err
  assert sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME) == ['notes.txt']
  assert (out / 'notes.txt').read_text() == 'kept'


def test_ring_refuses_a_dense_key_mask():
  q, k, v, segments, positions = _inputs(balanced=False, packed=False)
  key_mask = jnp.ones((BATCH, LENGTH, LENGTH), bool)
  options = AttentionOptions(scale=1.0, key_mask_BTS=key_mask)
  with pytest.raises(ConfigError, match='context_parallel_strategy=all_gather'):
    _ring(q, k, v, segments, positions, options, RING)

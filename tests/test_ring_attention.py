"""Ring attention (``mesh.context_parallel_strategy=ring``) on 8 simulated CPU devices.

The ring function under ``shard_map`` equals a float64 NumPy attention on the same tokens,
in the plain and the load-balanced token order, with grouped heads, packed documents,
windows and sinks; its gradients equal the all-gather strategy's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from numpy_reference import attention, visible

from maxnnx.config import ConfigError, MeshConfig
from maxnnx.kernels import AttentionMask, AttentionOptions, XlaAttention
from maxnnx.layers.attention import Q_AXES
from maxnnx.layers.context_parallel import attend
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


def _ring(q, k, v, segments, positions, options, mesh_config):
  """The output of ``attend`` under ``mesh_config`` and its compiled HLO text."""
  mesh = make_mesh(mesh_config)
  mask = AttentionMask.causal(jnp.asarray(segments), jnp.asarray(positions))
  seq = NamedSharding(mesh, spec_for(Q_AXES, logical_rules(mesh_config), mesh, q.shape))
  q, k, v = (jax.device_put(a, seq) for a in (q, k, v))
  with use_mesh(mesh, logical_rules(mesh_config),
                context_parallel_strategy=mesh_config.context_parallel_strategy):
    step = jax.jit(lambda q, k, v, m: attend(XlaAttention(), q, k, v, m, options))
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

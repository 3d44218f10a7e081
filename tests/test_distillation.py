"""Distillation: divergences and gradients against float64 NumPy, chunking, sharded runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.train import DistillationObjective, TrainConfig, Trainer, as_batch
from maxnnx.train.chunks import Head
from maxnnx.train.distillation import distillation_sums, token_divergence

BATCH, SEQ, VOCAB = 4, 16, 512
TEMPERATURE = 2.0


def _log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _numpy_divergence(student, teacher, divergence, temperature, beta=0.3):
  """Per-token divergence in float64, times ``temperature ** 2``."""
  lq, lp = _log_softmax(student / temperature), _log_softmax(teacher / temperature)

  def kl(la, lb):
    return (np.exp(la) * (la - lb)).sum(-1)

  if divergence == 'forward_kl':
    out = kl(lp, lq)
  elif divergence == 'reverse_kl':
    out = kl(lq, lp)
  else:
    lm = np.log(beta * np.exp(lp) + (1 - beta) * np.exp(lq))
    out = beta * kl(lp, lm) + (1 - beta) * kl(lq, lm)
  return out * temperature**2


@pytest.mark.parametrize('divergence', ['forward_kl', 'reverse_kl', 'jsd'])
def test_divergences_and_gradients_match_numpy(divergence):
  rng = np.random.default_rng(0)
  student, teacher = rng.normal(size=(2, 3, 7)) * 2, rng.normal(size=(2, 3, 7)) * 2
  coef = rng.normal(size=(2, 3))
  expected = _numpy_divergence(student, teacher, divergence, TEMPERATURE)

  def weighted(s):
    div = token_divergence(s, jnp.asarray(teacher, jnp.float32), divergence=divergence,
                           temperature=TEMPERATURE, jsd_beta=0.3)
    return (div * coef).sum(), div

  grad, got = jax.grad(weighted, has_aux=True)(jnp.asarray(student, jnp.float32))
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
  # Central finite differences of the float64 NumPy divergence.
  eps, fd = 1e-6, np.zeros_like(student)
  for idx in np.ndindex(student.shape):
    up, down = student.copy(), student.copy()
    up[idx] += eps
    down[idx] -= eps
    fd[idx] = ((_numpy_divergence(up, teacher, divergence, TEMPERATURE) -
                _numpy_divergence(down, teacher, divergence, TEMPERATURE)) * coef).sum() / (2 * eps)
  np.testing.assert_allclose(grad, fd, rtol=1e-3, atol=1e-5)
  if divergence == 'forward_kl':  # the textbook gradient: T * (q - p)
    q = np.exp(_log_softmax(student / TEMPERATURE))
    p = np.exp(_log_softmax(teacher / TEMPERATURE))
    np.testing.assert_allclose(grad, TEMPERATURE * (q - p) * coef[..., None], rtol=1e-4,
                               atol=1e-6)


@pytest.mark.parametrize('divergence', ['forward_kl', 'jsd'])
def test_chunked_distillation_equals_full_logits(divergence):
  rng = np.random.default_rng(1)
  b, t, d, v = 2, 12, 8, 30
  xs, xt = (jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32) for _ in range(2))
  ws = jnp.asarray(rng.normal(size=(d, v)) * 0.5, jnp.float32)
  wt = jnp.asarray(rng.normal(size=(v, d)) * 0.5, jnp.float32)  # tied-embedding layout
  targets = jnp.asarray(rng.integers(0, v, (b, t)))
  mask = jnp.asarray(rng.random((b, t)) > 0.3, jnp.float32)
  kw = dict(divergence=divergence, temperature=TEMPERATURE, jsd_beta=0.4)

  def full(xs, ws):
    zs, zt = xs @ ws, jnp.einsum('btd,vd->btv', xt, wt)
    div = token_divergence(zs, zt, **kw)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(zs), targets[..., None], -1)[..., 0]
    return (div * mask).sum(), (ce * mask).sum()

  def chunked(xs, ws, chunk):
    return distillation_sums(xs, Head(ws, False), xt, Head(wt, True), targets, mask,
                             chunk_length=chunk, **kw)

  expected = full(xs, ws)
  for chunk in (1, 4, 12):
    np.testing.assert_allclose(chunked(xs, ws, chunk), expected, rtol=1e-5)
  g_chunk = jax.grad(lambda x, w: chunked(x, w, 3)[0] + 0.3 * chunked(x, w, 3)[1],
                     argnums=(0, 1))(xs, ws)
  g_full = jax.grad(lambda x, w: full(x, w)[0] + 0.3 * full(x, w)[1], argnums=(0, 1))(xs, ws)
  for a, e in zip(g_chunk, g_full):
    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6)


def _model_config(**changes):
  return maxnnx.get_preset('tiny', **{'runtime.dtype': 'float32',
                                      'runtime.param_dtype': 'float32'}).replace(**changes)


def _batch(seed):
  rng = np.random.default_rng(seed)
  windows = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
  mask = np.ones((BATCH, SEQ), np.float32)
  mask[:, :4] = 0  # prompts do not count
  return {'inputs': windows[:, :-1], 'targets': windows[:, 1:], 'loss_mask': mask}


def _params(model):
  return jax.tree.map(np.array, nnx.state(model, nnx.Param))


@pytest.mark.slow
def test_sharded_distillation_matches_one_device_and_keeps_the_teacher():
  teacher = maxnnx.Transformer(_model_config(), rngs=nnx.Rngs(1))
  teacher_before = _params(teacher)
  histories = []
  for mesh in (MeshConfig(data=1), MeshConfig(data=2, fsdp=2, tensor=2)):
    objective = DistillationObjective(nnx.clone(teacher), temperature=TEMPERATURE,
                                      divergence='jsd', hard_label_weight=0.25, chunk_length=4)
    config = TrainConfig(steps=3, global_batch_size=BATCH, seq_len=SEQ, learning_rate=1e-2,
                         warmup_steps=0, log_every=1, grad_accum_steps=2, mesh=mesh)
    student = maxnnx.Transformer(_model_config(), rngs=nnx.Rngs(0))
    trainer = Trainer(student, config, objective, data=iter([_batch(0)] * 3))
    histories.append(trainer.fit(log=lambda line: None))
    same = jax.tree.map(np.array_equal, teacher_before,
                        _params(trainer.frozen_models['teacher']))
    assert all(jax.tree.leaves(same))
  for key in ('loss', 'distill_loss', 'ce_loss'):
    np.testing.assert_allclose([m[key] for m in histories[1]], [m[key] for m in histories[0]],
                               rtol=1e-4)
  assert histories[0][-1]['loss'] < histories[0][0]['loss']


def test_vocabulary_mismatch_names_both_sizes():
  student = maxnnx.Transformer(_model_config(), rngs=nnx.Rngs(0))
  teacher = maxnnx.Transformer(_model_config(vocab_size=256), rngs=nnx.Rngs(1))
  objective = DistillationObjective(teacher)
  batch = jax.tree.map(jnp.asarray, as_batch(_batch(0)))
  with pytest.raises(ValueError, match='vocab_size=512.*vocab_size=256'):
    objective.loss(student, batch, frozen={'teacher': teacher}, norm={'tokens': 1.0})
  with pytest.raises(ValueError, match='jsd_beta'):
    DistillationObjective(teacher, divergence='jsd', jsd_beta=1.0)

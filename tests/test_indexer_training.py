"""DeepSeek V3.2's indexer training (``model.mla.indexer_training``): the KL loss and its
gradient against float64 NumPy, the loss reaching the indexer alone, the dense warm-up training
the indexer alone, and the sparse stage training everything."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES
from flax import nnx

import maxnnx
from maxnnx.config import ConfigError, MeshConfig
from maxnnx.layers.indexer import attention_target, indexer_kl_loss
from maxnnx.layers.mla import indexer_losses
from maxnnx.train import TrainConfig, Trainer


def _numpy_target(q, k, over, scale):
  scores = np.einsum('btnq,bsnq->bnts', q.astype(np.float64), k.astype(np.float64)) * scale
  scores = np.where(over[:, None], scores, -np.inf)
  with np.errstate(invalid='ignore'):
    probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs = np.where(over[:, None], probs, 0.0)
  probs = probs / np.maximum(probs.sum(-1, keepdims=True), 1e-300)
  summed = probs.sum(1)
  return summed / np.maximum(summed.sum(-1, keepdims=True), 1e-300)


def _numpy_kl_and_grad(index, target, over):
  """float64 mean-over-rows KL(target || softmax(index)) and its gradient in ``index``."""
  index = np.where(over, index.astype(np.float64), -np.inf)
  with np.errstate(invalid='ignore', divide='ignore'):
    log_q = index - index.max(-1, keepdims=True)
    log_q = log_q - np.log(np.where(over, np.exp(log_q), 0.0).sum(-1, keepdims=True))
  rows = over.any(-1)
  kept = over & (target > 0)
  safe_log_q = np.where(kept, log_q, 0.0)
  kl = np.where(kept, target * (np.log(np.where(kept, target, 1.0)) - safe_log_q), 0.0).sum()
  count = max(rows.sum(), 1)
  grad = np.where(over, np.exp(np.where(over, log_q, 0.0)) - target, 0.0) / count
  return kl / count, grad


def test_kl_loss_and_its_gradient_equal_float64_numpy():
  """Causal rows, a fully masked row, and a sparse selection: the loss is the mean over rows
  that see a key, and its gradient in the scores is (softmax - target) / rows."""
  rng = np.random.default_rng()
  batch, length, heads, width = 2, 7, 3, 5
  q = rng.normal(size=(batch, length, heads, width)).astype(np.float32)
  k = rng.normal(size=(batch, length, heads, width)).astype(np.float32)
  over = np.tril(np.ones((length, length), bool))[None].repeat(batch, 0)
  over &= rng.random(over.shape) < 0.7  # a sparse selection
  over[1, 3] = False  # a query with no key at all
  index = rng.normal(size=(batch, length, length)).astype(np.float32) * 2
  target = np.asarray(attention_target(jnp.asarray(q), jnp.asarray(k), jnp.asarray(over), 0.4))
  np.testing.assert_allclose(target, _numpy_target(q, k, over, 0.4), rtol=1e-5, atol=1e-7)
  loss, grad = jax.value_and_grad(indexer_kl_loss)(jnp.asarray(index), jnp.asarray(target),
                                                   jnp.asarray(over))
  expected, expected_grad = _numpy_kl_and_grad(index, target.astype(np.float64), over)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-7)


def _v32(stage):
  base = maxnnx.from_pretrained(os.path.join(FIXTURES, 'deepseek_v32'))
  cfg = base.config.replace(**{'mla.indexer_training': stage, 'runtime.dtype': 'float32'})
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))
  nnx.update(model, nnx.state(base, nnx.Param))
  return model


def _flat_params(model):
  return {'/'.join(map(str, path)): np.asarray(v[...])
          for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize('stage', ['dense_warmup', 'sparse'])
def test_the_indexer_loss_reaches_the_indexer_alone(stage):
  """The KL's gradient is zero everywhere but in the indexer's parameters (its input is
  detached), and not zero there."""
  model = _v32(stage)
  ids = jnp.asarray(np.random.default_rng().integers(0, model.config.vocab_size, (2, 16)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def kl(params):
    m = nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rest))
    m(ids)
    return sum(jnp.sum(t) for t in indexer_losses(m))

  grads = {'/'.join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(
      jax.grad(kl)(params))}
  indexer = {p: g for p, g in grads.items() if 'indexer' in p}
  assert indexer and all(np.abs(g).max() > 0 for g in indexer.values())
  assert all(not np.any(g) for p, g in grads.items() if 'indexer' not in p)


def _train(model, steps):
  trainer = Trainer(model, TrainConfig(steps=steps, global_batch_size=4, seq_len=32,
                                       learning_rate=1e-2, warmup_steps=0, log_every=1,
                                       eval_every=0, mesh=MeshConfig(data=1)))
  return trainer.fit(log=lambda line: None), trainer.model


def test_dense_warmup_trains_the_indexer_alone_and_lowers_its_loss():
  model = _v32('dense_warmup')
  before = _flat_params(model)
  history, trained = _train(model, 8)
  after = _flat_params(trained)
  losses = [h['indexer_loss'] for h in history]
  assert np.mean(losses[-3:]) < losses[0], losses
  changed = {p for p in before if not np.array_equal(before[p], after[p])}
  assert changed and all('indexer' in p for p in changed), sorted(changed)[:5]


def test_the_sparse_stage_trains_everything_and_logs_the_indexer_loss():
  model = _v32('sparse')
  before = _flat_params(model)
  history, trained = _train(model, 2)
  after = _flat_params(trained)
  assert all(h['indexer_loss'] > 0 for h in history)
  changed = {p for p in before if not np.array_equal(before[p], after[p])}
  assert any('indexer' in p for p in changed) and any('indexer' not in p for p in changed)


def test_indexer_training_needs_an_indexer():
  with pytest.raises(ConfigError, match='index_topk'):
    maxnnx.get_preset('tiny').replace(**{'attention.type': 'mla',
                                         'mla.indexer_training': 'sparse'})

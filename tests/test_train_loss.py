"""The fused head + cross-entropy equals full logits, and both equal float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.train import TrainConfig, Trainer
from maxnnx.train.loss import chunked_head_cross_entropy, default_chunk_length, masked_cross_entropy


def _numpy_head_loss(x, w, targets, mask, vocab_major, z_loss, softcap):
  """Float64 reference: logits, optional cap, masked cross-entropy and z-loss sums."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  logits = x @ (w.T if vocab_major else w)
  if softcap is not None:
    logits = softcap * np.tanh(logits / softcap)
  peak = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - peak).sum(-1)) + peak[..., 0]
  target = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  ce, z = ((lse - target) * mask).sum(), (lse**2 * mask).sum()
  return ce + z_loss * z, ce, z


@pytest.mark.parametrize('vocab_major,softcap,z_loss', [(False, None, 0.0), (True, None, 1e-3),
                                                         (False, 5.0, 1e-2)])
def test_fused_loss_and_gradients_match_full_logits(vocab_major, softcap, z_loss):
  rng = np.random.default_rng()
  batch, length, d, vocab = 2, 12, 16, 40
  x = jnp.asarray(rng.normal(size=(batch, length, d)), jnp.float32)
  w_shape = (vocab, d) if vocab_major else (d, vocab)
  w = jnp.asarray(rng.normal(size=w_shape) * 0.3, jnp.float32)
  targets = jnp.asarray(rng.integers(vocab, size=(batch, length)))
  mask = jnp.asarray(rng.random((batch, length)) > 0.2, jnp.float32)

  def fused(x, w):
    return chunked_head_cross_entropy(x, w, targets, mask, vocab_major=vocab_major,
                                      chunk_length=4, z_loss=z_loss, softcap=softcap)

  def full(x, w):
    logits = jnp.einsum('btd,vd->btv' if vocab_major else 'btd,dv->btv', x, w)
    if softcap is not None:
      logits = softcap * jnp.tanh(logits / softcap)
    ce, z = masked_cross_entropy(logits, targets, mask)
    return ce + z_loss * z, ce, z

  expected = _numpy_head_loss(x, w, np.asarray(targets), np.asarray(mask), vocab_major, z_loss,
                              softcap)
  for got in (fused(x, w), jax.jit(fused)(x, w)):
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=2e-6)
  g_fused = jax.grad(lambda x, w: fused(x, w)[0], argnums=(0, 1))(x, w)
  g_full = jax.grad(lambda x, w: full(x, w)[0], argnums=(0, 1))(x, w)
  for a, b in zip(g_fused, g_full):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(b)).max() > 1e-3  # the gradients are not trivially zero
  # The statistics carry no gradient; only the total does.
  g_stats = jax.grad(lambda x: fused(x, w)[1])(x)
  np.testing.assert_array_equal(g_stats, np.zeros_like(g_stats))


def test_chunk_length_must_divide_the_sequence():
  x, w = jnp.zeros((1, 6, 4)), jnp.zeros((4, 8))
  ids, mask = jnp.zeros((1, 6), jnp.int32), jnp.ones((1, 6))
  with pytest.raises(ValueError, match='chunk_length=4 must divide'):
    chunked_head_cross_entropy(x, w, ids, mask, vocab_major=False, chunk_length=4)
  with pytest.raises(maxnnx.config.ConfigError, match='loss_chunk_length'):
    TrainConfig(seq_len=32, loss_chunk_length=5)
  assert default_chunk_length(4, 256, 32_000, 32 << 20) == 64
  assert default_chunk_length(1, 7, 10**9, 1) == 1


@pytest.mark.parametrize('model', [pytest.param('tiny', marks=pytest.mark.slow),
                                   pytest.param('tiny-moe', marks=pytest.mark.slow),
                                   'tied-softcap'])
def test_fused_and_full_logits_training_agree(model):
  """The same steps with the fused loss and with full logits give the same losses."""
  if model == 'tied-softcap':
    model = maxnnx.get_preset('tiny').replace(tie_word_embeddings=True, final_logit_softcap=3.0)

  def losses(fused):
    cfg = TrainConfig(steps=3, global_batch_size=4, seq_len=32, learning_rate=1e-2,
                      log_every=1, z_loss=1e-3, fused_loss=fused, loss_chunk_length=8,
                      mesh=maxnnx.config.MeshConfig(data=1))
    trainer = Trainer(model, cfg)
    before = [np.array(p) for p in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))]
    trainer.fit()
    after = [np.array(p) for p in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))]
    assert any(not np.array_equal(b, a) for b, a in zip(before, after))  # it trained
    return [h['loss'] for h in trainer.history]

  fused, full = losses(True), losses(False)
  np.testing.assert_allclose(fused, full, rtol=2e-5)

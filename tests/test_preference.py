"""DPO: losses and gradients against float64 NumPy, chunked log-probs, Trainer runs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.train import DPOObjective, TrainConfig, Trainer
from maxnnx.train.chunks import Head, model_sequence_logps, sequence_logps
from maxnnx.train.preference import dpo_loss

BATCH, SEQ, VOCAB = 4, 16, 512


def _logsigmoid(x):
  return -np.logaddexp(0.0, -x)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _numpy_dpo(h, beta, loss_type, ls):
  """Per-pair loss and d loss / d h in float64."""
  if loss_type == 'sigmoid':
    loss = -_logsigmoid(beta * h) * (1 - ls) - _logsigmoid(-beta * h) * ls
    grad = -(1 - ls) * beta * _sigmoid(-beta * h) + ls * beta * _sigmoid(beta * h)
  elif loss_type == 'ipo':
    loss, grad = (h - 1 / (2 * beta))**2, 2 * (h - 1 / (2 * beta))
  else:
    loss, grad = np.maximum(1 - beta * h, 0.0), np.where(1 - beta * h > 0, -beta, 0.0)
  return loss, grad


@pytest.mark.parametrize('loss_type,ls', [('sigmoid', 0.0), ('sigmoid', 0.1), ('ipo', 0.0),
                                          ('hinge', 0.0)])
def test_dpo_losses_and_gradients_match_numpy(loss_type, ls):
  rng = np.random.default_rng(0)
  beta = 0.3
  logps = [rng.normal(-20.0, 4.0, 6) for _ in range(4)]  # pi_c, pi_r, ref_c, ref_r
  h = (logps[0] - logps[2]) - (logps[1] - logps[3])
  expected, dh = _numpy_dpo(h, beta, loss_type, ls)

  def total(*args):
    return dpo_loss(*args, beta=beta, loss_type=loss_type, label_smoothing=ls)[0].sum()

  args = [jnp.asarray(x, jnp.float32) for x in logps]
  losses, chosen, rejected = dpo_loss(*args, beta=beta, loss_type=loss_type,
                                      label_smoothing=ls)
  np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(chosen, beta * (logps[0] - logps[2]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(rejected, beta * (logps[1] - logps[3]), rtol=1e-5, atol=1e-5)
  grads = jax.grad(total, argnums=(0, 1, 2, 3))(*args)
  for g, sign in zip(grads, (1, -1, -1, 1)):
    np.testing.assert_allclose(g, sign * dh, rtol=1e-4, atol=1e-6)


def test_dpo_rejects_bad_arguments():
  with pytest.raises(ValueError, match='exactly one of reference'):
    DPOObjective()
  with pytest.raises(ValueError, match='loss_type'):
    DPOObjective(loss_type='kto', reference_fn=lambda m, b: None)
  with pytest.raises(ValueError, match='whole'):
    DPOObjective(reference_fn=lambda m, b: None).bind(
        TrainConfig(global_batch_size=6, grad_accum_steps=2))


@pytest.mark.parametrize('vocab_major,softcap', [(False, None), (True, 5.0)])
def test_chunked_sequence_logps_match_a_full_log_softmax(vocab_major, softcap):
  rng = np.random.default_rng(1)
  b, t, d, v = 3, 12, 8, 40
  x = rng.normal(size=(b, t, d))
  w = rng.normal(size=(v, d) if vocab_major else (d, v)) * 0.5
  targets = rng.integers(0, v, (b, t))
  mask = (rng.random((b, t)) > 0.3).astype(np.float64)
  logits = x @ (w.T if vocab_major else w)
  if softcap:
    logits = softcap * np.tanh(logits / softcap)
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  expected = (np.take_along_axis(logp, targets[..., None], -1)[..., 0] * mask).sum(-1)

  def chunked(x, w, chunk):
    head = Head(w, vocab_major, softcap)
    return sequence_logps(x, head, jnp.asarray(targets), jnp.asarray(mask), chunk_length=chunk)

  def full(x, w):
    z = jnp.einsum('btd,vd->btv' if vocab_major else 'btd,dv->btv', x, w)
    z = z if softcap is None else softcap * jnp.tanh(z / softcap)
    lp = jnp.take_along_axis(jax.nn.log_softmax(z), jnp.asarray(targets)[..., None], -1)[..., 0]
    return (lp * mask).sum(-1)

  xj, wj = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
  for chunk in (1, 4, 12):
    np.testing.assert_allclose(chunked(xj, wj, chunk), expected, rtol=1e-5)
  # Gradients of a weighted sum equal those through the full logits.
  coef = jnp.asarray([1.0, -2.0, 0.5])
  g_chunk = jax.grad(lambda x, w: (chunked(x, w, 4) * coef).sum(), argnums=(0, 1))(xj, wj)
  g_full = jax.grad(lambda x, w: (full(x, w) * coef).sum(), argnums=(0, 1))(xj, wj)
  for a, e in zip(g_chunk, g_full):
    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


def _model_config():
  return maxnnx.get_preset('tiny', **{'runtime.dtype': 'float32', 'runtime.param_dtype': 'float32'})


def _pairs_batch(seed=0, prompt=6):
  """Pairs of rows sharing a prompt: ``loss_mask`` 1 on the completion only."""
  rng = np.random.default_rng(seed)
  windows = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
  windows[1::2, :prompt] = windows[0::2, :prompt]
  mask = np.zeros((BATCH, SEQ), np.float32)
  mask[:, prompt - 1:] = 1.0
  mask[3, -3:] = 0.0  # a shorter rejected completion
  return {'inputs': windows[:, :-1], 'targets': windows[:, 1:], 'loss_mask': mask}


def _config(**changes):
  base = dict(global_batch_size=BATCH, seq_len=SEQ, learning_rate=1e-2, warmup_steps=0,
              mesh=MeshConfig(data=1))
  return TrainConfig(**{**base, **changes})


def test_dpo_with_the_initial_policy_as_reference_starts_at_ln2():
  policy = maxnnx.Transformer(_model_config(), rngs=nnx.Rngs(0))
  # nnx.clone shares the arrays; the Trainer copies frozen models (it donates the policy's).
  trainer = Trainer(policy, _config(), DPOObjective(beta=0.1, reference=nnx.clone(policy)))
  first = trainer.step(_pairs_batch(0))
  assert first['loss'] == pytest.approx(math.log(2.0), abs=1e-6)
  for key in ('rewards/chosen', 'rewards/rejected', 'rewards/margins'):
    assert first[key] == pytest.approx(0.0, abs=1e-5)  # policy and reference compile apart
  assert first['logps/chosen'] < 0 and first['logps/rejected'] < 0
  second = trainer.step(_pairs_batch(0))
  assert second['loss'] < first['loss'] and second['rewards/margins'] > 0


def test_dpo_reference_fn_hook():
  def reference_fn(model, batch):
    return model_sequence_logps(model, batch)

  trainer = Trainer(_model_config(), _config(learning_rate=0.0),
                    DPOObjective(reference_fn=reference_fn))
  assert trainer.frozen_models == {}
  assert trainer.step(_pairs_batch(0))['loss'] == pytest.approx(math.log(2.0), abs=1e-6)


@pytest.mark.slow
def test_dpo_gradient_accumulation_matches_one_batch():
  """Micro-batches of whole pairs give the whole batch's loss, metrics and gradient."""
  config = _model_config()
  reference = maxnnx.Transformer(config, rngs=nnx.Rngs(1))
  out = []
  for steps in (1, 2):
    policy = maxnnx.Transformer(config, rngs=nnx.Rngs(0))
    trainer = Trainer(policy, _config(learning_rate=0.0, grad_accum_steps=steps),
                      DPOObjective(beta=0.5, reference=reference))
    out.append(trainer.step(_pairs_batch(2)))
  keys = ['loss', 'grad_norm', 'rewards/chosen', 'rewards/rejected', 'rewards/accuracies',
          'rewards/margins', 'logps/chosen', 'logps/rejected']
  for key in keys:
    assert out[1][key] == pytest.approx(out[0][key], rel=1e-4, abs=1e-6), key

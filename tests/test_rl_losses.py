"""GRPO, Dr. GRPO, DAPO and GSPO losses and advantages against float64 NumPy written out
token by token from the papers' formulas."""

import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxnnx.rl import losses


def _numpy_advantages(rewards, group, scale):
  out = []
  for g in range(0, len(rewards), group):
    values = [float(r) for r in rewards[g:g + group]]
    mean = sum(values) / group
    std = statistics.stdev(values)
    out += [(v - mean) / (std + 1e-4) if scale else v - mean for v in values]
  return np.array(out)


def _numpy_loss(logp, old, ref, adv, mask, *, loss_type, eps_low, eps_high, beta, max_len):
  rows, length = logp.shape
  per_row, token_sum, token_count = [], 0.0, 0
  for i in range(rows):
    positions = [t for t in range(length) if mask[i, t]]
    if loss_type == 'gspo':
      seq_ratio = math.exp(sum(logp[i, t] - old[i, t] for t in positions) / max(len(positions), 1))
    row = 0.0
    for t in positions:
      ratio = seq_ratio if loss_type == 'gspo' else math.exp(logp[i, t] - old[i, t])
      clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
      surrogate = -min(ratio * adv[i], clipped * adv[i])
      delta = ref[i, t] - logp[i, t]
      kl = math.exp(delta) - delta - 1
      row += surrogate + beta * kl
    per_row.append(row / max(len(positions), 1))
    token_sum += row
    token_count += len(positions)
  if loss_type in ('grpo', 'gspo'):
    return sum(per_row) / rows
  if loss_type == 'dapo':
    return token_sum / max(token_count, 1)
  return token_sum / (rows * max_len)


def _rollout(seed, rows=8, length=12):
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.1, 3.0, (rows, length))
  old = logp + rng.normal(0, 0.3, (rows, length))  # ratios well outside the clip range too
  ref = logp + rng.normal(0, 0.5, (rows, length))
  mask = np.zeros((rows, length))
  for i in range(rows):
    start = rng.integers(1, 5)
    mask[i, start:start + rng.integers(1, length - start + 1)] = 1
  adv = rng.normal(0, 1, rows)
  return logp, old, ref, adv, mask


@pytest.mark.parametrize('group,scale', [(4, True), (4, False), (2, True)])
def test_group_advantages_match_numpy(group, scale):
  rewards = np.random.default_rng(group).integers(0, 3, 16).astype(float)
  got = losses.group_advantages(rewards, group, scale_by_std=scale)
  np.testing.assert_allclose(got, _numpy_advantages(rewards, group, scale), rtol=1e-6, atol=1e-6)


def test_equal_rewards_give_zero_advantages_and_are_flagged():
  rewards = np.array([1., 1., 1., 1., 0., 1., 0., 0.])
  np.testing.assert_array_equal(losses.group_advantages(rewards, 4)[:4], 0.0)
  np.testing.assert_array_equal(losses.zero_variance_groups(rewards, 4), [True, False])
  with pytest.raises(ValueError, match='group_size'):
    losses.group_advantages(rewards, 3)


@pytest.mark.parametrize('loss_type', losses.LOSS_TYPES)
@pytest.mark.parametrize('beta', [0.0, 0.04])
def test_loss_of_every_variant_matches_numpy(loss_type, beta):
  logp, old, ref, adv, mask = _rollout(seed=losses.LOSS_TYPES.index(loss_type) * 10 + int(beta > 0))
  eps_low, eps_high = 0.2, 0.28 if loss_type == 'dapo' else 0.2
  if loss_type == 'gspo':
    eps_low, eps_high = 3e-2, 4e-2
  got = losses.policy_loss(jnp.asarray(logp, jnp.float32), jnp.asarray(old, jnp.float32),
                           jnp.asarray(adv, jnp.float32), jnp.asarray(mask, jnp.float32),
                           loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
                           beta=beta, ref_logps_BT=jnp.asarray(ref, jnp.float32),
                           max_completion_length=16)
  want = _numpy_loss(logp, old, ref, adv, mask, loss_type=loss_type, eps_low=eps_low,
                     eps_high=eps_high, beta=beta, max_len=16)
  np.testing.assert_allclose(float(got), want, rtol=2e-5, atol=1e-6)


def test_gspo_gradient_is_the_sequence_level_objective_gradient():
  """GSPO's token form has the value and the gradient of the sequence-level ratio."""
  logp, old, _, adv, mask = _rollout(seed=7)
  old, adv, mask = (jnp.asarray(a, jnp.float32) for a in (old, adv, mask))

  def sequence_level(logp_BT):
    lengths = jnp.maximum(mask.sum(-1), 1.0)
    s_B = jnp.exp(jnp.sum((logp_BT - old) * mask, -1) / lengths)
    return jnp.mean(-jnp.minimum(s_B * adv, jnp.clip(s_B, 0.97, 1.04) * adv))

  def token_form(logp_BT):
    return losses.policy_loss(logp_BT, old, adv, mask, loss_type='gspo', epsilon_low=0.03,
                              epsilon_high=0.04)

  x = jnp.asarray(logp, jnp.float32)
  np.testing.assert_allclose(float(token_form(x)), float(sequence_level(x)), rtol=1e-5)
  np.testing.assert_allclose(jax.grad(token_form)(x), jax.grad(sequence_level)(x), rtol=1e-4,
                             atol=1e-7)


def test_clipped_tokens_carry_no_gradient():
  """Past the clip range (in the advantage's direction) a token's gradient is zero."""
  logp = jnp.log(jnp.array([[0.5, 0.5]]))
  old = logp - jnp.array([[0.5, 0.0]])  # ratio e^0.5 > 1.2 on the first token, 1 on the second
  grads = jax.grad(lambda x: losses.policy_loss(x, old, jnp.ones(1), jnp.ones((1, 2))))(logp)
  assert float(grads[0, 0]) == 0.0 and float(grads[0, 1]) < 0.0
  terms = losses.policy_loss_terms(logp, old, jnp.ones(1), jnp.ones((1, 2)))
  np.testing.assert_array_equal(terms['clipped_high'], [[1.0, 0.0]])


def test_unknown_loss_type_is_refused():
  with pytest.raises(ValueError, match='loss_type must be one of'):
    losses.policy_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros(1), jnp.ones((1, 2)),
                       loss_type='ppo')

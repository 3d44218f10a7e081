"""GRPO and its variants as plain functions of per-token log-probabilities.

Rows of a rollout batch come in groups of ``group_size`` completions of the same
prompt, one group after another. With ``logp`` the trained policy's log-probs
of the completion tokens, ``old`` the policy's at sampling time (its log-probs
from the forward pass made before the first optimisation pass) and ``ref`` the
reference policy's:

* advantages (:func:`group_advantages`): ``A_i = (r_i - mean_g r) / (std_g r + 1e-4)``
  over the rewards of row ``i``'s group (``std`` with Bessel's correction, as
  TRL computes it), or ``r_i - mean_g r`` without the division (``dr_grpo``);
* the importance ratio per token ``rho_t = exp(logp_t - old_t)``; for ``gspo``
  the sequence's ratio ``s_i = exp(mean_t (logp_t - old_t))`` in GSPO's token form
  ``rho_t = sg(s_i) * exp(logp_t - sg(logp_t))`` (value ``s_i``, gradient of the
  sequence-level objective);
* the clipped surrogate per token ``-min(rho_t A_i, clip(rho_t, 1 - eps_low,
  1 + eps_high) A_i)`` plus ``beta`` times the k3 estimate of the KL divergence to
  the reference, ``exp(ref_t - logp_t) - (ref_t - logp_t) - 1``;
* aggregated over the completion tokens (``mask``) by :data:`LOSS_TYPES`:

  ``grpo``, ``gspo``
    the mean over rows of each row's token mean (sequence-level, as in DeepSeekMath);
  ``dapo``
    the mean over every completion token of the batch (token-level);
  ``dr_grpo``
    the sum over tokens divided by ``rows * max_completion_length`` (no length
    normalisation, Dr. GRPO).

The DAPO recipe also raises ``eps_high`` above ``eps_low`` (clip-higher) and
drops groups whose rewards are all equal (dynamic sampling, done when rollouts
are collected: :class:`maxnnx.rl.Rollouts`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LOSS_TYPES = ('grpo', 'dr_grpo', 'dapo', 'gspo')
# GRPO's defaults, declared once: the clip range and the KL weight (GRPOConfig, GRPOObjective
# and the loss functions read these).
DEFAULT_EPSILON = 0.2
DEFAULT_BETA = 0.0


def check_loss_type(loss_type: str) -> None:
  """Raise a ``ValueError`` naming the choices unless ``loss_type`` is one of them."""
  if loss_type not in LOSS_TYPES:
    raise ValueError(f'loss_type must be one of {LOSS_TYPES}, got {loss_type!r}.')


def group_advantages(rewards_N, group_size: int, *, scale_by_std: bool = True,
                     eps: float = 1e-4) -> np.ndarray:
  """Group-normalised advantages ``[N]`` of rewards ``[N]`` (groups of ``group_size`` rows).

  ``scale_by_std=False`` (Dr. GRPO) only subtracts the group mean.
  """
  rewards = np.asarray(rewards_N, np.float64)
  if group_size < 2 or rewards.shape[0] % group_size:
    raise ValueError(f'group_size must be >= 2 and divide the {rewards.shape[0]} rewards, '
                     f'got {group_size}.')
  grouped = rewards.reshape(-1, group_size)
  centred = grouped - grouped.mean(axis=1, keepdims=True)
  if scale_by_std:
    centred = centred / (grouped.std(axis=1, ddof=1, keepdims=True) + eps)
  return centred.reshape(-1).astype(np.float32)


def zero_variance_groups(rewards_N, group_size: int) -> np.ndarray:
  """``[N / group_size]`` bool: groups whose rewards are all equal (no learning signal)."""
  grouped = np.asarray(rewards_N, np.float64).reshape(-1, group_size)
  return np.all(grouped == grouped[:, :1], axis=1)


def policy_loss_terms(logps_BT: jax.Array, old_logps_BT: jax.Array, advantages_B: jax.Array,
                      mask_BT: jax.Array, *, loss_type: str = 'grpo',
                      epsilon_low: float = DEFAULT_EPSILON,
                      epsilon_high: float = DEFAULT_EPSILON, beta: float = DEFAULT_BETA,
                      ref_logps_BT: jax.Array | None = None) -> dict[str, jax.Array]:
  """Per-token terms of the clipped objective, ``[B, T]`` each (zero off the mask).

  Returns ``loss`` (the surrogate plus ``beta`` times ``kl``), ``kl`` (k3, zero when
  ``beta == 0``), ``clipped_low`` / ``clipped_high`` (1 where the ratio is clipped below
  with a negative advantage, or above with a positive one, i.e. where the clip
  stops the gradient).
  """
  check_loss_type(loss_type)
  mask = mask_BT.astype(jnp.float32)
  logps = logps_BT.astype(jnp.float32)
  log_ratio_BT = logps - old_logps_BT.astype(jnp.float32)
  if loss_type == 'gspo':
    lengths_B = jnp.maximum(mask.sum(-1), 1.0)
    sequence_B = jnp.sum(log_ratio_BT * mask, -1) / lengths_B
    log_ratio_BT = jax.lax.stop_gradient(sequence_B)[:, None] + logps - jax.lax.stop_gradient(
        logps)
  ratio_BT = jnp.exp(log_ratio_BT)
  adv_B1 = advantages_B.astype(jnp.float32)[:, None]
  clipped_ratio = jnp.clip(ratio_BT, 1.0 - epsilon_low, 1.0 + epsilon_high)
  surrogate_BT = -jnp.minimum(ratio_BT * adv_B1, clipped_ratio * adv_B1)
  kl_BT = jnp.zeros_like(logps)
  if beta:
    if ref_logps_BT is None:
      raise ValueError('beta > 0 needs the reference log-probs (ref_logps_BT).')
    delta = ref_logps_BT.astype(jnp.float32) - logps
    kl_BT = jnp.exp(delta) - delta - 1.0
  low = ((ratio_BT < 1.0 - epsilon_low) & (adv_B1 < 0)).astype(jnp.float32)
  high = ((ratio_BT > 1.0 + epsilon_high) & (adv_B1 > 0)).astype(jnp.float32)
  return {'loss': (surrogate_BT + beta * kl_BT) * mask, 'kl': kl_BT * mask,
          'clipped_low': low * mask, 'clipped_high': high * mask}


def aggregate(per_token_BT: jax.Array, mask_BT: jax.Array, *, loss_type: str, rows: float,
              tokens: float, max_completion_length: int) -> jax.Array:
  """This (micro-)batch's share of the loss: ``per_token_BT`` (masked) aggregated as
  ``loss_type`` says, over a whole batch of ``rows`` rows and ``tokens`` completion tokens
  (so micro-batch shares add up to the batch's loss)."""
  check_loss_type(loss_type)
  if loss_type in ('grpo', 'gspo'):
    lengths_B = jnp.maximum(mask_BT.astype(jnp.float32).sum(-1), 1.0)
    return jnp.sum(per_token_BT.sum(-1) / lengths_B) / rows
  if loss_type == 'dapo':
    return per_token_BT.sum() / tokens
  return per_token_BT.sum() / (rows * max_completion_length)


def policy_loss(logps_BT, old_logps_BT, advantages_B, mask_BT, *, loss_type: str = 'grpo',
                epsilon_low: float = DEFAULT_EPSILON, epsilon_high: float = DEFAULT_EPSILON,
                beta: float = DEFAULT_BETA,
                ref_logps_BT=None, max_completion_length: int | None = None) -> jax.Array:
  """The scalar loss of one whole rollout batch (see the module docstring)."""
  terms = policy_loss_terms(logps_BT, old_logps_BT, advantages_B, mask_BT, loss_type=loss_type,
                            epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
                            ref_logps_BT=ref_logps_BT)
  mask = jnp.asarray(mask_BT, jnp.float32)
  return aggregate(terms['loss'], mask, loss_type=loss_type, rows=mask.shape[0],
                   tokens=jnp.maximum(mask.sum(), 1.0),
                   max_completion_length=max_completion_length or mask.shape[1])


__all__ = ['LOSS_TYPES', 'aggregate', 'check_loss_type', 'group_advantages', 'policy_loss',
           'policy_loss_terms', 'zero_variance_groups']

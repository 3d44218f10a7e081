"""``GRPOObjective``: the clipped policy-gradient loss of GRPO and its variants.

The objective trains on rollout batches that :class:`~maxnnx.rl.Rollouts` makes:
rows are prompt + completion (the ordinary batch keys, ``loss_mask`` 1 on the
completion's target positions) plus three per-token fields
(:attr:`GRPOObjective.batch_fields`):

``old_logps``
  the policy's log-probs of the targets when the rollout was taken (from a
  forward pass on the training mesh, before the first optimisation pass);
``ref_logps``
  the reference policy's (zeros when ``beta == 0``);
``advantages``
  each row's group-normalised advantage, repeated along the row.

The loss recomputes the policy's log-probs under ``softmax(logits /
temperature)`` (the distribution the completions were sampled from) with the
head applied one slice at a time, and combines them as
:mod:`maxnnx.rl.losses` describes.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from maxnnx.rl import losses
from maxnnx.train.chunks import Head, chunk_length_for, token_logps
from maxnnx.train.objectives import Objective

#: The per-token fields a rollout batch carries besides the ordinary batch keys.
ROLLOUT_FIELDS = {'old_logps': jnp.float32, 'ref_logps': jnp.float32,
                  'advantages': jnp.float32}


def policy_token_logps(model: nnx.Module, batch: dict, *, temperature: float = 1.0,
                       chunk_length: int | None = None):
  """``(logps_BT, entropy_BT)`` of ``model`` on a batch's targets at ``temperature``."""
  x_BTD = model.hidden_states(batch['inputs'], segment_ids=batch['segment_ids'],
                              positions=batch['positions'])
  batch_size, length = batch['targets'].shape
  chunk = chunk_length_for(batch_size, length, model.config.vocab_size, copies=2,
                           requested=chunk_length)
  return token_logps(x_BTD, Head.of(model), batch['targets'], chunk_length=chunk,
                     temperature=temperature)


class GRPOObjective(Objective):
  """GRPO (``grpo``), Dr. GRPO (``dr_grpo``), DAPO (``dapo``) or GSPO (``gspo``).

  Args:
    loss_type: one of :data:`~maxnnx.rl.losses.LOSS_TYPES`.
    beta: weight of the k3 KL penalty to the reference (0: no reference is used).
    epsilon: the lower clip range ``eps_low`` (ratio ``>= 1 - epsilon``).
    epsilon_high: the upper clip range (``<= 1 + epsilon_high``); ``None`` is
      ``epsilon`` (DAPO's clip-higher sets it larger).
    temperature: the sampling temperature of the rollouts.
    max_completion_length: the completion budget (``max_new_tokens``), the
      constant denominator of ``dr_grpo``.
    reference: a frozen reference policy, placed on the mesh by the Trainer as
      ``frozen['reference']`` (the rollouts read its log-probs from there); not
      needed with ``beta == 0`` or when the reference is the policy with its LoRA
      adapters off.
    chunk_length: sequence positions per head slice (``None``: chosen to keep a
      slice's logits small).

  Metrics (TRL's names where TRL has one): ``loss``, ``kl`` and ``entropy`` (means
  over the completion tokens), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
  ``clip_ratio/region_mean`` (share of completion tokens whose ratio the clip
  stops) and ``advantages/abs_mean``.
  """

  batch_fields = ROLLOUT_FIELDS

  def __init__(self, loss_type: str = 'grpo', *, beta: float = losses.DEFAULT_BETA,
               epsilon: float = losses.DEFAULT_EPSILON,
               epsilon_high: float | None = None, temperature: float = 1.0,
               max_completion_length: int = 256, reference: nnx.Module | None = None,
               chunk_length: int | None = None):
    losses.check_loss_type(loss_type)
    if beta < 0 or epsilon <= 0 or (epsilon_high is not None and epsilon_high <= 0):
      raise ValueError(f'Need beta >= 0 and positive clip ranges, got beta={beta}, '
                       f'epsilon={epsilon}, epsilon_high={epsilon_high}.')
    if temperature <= 0:
      raise ValueError(f'temperature must be positive (the rollouts sample), got {temperature}.')
    self.loss_type, self.beta = loss_type, float(beta)
    self.epsilon_low = float(epsilon)
    self.epsilon_high = float(epsilon if epsilon_high is None else epsilon_high)
    self.temperature, self.max_completion_length = float(temperature), max_completion_length
    self.chunk_length = chunk_length
    self.frozen_models = {} if reference is None else {'reference': reference}

  def normalizers(self, model, batch):
    """Rows and completion tokens of the whole batch."""
    del model
    return {'rows': float(batch['inputs'].shape[0]),
            'tokens': jnp.maximum(batch['loss_mask'].sum(), 1.0)}

  def loss(self, model, batch, *, frozen, norm):
    """This micro-batch's share of the loss, and metric sums."""
    del frozen
    mask_BT = batch['loss_mask']
    logps_BT, entropy_BT = policy_token_logps(model, batch, temperature=self.temperature,
                                              chunk_length=self.chunk_length)
    advantages_B = batch['advantages'][:, 0]
    terms = losses.policy_loss_terms(
        logps_BT, batch['old_logps'], advantages_B, mask_BT, loss_type=self.loss_type,
        epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, beta=self.beta,
        ref_logps_BT=batch['ref_logps'])
    loss = losses.aggregate(terms['loss'], mask_BT, loss_type=self.loss_type, rows=norm['rows'],
                            tokens=norm['tokens'],
                            max_completion_length=self.max_completion_length)
    sums = {'loss': loss, 'kl': terms['kl'].sum(), 'entropy': (entropy_BT * mask_BT).sum(),
            'clip_low': terms['clipped_low'].sum(), 'clip_high': terms['clipped_high'].sum(),
            'abs_advantage': jnp.abs(advantages_B).sum()}
    return loss, sums

  def metrics(self, sums, norm):
    """Token means of the KL, entropy and clipped shares; the loss as summed."""
    tokens = norm['tokens']
    return {'loss': sums['loss'], 'kl': sums['kl'] / tokens, 'entropy': sums['entropy'] / tokens,
            'clip_ratio/low_mean': sums['clip_low'] / tokens,
            'clip_ratio/high_mean': sums['clip_high'] / tokens,
            'clip_ratio/region_mean': (sums['clip_low'] + sums['clip_high']) / tokens,
            'advantages/abs_mean': sums['abs_advantage'] / norm['rows']}

  def eval_loss(self, model, batch, *, frozen):
    """Not defined for rollouts: GRPO runs have no held-out loss."""
    raise ValueError('GRPO has no held-out loss: set eval_every=0 (score the policy with a '
                     'reward on held-out prompts instead).')


__all__ = ['GRPOObjective', 'ROLLOUT_FIELDS', 'policy_token_logps']

"""Direct preference optimisation (DPO) and its IPO / hinge variants as a training objective.

::

  reference = nnx.clone(policy)     # the policy as it starts (e.g. the SFT checkpoint)
  trainer = Trainer(policy, train_config, objective=DPOObjective(beta=0.1, reference=reference))

With LoRA the reference is the policy with its adapters off, so no second model is held::

  policy = apply_lora(policy, LoraConfig(rank=8))           # maxnnx.train.lora
  trainer = Trainer(policy, train_config,
                    objective=DPOObjective(beta=0.1, reference_fn=without_adapters_logps))

Batch layout (the ordinary :data:`~maxnnx.train.batches.BATCH_KEYS`, no new
keys): rows come in pairs, row ``2i`` the *chosen* and row ``2i + 1`` the
*rejected* sequence of pair ``i``, each the prompt followed by the completion,
with ``loss_mask`` 1 on the completion's target positions only. A sequence's
log-probability is the sum of ``log p(target)`` over its masked positions,
computed with the head applied one slice of the sequence at a time
(:func:`maxnnx.train.chunks.sequence_logps`), so the ``[B, T, vocab]`` logits
are never held at once.

With ``h = (pi_c - ref_c) - (pi_r - ref_r)`` (policy and reference log-probs of
the chosen and rejected sequences) the per-pair losses are those of TRL:

* ``sigmoid``: ``-logsigmoid(beta h) (1 - ls) - logsigmoid(-beta h) ls``
  (``ls`` the label smoothing);
* ``ipo``: ``(h - 1 / (2 beta))^2``, where, as in TRL, the log-probs are
  *averaged* over each sequence's completion tokens rather than summed;
* ``hinge``: ``relu(1 - beta h)``.

The reference may share arrays with the policy (``nnx.clone`` does): the
Trainer places frozen models on copies of their buffers, since it donates the
policy's to its step.

Gradient accumulation: the step splits its batch into ``grad_accum_steps``
contiguous micro-batches of rows. A pair must not be split, so the rows per
micro-batch (``global_batch_size / grad_accum_steps``) must be even;
:meth:`DPOObjective.bind` checks it. (In a multi-host run, each process's rows
must also hold whole pairs.) Losses and metrics are per-pair sums divided by the
whole batch's pair count, so the micro-batch sums are the batch means.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.train.chunks import model_sequence_logps
from maxnnx.train.config import TrainConfig
from maxnnx.train.objectives import Objective

LOSS_TYPES = ('sigmoid', 'ipo', 'hinge')

ReferenceFn = Callable[[nnx.Module, dict[str, jax.Array]], jax.Array]


def dpo_loss(policy_chosen_P: jax.Array, policy_rejected_P: jax.Array,
             reference_chosen_P: jax.Array, reference_rejected_P: jax.Array, *,
             beta: float = 0.1, loss_type: str = 'sigmoid', label_smoothing: float = 0.0
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-pair DPO losses and implicit rewards from sequence log-probs.

  Args:
    policy_chosen_P, policy_rejected_P: the trained policy's log-probs of the
      chosen and rejected sequences, ``[P]`` (one per pair).
    reference_chosen_P, reference_rejected_P: the reference model's.
    beta, loss_type, label_smoothing: see :class:`DPOObjective`.

  Returns:
    ``(losses_P, chosen_rewards_P, rejected_rewards_P)``; the rewards are
    ``beta * (policy - reference)`` and carry no gradient.
  """
  if loss_type not in LOSS_TYPES:
    raise ValueError(f'loss_type must be one of {LOSS_TYPES}, got {loss_type!r}.')
  chosen_ratio_P = policy_chosen_P - reference_chosen_P
  rejected_ratio_P = policy_rejected_P - reference_rejected_P
  h_P = chosen_ratio_P - rejected_ratio_P
  if loss_type == 'sigmoid':
    losses_P = (-jax.nn.log_sigmoid(beta * h_P) * (1.0 - label_smoothing)
                - jax.nn.log_sigmoid(-beta * h_P) * label_smoothing)
  elif loss_type == 'ipo':
    losses_P = (h_P - 1.0 / (2.0 * beta))**2
  else:
    losses_P = jax.nn.relu(1.0 - beta * h_P)
  rewards = jax.lax.stop_gradient((beta * chosen_ratio_P, beta * rejected_ratio_P))
  return losses_P, rewards[0], rewards[1]


class DPOObjective(Objective):
  """DPO (or IPO / hinge) on pairs of rows: ``2i`` chosen, ``2i + 1`` rejected.

  Args:
    beta: the KL-penalty temperature ``beta``.
    loss_type: ``'sigmoid'`` (DPO), ``'ipo'`` or ``'hinge'`` (see the module docstring).
    label_smoothing: the probability that a preference label is flipped
      (conservative DPO; ``sigmoid`` only).
    reference: the frozen reference policy (an ``nnx.Module`` with
      ``hidden_states``/``head_weight``), placed by the Trainer on its mesh as
      ``frozen['reference']``.
    reference_fn: instead of ``reference``, ``reference_fn(model, batch) ->
      logps_B``: the reference's summed log-probs of each row, computed from the
      policy being trained, e.g. :func:`maxnnx.train.lora.without_adapters_logps`
      (the policy with its LoRA adapters switched off, so no second model is
      held); its result is not differentiated, and for ``ipo`` it is averaged over
      the completion tokens like the policy's.
    chunk_length: sequence positions per head slice; ``None`` picks one that
      keeps a slice's logits small.

  Exactly one of ``reference`` and ``reference_fn`` is needed.

  Metrics (TRL's names, means over the batch's pairs): ``loss``,
  ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
  ``rewards/margins``, ``logps/chosen``, ``logps/rejected``.
  """

  def __init__(self, beta: float = 0.1, loss_type: str = 'sigmoid',
               label_smoothing: float = 0.0, reference: nnx.Module | None = None, *,
               reference_fn: ReferenceFn | None = None, chunk_length: int | None = None):
    if loss_type not in LOSS_TYPES:
      raise ValueError(f'loss_type must be one of {LOSS_TYPES}, got {loss_type!r}.')
    if beta <= 0:
      raise ValueError(f'beta must be positive, got {beta}.')
    if not 0.0 <= label_smoothing < 0.5:
      raise ValueError(f'label_smoothing must be in [0, 0.5), got {label_smoothing}.')
    if label_smoothing and loss_type != 'sigmoid':
      raise ValueError(f"label_smoothing applies to loss_type='sigmoid' only, not {loss_type!r}.")
    if (reference is None) == (reference_fn is None):
      raise ValueError('DPOObjective needs exactly one of reference= (a frozen reference '
                       'model) and reference_fn= (reference log-probs from the policy).')
    self.beta, self.loss_type, self.label_smoothing = float(beta), loss_type, label_smoothing
    self.reference, self.reference_fn, self.chunk_length = reference, reference_fn, chunk_length
    self.frozen_models = {} if reference is None else {'reference': reference}

  def bind(self, config: TrainConfig) -> DPOObjective:
    """Check that every micro-batch holds whole pairs; return this objective."""
    micro_rows, rest = divmod(config.global_batch_size, config.grad_accum_steps)
    if rest or micro_rows % 2:
      raise ValueError(
          f'DPO needs whole (chosen, rejected) pairs in every micro-batch: global_batch_size='
          f'{config.global_batch_size} / grad_accum_steps={config.grad_accum_steps} must be an '
          'even number of rows.')
    return self

  def normalizers(self, model, batch):
    """``{'pairs': B / 2}``, the number of pairs in the whole batch."""
    del model
    return {'pairs': _pairs(batch)}

  def loss(self, model, batch, *, frozen, norm):
    """Mean per-pair loss of this micro-batch's share of the batch, and metric sums."""
    terms = self._pair_terms(model, batch, frozen)
    losses_P, chosen_P, rejected_P, pi_c_P, pi_r_P = terms
    pairs = norm['pairs']
    loss = jnp.sum(losses_P) / pairs
    metrics = {
        'loss': loss,
        'rewards/chosen': jnp.sum(chosen_P) / pairs,
        'rewards/rejected': jnp.sum(rejected_P) / pairs,
        'rewards/accuracies': jnp.sum((chosen_P > rejected_P).astype(jnp.float32)) / pairs,
        'rewards/margins': jnp.sum(chosen_P - rejected_P) / pairs,
        'logps/chosen': jax.lax.stop_gradient(jnp.sum(pi_c_P)) / pairs,
        'logps/rejected': jax.lax.stop_gradient(jnp.sum(pi_r_P)) / pairs,
    }
    return loss, metrics

  def eval_loss(self, model, batch, *, frozen):
    """``(sum of per-pair losses, number of pairs)`` of a held-out batch."""
    losses_P = self._pair_terms(model, batch, frozen)[0]
    return jnp.sum(losses_P), jnp.asarray(losses_P.shape[0], jnp.float32)

  def _pair_terms(self, model, batch, frozen):
    _pairs(batch)
    policy_B = self._logps(model, batch)
    if self.reference_fn is not None:
      reference_B = self._averaged(self.reference_fn(model, batch), batch)
    else:
      if 'reference' not in frozen:
        raise ValueError("DPOObjective: frozen['reference'] is missing; pass the objective "
                         'to a Trainer, which places the reference model.')
      reference_B = self._logps(frozen['reference'], batch)
    reference_B = jax.lax.stop_gradient(reference_B.astype(jnp.float32))
    pi_c_P, pi_r_P = policy_B[0::2], policy_B[1::2]
    losses_P, chosen_P, rejected_P = dpo_loss(
        pi_c_P, pi_r_P, reference_B[0::2], reference_B[1::2], beta=self.beta,
        loss_type=self.loss_type, label_smoothing=self.label_smoothing)
    return losses_P, chosen_P, rejected_P, pi_c_P, pi_r_P

  def _logps(self, model, batch):
    logps_B = model_sequence_logps(model, batch, chunk_length=self.chunk_length)
    return self._averaged(logps_B, batch)

  def _averaged(self, logps_B, batch):
    if self.loss_type == 'ipo':  # TRL averages over the completion tokens for IPO
      logps_B = logps_B / jnp.maximum(batch['loss_mask'].sum(-1), 1.0)
    return logps_B


def _pairs(batch) -> int:
  rows = batch['inputs'].shape[0]
  if rows % 2:
    raise ValueError(f'DPO batches hold (chosen, rejected) row pairs; got {rows} rows.')
  return rows // 2


__all__ = ['DPOObjective', 'LOSS_TYPES', 'dpo_loss']

"""Training objectives: what the train step minimises, as an object the Trainer takes.

::

  trainer = Trainer('tiny', config)                                   # PretrainObjective
  trainer = Trainer(student, config, objective=Distill(teacher))      # a custom one

An objective has three parts:

``normalizers(model, batch)``
  Quantities of the *whole* step batch computed once, outside the gradient
  (token counts). With ``grad_accum_steps > 1`` the step splits the batch into
  micro-batches; the objective divides by these so that the per-micro-batch
  losses add up to the loss of the whole batch. Default: ``{'tokens':
  max(loss_mask.sum(), 1)}``.

``loss(model, batch, *, frozen, norm) -> (loss, metrics)``
  Traced inside the jitted step, once per micro-batch. ``model`` is the model
  being trained (gradients are taken with respect to its trainable parameters:
  every ``nnx.Param``, or only the LoRA adapters of an adapted model),
  ``batch`` the (micro-)batch dict (see :func:`maxnnx.train.as_batch`),
  ``norm`` what ``normalizers`` gave for the whole batch, and ``frozen`` a dict
  ``name -> nnx.Module`` with the same names as :attr:`Objective.frozen_models`:
  the frozen models, placed on the trainer's mesh and merged inside the step.
  ``loss`` is a float32 scalar; ``metrics`` a dict of scalars that are *summed*
  over micro-batches (so report sums, or means already divided by a ``norm``
  entry).

``batch_fields``
  Extra per-token arrays the batches carry (``name -> dtype``), e.g. the
  sampler's log-probs of an RL rollout; empty by default.

``metrics(sums, norm) -> dict``
  The step's metrics from the micro-batch sums. It must contain ``loss`` (the
  value the non-finite and spike guards watch, and the one logged). Default:
  ``sums`` unchanged.

Frozen models (a DPO reference policy, a distillation teacher) are declared in
``frozen_models``. The Trainer places them with the same mesh and logical-axis
rules as the trained model, passes their state into the jitted step as an
argument it neither donates nor returns, and keeps them out of the optimizer:
they never change. A distillation objective is then::

  class Distill(Objective):
    def __init__(self, teacher):
      self.frozen_models = {'teacher': teacher}

    def loss(self, model, batch, *, frozen, norm):
      student_BTV = model(batch['inputs'], segment_ids=batch['segment_ids'],
                          positions=batch['positions'])
      teacher_BTV = frozen['teacher'](batch['inputs'], segment_ids=batch['segment_ids'],
                                      positions=batch['positions'])
      kl_BT = kl_divergence(teacher_BTV, student_BTV)
      loss = (kl_BT * batch['loss_mask']).sum() / norm['tokens']
      return loss, {'loss': loss}

Before training, the Trainer calls ``objective.bind(config)`` with its
:class:`~maxnnx.train.config.TrainConfig` and uses the objective it returns
(``PretrainObjective`` takes its loss weights from there).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.layers.mla import indexer_losses
from maxnnx.layers.moe import moe_aux_losses
from maxnnx.layers.mtp import mtp_targets
from maxnnx.train.config import TrainConfig
from maxnnx.train.loss import chunked_head_cross_entropy, default_chunk_length, masked_cross_entropy

Metrics = dict[str, jax.Array]


def images(batch: dict) -> dict:
  """``{'pixel_values': [batch, images_per_row, C, H, W]}`` of an image+text batch, else
  ``{}``: keywords for the model (each row's placeholders take that row's images)."""
  if 'pixel_values' not in batch:
    return {}
  return {'pixel_values': batch['pixel_values']}


class Objective:
  """Base class of training objectives (see the module docstring for the contract).

  Attributes:
    frozen_models: ``name -> nnx.Module`` of models the loss reads but never
      trains (a reference policy, a teacher); empty by default.
    batch_fields: ``name -> dtype`` of further ``[batch, seq_len]`` arrays every
      batch must carry besides :data:`~maxnnx.train.batches.BATCH_KEYS` (an RL
      objective's old log-probs and advantages); sharded like the tokens.
  """

  frozen_models: dict[str, nnx.Module] = {}
  batch_fields: dict[str, Any] = {}

  def bind(self, config: TrainConfig) -> Objective:
    """This objective for a run with ``config`` (default: itself, unchanged)."""
    del config
    return self

  def normalizers(self, model: nnx.Module, batch: dict[str, jax.Array]) -> dict[str, Any]:
    """Whole-batch quantities for :meth:`loss`: ``{'tokens': max(loss_mask.sum(), 1)}``."""
    del model
    return {'tokens': jnp.maximum(batch['loss_mask'].sum(), 1.0)}

  def loss(self, model: nnx.Module, batch: dict[str, jax.Array], *,
           frozen: dict[str, nnx.Module], norm: dict[str, Any]) -> tuple[jax.Array, Metrics]:
    """``(loss, metrics)`` of one (micro-)batch; the loss is differentiated."""
    raise NotImplementedError

  def metrics(self, sums: Metrics, norm: dict[str, Any]) -> Metrics:
    """The step's metrics from the per-micro-batch ``metrics`` summed (needs ``loss``)."""
    del norm
    return dict(sums)

  def eval_loss(self, model: nnx.Module, batch: dict[str, jax.Array], *,
                frozen: dict[str, nnx.Module]) -> tuple[jax.Array, jax.Array]:
    """``(total, weight)`` of a held-out batch: ``evaluate`` reports ``sum(total) / sum(weight)``.

    Default: the masked next-token cross-entropy of ``model`` (its sum and the
    token count).
    """
    del frozen
    logits_BTV = model(batch['inputs'], segment_ids=batch['segment_ids'],
                       positions=batch['positions'])
    ce_sum, _ = masked_cross_entropy(logits_BTV, batch['targets'], batch['loss_mask'])
    return ce_sum, batch['loss_mask'].sum()


@dataclasses.dataclass(frozen=True)
class PretrainObjective(Objective):
  """Next-token cross-entropy with the fused head, plus z-loss, MoE and MTP terms.

  The loss of a batch with ``N`` counted tokens is
  ``(ce_sum + z_loss * z_sum) / N + router_aux_loss_coef * load_balance_loss +
  router_z_loss_coef * router_z_loss + mtp_loss_scaling_factor * mtp``, where
  ``mtp`` is the mean over MTP depths of each depth's mean cross-entropy.

  Args:
    config: the :class:`TrainConfig` whose ``z_loss``, ``fused_loss``,
      ``loss_chunk_length``, ``router_aux_loss_coef``, ``router_z_loss_coef``
      and ``mtp_loss_scaling_factor`` apply; ``None`` takes the Trainer's.

  Metrics: ``loss`` (mean cross-entropy per token, without the extra terms),
  ``z_loss`` (mean ``logsumexp^2``), ``moe_aux_loss`` (the weighted MoE terms)
  and, with MTP, ``mtp_loss`` (mean over depths, unscaled); with
  ``mla.indexer_training``, ``indexer_loss`` (DeepSeek V3.2's indexer KL, mean over MLA
  layers, unweighted; the loss adds ``indexer_loss_weight`` times it).
  """

  config: TrainConfig | None = None

  def bind(self, config: TrainConfig) -> PretrainObjective:
    """This objective with ``config`` when it has none of its own."""
    return self if self.config is not None else dataclasses.replace(self, config=config)

  def normalizers(self, model, batch):
    """Counted tokens of the batch (``tokens``) and of each MTP depth's targets (``mtp``)."""
    norm = super().normalizers(model, batch)
    norm['mtp'] = [jnp.maximum(_depth_targets(batch, k)[1].sum(), 1.0)
                   for k in range(1, model.config.mtp.num_layers + 1)]
    return norm

  def loss(self, model, batch, *, frozen, norm):
    """Loss of one (micro-)batch; ``metrics`` are sums to be divided in :meth:`metrics`."""
    del frozen
    cfg, mc = self._config(), model.config
    total_tokens = norm['tokens']
    depths = mc.mtp.num_layers
    mtp_tokens = norm.get('mtp') or ()
    out = model.hidden_states(batch['inputs'], segment_ids=batch['segment_ids'],
                              positions=batch['positions'], mtp=depths > 0, **images(batch))
    x_BTD, mtp_hidden = out if depths else (out, ())
    objective, ce_sum, z_sum = self._terms(model, x_BTD, batch['targets'], batch['loss_mask'],
                                           cfg.z_loss)
    # Multi-token prediction: mean over depths of each depth's mean cross-entropy.
    mtp = sum(self._terms(model, h_BTD, *_depth_targets(batch, k), 0.0)[0] / mtp_tokens[k - 1]
              for k, h_BTD in enumerate(mtp_hidden, start=1)) / max(depths, 1)
    mtp = jnp.asarray(mtp, jnp.float32)
    # MoE balancing / router z losses (zero without MoE layers), weighted like the
    # micro-batch's share of the tokens so accumulation matches the whole batch.
    aux = 0.0
    if mc.moe.num_experts > 1:
      losses = moe_aux_losses(model)
      aux = (cfg.router_aux_loss_coef * losses['load_balance_loss']
             + cfg.router_z_loss_coef * losses['router_z_loss'])
      aux = aux * batch['loss_mask'].sum() / total_tokens
    loss = objective / total_tokens + aux
    sums = {'ce_sum': ce_sum, 'z_sum': z_sum, 'moe_aux_loss': aux, 'mtp_loss': mtp}
    # DeepSeek V3.2's indexer KL (mla.indexer_training), mean over MLA layers, weighted by
    # the micro-batch's share of the tokens like the MoE terms.
    index_terms = indexer_losses(model)
    if index_terms:
      kl = jnp.concatenate([t.reshape(-1) for t in index_terms]).mean()
      sums['indexer_loss'] = kl * batch['loss_mask'].sum() / total_tokens
      loss = loss + cfg.indexer_loss_weight * sums['indexer_loss']
    return loss + cfg.mtp_loss_scaling_factor * mtp, sums

  def metrics(self, sums, norm):
    """``loss`` and ``z_loss`` per token, ``moe_aux_loss``, and ``mtp_loss`` with MTP."""
    total_tokens = norm['tokens']
    out = {'loss': sums['ce_sum'] / total_tokens, 'z_loss': sums['z_sum'] / total_tokens,
           'moe_aux_loss': jnp.asarray(sums['moe_aux_loss'], jnp.float32)}
    if norm.get('mtp'):
      out['mtp_loss'] = jnp.asarray(sums['mtp_loss'], jnp.float32)
    if 'indexer_loss' in sums:
      out['indexer_loss'] = jnp.asarray(sums['indexer_loss'], jnp.float32)
    return out

  def eval_loss(self, model, batch, *, frozen):
    """Summed next-token cross-entropy (the training head, without z-loss) and token count."""
    del frozen
    x_BTD = model.hidden_states(batch['inputs'], segment_ids=batch['segment_ids'],
                                positions=batch['positions'], **images(batch))
    _, ce_sum, _ = self._terms(model, x_BTD, batch['targets'], batch['loss_mask'],
                               self._config().z_loss)
    return ce_sum, batch['loss_mask'].sum()

  def _config(self) -> TrainConfig:
    return self.config if self.config is not None else TrainConfig()

  def _terms(self, model, h_BTD, targets_BT, mask_BT, z_loss):
    """``(ce_sum + z_loss * z_sum, ce_sum, z_sum)`` over the masked tokens.

    The head and loss are fused (:mod:`maxnnx.train.loss`) unless ``fused_loss=False``.
    """
    cfg, mc = self._config(), model.config
    if not cfg.fused_loss:
      ce_sum, z_sum = masked_cross_entropy(model.logits(h_BTD), targets_BT, mask_BT)
      return ce_sum + z_loss * z_sum, ce_sum, z_sum
    weight, vocab_major = model.head_weight()
    batch_size, length = targets_BT.shape
    chunk = cfg.loss_chunk_length or default_chunk_length(
        batch_size, length, mc.vocab_size,
        (32 if jax.default_backend() == 'cpu' else 1024) << 20)
    return chunked_head_cross_entropy(
        h_BTD, weight, targets_BT, mask_BT, vocab_major=vocab_major, chunk_length=chunk,
        z_loss=z_loss, softcap=mc.final_logit_softcap, dtype=mc.jnp_dtype('dtype'))


def _depth_targets(batch: dict, k: int) -> tuple[jax.Array, jax.Array]:
  """Targets and loss mask of MTP depth ``k`` for a batch dict."""
  return mtp_targets(batch['targets'], batch['loss_mask'], batch['segment_ids'],
                     batch['positions'], k)


__all__ = ['Objective', 'PretrainObjective']

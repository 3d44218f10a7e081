"""Knowledge distillation from a frozen teacher as a training objective.

::

  trainer = Trainer(student, train_config,
                    objective=DistillationObjective(teacher, temperature=2.0))

Per counted token (``loss_mask`` 1) the student's distribution
``q = softmax(student_logits / T)`` is pulled towards the teacher's
``p = softmax(teacher_logits / T)`` by one of

* ``forward_kl``: ``KL(p || q)`` (mean-seeking, the classic one);
* ``reverse_kl``: ``KL(q || p)`` (mode-seeking);
* ``jsd``: the generalised Jensen-Shannon divergence of TRL's GKD,
  ``beta KL(p || m) + (1 - beta) KL(q || m)`` with ``m = beta p + (1 - beta) q``
  (``beta`` = ``jsd_beta`` in ``(0, 1)``; 0.5 is the symmetric JSD),

multiplied by ``T^2`` so that gradient magnitudes do not shrink with the
temperature. With ``hard_label_weight = w`` the loss is ``(1 - w) * divergence
+ w * cross_entropy`` (the student's next-token cross-entropy on the batch's
targets, at temperature 1), each a mean over the counted tokens.

Both models' heads are applied one slice of the sequence at a time
(:func:`maxnnx.train.chunks.scan_chunks`): neither's ``[B, T, vocab]`` logits
are ever held at once. The two must share a vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.train.chunks import Head, chunk_length_for, scan_chunks, target_logps
from maxnnx.train.objectives import Objective

DIVERGENCES = ('forward_kl', 'reverse_kl', 'jsd')


def token_divergence(student_logits_BTV: jax.Array, teacher_logits_BTV: jax.Array, *,
                     divergence: str = 'forward_kl', temperature: float = 1.0,
                     jsd_beta: float = 0.5) -> jax.Array:
  """The per-token divergence ``[B, T]`` (float32) between the two models' distributions.

  Both logits are divided by ``temperature`` before the softmax and the result
  is scaled by ``temperature ** 2``; see the module docstring for the divergences.
  """
  if divergence not in DIVERGENCES:
    raise ValueError(f'divergence must be one of {DIVERGENCES}, got {divergence!r}.')
  log_q = jax.nn.log_softmax(student_logits_BTV.astype(jnp.float32) / temperature, axis=-1)
  log_p = jax.nn.log_softmax(teacher_logits_BTV.astype(jnp.float32) / temperature, axis=-1)
  if divergence == 'forward_kl':
    div_BT = _kl(log_p, log_q)
  elif divergence == 'reverse_kl':
    div_BT = _kl(log_q, log_p)
  else:
    log_m = jnp.logaddexp(jnp.log(jsd_beta) + log_p, jnp.log1p(-jsd_beta) + log_q)
    div_BT = jsd_beta * _kl(log_p, log_m) + (1.0 - jsd_beta) * _kl(log_q, log_m)
  return div_BT * temperature**2


def _kl(log_a, log_b):
  """``KL(a || b)`` over the last axis from log-probabilities."""
  return jnp.sum(jnp.exp(log_a) * (log_a - log_b), axis=-1)


def distillation_sums(student_x_BTD: jax.Array, student_head: Head, teacher_x_BTD: jax.Array,
                      teacher_head: Head, targets_BT: jax.Array, mask_BT: jax.Array, *,
                      chunk_length: int, divergence: str = 'forward_kl',
                      temperature: float = 1.0, jsd_beta: float = 0.5
                      ) -> tuple[jax.Array, jax.Array]:
  """``(divergence_sum, cross_entropy_sum)`` over the masked tokens, one slice at a time.

  Args:
    student_x_BTD, teacher_x_BTD: each model's final hidden states.
    student_head, teacher_head: each model's output head.
    targets_BT, mask_BT: next-token targets and the counted positions.
    chunk_length: positions per slice (must divide ``T``).
    divergence, temperature, jsd_beta: see :func:`token_divergence`.

  The teacher's side carries no gradient; the student's sums are differentiable
  in ``student_x_BTD`` and ``student_head.weight``.
  """
  teacher_x_BTD = jax.lax.stop_gradient(teacher_x_BTD)
  teacher_head = Head(jax.lax.stop_gradient(teacher_head.weight), teacher_head.vocab_major,
                      teacher_head.softcap, teacher_head.dtype)

  def slice_sums(student_x_BCD, teacher_x_BCD, targets_BC, mask_BC):
    student_BCV = student_head.logits(student_x_BCD)
    teacher_BCV = teacher_head.logits(teacher_x_BCD)
    div_BC = token_divergence(student_BCV, teacher_BCV, divergence=divergence,
                              temperature=temperature, jsd_beta=jsd_beta)
    ce_BC = -target_logps(student_BCV, targets_BC)
    return jnp.sum(div_BC * mask_BC), jnp.sum(ce_BC * mask_BC)

  return scan_chunks(slice_sums, (student_x_BTD, teacher_x_BTD, targets_BT,
                                  mask_BT.astype(jnp.float32)), chunk_length)


class DistillationObjective(Objective):
  """Distil a frozen teacher (``frozen['teacher']``) into the trained student.

  Args:
    teacher: the teacher model (a ``maxnnx.Transformer`` with the student's
      vocabulary); the Trainer places it on its mesh and never trains it.
    temperature: the softmax temperature ``T`` of both distributions (> 0).
    divergence: ``'forward_kl'``, ``'reverse_kl'`` or ``'jsd'``.
    jsd_beta: the mixture weight of the teacher in ``jsd``, in ``(0, 1)``.
    hard_label_weight: weight ``w`` of the next-token cross-entropy; the loss is
      ``(1 - w) * divergence + w * cross_entropy``.
    chunk_length: sequence positions per head slice; ``None`` picks one that
      keeps a slice's logits (two of them) small.

  Metrics: ``loss`` (the mixed loss per token), ``distill_loss`` (the divergence
  per token, times ``T^2``) and ``ce_loss`` (the student's cross-entropy per token).
  """

  def __init__(self, teacher: nnx.Module, temperature: float = 1.0,
               divergence: str = 'forward_kl', jsd_beta: float = 0.5,
               hard_label_weight: float = 0.0, *, chunk_length: int | None = None):
    if divergence not in DIVERGENCES:
      raise ValueError(f'divergence must be one of {DIVERGENCES}, got {divergence!r}.')
    if temperature <= 0:
      raise ValueError(f'temperature must be positive, got {temperature}.')
    if divergence == 'jsd' and not 0.0 < jsd_beta < 1.0:
      raise ValueError(f"jsd_beta must be in (0, 1), got {jsd_beta}; use 'forward_kl' or "
                       "'reverse_kl' for the ends.")
    if not 0.0 <= hard_label_weight <= 1.0:
      raise ValueError(f'hard_label_weight must be in [0, 1], got {hard_label_weight}.')
    self.teacher, self.temperature, self.divergence = teacher, float(temperature), divergence
    self.jsd_beta, self.hard_label_weight = float(jsd_beta), float(hard_label_weight)
    self.chunk_length = chunk_length
    self.frozen_models = {'teacher': teacher}

  def loss(self, model, batch, *, frozen, norm):
    """Mixed loss of this micro-batch's share of the batch's tokens, and metric sums."""
    div_sum, ce_sum = self._sums(model, batch, frozen)
    tokens = norm['tokens']
    w = self.hard_label_weight
    loss = ((1.0 - w) * div_sum + w * ce_sum) / tokens
    return loss, {'loss': loss, 'distill_loss': div_sum / tokens,
                  'ce_loss': jax.lax.stop_gradient(ce_sum) / tokens}

  def eval_loss(self, model, batch, *, frozen):
    """``(summed mixed loss, counted tokens)`` of a held-out batch."""
    div_sum, ce_sum = self._sums(model, batch, frozen)
    w = self.hard_label_weight
    return (1.0 - w) * div_sum + w * ce_sum, batch['loss_mask'].sum()

  def _sums(self, model, batch, frozen):
    teacher = frozen['teacher']
    student_vocab, teacher_vocab = model.config.vocab_size, teacher.config.vocab_size
    if student_vocab != teacher_vocab:
      raise ValueError(f'Distillation needs a shared vocabulary: the student has vocab_size='
                       f'{student_vocab}, the teacher vocab_size={teacher_vocab}.')
    kwargs = dict(segment_ids=batch['segment_ids'], positions=batch['positions'])
    student_x_BTD = model.hidden_states(batch['inputs'], **kwargs)
    teacher_x_BTD = teacher.hidden_states(batch['inputs'], **kwargs)
    batch_size, length = batch['targets'].shape
    chunk = chunk_length_for(batch_size, length, student_vocab, copies=2,
                             requested=self.chunk_length)
    return distillation_sums(student_x_BTD, Head.of(model), teacher_x_BTD, Head.of(teacher),
                             batch['targets'], batch['loss_mask'], chunk_length=chunk,
                             divergence=self.divergence, temperature=self.temperature,
                             jsd_beta=self.jsd_beta)


__all__ = ['DIVERGENCES', 'DistillationObjective', 'distillation_sums', 'token_divergence']

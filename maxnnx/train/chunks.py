"""Per-slice output-head computations that never hold the full ``[B, T, vocab]`` logits.

The fine-tuning objectives (:mod:`maxnnx.train.preference`,
:mod:`maxnnx.train.distillation`) need more than the summed cross-entropy of
:mod:`maxnnx.train.loss`: per-sequence log-probabilities, or a divergence
between two models' distributions. :func:`scan_chunks` walks the sequence in
slices of ``chunk_length`` positions, applies a function to each slice's
hidden states (which forms that slice's ``[B, C, vocab]`` logits with
:meth:`Head.logits`) and sums the results. The per-slice function is
rematerialised (``jax.checkpoint``), so the backward pass recomputes one
slice's logits at a time instead of keeping every slice's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.train.loss import default_chunk_length


@dataclasses.dataclass(frozen=True)
class Head:
  """An output head: its weight, layout, final soft-cap and matmul dtype.

  Attributes:
    weight: ``[vocab, d_model]`` when ``vocab_major`` (tied embeddings), else
      ``[d_model, vocab]`` (an ``lm_head`` kernel).
    vocab_major: the weight's layout.
    softcap: ``cap * tanh(logits / cap)`` on the logits (Gemma 2), or ``None``.
    dtype: the matmul input dtype (accumulation is float32).
  """

  weight: jax.Array
  vocab_major: bool
  softcap: float | None = None
  dtype: Any = jnp.float32

  @classmethod
  def of(cls, model: nnx.Module) -> Head:
    """The head of a ``maxnnx.Transformer`` (``head_weight()`` and its config)."""
    weight, vocab_major = model.head_weight()
    cfg = model.config
    return cls(weight, vocab_major, cfg.final_logit_softcap, cfg.jnp_dtype('dtype'))

  def logits(self, x_BCD: jax.Array) -> jax.Array:
    """Float32 logits ``[B, C, vocab]`` of hidden states ``[B, C, d_model]``."""
    spec = 'bcd,vd->bcv' if self.vocab_major else 'bcd,dv->bcv'
    logits_BCV = jnp.einsum(spec, x_BCD.astype(self.dtype), self.weight.astype(self.dtype),
                            preferred_element_type=jnp.float32)
    if self.softcap is not None:
      logits_BCV = self.softcap * jnp.tanh(logits_BCV / self.softcap)
    return logits_BCV


def chunk_length_for(batch: int, seq_len: int, vocab_size: int, *, copies: int = 1,
                     requested: int | None = None) -> int:
  """``requested``, or the longest slice whose ``copies`` float32 ``[batch, chunk, vocab]``
  logits fit in 32 MiB on CPU (1 GiB on accelerators)."""
  if requested:
    return requested
  budget = (32 if jax.default_backend() == 'cpu' else 1024) << 20
  return default_chunk_length(batch, seq_len, vocab_size, budget // max(copies, 1))


def scan_chunks(fn: Callable[..., Any], arrays: tuple[jax.Array, ...], chunk_length: int) -> Any:
  """``sum over slices s of fn(*[a[:, s] for a in arrays])``.

  Args:
    fn: maps ``[B, C, ...]`` slices of ``arrays`` to a pytree of arrays (per-row
      ``[B]`` sums, scalars), which are added up over the slices. It may close
      over weights; gradients flow to them and to ``arrays``.
    arrays: ``[B, T, ...]`` arrays sliced along their second axis.
    chunk_length: positions per slice; must divide ``T``.
  """
  length = arrays[0].shape[1]
  if length % chunk_length:
    raise ValueError(f'chunk_length={chunk_length} must divide the sequence length {length}.')
  slices = tuple(_slices(a, chunk_length) for a in arrays)
  body = jax.checkpoint(fn)
  first = jax.eval_shape(body, *(s[0] for s in slices))
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first)

  def step(acc, xs):
    return jax.tree.map(jnp.add, acc, body(*xs)), None

  total, _ = jax.lax.scan(step, zeros, slices)
  return total


def map_chunks(fn: Callable[..., Any], arrays: tuple[jax.Array, ...], chunk_length: int) -> Any:
  """``fn`` applied slice by slice, outputs put back along the sequence.

  Like :func:`scan_chunks`, but ``fn`` maps ``[B, C, ...]`` slices to ``[B, C, ...]``
  arrays (per-position values: log-probs, entropies) and the result is their
  ``[B, T, ...]`` concatenation. The per-slice function is rematerialised, so the
  backward pass holds one slice's logits at a time.
  """
  length = arrays[0].shape[1]
  if length % chunk_length:
    raise ValueError(f'chunk_length={chunk_length} must divide the sequence length {length}.')
  slices = tuple(_slices(a, chunk_length) for a in arrays)
  body = jax.checkpoint(fn)
  _, stacked = jax.lax.scan(lambda carry, xs: (carry, body(*xs)), None, slices)
  return jax.tree.map(lambda s: jnp.moveaxis(s, 0, 1).reshape(s.shape[1], length,
                                                              *s.shape[3:]), stacked)


def token_logps(x_BTD: jax.Array, head: Head, targets_BT: jax.Array, *, chunk_length: int,
                temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """``(logps_BT, entropy_BT)``: ``log p(target)`` at every position and the entropy of
  each position's distribution, under ``softmax(logits / temperature)``, in float32.

  The log-probs are differentiable (in ``x_BTD`` and ``head.weight``); the entropy
  is not (a metric). The head is applied one slice at a time (:func:`map_chunks`).
  """

  def slice_terms(x_BCD, targets_BC):
    logits_BCV = head.logits(x_BCD) / temperature
    logps_BCV = jax.nn.log_softmax(logits_BCV, axis=-1)
    entropy_BC = -jnp.sum(jnp.exp(logps_BCV) * logps_BCV, axis=-1)
    hit_BCV = jnp.arange(logits_BCV.shape[-1]) == targets_BC[..., None]  # no gather: the
    picked_BC = jnp.sum(jnp.where(hit_BCV, logps_BCV, 0.0), axis=-1)   # vocab may be sharded
    return picked_BC, jax.lax.stop_gradient(entropy_BC)

  return map_chunks(slice_terms, (x_BTD, targets_BT), chunk_length)


def target_logps(logits_BCV: jax.Array, targets_BC: jax.Array) -> jax.Array:
  """``log softmax(logits)[target]`` per position, ``[B, C]`` in float32."""
  lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
  hit_BCV = jnp.arange(logits_BCV.shape[-1]) == targets_BC[..., None]
  return jnp.sum(jnp.where(hit_BCV, logits_BCV, 0.0), axis=-1) - lse_BC


def sequence_logps(x_BTD: jax.Array, head: Head, targets_BT: jax.Array, mask_BT: jax.Array, *,
                   chunk_length: int) -> jax.Array:
  """Per-row sum of ``log p(target)`` over the masked positions: ``[B]`` float32.

  The head is applied one slice of ``chunk_length`` positions at a time
  (see :func:`scan_chunks`); the result is differentiable in ``x_BTD`` and
  ``head.weight``.
  """

  def slice_logps(x_BCD, targets_BC, mask_BC):
    return jnp.sum(target_logps(head.logits(x_BCD), targets_BC) * mask_BC, axis=-1)

  return scan_chunks(slice_logps, (x_BTD, targets_BT, mask_BT.astype(jnp.float32)),
                     chunk_length)


def model_sequence_logps(model: nnx.Module, batch: dict[str, jax.Array], *,
                         chunk_length: int | None = None) -> jax.Array:
  """:func:`sequence_logps` of a ``maxnnx.Transformer`` on a batch dict: ``[B]`` float32."""
  x_BTD = model.hidden_states(batch['inputs'], segment_ids=batch['segment_ids'],
                              positions=batch['positions'])
  batch_size, length = batch['targets'].shape
  chunk = chunk_length_for(batch_size, length, model.config.vocab_size, requested=chunk_length)
  return sequence_logps(x_BTD, Head.of(model), batch['targets'], batch['loss_mask'],
                        chunk_length=chunk)


def _slices(a: jax.Array, chunk_length: int) -> jax.Array:
  """``[B, T, ...] -> [T / chunk, B, chunk, ...]``."""
  batch, length = a.shape[:2]
  a = a.reshape(batch, length // chunk_length, chunk_length, *a.shape[2:])
  return jnp.moveaxis(a, 1, 0)


__all__ = ['Head', 'chunk_length_for', 'map_chunks', 'model_sequence_logps', 'scan_chunks',
           'sequence_logps', 'target_logps', 'token_logps']

"""Residual dropout that is on in the train step only.

``ModelConfig.dropout_rate`` drops the embeddings and each decoder layer's attention
and MLP outputs before they join the residual stream (GPT-2/3's ``resid_pdrop`` and
``embd_pdrop``, MaxText's ``dropout_rate``). Masks are drawn only inside
:func:`dropout_key`, which the Trainer's train step enters with a key of
``TrainConfig.seed``, the step and the micro-batch; evaluation, generation and
serving never drop. Each decoder layer carries a :class:`DropoutSeed` (its index
over the whole model, with a leading ``layers`` axis when scanned) that the step's
key is folded with, so every layer draws its own masks and a scanned, looped or
pipelined stack draws the same ones.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

_KEY: contextvars.ContextVar = contextvars.ContextVar('dropout_key', default=None)
EMBEDDING_SEED = 1 << 20  # the embeddings' masks, apart from every layer's
ATTENTION, MLP = 0, 1  # the two sites of a decoder layer


class DropoutSeed(nnx.Variable):
  """A decoder layer's index over the whole model (one per layer of a scanned stack), which
  the step's dropout key is folded with. Not trained."""


@contextlib.contextmanager
def dropout_key(key: jax.Array):
  """While tracing inside this context, models with ``dropout_rate > 0`` drop; ``key`` (a
  ``jax.random.key``, usually traced) is the step's."""
  token = _KEY.set(key)
  try:
    yield
  finally:
    _KEY.reset(token)


def dropout(x: jax.Array, rate: float, seed, site: int = 0) -> jax.Array:
  """``x`` with each value zeroed with probability ``rate`` and the rest scaled by
  ``1 / (1 - rate)``, inside :func:`dropout_key` only (else ``x`` unchanged). ``seed`` and
  ``site`` tell the masks of layers and of places within a layer apart."""
  key = _KEY.get()
  if key is None or rate <= 0.0:
    return x
  key = jax.random.fold_in(jax.random.fold_in(key, seed), site)
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)


__all__ = ['DropoutSeed', 'dropout', 'dropout_key']

"""Adapter dropout (PEFT's ``lora_dropout``) that is on in the train step and off elsewhere.

An adapted projection computes ``x W + (alpha / rank) dropout(x) A B``: the
dropout falls on the adapter's input only, never on the base matmul. qwix's
``LoraRule(dropout=...)`` does the dropping; left to itself it would drop on
every call (generation and evaluation included) and draw its masks from an
``nnx.Rngs`` held by each module. Here instead:

* the masks are drawn only inside :func:`adapter_dropout` (which the Trainer's
  train step enters with a key made of ``TrainConfig.seed``, the step and the
  micro-batch), so evaluation, generation, serving and a DPO reference never
  drop anything;
* each adapted module carries a :class:`LoraDropoutSeed`, one distinct integer
  per module and per layer of a scanned stack (a leading ``layers`` axis like
  the kernel's), which the step's key is folded with: every layer draws its own
  mask, and a resumed run draws the same masks as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

_STEP_KEY: contextvars.ContextVar = contextvars.ContextVar('lora_dropout_key', default=None)


class LoraDropoutSeed(nnx.Variable):
  """Integers that tell an adapted module's dropout masks apart: a scalar, or one per layer of a
  scanned stack. Not trained; the step's dropout key is folded with them."""


@contextlib.contextmanager
def adapter_dropout(key: jax.Array):
  """While tracing inside this context, adapters with ``LoraConfig.dropout > 0`` drop their input.

  ``key`` (a ``jax.random.key``, usually traced) is the step's; each module folds
  in its :class:`LoraDropoutSeed`. Outside the context adapters never drop.
  """
  token = _STEP_KEY.set(key)
  try:
    yield
  finally:
    _STEP_KEY.reset(token)


def add_dropout_seeds(modules, lead_shapes) -> None:
  """Give each adapted module its :class:`LoraDropoutSeed` (``modules[i]`` gets the
  integers ``i * 2**16 + layer``), with the kernel's leading sharding names."""
  for i, (module, lead_shape) in enumerate(zip(modules, lead_shapes)):
    count = lead_shape[0] if lead_shape else 1
    seeds = (i << 16) + jnp.arange(count, dtype=jnp.uint32)
    names = tuple(module.kernel.get_metadata().get('out_sharding') or (None,) * len(lead_shape))
    module.lora_dropout_seed = LoraDropoutSeed(
      seeds.reshape(lead_shape), out_sharding=names[:len(lead_shape)], eager_sharding=False)


def switched_provider(rules):
  """qwix's ``LoraProvider`` for ``rules`` whose dropout runs only under :func:`adapter_dropout`."""
  import qwix  # noqa: PLC0415 (imported on first use, like the rest of the LoRA code)
  from qwix._src.utils import flax_util  # noqa: PLC0415 (how qwix finds the calling module)

  class SwitchedDropoutLoraProvider(qwix.LoraProvider):
    """Drops the adapters' input only inside :func:`adapter_dropout`, with the module's seed."""

    def _get_current_rule_and_op_id(self, op_name, **kwargs):
      rule, op_id = super()._get_current_rule_and_op_id(op_name, **kwargs)
      if isinstance(rule, qwix.LoraRule) and rule.dropout > 0:
        module = flax_util.get_current_module()
        key = _STEP_KEY.get()
        seed = getattr(module, 'lora_dropout_seed', None)
        if key is None or seed is None:
          rule = dataclasses.replace(rule, dropout=0.0)
        else:
          # qwix draws the mask from ``module.qwix_rngs['dropout']``. The stream is made here,
          # at this trace level, and set past nnx's attribute bookkeeping: it is never part of
          # the module's state, and dot_general below takes it away again.
          rngs = nnx.Rngs(dropout=jax.random.fold_in(key, seed[...]))
          object.__setattr__(module, 'qwix_rngs', rngs)
      return rule, op_id

    def dot_general(self, *args, **kwargs):
      try:
        return super().dot_general(*args, **kwargs)
      finally:
        module = flax_util.get_current_module()
        if isinstance(getattr(module, 'qwix_rngs', None), nnx.Rngs):
          object.__setattr__(module, 'qwix_rngs', None)

  return SwitchedDropoutLoraProvider(rules)


__all__ = ['LoraDropoutSeed', 'add_dropout_seeds', 'adapter_dropout', 'switched_provider']

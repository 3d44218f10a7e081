"""Attention kernels behind one interface, registered by name.

A kernel takes projected, rotated ``q``/``k``/``v``, an
:class:`~maxnnx.kernels.masks.AttentionMask` and the call's
:class:`~maxnnx.kernels.options.AttentionOptions` and returns the attention
output.
``xla`` (plain einsum + softmax) supports every feature and runs everywhere; it
is the reference and the fallback. Other strategies declare what they support
(:class:`~maxnnx.kernels.capabilities.AttentionCapabilities`) and register
themselves under their own names; a call they cannot serve is refused or sent
to ``xla`` as their ``on_unsupported`` policy says (see
:mod:`maxnnx.kernels.capabilities`).
"""

import abc
import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp

from maxnnx.kernels.capabilities import (
  ALL_PLATFORMS,
  FLOAT_DTYPES,
  AttentionCapabilities,
  AttentionRequest,
  KernelStrategy,
  lookup_kernel,
)
from maxnnx.kernels.masks import AttentionMask
from maxnnx.kernels.options import AttentionOptions


@dataclasses.dataclass(frozen=True)
class AttentionKernel(KernelStrategy):
  """Base class of attention strategies; instances are stateless and hashable.

  A strategy declares :attr:`capabilities` and implements :meth:`attend`;
  ``__call__`` checks each call against the capabilities first and applies the
  ``on_unsupported`` policy (``fallback`` to ``xla`` with a warning logged once,
  or ``error``) when the strategy cannot serve it.
  """

  kind: ClassVar[str] = 'attention'

  def __call__(self, q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
               mask: AttentionMask, options: AttentionOptions) -> jax.Array:
    """Attention output ``[B, T, heads, v_head_dim]``.

    ``options`` carries the scale and the optional features (soft-cap, sliding
    window, sinks). Query rows that see no key at all (padding) have
    unspecified output.
    """
    return self.run_checked(AttentionRequest.of(q_BTNH, k_BSKH, v_BSKH, options, mask),
                            self.attend, XlaAttention().attend,
                            q_BTNH, k_BSKH, v_BSKH, mask, options)

  @abc.abstractmethod
  def attend(self, q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
             mask: AttentionMask, options: AttentionOptions) -> jax.Array:
    """Compute attention for a call already checked against the capabilities."""

  def attend_and_max_logits(self, q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                            mask: AttentionMask, options: AttentionOptions
                            ) -> tuple[jax.Array, jax.Array | None]:
    """``__call__``'s output and each head's largest visible logit ``scale * q . k`` (before
    any soft-cap; ``[heads]`` float32, no gradient, ``-inf`` for a head that sees no key),
    for QK-clip. ``None`` in its place where the strategy does not track it as it attends
    (this default): the caller then computes it over the dense mask.
    """
    return self(q_BTNH, k_BSKH, v_BSKH, mask, options), None


@dataclasses.dataclass(frozen=True)
class XlaAttention(AttentionKernel):
  """Reference attention: scores in float32, dense boolean mask, softmax.

  Supports grouped heads (GQA/MQA), soft-capping, sliding windows (also traced
  per-layer windows), attention sinks, a ``v`` head size different from the
  ``q``/``k`` one, and any segment/position mask. Query rows that see no key
  get the mean of all values.
  """

  name: str = 'xla'

  @property
  def capabilities(self) -> AttentionCapabilities:
    """Everything, everywhere."""
    return AttentionCapabilities(
        platforms=ALL_PLATFORMS, dtypes=FLOAT_DTYPES, gqa=True, masking='positions',
        decode=True, sliding_window=True, traced_window=True, softcap=True, sinks=True,
        distinct_v_head_dim=True, chunked=True, key_mask=True, blocks=True)

  def attend(self, q_BTNH, k_BSKH, v_BSKH, mask, options):
    """Einsum scores, mask, softmax (with sinks), einsum values."""
    scale, softcap, sinks_N = options.scale, options.softcap, options.sinks_N
    batch, length, num_heads, head_dim = q_BTNH.shape
    num_kv_heads = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum('btkgh,bskh->bkgts', q_BTKGH, k_BSKH,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:
      scores = softcap * jnp.tanh(scores / softcap)
    allowed_BTS = options.visible(mask)
    scores = jnp.where(allowed_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if sinks_N is None:
      probs = jax.nn.softmax(scores, axis=-1)
    else:
      sinks_KG11 = sinks_N.astype(jnp.float32).reshape(num_kv_heads, -1, 1, 1)
      sinks = jnp.broadcast_to(sinks_KG11, scores.shape[:-1] + (1,))
      probs = jax.nn.softmax(jnp.concatenate([scores, sinks], axis=-1), axis=-1)[..., :-1]
    probs = probs.astype(v_BSKH.dtype)
    out = jnp.einsum('bkgts,bskh->btkgh', probs, v_BSKH,
                     preferred_element_type=jnp.float32).astype(v_BSKH.dtype)
    return out.reshape(batch, length, num_heads, v_BSKH.shape[-1])


ATTENTION_IMPLEMENTATIONS: dict[str, Callable[[], AttentionKernel]] = {'xla': XlaAttention}


def register_attention_kernel(name: str, factory: Callable[[], AttentionKernel]) -> None:
  """Make ``factory`` available as ``ModelConfig.attention_impl = name``."""
  ATTENTION_IMPLEMENTATIONS[name] = factory


def get_attention_kernel(name: str, *, on_unsupported: str | None = None) -> AttentionKernel:
  """The kernel registered as ``name``; a clear error lists the known ones.

  ``on_unsupported`` (``fallback`` or ``error``) overrides the strategy's policy.
  """
  return lookup_kernel(ATTENTION_IMPLEMENTATIONS, 'attention', name, on_unsupported)

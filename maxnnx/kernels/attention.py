"""Attention kernels behind one interface, registered by name.

A kernel takes projected, rotated ``q``/``k``/``v`` and an
:class:`~maxnnx.kernels.masks.AttentionMask` and returns the attention output.
``xla`` (plain einsum + softmax) supports every feature and runs everywhere;
other strategies register themselves under their own names.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from maxnnx.kernels.masks import AttentionMask


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
  """Base class of attention strategies; instances are stateless and hashable."""

  name: str = 'base'

  def __call__(self, q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
               mask: AttentionMask, *, scale: float, softcap: float | None,
               sliding_window: int | jax.Array | None,
               sinks_N: jax.Array | None = None) -> jax.Array:
    """Attention output ``[B, T, heads, head_dim]``.

    ``sinks_N`` (GPT-OSS) is one learned logit per query head that joins every
    softmax as an extra, value-less key.
    """
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class XlaAttention(AttentionKernel):
  """Reference attention: scores in float32, dense boolean mask, softmax.

  Supports grouped heads (GQA/MQA), soft-capping, sliding windows (also traced
  per-layer windows), attention sinks and any segment/position mask.
  """

  name: str = 'xla'

  def __call__(self, q_BTNH, k_BSKH, v_BSKH, mask, *, scale, softcap, sliding_window,
               sinks_N=None):
    batch, length, num_heads, head_dim = q_BTNH.shape
    num_kv_heads = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum('btkgh,bskh->bkgts', q_BTKGH, k_BSKH,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:
      scores = softcap * jnp.tanh(scores / softcap)
    allowed_BTS = mask.dense(sliding_window)
    scores = jnp.where(allowed_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if sinks_N is None:
      probs = jax.nn.softmax(scores, axis=-1)
    else:
      sinks_KG11 = sinks_N.astype(jnp.float32).reshape(num_kv_heads, -1, 1, 1)
      sinks = jnp.broadcast_to(sinks_KG11, scores.shape[:-1] + (1,))
      probs = jax.nn.softmax(jnp.concatenate([scores, sinks], axis=-1), axis=-1)[..., :-1]
    probs = probs.astype(v_BSKH.dtype)
    out = jnp.einsum('bkgts,bskh->btkgh', probs, v_BSKH)
    return out.reshape(batch, length, num_heads, head_dim)


ATTENTION_IMPLEMENTATIONS: dict[str, Callable[[], AttentionKernel]] = {'xla': XlaAttention}


def register_attention_kernel(name: str, factory: Callable[[], AttentionKernel]) -> None:
  """Make ``factory`` available as ``ModelConfig.attention_impl = name``."""
  ATTENTION_IMPLEMENTATIONS[name] = factory


def get_attention_kernel(name: str) -> AttentionKernel:
  """The kernel registered as ``name``; a clear error lists the known ones."""
  if name not in ATTENTION_IMPLEMENTATIONS:
    known = ', '.join(sorted(ATTENTION_IMPLEMENTATIONS))
    raise ValueError(f"Unknown attention_impl '{name}'. Known implementations: {known}.")
  return ATTENTION_IMPLEMENTATIONS[name]()

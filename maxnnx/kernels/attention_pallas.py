"""The Pallas (Triton) flash-attention kernel of ``jax.experimental.pallas.ops.gpu``.

``pallas_gpu`` runs ``attention.mha``: a fused, memory-linear forward and
backward on NVIDIA GPUs. The kernel knows one segment-id row shared by queries
and keys and applies causality by index, so it serves self-attention only (no
decode step), without sliding windows, soft-capping or sinks. Grouped key/value
heads are repeated to the query heads before the call.

Causality by index equals the mask's causality by position only when, in each
row, segment ids never decrease along the non-padding tokens and positions
increase inside each segment (plain, packed and left-padded batches). The
kernel checks this at run time and computes with ``xla`` (logging a warning
once) when it does not hold, so the answer is never wrong.

``interpret=True`` runs the same kernel in the Pallas interpreter on any
platform (slow; for tests of this wrapper).
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp

from maxnnx.kernels.attention import AttentionKernel, XlaAttention, register_attention_kernel
from maxnnx.kernels.capabilities import (
  ALL_PLATFORMS,
  FLOAT_DTYPES,
  AttentionCapabilities,
  warn_once,
)
from maxnnx.kernels.masks import index_order_matches_positions

#: The kernel's default forward block; backward blocks are 32.
_BLOCK = 128


def _warn_runtime_fallback(name: str) -> None:
  warn_once(('attention', name, 'runtime'),
            f"attention_impl '{name}': segment ids/positions are not in index order in some "
            "row; such calls are computed with 'xla'.")


@dataclasses.dataclass(frozen=True)
class PallasFlashAttention(AttentionKernel):
  """Pallas/Triton flash attention for GPU self-attention (training and prefill).

  Attributes:
    interpret: run in the Pallas interpreter (any platform, slow).
  """

  name: str = 'pallas_gpu'
  interpret: bool = False

  @property
  def capabilities(self) -> AttentionCapabilities:
    """Self-attention with segment ids, causal by index; GPU (or interpreter)."""
    return AttentionCapabilities(
        platforms=ALL_PLATFORMS if self.interpret else ('gpu',), dtypes=FLOAT_DTYPES,
        gqa=True, masking='index_causal', decode=False, sliding_window=False,
        traced_window=False, softcap=False, sinks=False, distinct_v_head_dim=False,
        chunked=False, key_mask=False)

  def unsupported_reasons(self, request):
    """The declared limits, and the kernel's block tiling of the sequence."""
    reasons = self.capabilities.missing(request)
    length = request.q_length
    if not (length % _BLOCK == 0 or (length < _BLOCK and length & (length - 1) == 0)):
      reasons.append(f'sequence length {length} must be a power of two below {_BLOCK} or a '
                     f'multiple of {_BLOCK}')
    return reasons

  def attend(self, q_BTNH, k_BSKH, v_BSKH, mask, options):
    """Repeat kv heads, run ``mha`` with segment ids; ``xla`` when index order differs."""
    scale = options.scale  # window, soft-cap and sinks are refused by the capability check
    with warnings.catch_warnings():
      # jax 0.12 deprecates this module for tokamax's Triton kernel, which maxnnx offers as
      # ``tokamax_triton``; this strategy stays while jax ships it, as the one Triton flash
      # kernel with an interpret mode (its tests run on CPU).
      warnings.filterwarnings('ignore', 'jax.experimental.pallas.ops.gpu.attention is deprecated',
                              DeprecationWarning)
      from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    groups = q_BTNH.shape[2] // k_BSKH.shape[2]

    def flash(q, k, v):
      k_BSNH, v_BSNH = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
      return pallas_attention.mha(q, k_BSNH, v_BSNH, mask.q_segment_ids, sm_scale=scale,
                                  causal=True, interpret=self.interpret)

    def reference(q, k, v):
      jax.debug.callback(_warn_runtime_fallback, self.name)
      return XlaAttention().attend(q, k, v, mask, options)

    return jax.lax.cond(index_order_matches_positions(mask), flash, reference,
                        q_BTNH, k_BSKH, v_BSKH)


register_attention_kernel('pallas_gpu', PallasFlashAttention)

"""``jax.nn.dot_product_attention`` as an attention strategy (``jax_nn`` and ``cudnn``).

The whole :class:`~maxnnx.kernels.masks.AttentionMask` (segments, positions,
sliding window, also a traced one) is passed as a dense boolean mask, so every
mask is honoured exactly; cuDNN turns it into an additive bias. Neither
implementation has soft-capping or sinks, and both need one head size for
``q``, ``k`` and ``v``.
"""

import dataclasses

import jax

from maxnnx.kernels.attention import AttentionKernel, register_attention_kernel
from maxnnx.kernels.capabilities import ALL_PLATFORMS, FLOAT_DTYPES, AttentionCapabilities


@dataclasses.dataclass(frozen=True)
class JaxNnAttention(AttentionKernel):
  """``jax.nn.dot_product_attention`` with ``implementation`` ``xla`` or ``cudnn``.

  Attributes:
    implementation: ``xla`` (everywhere) or ``cudnn`` (NVIDIA GPUs, bf16/f16).
  """

  name: str = 'jax_nn'
  implementation: str = 'xla'

  @property
  def capabilities(self) -> AttentionCapabilities:
    """Dense-mask attention without soft-cap or sinks; cuDNN only on GPU in bf16/f16."""
    cudnn = self.implementation == 'cudnn'
    return AttentionCapabilities(
        platforms=('gpu',) if cudnn else ALL_PLATFORMS,
        dtypes=('bfloat16', 'float16') if cudnn else FLOAT_DTYPES,
        gqa=True, masking='positions', decode=True, sliding_window=True, traced_window=True,
        softcap=False, sinks=False, distinct_v_head_dim=False, chunked=True, key_mask=True,
        blocks=True)

  def attend(self, q_BTNH, k_BSKH, v_BSKH, mask, options):
    """One ``jax.nn.dot_product_attention`` call with the mask as ``[B, 1, T, S]``."""
    allowed_B1TS = options.visible(mask)[:, None]
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=allowed_B1TS,
                                        scale=options.scale, implementation=self.implementation)


register_attention_kernel('jax_nn', JaxNnAttention)
register_attention_kernel('cudnn', lambda: JaxNnAttention(name='cudnn', implementation='cudnn'))

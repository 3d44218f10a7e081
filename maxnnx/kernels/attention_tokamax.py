"""``tokamax.dot_product_attention`` as attention strategies.

``tokamax`` tries tokamax's implementations in order (``mosaic``, ``triton``,
``xla``) like tokamax's own default, but logs (once, as a warning on
``maxnnx.kernels``) every implementation that could not run, so a silent drop
to XLA on an unsupported platform is visible; ``tokamax_<impl>`` pins one
implementation. The mask is passed dense (``[B, 1, T, S]`` booleans), so every
:class:`~maxnnx.kernels.masks.AttentionMask` is honoured exactly. tokamax is
imported on first use, so ``import maxnnx`` stays quick and works without it.
"""

import dataclasses
from typing import ClassVar

from maxnnx.kernels.attention import AttentionKernel, register_attention_kernel
from maxnnx.kernels.capabilities import (
  ALL_PLATFORMS,
  FLOAT_DTYPES,
  AttentionCapabilities,
  TokamaxStrategy,
  import_tokamax,
)

#: Platforms of each tokamax attention implementation.
TOKAMAX_ATTENTION_PLATFORMS = {
    'mosaic': ('gpu', 'tpu'), 'triton': ('gpu',), 'cudnn': ('gpu',), 'xla': ALL_PLATFORMS,
    'xla_chunked': ALL_PLATFORMS}


@dataclasses.dataclass(frozen=True)
class TokamaxAttention(TokamaxStrategy, AttentionKernel):
  """``tokamax.dot_product_attention`` over ``implementations`` (see
  :class:`~maxnnx.kernels.capabilities.TokamaxStrategy`), first that runs wins."""

  PLATFORMS: ClassVar[dict[str, tuple[str, ...]]] = TOKAMAX_ATTENTION_PLATFORMS

  @property
  def capabilities(self) -> AttentionCapabilities:
    """Dense-mask attention with soft-cap, no sinks; platforms of its implementations."""
    only_cudnn = self.implementations == ('cudnn',)
    return AttentionCapabilities(
        platforms=self.platforms, dtypes=('bfloat16', 'float16') if only_cudnn else FLOAT_DTYPES,
        gqa=True, masking='positions', decode=True, sliding_window=True, traced_window=True,
        softcap=not only_cudnn, sinks=False, distinct_v_head_dim=not only_cudnn,
        chunked=True, key_mask=True, blocks=True)

  def attend(self, q_BTNH, k_BSKH, v_BSKH, mask, options):
    """Try each implementation; log the ones that refuse; raise if all refuse."""
    tokamax = import_tokamax()  # sinks are refused by the capability check
    allowed_B1TS = options.visible(mask)[:, None]
    return self.run_first(
        lambda impl: tokamax.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=allowed_B1TS,
                                                   scale=options.scale,
                                                   logits_soft_cap=options.softcap,
                                                   implementation=impl))


register_attention_kernel('tokamax', TokamaxAttention)
for _impl in TOKAMAX_ATTENTION_PLATFORMS:
  register_attention_kernel(
      f'tokamax_{_impl}',
      lambda impl=_impl: TokamaxAttention(name=f'tokamax_{impl}', implementations=(impl,)))

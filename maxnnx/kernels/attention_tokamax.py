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

from maxnnx.kernels.attention import AttentionKernel, register_attention_kernel
from maxnnx.kernels.capabilities import (
  ALL_PLATFORMS,
  FLOAT_DTYPES,
  AttentionCapabilities,
  import_tokamax,
  run_first_tokamax,
  tokamax_missing,
)

#: Platforms of each tokamax attention implementation.
TOKAMAX_ATTENTION_PLATFORMS = {
    'mosaic': ('gpu', 'tpu'), 'triton': ('gpu',), 'cudnn': ('gpu',), 'xla': ALL_PLATFORMS,
    'xla_chunked': ALL_PLATFORMS}
#: The order ``tokamax`` tries them in (tokamax's own default order).
TOKAMAX_DEFAULT_ORDER = ('mosaic', 'triton', 'xla')


@dataclasses.dataclass(frozen=True)
class TokamaxAttention(AttentionKernel):
  """``tokamax.dot_product_attention`` over ``implementations``, first that runs wins.

  Attributes:
    implementations: tokamax implementation names, tried in order.
  """

  name: str = 'tokamax'
  implementations: tuple[str, ...] = TOKAMAX_DEFAULT_ORDER

  def __post_init__(self):
    super().__post_init__()
    unknown = [i for i in self.implementations if i not in TOKAMAX_ATTENTION_PLATFORMS]
    if unknown or not self.implementations:
      raise ValueError(f'TokamaxAttention.implementations must be a non-empty tuple of '
                       f'{tuple(TOKAMAX_ATTENTION_PLATFORMS)}, got {self.implementations}.')

  @property
  def capabilities(self) -> AttentionCapabilities:
    """Dense-mask attention with soft-cap, no sinks; platforms of its implementations."""
    platforms = tuple(p for p in ALL_PLATFORMS
                      if any(p in TOKAMAX_ATTENTION_PLATFORMS[i] for i in self.implementations))
    only_cudnn = self.implementations == ('cudnn',)
    return AttentionCapabilities(
        platforms=platforms, dtypes=('bfloat16', 'float16') if only_cudnn else FLOAT_DTYPES,
        gqa=True, masking='positions', decode=True, sliding_window=True, traced_window=True,
        softcap=not only_cudnn, sinks=False, distinct_v_head_dim=not only_cudnn,
        chunked=True, key_mask=True, blocks=True)

  def unsupported_reasons(self, request):
    """The declared limits, and tokamax being importable."""
    missing = tokamax_missing()
    return self.capabilities.missing(request) + ([missing] if missing else [])

  def attend(self, q_BTNH, k_BSKH, v_BSKH, mask, options):
    """Try each implementation; log the ones that refuse; raise if all refuse."""
    tokamax = import_tokamax()  # sinks are refused by the capability check
    allowed_B1TS = options.visible(mask)[:, None]
    return run_first_tokamax(
        'attention', self.name, self.implementations,
        lambda impl: tokamax.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=allowed_B1TS,
                                                   scale=options.scale,
                                                   logits_soft_cap=options.softcap,
                                                   implementation=impl),
        TOKAMAX_ATTENTION_PLATFORMS)


register_attention_kernel('tokamax', TokamaxAttention)
for _impl in TOKAMAX_ATTENTION_PLATFORMS:
  register_attention_kernel(
      f'tokamax_{_impl}',
      lambda impl=_impl: TokamaxAttention(name=f'tokamax_{impl}', implementations=(impl,)))

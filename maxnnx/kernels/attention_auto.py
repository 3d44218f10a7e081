"""``auto``: the attention strategy measured fastest on the call's platform, picked when traced.

On an NVIDIA GPU a bfloat16/float16 call goes to ``cudnn`` (on an H100 the ``gpu-1b`` train step
ran 1.29x faster with it than with ``xla_flash``, see ``benchmarks/RESULTS.md``); every other
call, and a GPU call cuDNN cannot serve (soft-capping, sinks, float32, ...), goes to
``xla_flash``, and what that cannot serve to ``xla``. ``cudnn`` gets its mask as a dense
``[B, 1, T, S]`` array, so past :data:`DENSE_MASK_MAX_POSITIONS` query x key positions (8192^2:
512 MiB of mask at batch 8) ``auto`` keeps to the blockwise ``xla_flash`` (a limit chosen, not
yet measured). The choice is made per call from the
same capability declarations the strategies use themselves, so ``auto`` never warns about a
fallback: it logs once (``maxnnx.kernels``, INFO) which strategy each kind of call ran.
"""

import dataclasses

from maxnnx.kernels.attention import (
  AttentionKernel,
  XlaAttention,
  get_attention_kernel,
  register_attention_kernel,
)
from maxnnx.kernels.capabilities import AttentionRequest, log_once

# Platform -> strategies in order of preference; the first that can serve a call runs it.
PREFERENCE: dict[str, tuple[str, ...]] = {
    'gpu': ('cudnn', 'xla_flash'),
    'tpu': ('xla_flash',),
    'cpu': ('xla_flash',),
}
DENSE_MASK_MAX_POSITIONS = 8192 * 8192
DENSE_MASK_STRATEGIES = ('cudnn',)


@dataclasses.dataclass(frozen=True)
class AutoAttention(AttentionKernel):
  """Runs the first strategy of :data:`PREFERENCE` for the platform that can serve the call."""

  name: str = 'auto'

  @property
  def capabilities(self):
    """Everything ``xla`` supports: a call no preferred strategy serves runs on ``xla``."""
    return XlaAttention().capabilities

  def choose(self, request: AttentionRequest) -> AttentionKernel:
    """The strategy that will run ``request``."""
    for name in PREFERENCE.get(request.platform, ()):
      if (name in DENSE_MASK_STRATEGIES
          and request.q_length * request.kv_length > DENSE_MASK_MAX_POSITIONS):
        continue
      kernel = get_attention_kernel(name, on_unsupported=self.on_unsupported)
      if not kernel.unsupported_reasons(request):
        return kernel
    return XlaAttention()

  def attend(self, q_BTNH, k_BSKH, v_BSKH, mask, options):
    """Attention by the chosen strategy."""
    return self._chosen(q_BTNH, k_BSKH, v_BSKH, mask, options)(q_BTNH, k_BSKH, v_BSKH, mask,
                                                                options)

  def attend_and_max_logits(self, q_BTNH, k_BSKH, v_BSKH, mask, options):
    """The chosen strategy's output and max logits (``xla_flash`` tracks them blockwise)."""
    kernel = self._chosen(q_BTNH, k_BSKH, v_BSKH, mask, options)
    return kernel.attend_and_max_logits(q_BTNH, k_BSKH, v_BSKH, mask, options)

  def _chosen(self, q_BTNH, k_BSKH, v_BSKH, mask, options) -> AttentionKernel:
    """:meth:`choose` for this call, logged once per kind of call."""
    request = AttentionRequest.of(q_BTNH, k_BSKH, v_BSKH, options, mask)
    kernel = self.choose(request)
    log_once(('attention', 'auto', request.platform, request.dtype, kernel.name),
             f"attention_impl 'auto' runs '{kernel.name}' for {request.dtype} on "
             f'{request.platform}.')
    return kernel


register_attention_kernel('auto', AutoAttention)

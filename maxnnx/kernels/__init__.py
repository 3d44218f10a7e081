"""Swappable compute kernels, chosen by name in the model config.

Importing this package registers every built-in strategy. Each declares its
capabilities; see :mod:`maxnnx.kernels.capabilities` for the fallback policy.
"""

from maxnnx.kernels.attention import (
  ATTENTION_IMPLEMENTATIONS,
  AttentionKernel,
  XlaAttention,
  get_attention_kernel,
  register_attention_kernel,
)
from maxnnx.kernels.attention_auto import AutoAttention
from maxnnx.kernels.attention_blockwise import BlockwiseAttention
from maxnnx.kernels.attention_jax_nn import JaxNnAttention
from maxnnx.kernels.attention_pallas import PallasFlashAttention
from maxnnx.kernels.attention_tokamax import TokamaxAttention
from maxnnx.kernels.capabilities import (
  AttentionCapabilities,
  AttentionRequest,
  KernelUnsupportedError,
  PagedAttentionCapabilities,
  PagedAttentionRequest,
  RaggedDotCapabilities,
  RaggedDotRequest,
)
from maxnnx.kernels.gated_delta import (
  GATED_DELTA_IMPLEMENTATIONS,
  ChunkedGatedDelta,
  GatedDeltaKernel,
  RecurrentGatedDelta,
  register_gated_delta_kernel,
)
from maxnnx.kernels.lookup import KERNEL_REGISTRIES, get_kernel, kernel_for
from maxnnx.kernels.masks import AttentionMask
from maxnnx.kernels.options import AttentionOptions, RaggedDotOptions
from maxnnx.kernels.paged_attention import (
  PAGED_ATTENTION_IMPLEMENTATIONS,
  PagedAttentionKernel,
  PagedBatch,
  XlaPagedAttention,
  get_paged_attention_kernel,
  register_paged_attention_kernel,
)
from maxnnx.kernels.paged_attention_pallas import PallasPagedAttention
from maxnnx.kernels.ragged_dot import (
  RAGGED_DOT_IMPLEMENTATIONS,
  DenseRaggedDot,
  LaxRaggedDot,
  RaggedDotKernel,
  TiledRaggedDot,
  TokamaxRaggedDot,
  get_ragged_dot_kernel,
  register_ragged_dot_kernel,
)

__all__ = ['ATTENTION_IMPLEMENTATIONS', 'AttentionCapabilities', 'AttentionKernel', 'AutoAttention',
           'AttentionMask', 'AttentionOptions', 'AttentionRequest', 'BlockwiseAttention',
           'ChunkedGatedDelta', 'DenseRaggedDot', 'GATED_DELTA_IMPLEMENTATIONS',
           'GatedDeltaKernel', 'JaxNnAttention', 'KERNEL_REGISTRIES', 'RecurrentGatedDelta',
           'KernelUnsupportedError', 'LaxRaggedDot', 'PAGED_ATTENTION_IMPLEMENTATIONS',
           'PagedAttentionCapabilities', 'PagedAttentionKernel', 'PagedAttentionRequest',
           'PagedBatch', 'PallasFlashAttention', 'PallasPagedAttention',
           'RAGGED_DOT_IMPLEMENTATIONS', 'RaggedDotCapabilities', 'RaggedDotKernel',
           'RaggedDotOptions', 'RaggedDotRequest', 'TiledRaggedDot', 'TokamaxAttention',
           'TokamaxRaggedDot', 'XlaAttention', 'XlaPagedAttention',
           'get_attention_kernel', 'get_kernel', 'get_paged_attention_kernel',
           'get_ragged_dot_kernel', 'kernel_for', 'register_attention_kernel',
           'register_gated_delta_kernel', 'register_paged_attention_kernel',
           'register_ragged_dot_kernel']

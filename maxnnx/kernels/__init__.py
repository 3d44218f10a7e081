"""Swappable compute kernels, chosen by name in the model config."""

from maxnnx.kernels.attention import (
                                      ATTENTION_IMPLEMENTATIONS,
                                      AttentionKernel,
                                      XlaAttention,
                                      get_attention_kernel,
                                      register_attention_kernel,
)
from maxnnx.kernels.masks import AttentionMask
from maxnnx.kernels.ragged_dot import (
                                       RAGGED_DOT_IMPLEMENTATIONS,
                                       RaggedDotKernel,
                                       get_ragged_dot_kernel,
                                       register_ragged_dot_kernel,
)

__all__ = ['ATTENTION_IMPLEMENTATIONS', 'AttentionKernel', 'AttentionMask', 'XlaAttention',
           'RAGGED_DOT_IMPLEMENTATIONS', 'RaggedDotKernel', 'get_attention_kernel',
           'get_ragged_dot_kernel', 'register_attention_kernel', 'register_ragged_dot_kernel']

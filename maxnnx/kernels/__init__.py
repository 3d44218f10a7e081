"""Swappable compute kernels, chosen by name in the model config."""

from maxnnx.kernels.attention import (
                                      ATTENTION_IMPLEMENTATIONS,
                                      AttentionKernel,
                                      XlaAttention,
                                      get_attention_kernel,
                                      register_attention_kernel,
)
from maxnnx.kernels.masks import AttentionMask

__all__ = ['ATTENTION_IMPLEMENTATIONS', 'AttentionKernel', 'AttentionMask', 'XlaAttention',
           'get_attention_kernel', 'register_attention_kernel']

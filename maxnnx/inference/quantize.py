"""Quantized inference: the linear layers' weights in int8, int4 or fp8 (and int8 activations).

:func:`quantize_for_inference` replaces the kernel of every
:class:`~maxnnx.layers.linear.DenseGeneral` of a model (the attention and MLP
projections; not the output head, whose error every token pays) with a qwix
``QArray``: the quantized values and their scales. The layer then multiplies
through ``qwix.dot_general``, which dequantizes the weight on the fly, or, for
``w8a8``, quantizes each token's activations to int8 too and multiplies int8 by
int8. Scales are per output channel; ``int4`` has one per 32 inputs as well.

Modes and what a weight holds (``bytes per value``):

======== ======================= =================================
mode     weight                  activations
======== ======================= =================================
int8     int8 (1)                float
int4     int4 (0.5), groups of 32 float
fp8      float8_e4m3fn (1)       float
w8a8     int8 (1)                int8, one scale per token
======== ======================= =================================

The routed experts of MoE layers, embeddings and norms stay in float; the
model is for inference only (its quantized kernels take no gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from maxnnx.layers.linear import DenseGeneral

MODES = {'int8': (jnp.int8, None), 'int4': (jnp.int4, 32),
         'fp8': (jnp.float8_e4m3fn, None), 'w8a8': (jnp.int8, None)}
SKIPPED_MODULES = ('lm_head',)


def check_mode(mode: str) -> None:
  """Raise ``ValueError`` naming the choices unless ``mode`` is ``none`` or one of :data:`MODES`."""
  if mode != 'none' and mode not in MODES:
    raise ValueError(f"quantization={mode!r}: expected one of {', '.join(MODES)} (or 'none').")


def quantize_for_inference(model: nnx.Module, mode: str) -> nnx.Module:
  """Quantize ``model``'s linear layers in place for inference and return it.

  Args:
    model: a :class:`~maxnnx.models.transformer.Transformer` (or any module holding
      :class:`~maxnnx.layers.linear.DenseGeneral` layers) with float kernels.
    mode: ``int8``, ``int4``, ``fp8`` (weight-only) or ``w8a8`` (int8 weights and
      activations); see the module doc.

  Raises:
    ValueError: an unknown ``mode``, or a model that is already quantized.
  """
  if mode not in MODES:
    raise ValueError(f"quantization={mode!r}: expected one of {', '.join(MODES)}.")
  qtype, group = MODES[mode]
  for path, module in nnx.iter_graph(model):
    if not isinstance(module, DenseGeneral) or any(p in SKIPPED_MODULES for p in path):
      continue
    kernel = module.kernel[...]
    if not isinstance(kernel, jax.Array):
      raise ValueError(f"{'.'.join(map(str, path))}: the kernel is already quantized.")
    n_in = len(module.in_shape)
    tiled = None
    if group and kernel.shape[n_in - 1] % group == 0 and kernel.shape[n_in - 1] > group:
      tiled = {n_in - 1: group}  # the last input axis, in groups
    module.kernel.set_value(qwix.quantize(
        kernel, qtype, channelwise_axes=tuple(range(n_in, kernel.ndim)), tiled_axes=tiled,
        scale_dtype=jnp.float32))
    module.inference_quantization = mode
  return model


def _nbytes(leaf) -> int:
  return (leaf.size + 1) // 2 if leaf.dtype == jnp.int4 else leaf.size * leaf.dtype.itemsize


def param_bytes(model: nnx.Module) -> int:
  """Bytes the model's parameters hold (quantized values and scales included)."""
  return sum(_nbytes(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def kernel_bytes(model: nnx.Module) -> int:
  """Bytes of the kernels :func:`quantize_for_inference` quantizes (values and scales)."""
  return sum(_nbytes(leaf) for path, module in nnx.iter_graph(model)
             if isinstance(module, DenseGeneral) and not any(p in SKIPPED_MODULES for p in path)
             for leaf in jax.tree.leaves(module.kernel[...]))


__all__ = ['MODES', 'check_mode', 'kernel_bytes', 'param_bytes', 'quantize_for_inference']

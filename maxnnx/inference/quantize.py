"""Quantized inference: the linear layers' and experts' weights in int8, int4 or fp8 (and int8
activations).

:func:`quantize_for_inference` replaces the kernel of every
:class:`~maxnnx.layers.linear.DenseGeneral` of a model (the attention and MLP
projections, shared experts included; not the output head, whose error every
token pays, nor an MoE router, whose error changes which experts a token
reaches) with a qwix ``QArray``: the quantized values and their scales. The
layer then multiplies through ``qwix.dot_general``, which dequantizes the
weight on the fly, or, for ``w8a8``, quantizes each token's activations to int8
too and multiplies int8 by int8. Scales are per output channel; ``int4`` has
one per 32 inputs as well.

The routed experts of MoE layers (:class:`~maxnnx.layers.moe.Experts`,
``[experts, in, out]``) are quantized the same way, with one scale per expert
and output channel (and per 32 inputs for ``int4``), and their grouped matmuls
run through ``qwix.ragged_dot`` (dropless dispatch) or ``qwix.einsum``
(capacity dispatch). Experts stay weight-only under ``w8a8``.

Modes and what a weight holds (``bytes per value``):

======== ======================= =================================
mode     weight                  activations
======== ======================= =================================
int8     int8 (1)                float
int4     int4 (0.5), groups of 32 float
fp8      float8_e4m3fn (1)       float
w8a8     int8 (1)                int8, one scale per token
======== ======================= =================================

Embeddings, norms and biases stay in float; the model is for inference only
(its quantized kernels take no gradient). A model loaded with
``from_pretrained(keep_quantized=True)`` holds a release's own quantized
kernels in the same form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.moe import Experts, Router

MODES = {'int8': (jnp.int8, None), 'int4': (jnp.int4, 32),
         'fp8': (jnp.float8_e4m3fn, None), 'w8a8': (jnp.int8, None)}
SKIPPED_MODULES = ('lm_head',)
EXPERT_WEIGHTS = ('gate_proj', 'up_proj', 'down_proj')


def check_mode(mode: str) -> None:
  """Raise ``ValueError`` naming the choices unless ``mode`` is ``none``, ``checkpoint`` (a
  quantized release's own weights, kept at load: ``from_pretrained(keep_quantized=True)``) or
  one of :data:`MODES`."""
  if mode not in ('none', 'checkpoint') and mode not in MODES:
    raise ValueError(f"quantization={mode!r}: expected one of {', '.join(MODES)} (or 'none', "
                     "or 'checkpoint' for a quantized release's own weights).")


def quantize_for_inference(model: nnx.Module, mode: str) -> nnx.Module:
  """Quantize ``model``'s linear layers and routed experts in place for inference and return it.

  Args:
    model: a :class:`~maxnnx.models.transformer.Transformer` (or any module holding
      :class:`~maxnnx.layers.linear.DenseGeneral` layers or
      :class:`~maxnnx.layers.moe.Experts`) with float weights.
    mode: ``int8``, ``int4``, ``fp8`` (weight-only) or ``w8a8`` (int8 weights and
      activations); see the module doc.

  Raises:
    ValueError: an unknown ``mode``, or a model that is already quantized.
  """
  if mode == 'checkpoint':
    raise ValueError("quantization='checkpoint' keeps a quantized release's own weights: it is "
                     'chosen at load, with from_pretrained(directory, keep_quantized=True).')
  if mode not in MODES:
    raise ValueError(f"quantization={mode!r}: expected one of {', '.join(MODES)}.")
  qtype, group = MODES[mode]
  for path, module in list(nnx.iter_graph(model)):
    where = '.'.join(map(str, path))
    if isinstance(module, Experts):
      for name in EXPERT_WEIGHTS:  # [(layers,) experts, in, out]: the inputs are axis -2
        param = getattr(module, name)
        param.set_value(_quantize(param[...], qtype, group, (param[...].ndim - 2,),
                                  f'{where}.{name}'))
      continue
    if (not isinstance(module, DenseGeneral) or isinstance(module, Router)
        or any(p in SKIPPED_MODULES for p in path)):
      continue
    kernel = module.kernel[...]
    lead = kernel.ndim - len(module.in_shape) - len(module.out_shape)  # a scanned stack's axis
    module.kernel.set_value(_quantize(kernel, qtype, group,
                                      tuple(range(lead, lead + len(module.in_shape))),
                                      f'{where}.kernel'))
    module.inference_quantization = mode
  return model


def _quantize(weight, qtype, group: int | None, inputs: tuple[int, ...], where: str):
  """``weight`` as a ``QArray`` with one scale per index of every axis but the ``inputs`` (the
  last of which is in groups of ``group`` where it divides into several)."""
  if not isinstance(weight, jax.Array):
    raise ValueError(f'{where}: the weight is already quantized.')
  tiled = None
  if group and weight.shape[inputs[-1]] % group == 0 and weight.shape[inputs[-1]] > group:
    tiled = {inputs[-1]: group}
  return qwix.quantize(weight, qtype,
                       channelwise_axes=tuple(a for a in range(weight.ndim) if a not in inputs),
                       tiled_axes=tiled, scale_dtype=jnp.float32)


def _nbytes(leaf) -> int:
  return (leaf.size + 1) // 2 if leaf.dtype == jnp.int4 else leaf.size * leaf.dtype.itemsize


def param_bytes(model: nnx.Module) -> int:
  """Bytes the model's parameters hold (quantized values and scales included)."""
  return sum(_nbytes(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def kernel_bytes(model: nnx.Module) -> int:
  """Bytes of the weights :func:`quantize_for_inference` quantizes (values and scales): the
  linear layers' kernels and the routed experts' weights."""
  weights = []
  for path, module in nnx.iter_graph(model):
    if isinstance(module, Experts):
      weights += [getattr(module, name)[...] for name in EXPERT_WEIGHTS]
    elif (isinstance(module, DenseGeneral) and not isinstance(module, Router)
          and not any(p in SKIPPED_MODULES for p in path)):
      weights.append(module.kernel[...])
  return sum(_nbytes(leaf) for leaf in jax.tree.leaves(weights))


__all__ = ['MODES', 'check_mode', 'kernel_bytes', 'param_bytes', 'quantize_for_inference']

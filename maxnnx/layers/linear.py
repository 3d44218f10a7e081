"""A dense layer over several input and output dimensions at once."""

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.layers.params import logical_param


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dense_dot(x: jax.Array, kernel: jax.Array, n_in: int, dtype) -> jax.Array:
  """``x[..., in] · kernel[in, out]`` in ``dtype`` with float32 accumulation, result in ``dtype``.

  ``n_in`` trailing dims of ``x`` contract with the leading ``n_in`` dims of
  ``kernel``. The backward pass is written out so that it stays in ``dtype``:
  plain autodiff would hand the float32 product's cotangent to both gradient
  matmuls, running them in float32 (on a CPU with bf16 units about half the
  speed), and would round the kernel gradient to ``dtype`` before returning it
  in the kernel's own dtype. Here both gradients are ``dtype`` x ``dtype``
  matmuls accumulated in float32, and the kernel gradient comes back in the
  kernel's dtype unrounded. The forward matmul is one ``lax.dot_general``, the
  op quantization libraries (qwix) intercept; their straight-through gradient
  is the same float formula as this one.
  """
  return _dense_dot_fwd(x, kernel, n_in, dtype)[0]


def _dense_dot_fwd(x, kernel, n_in, dtype):
  contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
  x_c, kernel_c = x.astype(dtype), kernel.astype(dtype)
  # Accumulate in float32 whatever the compute dtype: on CPUs a bf16 x bf16 -> f32 dot is
  # about twice as fast as bf16 -> bf16, and on GPUs it is what the tensor cores do anyway.
  y = jax.lax.dot_general(x_c, kernel_c, (contract, ((), ())),
                          preferred_element_type=jnp.float32).astype(dtype)
  return y, (x_c, kernel_c, jnp.zeros((), x.dtype), jnp.zeros((), kernel.dtype))


def _dense_dot_bwd(n_in, dtype, residuals, dy):
  x_c, kernel_c, x_like, kernel_like = residuals
  dy = dy.astype(dtype)
  batch_ndim, n_out = x_c.ndim - n_in, kernel_c.ndim - n_in
  out_dims = tuple(range(batch_ndim, batch_ndim + n_out))
  dx = jax.lax.dot_general(dy, kernel_c, ((out_dims, tuple(range(n_in, n_in + n_out))),
                                          ((), ())), preferred_element_type=jnp.float32)
  batch_dims = tuple(range(batch_ndim))
  dkernel = jax.lax.dot_general(x_c, dy, ((batch_dims, batch_dims), ((), ())),
                                preferred_element_type=jnp.float32)
  return dx.astype(x_like.dtype), dkernel.astype(kernel_like.dtype)


dense_dot.defvjp(_dense_dot_fwd, _dense_dot_bwd)


class DenseGeneral(nnx.Module):
  """``y[..., out] = x[..., in] · kernel[in, out] (+ bias[out])``.

  ``in_shape`` and ``out_shape`` may each span several dimensions, so a query
  projection is ``DenseGeneral((d_model,), (heads, head_dim))`` and its output
  projection ``DenseGeneral((heads, head_dim), (d_model,))``: no reshapes, and
  each kernel dimension keeps its own logical sharding name. The matmul is one
  ``lax.dot_general`` (which quantization libraries such as qwix intercept).

  Attributes:
    kernel: ``nnx.Param`` of shape ``in_shape + out_shape``.
    bias: ``nnx.Param`` of shape ``out_shape`` or ``None``.
    custom_gradient: ``True`` (default) runs the matmul through :func:`dense_dot`'s
      custom VJP; ``False`` runs a plain ``lax.dot_general`` that JAX
      differentiates. Adapters that add their own terms to the intercepted matmul
      (LoRA, :mod:`maxnnx.train.lora`) need ``False``: a custom VJP knows only
      ``x`` and ``kernel``, so their parameters would get no gradient. With it the
      kernel may also be a quantized array of the intercepting library (QLoRA).
    inference_quantization: ``None``, or the mode
      :func:`~maxnnx.inference.quantize.quantize_for_inference` quantized the kernel
      with (it is then a qwix ``QArray``).
  """

  inference_quantization: str | None = None  # set by maxnnx.inference.quantize_for_inference

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], *,
               axes: Sequence[str], use_bias: bool = False, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs, custom_gradient: bool = True):
    self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
    self.dtype = dtype
    self.custom_gradient = custom_gradient
    if len(axes) != len(self.in_shape) + len(self.out_shape):
      raise ValueError(f'axes {tuple(axes)} must name every dimension of '
                       f'{self.in_shape + self.out_shape}.')
    fan_in = math.prod(self.in_shape)
    init = nnx.initializers.normal(stddev=fan_in**-0.5)
    self.kernel = logical_param(init, rngs.params(), self.in_shape + self.out_shape,
                                param_dtype, axes, contract_ndim=len(self.in_shape))
    self.bias = (logical_param(nnx.initializers.zeros, rngs.params(), self.out_shape,
                               param_dtype, axes[len(self.in_shape):]) if use_bias else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    n_in = len(self.in_shape)
    if x.shape[x.ndim - n_in:] != self.in_shape:
      raise ValueError(f'DenseGeneral expects trailing dims {self.in_shape}, got {x.shape}.')
    dtype = jnp.dtype(self.dtype)
    kernel = self.kernel[...]
    if self.inference_quantization is not None:  # see maxnnx.inference.quantize
      y = self._quantized_dot(x.astype(dtype), kernel, n_in).astype(dtype)
    elif self.custom_gradient:
      y = dense_dot(x, kernel, n_in, dtype)
    else:
      contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
      if isinstance(kernel, jax.Array):  # a quantized kernel stays as its library holds it
        kernel = kernel.astype(dtype)
      y = jax.lax.dot_general(x.astype(dtype), kernel, (contract, ((), ())),
                              preferred_element_type=jnp.float32)
      y = y.astype(dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y

  def _quantized_dot(self, x: jax.Array, kernel, n_in: int) -> jax.Array:
    """``x · kernel`` with the kernel a qwix ``QArray``; under ``w8a8``, ``x`` is quantized
    to int8 per token first."""
    import qwix  # only models quantized for inference need it (a slow import)

    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    if self.inference_quantization == 'w8a8':
      x = qwix.quantize(x, jnp.int8, channelwise_axes=tuple(range(x.ndim - n_in)),
                        scale_dtype=jnp.float32)
    return qwix.dot_general(x, kernel, (contract, ((), ())), preferred_element_type=jnp.float32)

"""A dense layer over several input and output dimensions at once."""

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.layers.params import logical_param


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
  """

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], *,
               axes: Sequence[str], use_bias: bool = False, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
    self.dtype = dtype
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
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    # Accumulate in float32 whatever the compute dtype: on CPUs a bf16 x bf16 -> f32 dot is
    # about twice as fast as bf16 -> bf16, and on GPUs it is what the tensor cores do anyway.
    y = jax.lax.dot_general(x.astype(self.dtype), self.kernel[...].astype(self.dtype),
                            (contract, ((), ())), preferred_element_type=jnp.float32
                            ).astype(self.dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y

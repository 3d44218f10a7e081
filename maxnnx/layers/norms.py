"""RMSNorm and LayerNorm, computed in float32."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.layers.params import logical_param


class RMSNorm(nnx.Module):
  """``x / sqrt(mean(x², over the normalised dims) + eps) * (scale_offset + w)``.

  ``shape`` is the trailing shape that is normalised together: ``(d_model,)``
  for the residual stream, ``(head_dim,)`` for per-head q/k norms, and
  ``(heads, head_dim)`` for a norm over a whole projection (OLMo 2).
  ``scale_offset=1.0`` gives Gemma's ``1 + w`` form (weights initialised at 0).
  The statistics are computed in float32 and the result cast back.
  """

  def __init__(self, shape: int | Sequence[int], *, axes: Sequence[str], eps: float = 1e-6,
               scale_offset: float = 0.0, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
    self.eps, self.scale_offset, self.dtype = eps, scale_offset, dtype
    init = nnx.initializers.zeros if scale_offset else nnx.initializers.ones
    self.scale = logical_param(init, rngs.params(), self.shape, param_dtype, axes)

  def __call__(self, x: jax.Array) -> jax.Array:
    reduce = tuple(range(x.ndim - len(self.shape), x.ndim))
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=reduce, keepdims=True) + self.eps)
    y = x32 * (self.scale_offset + self.scale[...].astype(jnp.float32))
    return y.astype(self.dtype)


class LayerNorm(nnx.Module):
  """Mean-centred, variance-normalised ``x * (scale_offset + w) + b`` over ``d``."""

  def __init__(self, shape: int, *, axes: Sequence[str], eps: float = 1e-5,
               scale_offset: float = 0.0, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.eps, self.scale_offset, self.dtype = eps, scale_offset, dtype
    init = nnx.initializers.zeros if scale_offset else nnx.initializers.ones
    self.scale = logical_param(init, rngs.params(), (shape,), param_dtype, axes)
    self.bias = logical_param(nnx.initializers.zeros, rngs.params(), (shape,), param_dtype, axes)

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    y = y * (self.scale_offset + self.scale[...].astype(jnp.float32)) + self.bias[...]
    return y.astype(self.dtype)

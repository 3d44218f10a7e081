"""A quantized KV cache: int8 or fp8 (e4m3) keys and values with one scale per token and head.

``kv_cache_dtype`` names how a cache stores keys and values:

* ``auto``: the compute dtype (no quantization);
* ``int8``: ``round(x / s)`` clipped to ``[-127, 127]``, with ``s = absmax / 127``;
* ``fp8``: ``x / s`` cast to ``float8_e4m3fn``, with ``s = absmax / 448`` (e4m3's largest
  finite value).

``absmax`` is the largest ``|x|`` over ``head_dim`` of one token's key (or value) in one KV
head, so each token and head has its own float32 scale, computed when the token is written:
writing a token never rescales the tokens already cached, and one outlier token costs
precision in its own row only. Reading multiplies back, ``x ≈ q * s`` (a zero vector has
``s = 0`` and reads back as zeros).

A paged pool keeps the scales beside the pages, ``[num_pages, page_size, kv_heads]`` float32
(:class:`QuantizedPages`); per token and head that is 4 bytes beside ``head_dim`` bytes of
int8 or fp8, so an int8 page takes ``(head_dim + 4) / (2 * head_dim)`` of a bf16 page's bytes
(0.53x at ``head_dim`` 64, 0.52x at 128).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

#: The names ``kv_cache_dtype`` takes (``maxnnx.config.engine`` repeats them: config imports
#: no kernels).
KV_CACHE_DTYPES = ('auto', 'int8', 'fp8')

# name -> (storage dtype, largest magnitude stored)
_STORAGE = {'int8': (jnp.int8, 127.0), 'fp8': (jnp.float8_e4m3fn, 448.0)}

#: The ``kv_cache_dtype`` of each storage dtype.
QUANTIZED_KV_DTYPES = {np.dtype(dtype): name for name, (dtype, _) in _STORAGE.items()}


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
  """``kv_cache_dtype`` when it is one of :data:`KV_CACHE_DTYPES`; else a one-line
  ``ValueError`` naming the key and the values it takes."""
  if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(f'kv_cache_dtype={kv_cache_dtype!r}: expected one of '
                     f"{', '.join(KV_CACHE_DTYPES)} (auto: the compute dtype).")
  return kv_cache_dtype


def kv_storage_dtype(kv_cache_dtype: str):
  """The dtype a quantized cache stores (``int8`` or ``float8_e4m3fn``); ``None`` for
  ``auto``."""
  check_kv_cache_dtype(kv_cache_dtype)
  return None if kv_cache_dtype == 'auto' else _STORAGE[kv_cache_dtype][0]


def quantize_kv(x: jax.Array, kv_cache_dtype: str) -> tuple[jax.Array, jax.Array]:
  """``(values, scales)`` of ``x [..., head_dim]``: values in the storage dtype, shaped as
  ``x``, and float32 scales ``[...]`` (one per vector over the last axis)."""
  if kv_cache_dtype not in _STORAGE:
    check_kv_cache_dtype(kv_cache_dtype)
    raise ValueError("quantize_kv needs kv_cache_dtype 'int8' or 'fp8', got 'auto'.")
  dtype, largest = _STORAGE[kv_cache_dtype]
  x32 = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x32), axis=-1) / largest
  scaled = x32 / jnp.where(scale > 0, scale, 1.0)[..., None]
  if dtype == jnp.int8:
    scaled = jnp.round(scaled)
  return jnp.clip(scaled, -largest, largest).astype(dtype), scale


def dequantize_kv(values: jax.Array, scales: jax.Array, dtype) -> jax.Array:
  """``values * scales`` (scales broadcast over the last axis), in ``dtype``."""
  return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)


@dataclasses.dataclass(frozen=True)
class QuantizedPages:
  """A pool of quantized pages and their scales, passed where float pages go.

  A pytree. ``shape`` and ``dtype`` are the stored values', so a paged-attention request
  reads the pool's geometry from it as from a float pool.

  Attributes:
    values: ``[num_pages, page_size, kv_heads, head_dim]`` int8 or float8_e4m3fn.
    scales: ``[num_pages, page_size, kv_heads]`` float32.
  """

  values: jax.Array
  scales: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    """The values' shape."""
    return self.values.shape

  @property
  def dtype(self):
    """The values' (storage) dtype."""
    return self.values.dtype

  def gather(self, index) -> 'QuantizedPages':
    """The pages ``index`` selects (``pages[index]`` of both arrays)."""
    return QuantizedPages(self.values[index], self.scales[index])

  def dequantize(self, dtype) -> jax.Array:
    """The pages as floats of ``dtype``."""
    return dequantize_kv(self.values, self.scales, dtype)


jax.tree_util.register_dataclass(QuantizedPages, data_fields=['values', 'scales'],
                                 meta_fields=[])

"""What this machine computes fastest: the dtype ``dtype='auto'`` resolves to, and the
matmul rate MFU divides by on a CPU.

Accelerators (GPU, TPU) run bfloat16 matmuls at several times their float32 rate, so
``auto`` is bfloat16 there. A CPU is fast in bfloat16 only with native bf16 instructions:
x86 CPUs with AVX-512 BF16 or AMX (the ``avx512_bf16`` / ``amx_bf16`` flags of
``/proc/cpuinfo``); without them XLA widens every bf16 operand to float32 and float32 is
the faster choice (1.3x for the default run on a 2-core AVX2 EPYC). Where the flags cannot
be read or do not decide (another architecture, another OS), a short matmul probe in both
dtypes does.
"""

from __future__ import annotations

import functools
import platform
import time

import jax
import jax.numpy as jnp

#: x86 CPU flags of native bfloat16 matrix arithmetic.
X86_BF16_FLAGS = ('avx512_bf16', 'amx_bf16')


def cpu_flags(path: str = '/proc/cpuinfo') -> frozenset[str] | None:
  """The CPU feature flags the operating system reports (``None`` where it has no
  ``/proc/cpuinfo``)."""
  try:
    with open(path, encoding='utf-8', errors='replace') as f:
      text = f.read()
  except OSError:
    return None
  flags = set()
  for line in text.splitlines():
    key, _, value = line.partition(':')
    if key.strip() in ('flags', 'Features'):
      flags.update(value.split())
  return frozenset(flags)


@functools.lru_cache(maxsize=8)
def measured_matmul_flops(dtype_name: str = 'float32', size: int = 1024,
                          seconds: float = 0.3) -> float:
  """FLOP/s of a square matmul on the default device, in ``dtype`` (f32 accumulation)."""
  dtype = jnp.dtype(dtype_name)
  a = jnp.ones((size, size), dtype)
  f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  f(a, a).block_until_ready()
  runs, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    f(a, a).block_until_ready()
    runs += 1
  return 2 * size**3 * runs / (time.perf_counter() - start)


def choose_compute_dtype(device_platform: str, flags: frozenset[str] | None,
                         machine: str, probe=measured_matmul_flops) -> tuple[str, str]:
  """``(dtype name, why)`` for a device of ``device_platform`` (``'cpu'``, ``'gpu'``…) on a
  host whose CPU reports ``flags`` and is a ``machine`` (``platform.machine()``);
  ``probe(dtype_name)`` measures a matmul rate when the flags do not decide."""
  if device_platform != 'cpu':
    return 'bfloat16', f'{device_platform}: bfloat16 matmuls run at full rate'
  x86 = machine.lower() in ('x86_64', 'amd64', 'i386', 'i686')
  if x86 and flags:
    native = [flag for flag in X86_BF16_FLAGS if flag in flags]
    if native:
      return 'bfloat16', f'this CPU has native bfloat16: {", ".join(native)}'
    return 'float32', 'this CPU has no native bfloat16: no avx512_bf16 or amx_bf16 flag'
  rates = {name: probe(name) for name in ('float32', 'bfloat16')}
  best = max(rates, key=rates.get)
  return best, ('measured matmuls: ' + ', '.join(f'{name} {rate / 1e9:.1f} GFLOP/s'
                                                 for name, rate in rates.items()))


@functools.cache
def auto_compute_dtype() -> tuple[str, str]:
  """``(dtype name, why)`` for the first device of this process (computed once)."""
  device_platform = jax.devices()[0].platform
  flags = cpu_flags() if device_platform == 'cpu' else None
  return choose_compute_dtype(device_platform, flags, platform.machine())


def resolve_compute_dtype(name: str) -> str:
  """``name``, or for ``'auto'`` the dtype :func:`auto_compute_dtype` picks."""
  return auto_compute_dtype()[0] if name == 'auto' else name


__all__ = ['X86_BF16_FLAGS', 'auto_compute_dtype', 'choose_compute_dtype', 'cpu_flags',
           'measured_matmul_flops', 'resolve_compute_dtype']

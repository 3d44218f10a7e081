"""Measurements the maxnnx benchmarks share: matmul ceiling, memory bandwidth, peak memory,
the device's name, and step-time statistics.

The ceiling and the bandwidth are measured in the benchmark's own process, right next to the
timed work, so a ratio against them (MFU, fraction of the bandwidth bound) means the same on a
laptop CPU, a shared 2-core VM or an H100.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import results
from maxnnx.train import flops as flops_lib


def device_description(device=None) -> str:
  """``'gpu: NVIDIA H100 80GB HBM3'``, or ``'cpu: <model> x<N> cores'`` on a CPU."""
  device = device or jax.devices()[0]
  if device.platform == 'cpu':
    return results.cpu_description()
  return f'{device.platform}: {device.device_kind}'


def on_cpu() -> bool:
  """True when the default JAX device is a CPU."""
  return jax.devices()[0].platform == 'cpu'


def nominal_peak_tflops(device=None) -> float | None:
  """The published dense bf16 peak of ``device`` from ``maxnnx.train.flops`` (``None`` for a
  CPU or an unknown kind)."""
  device = device or jax.devices()[0]
  kind = (getattr(device, 'device_kind', '') or '').lower()
  if device.platform == 'cpu':
    return None
  for key, peak in flops_lib.PEAK_FLOPS_BY_KIND:
    if key.lower() in kind:
      return peak / 1e12
  return None


def _time_samples(fn, args, seconds: float, min_samples: int = 3) -> list[float]:
  """Seconds per call of ``fn(*args)`` for about ``seconds``: each sample times enough
  back-to-back calls (then one sync) to last about 20 ms, so dispatch overhead stays small on
  fast accelerators."""
  jax.block_until_ready(fn(*args))  # compile and warm
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  reps = max(1, int(0.02 / max(time.perf_counter() - start, 1e-9)))
  samples, start = [], time.perf_counter()
  while len(samples) < min_samples or time.perf_counter() - start < seconds:
    t0 = time.perf_counter()
    out = [fn(*args) for _ in range(reps)]
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / reps)
  return samples


def matmul_ceiling_tflops(dtype: str, size: int | None = None, seconds: float = 1.0) -> float:
  """TFLOP/s of a square ``size``^3 matmul in ``dtype`` through the fastest path we know.

  bf16 inputs accumulate into float32 (``preferred_element_type``): on a CPU with AVX-512 BF16
  that is about twice as fast as a bf16 result or a float32 matmul; on a GPU it is the
  tensor-core path. float32 runs a plain float32 matmul. The median of the calls is returned
  (a ceiling that one lucky call cannot inflate). ``size`` defaults to 8192 on accelerators and
  2048 on CPU.
  """
  size = size or (2048 if on_cpu() else 8192)
  dt = jnp.dtype(dtype)
  key_a, key_b = jax.random.split(jax.random.key(0))
  a = jax.random.normal(key_a, (size, size), jnp.float32).astype(dt)
  b = jax.random.normal(key_b, (size, size), jnp.float32).astype(dt)
  matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  samples = _time_samples(matmul, (a, b), seconds)
  return 2 * size**3 / statistics.median(samples) / 1e12


def memory_bandwidth_gbs(mib: int | None = None, seconds: float = 1.0) -> dict[str, float]:
  """Measured memory bandwidth in GB/s: ``read`` (a sum over a large float32 array) and
  ``copy`` (``x + 1`` written in place over a donated buffer; bytes read + written), each the
  median over calls for about ``seconds``. ``mib`` defaults to 512 on CPU (far past the caches)
  and 2048 on accelerators."""
  mib = mib or (512 if on_cpu() else 2048)
  n = mib * 2**20 // 4
  x = jnp.arange(n, dtype=jnp.float32)
  read = statistics.median(_time_samples(jax.jit(jnp.sum), (x,), seconds))
  bump = jax.jit(lambda x: x + 1, donate_argnums=0)
  x = jax.block_until_ready(bump(x))
  samples, start = [], time.perf_counter()
  while len(samples) < 3 or time.perf_counter() - start < seconds:
    t0 = time.perf_counter()
    x = jax.block_until_ready(bump(x))
    samples.append(time.perf_counter() - t0)
  return {'read': 4 * n / read / 1e9, 'copy': 2 * 4 * n / statistics.median(samples) / 1e9}


def peak_memory() -> tuple[float | None, str]:
  """``(GiB, what it is)``: the device's peak bytes in use on an accelerator, else this
  process's peak resident set size (which also counts Python, XLA and the data)."""
  device = jax.devices()[0]
  if device.platform != 'cpu':
    try:
      stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 (backends without memory stats)
      stats = {}
    if 'peak_bytes_in_use' in stats:
      return stats['peak_bytes_in_use'] / 2**30, 'device peak bytes in use'
    return None, 'unknown (no device memory stats)'
  kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
  return kib / 2**20, 'process peak RSS'


def percentiles(samples: list[float]) -> dict[str, float]:
  """``{'p10', 'median', 'p90', 'mean'}`` of ``samples``."""
  values = np.asarray(samples, np.float64)
  return {'p10': float(np.percentile(values, 10)), 'median': float(np.median(values)),
          'p90': float(np.percentile(values, 90)), 'mean': float(values.mean())}


def versions() -> dict[str, str]:
  """Versions of the packages a maxnnx result depends on, and the git commit of this
  checkout (``maxnnx_commit``, with ``+dirty`` for uncommitted changes) when there is one."""
  out = results.package_versions('maxnnx', 'jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint',
                                 'grain', 'tokamax')
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=root, text=True,
                            capture_output=True, timeout=10).stdout.strip()
    dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=root,
                           text=True, capture_output=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    commit = dirty = ''
  if commit:
    out['maxnnx_commit'] = commit + ('+dirty' if dirty else '')
  return out

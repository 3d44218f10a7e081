"""Per-device memory of a compiled train step, and how much a device has.

``Trainer.compile`` uses these to report the step's footprint and to refuse a
step that cannot fit before any weights exist.
"""

from __future__ import annotations

import os
import re

import jax
from jax.sharding import Mesh


def format_gib(n: float) -> str:
  """Bytes as a ``'1.23 GiB'`` string."""
  return f'{n / 2**30:.2f} GiB'


# HBM per device in GB (1e9 bytes) by a substring of ``device.device_kind`` (first match),
# from the Cloud TPU datasheets: for devices that report no memory stats (those of a
# topology that is not attached, described for ahead-of-time compilation).
HBM_GB_BY_KIND = (('TPU v6 lite', 32), ('TPU v5 lite', 16), ('TPU v5', 95), ('TPU v4', 32),
                  ('TPU v3', 16))


def device_memory_limit(device, override_gib: float | None = None) -> tuple[int | None, str]:
  """Bytes of memory one device may use, and where that number came from."""
  if override_gib is not None:
    return int(override_gib * 2**30), 'TrainConfig.memory_limit_gib'
  stats = None
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 (backends without memory stats)
    stats = None
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit']), f'{device.device_kind} memory'
  for kind, gb in HBM_GB_BY_KIND:
    if kind in getattr(device, 'device_kind', ''):
      return gb * 10**9, f'{device.device_kind} HBM ({gb} GB, datasheet)'
  if device.platform == 'cpu':
    try:
      total = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    except (ValueError, OSError):
      return None, 'unknown'
    local = max(len(jax.local_devices()), 1)
    return total // local, f'host RAM / {local} local devices'
  return None, 'unknown'


def memory_report(compiled, mesh: Mesh, override_gib: float | None = None) -> dict:
  """Per-device bytes of a compiled step: arguments, outputs, temporaries, peak, and what
  lives in host memory (offloaded tensors, on backends that place them there)."""
  analysis = compiled.memory_analysis()
  args = getattr(analysis, 'argument_size_in_bytes', 0)
  outs = getattr(analysis, 'output_size_in_bytes', 0)
  alias = getattr(analysis, 'alias_size_in_bytes', 0)
  temp = getattr(analysis, 'temp_size_in_bytes', 0)
  code = getattr(analysis, 'generated_code_size_in_bytes', 0)
  host_sizes = {k: getattr(analysis, f'host_{k}_size_in_bytes', 0) or 0
                for k in ('argument', 'output', 'alias', 'temp')}
  host = (host_sizes['argument'] + host_sizes['output'] - host_sizes['alias']
          + host_sizes['temp'])
  peak = args + outs - alias + temp
  limit, source = device_memory_limit(mesh.devices.flat[0], override_gib)
  return {'argument_bytes': args, 'output_bytes': outs, 'alias_bytes': alias,
          'temp_bytes': temp, 'code_bytes': code, 'peak_bytes': peak, 'limit_bytes': limit,
          'limit_source': source, 'devices': mesh.size, 'host_bytes': host}


def format_memory_report(report: dict) -> str:
  """A short human-readable memory report."""
  limit = (f"{format_gib(report['limit_bytes'])} ({report['limit_source']})"
           if report['limit_bytes'] else 'unknown')
  cache = f" (compile cache {report['compile_cache']})" if report.get('compile_cache') else ''
  return (f"compiled train step in {report.get('compile_seconds', 0):.1f}s{cache}; per device: "
          f"arguments {format_gib(report['argument_bytes'])}, "
          f"temporaries {format_gib(report['temp_bytes'])}, "
          f"peak {format_gib(report['peak_bytes'])} of {limit}"
          + (f"; host memory {format_gib(report['host_bytes'])} (offloaded)"
             if report.get('host_bytes') else ''))


def overshoot_message(report: dict) -> str | None:
  """Why the step in ``report`` cannot fit on a device, or ``None`` when it fits."""
  if not report['limit_bytes'] or report['peak_bytes'] <= report['limit_bytes']:
    return None
  over = report['peak_bytes'] - report['limit_bytes']
  return (f"The train step needs {format_gib(report['peak_bytes'])} per device but "
          f"{format_gib(report['limit_bytes'])} is available ({report['limit_source']}): over by "
          f'{format_gib(over)}. Shard further (mesh.fsdp, mesh.tensor), lower global_batch_size '
          'or seq_len, use grad_accum_steps or remat_policy=full.')


_COMPILER_OOM = re.compile(r'required for (?:HLO )?(\w+) \(([\d.]+)\s*([KMGT]i?B?)\)'
                           r'.*?available \w+ \(([\d.]+)\s*([KMGT]i?B?)\)', re.S)


def compiler_oom_message(error: Exception) -> str | None:
  """The one-line reason of a compiler that refused the step for lack of device memory (the
  TPU compiler's ``RESOURCE_EXHAUSTED ... CompileTimeHbmOom``), or ``None`` for other errors."""
  text = str(error)
  if 'RESOURCE_EXHAUSTED' not in text:
    return None
  found = _COMPILER_OOM.search(text)
  need = (f'{found.group(2)} {found.group(3)} of {found.group(1)} per device but '
          f'{found.group(4)} {found.group(5)} is available' if found else
          'more memory per device than there is')
  return (f'The compiler refused the train step: it needs {need}. Shard further (mesh.fsdp, '
          'mesh.tensor, mesh.expert), lower global_batch_size or seq_len, use grad_accum_steps, '
          'remat_policy=full or the host offloads (optimizer_memory_host_offload, '
          'parameter_memory_host_offload).')


__all__ = ['compiler_oom_message', 'device_memory_limit', 'format_gib', 'format_memory_report',
           'memory_report', 'overshoot_message']

"""Keep the host allocator from handing the CPU backend's step buffers back to the OS.

On the CPU backend every jitted step allocates its temporaries (hundreds of MB even for
a small model) with the C library's ``malloc`` and frees them at the end of the step.
glibc serves any block of 32 MB or more with a fresh ``mmap`` and unmaps it on
``free``, so the next step touches brand-new pages and pays a page fault and a zeroing
for every 4 KB of them: about 66,000 faults per ``cpu-tiny`` step and 261,000 per
``cpu-medium`` step, 10-20% of the step time on a 2-core VM (``benchmarks/RESULTS.md``).

:func:`keep_freed_host_memory` tells glibc (``mallopt``) to serve large blocks from its
heap, never to shrink the heap, and to give every thread the same arena, so that the
pages of one step are reused by the next. The price: memory freed by the process stays
mapped to it (reused by later allocations, not returned to the OS), which is why it is
only applied when JAX computes on the CPU.

Threads choose their arena at their first allocation, and XLA starts its worker threads
with the backend, so the setting only takes full effect before the first JAX
computation. Importing this module (the first thing ``import maxnnx`` does) therefore
applies it when the CPU will be JAX's backend (``JAX_PLATFORMS`` starts with ``cpu``, or
no accelerator plugin is installed). ``MAXNNX_KEEP_HOST_MEMORY=0`` leaves the allocator
alone, ``=1`` applies it whatever the backend. Off Linux with glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import sys

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER_TRIM = -1  # glibc: a trim threshold of -1 turns trimming off

ENV_VAR = 'MAXNNX_KEEP_HOST_MEMORY'

# Modules whose presence means JAX will pick an accelerator by default.
_ACCELERATOR_PLUGINS = ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax_rocm6_plugin',
                        'jax_rocm7_plugin', 'libtpu')

_state = {'applied': False, 'before_backend': None}


def _glibc():
  """The loaded glibc, or ``None`` when this is not Linux with glibc."""
  if not sys.platform.startswith('linux'):
    return None
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
  except OSError:
    return None
  # Only glibc has gnu_get_libc_version (musl's mallopt does nothing).
  return libc if hasattr(libc, 'gnu_get_libc_version') and hasattr(libc, 'mallopt') else None


def _backend_started() -> bool:
  """Whether JAX has already created a backend (and with it XLA's worker threads)."""
  bridge = sys.modules.get('jax._src.xla_bridge')
  return bool(bridge is not None and bridge.backends_are_initialized())


def cpu_is_default_backend() -> bool:
  """Whether JAX will compute on the CPU, decided without starting a backend.

  ``JAX_PLATFORMS`` (environment or ``jax.config``) decides when set; otherwise the CPU
  is the default unless a CUDA, ROCm or TPU plugin is installed.
  """
  platforms = os.environ.get('JAX_PLATFORMS', '')
  config = sys.modules.get('jax') and getattr(sys.modules['jax'], 'config', None)
  if config is not None:
    platforms = getattr(config, 'jax_platforms', None) or platforms
  if platforms:
    return platforms.split(',')[0].strip().lower() == 'cpu'
  return not any(importlib.util.find_spec(name) for name in _ACCELERATOR_PLUGINS)


def keep_freed_host_memory(*, force: bool = False) -> bool:
  """Make glibc keep freed memory mapped for reuse; return whether it was applied.

  Does nothing and returns ``False`` off glibc, when ``MAXNNX_KEEP_HOST_MEMORY=0``, or,
  unless ``force`` (or ``MAXNNX_KEEP_HOST_MEMORY=1``), when JAX will not compute on the
  CPU (:func:`cpu_is_default_backend`). Calling it again is harmless. Called after a JAX
  backend started, it still applies, but the threads that already allocated keep their
  own arenas and go on page-faulting; :func:`host_memory_status` tells which happened.
  """
  setting = os.environ.get(ENV_VAR, '').strip().lower()
  if setting in ('0', 'false', 'no', 'off'):
    return False
  force = force or setting in ('1', 'true', 'yes', 'on')
  libc = _glibc()
  if libc is None or not (force or cpu_is_default_backend()):
    return False
  if not _state['applied']:
    _state['before_backend'] = not _backend_started()
  ok = all(libc.mallopt(param, value) == 1 for param, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM)))
  _state['applied'] = _state['applied'] or ok
  return ok


def host_memory_status() -> dict:
  """``{'applied': bool, 'before_backend': bool | None}``: whether
  :func:`keep_freed_host_memory` took effect, and whether that was before JAX started a
  backend (only then do XLA's worker threads share the tuned arena)."""
  return dict(_state)


# At import, before any maxnnx module can start a JAX backend (see the module docstring).
keep_freed_host_memory()

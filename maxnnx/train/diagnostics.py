"""Profiles, HLO dumps and the persistent compilation cache of a training run.

* ``TrainConfig.profile='steps:10-15'`` traces those optimizer steps with
  ``jax.profiler`` into ``<profile_dir>/plugins/profile/<time>/<host>.xplane.pb``,
  the layout TensorBoard's profile plugin and XProf open
  (``tensorboard --logdir <profile_dir>`` or ``xprof <profile_dir>``).
* ``TrainConfig.dump_hlo=True`` writes the train step's jaxpr, StableHLO and
  optimized HLO text once, when it is compiled.
* ``TrainConfig.compile_cache=<dir>`` turns on JAX's persistent compilation
  cache, so a restarted run loads the compiled step instead of compiling it.

Files go to the directory the setting names or, by default, next to the
run's metrics (see :func:`run_directory`). Any of them may be a URL (``gs://``): a
profile is traced into a local directory and copied up when it stops, HLO text is
written through :mod:`maxnnx.paths`, and JAX opens a remote compilation cache itself.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import tempfile
from collections.abc import Iterator

import jax

from maxnnx import paths
from maxnnx.config import ConfigError

logger = logging.getLogger(__name__)

_PROFILE_SPEC = re.compile(r'steps:(\d+)(?:-(\d+))?')


def parse_profile_spec(spec: str) -> tuple[int, int]:
  """``'steps:10-15'`` -> ``(10, 15)``; ``'steps:7'`` -> ``(7, 7)``. Raises ConfigError."""
  match = _PROFILE_SPEC.fullmatch(spec.strip().replace(' ', ''))
  if match:
    first = int(match.group(1))
    last = int(match.group(2) or first)
    if 1 <= first <= last:
      return first, last
  raise ConfigError(f"TrainConfig.profile must be 'steps:FIRST-LAST' with 1 <= FIRST <= LAST "
                    f"(e.g. 'steps:10-15'), got {spec!r}.")


def run_directory(config) -> str:
  """Where a run's diagnostics go by default: the directory of ``metrics_jsonl``, else
  the parent of ``checkpoint_dir``, else ``tensorboard_dir``, else ``maxnnx_diagnostics``."""
  if config.metrics_jsonl:
    return paths.parent(config.metrics_jsonl)
  if config.checkpoint_dir:
    return paths.parent(config.checkpoint_dir.rstrip('/'))
  if config.tensorboard_dir:
    return config.tensorboard_dir
  return 'maxnnx_diagnostics'


def profile_directory(config) -> str:
  """``config.profile_dir``, or ``<run directory>/profile``."""
  return config.profile_dir or paths.join(run_directory(config), 'profile')


def hlo_directory(config) -> str:
  """``config.dump_hlo_dir``, or ``<run directory>/hlo``."""
  return config.dump_hlo_dir or paths.join(run_directory(config), 'hlo')


# -- profiling ------------------------------------------------------------------------------

class StepProfiler:
  """Starts a ``jax.profiler`` trace before step ``first`` and stops it after ``last``.

  Args:
    spec: a profile spec (:func:`parse_profile_spec`), or ``None`` for no profile.
    directory: the trace's log directory (TensorBoard ``--logdir``); at a URL the trace is
      written into a local directory and copied there when it stops.
  """

  def __init__(self, spec: str | None, directory: str):
    self.steps = parse_profile_spec(spec) if spec else None
    self.directory = directory
    self.active = False
    self._local: str | None = None  # where a trace bound for a URL is written first

  def before_step(self, step: int) -> None:
    """Call before running optimizer step ``step`` (1-based)."""
    if self.steps and step == self.steps[0] and not self.active:
      if paths.is_remote(self.directory):
        self._local = tempfile.mkdtemp(prefix='maxnnx-profile-')
      else:
        paths.makedirs(self.directory)
      jax.profiler.start_trace(self._local or self.directory)
      self.active = True

  def after_step(self, step: int, state=None) -> None:
    """Call after dispatching step ``step``; at the last one waits for ``state`` and stops."""
    if self.active and step >= self.steps[1]:
      self.stop(state)

  def stop(self, state=None) -> None:
    """Stop an active trace (after ``state`` is computed) and write it."""
    if not self.active:
      return
    if state is not None:
      jax.block_until_ready(state)
    jax.profiler.stop_trace()
    self.active = False
    if self._local is not None:
      paths.copy_tree_to(self._local, self.directory)
      shutil.rmtree(self._local, ignore_errors=True)
      self._local = None
    first, last = self.steps
    logger.warning('Wrote the profile of steps %d-%d to %s (open it with tensorboard --logdir '
                   '%s, or xprof).', first, last, self.directory, self.directory)


# -- HLO --------------------------------------------------------------------------------------

def dump_hlo(directory: str, name: str, traced, lowered, compiled) -> list[str]:
  """Write ``name``'s jaxpr, StableHLO, HLO before and after XLA's passes; returns paths."""
  paths.makedirs(directory)
  texts = {
      f'{name}.jaxpr.txt': str(traced.jaxpr) if traced is not None else None,
      f'{name}.stablehlo.mlir': lowered.as_text(),
      f'{name}.hlo.txt': lowered.as_text(dialect='hlo'),
      f'{name}.optimized.hlo.txt': compiled.as_text(),
  }
  written = []
  for filename, text in texts.items():
    if text:
      path = paths.join(directory, filename)
      paths.write_text(path, text)
      written.append(path)
  logger.warning('Wrote the jaxpr and HLO of %s to %s.', name, directory)
  return written


# -- the persistent compilation cache ----------------------------------------------------------

def enable_compile_cache(directory: str) -> None:
  """Use ``directory`` (local or a URL) as JAX's persistent compilation cache, caching every
  compile."""
  from jax.experimental.compilation_cache import compilation_cache  # noqa: PLC0415
  directory = paths.absolute(directory)
  if jax.config.jax_compilation_cache_dir == directory:
    return
  paths.makedirs(directory)
  jax.config.update('jax_compilation_cache_dir', directory)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
  compilation_cache.reset_cache()  # earlier compiles in this process may have checked it off


class CacheEvents:
  """Counts persistent-cache hits and misses while the ``watch()`` block runs."""

  def __init__(self):
    self.hits = self.misses = 0

  def _listen(self, event: str, **_) -> None:
    if event == '/jax/compilation_cache/cache_hits':
      self.hits += 1
    elif event == '/jax/compilation_cache/cache_misses':
      self.misses += 1

  @contextlib.contextmanager
  def watch(self) -> Iterator[CacheEvents]:
    """Listen to JAX's compilation-cache events inside the block."""
    jax.monitoring.register_event_listener(self._listen)
    try:
      yield self
    finally:
      jax.monitoring.unregister_event_listener(self._listen)

  @property
  def outcome(self) -> str | None:
    """``'hit'``, ``'miss'`` or ``None`` (the cache was not consulted)."""
    return 'hit' if self.hits else 'miss' if self.misses else None


__all__ = ['CacheEvents', 'StepProfiler', 'dump_hlo', 'enable_compile_cache', 'hlo_directory',
           'parse_profile_spec', 'profile_directory', 'run_directory']

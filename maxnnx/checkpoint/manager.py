"""Fault-tolerant training checkpoints on orbax.

A checkpoint directory holds one sub-directory per saved step (``<dir>/<step>/``)
with three items: ``state`` (model and optimizer arrays, each written from the
devices that own its shards), ``extra`` (the trainer's small replicated
arrays) and ``meta`` (JSON: step, data-iterator position, history length,
model config and a checksum of every array).

Why this survives a crash at any moment:

* orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it to
  ``<step>`` only once every file is written, so a half-written step never
  looks like a checkpoint, and an older step is never written over;
* saves are asynchronous: ``save`` returns once the arrays are on the host,
  and the files are written while training goes on;
* restore verifies every array against the checksums in ``meta`` (computed on
  the devices when the step was saved). A step that fails to load or to verify
  is logged with its step and the problem, moved aside to ``corrupt-<step>``,
  and the previous step is tried.

The directory may be a URL (``gs://bucket/run/checkpoints``): it is handed to orbax as it is
(orbax and tensorstore write to Cloud Storage themselves); a local path is made absolute.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from maxnnx import paths

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


class CheckpointError(ValueError):
  """A checkpoint cannot be saved or restored (named with its directory and step)."""


# -- checksums -----------------------------------------------------------------------------


_UNSIGNED_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32}  # raw bits of each item size


def _leaf_bits(x: jax.Array) -> jax.Array:
  """Sum of the array's raw bits as uint32 (wrapping): exact whatever the sharding."""
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    bits = jax.lax.bitcast_convert_type(x, _UNSIGNED_OF_SIZE[x.dtype.itemsize])
    bits = bits.astype(jnp.uint32)
  return jnp.sum(bits, dtype=jnp.uint32)


@jax.jit
def _bit_sums(leaves: list) -> list:
  return [_leaf_bits(x) for x in leaves]


def host_checksum(array: np.ndarray) -> int:
  """:func:`checksums`' value of one host (NumPy) array, computed on the host."""
  array = np.asarray(array)
  if array.dtype == np.bool_:
    bits = array.astype(np.uint32)
  else:
    bits = np.ascontiguousarray(array).view(_UNSIGNED_OF_SIZE[array.dtype.itemsize])
    bits = bits.astype(np.uint32, copy=False)
  return int(np.sum(bits, dtype=np.uint32))


def checksums(tree: Any) -> dict[str, int]:
  """``{path: sum of raw bits mod 2**32}`` for every array in ``tree``.

  Integer sums are order-independent, so the value does not depend on how the
  array is sharded, and a changed byte shows up in its array's sum.
  """
  paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(tree)[0]) if jax.tree.leaves(
      tree) else ((), ())
  sums = jax.device_get(_bit_sums(list(leaves))) if leaves else []
  return {jax.tree_util.keystr(p): int(s) for p, s in zip(paths, sums)}


# -- the manager ---------------------------------------------------------------------------


class CheckpointManager:
  """Periodic, asynchronous, verified checkpoints of a training run.

  Args:
    directory: where the steps go (created if missing): a local path or a URL.
    keep: how many of the newest steps to keep (older ones are deleted once a
      newer one is complete).
    async_save: write files in the background (``wait`` blocks until done).
  """

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    if keep < 1:
      raise ValueError(f'keep must be >= 1 checkpoints, got {keep}.')
    self.directory = paths.absolute(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep,
                                           enable_async_checkpointing=async_save,
                                           cleanup_tmp_directories=True, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  # -- steps ---------------------------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Complete steps on disk (half-written ones never appear), oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest complete step, or ``None`` when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  # -- saving --------------------------------------------------------------------------------

  def save(self, step: int, state: Any, extra: dict | None, meta: dict | None = None) -> bool:
    """Start saving ``step``; returns ``False`` when that step is already on disk.

    ``state`` is an ``nnx.State`` (or any pytree) of sharded arrays, ``extra``
    a dict of small arrays, ``meta`` JSON-serialisable data (data-iterator
    state, history length…). Only the device-to-host copy blocks.
    """
    if step in self.all_steps():
      return False
    pure = _pure(state)
    items = {'state': ocp.args.StandardSave(pure)}
    sums = {'state': checksums(pure)}
    if extra:
      items['extra'], sums['extra'] = ocp.args.StandardSave(extra), checksums(extra)
    record = {**(meta or {}), 'step': int(step), 'format': FORMAT_VERSION, 'checksums': sums}
    _quiet_echoes(self.directory)  # a full disk fails one write, and every other one echoes it
    with self._storage_errors():  # also the previous save's, which this one waits for
      self._manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(record), **items))
    return True

  def wait(self) -> None:
    """Block until every started save is on disk."""
    with self._storage_errors():
      self._manager.wait_until_finished()

  def close(self) -> None:
    """Wait for pending saves and release orbax's threads."""
    with self._storage_errors():
      self._manager.close()

  @contextlib.contextmanager
  def _storage_errors(self):
    """Raise a write that the file system refused (tensorstore words it as ``RESOURCE_EXHAUSTED:
    ... [os_error_code='28']``) as the ``OSError`` it is, naming the step's directory."""
    try:
      yield
    except Exception as e:
      os_error = _os_error_of(e, self.directory)
      if os_error is None:
        raise
      raise os_error from e

  # -- restoring -----------------------------------------------------------------------------

  def read_meta(self, step: int) -> dict:
    """The JSON ``meta`` item of ``step``."""
    restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    meta = restored.meta
    if not isinstance(meta, dict) or meta.get('step') != step or 'checksums' not in meta:
      raise CheckpointError(f'{self._step_dir(step)}: meta is not a maxnnx checkpoint record.')
    return meta

  def restore(self, abstract_state: Any, abstract_extra: dict, step: int | None = None
              ) -> tuple[int, Any, dict, dict] | None:
    """``(step, state, extra, meta)`` of the newest good step, or ``None`` if there is none.

    ``abstract_state`` / ``abstract_extra`` give the structure, dtypes and
    (concrete) shardings to restore into. With ``step=None`` a step that fails
    to load or to verify is reported with a warning, moved aside to
    ``corrupt-<step>`` and the one before it is tried; an explicit ``step``
    that fails raises :class:`CheckpointError`.
    """
    candidates = [step] if step is not None else list(reversed(self.all_steps()))
    if step is not None and step not in self.all_steps():
      raise CheckpointError(f'{self.directory}: no complete checkpoint of step {step}; '
                            f'have {self.all_steps()}.')
    for candidate in candidates:
      try:
        return self._restore_step(candidate, abstract_state, abstract_extra)
      except Exception as e:  # noqa: BLE001 (any failure of one step means: use an older one)
        problem = f'{type(e).__name__}: {_first_line(e)}'
        if step is not None:
          raise CheckpointError(f'{self._step_dir(candidate)} cannot be restored: {problem}'
                                ) from e
        _quiet_echoes(self.directory)
        logger.warning('Checkpoint step %d in %s is unusable (%s); moving it to corrupt-%d '
                       'and falling back to the previous checkpoint.', candidate,
                       self.directory, problem, candidate)
        self._quarantine(candidate)
    return None

  def _restore_step(self, step: int, abstract_state, abstract_extra):
    self._check_files(step)
    meta = self.read_meta(step)
    abstract_pure = _pure(abstract_state)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_pure),
        extra=ocp.args.StandardRestore(abstract_extra)))
    for name, tree in (('state', restored.state), ('extra', restored.extra)):
      expected, actual = meta['checksums'][name], checksums(tree)
      bad = sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))
      if bad:
        shown = ', '.join(bad[:3]) + (' …' if len(bad) > 3 else '')
        raise CheckpointError(f"{len(bad)} array(s) of '{name}' fail their checksum: {shown}")
    state = restored.state
    if isinstance(abstract_state, nnx.State):
      state = jax.tree.map(lambda x: x, abstract_state)  # fresh Variables
      nnx.replace_by_pure_dict(state, restored.state)
    return step, state, dict(restored.extra), meta

  def _check_files(self, step: int) -> None:
    """Fail early, before any read is started, when an item's index files are missing."""
    for item in ('meta', 'state', 'extra'):
      path = paths.join(self._step_dir(step), item)
      needed = ['metadata'] if item == 'meta' else ['_METADATA', 'manifest.ocdbt']
      missing = [name for name in needed if not paths.exists(paths.join(path, name))]
      if missing:
        raise CheckpointError(f'missing file {paths.join(path, missing[0])}')

  def _step_dir(self, step: int) -> str:
    return paths.join(self.directory, str(step))

  def _quarantine(self, step: int) -> None:
    if jax.process_index() == 0:
      target = paths.join(self.directory, f'corrupt-{step}')
      suffix = 0
      while paths.exists(target):
        suffix += 1
        target = paths.join(self.directory, f'corrupt-{step}.{suffix}')
      paths.rename(self._step_dir(step), target)
    self._manager.reload()


_QUIETED: set[str] = set()


def _quiet_echoes(directory: str) -> None:
  """Silence the echoes of a failed save to, or restore from, ``directory``.

  When one array of a step fails to write (a full disk) or to load, orbax's other writes and
  reads of that step end later in the background and report themselves: each of its threads
  logs the error with a traceback through ``absl``, ``Future exception was never retrieved``
  comes through ``asyncio``, ``Event loop is closed`` as unraisable errors and writes never
  started as ``coroutine ... was never awaited`` warnings at exit, dozens of
  tracebacks in all. The failure itself reaches the caller once (a save's from :meth:`wait` or
  the next save, a restore's as a warning or :class:`CheckpointError`), so these are dropped;
  anything that does not name ``directory`` passes through.
  """
  if directory in _QUIETED:
    return
  _QUIETED.add(directory)

  def keep_asyncio(record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    text = f'{record.getMessage()} {error}'
    return not ('never retrieved' in text and directory in text)

  def keep_absl(record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR or not record.exc_info:
      return True
    return not any(directory in str(e) for e in paths.exception_chain(record.exc_info[1]))

  logging.getLogger('asyncio').addFilter(keep_asyncio)
  logging.getLogger('absl').addFilter(keep_absl)
  # a write still queued when the failure ends the run is dropped unawaited at exit
  warnings.filterwarnings('ignore', category=RuntimeWarning,
                          message=r"coroutine '.*write_fragment' was never awaited")
  if not getattr(sys.unraisablehook, 'maxnnx_quiet', False):
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
      value = unraisable.exc_value
      if isinstance(value, RuntimeError) and str(value) == 'Event loop is closed':
        return
      previous(unraisable)

    hook.maxnnx_quiet = True
    sys.unraisablehook = hook


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _os_error_of(error: BaseException, directory: str) -> OSError | None:
  """The ``OSError`` that ``error`` carries as text, with the step directory it names, or
  ``None`` when it is already an ``OSError`` or carries none."""
  for e in paths.exception_chain(error):
    if isinstance(e, OSError):
      return None
    code = _OS_ERROR_CODE.search(str(e))
    if code:
      number = int(code.group(1))
      step = re.search(re.escape(directory.rstrip('/')) + r'/(\d+)', str(e))
      path = f'{directory.rstrip("/")}/{step.group(1)}' if step else directory
      return OSError(number, os.strerror(number), path)
  return None


def _pure(state: Any) -> Any:
  return nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state


def _first_line(error: BaseException) -> str:
  text = str(error).strip().splitlines()
  return text[0][:300] if text else repr(error)


def read_meta(directory: str, step: int | None = None) -> dict:
  """The JSON record of checkpoint ``step`` (default: the newest complete one)."""
  manager = CheckpointManager(directory, async_save=False)
  try:
    steps = manager.all_steps()
    if not steps:
      raise CheckpointError(f'{directory}: no complete checkpoint found.')
    step = steps[-1] if step is None else step
    if step not in steps:
      raise CheckpointError(f'{directory}: no checkpoint of step {step}; have {steps}.')
    return manager.read_meta(step)
  finally:
    manager.close()


def restore_params(directory: str, abstract_params: Any, step: int | None = None
                   ) -> tuple[Any, dict]:
  """Only the model parameters of a checkpoint: ``(pure dict, meta)``.

  ``abstract_params`` is the pure-dict tree of ``ShapeDtypeStruct``s of the
  parameters (their shardings are used when set), or a function from the
  checkpoint's meta record to that tree; the optimizer state is never read.
  Works on training checkpoints and on parameter-only ones (``state[0]`` is
  the model in both). A relative ``directory`` is taken from the working directory.
  """
  directory = paths.absolute(directory)  # orbax reads absolute paths only
  meta = read_meta(directory, step)
  step = meta['step']
  if callable(abstract_params):
    abstract_params = abstract_params(meta)
  item = {0: abstract_params}
  restore_args = ocp.checkpoint_utils.construct_restore_args(item)
  checkpointer = ocp.PyTreeCheckpointer()
  restored = checkpointer.restore(
      paths.join(directory, str(step), 'state'),
      args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
  params = restored[0] if 0 in restored else restored['0']
  expected = meta['checksums']['state']
  actual = checksums({0: params})
  bad = sorted(k for k in actual if expected.get(k) != actual[k])
  if bad:
    raise CheckpointError(f'{directory} step {step}: {len(bad)} parameter array(s) fail their '
                          f'checksum: {", ".join(bad[:3])}.')
  return params, meta


__all__ = ['FORMAT_VERSION', 'CheckpointError', 'CheckpointManager', 'checksums', 'host_checksum',
           'read_meta', 'restore_params']

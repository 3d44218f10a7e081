"""Emergency checkpoints: frequent per-process local copies, each replicated on a peer process.

Besides the persistent checkpoints of :mod:`maxnnx.checkpoint.manager` (slow storage, saved
every ``checkpoint_every`` steps), a run with ``enable_emergency_checkpoint`` saves every
``local_checkpoint_period`` steps to fast local disks: each process writes only the shards its
devices own, and the same files once more into the directory of its peer, process
``(i + 1) % n``, so that losing one host's disk (or the host) loses no step.

Layout of ``local_checkpoint_directory``, which every process sees whole::

  process-<k>/<step>/shards-<i>.npz    the shards of process i, kept on process k's disk
  process-<k>/<step>/shards-<i>.json   their index: step, process count, which part of which
                                       array each shard is, checksums, the trainer's record

``process-<k>`` is process ``k``'s disk (on a cluster, each host's local disk mounted there on
every host; in a one-machine test, plain directories). ``shards-<i>`` sits in ``process-i``
(its own copy) and in ``process-<peer of i>`` (the replica). The ``.json`` index is written
last, after the ``.npz`` is on disk, and records its size: a copy is complete when both are
there and agree. A step is complete when every process of the run that saved it has a
complete copy somewhere; a restore reads each array's parts from whichever copies hold them,
so it fills any mesh: the same processes, or fewer (a restart after losing hosts).

orbax's ``experimental.emergency.CheckpointManager`` (0.12) is not used: it keeps local copies
only on the processes outside the first data-parallel replica (the first writes only the
persistent checkpoint), recovers a lost local copy by broadcasting from another replica (so the
state must be whole in every replica: no FSDP across hosts, and at least two replicas), is built
around one ``state`` item, and restores its local copies onto the processes' previous device
layout; a restart on fewer processes would always fall back to the persistent checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from maxnnx.checkpoint.manager import CheckpointError, host_checksum

logger = logging.getLogger(__name__)

LOCAL_FORMAT = 1
_STEP = re.compile(r'\d+')
_PROCESS = re.compile(r'process-(\d+)')


def peer_of(process: int, count: int) -> int:
  """The process whose local disk keeps the replica of ``process``'s shards."""
  return (process + 1) % count


@dataclass(frozen=True)
class LocalStep:
  """A complete local step.

  Attributes:
    step: the step.
    process_count: how many processes saved it.
    copies: ``{process i: directory holding a complete copy of shards-i}``, the own copy
      preferred over the replica.
  """

  step: int
  process_count: int
  copies: dict[int, str]


def choose_source(local_steps: list[int], persistent_steps: list[int]
                  ) -> tuple[str, int] | None:
  """Where to resume from: ``('local', step)`` or ``('persistent', step)``, the newest step
  complete in either (local on a tie: it is the faster read), or ``None`` when both are
  empty."""
  local = max(local_steps, default=None)
  persistent = max(persistent_steps, default=None)
  if local is None and persistent is None:
    return None
  if persistent is None or (local is not None and local >= persistent):
    return 'local', local
  return 'persistent', persistent


class LocalCheckpoints:
  """The local, peer-replicated checkpoints of one process.

  Args:
    directory: ``local_checkpoint_directory`` (a local path; created if missing).
    keep: how many of the newest steps each process keeps on its disk.
    process_index: this process (default ``jax.process_index()``).
    process_count: the processes of the run (default ``jax.process_count()``).
  """

  def __init__(self, directory: str, *, keep: int = 2, process_index: int | None = None,
               process_count: int | None = None):
    if '://' in directory:
      raise ValueError(f'local_checkpoint_directory={directory!r} must be a local path (a '
                       'host disk), not a URL; the persistent checkpoint_dir may be a URL.')
    if keep < 1:
      raise ValueError(f'keep must be >= 1 local checkpoints, got {keep}.')
    self.directory = os.path.abspath(directory)
    self.keep = keep
    self.process = jax.process_index() if process_index is None else process_index
    self.count = jax.process_count() if process_count is None else process_count

  def own_directory(self, process: int | None = None) -> str:
    """``process-<k>``: the local disk of process ``k`` (default: this one)."""
    return os.path.join(self.directory, f'process-{self.process if process is None else process}')

  # -- saving --------------------------------------------------------------------------------

  def save(self, step: int, state: Any, extra: dict | None, meta: dict | None = None) -> None:
    """Write this process's shards of ``state`` and ``extra`` for ``step`` to its own disk and
    to its peer's, then drop its steps older than the ``keep`` newest. Synchronous: returns
    once both copies are on disk."""
    tree = {'state': _pure(state), 'extra': dict(extra or {})}
    arrays, index = {}, {'format': LOCAL_FORMAT, 'step': int(step), 'process': self.process,
                         'process_count': self.count, 'meta': meta or {}, 'pieces': []}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      name = jax.tree_util.keystr(path)
      for shard in _owned_shards(leaf):
        data = np.asarray(shard.data)
        bounds = _bounds(shard.index, leaf.shape)
        key = f'a{len(arrays)}'
        arrays[key] = _raw(data)
        index['pieces'].append({'leaf': name, 'key': key, 'shape': list(leaf.shape),
                                'dtype': str(np.dtype(leaf.dtype)), 'bounds': bounds,
                                'checksum': host_checksum(data)})
    own = os.path.join(self.own_directory(), str(step))
    _write_copy(own, self.process, arrays, index)
    peer = peer_of(self.process, self.count)
    if peer != self.process:
      target = os.path.join(self.own_directory(peer), str(step))
      os.makedirs(target, exist_ok=True)
      for suffix in ('.npz', '.json'):  # the index last: a copy is complete once it is there
        name = f'shards-{self.process}{suffix}'
        _atomic_copy(os.path.join(own, name), os.path.join(target, name))
    self._prune()

  def _prune(self) -> None:
    steps = sorted(_steps_in(self.own_directory()))
    for old in steps[:-self.keep]:
      shutil.rmtree(os.path.join(self.own_directory(), str(old)), ignore_errors=True)
    if self.process == 0:  # the disks of processes a smaller restart no longer has
      for process, path in _process_dirs(self.directory):
        if process >= self.count:
          for old in sorted(_steps_in(path))[:-self.keep]:
            shutil.rmtree(os.path.join(path, str(old)), ignore_errors=True)

  def drop_after(self, step: int) -> None:
    """Delete every copy of steps newer than ``step`` (what a killed run left after the step a
    restart resumes from, which the resumed run will save again). Process 0 does it."""
    if self.process != 0:
      return
    for _, path in _process_dirs(self.directory):
      for newer in _steps_in(path):
        if newer > step:
          shutil.rmtree(os.path.join(path, str(newer)), ignore_errors=True)

  # -- finding steps -------------------------------------------------------------------------

  def complete_steps(self) -> dict[int, LocalStep]:
    """``{step: LocalStep}`` of every step whose every process's shards have a complete copy
    in some process's directory; an incomplete copy (a save cut short) is skipped."""
    found: dict[int, dict[int, dict[int, str]]] = {}  # step -> process count -> owner -> dir
    for holder, path in _process_dirs(self.directory):
      for step in _steps_in(path):
        step_dir = os.path.join(path, str(step))
        for name in os.listdir(step_dir):
          match = re.fullmatch(r'shards-(\d+)\.json', name)
          if not match:
            continue
          owner = int(match.group(1))
          index = _complete_index(step_dir, owner, step)
          if index is None:
            continue
          copies = found.setdefault(step, {}).setdefault(index['process_count'], {})
          if owner not in copies or holder == owner:  # prefer the owner's own disk
            copies[owner] = step_dir
    complete = {}
    for step, by_count in found.items():
      for count, copies in sorted(by_count.items()):
        if set(copies) == set(range(count)):
          complete[step] = LocalStep(step, count, dict(sorted(copies.items())))
    return dict(sorted(complete.items()))

  def latest_step(self) -> int | None:
    """The newest complete step, or ``None``."""
    steps = self.complete_steps()
    return max(steps) if steps else None

  # -- restoring -----------------------------------------------------------------------------

  def restore(self, step: int, abstract_state: Any, abstract_extra: dict
              ) -> tuple[Any, dict, dict]:
    """``(state, extra, meta)`` of complete step ``step``, laid out as the abstract trees say
    (their shapes, dtypes and shardings: any mesh, any number of processes).

    Each process reads only the parts of the copies that overlap its own shards, and checks
    each part against its checksum. ``meta`` is process 0's record of that step. A process
    whose own copy of the step is missing (its disk was lost) copies the replica back.
    """
    local = self.complete_steps().get(step)
    if local is None:
      raise CheckpointError(f'{self.directory}: step {step} has no complete local copy.')
    indexes = {owner: _read_index(os.path.join(path, f'shards-{owner}.json'))
               for owner, path in local.copies.items()}
    pieces: dict[str, list] = {}
    for owner, index in indexes.items():
      archive = _LazyArchive(os.path.join(local.copies[owner], f'shards-{owner}.npz'))
      for piece in index['pieces']:
        pieces.setdefault(piece['leaf'], []).append((piece, archive))
    abstract = {'state': _pure(abstract_state), 'extra': dict(abstract_extra)}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    restored = []
    for path, like in leaves:
      name = jax.tree_util.keystr(path)
      if name not in pieces:
        raise CheckpointError(f'{local.copies[0]}: step {step} has no array {name}.')
      restored.append(_assemble(name, like, pieces[name], step))
    tree = jax.tree_util.tree_unflatten(treedef, restored)
    state = tree['state']
    if isinstance(abstract_state, nnx.State):
      state = jax.tree.map(lambda x: x, abstract_state)  # fresh Variables
      nnx.replace_by_pure_dict(state, tree['state'])
    self._heal(local)
    return state, tree['extra'], indexes[0]['meta']

  def _heal(self, local: LocalStep) -> None:
    """Copy this process's shards back from the replica when its own copy is gone."""
    own = os.path.join(self.own_directory(), str(local.step))
    source = local.copies.get(self.process)
    if local.process_count != self.count or source is None or source == own:
      return
    os.makedirs(own, exist_ok=True)
    for suffix in ('.npz', '.json'):
      name = f'shards-{self.process}{suffix}'
      _atomic_copy(os.path.join(source, name), os.path.join(own, name))
    logger.info('Local checkpoint step %d: copied process %d\'s shards back from the replica '
                'in %s.', local.step, self.process, source)


# -- helpers ----------------------------------------------------------------------------------


def _pure(state: Any) -> Any:
  return nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state


def _owned_shards(leaf) -> list:
  """The shards of ``leaf`` this process writes: its addressable ones with replica id 0 (over
  all processes, each part of the array exactly once)."""
  if not isinstance(leaf, jax.Array):
    leaf = jax.numpy.asarray(leaf)
    return [leaf.addressable_shards[0]] if jax.process_index() == 0 else []
  return [s for s in leaf.addressable_shards if s.replica_id == 0]


def _bounds(index: tuple, shape: tuple) -> list[list[int]]:
  return [[s.start or 0, n if s.stop is None else s.stop] for s, n in zip(index, shape)]


def _raw(data: np.ndarray) -> np.ndarray:
  """``data``'s raw bits as unsigned integers (npz keeps no bfloat16)."""
  data = np.ascontiguousarray(data)
  return data.view(np.uint8) if data.dtype == np.bool_ else data.view(f'u{data.dtype.itemsize}')


def _write_copy(step_dir: str, process: int, arrays: dict, index: dict) -> None:
  os.makedirs(step_dir, exist_ok=True)
  archive = os.path.join(step_dir, f'shards-{process}.npz')
  with open(archive + '.tmp', 'wb') as f:
    np.savez(f, **arrays)
    f.flush()
    os.fsync(f.fileno())
  os.replace(archive + '.tmp', archive)
  index['bytes'] = os.path.getsize(archive)
  _atomic_write(os.path.join(step_dir, f'shards-{process}.json'), json.dumps(index).encode())


def _atomic_write(path: str, data: bytes) -> None:
  with open(path + '.tmp', 'wb') as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + '.tmp', path)


def _atomic_copy(source: str, target: str) -> None:
  shutil.copyfile(source, target + '.tmp')
  with open(target + '.tmp', 'rb+') as f:
    os.fsync(f.fileno())
  os.replace(target + '.tmp', target)


def _process_dirs(directory: str) -> list[tuple[int, str]]:
  if not os.path.isdir(directory):
    return []
  found = [(int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
           if (m := _PROCESS.fullmatch(name))]
  return sorted(p for p in found if os.path.isdir(p[1]))


def _steps_in(path: str) -> list[int]:
  if not os.path.isdir(path):
    return []
  return [int(name) for name in os.listdir(path)
          if _STEP.fullmatch(name) and os.path.isdir(os.path.join(path, name))]


def _read_index(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def _complete_index(step_dir: str, owner: int, step: int) -> dict | None:
  """The index of ``shards-<owner>`` in ``step_dir`` when the copy is complete, else ``None``."""
  try:
    index = _read_index(os.path.join(step_dir, f'shards-{owner}.json'))
    size = os.path.getsize(os.path.join(step_dir, f'shards-{owner}.npz'))
  except (OSError, ValueError):
    return None
  if (not isinstance(index, dict) or index.get('format') != LOCAL_FORMAT
      or index.get('step') != step or index.get('process') != owner
      or index.get('bytes') != size or not isinstance(index.get('process_count'), int)):
    return None
  return index


class _LazyArchive:
  """An ``.npz`` opened on first use, each array read once."""

  def __init__(self, path: str):
    self.path, self._file, self._cache = path, None, {}

  def get(self, key: str) -> np.ndarray:
    if key not in self._cache:
      if self._file is None:
        self._file = np.load(self.path)
      self._cache[key] = self._file[key]
    return self._cache[key]


def _assemble(name: str, like, pieces: list, step: int) -> jax.Array:
  """The array ``like`` describes, each of this process's shards cut from the saved parts."""
  shape = tuple(like.shape)
  dtype = np.dtype(like.dtype)
  checked: set[int] = set()

  def part(piece, archive) -> np.ndarray:
    if list(piece['shape']) != list(shape) or np.dtype(piece['dtype']) != dtype:
      raise CheckpointError(f'local checkpoint step {step}: {name} was saved as '
                            f'{piece["dtype"]}{piece["shape"]}, expected {dtype}{list(shape)}.')
    data = archive.get(piece['key']).view(dtype)
    data = data.reshape([b - a for a, b in piece['bounds']])
    if id(piece) not in checked:
      if host_checksum(data) != piece['checksum']:
        raise CheckpointError(f'{archive.path}: {name} fails its checksum (step {step}).')
      checked.add(id(piece))
    return data

  def fill(index) -> np.ndarray:
    bounds = _bounds(index, shape)
    out = np.empty([b - a for a, b in bounds], dtype)
    covered = 0
    for piece, archive in pieces:
      low = [max(a, pa) for (a, _), (pa, _) in zip(bounds, piece['bounds'])]
      high = [min(b, pb) for (_, b), (_, pb) in zip(bounds, piece['bounds'])]
      if any(lo >= hi for lo, hi in zip(low, high)):
        continue
      source = part(piece, archive)
      out[tuple(slice(lo - a, hi - a) for lo, hi, (a, _) in zip(low, high, bounds))] = source[
          tuple(slice(lo - pa, hi - pa) for lo, hi, (pa, _) in zip(low, high, piece['bounds']))]
      covered += math.prod(hi - lo for lo, hi in zip(low, high))
    if covered != out.size:
      raise CheckpointError(f'local checkpoint step {step}: the saved parts of {name} cover '
                            f'{covered} of the {out.size} elements of a shard.')
    return out

  sharding = getattr(like, 'sharding', None)
  if sharding is None:
    return jax.numpy.asarray(fill(tuple(slice(None) for _ in shape)))
  return jax.make_array_from_callback(shape, sharding, fill)


__all__ = ['LOCAL_FORMAT', 'LocalCheckpoints', 'LocalStep', 'choose_source', 'peer_of']

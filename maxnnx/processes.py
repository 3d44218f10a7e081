"""Small collectives for multi-process runs, usable from every layer of the package.

A multi-process run (``jax.distributed``; see :mod:`maxnnx.train.distributed`) has every
process run the same program. These helpers move host data between the processes; each is a
collective (every process calls it, in the same order) and costs nothing with one process.
"""

from __future__ import annotations

import jax
import numpy as np


def is_primary() -> bool:
  """Whether this is process 0, the one that prints and writes a run's shared files."""
  return jax.process_index() == 0


def broadcast_bytes(data: bytes | None) -> bytes:
  """Process 0's ``data`` on every process (a file that only process 0 made, e.g. a trained
  tokenizer); ``data`` is ignored on the others. One process: ``data`` as is."""
  if jax.process_count() == 1:
    return data
  from jax.experimental import multihost_utils  # noqa: PLC0415
  size = int(multihost_utils.broadcast_one_to_all(
      np.asarray(len(data) if is_primary() else 0, np.int64)))
  buffer = np.frombuffer(data, np.uint8) if is_primary() else np.zeros(size, np.uint8)
  return np.asarray(multihost_utils.broadcast_one_to_all(buffer), np.uint8).tobytes()


def allgather_bytes(data: bytes) -> list[bytes]:
  """Every process's ``data``, in process order, on every process. One process: ``[data]``."""
  if jax.process_count() == 1:
    return [data]
  from jax.experimental import multihost_utils  # noqa: PLC0415
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([len(data)], np.int64)))
  sizes = sizes.reshape(-1)
  buffer = np.zeros(int(sizes.max()), np.uint8)
  buffer[:len(data)] = np.frombuffer(data, np.uint8)
  gathered = np.asarray(multihost_utils.process_allgather(buffer[None]))
  gathered = gathered.reshape(len(sizes), -1)
  return [gathered[i, :int(n)].tobytes() for i, n in enumerate(sizes)]


def host_value(array) -> np.ndarray:
  """The whole value of ``array`` as a NumPy array on this host.

  A jax array that spans several processes' devices is gathered from all of them (a
  collective: every process calls it for the same array); anything else is fetched as is.
  """
  if isinstance(array, jax.Array) and not array.is_fully_addressable:
    from jax.experimental import multihost_utils  # noqa: PLC0415
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
  return np.asarray(jax.device_get(array))


def place_host_value(host: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
  """``host``, the whole value (the same on every process), as an array on ``sharding``.

  Each process places only its own shards, with no transfer or check between processes
  (the inverse of :func:`host_value`). ``sharding=None``: on the default device,
  uncommitted, as ``jnp.asarray`` places it.
  """
  if sharding is None:
    return jax.device_put(host)
  if sharding.is_fully_addressable:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  # A CPU device may keep an aligned host array as its buffer instead of copying it; a slice
  # kept so would keep the whole of ``host`` alive in a process that holds only its share.
  return jax.make_array_from_callback(host.shape, sharding,
                                      lambda index: np.array(host[index], copy=True))


def barrier(name: str) -> None:
  """Wait until every process has reached the barrier ``name`` (nothing with one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # noqa: PLC0415
    multihost_utils.sync_global_devices(name)


__all__ = ['allgather_bytes', 'barrier', 'broadcast_bytes', 'host_value', 'is_primary']

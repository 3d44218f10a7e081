"""Multi-host start-up: ``jax.distributed`` from arguments or the environment.

Every process of a multi-host run calls :func:`initialize` before touching
devices. Arguments win; otherwise ``MAXNNX_COORDINATOR_ADDRESS``,
``MAXNNX_NUM_PROCESSES`` and ``MAXNNX_PROCESS_ID`` are read; otherwise, on a
cluster JAX recognises (SLURM, Kubernetes JobSet, TPU pods…),
``jax.distributed.initialize()`` discovers everything itself. A single process
with none of these set is left alone.
"""

from __future__ import annotations

import os

import jax

from maxnnx.processes import broadcast_bytes, host_value, is_primary


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False) -> bool:
  """Join a multi-process run; returns ``True`` when ``jax.distributed`` was started.

  Args:
    coordinator_address: ``host:port`` of process 0's coordinator.
    num_processes: how many processes take part.
    process_id: this process's rank in ``[0, num_processes)``.
    auto: with nothing given, still call ``jax.distributed.initialize()`` so it
      can discover a cluster environment.
  """
  env = os.environ
  coordinator_address = coordinator_address or env.get('MAXNNX_COORDINATOR_ADDRESS')
  if num_processes is None and env.get('MAXNNX_NUM_PROCESSES'):
    num_processes = int(env['MAXNNX_NUM_PROCESSES'])
  if process_id is None and env.get('MAXNNX_PROCESS_ID'):
    process_id = int(env['MAXNNX_PROCESS_ID'])
  given = (coordinator_address, num_processes, process_id)
  if all(v is None for v in given):
    if auto:
      jax.distributed.initialize()
      return True
    return False
  if any(v is None for v in given):
    raise ValueError('A multi-process run needs coordinator_address, num_processes and '
                     f'process_id together; got {dict(zip(("coordinator_address", "num_processes", "process_id"), given))}.')  # noqa: E501
  if not 0 <= process_id < num_processes:
    raise ValueError(f'process_id {process_id} is outside [0, num_processes={num_processes}).')
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)
  return True


def host_local_model(model, variables=None):
  """A copy of ``model`` whose parameters (or its ``variables``, an nnx filter such as
  ``nnx.LoRAParam``) are whole NumPy arrays on every process.

  In a multi-process run parameters are sharded over every process's devices and no
  process can read them alone; this gathers them (a collective: every process calls it,
  one parameter at a time), so that exporting (``save_pretrained``, ``merge_adapters``) or
  sampling can then run on one process. Each process holds the whole model in host memory
  afterwards. One process: ``model`` itself.
  """
  if jax.process_count() == 1:
    return model
  from flax import nnx  # noqa: PLC0415
  copy = nnx.clone(model)
  nnx.update(copy, jax.tree.map(host_value, nnx.state(copy, variables or nnx.Param)))
  return copy


__all__ = ['broadcast_bytes', 'host_local_model', 'initialize', 'is_primary']

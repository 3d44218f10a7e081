"""Devices of an accelerator topology that is not attached, for ahead-of-time compilation.

``maxnnx compile topology=v5p-128`` compiles the train step for a TPU slice from any
machine, as MaxText's ``compile_topology`` does: jax describes the slice's devices
(:func:`jax.experimental.topologies.get_topology_desc`) when libtpu is installed, even on a
CPU-only host, and the step is lowered and compiled for them without running.

Names are those of Cloud TPU slices: ``v4-N`` and ``v5p-N`` count TensorCores (two per
chip; a 3-D torus of ``N / 2`` chips), ``v5e-N`` (or ``v5litepod-N``) and ``v6e-N`` count
chips (a 2-D torus); ``GEN:AxBxC`` gives the chip grid itself (``v5p:4x4x8``). Each
doubling of a slice doubles the last of its smallest sides (``v5p-16``: 2x2x2, ``v5p-32``:
2x2x4, ``v5p-64``: 2x4x4), as Cloud TPU lays slices out. GPU targets are not described by
jax without the CUDA plugin and a GPU; they are refused with that reason.
"""

from __future__ import annotations

import math
import os
import re

import jax

# Slice-name prefix -> (jax's generation name, torus dimensions, TensorCores per chip in N).
_GENERATIONS = {'v4': ('v4', 3, 2), 'v5p': ('v5p', 3, 2), 'v5e': ('v5e', 2, 1),
                'v5litepod': ('v5e', 2, 1), 'v6e': ('v6e', 2, 1)}


def slice_shape(chips: int, dims: int) -> tuple[int, ...]:
  """The chip grid of a slice of ``chips`` chips (a power of two, at least 4)."""
  if chips < 4 or chips & (chips - 1):
    raise ValueError(f'a slice of {chips} chips: slices named by size have a power-of-two '
                     'number of chips, at least 4; give the grid as GEN:AxB(xC) instead.')
  shape = [2, 2] + [1] * (dims - 2)
  while math.prod(shape) < chips:
    smallest = min(shape)
    last = max(i for i, side in enumerate(shape) if side == smallest)
    shape[last] *= 2
  return tuple(shape)


def topology_name(name: str) -> str:
  """``'v5p-16'`` -> jax's ``'v5p:2x2x2'`` (a ``GEN:AxBxC`` name is kept as given)."""
  text = name.strip().lower()
  grid = re.fullmatch(r'(v\w+):(\d+(?:x\d+)+)', text)
  if grid:
    generation = _GENERATIONS.get(grid.group(1), (grid.group(1),))[0]
    return f'{generation}:{grid.group(2)}'
  sized = re.fullmatch(r'(v\w+?)-(\d+)', text)
  if not sized or sized.group(1) not in _GENERATIONS:
    if re.search(r'h100|h200|a100|b200|gpu', text):
      raise ValueError(f'topology={name}: GPU targets cannot be compiled for here; jax describes '
                       'GPU devices only with the CUDA plugin on a machine that has the GPUs. '
                       'Compile on the target machine (maxnnx compile without topology=).')
    raise ValueError(f"topology={name}: expected a Cloud TPU slice name such as 'v5p-128', "
                     f"'v5e-16', 'v6e-64', 'v4-32', or a chip grid such as 'v5p:4x4x4' "
                     f"(generations: {', '.join(sorted(_GENERATIONS))}).")
  generation, dims, cores = _GENERATIONS[sized.group(1)]
  count = int(sized.group(2))
  if count % cores:
    raise ValueError(f'topology={name}: {sized.group(1)} slices count TensorCores, {cores} per '
                     'chip; the number must be even.')
  try:
    shape = slice_shape(count // cores, dims)
  except ValueError as e:
    raise ValueError(f'topology={name}: {e}') from None
  return f"{generation}:{'x'.join(map(str, shape))}"


def topology_devices(name: str, num_slices: int = 1) -> list:
  """The abstract devices of ``num_slices`` slices of topology ``name`` (see the module
  docstring), ordered by slice then id.

  Raises:
    ValueError: an unknown name, a GPU target, or a machine without libtpu (with the
      command that installs it).
  """
  from jax.experimental import topologies  # noqa: PLC0415
  if num_slices < 1:
    raise ValueError(f'topology_slices must be >= 1, got {num_slices}.')
  target = topology_name(name)
  if jax.default_backend() == 'cpu':  # no TPU here: nothing to look up or to lock
    os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
    os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
    os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  try:
    description = topologies.get_topology_desc(
        platform='tpu', topology_name=target,
        **({'num_slices': num_slices} if num_slices > 1 else {}))
  except Exception as e:  # noqa: BLE001 (the plugin's errors have no common type)
    message = str(e).splitlines()[0].rstrip('.') if str(e) else type(e).__name__
    raise ValueError(
        f'topology={name} ({target}): jax could not describe it ({message}). Compiling for a TPU '
        f"slice needs libtpu on this machine: pip install 'jax[tpu]=={jax.__version__}'.") from None
  return sorted(description.devices, key=lambda d: (getattr(d, 'slice_index', 0), d.id))


__all__ = ['slice_shape', 'topology_devices', 'topology_name']

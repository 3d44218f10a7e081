"""Device meshes and logical-axis sharding.

Every parameter carries logical axis names (``embed``, ``heads``, ``mlp``…) in
its ``out_sharding`` metadata, and layers tag their activations the same way
with :func:`constrain` (``activation_batch``, ``activation_length``…). A list of
*rules* maps each logical name to mesh axes; the same model then runs with
data, FSDP, tensor, expert, context or pipeline parallelism, or any mix, by
changing only the mesh and the rules.

Typical use (the ``Trainer`` does this for you)::

  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  rules = logical_rules(MeshConfig(...))
  with use_mesh(mesh, rules):
    ...  # jit, build and run; constrain() inside layers now shards activations

Outside :func:`use_mesh` (or under a mesh with one device) :func:`constrain` is
a no-op, so layers run unchanged on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from maxnnx.config import MESH_AXES, ConfigError, MeshConfig

logger = logging.getLogger(__name__)

MeshAxes = str | tuple[str, ...] | None

# Logical name -> mesh axes, in order. Parameters use the bare names, activations
# the ``activation_*`` names, so each can be sharded differently.
DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # parameters
    ('vocab', 'tensor'),
    ('position', None),
    ('embed', ('fsdp', 'context', 'expert')),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('head_dim', None),
    ('mlp', 'tensor'),
    ('norm', None),
    ('layers', 'stage'),
    ('expert', 'expert'),
    # MLA's low-rank latents: the up-projections (``[q_lora, heads, head_dim]``) have no
    # ``embed`` axis, so FSDP splits them here (as MaxText does); left whole they were
    # replicated on every device (DeepSeek-V3: 3.3 B parameters and their moments per chip).
    ('q_lora', ('fsdp', 'context', 'expert')),
    ('kv_lora', ('fsdp', 'context', 'expert')),
    # activations
    ('activation_batch', ('data', 'fsdp', 'expert')),
    ('activation_length', 'context'),
    ('activation_norm_length', 'context'),
    ('activation_embed', None),
    ('activation_heads', 'tensor'),
    ('activation_kv_heads', 'tensor'),
    ('activation_kv_length', None),
    ('activation_mlp', 'tensor'),
    ('activation_vocab', 'tensor'),
    ('activation_expert', 'expert'),
    ('activation_stage', 'stage'),
)

_CURRENT_RULES: contextvars.ContextVar[dict[str, MeshAxes] | None] = contextvars.ContextVar(
    'maxnnx_logical_rules', default=None)
_PIPELINE_SCHEDULE: contextvars.ContextVar[tuple[int | None, int]] = contextvars.ContextVar(
    'maxnnx_pipeline_schedule', default=(None, 1))
_CONTEXT_STRATEGY: contextvars.ContextVar[str] = contextvars.ContextVar(
    'maxnnx_context_parallel_strategy', default='all_gather')
_EXPERT_STRATEGY: contextvars.ContextVar[str] = contextvars.ContextVar(
    'maxnnx_expert_parallel_strategy', default='gspmd')


def logical_rules(mesh_config: MeshConfig | None = None) -> dict[str, MeshAxes]:
  """The rules for ``mesh_config``: defaults, then sequence parallelism and the context
  strategy (``ring`` keeps keys and values split along the sequence), then overrides."""
  rules = dict(DEFAULT_RULES)
  if mesh_config is not None:
    if mesh_config.sequence_parallel:
      rules['activation_norm_length'] = ('context', 'tensor')
    if mesh_config.context_parallel_strategy == 'ring':
      rules['activation_kv_length'] = 'context'
    for name, axes in mesh_config.rules:
      rules[name] = axes
  return rules


def mesh_shape(mesh_config: MeshConfig, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
  """Resolve ``-1`` sizes: ``(per-slice sizes, across-slice sizes)`` by axis name.

  Raises:
    ConfigError: when the sizes do not multiply to ``num_devices``.
  """
  dcn = {a: getattr(mesh_config, 'dcn_' + a) for a in MESH_AXES}
  dcn_fixed = math.prod(s for s in dcn.values() if s != -1)
  if num_devices % dcn_fixed:
    raise ConfigError(f'{num_devices} devices cannot be split into dcn axes {dcn}.')
  for a, s in dcn.items():
    if s == -1:
      dcn[a] = num_devices // dcn_fixed
  per_slice = num_devices // math.prod(dcn.values())
  ici = {a: getattr(mesh_config, a) for a in MESH_AXES}
  fixed = math.prod(s for s in ici.values() if s != -1)
  free = [a for a, s in ici.items() if s == -1]
  if free:
    if per_slice % fixed:
      raise ConfigError(
          f'Mesh axes {ici} need a multiple of {fixed} devices per slice, have {per_slice}.')
    ici[free[0]] = per_slice // fixed
  if math.prod(ici.values()) * math.prod(dcn.values()) != num_devices:
    sizes = {a: ici[a] * dcn[a] for a in MESH_AXES}
    raise ConfigError(
        f'Mesh {sizes} uses {math.prod(sizes.values())} devices but {num_devices} are '
        f'available; set one axis to -1 (e.g. mesh.data=-1) or change the sizes.')
  return ici, dcn


def make_mesh(mesh_config: MeshConfig | None = None, devices: Sequence | None = None) -> Mesh:
  """A ``Mesh`` with axes ``stage, data, fsdp, expert, context, tensor``.

  Axes are ordered slowest to fastest-varying, so ``tensor`` (most
  communication) lands on the nearest devices. Axes are ``AxisType.Auto``:
  the compiler propagates shardings from the constraints we place. A mesh with
  fixed sizes smaller than the device count uses the first devices (e.g.
  ``MeshConfig(data=1)`` runs on one device).
  """
  mesh_config = mesh_config or MeshConfig()
  devices = list(jax.devices() if devices is None else devices)
  # Process-major order: devices of one host sit together on the fast axes.
  devices.sort(key=lambda d: (d.process_index, d.id))
  sizes = [getattr(mesh_config, g + a) for g in ('', 'dcn_') for a in MESH_AXES]
  wanted = math.prod(sizes)
  if -1 not in sizes and wanted < len(devices):
    logger.info('Mesh needs %d of %d devices; using the first %d.', wanted, len(devices), wanted)
    devices = devices[:wanted]
  ici, dcn = mesh_shape(mesh_config, len(devices))
  shape = tuple(ici[a] * dcn[a] for a in MESH_AXES)
  if math.prod(dcn.values()) > 1 and hasattr(devices[0], 'slice_index'):
    from jax.experimental import mesh_utils  # noqa: PLC0415 (multi-slice TPU only)
    array = mesh_utils.create_hybrid_device_mesh(
        tuple(ici[a] for a in MESH_AXES), tuple(dcn[a] for a in MESH_AXES), devices)
  else:
    array = np.asarray(devices, dtype=object).reshape(shape)
  return Mesh(array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def tensor_parallel_mesh(tensor_parallel: int) -> MeshConfig | None:
  """The mesh of a model sharded over ``tensor_parallel`` devices for inference (its heads
  and MLP width: ``MeshConfig(data=1, tensor=n)``), or ``None`` for one device.

  In a multi-process run the model must span every process's devices, so there
  ``tensor_parallel`` must be the global device count.

  Raises:
    ValueError: a count this run cannot place, with the counts it can.
  """
  local, total, processes = jax.local_device_count(), jax.device_count(), jax.process_count()
  if processes > 1:
    if tensor_parallel != total:
      raise ValueError(f'tensor_parallel={tensor_parallel}: a run of {processes} processes '
                       f'shards the model over all their devices; set tensor_parallel={total}.')
  elif not 1 <= tensor_parallel <= local:
    raise ValueError(f'tensor_parallel={tensor_parallel}: this process has {local} device(s); '
                     f'use 1 to {local}.')
  return MeshConfig(data=1, tensor=tensor_parallel) if tensor_parallel > 1 else None


def spec_for(names: Sequence[str | None], rules: dict[str, MeshAxes] | None = None,
             mesh: Mesh | jax.sharding.AbstractMesh | None = None,
             shape: Sequence[int] | None = None) -> P:
  """The ``PartitionSpec`` of an array whose dimensions have logical ``names``.

  A mesh axis is used at most once per array (the first dimension that asks for
  it gets it); axes of size 1 are dropped; with ``shape`` given, axes that do
  not divide a dimension are dropped from it (the dimension stays replicated
  along them) so any model runs on any mesh. Axes that are manual in ``mesh`` (inside a
  ``shard_map`` over them) are dropped too: there each device already holds its own block.
  """
  rules = _CURRENT_RULES.get() if rules is None else rules
  rules = rules if rules is not None else dict(DEFAULT_RULES)
  sizes = dict(mesh.shape) if mesh is not None else None
  used: set[str] = set(getattr(mesh, 'manual_axes', ()) or ())
  spec = []
  for dim, name in enumerate(names):
    axes = rules.get(name) if name is not None else None
    if name is not None and name not in rules:
      raise KeyError(f"No sharding rule for logical axis '{name}'. Add one with "
                     f"MeshConfig.rules, e.g. rules=(('{name}', None),).")
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    chosen = []
    for axis in axes:
      if axis in used or (sizes is not None and sizes.get(axis, 1) == 1):
        continue
      if shape is not None and sizes is not None:
        if shape[dim] % (math.prod(sizes[a] for a in chosen) * sizes[axis]):
          continue
      chosen.append(axis)
      used.add(axis)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return P(*spec)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: dict[str, MeshAxes] | None = None, *,
             pipeline_microbatches: int | None = None, pipeline_repeats: int = 1,
             context_parallel_strategy: str = 'all_gather',
             expert_parallel_strategy: str = 'gspmd'):
  """Make ``mesh`` current (``jax.set_mesh``) and ``rules`` the logical rules.

  ``pipeline_microbatches`` is how many micro-batches a pipelined layer stack
  (mesh axis ``stage`` > 1) splits each batch into (default: one per stage), and
  ``pipeline_repeats`` how many times each micro-batch goes round the stages (1: GPipe;
  more: a circular pipeline, see :mod:`maxnnx.parallel.pipeline`).
  ``context_parallel_strategy`` is how attention crosses the ``context`` axis
  (``MeshConfig.context_parallel_strategy``) and ``expert_parallel_strategy`` how MoE
  tokens cross the ``expert`` axis (``MeshConfig.expert_parallel_strategy``).
  """
  token = _CURRENT_RULES.set(dict(DEFAULT_RULES) if rules is None else dict(rules))
  pipeline_token = _PIPELINE_SCHEDULE.set((pipeline_microbatches, pipeline_repeats))
  strategy_token = _CONTEXT_STRATEGY.set(context_parallel_strategy)
  expert_token = _EXPERT_STRATEGY.set(expert_parallel_strategy)
  try:
    with jax.set_mesh(mesh):
      yield mesh
  finally:
    _CURRENT_RULES.reset(token)
    _PIPELINE_SCHEDULE.reset(pipeline_token)
    _CONTEXT_STRATEGY.reset(strategy_token)
    _EXPERT_STRATEGY.reset(expert_token)


def pipeline_microbatches() -> int:
  """Micro-batches per step of a pipelined stack under the current mesh."""
  stages = mesh_axis_size('stage')
  return _PIPELINE_SCHEDULE.get()[0] or stages


def pipeline_repeats() -> int:
  """Rounds of the stages each micro-batch makes under the current mesh (1: GPipe)."""
  return _PIPELINE_SCHEDULE.get()[1]


def context_parallel_strategy() -> str:
  """How attention crosses the ``context`` axis under the current mesh (``all_gather``
  or ``ring``)."""
  return _CONTEXT_STRATEGY.get()


def expert_parallel_strategy() -> str:
  """How MoE tokens cross the ``expert`` axis under the current mesh (``gspmd`` or
  ``all_to_all``)."""
  return _EXPERT_STRATEGY.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Tag activation ``x`` with logical axis ``names`` (a sharding constraint).

  A no-op unless called under :func:`use_mesh` with more than one device, so
  layers can call it unconditionally.
  """
  rules = _CURRENT_RULES.get()
  mesh = jax.sharding.get_abstract_mesh()
  if rules is None or mesh.empty or mesh.size == 1:
    return x
  if len(names) != x.ndim:
    raise ValueError(f'constrain: {len(names)} names {tuple(names)} for shape {x.shape}.')
  return jax.lax.with_sharding_constraint(x, spec_for(names, rules, mesh, x.shape))


def mesh_axis_size(axis: str) -> int:
  """Size of ``axis`` in the current mesh (1 when there is none)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or axis not in mesh.axis_names:
    return 1
  return dict(mesh.shape)[axis]


def _names_of(variable) -> tuple | None:
  names = variable.get_metadata().get('out_sharding')
  return tuple(names) if names is not None else None


def state_shardings(state, mesh: Mesh, rules: dict[str, MeshAxes] | None = None):
  """``NamedSharding`` for every array in an nnx ``State`` (or tree of Variables).

  The result has the structure of ``state`` (each Variable holding its
  sharding), so it can be passed to ``jax.jit`` and ``jax.device_put``.
  Variables without logical names (RNG counters, step counts) are replicated.
  """
  rules = dict(DEFAULT_RULES) if rules is None else rules

  def one(x):
    value = x.get_value() if isinstance(x, nnx.Variable) else x
    if not hasattr(value, 'shape'):  # e.g. optax's MaskedNode: no array, nothing to place
      return x
    names = _names_of(x) if isinstance(x, nnx.Variable) else None

    def place(array):
      if names is None or len(names) != len(array.shape):
        return NamedSharding(mesh, P())
      return NamedSharding(mesh, spec_for(names, rules, mesh, array.shape))

    # A quantized kernel (a qwix QArray: values and scales) places each of its arrays by its
    # own shape: a scale's size-1 dimensions stay whole where the values' are split.
    named = jax.tree.map(place, value)
    return x.replace(value=named) if isinstance(x, nnx.Variable) else named

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def describe_sharding(module: nnx.Module, mesh: Mesh,
                      rules: dict[str, MeshAxes] | None = None) -> list[tuple[str, tuple, P]]:
  """``(path, shape, PartitionSpec)`` of every parameter, for printing or tables."""
  rows = []
  for path, var in nnx.iter_graph(module):
    if isinstance(var, nnx.Param):
      names = _names_of(var)
      shape = tuple(var.shape)
      spec = spec_for(names, rules or dict(DEFAULT_RULES), mesh, shape) if names else P()
      rows.append(('.'.join(str(p) for p in path), shape, spec))
  return rows

"""Many LoRA adapters served at once from one base model (vLLM's multi-LoRA serving).

Each adapted projection of the engine's working copy holds every adapter at once, stacked
``[num_slots, ...]`` with slot 0 all zeros (no adapter), and the step tells it which slot each
of its flat tokens uses. A step then serves requests for different adapters, and for the
base model, in the same batch, the idea of punica and S-LoRA: ::

  y_T = x_T W + (x_T A[s_T]) B[s_T]       (s_T: token T's slot; A, B scaled by alpha / r)

Nothing is merged into ``W``, and the shapes do not depend on which adapters a batch mixes, so
one compiled program serves every mix. The selection is a mask: every token's input goes
through all the stacked ``A`` (``[T, slots, r]``: ``slots * r`` columns, a few percent of a
projection), and only its own slot's ``r`` columns go on through ``B``, one dense matmul each.

**How the slots reach the projections.** The layer stack's call signatures stay as they are:
each adapted projection becomes a :class:`MultiLoraDense`, a ``DenseGeneral`` with the
stacked adapters (``LoraStack`` variables) and a ``token_slots`` variable (``LoraSlots``). The
jitted step sets ``token_slots`` on every one of them before the forward pass
(:func:`set_token_slots`; a scanned stack's copy has a leading ``layers`` axis, as all its
variables do) and empties it after, so the state the step returns keeps its shapes. With
empty ``token_slots`` the projection is its base. Neither variable is an ``nnx.Param``: the
engine's parameters stay the base model's.

**Loading.** Adapters come from PEFT directories (what ``maxnnx sft ... lora`` writes and
``peft`` reads), read by :func:`~maxnnx.train.lora.load_adapter`; each one's scale
``alpha / r`` is folded into its ``B``, and a rank below ``max_lora_rank`` is padded with
zeros (exact). A rank above it, a module the model lacks or a missing file is refused when the
engine is built, naming the adapter and the fix. So is an adapter of MLA's ``kv_b_proj``: the
paged step applies it to cached latents, where no token's slot is at hand.

**Loading while serving** (vLLM's runtime LoRA updating). The stacks keep their shapes,
``max_loras + 1`` slots of ``max_lora_rank``, whatever they hold, so an adapter loaded later
is written into a free slot of the stacks already there (:func:`write_slot`) and unloading
zeroes its slot: the compiled step runs on unchanged. Only projections that have a stack can
take an adapter: those the start's adapters adapt, and those ``lora_target_modules`` names
(an engine started with no adapter at all can take them later). Each load gets a serial
number of its own (:meth:`ServedAdapters.cache_salt`), so prefix pages cached under one
adapter are never reused by another loaded later under its name or into its slot.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxnnx.layers.linear import DenseGeneral
from maxnnx.models.transformer import layer_stacks
from maxnnx.train.lora.adapters import STACKS_PATH, candidate_modules

#: Projections a paged step applies to cached positions rather than to its own tokens (MLA
#: rebuilds keys and values from the latents of every gathered page): no per-token slot fits.
KEY_SIDE_PROJECTIONS = ('kv_b_proj',)


class UnknownAdapterError(ValueError):
  """A request or an unload names an adapter the engine does not serve (the server's 404)."""


class LoraStack(nnx.Variable):
  """Stacked adapter weights of one projection, ``[slots, in, r]`` or ``[slots, r, out]``
  (after a leading ``layers`` axis in a scanned stack)."""


class LoraSlots(nnx.Variable):
  """The adapter slot of each token of the step (``[T]``; ``[layers, T]`` in a scanned stack);
  empty outside a step."""


class MultiLoraDense(DenseGeneral):
  """A :class:`~maxnnx.layers.linear.DenseGeneral` plus many adapters, one per token.

  ``y = x W (+ bias) + (x A[s]) B[s]`` with ``s`` each token's slot (``token_slots``); slot
  0 holds zeros. It takes over ``base``'s kernel and bias (the same variables, so the
  parameters' paths do not change).

  Args:
    base: the projection to adapt.
    lora_a: ``[*lead, slots, in, r]`` (``in`` flattened, ``lead`` the stack's layers axis).
    lora_b: ``[*lead, slots, r, out]`` (``out`` flattened), the scale folded in.
  """

  def __init__(self, base: DenseGeneral, lora_a: jax.Array, lora_b: jax.Array):
    self.in_shape, self.out_shape = base.in_shape, base.out_shape
    self.dtype = base.dtype
    self.custom_gradient = base.custom_gradient
    if 'inference_quantization' in vars(base):
      self.inference_quantization = base.inference_quantization
    self.kernel, self.bias = base.kernel, base.bias
    lead = lora_a.shape[:-3]
    self.lora_a = LoraStack(lora_a)
    self.lora_b = LoraStack(lora_b)
    self.token_slots = LoraSlots(jnp.zeros((*lead, 0), jnp.int32))

  def __call__(self, x: jax.Array) -> jax.Array:
    y = super().__call__(x)
    slots_T = self.token_slots[...]
    if slots_T.shape[-1] == 0:  # outside a step: the base projection
      return y
    n_in = len(self.in_shape)
    tokens = math.prod(x.shape[:x.ndim - n_in])
    if tokens != slots_T.shape[-1]:
      raise ValueError(f'MultiLoraDense got {tokens} tokens but {slots_T.shape[-1]} adapter '
                       'slots; set_token_slots takes one slot per token of the step.')
    dtype = jnp.dtype(self.dtype)
    a_NIR, b_NRO = self.lora_a[...], self.lora_b[...]
    x_TI = x.reshape(tokens, -1).astype(dtype)
    xa_TNR = jnp.einsum('ti,nir->tnr', x_TI, a_NIR.astype(dtype),
                        preferred_element_type=jnp.float32)
    mine_TN = slots_T[:, None] == jnp.arange(a_NIR.shape[0])
    xa_TNR = jnp.where(mine_TN[:, :, None], xa_TNR, 0).astype(dtype)
    delta_TO = jnp.einsum('tnr,nro->to', xa_TNR, b_NRO.astype(dtype),
                          preferred_element_type=jnp.float32)
    return y + delta_TO.reshape(y.shape).astype(y.dtype)


def set_token_slots(model: nnx.Module, slots_T: jax.Array | None) -> None:
  """Give every :class:`MultiLoraDense` of ``model`` the slot of each token (``[T]``), or
  empty them (``None``: the base projections again). Nothing happens without adapters."""
  for _, module in nnx.iter_modules(model):
    if isinstance(module, MultiLoraDense):
      lead = module.lora_a.shape[:-3]
      if slots_T is None:
        module.token_slots.set_value(jnp.zeros((*lead, 0), jnp.int32))
      else:
        module.token_slots.set_value(jnp.broadcast_to(slots_T, (*lead, slots_T.shape[-1])))


@dataclasses.dataclass
class LoadedAdapter:
  """One adapter read from its PEFT directory.

  Attributes:
    name: the name requests select it by.
    path: its directory.
    rank: its rank (the largest of its modules').
    weights: ``{unscanned module path: (A [in, r], B [r, out])}``, ``alpha / r`` in ``B``.
  """

  name: str
  path: str
  rank: int
  weights: dict


def read_adapter(model: nnx.Module, name: str, path: str, max_lora_rank: int,
                 source: str = 'Engine lora_modules') -> LoadedAdapter:
  """The adapter in PEFT directory ``path`` for ``model``, checked against ``max_lora_rank``;
  ``source`` (what named it) starts every error.

  Raises:
    ValueError: one line naming the adapter and the fix (a missing file, an unsupported
      config, a module ``model`` lacks, a rank above ``max_lora_rank``).
  """
  from maxnnx.train.lora import adapter_weights, load_adapter  # noqa: PLC0415 (imports qwix)
  try:
    adapted = load_adapter(model, path)
  except ValueError as e:  # PretrainedError too
    raise ValueError(f"{source}: adapter '{name}' ({path}) does not load on this "
                     f'{model.config.family} model: {e}') from None
  config = adapted.lora_config
  if config.rank > max_lora_rank:
    raise ValueError(f"{source}: adapter '{name}' ({path}) has rank {config.rank}, "
                     f'above max_lora_rank={max_lora_rank}; set max_lora_rank={config.rank} '
                     'or more.')
  weights = {}
  for module_path, (a, b) in adapter_weights(adapted).items():
    weights[module_path] = (np.asarray(a, np.float32),
                            np.asarray(b, np.float32) * np.float32(config.scale))
  for module_path in weights:
    if module_path[-1] in KEY_SIDE_PROJECTIONS:
      raise ValueError(f"{source}: adapter '{name}' ({path}) adapts "
                       f"{'.'.join(map(str, module_path))}, which the paged MLA applies to cached "
                       'latents, not to the step\'s tokens; serve it merged '
                       '(merge_adapters) or drop that module.')
    if not re.fullmatch(STACKS_PATH, '/'.join(map(str, module_path))):
      raise ValueError(f"{source}: adapter '{name}' ({path}) adapts "
                       f"{'.'.join(map(str, module_path))}, outside the decoder layers; the "
                       'engine serves decoder-layer adapters only: drop that module.')
  return LoadedAdapter(name, path, config.rank, weights)


def _layer_paths(model: nnx.Module, path: tuple, module: DenseGeneral) -> list[tuple]:
  """The unscanned paths of ``module``'s layers (one, or one per layer of a scanned stack)."""
  lead = module.kernel.ndim - len(module.in_shape) - len(module.out_shape)
  cfg = model.config
  if not (cfg.runtime.scan_layers and lead):
    return [path]
  start, count = next((s, c) for n, s, c, _ in layer_stacks(cfg) if n == path[0])
  return [('layers', start + i, *path[1:]) for i in range(count)]


def _parent(model: nnx.Module, path: tuple):
  node = model
  for part in path[:-1]:
    node = node[part] if isinstance(part, int) else getattr(node, part)
  return node


def install_adapters(model: nnx.Module, adapters: list[LoadedAdapter], num_slots: int,
                     rank: int, targets: tuple[str, ...] = ()) -> dict[tuple, list[tuple]]:
  """Replace every projection of ``model`` that some adapter adapts, or whose name is in
  ``targets``, by a :class:`MultiLoraDense` holding ``num_slots`` slots of rank ``rank``: slot
  ``i + 1`` is ``adapters[i]``, the other slots zeros. Modifies ``model``; returns ``{path
  replaced: the unscanned paths of its layers}`` (``[path]`` outside a scanned stack)."""
  replaced = {}
  for path, module in candidate_modules(model):
    if not re.fullmatch(STACKS_PATH, '/'.join(map(str, path))):
      continue
    rows = _layer_paths(model, path, module)
    if path[-1] not in targets and not any(
        row in adapter.weights for adapter in adapters for row in rows):
      continue
    din, dout = math.prod(module.in_shape), math.prod(module.out_shape)
    a = np.zeros((len(rows), num_slots, din, rank), np.float32)
    b = np.zeros((len(rows), num_slots, rank, dout), np.float32)
    for slot, adapter in enumerate(adapters, start=1):
      _place(a, b, slot, adapter, rows)
    if rows == [path]:  # not a scanned stack
      a, b = a[0], b[0]
    dtype = jnp.dtype(module.dtype)  # the compute dtype (the kernel may be quantized)
    setattr(_parent(model, path), path[-1],
            MultiLoraDense(module, jnp.asarray(a, dtype), jnp.asarray(b, dtype)))
    replaced[path] = rows
  return replaced


def _place(a: np.ndarray, b: np.ndarray, slot: int, adapter: LoadedAdapter | None,
           rows: list[tuple]) -> None:
  """Write ``adapter``'s weights (zeros for ``None``) into slot ``slot`` of one projection's
  stacks ``a`` ``[layers, slots, in, r]`` and ``b`` ``[layers, slots, r, out]``."""
  a[:, slot] = 0
  b[:, slot] = 0
  if adapter is None:
    return
  for layer, row in enumerate(rows):
    if row in adapter.weights:
      a_IR, b_RO = adapter.weights[row]
      a[layer, slot, :, :a_IR.shape[1]] = a_IR
      b[layer, slot, :b_RO.shape[0]] = b_RO


def missing_stacks(adapter: LoadedAdapter, stacks: dict[tuple, list[tuple]]) -> list[str]:
  """The modules ``adapter`` adapts that have no stack in ``stacks`` (``install_adapters``'
  result), dotted."""
  have = {row for rows in stacks.values() for row in rows}
  return sorted('.'.join(map(str, path)) for path in adapter.weights if path not in have)


def write_slot(state: nnx.State, stacks: dict[tuple, list[tuple]], slot: int,
               adapter: LoadedAdapter | None) -> None:
  """Put ``adapter`` (zeros for ``None``) into slot ``slot`` of every stack of ``state`` (the
  split-off non-parameter state of a model :func:`install_adapters` changed), in place.

  The new arrays keep each stack's shape, dtype, sharding and commitment, so a step compiled
  before runs them as they are. Written on the host (no program is compiled for it)."""
  for path, rows in stacks.items():
    node = state
    for part in path:
      node = node[part]
    olds = {name: node[name][...] for name in ('lora_a', 'lora_b')}
    # [layers, slots, ...] on the host (one layer outside a scanned stack).
    a, b = (np.array(olds[n], np.float32).reshape(len(rows), *olds[n].shape[-3:])
            for n in ('lora_a', 'lora_b'))
    _place(a, b, slot, adapter, rows)
    for name, new in (('lora_a', a), ('lora_b', b)):
      old = olds[name]
      # As committed to its devices as the old array: a change would compile the step anew.
      node[name].set_value(jax.device_put(new.reshape(old.shape).astype(old.dtype),
                                          old.sharding if old.committed else None))


def parse_lora_modules(entries) -> dict[str, str]:
  """``{name: path}`` of ``EngineConfig.lora_modules`` (``'name=path'`` entries)."""
  out = {}
  for entry in entries:
    name, _, path = entry.partition('=')
    out[name] = path
  return out




@dataclasses.dataclass
class ServedAdapters:
  """The LoRA adapters an engine serves, and its free slots.

  Attributes:
    num_slots: the stacks' slots, slot 0 (the base model) included; 0 without stacks.
    slots: ``{adapter name: slot}``, in the order they were loaded (slot 0 is the base model).
    paths: ``{adapter name: its directory}``.
    serials: ``{adapter name: the serial number of its load}`` (never reused: see
      :meth:`cache_salt`).
    loads: adapters loaded so far (the latest serial number given).
  """

  num_slots: int = 0
  slots: dict[str, int] = dataclasses.field(default_factory=dict)
  paths: dict[str, str] = dataclasses.field(default_factory=dict)
  serials: dict[str, int] = dataclasses.field(default_factory=dict)
  loads: int = 0

  @classmethod
  def load(cls, model: nnx.Module, config) -> tuple[ServedAdapters, tuple | None]:
    """Read an :class:`~maxnnx.config.EngineConfig`'s ``lora_modules``: the adapters served,
    and the model runner's ``lora`` argument (``(adapters, slots, rank, targets)``; ``None``
    without adapters and ``lora_target_modules``)."""
    paths = parse_lora_modules(config.lora_modules)
    targets = tuple(config.lora_target_modules)
    if not paths and not targets:
      return cls(), None
    check_targets(model, targets)
    rank = config.max_lora_rank
    adapters = [read_adapter(model, name, path, rank) for name, path in paths.items()]
    served = cls(1 + (config.max_loras or max(len(adapters), 1)))
    for adapter in adapters:
      served.add(adapter.name, adapter.path)
    return served, (adapters, served.num_slots, rank, targets)

  @property
  def names(self) -> tuple[str, ...]:
    """The adapters' names, in the order they were loaded."""
    return tuple(self.slots)

  def slot(self, name: str | None) -> int:
    """The slot of adapter ``name`` (0 for ``None``, the base model).

    Raises:
      UnknownAdapterError: ``name`` is not served, naming those that are.
    """
    if name is None:
      return 0
    if name not in self.slots:
      served = ', '.join(repr(n) for n in self.names) or 'none (Engine lora_modules)'
      raise UnknownAdapterError(f'lora={name!r} is not an adapter of this engine; it serves '
                                f'{served}.')
    return self.slots[name]

  def cache_salt(self, name: str | None) -> bytes:
    """What sets the prefix-cache pages of adapter ``name``'s requests apart: its load's serial
    number, so that an adapter loaded later under the same name or into the same slot never
    meets pages cached for an earlier one (``b''`` for the base model)."""
    return b'' if name is None else f'lora:{self.serials[name]}'.encode()

  def add(self, name: str, path: str) -> int:
    """Serve adapter ``name`` (from ``path``) in the lowest free slot; returns the slot.

    Raises:
      ValueError: ``name`` is served already, or no slot is free (naming ``max_loras``).
    """
    if name in self.slots:
      raise ValueError(f'lora_name {name!r} is loaded already (slot {self.slots[name]}); '
                       'unload it first or load it under another name.')
    taken = set(self.slots.values())
    free = [slot for slot in range(1, self.num_slots) if slot not in taken]
    if not free:
      raise ValueError(f'No free adapter slot: all max_loras={self.num_slots - 1} hold '
                       f"adapters ({', '.join(map(repr, self.names))}); unload one or start "
                       'the engine with a larger max_loras.')
    self.loads += 1
    self.slots[name], self.paths[name], self.serials[name] = free[0], path, self.loads
    return free[0]

  def remove(self, name: str) -> int:
    """Stop serving adapter ``name``; returns the slot it frees.

    Raises:
      UnknownAdapterError: ``name`` is not served.
    """
    slot = self.slot(name)
    for table in (self.slots, self.paths, self.serials):
      del table[name]
    return slot


def check_targets(model: nnx.Module, targets: tuple[str, ...]) -> None:
  """Refuse a ``lora_target_modules`` name that no decoder-layer projection of ``model`` has
  (or MLA's ``kv_b_proj``), naming those it has."""
  names = sorted({path[-1] for path, _ in candidate_modules(model)
                  if re.fullmatch(STACKS_PATH, '/'.join(map(str, path)))})
  for target in targets:
    if target in KEY_SIDE_PROJECTIONS:
      raise ValueError(f'Engine lora_target_modules: {target} is applied to cached latents by '
                       'the paged MLA, where no token\'s adapter is at hand; drop it.')
    if target not in names:
      raise ValueError(f'Engine lora_target_modules: {target!r} is not a projection of this '
                       f"{model.config.family} model's layers; choose among "
                       f"{', '.join(n for n in names if n not in KEY_SIDE_PROJECTIONS)}.")


__all__ = ['KEY_SIDE_PROJECTIONS', 'LoadedAdapter', 'LoraSlots', 'LoraStack', 'MultiLoraDense',
           'ServedAdapters', 'UnknownAdapterError', 'check_targets', 'install_adapters',
           'missing_stacks', 'parse_lora_modules', 'read_adapter', 'set_token_slots',
           'write_slot']

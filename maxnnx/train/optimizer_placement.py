"""Where the training state lives: the optimizer's moments sharded over ``data`` (ZeRO-1) or in
host memory, and the parameters in host memory.

The first two act on the optimizer's moments (``opt_state``: Adam's ``mu`` and ``nu``, momentum
buffers), never on the parameters or the step counter:

* ``TrainConfig.shard_optimizer_over_data`` (ZeRO-1, MaxText's name): each moment gets its
  parameter's sharding plus the ``data`` mesh axis on its first dimension that is unsharded
  and divisible by the ``data`` size, so the data-parallel replicas each hold a slice while the
  parameters stay replicated over ``data``. A moment with no such dimension stays replicated.
  XLA then reduce-scatters what the update needs and all-gathers the new parameters.
* ``TrainConfig.optimizer_memory_host_offload`` (MaxText's name): the moments live in host
  memory (``pinned_host``) with the sharding they would have on the devices. The train step
  copies them to the device before the update and its output sharding puts the new moments
  back, so between steps the devices hold only the parameters: for AdamW in float32 that is
  two thirds of the training state. The copies cost host-device bandwidth every step.

``TrainConfig.parameter_memory_host_offload`` (MaxText's name) does the same for the model's
state (its parameters and the statistics a forward pass records): in host memory between
steps, copied to the devices at the start of each train and eval step, written back by the
step's output sharding. With both offloads the devices hold the training state only while a
step runs.

``TrainConfig.parameter_streaming`` (with ``parameter_memory_host_offload``) leaves the scanned
layer stacks in host memory inside the step too: each iteration of the layers' scan copies
its own layer's slice to the device, in the forward pass and again in the backward pass's
recomputation (:meth:`~maxnnx.models.transformer.Transformer._scan_stack`), so the forward
and backward passes hold one or two layers' parameters on the device rather than all of them.
The stacks' gradients come out in host memory; they and the parameters are copied in for the
update (:func:`model_to_device`), when the activations are gone.
"""

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from maxnnx.layers.remat import to_device

HOST = 'pinned_host'


def _map_moments(fn, shardings, *rest):
  """``shardings`` of a ``(model, optimizer)`` state with ``fn(named, *rest_leaves)`` applied
  to each ``NamedSharding`` of the optimizer's ``opt_state`` (``rest``: trees of the same
  state, e.g. its abstract arrays)."""
  def value(leaf):
    return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf

  def one(leaf, *others):
    named = value(leaf)
    if not hasattr(named, 'mesh'):
      return leaf
    new = fn(named, *(value(o) for o in others))
    return leaf.replace(value=new) if isinstance(leaf, nnx.Variable) else new

  shardings[1]['opt_state'] = jax.tree.map(one, shardings[1]['opt_state'],
                                           *(r[1]['opt_state'] for r in rest),
                                           is_leaf=lambda x: isinstance(x, nnx.Variable))
  return shardings


def optimizer_state_over_data(shardings, abstract_state):
  """ZeRO-1: ``shardings`` with each moment also split over the ``data`` mesh axis (on its
  first unsharded dimension that ``data`` divides; ``abstract_state`` gives the shapes)."""
  def over_data(named, abstract):
    shape = abstract.shape
    size = dict(named.mesh.shape).get('data', 1)
    spec = list(named.spec) + [None] * (len(shape) - len(named.spec))
    used = {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
    if size == 1 or 'data' in used:
      return named
    for dim, entry in enumerate(spec):
      if entry is None and shape[dim] % size == 0:
        spec[dim] = 'data'
        return NamedSharding(named.mesh, P(*spec), memory_kind=named.memory_kind)
    return named

  return _map_moments(over_data, shardings, abstract_state)


def optimizer_state_on_host(shardings):
  """``shardings`` of a ``(model, optimizer)`` state with the optimizer's ``opt_state`` moved to
  host memory (the step counter and the model stay on the device)."""
  return _map_moments(lambda named: named.with_memory_kind(HOST), shardings)


def optimizer_state_to_device(state):
  """Inside the train step: the ``(model, optimizer)`` state with ``opt_state`` copied to the
  device for the update."""
  state[1]['opt_state'] = jax.tree.map(to_device, state[1]['opt_state'])
  return state


def _model_part_in(shardings, kind: str):
  """A new tree of ``shardings`` (of a ``(model, optimizer)`` state) with the model's part in
  memory ``kind``; the optimizer's part as it was."""
  def one(path, leaf):
    named = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    if not hasattr(named, 'mesh') or getattr(path[0], 'key', None) != 0:
      return leaf
    moved = named.with_memory_kind(kind)
    return leaf.replace(value=moved) if isinstance(leaf, nnx.Variable) else moved

  return jax.tree_util.tree_map_with_path(one, shardings,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable))


def parameters_on_host(shardings):
  """``shardings`` of a ``(model, optimizer)`` state with the model's part moved to host
  memory (a new tree; the optimizer's part as it was)."""
  return _model_part_in(shardings, HOST)


def parameters_on_device(shardings):
  """The inverse of :func:`parameters_on_host`: the model's part in device memory (what code
  outside the step computes with)."""
  return _model_part_in(shardings, 'device')


def parameters_to_device(state, keep_on_host: tuple[str, ...] = ()):
  """Inside a step: the ``(model, optimizer)`` state with the model's part copied to the
  device, but for the model's attributes named in ``keep_on_host`` (the scanned layer stacks
  that :func:`~maxnnx.models.transformer.layer_stacks` names, when streamed)."""
  def one(path, x):
    return x if getattr(path[0], 'key', None) in keep_on_host else to_device(x)

  state[0] = jax.tree_util.tree_map_with_path(one, state[0])
  return state


def model_to_device(model) -> None:
  """Inside a step: copy the arrays of ``model`` that are in host memory to the device, in
  place (the streamed layer stacks, before the update)."""
  nnx.update(model, jax.tree.map(to_device, nnx.state(model)))


__all__ = ['model_to_device', 'optimizer_state_on_host', 'optimizer_state_over_data',
           'optimizer_state_to_device', 'parameters_on_device', 'parameters_on_host',
           'parameters_to_device']

"""The optimizer state in host memory between steps (MaxText's ``optimizer_memory_host_offload``).

With ``TrainConfig.optimizer_memory_host_offload`` the optimizer's moments (``opt_state``: Adam's
``mu`` and ``nu``, momentum buffers) live in host memory (``pinned_host``) with the sharding they
would have on the devices. The train step copies them to the device before the update and its
output sharding puts the new moments back, so between steps the devices hold only the parameters:
for AdamW in float32 that is two thirds of the training state. The copies cost host-device
bandwidth every step, which is the trade.
"""

import jax
from flax import nnx

HOST = 'pinned_host'


def optimizer_state_on_host(shardings):
  """``shardings`` of a ``(model, optimizer)`` state with the optimizer's ``opt_state`` moved to
  host memory (the step counter and the model stay on the device)."""
  def to_host(leaf):
    if isinstance(leaf, nnx.Variable):
      value = leaf.get_value()
      return leaf.replace(value=value.with_memory_kind(HOST)) if hasattr(value, 'mesh') else leaf
    return leaf.with_memory_kind(HOST) if hasattr(leaf, 'mesh') else leaf

  shardings[1]['opt_state'] = jax.tree.map(to_host, shardings[1]['opt_state'],
                                           is_leaf=lambda x: isinstance(x, nnx.Variable))
  return shardings


def optimizer_state_to_device(state):
  """Inside the train step: the ``(model, optimizer)`` state with ``opt_state`` copied to the
  device for the update."""
  def to_device(x):
    return jax.device_put(x, jax.memory.Space.Device) if hasattr(x, 'shape') else x

  state[1]['opt_state'] = jax.tree.map(to_device, state[1]['opt_state'])
  return state


__all__ = ['optimizer_state_on_host', 'optimizer_state_to_device']

"""Rematerialisation policies by name: what a block keeps for the backward pass.

Layers tag intermediates with ``jax.ad_checkpoint.checkpoint_name``: attention
and MLA tag ``query_proj``, ``key_proj``, ``value_proj``, ``attention_out`` and
``out_proj``; the MLP and the MoE experts tag ``mlp_hidden`` and ``mlp_out``. A
policy says which tagged values to save.
Everything not saved is recomputed in the backward pass. The ``custom`` policy
chooses per tagged tensor: kept in device memory, offloaded to host memory
(``pinned_host``: the forward pass copies it out, the backward pass copies it
back), or recomputed, as MaxText's ``remat_policy: custom`` does.

A block whose parameters arrive in host memory (a scanned layer stack streamed from the host,
``TrainConfig.parameter_streaming``) is wrapped with ``stream=True``: the wrapped function
copies them to the device itself (:func:`to_device`), tagged ``streamed_parameters``, which no
policy but ``none`` saves, so the backward pass copies the layer in again rather than keeping
the copy.
"""

from collections.abc import Callable, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name

_CP = jax.checkpoint_policies

REMAT_POLICIES: dict[str, object] = {
    'minimal': _CP.dots_with_no_batch_dims_saveable,
    'save_dot_except_mlp': _CP.save_only_these_names(
        'query_proj', 'key_proj', 'value_proj', 'attention_out', 'out_proj'),
    'save_qkv_proj': _CP.save_only_these_names('query_proj', 'key_proj', 'value_proj'),
    'save_out_proj': _CP.save_only_these_names('out_proj'),
    'save_attention_out': _CP.save_only_these_names('attention_out'),
    'full': _CP.nothing_saveable,
}


def custom_policy(save: Sequence[str] = (), offload: Sequence[str] = ()):
  """A checkpoint policy keeping the tagged tensors ``save`` on the device, moving those in
  ``offload`` to host memory and back, and recomputing the rest."""
  return _CP.save_and_offload_only_these_names(
      names_which_can_be_saved=list(save), names_which_can_be_offloaded=list(offload),
      offload_src='device', offload_dst='pinned_host')


STREAMED = 'streamed_parameters'


def in_host_memory(x) -> bool:
  """Whether ``x`` (an array or a tracer) is in host memory."""
  return hasattr(x, 'shape') and jax.typeof(x).memory_space == jax.memory.Space.Host


def to_device(x):
  """``x`` copied to device memory when it is in host memory (inside a jitted step); anything
  else as it is."""
  return jax.device_put(x, jax.memory.Space.Device) if in_host_memory(x) else x


def remat(fn: Callable, policy: str, *, save: Sequence[str] = (),
          offload: Sequence[str] = (), stream: bool = False) -> Callable:
  """``fn`` wrapped in ``jax.checkpoint`` with the named policy (``none``: unchanged;
  ``custom``: :func:`custom_policy` of ``save`` and ``offload``).

  ``stream``: ``fn``'s first argument is a tree of parameters in host memory that the
  wrapped function copies to the device (tagged :data:`STREAMED`, which no policy but
  ``none`` saves; ``none`` would keep every layer's copy, so streaming refuses it)."""
  if stream:
    if policy == 'none':
      raise ValueError("Streamed parameters need a remat policy other than 'none'.")
    inner = fn

    def fn(tree, *args):
      copied = jax.tree.map(lambda x: checkpoint_name(to_device(x), STREAMED)
                            if in_host_memory(x) else x, tree)
      return inner(copied, *args)

  if policy == 'none':
    return fn
  if policy == 'custom':
    return jax.checkpoint(fn, policy=custom_policy(save, offload), prevent_cse=False)
  if policy not in REMAT_POLICIES:
    raise ValueError(f"Unknown remat_policy '{policy}'; known: none, custom, "
                     f"{', '.join(REMAT_POLICIES)}.")
  return jax.checkpoint(fn, policy=REMAT_POLICIES[policy], prevent_cse=False)

"""Rematerialisation policies by name: what a block keeps for the backward pass.

Layers tag intermediates with ``jax.ad_checkpoint.checkpoint_name``: attention
and MLA tag ``query_proj``, ``key_proj``, ``value_proj``, ``attention_out`` and
``out_proj``; the MLP and the MoE experts tag ``mlp_hidden`` and ``mlp_out``. A
policy says which tagged values to save.
Everything not saved is recomputed in the backward pass.
"""

from collections.abc import Callable

import jax

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


def remat(fn: Callable, policy: str) -> Callable:
  """``fn`` wrapped in ``jax.checkpoint`` with the named policy (``none``: unchanged)."""
  if policy == 'none':
    return fn
  if policy not in REMAT_POLICIES:
    raise ValueError(f"Unknown remat_policy '{policy}'; known: none, "
                     f"{', '.join(REMAT_POLICIES)}.")
  return jax.checkpoint(fn, policy=REMAT_POLICIES[policy], prevent_cse=False)

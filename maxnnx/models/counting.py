"""Parameter counts of the model a :class:`~maxnnx.config.ModelConfig` builds.

Counted from the abstract model (``nnx.eval_shape``: shapes only, no device
memory), so they always match what :class:`~maxnnx.models.transformer.Transformer`
builds, for any preset up to the trillion-parameter ones.
"""

from __future__ import annotations

import functools
import math

import jax
from flax import nnx

from maxnnx.config import ModelConfig
from maxnnx.models.transformer import Transformer

# The routed-expert weights of a MoE block (``Experts``), stacked ``[..., experts, ...]``.
_EXPERT_MODULE = 'experts'
# The image side of a vision-language model.
_VISION_MODULES = ('vision_tower', 'multi_modal_projector')


@functools.lru_cache(maxsize=64)
def _abstract_param_sizes(cfg: ModelConfig) -> tuple[tuple[tuple, int], ...]:
  """``(path, size)`` of every parameter of the model ``cfg`` builds."""
  types = set(cfg.resolved_layer_types)
  mixers = types & {'linear'}
  uniform = ((not mixers or types == mixers)
             and (not cfg.attention.global_layers.is_set or len(types) == 1))
  if cfg.moe.layer_step == 1 and uniform:  # a scanned stack: same parameters, faster build
    cfg = cfg.replace(**{'runtime.scan_layers': True})
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  return tuple((tuple(path), math.prod(jax.tree.leaves(var)[0].shape)) for path, var in flat)


def num_params(cfg: ModelConfig) -> int:
  """Exact parameter count of the model ``cfg`` builds (MTP modules included)."""
  return sum(size for _, size in _abstract_param_sizes(cfg))


def num_active_params(cfg: ModelConfig) -> int:
  """Parameters used per token: :func:`num_params` counting only the
  ``moe.num_experts_per_tok`` routed experts of each MoE layer (MTP modules
  included; embeddings counted in full)."""
  experts, top_k = cfg.moe.num_experts, cfg.moe.num_experts_per_tok
  routed = sum(size for path, size in _abstract_param_sizes(cfg) if _EXPERT_MODULE in path)
  return num_params(cfg) - (routed // experts * (experts - top_k) if experts else 0)


def num_vision_params(cfg: ModelConfig) -> int:
  """Parameters of the vision tower and its projector (0 for a text model)."""
  return sum(size for path, size in _abstract_param_sizes(cfg) if path[0] in _VISION_MODULES)


__all__ = ['num_active_params', 'num_params', 'num_vision_params']

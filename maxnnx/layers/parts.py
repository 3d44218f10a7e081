"""Swappable parts of a decoder block: your own attention, MLP, MoE or norm without a fork.

A :class:`BlockParts` names a factory for each part; ``None`` keeps the part the
config chooses. Pass it to :class:`~maxnnx.layers.block.DecoderBlock` or
:class:`~maxnnx.models.transformer.Transformer`; every block is then built with
it, in both layer layouts (a list of blocks, or one stacked block under
``scan_layers=True``) and in the multi-token-prediction layers::

  from maxnnx.layers import Attention, BlockParts

  class MyAttention(Attention):   # any class taking (cfg, *, rngs) is a factory
    ...

  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0), parts=BlockParts(attention=MyAttention))

A replacement must be called like the part it replaces. The model builds one
:class:`~maxnnx.layers.layer_call.LayerCall` per layer and call (the layer's rotary
``(cos, sin)``, mask, sliding window or chunk size, KV cache slot or paged batch, per-layer
input, shared keys and values, ...); the block passes it on as it is, and each part reads the
fields it needs:

* attention: ``attn(x_BTD, call)`` -> ``[B, T, d_model]`` (``(out, (k, v))`` when
  ``call.return_kv``), where ``call.cos_sin`` is the ``(cos, sin)`` pair of the layer's rotary
  embedding (``None`` to rotate nothing) and ``call.mask`` an
  :class:`~maxnnx.kernels.masks.AttentionMask`. For KV-cache decoding (``call.cache_index``
  set) it also needs ``init_cache(batch, max_length, dtype)``; for the serving engine,
  ``init_paged_cache(num_pages, page_size, dtype)`` and ``call.paged``, a
  :class:`~maxnnx.kernels.paged_attention.PagedBatch` (subclass
  :class:`~maxnnx.layers.attention.Attention` to inherit all three, and the quantized caches
  of ``kv_cache_dtype='int8'`` or ``'fp8'``, which other replacements refuse). A part that
  cannot honour a field the model sets should say so:
  ``call.refuse('MyAttention', 'chunk_size')`` raises a one-line error naming it.
* mlp, moe: ``mlp(x_BTD, call)`` -> ``[B, T, d_model]`` (the built-in ones read nothing of
  ``call``; a MoE beside a dense MLP, ``moe.dense_branch``, also gets ``router_input_BTD=``).
* norm: ``norm(x_BTD)`` -> ``[B, T, d_model]``.
* block: ``block(x_BTD, call)`` with an ``attn`` attribute (the KV cache lives there); it
  returns ``(x_BTD, keys and values)`` when ``call.return_kv``.

Every parameter of a replacement must carry logical axis names (create it with
:func:`maxnnx.layers.params.logical_param` or
:class:`~maxnnx.layers.linear.DenseGeneral`; ``None`` names a replicated
dimension) so that meshes shard it; building a part without them raises.
"""

import dataclasses
from collections.abc import Callable
from typing import Protocol

from flax import nnx

from maxnnx.config import ModelConfig


class PartFactory(Protocol):
  """Builds one part of a block: ``factory(cfg, rngs=rngs)``; a layer class fits."""

  def __call__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    """A new module for ``cfg`` whose parameters draw on ``rngs``."""
    ...


@dataclasses.dataclass(frozen=True)
class BlockParts:
  """Factories of the parts of each decoder block; ``None`` = the config's choice.

  Attributes:
    attention: replaces :class:`~maxnnx.layers.attention.Attention` (or
      :class:`~maxnnx.layers.mla.MLA` when ``attention.type='mla'``).
    mlp: replaces the dense :class:`~maxnnx.layers.mlp.MLP` of non-MoE layers.
    moe: replaces :class:`~maxnnx.layers.moe.MoE` in MoE layers (it may report
      routing statistics through ``MoeAux`` variables as ``MoE`` does).
    norm: replaces every residual-stream norm over ``d_model``: the blocks'
      pre/post norms, the model's final norm and the MTP layers' norms (not the
      q/k norms inside attention).
    block: a :class:`~maxnnx.layers.block.DecoderBlock` subclass (or a factory
      called as ``block(cfg, rngs=rngs, use_moe=use_moe, parts=parts)``) used
      for every layer instead of ``DecoderBlock``.
  """

  attention: PartFactory | None = None
  mlp: PartFactory | None = None
  moe: PartFactory | None = None
  norm: PartFactory | None = None
  block: Callable[..., nnx.Module] | None = None


def build_part(factory: Callable[..., nnx.Module], cfg: ModelConfig, rngs: nnx.Rngs,
               role: str, **kwargs) -> nnx.Module:
  """``factory(cfg, rngs=rngs, **kwargs)``, checked to name every parameter's axes."""
  module = factory(cfg, rngs=rngs, **kwargs)
  if not isinstance(module, nnx.Module):
    raise TypeError(f'The {role} factory {factory!r} returned a {type(module).__name__}, '
                    'not an nnx.Module.')
  check_logical_names(module, role)
  return module


def check_logical_names(module: nnx.Module, role: str = 'module') -> None:
  """Raise ``ValueError`` if a parameter of ``module`` has no logical axis names.

  Names live in the ``out_sharding`` metadata, one per dimension (see
  :func:`maxnnx.layers.params.logical_param`); without them a mesh cannot
  shard the parameter.
  """
  for path, var in nnx.iter_graph(module):
    if not isinstance(var, nnx.Param):
      continue
    names = var.get_metadata().get('out_sharding')
    shape = getattr(var.get_value(), 'shape', ())
    if names is None or len(names) != len(shape):
      where = '.'.join(map(str, path)) or '(root)'
      raise ValueError(
          f'{role} {type(module).__name__}: parameter {where} of shape {tuple(shape)} has '
          f'logical axis names {names}; give one name per dimension (e.g. create it with '
          "maxnnx.layers.params.logical_param(init, key, shape, dtype, ('heads',)); None "
          'for a replicated dimension) so meshes can shard it.')

"""What one decoder layer is called with: a :class:`LayerCall`, built per layer and call.

The model builds one for each layer (its rotary tables, mask, window or chunk, the KV cache
slot or paged batch, ...) and calls ``block(x_BTD, call)``; the block hands the same object
to its attention, MLP or MoE: ``attn(x_BTD, call)``, ``mlp(x_BTD, call)``. Each part reads
the fields it needs, so a new per-call input is one more field here rather than one more
keyword in every signature, and a custom part (:mod:`maxnnx.layers.parts`) keeps working
when the model learns a new one.

A ``LayerCall`` is a pytree whose Python scalars, booleans and ``None`` are static metadata:
``jit``, ``scan`` and ``remat`` see only its arrays. A window given as an ``int`` (a layer of
a known type) stays a compile-time constant; the traced window of a scanned stack mixing
layer types stays traced.
"""

from __future__ import annotations

import dataclasses

import jax

from maxnnx.kernels.masks import AttentionMask
from maxnnx.kernels.paged_attention import PagedBatch


@dataclasses.dataclass(frozen=True)
class LayerCall:
  """The per-call inputs of one decoder layer; ``None`` = not used by this call.

  Attributes:
    cos_sin: the layer's rotary ``(cos, sin)`` tables (``[B, T, rotary_dim // 2]`` each), or
      ``None`` to rotate nothing (learned positions, NoPE layers, ``linear`` layers).
    mask: the :class:`~maxnnx.kernels.masks.AttentionMask` of the queries and keys (when
      decoding, the keys are the cache slots); ``None`` in a paged call (the pages hold it).
    sliding_window: the layer's sliding window: an ``int``, or a traced int32 in scanned
      stacks mixing layer types (int32 max for layers without one).
    chunk_size: the layer's attention chunk (``ModelConfig.attention.chunk_size``), an
      ``int`` or traced like ``sliding_window``.
    nope: a traced bool in scanned stacks mixing NoPE and rotary layers: this layer skips
      the rotation ``cos_sin`` would apply.
    cache_index: decoding: the KV cache slot of this step's first token (int32 scalar).
    paged: serving: the :class:`~maxnnx.kernels.paged_attention.PagedBatch` saying where
      this step's flat tokens go in the page pools.
    per_layer_input: ``[B, T, per_layer_input_dim]``, this layer's slice of the model's
      per-layer inputs (``ModelConfig.per_layer_input_dim``).
    shared_kv: the keys and values (cache, or page pools when paged) of the layer whose
      keys and values this ``kv_shared`` layer attends with.
    return_kv: the attention (and the block) also return the keys and values they
      attended over: ``(out, (k, v))``.
  """

  cos_sin: tuple[jax.Array, jax.Array] | None = None
  mask: AttentionMask | None = None
  sliding_window: int | jax.Array | None = None
  chunk_size: int | jax.Array | None = None
  nope: jax.Array | None = None
  cache_index: jax.Array | None = None
  paged: PagedBatch | None = None
  per_layer_input: jax.Array | None = None
  shared_kv: tuple | None = None
  return_kv: bool = False

  def replace(self, **changes) -> LayerCall:
    """A copy with ``changes`` (field name -> value)."""
    return dataclasses.replace(self, **changes)

  def refuse(self, owner: str, *names: str) -> None:
    """Raise ``ValueError`` if one of the fields ``names`` is set: ``owner`` cannot use it."""
    for name in names:
      value = getattr(self, name)
      if value is not None and value is not False:
        raise ValueError(f'{owner} does not support LayerCall.{name}; leave it unset for this '
                         'layer (or use a layer type that supports it).')


_FIELDS = tuple(field.name for field in dataclasses.fields(LayerCall))


def _is_static(value) -> bool:
  return value is None or isinstance(value, (bool, int, float, str))


def _flatten_with_keys(call: LayerCall):
  """Arrays (and pytrees of them) as children; Python scalars and ``None`` as metadata."""
  children, static = [], []
  for name in _FIELDS:
    value = getattr(call, name)
    if _is_static(value):
      static.append((name, value))
    else:
      children.append((jax.tree_util.GetAttrKey(name), value))
  return children, (tuple(key.name for key, _ in children), tuple(static))


def _flatten(call: LayerCall):
  children, aux = _flatten_with_keys(call)
  return [value for _, value in children], aux


def _unflatten(aux, children) -> LayerCall:
  names, static = aux
  return LayerCall(**dict(zip(names, children)), **dict(static))


jax.tree_util.register_pytree_with_keys(LayerCall, _flatten_with_keys, _unflatten, _flatten)

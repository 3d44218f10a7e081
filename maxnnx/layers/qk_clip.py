"""QK-clip, the clip of Kimi K2's MuonClip: keep attention logits under a threshold by
rescaling the query and key projections after each optimizer step.

A model built with ``ModelConfig.runtime.record_max_logits`` gives each attention layer a
:class:`MaxLogits` variable, which every training forward pass overwrites with each head's
largest pre-softmax logit ``scale * q . k`` over the keys it may see (float32, outside the
gradient). ``xla_flash`` takes it from the blocks of scores it forms anyway (no dense mask or
scores); other strategies cost one more ``[B, heads, T, S]`` score pass per layer
(:func:`head_max_logits`; see ``layers.context_parallel.attend_and_max_logits``). After the update,
:func:`clip_query_key` multiplies head ``h`` by ``gamma_h = min(1, threshold / max_logit_h)``,
which scales that head's logits on the same input by exactly ``gamma_h``:

* multi-head attention with its own keys and values: ``W_q`` and ``W_k`` of the head each by
  ``sqrt(gamma_h)`` (the paper's split);
* grouped queries (a key head shared by several query heads), keys that are also the values, or
  a layer reading another layer's keys: ``W_q`` of the head by ``gamma_h`` alone, so that the
  shared key head and the other heads' logits are untouched;
* biases of the scaled projections scale with them, and of an output-gated query projection
  (``[query, gate]`` per head) only the query half does.

* MLA (the paper's case): each head's query and key ``nope`` columns by ``sqrt(gamma_h)``, its
  query ``rope`` columns by ``gamma_h``; the rotated key part, shared by every head, stays.

Layers with q/k norms are refused: the norm fixes each head's scale, so rescaling the
projections cannot lower the logits (and the norm bounds them already).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.layers.params import ForwardStat


class MaxLogits(ForwardStat):
  """Each head's largest pre-softmax attention logit in the last forward pass, ``[heads]``
  float32 (``[layers, heads]`` in a scanned stack). Not a parameter: optimizers skip it and
  ``save_pretrained`` does not write it."""


def head_max_logits(q_BTNH: jax.Array, k_BSKH: jax.Array, allowed_BTS: jax.Array,
                    scale: float) -> jax.Array:
  """``max over (b, t, s) allowed of scale * q[b, t, n] . k[b, s, n // group]`` per head
  ``n``, in float32 and outside the gradient (``-inf`` for a head that sees no key)."""
  batch, length, heads, head_dim = q_BTNH.shape
  kv_heads = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
  scores = jnp.einsum('btkgh,bskh->bkgts', jax.lax.stop_gradient(q_BTKGH),
                      jax.lax.stop_gradient(k_BSKH), preferred_element_type=jnp.float32) * scale
  scores = jnp.where(allowed_BTS[:, None, None], scores, -jnp.inf)
  return scores.max(axis=(0, 3, 4)).reshape(heads)


def clip_factors(max_logits: jax.Array, threshold: float) -> jax.Array:
  """``gamma = min(1, threshold / max_logit)`` per head (1 where the max is at most the
  threshold, or not finite: a head that saw no key)."""
  over = jnp.isfinite(max_logits) & (max_logits > threshold)
  return jnp.where(over, threshold / jnp.where(over, max_logits, 1.0), 1.0)


def qk_clip_metrics(max_logits: list[jax.Array], threshold: float) -> dict[str, jax.Array]:
  """``max_attention_logit`` (over every recording layer and head, before the clip) and
  ``qk_clipped_heads`` (how many heads the clip rescales)."""
  if not max_logits:
    return {}
  flat = jnp.concatenate([m.reshape(-1) for m in max_logits])
  return {'max_attention_logit': jnp.max(jnp.where(jnp.isfinite(flat), flat, -jnp.inf)),
          'qk_clipped_heads': jnp.sum(clip_factors(flat, threshold) < 1).astype(jnp.float32)}


def _attention_modules(model) -> list:
  from maxnnx.layers.attention import Attention  # noqa: PLC0415 (attention imports this)
  from maxnnx.layers.mla import MLA  # noqa: PLC0415
  return [m for _, m in nnx.iter_modules(model)
          if isinstance(m, (Attention, MLA)) and m.max_logits is not None]


def attention_max_logits(model) -> list[jax.Array]:
  """The :class:`MaxLogits` of every recording attention layer of ``model``, in graph order
  (traceable)."""
  return [m.max_logits[...] for m in _attention_modules(model)]


def records_max_logits(model) -> bool:
  """Whether ``model`` has attention layers that record their max logits."""
  return bool(_attention_modules(model))


def _scale_heads(projection, factor, columns: tuple[int, int] | None = None) -> None:
  """Multiply head ``n`` of a ``[in] -> [heads, width]`` projection (kernel
  ``[*layers, in, heads, width]``, bias ``[*layers, heads, width]``) by ``factor[..., n]`` in
  place; with ``columns=(start, stop)`` only those columns of each head."""
  def scale(variable, factor_heads) -> None:  # factor_heads broadcasts over [..., heads]
    value = variable[...]
    start, stop = columns if columns is not None else (0, value.shape[-1])
    index = jnp.arange(value.shape[-1])
    f = jnp.where((index >= start) & (index < stop), factor_heads[..., None], 1.0)
    variable[...] = (value.astype(jnp.float32) * f).astype(value.dtype)

  scale(projection.kernel, jnp.expand_dims(factor, axis=-2))  # the input axis
  if getattr(projection, 'bias', None) is not None:
    scale(projection.bias, factor)


def _clip_attention(module, gamma) -> None:
  width = module.q_proj.kernel.shape[-1]
  query = (0, width // 2) if module.output_gate else None  # [query, gate] per head
  own_keys = (module.k_proj is not None and module.v_proj is not None
              and module.k_proj.kernel.shape[-2] == module.q_proj.kernel.shape[-2])
  if own_keys:
    root = jnp.sqrt(gamma)
    _scale_heads(module.q_proj, root, query)
    _scale_heads(module.k_proj, root)
  else:
    _scale_heads(module.q_proj, gamma, query)


def _clip_mla(module, gamma) -> None:
  """MLA: each head's query and key ``nope`` columns by ``sqrt(gamma)`` (the key's come from
  ``kv_b_proj``), its query ``rope`` columns by ``gamma``; the rotated key part, shared by
  every head, and the values stay."""
  root, nope = jnp.sqrt(gamma), module.nope
  query = module.q_proj if module.q_proj is not None else module.q_b_proj
  _scale_heads(query, root, (0, nope))
  _scale_heads(query, gamma, (nope, nope + module.rope))
  _scale_heads(module.kv_b_proj, root, (0, nope))


def clip_query_key(model, max_logits: list[jax.Array], threshold: float) -> None:
  """Rescale the query/key projections of every recording attention layer of ``model`` in
  place so that its heads' logits on the measured input come back to ``threshold`` (see the
  module docstring). ``max_logits`` is :func:`attention_max_logits` of the same model (e.g.
  the maximum over a step's micro-batches)."""
  from maxnnx.layers.mla import MLA  # noqa: PLC0415 (mla imports this)
  for module, logits in zip(_attention_modules(model), max_logits, strict=True):
    gamma = clip_factors(logits, threshold)
    (_clip_mla if isinstance(module, MLA) else _clip_attention)(module, gamma)


__all__ = ['MaxLogits', 'attention_max_logits', 'clip_factors', 'clip_query_key',
           'head_max_logits', 'qk_clip_metrics', 'records_max_logits']

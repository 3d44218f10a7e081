"""LoRA adapters on projections that a Hugging Face checkpoint stores fused.

Phi-3 keeps q, k and v in one ``qkv_proj`` and gate and up in one
``gate_up_proj``; GPT-2 keeps q, k and v in ``attn.c_attn``. maxnnx has one
projection per part, so a PEFT adapter of a fused module and ours differ:

* **Export** (:func:`fuse_adapters`): the parts' adapters become one of rank
  ``k r`` (``k`` parts, zeros for a part without an adapter), ``A`` the parts'
  ``A`` stacked along the rank and ``B`` block-diagonal, so ``B A`` stacks each
  part's ``B_p A_p`` over the part's output rows exactly. PEFT is told the larger
  rank and an ``alpha`` ``k`` times larger (``rank_pattern`` /
  ``alpha_pattern``), which keeps the scale ``alpha / r``.
* **Import** (:func:`unfuse_adapters`): each part takes the fused ``B``'s rows of
  its outputs; with a block-diagonal ``B`` (as exported above) it takes its own
  block and rank ``r``, otherwise (an adapter PEFT trained) it shares the whole
  ``A``, rank ``k r``. Both are exact.

Adapters here are ``{module name: (A [r, in], B [out, r])}`` in PEFT's layout;
``groups`` is the family's ``Family.fused_modules(config)``: fused module suffix
``-> ((part suffix, output rows), ...)`` in row order.
"""

from __future__ import annotations

import numpy as np

from maxnnx.models.hf import PretrainedError

Adapters = dict[str, tuple[np.ndarray, np.ndarray]]


def _split_name(name: str, suffixes) -> tuple[str, str] | None:
  """``(prefix, suffix)`` for the first of ``suffixes`` that ends ``name`` as whole modules."""
  for suffix in suffixes:
    if name.endswith('.' + suffix):
      return name[:-len(suffix)], suffix
  return None


def fuse_adapters(adapters: Adapters, groups: dict) -> tuple[Adapters, dict[str, int]]:
  """Per-projection adapters -> the checkpoint's modules, and each fused module's rank factor.

  Returns ``(adapters, factors)``: ``factors`` maps the last name of each fused
  module written (``qkv_proj``) to ``k``, its number of parts.
  """
  parts_of = {part: (fused, i) for fused, parts in groups.items()
              for i, (part, _) in enumerate(parts)}
  out: Adapters = {}
  collected: dict[tuple[str, str], dict[int, tuple[np.ndarray, np.ndarray]]] = {}
  for name, pair in adapters.items():
    split = _split_name(name, parts_of)
    if split is None:
      out[name] = pair
      continue
    prefix, part = split
    fused, index = parts_of[part]
    collected.setdefault((prefix, fused), {})[index] = pair
  factors = {}
  for (prefix, fused), present in collected.items():
    parts = groups[fused]
    a_any, _ = next(iter(present.values()))
    rank, din = a_any.shape
    rows = [r for _, r in parts]
    a_fused = np.zeros((len(parts) * rank, din), a_any.dtype)
    b_fused = np.zeros((sum(rows), len(parts) * rank), a_any.dtype)
    for index, (a, b) in present.items():
      if a.shape != (rank, din) or b.shape != (rows[index], rank):
        raise ValueError(f'{prefix}{parts[index][0]}: adapter shapes A {a.shape}, B {b.shape} do '
                         f'not fit {prefix}{fused} (A ({rank}, {din}), B ({rows[index]}, {rank})).')
      start = sum(rows[:index])
      a_fused[index * rank:(index + 1) * rank] = a
      b_fused[start:start + rows[index], index * rank:(index + 1) * rank] = b
    out[prefix + fused] = (a_fused, b_fused)
    factors[fused.rsplit('.', 1)[-1]] = len(parts)
  return out, factors


def unfuse_adapters(adapters: dict[str, tuple[np.ndarray, np.ndarray, float]], groups: dict,
                    source: str) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
  """The checkpoint's modules -> per-projection adapters (each ``(A, B, scale)``).

  Raises ``PretrainedError`` (naming ``source`` and the module) when a fused
  adapter's ``B`` does not have the fused module's rows.
  """
  out = {}
  for name, (a, b, scale) in adapters.items():
    split = _split_name(name, groups)
    if split is None:
      out[name] = (a, b, scale)
      continue
    prefix, fused = split
    parts = groups[fused]
    rows = [r for _, r in parts]
    if b.shape[0] != sum(rows):
      raise PretrainedError(f'{source}: lora_B of {name} has {b.shape[0]} rows; {fused} has '
                            f'{sum(rows)} ({" + ".join(map(str, rows))}).')
    starts = np.cumsum([0, *rows])
    k, rank = len(parts), a.shape[0]
    block = rank // k if rank % k == 0 else None
    if block is not None:
      mask = np.ones(b.shape, bool)
      for i in range(k):
        mask[starts[i]:starts[i + 1], i * block:(i + 1) * block] = False
      if np.any(b[mask]):
        block = None  # a dense B (PEFT trained it): every part shares A
    for i, (part, _) in enumerate(parts):
      b_part = b[starts[i]:starts[i + 1]]
      if block is None:
        out[prefix + part] = (a, b_part, scale)
      else:
        cols = slice(i * block, (i + 1) * block)
        out[prefix + part] = (a[cols], b_part[:, cols], scale)
  return out


__all__ = ['fuse_adapters', 'unfuse_adapters']

"""Creating parameters that carry logical sharding names, and the variable type of the
statistics a forward pass writes."""

from collections.abc import Callable, Sequence

import jax
from flax import nnx

Initializer = Callable[[jax.Array, Sequence[int], jax.typing.DTypeLike], jax.Array]


class ForwardStat(nnx.Variable):
  """A statistic that each forward pass writes (MoE routing loads, attention max logits).

  Not a parameter: optimizers built with ``wrt=nnx.Param`` skip it and ``save_pretrained``
  does not write it. Scanned, rematerialised and pipelined layer stacks carry every
  ``ForwardStat`` out of their loop, so the model holds the last pass's values whatever its
  layout. Its ``combine`` metadata (``sum``, ``max`` or ``mean``, the default) says how the
  values of a batch's micro-batches make the whole batch's, where a pipeline splits it.
  """


def logical_param(init: Initializer, key: jax.Array, shape: Sequence[int], dtype,
                  names: Sequence[str], **metadata) -> nnx.Param:
  """An ``nnx.Param`` whose ``out_sharding`` metadata holds logical axis names.

  The names (``embed``, ``heads``, ``mlp``…) say what each dimension is; the
  sharding module maps them onto mesh axes. Eager sharding is off so a model can
  be built with or without a mesh; placement happens when the state is jitted
  with explicit output shardings. Extra ``metadata`` (e.g. ``contract_ndim``,
  how many leading dims a kernel contracts, used by Muon) is kept on the Param.
  """
  shape = tuple(shape)
  if len(names) != len(shape):
    raise ValueError(f'{len(names)} axis names {tuple(names)} for a {len(shape)}-d shape {shape}.')
  return nnx.Param(init(key, shape, dtype), out_sharding=tuple(names), eager_sharding=False,
                   **metadata)

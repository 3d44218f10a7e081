"""Build the norm a config asks for."""

from collections.abc import Sequence

from flax import nnx

from maxnnx.config import ModelConfig
from maxnnx.layers.norms import LayerNorm, RMSNorm


def make_norm(cfg: ModelConfig, shape: int | Sequence[int] | None = None,
              axes: Sequence[str] = ('norm',), *, rngs: nnx.Rngs) -> RMSNorm | LayerNorm:
  """The residual-stream norm of ``cfg`` (or an RMSNorm over ``shape``/``axes``)."""
  shape = cfg.d_model if shape is None else shape
  kwargs = dict(axes=axes, eps=cfg.norm_eps, scale_offset=cfg.norm_scale_offset,
                dtype=cfg.jnp_dtype(), param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)
  if cfg.norm_type == 'layer' and isinstance(shape, int):
    return LayerNorm(shape, **kwargs)
  return RMSNorm(shape, **kwargs)

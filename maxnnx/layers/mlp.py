"""Feed-forward blocks: gated (SwiGLU, GeGLU) or plain two-layer MLPs."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxnnx.config import ModelConfig, RuntimeConfig
from maxnnx.layers.layer_call import LayerCall
from maxnnx.layers.linear import DenseGeneral
from maxnnx.sharding import constrain

HIDDEN_AXES = ('activation_batch', 'activation_length', 'activation_mlp')

ACTIVATIONS = {
    'silu': jax.nn.silu,
    'gelu_tanh': lambda x: jax.nn.gelu(x, approximate=True),
    'gelu': lambda x: jax.nn.gelu(x, approximate=False),
    'relu': jax.nn.relu,
}


class MLP(nnx.Module):
  """``down(act(gate(x)) * up(x))`` when gated, else ``down(act(up(x)))``.

  Attributes:
    gate_proj: ``[d_model] -> [mlp]`` (gated only).
    up_proj: ``[d_model] -> [mlp]``.
    down_proj: ``[mlp] -> [d_model]``.
  """

  def __init__(self, d_model: int, mlp_dim: int, *, rngs: nnx.Rngs, activation: str = 'silu',
               gated: bool = True, use_bias: bool = False,
               runtime: RuntimeConfig | None = None):
    runtime = runtime or RuntimeConfig()
    d, m = d_model, mlp_dim
    dense = dict(use_bias=use_bias, dtype=runtime.jnp_dtype(),
                 param_dtype=runtime.jnp_dtype('param_dtype'), rngs=rngs)
    self.gate_proj = (DenseGeneral((d,), (m,), axes=('embed', 'mlp'), **dense)
                      if gated else None)
    self.up_proj = DenseGeneral((d,), (m,), axes=('embed', 'mlp'), **dense)
    self.down_proj = DenseGeneral((m,), (d,), axes=('mlp', 'embed'), **dense)
    self.activation = activation

  @classmethod
  def from_config(cls, cfg: ModelConfig, *, rngs: nnx.Rngs) -> MLP:
    """The dense MLP of a model: ``d_model -> mlp_dim -> d_model`` as ``cfg`` says."""
    return cls(cfg.d_model, cfg.mlp_dim, activation=cfg.mlp_activation, gated=cfg.mlp_gated,
               use_bias=cfg.mlp_bias, runtime=cfg.runtime, rngs=rngs)

  def __call__(self, x_BTD: jax.Array, call: LayerCall | None = None) -> jax.Array:
    """``[B, T, d_model]``; ``call`` (the block's :class:`~maxnnx.layers.layer_call.LayerCall`)
    is not read: the MLP acts on each token alone."""
    del call
    act = ACTIVATIONS[self.activation]
    if self.gate_proj is not None:
      h_BTF = act(self.gate_proj(x_BTD)) * self.up_proj(x_BTD)
    else:
      h_BTF = act(self.up_proj(x_BTD))
    h_BTF = checkpoint_name(constrain(h_BTF, HIDDEN_AXES), 'mlp_hidden')
    return checkpoint_name(self.down_proj(h_BTF), 'mlp_out')

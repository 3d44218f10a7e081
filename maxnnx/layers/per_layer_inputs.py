"""Per-layer inputs (Gemma 4 E2B/E4B): a small vector per token for every layer.

:class:`PerLayerInputs` (one per model) builds ``[B, T, num_layers, P]`` from two parts,
``P = ModelConfig.per_layer_input_dim``:

* a table indexed by the token id, ``[vocab, num_layers * P]``, scaled by ``sqrt(P)``;
* a projection of the token's (scaled) embedding, ``[d_model] -> [num_layers, P]``,
  scaled by ``d_model ** -0.5`` and RMS-normalised over ``P``;

summed and scaled by ``2 ** -0.5``. Block ``i`` reads slice ``i`` through
:class:`PerLayerInputGate`: after its MLP it adds
``norm(proj(act(gate(x)) * input_i))`` to the residual stream.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.config import ModelConfig
from maxnnx.layers.embedding import Embed
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.mlp import ACTIVATIONS
from maxnnx.layers.norm_factory import make_norm


class PerLayerInputs(nnx.Module):
  """The model's per-layer inputs ``[B, T, num_layers, P]``.

  Attributes:
    embed_tokens_per_layer: table ``[per_layer_input_vocab_size, num_layers * P]``.
    per_layer_model_projection: ``[d_model] -> [num_layers, P]``.
    per_layer_projection_norm: RMSNorm over ``P``.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dims = cfg.num_layers, cfg.per_layer_input_dim
    dtype, param_dtype = cfg.jnp_dtype(), cfg.jnp_dtype('param_dtype')
    self.vocab_size = cfg.per_layer_input_vocab_size or cfg.vocab_size
    self.embed_tokens_per_layer = Embed(self.vocab_size, dims[0] * dims[1],
                                        init_std=cfg.initializer_range, dtype=dtype,
                                        param_dtype=param_dtype, rngs=rngs)
    self.per_layer_model_projection = DenseGeneral(
        (cfg.d_model,), dims, axes=('embed', None, None), dtype=dtype,
        param_dtype=param_dtype, rngs=rngs)
    self.per_layer_projection_norm = make_norm(cfg, (dims[1],), (None,), rngs=rngs)

  def __call__(self, ids_BT: jax.Array, x_BTD: jax.Array) -> jax.Array:
    """``[B, T, num_layers, P]`` for token ids ``[B, T]`` and their embeddings ``x_BTD``
    (ids beyond the table get only the projection part)."""
    num_layers, width = self.per_layer_model_projection.out_shape
    known_BT = ids_BT < self.vocab_size
    table_BTX = self.embed_tokens_per_layer(jnp.where(known_BT, ids_BT, 0))
    table_BTX = table_BTX * (jnp.asarray(width**0.5, table_BTX.dtype) * known_BT[..., None])
    table_BTLP = table_BTX.reshape(*ids_BT.shape, num_layers, width)
    projected_BTLP = self.per_layer_model_projection(x_BTD) * jnp.asarray(
        x_BTD.shape[-1] ** -0.5, x_BTD.dtype)
    projected_BTLP = self.per_layer_projection_norm(projected_BTLP)
    return (projected_BTLP + table_BTLP) * jnp.asarray(2**-0.5, x_BTD.dtype)


class PerLayerInputGate(nnx.Module):
  """One block's use of its per-layer input: ``norm(proj(act(gate(x)) * input))``.

  Attributes:
    per_layer_input_gate: ``[d_model] -> [P]``.
    per_layer_projection: ``[P] -> [d_model]``.
    post_per_layer_input_norm: norm over ``d_model``.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dense = dict(dtype=cfg.jnp_dtype(), param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)
    width = cfg.per_layer_input_dim
    self.per_layer_input_gate = DenseGeneral((cfg.d_model,), (width,), axes=('embed', None),
                                             **dense)
    self.per_layer_projection = DenseGeneral((width,), (cfg.d_model,), axes=(None, 'embed'),
                                             **dense)
    self.post_per_layer_input_norm = make_norm(cfg, rngs=rngs)
    self.activation = cfg.mlp_activation

  def __call__(self, x_BTD: jax.Array, input_BTP: jax.Array) -> jax.Array:
    """What the block adds to its residual stream ``[B, T, d_model]``."""
    h_BTP = ACTIVATIONS[self.activation](self.per_layer_input_gate(x_BTD)) * input_BTP
    return self.post_per_layer_input_norm(self.per_layer_projection(h_BTP))

"""One decoder block: attention and MLP sub-blocks with pre- and/or post-norms."""

import jax
from flax import nnx

from maxnnx.config import LayerType, ModelConfig
from maxnnx.layers.attention import Attention
from maxnnx.layers.dropout import ATTENTION, dropout
from maxnnx.layers.dropout import MLP as MLP_SITE
from maxnnx.layers.gated_deltanet import GatedDeltaNet
from maxnnx.layers.layer_call import LayerCall
from maxnnx.layers.mla import MLA
from maxnnx.layers.mlp import MLP
from maxnnx.layers.moe import MoE
from maxnnx.layers.norm_factory import make_norm
from maxnnx.layers.params import logical_param
from maxnnx.layers.parts import BlockParts, build_part
from maxnnx.layers.per_layer_inputs import PerLayerInputGate
from maxnnx.sharding import constrain

RESIDUAL_AXES = ('activation_batch', 'activation_norm_length', 'activation_embed')


class DecoderBlock(nnx.Module):
  """``x + post(attn(pre(x)))`` then ``x + post(mlp(pre(x)))``.

  ``cfg.pre_norm`` and ``cfg.post_norm`` choose which norms exist: Llama-style
  blocks have only pre-norms, Gemma 2/3 both, OLMo 2 only post-norms.
  ``use_moe`` replaces the MLP by a :class:`~maxnnx.layers.moe.MoE` (same name, ``mlp``);
  ``linear_attention`` the attention by a :class:`~maxnnx.layers.gated_deltanet.GatedDeltaNet`
  (same name, ``attn``; the config's ``linear`` layers).
  ``parts`` (:class:`~maxnnx.layers.parts.BlockParts`) swaps in your own attention,
  MLP, MoE or norm modules; its ``None`` fields keep the config's choice.
  ``layer_type`` gives the attention its layer's shapes when ``cfg.attention.global_layers``
  sets the full layers apart (a custom attention factory then gets it as a keyword).

  With ``cfg.moe.dense_branch`` a MoE layer keeps its dense ``mlp`` and adds ``moe``
  beside it (Gemma 4)::

    mlp_out = mlp_post_norm(dense_post_norm(mlp(mlp_pre_norm(x)))
                            + moe_post_norm(moe(moe_pre_norm(x), router input x)))

  With ``cfg.per_layer_input_dim`` the block then adds ``per_layer_input(x, its input)``
  (:class:`~maxnnx.layers.per_layer_inputs.PerLayerInputGate`), and with
  ``cfg.layer_scale`` the result is multiplied by ``layer_scalar`` ``[1]``.
  ``kv_shared`` builds a block whose attention has no keys or values of its own
  (``cfg.num_kv_shared_layers``; the MLP is ``cfg.kv_shared_mlp_dim`` wide).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, use_moe: bool = False,
               parts: BlockParts | None = None, linear_attention: bool = False,
               layer_type: LayerType | None = None, kv_shared: bool = False):
    parts = BlockParts() if parts is None else parts
    self.dropout_rate = cfg.dropout_rate
    self.dropout_seed = nnx.data(None)  # a DropoutSeed, set by the model that stacks it

    def norm(enabled):
      if not enabled:
        return None
      return (make_norm(cfg, rngs=rngs) if parts.norm is None else
              build_part(parts.norm, cfg, rngs, 'norm'))

    self.attn_pre_norm = norm(cfg.pre_norm)
    if linear_attention:
      self.attn = GatedDeltaNet(cfg, rngs=rngs)
    else:
      shaped = ({'layer_type': layer_type}
                if cfg.attention.global_layers.is_set and layer_type is not None else {})
      if kv_shared:
        shaped['kv_shared'] = True
      if parts.attention is not None:
        self.attn = build_part(parts.attention, cfg, rngs, 'attention', **shaped)
      elif cfg.attention.type == 'mla':
        self.attn = MLA(cfg, rngs=rngs)
      else:
        self.attn = Attention(cfg, rngs=rngs, **shaped)
    self.attn_post_norm = norm(cfg.post_norm)
    self.mlp_pre_norm = norm(cfg.pre_norm)
    beside = use_moe and cfg.moe.dense_branch  # Gemma 4: dense MLP and experts side by side
    custom_mlp = parts.moe if use_moe and not beside else parts.mlp
    if kv_shared and cfg.kv_shared_mlp_dim is not None:
      cfg_mlp = cfg.replace(mlp_dim=cfg.kv_shared_mlp_dim)
    else:
      cfg_mlp = cfg
    if custom_mlp is None:
      self.mlp = (MoE.from_config(cfg, rngs=rngs) if use_moe and not beside
                  else MLP.from_config(cfg_mlp, rngs=rngs))
    else:
      self.mlp = build_part(custom_mlp, cfg, rngs, 'moe' if use_moe and not beside else 'mlp')
    self.dense_post_norm = norm(beside)
    self.moe_pre_norm = norm(beside)
    self.moe = nnx.data(None)
    if beside:
      self.moe = (MoE.from_config(cfg, rngs=rngs) if parts.moe is None
                  else build_part(parts.moe, cfg, rngs, 'moe'))
    self.moe_post_norm = norm(beside)
    self.mlp_post_norm = norm(cfg.post_norm)
    self.per_layer_input = (PerLayerInputGate(cfg, rngs=rngs) if cfg.per_layer_input_dim
                            else None)
    self.layer_scalar = (logical_param(nnx.initializers.ones, rngs.params(), (1,),
                                       cfg.jnp_dtype('param_dtype'), (None,))
                         if cfg.layer_scale else None)

  def __call__(self, x_BTD: jax.Array, call: LayerCall) -> jax.Array | tuple[jax.Array, tuple]:
    """The block's output ``[B, T, d_model]``.

    ``call`` (:class:`~maxnnx.layers.layer_call.LayerCall`) goes as it is to the attention,
    the MLP and the MoE; the block itself reads ``call.per_layer_input`` (this layer's
    ``[B, T, P]`` slice of the per-layer inputs) and ``call.return_kv``, with which the
    result is ``(output, the attention's keys and values)``.
    """
    x_BTD = constrain(x_BTD, RESIDUAL_AXES)
    h = self.attn_pre_norm(x_BTD) if self.attn_pre_norm is not None else x_BTD
    h = self.attn(h, call)
    kv = None
    if call.return_kv:
      h, kv = h
    if self.attn_post_norm is not None:
      h = self.attn_post_norm(h)
    x_BTD = x_BTD + self._dropped(h, ATTENTION)
    h = self.mlp_pre_norm(x_BTD) if self.mlp_pre_norm is not None else x_BTD
    h = self.mlp(h, call)
    if self.moe is not None:
      routed = self.moe(self.moe_pre_norm(x_BTD), call, router_input_BTD=x_BTD)
      h = self.dense_post_norm(h) + self.moe_post_norm(routed)
    if self.mlp_post_norm is not None:
      h = self.mlp_post_norm(h)
    x_BTD = x_BTD + self._dropped(h, MLP_SITE)
    if self.per_layer_input is not None:
      if call.per_layer_input is None:
        raise ValueError('This block takes a per-layer input (ModelConfig.per_layer_input_dim '
                         '> 0): set LayerCall.per_layer_input=[B, T, per_layer_input_dim].')
      x_BTD = x_BTD + self.per_layer_input(x_BTD, call.per_layer_input)
    if self.layer_scalar is not None:
      x_BTD = x_BTD * self.layer_scalar[...].astype(x_BTD.dtype)
    x_BTD = constrain(x_BTD, RESIDUAL_AXES)
    return (x_BTD, kv) if call.return_kv else x_BTD

  def _dropped(self, h: jax.Array, site: int) -> jax.Array:
    """``h`` under residual dropout (in the train step only; :mod:`maxnnx.layers.dropout`)."""
    if not self.dropout_rate or self.dropout_seed is None:
      return h
    return dropout(h, self.dropout_rate, self.dropout_seed[...], site)


def make_block(cfg: ModelConfig, rngs: nnx.Rngs, use_moe: bool = False,
               parts: BlockParts | None = None, linear_attention: bool = False,
               layer_type: LayerType | None = None, kv_shared: bool = False) -> nnx.Module:
  """One layer of the stack: ``parts.block`` when set, else a :class:`DecoderBlock`.

  ``linear_attention`` (a ``linear`` layer) and ``kv_shared`` reach a custom block factory
  only when set, ``layer_type`` only when ``cfg.attention.global_layers`` gives layer types
  their own shapes.
  """
  parts = BlockParts() if parts is None else parts
  extra = {'linear_attention': True} if linear_attention else {}
  if cfg.attention.global_layers.is_set and layer_type is not None:
    extra['layer_type'] = layer_type
  if kv_shared:
    extra['kv_shared'] = True
  if parts.block is None:
    return DecoderBlock(cfg, rngs=rngs, use_moe=use_moe, parts=parts, **extra)
  return build_part(parts.block, cfg, rngs, 'block', use_moe=use_moe, parts=parts, **extra)

"""One decoder block: attention and MLP sub-blocks with pre- and/or post-norms."""

import jax
from flax import nnx

from maxnnx.config import ModelConfig
from maxnnx.kernels.masks import AttentionMask
from maxnnx.layers.attention import Attention
from maxnnx.layers.gated_deltanet import GatedDeltaNet
from maxnnx.layers.mla import MLA
from maxnnx.layers.mlp import MLP
from maxnnx.layers.moe import MoE
from maxnnx.layers.norm_factory import make_norm
from maxnnx.layers.parts import BlockParts, build_part
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
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, use_moe: bool = False,
               parts: BlockParts | None = None, linear_attention: bool = False):
    parts = BlockParts() if parts is None else parts

    def norm(enabled):
      if not enabled:
        return None
      return (make_norm(cfg, rngs=rngs) if parts.norm is None else
              build_part(parts.norm, cfg, rngs, 'norm'))

    self.attn_pre_norm = norm(cfg.pre_norm)
    if linear_attention:
      self.attn = GatedDeltaNet(cfg, rngs=rngs)
    elif parts.attention is None:
      self.attn = MLA(cfg, rngs=rngs) if cfg.attention_type == 'mla' else Attention(cfg, rngs=rngs)
    else:
      self.attn = build_part(parts.attention, cfg, rngs, 'attention')
    self.attn_post_norm = norm(cfg.post_norm)
    self.mlp_pre_norm = norm(cfg.pre_norm)
    custom_mlp = parts.moe if use_moe else parts.mlp
    if custom_mlp is None:
      self.mlp = MoE.from_config(cfg, rngs=rngs) if use_moe else MLP.from_config(cfg, rngs=rngs)
    else:
      self.mlp = build_part(custom_mlp, cfg, rngs, 'moe' if use_moe else 'mlp')
    self.mlp_post_norm = norm(cfg.post_norm)

  def __call__(self, x_BTD: jax.Array, cos_sin, mask: AttentionMask | None, *,
               sliding_window=None, cache_index=None, paged=None, chunk_size=None,
               nope=None) -> jax.Array:
    """The block's output ``[B, T, d_model]``; the keywords go to the attention.

    ``paged`` (a :class:`~maxnnx.kernels.paged_attention.PagedBatch`),
    ``chunk_size`` (chunked layers) and ``nope`` (scanned stacks mixing NoPE and
    rotary layers) are passed on only when set, so custom attention parts
    without them keep working everywhere else.
    """
    x_BTD = constrain(x_BTD, RESIDUAL_AXES)
    h = self.attn_pre_norm(x_BTD) if self.attn_pre_norm is not None else x_BTD
    extra = {} if paged is None else {'paged': paged}
    for name, value in (('chunk_size', chunk_size), ('nope', nope)):
      if value is not None:
        extra[name] = value
    h = self.attn(h, cos_sin, mask, sliding_window=sliding_window, cache_index=cache_index,
                  **extra)
    if self.attn_post_norm is not None:
      h = self.attn_post_norm(h)
    x_BTD = x_BTD + h
    h = self.mlp_pre_norm(x_BTD) if self.mlp_pre_norm is not None else x_BTD
    h = self.mlp(h)
    if self.mlp_post_norm is not None:
      h = self.mlp_post_norm(h)
    return constrain(x_BTD + h, RESIDUAL_AXES)


def make_block(cfg: ModelConfig, rngs: nnx.Rngs, use_moe: bool = False,
               parts: BlockParts | None = None, linear_attention: bool = False) -> nnx.Module:
  """One layer of the stack: ``parts.block`` when set, else a :class:`DecoderBlock`.

  ``linear_attention`` (a ``linear`` layer) reaches a custom block factory only when set.
  """
  parts = BlockParts() if parts is None else parts
  extra = {'linear_attention': True} if linear_attention else {}
  if parts.block is None:
    return DecoderBlock(cfg, rngs=rngs, use_moe=use_moe, parts=parts, **extra)
  return build_part(parts.block, cfg, rngs, 'block', use_moe=use_moe, parts=parts, **extra)

"""Vision encoder and projector: images to embeddings in the language model's space.

:class:`VisionEncoder` is a SigLIP-style ViT (Gemma 3's vision tower): non-overlapping
patches through one linear map (the checkpoints' stride-``patch_size`` convolution), a
learned position per patch, pre-LayerNorm blocks of bidirectional multi-head attention
and a GELU MLP (all projections biased), a final LayerNorm.
:class:`PooledProjector` (Gemma 3's multimodal projector) average-pools the patch grid
to ``tokens_per_image`` tokens, RMS-normalises them (``1 + w``) and maps them to
``d_model``. Both read :class:`~maxnnx.config.VisionConfig`; their parameters carry the
text layers' logical axis names (``embed``, ``heads``, ``head_dim``, ``mlp``).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.config import ModelConfig, VisionConfig
from maxnnx.layers.embedding import Embed
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.mlp import ACTIVATIONS
from maxnnx.layers.norms import LayerNorm, RMSNorm
from maxnnx.layers.params import logical_param


def _dense(cfg: ModelConfig, rngs: nnx.Rngs):
  return dict(dtype=cfg.jnp_dtype(), param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)


def _layer_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> LayerNorm:
  v = cfg.vision
  return LayerNorm(v.hidden_size, axes=('embed',), eps=v.norm_eps, dtype=cfg.jnp_dtype(),
                   param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)


def patchify(pixels_BCHW: jax.Array, patch_size: int) -> jax.Array:
  """``[B, C, H, W]`` -> ``[B, (H/p) * (W/p), C, p, p]``, patches in row-major order."""
  b, c, h, w = pixels_BCHW.shape
  p = patch_size
  x = pixels_BCHW.reshape(b, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
  return x.reshape(b, (h // p) * (w // p), c, p, p)


class PatchEmbeddings(nnx.Module):
  """Patches to vectors plus a learned position each.

  Attributes:
    patch_embedding: ``[channels, patch, patch] -> [hidden]`` with bias.
    position_embedding: table ``[num_patches, hidden]``.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    v = cfg.vision
    self.patch_size = v.patch_size
    self.patch_embedding = DenseGeneral((v.num_channels, v.patch_size, v.patch_size),
                                        (v.hidden_size,), axes=(None, None, None, 'embed'),
                                        use_bias=True, **_dense(cfg, rngs))
    self.position_embedding = Embed(v.patches_per_side**2, v.hidden_size,
                                    init_std=cfg.initializer_range, dtype=cfg.jnp_dtype(),
                                    param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)

  def __call__(self, pixels_BCHW: jax.Array) -> jax.Array:
    """``[B, num_patches, hidden]``."""
    patches_BNCPP = patchify(pixels_BCHW.astype(self.patch_embedding.dtype), self.patch_size)
    x_BND = self.patch_embedding(patches_BNCPP)
    return x_BND + self.position_embedding.embedding[...].astype(x_BND.dtype)


class VisionAttention(nnx.Module):
  """Bidirectional multi-head self-attention over an image's patches (biased projections).

  Attributes:
    q_proj, k_proj, v_proj: ``[hidden] -> [heads, head_dim]``.
    out_proj: ``[heads, head_dim] -> [hidden]``.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    v = cfg.vision
    heads, head_dim = v.num_heads, v.hidden_size // v.num_heads
    dense = dict(use_bias=True, **_dense(cfg, rngs))
    for name in ('q_proj', 'k_proj', 'v_proj'):
      setattr(self, name, DenseGeneral((v.hidden_size,), (heads, head_dim),
                                       axes=('embed', 'heads', 'head_dim'), **dense))
    self.out_proj = DenseGeneral((heads, head_dim), (v.hidden_size,),
                                 axes=('heads', 'head_dim', 'embed'), **dense)

  def __call__(self, x_BND: jax.Array) -> jax.Array:
    """``[B, patches, hidden]``: every patch attends to every patch of its image."""
    q_BNHD, k_BNHD, v_BNHD = self.q_proj(x_BND), self.k_proj(x_BND), self.v_proj(x_BND)
    scores_BHNM = jnp.einsum('bnhd,bmhd->bhnm', q_BNHD, k_BNHD,
                             preferred_element_type=jnp.float32) * q_BNHD.shape[-1] ** -0.5
    weights_BHNM = jax.nn.softmax(scores_BHNM, axis=-1).astype(v_BNHD.dtype)
    out_BNHD = jnp.einsum('bhnm,bmhd->bnhd', weights_BHNM, v_BNHD)
    return self.out_proj(out_BNHD)


class VisionMLP(nnx.Module):
  """``fc2(act(fc1(x)))`` with biases.

  Attributes:
    fc1: ``[hidden] -> [intermediate]``.
    fc2: ``[intermediate] -> [hidden]``.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    v = cfg.vision
    dense = dict(use_bias=True, **_dense(cfg, rngs))
    self.fc1 = DenseGeneral((v.hidden_size,), (v.intermediate_size,), axes=('embed', 'mlp'),
                            **dense)
    self.fc2 = DenseGeneral((v.intermediate_size,), (v.hidden_size,), axes=('mlp', 'embed'),
                            **dense)
    self.activation = v.activation

  def __call__(self, x_BND: jax.Array) -> jax.Array:
    """``[B, patches, hidden]``."""
    return self.fc2(ACTIVATIONS[self.activation](self.fc1(x_BND)))


class VisionBlock(nnx.Module):
  """``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.layer_norm1 = _layer_norm(cfg, rngs)
    self.self_attn = VisionAttention(cfg, rngs=rngs)
    self.layer_norm2 = _layer_norm(cfg, rngs)
    self.mlp = VisionMLP(cfg, rngs=rngs)

  def __call__(self, x_BND: jax.Array) -> jax.Array:
    """``[B, patches, hidden]``."""
    x_BND = x_BND + self.self_attn(self.layer_norm1(x_BND))
    return x_BND + self.mlp(self.layer_norm2(x_BND))


class VisionEncoder(nnx.Module):
  """A ViT over ``[B, C, H, W]`` images: ``[B, num_patches, hidden]`` features.

  Attributes:
    embeddings: :class:`PatchEmbeddings`.
    encoder_layers: ``nnx.List`` of :class:`VisionBlock`.
    post_layernorm: the final LayerNorm.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.embeddings = PatchEmbeddings(cfg, rngs=rngs)
    self.encoder_layers = nnx.List([VisionBlock(cfg, rngs=rngs)
                                    for _ in range(cfg.vision.num_layers)])
    self.post_layernorm = _layer_norm(cfg, rngs)

  def __call__(self, pixels_BCHW: jax.Array) -> jax.Array:
    """``[B, num_patches, hidden]`` features of ``[B, C, H, W]`` images."""
    x_BND = self.embeddings(pixels_BCHW)
    for block in self.encoder_layers:
      x_BND = block(x_BND)
    return self.post_layernorm(x_BND)


class PooledProjector(nnx.Module):
  """Patch features ``[B, num_patches, hidden]`` -> ``[B, tokens_per_image, d_model]``.

  Attributes:
    mm_soft_emb_norm: RMSNorm over ``hidden`` (``1 + w``).
    mm_input_projection_weight: ``[hidden, d_model]``.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    v: VisionConfig = cfg.vision
    self.patches_per_side = v.patches_per_side
    self.tokens_per_side = round(v.tokens_per_image**0.5)
    self.mm_soft_emb_norm = RMSNorm(v.hidden_size, axes=('embed',), eps=v.norm_eps,
                                    scale_offset=1.0, dtype=cfg.jnp_dtype(),
                                    param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)
    self.mm_input_projection_weight = logical_param(
        nnx.initializers.normal(v.hidden_size**-0.5), rngs.params(),
        (v.hidden_size, cfg.d_model), cfg.jnp_dtype('param_dtype'), (None, 'embed'))

  def __call__(self, x_BND: jax.Array) -> jax.Array:
    """``[B, tokens_per_image, d_model]`` of patch features ``[B, num_patches, hidden]``."""
    b, _, d = x_BND.shape
    side, out = self.patches_per_side, self.tokens_per_side
    k = side // out
    pooled_BOD = x_BND.reshape(b, out, k, out, k, d).mean(axis=(2, 4)).reshape(b, out * out, d)
    normed_BOD = self.mm_soft_emb_norm(pooled_BOD)
    return jnp.einsum('bod,de->boe', normed_BOD,
                      self.mm_input_projection_weight[...].astype(normed_BOD.dtype))

"""Vision encoder and projector: images to embeddings in the language model's space.

:class:`VisionEncoder` is a SigLIP-style ViT (Gemma 3's vision tower): non-overlapping
patches through one linear map (the checkpoints' stride-``patch_size`` convolution), a
learned position per patch, pre-LayerNorm blocks of bidirectional multi-head attention
and a GELU MLP (all projections biased), a final LayerNorm.
:class:`PooledProjector` (Gemma 3's multimodal projector) average-pools the patch grid
to ``tokens_per_image`` tokens, RMS-normalises them (``1 + w``) and maps them to
``d_model``. Llama 4's tower is the same ViT with its options on (no patch bias, a class
token, a LayerNorm before the blocks, 2-D rotary embeddings, exact GELU), and
:class:`PixelShuffleProjector` folds neighbouring patches into tokens. All read
:class:`~maxnnx.config.VisionConfig`; their parameters carry the text layers' logical axis
names (``embed``, ``heads``, ``head_dim``, ``mlp``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
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
  """Patches to vectors plus a learned position each (and the class token, if any).

  Attributes:
    patch_embedding: ``[channels, patch, patch] -> [hidden]`` (biased unless
      ``vision.patch_bias`` is off).
    position_embedding: table ``[num_patches (+ 1 for the class token), hidden]``.
    class_embedding: ``[hidden]``, the class token appended after the patches
      (``vision.class_token``), else ``None``.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    v = cfg.vision
    self.patch_size = v.patch_size
    self.patch_embedding = DenseGeneral((v.num_channels, v.patch_size, v.patch_size),
                                        (v.hidden_size,), axes=(None, None, None, 'embed'),
                                        use_bias=v.patch_bias, **_dense(cfg, rngs))
    self.position_embedding = Embed(v.patches_per_side**2 + v.class_token, v.hidden_size,
                                    init_std=cfg.initializer_range, dtype=cfg.jnp_dtype(),
                                    param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)
    self.class_embedding = logical_param(
        nnx.initializers.normal(v.hidden_size**-0.5), rngs.params(), (v.hidden_size,),
        cfg.jnp_dtype('param_dtype'), ('embed',)) if v.class_token else None

  def __call__(self, pixels_BCHW: jax.Array) -> jax.Array:
    """``[B, num_patches (+ 1), hidden]``."""
    patches_BNCPP = patchify(pixels_BCHW.astype(self.patch_embedding.dtype), self.patch_size)
    x_BND = self.patch_embedding(patches_BNCPP)
    if self.class_embedding is not None:
      cls_B1D = jnp.broadcast_to(self.class_embedding[...].astype(x_BND.dtype),
                                 (x_BND.shape[0], 1, x_BND.shape[2]))
      x_BND = jnp.concatenate([x_BND, cls_B1D], axis=1)
    return x_BND + self.position_embedding.embedding[...].astype(x_BND.dtype)


def rope_2d_angles(head_dim: int, side: int, theta: float, class_token: bool) -> np.ndarray:
  """``[side * side (+ 1), head_dim / 2]`` float32 angles of Llama 4's 2-D rotary embedding:
  pair ``j < head_dim / 4`` turns by ``(column + 1) * theta ** (-4j / head_dim)``, pair
  ``head_dim / 4 + j`` by ``(row + 1)`` times the same; the class token does not turn."""
  half = head_dim // 2
  exponents = np.arange(0, half, 2, dtype=np.float32)[:half // 2] / np.float32(half)
  inv_freq = np.float32(1.0) / (np.float32(theta) ** exponents)
  index = np.arange(side * side)
  column = (index % side + 1).astype(np.float32)[:, None]
  row = (index // side + 1).astype(np.float32)[:, None]
  angles = np.concatenate([column * inv_freq, row * inv_freq], axis=1).astype(np.float32)
  if class_token:
    angles = np.concatenate([angles, np.zeros((1, half), np.float32)])
  return angles


def rotate_pairs(x_BNHD: jax.Array, angles_NP: jax.Array) -> jax.Array:
  """Rotate adjacent pairs ``(2i, 2i + 1)`` of the last axis by ``angles[:, i]`` (in float32)."""
  x = x_BNHD.astype(jnp.float32).reshape(*x_BNHD.shape[:-1], -1, 2)
  cos, sin = jnp.cos(angles_NP)[None, :, None], jnp.sin(angles_NP)[None, :, None]
  a, b = x[..., 0], x[..., 1]
  out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
  return out.reshape(x_BNHD.shape).astype(x_BNHD.dtype)


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
    self.rope = None if v.rope_theta is None else (  # static: the angles are constants
        head_dim, v.patches_per_side, float(v.rope_theta), v.class_token)

  def __call__(self, x_BND: jax.Array) -> jax.Array:
    """``[B, patches, hidden]``: every patch attends to every patch of its image."""
    q_BNHD, k_BNHD, v_BNHD = self.q_proj(x_BND), self.k_proj(x_BND), self.v_proj(x_BND)
    if self.rope is not None:
      angles_NP = jnp.asarray(rope_2d_angles(*self.rope))
      q_BNHD, k_BNHD = rotate_pairs(q_BNHD, angles_NP), rotate_pairs(k_BNHD, angles_NP)
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
    self.pre_layernorm = _layer_norm(cfg, rngs) if cfg.vision.pre_norm else None
    self.encoder_layers = nnx.List([VisionBlock(cfg, rngs=rngs)
                                    for _ in range(cfg.vision.num_layers)])
    self.post_layernorm = _layer_norm(cfg, rngs)
    self.class_token = cfg.vision.class_token

  def __call__(self, pixels_BCHW: jax.Array) -> jax.Array:
    """``[B, num_patches, hidden]`` features of ``[B, C, H, W]`` images (the class token,
    if any, dropped)."""
    x_BND = self.embeddings(pixels_BCHW)
    if self.pre_layernorm is not None:
      x_BND = self.pre_layernorm(x_BND)
    for block in self.encoder_layers:
      x_BND = block(x_BND)
    x_BND = self.post_layernorm(x_BND)
    return x_BND[:, :-1] if self.class_token else x_BND


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


class PixelShuffleProjector(nnx.Module):
  """Patch features ``[B, num_patches, hidden]`` -> ``[B, tokens_per_image, d_model]``
  (Llama 4): each ``s x s`` square of patches becomes one token of ``s * s * hidden``
  features (``s = 1 / pixel_shuffle_ratio``; row offset, then column offset, then
  feature), then ``gelu(fc2(gelu(fc1(x))))`` and one map to ``d_model``, all unbiased.

  Attributes:
    adapter_fc1: ``[s * s * hidden] -> [adapter_dim]``.
    adapter_fc2: ``[adapter_dim] -> [adapter_dim]``.
    linear_1: ``[adapter_dim] -> [d_model]``.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    v: VisionConfig = cfg.vision
    self.fold = round(1 / v.pixel_shuffle_ratio)
    self.side = v.patches_per_side
    dense = dict(use_bias=False, **_dense(cfg, rngs))
    self.adapter_fc1 = DenseGeneral((self.fold**2 * v.hidden_size,), (v.adapter_dim,),
                                    axes=('embed', 'mlp'), **dense)
    self.adapter_fc2 = DenseGeneral((v.adapter_dim,), (v.adapter_dim,), axes=('mlp', None),
                                    **dense)
    self.linear_1 = DenseGeneral((v.adapter_dim,), (cfg.d_model,), axes=(None, 'embed'),
                                 **dense)

  def __call__(self, x_BND: jax.Array) -> jax.Array:
    """``[B, tokens_per_image, d_model]`` of patch features ``[B, num_patches, hidden]``."""
    b, _, d = x_BND.shape
    s, grid = self.fold, self.side // self.fold
    x_BOF = (x_BND.reshape(b, grid, s, grid, s, d).transpose(0, 1, 3, 2, 4, 5)
             .reshape(b, grid * grid, s * s * d))
    gelu = functools.partial(jax.nn.gelu, approximate=False)
    return self.linear_1(gelu(self.adapter_fc2(gelu(self.adapter_fc1(x_BOF)))))


def make_projector(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """The projector ``cfg.vision.projector`` names."""
  if cfg.vision.projector == 'pixel_shuffle':
    return PixelShuffleProjector(cfg, rngs=rngs)
  return PooledProjector(cfg, rngs=rngs)

"""The image side of :class:`~maxnnx.models.transformer.Transformer`: image embeddings
placed at their placeholder tokens, and the image blocks whose tokens attend to each other
in both directions (vision-language models; nothing here runs without a vision tower).
"""

import jax
import jax.numpy as jnp
import numpy as np

from maxnnx.kernels.masks import image_blocks
from maxnnx.layers.block import RESIDUAL_AXES
from maxnnx.sharding import constrain


class VisionInputs:
  """Methods of a transformer with an optional ``vision_tower`` and
  ``multi_modal_projector`` (and a ``cache_blocks`` cache when decoding)."""

  def _image_blocks(self, ids_BT, pixel_values, token_type_ids, paged, embedded: bool):
    """Image-block ids ``[B, T]`` of a multimodal call, or ``None`` (also when paged: the
    batch holds them)."""
    if pixel_values is None and token_type_ids is None and not embedded:
      return None
    if self.vision_tower is None:
      raise ValueError('pixel_values / token_type_ids / image_embeddings need a model with a '
                       'vision tower (ModelConfig.vision.num_layers > 0).')
    if paged is not None:
      if pixel_values is not None or token_type_ids is not None:
        raise ValueError('With paged=..., images come as image_embeddings and their blocks in '
                         'PagedBatch.blocks_T (the serving Engine does this: '
                         'add_request(..., images=...)).')
      return None
    if not self.config.vision.bidirectional:  # image tokens attend causally (Llama 4)
      return None
    is_image_BT = (ids_BT == self.config.vision.image_token_id if token_type_ids is None
                   else token_type_ids == 1)
    return image_blocks(is_image_BT)

  def _cache_image_blocks(self, blocks_BT, shape, start):
    """This step's image-block ids (numbered after those already cached), written into
    ``cache_blocks``; all -1 without images."""
    if blocks_BT is None:
      blocks_BT = jnp.full(shape, -1, jnp.int32)
    else:
      first = jnp.max(self.cache_blocks[...], axis=1, keepdims=True) + 1
      blocks_BT = jnp.where(blocks_BT >= 0, blocks_BT + first, -1)
    self.cache_blocks[...] = jax.lax.dynamic_update_slice(self.cache_blocks[...], blocks_BT,
                                                          start)
    return blocks_BT

  def _text_ids(self, ids_BT):
    """Ids for the embedding table: an image placeholder beyond it becomes 0."""
    image_id = self.config.vision.image_token_id
    if self.vision_tower is None or image_id < self.config.vocab_size:
      return ids_BT
    return jnp.where(ids_BT == image_id, 0, ids_BT)

  def image_features(self, pixel_values: jax.Array) -> jax.Array:
    """``[num_images, tokens_per_image, d_model]``: the projected image embeddings."""
    if self.vision_tower is None:
      raise ValueError('image_features needs a model with a vision tower '
                       '(ModelConfig.vision.num_layers > 0).')
    v = self.config.vision
    expected = (v.num_channels, v.image_size, v.image_size)
    if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != expected:
      raise ValueError(f'pixel_values must be [num_images, {", ".join(map(str, expected))}] '
                       f'(ModelConfig.vision), got shape {tuple(pixel_values.shape)}.')
    return self.multi_modal_projector(self.vision_tower(pixel_values))

  def _place_images(self, x_BTD, ids_BT, pixel_values):
    """``x_BTD`` with the image placeholders' rows replaced by the image embeddings."""
    if pixel_values.ndim == 5:
      return self._place_row_images(x_BTD, ids_BT, pixel_values)
    features_ID = self.image_features(pixel_values)
    features_MD = features_ID.reshape(-1, features_ID.shape[-1]).astype(x_BTD.dtype)
    is_image_N = (ids_BT == self.config.vision.image_token_id).reshape(-1)
    if not isinstance(is_image_N, jax.core.Tracer):
      count = int(np.asarray(is_image_N).sum())
      if count != features_MD.shape[0]:
        raise ValueError(f'input_ids hold {count} image placeholder tokens (id '
                         f'{self.config.vision.image_token_id}) but {pixel_values.shape[0]} '
                         f'image(s) give {features_MD.shape[0]} embeddings '
                         f'({self.config.vision.tokens_per_image} each).')
    index_N = jnp.clip(jnp.cumsum(is_image_N) - 1, 0, features_MD.shape[0] - 1)
    x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
    x_ND = jnp.where(is_image_N[:, None], features_MD[index_N], x_ND)
    return constrain(x_ND.reshape(x_BTD.shape), RESIDUAL_AXES)

  def _place_row_images(self, x_BTD, ids_BT, pixels_BKCHW):
    """Per-row placement: row ``b``'s placeholders take row ``b``'s images in order."""
    b, k = pixels_BKCHW.shape[:2]
    if b != ids_BT.shape[0]:
      raise ValueError(f'pixel_values [batch, images_per_row, C, H, W] has batch {b}, but '
                       f'input_ids has {ids_BT.shape[0]} rows.')
    is_image_BT = ids_BT == self.config.vision.image_token_id
    room = k * self.config.vision.tokens_per_image
    if not isinstance(is_image_BT, jax.core.Tracer):
      counts = np.asarray(is_image_BT).sum(axis=1)
      if counts.max(initial=0) > room:
        row = int(counts.argmax())
        raise ValueError(f'row {row} of input_ids holds {int(counts[row])} image placeholder '
                         f'tokens (id {self.config.vision.image_token_id}), more than its {k} '
                         f'image(s) give ({room}).')
    features_BKID = self.image_features(pixels_BKCHW.reshape(b * k, *pixels_BKCHW.shape[2:]))
    features_BMD = features_BKID.reshape(b, room, features_BKID.shape[-1]).astype(x_BTD.dtype)
    index_BT = jnp.clip(jnp.cumsum(is_image_BT, axis=1) - 1, 0, features_BMD.shape[1] - 1)
    placed_BTD = jnp.take_along_axis(features_BMD, index_BT[..., None], axis=1)
    x_BTD = jnp.where(is_image_BT[..., None], placed_BTD, x_BTD)
    return constrain(x_BTD, RESIDUAL_AXES)

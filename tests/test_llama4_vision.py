"""Llama 4 with images against transformers.

``tests/fixtures/hf/llama4_vision`` (``make_vision_fixtures.py``) is a tiny random
``Llama4ForConditionalGeneration``: a 2-layer tower on 56x56 tiles (4x4 patches of 14,
pixel-shuffled to 4 tokens per tile, a class token, 2-D rotary embeddings) and a 2-layer
text model (a dense layer, then an MoE layer; chunks of 8 cutting through the images). Its
rows hold a single-tile image, and an image of 2x1 tiles plus its global tile followed by a
single-tile one, with the processor's start, separator and end tokens around the
``<|patch|>`` placeholders.
"""

import json
import os

import numpy as np
import pytest
from conftest import FIXTURES, export_and_compare, legacy_checkpoint, reference, rel_error

import maxnnx
from maxnnx.models.hf import PretrainedError
from maxnnx.serving import Engine, SamplingParams

CASE = os.path.join(FIXTURES, 'llama4_vision')
REL_TOL = 1e-4




@pytest.mark.parametrize('layout', ['transformers5', 'legacy'])
def test_logits_with_images_match_transformers(layout, tmp_path):
  """Tile features in place of the <|patch|> placeholders, in order, attending causally;
  both config layouts; text alone too."""
  ref = reference('llama4_vision')
  path = CASE if layout == 'transformers5' else legacy_checkpoint('llama4_vision', str(tmp_path))
  model = maxnnx.from_pretrained(path)
  v = model.config.vision
  assert (v.num_layers, v.tokens_per_image, v.projector, v.bidirectional) == (
      2, 4, 'pixel_shuffle', False)
  assert rel_error(model(ref['input_ids'], pixel_values=ref['pixel_values']),
                    ref['logits']) < REL_TOL
  assert rel_error(model(ref['text_ids']), ref['text_logits']) < REL_TOL


def test_export_writes_the_checkpoint_back(tmp_path):
  """save_pretrained writes the fixture's tensors under their multimodal names and a nested
  config that loads as the same model."""
  _, written = export_and_compare('llama4_vision', tmp_path)
  assert written['architectures'] == ['Llama4ForConditionalGeneration']
  assert written['vision_config']['vision_output_dim'] == 48
  assert maxnnx.from_pretrained(str(tmp_path)).config == maxnnx.config_from_pretrained(CASE)


@pytest.mark.slow  # ~20 s; tests/test_vision_serving.py serves Gemma 3 images by default
def test_the_engine_serves_tiles_like_generate():
  """Each tile's run of placeholders takes that tile's features; a budget of 8 tokens makes
  the prefill chunks stop before each tile rather than inside it."""
  ref = reference('llama4_vision')
  model = maxnnx.from_pretrained(CASE)
  v = model.config.vision
  ids = ref['input_ids'][1]
  images = ref['pixel_values'][1:]  # row 1's four tiles
  want = maxnnx.generate(model, [ids.tolist()], max_new_tokens=4, eos_ids=None,
                         pixel_values=images).tokens[0].tolist()
  engine = Engine(model, max_batch=2, token_budget=8, page_size=8, max_model_len=64)
  got = engine.generate([ids.tolist()], SamplingParams(max_tokens=4, temperature=0.0,
                                                       ignore_eos=True), images=[images])
  assert list(got[0].token_ids) == want
  assert (ids == v.image_token_id).sum() == 4 * v.tokens_per_image


def test_an_inconsistent_vision_config_is_refused(tmp_path):
  with open(os.path.join(CASE, 'config.json')) as f:
    config = json.load(f)
  config['vision_config']['intermediate_size'] = 96
  with open(tmp_path / 'config.json', 'w') as f:
    json.dump(config, f)
  with pytest.raises(PretrainedError, match=r'intermediate_size \(96\) must be '
                                            r'hidden_size / pixel_shuffle_ratio\*\*2 = 128'):
    maxnnx.config_from_pretrained(str(tmp_path))


IMAGES = os.path.join(os.path.dirname(FIXTURES), 'images')


def test_tiling_matches_the_transformers_processor():
  """Canvas, resize, tiles (row by row, then the global tile) and bfloat16-rounded
  normalisation equal transformers' Llama 4 processor on the committed PNGs."""
  from maxnnx.data.images import TiledImageProcessor, load_image_processor
  ref = np.load(os.path.join(IMAGES, 'llama4_processor.npz'))
  names = ('landscape', 'portrait', 'square_rgba')
  pixels, layouts = TiledImageProcessor(tile_size=16, max_patches=6)(
      [os.path.join(IMAGES, f'{n}.png') for n in names])
  assert layouts == [tuple(r) for r in ref['aspect_ratios'].tolist()]
  assert pixels.shape == ref['pixel_values'].shape and pixels.dtype == np.float32
  np.testing.assert_allclose(pixels, ref['pixel_values'], rtol=0, atol=1e-6)
  processor = load_image_processor(CASE)
  assert isinstance(processor, TiledImageProcessor) and processor.tile_size == 56


@pytest.mark.parametrize('size,tiles', [
    ((100, 100), (1, 1)), ((336, 336), (1, 1)), ((337, 337), (2, 2)), ((500, 300), (2, 1)),
    ((300, 800), (1, 3)), ((1000, 1000), (3, 3)), ((2000, 300), (6, 1)), ((50, 1500), (1, 5)),
    ((700, 1400), (3, 5)), ((100, 700), (1, 3))])
def test_canvases_are_the_ones_transformers_picks(size, tiles):
  """The tiles (of 336, at most 16) transformers' Llama 4 processor gives images of these
  sizes; a short image is not enlarged past one tile's height (100x700 stays 100x700,
  padded to 336x1008)."""
  from maxnnx.data.images import TiledImageProcessor
  (height, width), new = TiledImageProcessor().canvas(*size)
  assert (height // 336, width // 336) == tiles
  if size == (100, 700):
    assert new == (100, 700)


def test_the_prompt_writes_each_tile_and_the_global_one():
  from maxnnx.config import VisionConfig
  from maxnnx.data.images import TiledImagePrompt

  class Specials:
    special_tokens = {t: i for i, t in enumerate(
        ['<|image|>', '<|image_start|>', '<|image_end|>', '<|tile_x_separator|>',
         '<|tile_y_separator|>', 'P'])}
  vision = VisionConfig(num_layers=1, hidden_size=8, intermediate_size=32, num_heads=2,
                        image_size=28, patch_size=7, tokens_per_image=4, image_token_id=5,
                        projector='pixel_shuffle', adapter_dim=4)
  prompt = TiledImagePrompt.from_tokenizer(Specials(), vision, model='Llama 4')
  prompt = TiledImagePrompt(**{**prompt.__dict__, 'tokens_per_tile': 2})
  text, count = prompt.expand('a<|image|>b<|image|>', [(2, 3), (1, 1)])
  x, y = '<|tile_x_separator|>', '<|tile_y_separator|>'
  assert count == 2 and text == (
      f'a<|image_start|>PP{x}PP{x}PP{y}PP{x}PP{x}PP{y}<|image|>PP<|image_end|>'
      'b<|image_start|><|image|>PP<|image_end|>')
  with pytest.raises(ValueError, match='2 image markers but tile layouts for 1'):
    prompt.expand('<|image|><|image|>', [(1, 1)])

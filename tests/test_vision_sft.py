"""Image+text SFT: chat records with images -> rows, their pixels and an assistant-only mask.

A Gemma 3 style tokenizer (its turn and image tokens, ``<image_soft_token>`` at the tiny
vision preset's ``image_token_id``) renders conversations whose user turns hold images;
the pipeline must put each record's placeholders and its own pixels in the same row, and
the model must give each row's placeholders that row's images.
"""

import base64
import json
import os
import shutil

import numpy as np
import pytest
from conftest import FIXTURES

import maxnnx
from maxnnx.data import DataConfig, ImageProcessor, make_sft_pipeline
from maxnnx.models import gemma3

IMAGES = os.path.join(os.path.dirname(FIXTURES), 'images')


@pytest.fixture(scope='module')
def vision_config():
  return maxnnx.get_preset('tiny-gemma3-vision')


def _processor(cfg):
  v = cfg.vision
  return ImageProcessor(height=v.image_size, width=v.image_size)


def _records(tmp_path):
  """Four records beside copies of the test images: a relative path, TRL's ``images``
  list with bare parts (two images), a data URL, and text only."""
  os.makedirs(tmp_path, exist_ok=True)
  for name in ('landscape.png', 'portrait.png'):
    shutil.copy(os.path.join(IMAGES, name), tmp_path / name)
  with open(os.path.join(IMAGES, 'square_rgba.png'), 'rb') as f:
    data_url = 'data:image/png;base64,' + base64.b64encode(f.read()).decode()
  records = [
      {'messages': [
          {'role': 'user', 'content': [{'type': 'image', 'image': 'landscape.png'},
                                       {'type': 'text', 'text': 'What is this?'}]},
          {'role': 'assistant', 'content': 'A wide field.'}]},
      {'images': ['portrait.png', 'landscape.png'], 'messages': [
          {'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': 'and'},
                                       {'type': 'image'}]},
          {'role': 'assistant', 'content': [{'type': 'text', 'text': 'Tall, then wide.'}]}]},
      {'messages': [
          {'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': data_url}},
                                       {'type': 'text', 'text': 'Colour?'}]},
          {'role': 'assistant', 'content': 'Red.'}]},
      {'messages': [{'role': 'user', 'content': 'Say hi.'},
                    {'role': 'assistant', 'content': 'Hi.'}]},
  ]
  path = tmp_path / 'records.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))
  return str(path), [['landscape.png'], ['portrait.png', 'landscape.png'],
                     ['square_rgba.png'], []]


def _pipeline(path, tokenizer_dir, cfg, **kwargs):
  from maxnnx.data import load_tokenizer
  tokenizer = load_tokenizer(str(tokenizer_dir / 'tokenizer.json'))
  options = dict(batch_size=4, seq_len=96, images_per_row=2,
                 image_processor=_processor(cfg),
                 image_prompt=gemma3.image_prompt(tokenizer, cfg.vision))
  config = DataConfig(sources=(path,), kind='jsonl', shuffle=False, overlong='truncate')
  return make_sft_pipeline(config, tokenizer, **{**options, **kwargs}), tokenizer


def test_rows_carry_their_own_images_and_train_on_the_answers(
    tmp_path, gemma3_tokenizer_dir, vision_config):
  path, names = _records(tmp_path)
  pipe, tokenizer = _pipeline(path, gemma3_tokenizer_dir, vision_config)
  batch = next(iter(pipe))
  v, processor = vision_config.vision, _processor(vision_config)
  assert batch['pixel_values'].shape == (4, 2, 3, v.image_size, v.image_size)
  answers = ['A wide field.', 'Tall, then wide.', 'Red.', 'Hi.']
  for row, (row_names, answer) in enumerate(zip(names, answers)):
    assert (batch['inputs'][row] == v.image_token_id).sum() == v.tokens_per_image * len(row_names)
    expected = processor([os.path.join(IMAGES, n) for n in row_names])[0] if row_names else []
    np.testing.assert_array_equal(batch['pixel_values'][row, :len(row_names)],
                                  np.asarray(expected).reshape(-1, 3, v.image_size, v.image_size))
    assert not batch['pixel_values'][row, len(row_names):].any()  # zero images pad the row
    trained = batch['targets'][row][batch['loss_mask'][row] == 1]
    assert tokenizer.decode(trained) == answer + '<end_of_turn>'
    # The placeholders sit between the blank-line-wrapped start and end of image tokens.
    text = tokenizer.decode(batch['inputs'][row][batch['segment_ids'][row] == 1])
    assert text.count('\n\n<start_of_image>' + '<image_soft_token>' * v.tokens_per_image
                      + '<end_of_image>\n\n') == len(row_names)


def test_pan_and_scan_crops_follow_their_image_in_the_row(tmp_path, gemma3_tokenizer_dir,
                                                         vision_config):
  """An elongated image brings its crops: the prompt writes them as transformers'
  Gemma3Processor does, and the row's pixels are the image then its crops."""
  path, _ = _records(tmp_path)
  v = vision_config.vision
  processor = ImageProcessor(height=v.image_size, width=v.image_size, pan_and_scan=True,
                             pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=3)
  pipe, tokenizer = _pipeline(path, gemma3_tokenizer_dir, vision_config, seq_len=256,
                              images_per_row=8, image_processor=processor)
  batch = next(iter(pipe))
  expected, crops = processor([os.path.join(IMAGES, 'landscape.png')])
  assert crops == [3]
  assert (batch['inputs'][0] == v.image_token_id).sum() == 4 * v.tokens_per_image
  np.testing.assert_array_equal(batch['pixel_values'][0, :4], expected)
  assert not batch['pixel_values'][0, 4:].any()
  text = tokenizer.decode(batch['inputs'][0][batch['segment_ids'][0] == 1])
  image = '\n\n<start_of_image>' + '<image_soft_token>' * v.tokens_per_image + '<end_of_image>\n\n'
  assert (f'Here is the original image {image} and here are some crops to help you see '
          f'better {image} {image} {image}') in text
  trained = batch['targets'][0][batch['loss_mask'][0] == 1]
  assert tokenizer.decode(trained) == 'A wide field.<end_of_turn>'
  assert (batch['inputs'][1] == v.image_token_id).sum() == 8 * v.tokens_per_image


def test_bad_image_records_name_the_record_and_the_fix(tmp_path, gemma3_tokenizer_dir,
                                                       vision_config):
  path, _ = _records(tmp_path)
  with pytest.raises(ValueError, match=r'records.jsonl line 2: 2 images, more than '
                                       r'images_per_row=1'):
    next(iter(_pipeline(path, gemma3_tokenizer_dir, vision_config, images_per_row=1)[0]))
  with pytest.raises(ValueError, match=r'line 1: .*image tokens run to position .* past '
                                       r'seq_len=8'):
    next(iter(_pipeline(path, gemma3_tokenizer_dir, vision_config, seq_len=8)[0]))
  os.remove(tmp_path / 'portrait.png')
  pipe = iter(_pipeline(path, gemma3_tokenizer_dir, vision_config)[0])
  with pytest.raises(ValueError, match=r'line 2: .*portrait.png: no such image file'):
    next(pipe)
  with pytest.raises(ValueError, match=r'line 1: the record has images but the pipeline has '
                                       r'no image side'):
    next(iter(_pipeline(path, gemma3_tokenizer_dir, vision_config, images_per_row=0,
                        image_processor=None, image_prompt=None)[0]))
  with pytest.raises(ValueError, match='needs image_processor='):
    _pipeline(path, gemma3_tokenizer_dir, vision_config, image_prompt=None)
  with pytest.raises(ValueError, match="lacks Gemma 3's image tokens: '<start_of_image>'"):
    gemma3.image_prompt(_plain_tokenizer(), vision_config.vision)


def _plain_tokenizer():
  """A tokenizer without Gemma 3's image tokens."""
  class Plain:
    special_tokens = {'<bos>': 0}
    vocab_size = 10
  return Plain()


def test_row_images_go_to_their_own_rows(vision_config):
  """``pixel_values [B, K, C, H, W]``: each row's placeholders take its own images, in
  order, and the zero images padding a row change nothing; equal to placing the same
  images row by row with ``[n, C, H, W]``."""
  from flax import nnx
  cfg, v = vision_config, vision_config.vision
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng()
  pixels = rng.normal(size=(3, 3, v.image_size, v.image_size)).astype(np.float32)
  n = v.tokens_per_image
  rows = rng.integers(3, 200, (2, 2 * n + 6)).astype(np.int32)
  rows[0, 2:2 + n] = v.image_token_id                       # row 0: one image
  rows[1, 1:1 + n] = rows[1, 3 + n:3 + 2 * n] = v.image_token_id  # row 1: two images
  batch_pixels = np.zeros((2, 2, 3, v.image_size, v.image_size), np.float32)
  batch_pixels[0, 0], batch_pixels[1] = pixels[0], pixels[1:]
  together = np.asarray(model(rows, pixel_values=batch_pixels))
  alone = [np.asarray(model(rows[:1], pixel_values=pixels[:1])),
           np.asarray(model(rows[1:], pixel_values=pixels[1:]))]
  np.testing.assert_allclose(together, np.concatenate(alone), rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match='row 1 of input_ids holds 32 image placeholder'):
    model(rows, pixel_values=batch_pixels[:, :1])


def _sft_losses(tmp_path, tokenizer_dir, cfg, mesh, trainable=None, steps=4):
  from maxnnx.train import TrainConfig, Trainer
  path, _ = _records(tmp_path)
  pipe, _ = _pipeline(path, tokenizer_dir, cfg)
  config = TrainConfig(steps=steps, global_batch_size=4, seq_len=96, images_per_row=2,
                       learning_rate=1e-2, warmup_steps=0, log_every=1, mesh=mesh)
  trainer = Trainer(cfg, config, data=pipe, trainable=trainable)
  tower = np.asarray(trainer.model.vision_tower.encoder_layers[0].mlp.fc1.kernel[...])
  history = trainer.fit(log=lambda line: None)
  moved = not np.array_equal(
      np.asarray(trainer.model.vision_tower.encoder_layers[0].mlp.fc1.kernel[...]), tower)
  return np.array([m['loss'] for m in history]), moved


def test_image_text_sft_with_a_frozen_tower(tmp_path, gemma3_tokenizer_dir, vision_config):
  """The SFT rows drive the Trainer: the assistant loss falls, the frozen tower stays."""
  from flax import nnx

  from maxnnx.config import MeshConfig
  frozen = nnx.All(nnx.Param, nnx.Not(nnx.PathContains('vision_tower')))
  losses, moved = _sft_losses(tmp_path, gemma3_tokenizer_dir, vision_config,
                              MeshConfig(data=1), trainable=frozen)
  assert losses[-1] < losses[0] and not moved


@pytest.mark.slow  # ~60 s: two compiles of the step, one on 8 devices
def test_image_text_sft_on_a_2x2x2_mesh_equals_one_device(tmp_path, gemma3_tokenizer_dir,
                                                         vision_config):
  """Image+text SFT batches (rows split over data/fsdp with their images) give the same
  losses on a 2x2x2 mesh as on one device, and the tower trains."""
  from maxnnx.config import MeshConfig
  one, moved = _sft_losses(tmp_path / 'one', gemma3_tokenizer_dir, vision_config,
                           MeshConfig(data=1), steps=3)
  mesh, _ = _sft_losses(tmp_path / 'mesh', gemma3_tokenizer_dir, vision_config,
                        MeshConfig(data=2, fsdp=2, tensor=2), steps=3)
  np.testing.assert_allclose(mesh, one, rtol=1e-4)
  assert moved


def test_cli_sft_trains_on_image_chat_records(tmp_path, gemma3_tokenizer_dir, capsys):
  """``maxnnx sft ... images_per_row=2``: the records' images reach the model (a preset with
  a tower takes SigLIP's normalisation at its own image size)."""
  from maxnnx import cli
  path, _ = _records(tmp_path)
  out = tmp_path / 'run'
  args = ['sft', 'model=tiny-gemma3-vision', f'tokenizer={gemma3_tokenizer_dir}/tokenizer.json',
          f'data={path}', 'images_per_row=2', 'steps=2', 'global_batch_size=4', 'seq_len=96',
          'log_every=1', f'output_dir={out}', 'mesh.data=1']
  assert cli.main(args) == 0, capsys.readouterr().err
  metrics = [json.loads(line) for line in open(out / 'metrics.jsonl')]
  assert [m['step'] for m in metrics if 'loss' in m] == [1, 2]
  capsys.readouterr()
  text_only = ['sft', 'model=tiny', args[2], f'data={path}', 'images_per_row=1', 'steps=1',
               f'output_dir={tmp_path}/o2']
  assert cli.main(text_only) == 2
  assert 'the model needs a vision tower' in capsys.readouterr().err

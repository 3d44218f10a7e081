"""Images + text: Gemma 3's vision tower, projector and image blocks against transformers.

``tests/fixtures/hf/gemma3_vision`` (``make_vision_fixtures.py``) is a tiny random
``Gemma3ForConditionalGeneration``: a 2-layer SigLIP tower on 32x32 images (8x8 patches
pooled to 16 tokens) and a 2-layer text model whose sliding window (8) is narrower than an
image; its references hold logits with images (image tokens attending to each other in
both directions) and text-only logits.
"""

import dataclasses
import os
import shutil

import numpy as np
import pytest
from conftest import FIXTURES, export_and_compare, legacy_checkpoint, reference, rel_error
from flax import nnx

import maxnnx
from maxnnx.checkpoint.safetensors import read_safetensors, write_safetensors
from maxnnx.kernels.attention import get_attention_kernel
from maxnnx.kernels.capabilities import AttentionRequest
from maxnnx.kernels.masks import AttentionMask, image_blocks
from maxnnx.kernels.options import AttentionOptions

CASE = os.path.join(FIXTURES, 'gemma3_vision')
REL_TOL = 1e-4




@pytest.mark.parametrize('layout,scan_layers', [
    ('transformers5', False), ('legacy', False),
    pytest.param('transformers5', True, marks=pytest.mark.slow)])
def test_logits_with_images_match_transformers(layout, scan_layers, tmp_path):
  """Image embeddings in place of the placeholders, bidirectional within each image (derived
  from the ids, or from token_type_ids), both config layouts, scanned text stack too; text
  alone too."""
  ref = reference('gemma3_vision')
  path = CASE if layout == 'transformers5' else legacy_checkpoint('gemma3_vision', str(tmp_path))
  model = maxnnx.from_pretrained(path, scan_layers=scan_layers)
  assert model.config.vision.num_layers == 2 and model.config.vision.tokens_per_image == 16
  logits = model(ref['input_ids'], pixel_values=ref['pixel_values'])
  assert rel_error(logits, ref['logits']) < REL_TOL
  typed = model(ref['input_ids'], pixel_values=ref['pixel_values'],
                token_type_ids=ref['token_type_ids'])
  assert rel_error(typed, ref['logits']) < REL_TOL
  assert rel_error(model(ref['text_ids']), ref['text_logits']) < REL_TOL


def test_pan_and_scan_prompts_match_transformers_processor_and_model():
  """With pan-and-scan on, the checkpoint's tokenizer and preprocessor_config give the ids
  transformers' Gemma3Processor gives (an image with 3 crops, then one with none), the same
  5 pictures, and logits at rel < 1e-4 (``pan_and_scan.npz``)."""
  from maxnnx.data import load_tokenizer
  from maxnnx.data.chat import encode_with_specials
  from maxnnx.models import image_inputs_for
  ref = np.load(os.path.join(CASE, 'pan_and_scan.npz'))
  model = maxnnx.from_pretrained(CASE)
  tokenizer = load_tokenizer(os.path.join(CASE, 'tokenizer.json'))
  processor, prompt = image_inputs_for(model.config, tokenizer, CASE, pan_and_scan=True)
  images = os.path.join(os.path.dirname(FIXTURES), 'images')
  pixels, crops = processor([os.path.join(images, n) for n in ('landscape.png',
                                                               'square_rgba.png')])
  assert crops == [3, 0]
  text, count = prompt.expand(
      '<bos>Look at <start_of_image> then at <start_of_image>, and say.', crops)
  assert count == 2
  ids = np.asarray([encode_with_specials(tokenizer, text)])
  np.testing.assert_array_equal(ids, ref['input_ids'])
  np.testing.assert_allclose(pixels, ref['pixel_values'], rtol=0, atol=1e-5)
  assert rel_error(model(ids, pixel_values=pixels), ref['logits']) < REL_TOL
  plain, _ = image_inputs_for(model.config, tokenizer, CASE)
  assert not plain.pan_and_scan  # as transformers' processor, unless asked
  tiled = dataclasses.replace(prompt, crops_format=None)
  with pytest.raises(ValueError, match='pan_and_scan=False'):
    tiled.expand('<start_of_image>', [2])


def test_export_writes_the_checkpoint_back(tmp_path):
  """save_pretrained writes the fixture's tensors (names, layouts, values) and a config that
  loads as the same model."""
  export_and_compare('gemma3_vision', tmp_path)
  assert maxnnx.from_pretrained(str(tmp_path)).config == maxnnx.config_from_pretrained(CASE)


def test_the_hub_prefix_layout_loads(tmp_path):
  """Hub checkpoints keep ``vision_tower.vision_model.*``; they load to the same logits."""
  tensors = read_safetensors(os.path.join(CASE, 'model.safetensors'))
  hub = {name.replace('vision_tower.', 'vision_tower.vision_model.', 1): array
         for name, array in tensors.items()}
  write_safetensors(str(tmp_path / 'model.safetensors'), hub)
  shutil.copy(os.path.join(CASE, 'config.json'), tmp_path)
  ref = reference('gemma3_vision')
  model = maxnnx.from_pretrained(str(tmp_path))
  assert rel_error(model(ref['input_ids'], pixel_values=ref['pixel_values']),
                    ref['logits']) < REL_TOL


def test_image_blocks_and_the_mask_they_make():
  """Runs of image tokens get one id each; within a block keys after the query are visible,
  a window still cuts, and text stays causal (against a direct NumPy construction)."""
  is_image = np.array([[0, 1, 1, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0, 1, 1]])
  blocks = np.asarray(image_blocks(is_image))
  np.testing.assert_array_equal(blocks, [[-1, 0, 0, -1, 1, 1, 1, -1], [0, 0, -1, -1, -1, -1, 1, 1]])
  positions = np.broadcast_to(np.arange(8), (2, 8))
  mask = AttentionMask.causal(np.ones((2, 8), np.int32), positions, blocks)
  dense = np.asarray(mask.dense(sliding_window=2))
  q, k = np.arange(8)[:, None], np.arange(8)[None, :]
  for b in range(2):
    same = (blocks[b][:, None] == blocks[b][None, :]) & (blocks[b][:, None] >= 0)
    np.testing.assert_array_equal(dense[b], ((k <= q) | same) & (q - k < 2))


def test_kernels_that_cannot_hold_image_blocks_say_so():
  q = np.zeros((1, 4, 2, 8), np.float32)
  options = AttentionOptions(scale=1.0)
  blocks = image_blocks(np.array([[0, 1, 1, 0]]))
  mask = AttentionMask.causal(np.ones((1, 4), np.int32), np.arange(4)[None], blocks)
  request = AttentionRequest.of(q, q, q, options, mask)
  assert request.blocks
  assert 'image blocks' in ' '.join(get_attention_kernel('pallas_gpu').unsupported_reasons(request))
  assert not get_attention_kernel('xla').unsupported_reasons(request)
  assert 'image blocks' in ' '.join(get_attention_kernel('xla_flash').unsupported_reasons(request))


def test_bad_image_inputs_are_clear_errors():
  ref = reference('gemma3_vision')
  model = maxnnx.from_pretrained(CASE)
  with pytest.raises(ValueError, match='48 image placeholder tokens'):
    model(ref['input_ids'], pixel_values=ref['pixel_values'][:2])
  with pytest.raises(ValueError, match=r'pixel_values must be \[num_images, 3, 32, 32\]'):
    model(ref['input_ids'], pixel_values=ref['pixel_values'][:, :, :16])
  text_only = maxnnx.Transformer(maxnnx.get_preset('tiny'), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='vision tower'):
    text_only(np.zeros((1, 4), np.int32), pixel_values=ref['pixel_values'])


def test_greedy_generation_with_an_image_matches_transformers():
  """The prompt's image fills the KV cache as one bidirectional block; decoding continues
  as transformers' generate does."""
  ref = reference('gemma3_vision')
  model = maxnnx.from_pretrained(CASE)
  prompt, expected = ref['gen_prompt'], ref['gen_output'][:, ref['gen_prompt'].shape[1]:]
  result = maxnnx.generate(model, prompt, max_new_tokens=expected.shape[1], eos_ids=None,
                           pixel_values=ref['pixel_values'][:1])
  np.testing.assert_array_equal(result.tokens, expected)
  other = maxnnx.generate(model, prompt, max_new_tokens=expected.shape[1], eos_ids=None,
                          pixel_values=ref['pixel_values'][1:2])
  assert not np.array_equal(other.tokens, expected)  # the image is what it looks at
  with pytest.raises(ValueError, match='16 image placeholder tokens'):
    maxnnx.generate(model, prompt, max_new_tokens=2, pixel_values=ref['pixel_values'][:2])


# google/gemma-3-4b-it's config.json as the Hub has it: the text config spells out only what
# differs from transformers' defaults, the special tokens sit at the top level.
GEMMA3_4B_HUB = {
    'architectures': ['Gemma3ForConditionalGeneration'], 'boi_token_index': 255999,
    'eoi_token_index': 256000, 'eos_token_id': [1, 106], 'image_token_index': 262144,
    'initializer_range': 0.02, 'mm_tokens_per_image': 256, 'model_type': 'gemma3',
    'text_config': {'hidden_size': 2560, 'intermediate_size': 10240,
                    'model_type': 'gemma3_text', 'num_hidden_layers': 34,
                    'rope_scaling': {'factor': 8.0, 'rope_type': 'linear'},
                    'sliding_window': 1024},
    'torch_dtype': 'bfloat16', 'transformers_version': '4.50.0.dev0',
    'vision_config': {'hidden_size': 1152, 'image_size': 896, 'intermediate_size': 4304,
                      'model_type': 'siglip_vision_model', 'num_attention_heads': 16,
                      'num_hidden_layers': 27, 'patch_size': 14, 'vision_use_head': False},
}


def test_the_gemma3_4b_hub_config_is_the_whole_model_preset():
  """Nested config with transformers' defaults filled in: the 4B preset, vision tower included
  (the special tokens come from the top level)."""
  from maxnnx.models.hf import HFConfig
  from maxnnx.models.registry import specs
  family = specs()['gemma3'].hf
  cfg = family.config_from_hf(HFConfig(GEMMA3_4B_HUB, 'config.json', family.defaults))
  preset = maxnnx.get_preset('gemma3-4b')
  assert cfg.vision == preset.vision and cfg.eos_token_id == (1, 106)
  assert cfg.replace(eos_token_id=None, bos_token_id=None, pad_token_id=None,
                     max_position_embeddings=preset.max_position_embeddings) == preset


@pytest.mark.slow  # ~25 s (the sharded load; image+text training on a mesh is slow too)
def test_the_vision_tower_shards_on_a_mesh_like_the_text_stack():
  """Loaded onto a 2x2x2 mesh, the tower's weights split along fsdp/tensor by their logical
  names, and the logits with images equal the single-device ones."""
  from maxnnx.config import MeshConfig
  ref = reference('gemma3_vision')
  sharded = maxnnx.from_pretrained(CASE, mesh=MeshConfig(data=2, fsdp=2, tensor=2))
  fc1 = sharded.vision_tower.encoder_layers[0].mlp.fc1.kernel[...]
  q = sharded.vision_tower.encoder_layers[0].self_attn.q_proj.kernel[...]
  assert fc1.sharding.shard_shape(fc1.shape) == (16, 32)  # [embed / fsdp, mlp / tensor]
  assert q.sharding.shard_shape(q.shape) == (16, 2, 8)  # [embed / fsdp, heads / tensor, -]
  logits = sharded(ref['input_ids'], pixel_values=ref['pixel_values'])
  assert rel_error(logits, ref['logits']) < 1e-5


def _image_text_batches(cfg, batch: int, seq_len: int, seed: int):
  """Rows of text around one image's placeholders; the next token after the image is a
  function of the image (its mean brightness), the loss only on text."""
  v = cfg.vision
  rng = np.random.default_rng(seed)
  while True:
    bright = rng.integers(0, 2, batch)
    pixels = (rng.normal(0, 0.3, (batch, 1, v.num_channels, v.image_size, v.image_size))
              + np.where(bright, 0.6, -0.6)[:, None, None, None, None]).astype(np.float32)
    rows = rng.integers(10, 40, (batch, seq_len + 1))
    rows[:, 2:2 + v.tokens_per_image] = v.image_token_id
    after = 2 + v.tokens_per_image
    rows[:, after] = np.where(bright, 100, 101)
    loss_mask = (rows[:, 1:] != v.image_token_id).astype(np.float32)
    yield {'inputs': rows[:, :-1], 'targets': rows[:, 1:], 'loss_mask': loss_mask,
           'pixel_values': pixels}


def _image_text_losses(mesh, trainable=None):
  from maxnnx.train import TrainConfig, Trainer
  cfg = maxnnx.get_preset('tiny-gemma3-vision')
  config = TrainConfig(steps=3, global_batch_size=8, seq_len=32, images_per_row=1,
                       learning_rate=1e-2, warmup_steps=0, log_every=3, mesh=mesh)
  trainer = Trainer(cfg, config, data=_image_text_batches(cfg, 8, 32, seed=2),
                    trainable=trainable)
  tower = np.asarray(trainer.model.vision_tower.encoder_layers[0].mlp.fc1.kernel[...])
  history = trainer.fit(log=lambda line: None)
  moved = not np.array_equal(
      np.asarray(trainer.model.vision_tower.encoder_layers[0].mlp.fc1.kernel[...]), tower)
  return np.array([m['loss'] for m in history]), moved


@pytest.mark.slow  # ~90 s: two compiles of the step, one on 8 devices
def test_image_text_training_on_a_2x2x2_mesh_equals_one_device():
  """pixel_values [batch, images_per_row, C, H, W] travel with the rows (split like them over
  data/fsdp); the losses on a 2x2x2 mesh equal one device's, and the tower trains."""
  from maxnnx.config import MeshConfig
  one, moved = _image_text_losses(MeshConfig(data=1))
  mesh, _ = _image_text_losses(MeshConfig(data=2, fsdp=2, tensor=2))
  np.testing.assert_allclose(mesh, one, rtol=1e-4)
  assert moved


def test_image_batches_are_checked():
  from maxnnx.train.batches import as_batch
  rows = np.zeros((2, 9), np.int32)
  with pytest.raises(ValueError, match='pixel_values'):
    as_batch(rows, image_shape=(1, 3, 64, 64))
  batch = {'inputs': rows[:, :-1], 'targets': rows[:, 1:],
           'pixel_values': np.zeros((2, 1, 3, 32, 32), np.float32)}
  with pytest.raises(ValueError, match=r'expected \(2, 1, 3, 64, 64\)'):
    as_batch(batch, image_shape=(1, 3, 64, 64))
  with pytest.raises(ValueError, match='images_per_row is 0'):
    as_batch(batch)


@pytest.mark.slow  # ~40 s: an eager forward and backward through tower and text
def test_lora_reaches_the_vision_tower():
  """A target name adapts the text layers and the tower's blocks alike (as PEFT matches module
  names); the tower's adapters get gradients from an image+text loss."""
  from maxnnx.train.lora import LoraConfig, apply_lora
  model = maxnnx.Transformer(maxnnx.get_preset('tiny-gemma3-vision'), rngs=nnx.Rngs(0))
  model = apply_lora(model, LoraConfig(rank=4, targets='q_proj,fc1'))
  adapted = {'.'.join(map(str, p[:-1])) for p, _ in
             nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
  assert 'vision_tower.encoder_layers.1.mlp.fc1' in adapted
  assert 'vision_tower.encoder_layers.0.self_attn.q_proj' in adapted
  assert 'layers.0.attn.q_proj' in adapted
  v = model.config.vision
  ids = np.array([[5] + [v.image_token_id] * v.tokens_per_image + [6, 7]])
  pixels = np.random.default_rng(0).normal(size=(1, 3, 64, 64)).astype(np.float32)

  def loss(model):
    return model(ids, pixel_values=pixels)[0, -1, 9]

  grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
  flat = {'.'.join(map(str, p)): np.asarray(g[...]) for p, g in nnx.to_flat_state(grads)}
  assert np.abs(flat['vision_tower.encoder_layers.0.mlp.fc1.kernel_lora_a']).max() == 0  # B = 0
  assert np.abs(flat['vision_tower.encoder_layers.0.mlp.fc1.kernel_lora_b']).max() > 0


def test_lora_targets_name_tower_and_text_projections_alike(tmp_path):
  """``q_proj`` adapts the text attention and the tower's; ``fc1`` the tower's MLP; the PEFT
  file names them as transformers' multimodal model does."""
  from maxnnx.train.lora import LoraConfig, apply_lora, save_adapter
  model = maxnnx.Transformer(maxnnx.get_preset('tiny-gemma3-vision'), rngs=nnx.Rngs(0))
  model = apply_lora(model, LoraConfig(rank=4, targets='q_proj,fc1'))
  adapted = {'.'.join(map(str, p[:-1])) for p, _ in
             nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
  assert {'vision_tower.encoder_layers.1.mlp.fc1', 'layers.0.attn.q_proj',
          'vision_tower.encoder_layers.0.self_attn.q_proj'} <= adapted
  save_adapter(model, str(tmp_path))
  names = set(read_safetensors(str(tmp_path / 'adapter_model.safetensors')))
  assert {'base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight',
          'base_model.model.model.vision_tower.encoder.layers.1.mlp.fc1.lora_B.weight'} <= names

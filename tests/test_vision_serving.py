"""Serving a vision-language model: the paged engine with images equals ``generate``.

The tiny Gemma 3 vision preset (16 tokens per image, image tokens attending to each other in
both directions, a sliding window narrower than an image) serves prompts with images beside
text-only ones, under a token budget that would cut an image if the scheduler let it.
"""

import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.models import gemma3
from maxnnx.serving import Engine, SamplingParams


@pytest.fixture(scope='module')
def model():
  return maxnnx.Transformer(maxnnx.get_preset('tiny-gemma3-vision'), rngs=nnx.Rngs(3))


def _prompt(rng, v, before: int, images: int, after: int) -> list[int]:
  """Text, then ``images`` runs of placeholders between start/end-of-image stand-ins."""
  ids = rng.integers(3, 200, before).tolist()
  for _ in range(images):
    ids += [201] + [v.image_token_id] * v.tokens_per_image + [202]
  return ids + rng.integers(3, 200, after).tolist()


def _pixels(rng, v, n):
  return rng.normal(size=(n, v.num_channels, v.image_size, v.image_size)).astype(np.float32)


def _greedy(n):
  return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_requests_with_images_equal_generate(model):
  v = model.config.vision
  rng = np.random.default_rng()
  prompts = [_prompt(rng, v, 5, 1, 3), _prompt(rng, v, 2, 0, 9), _prompt(rng, v, 11, 2, 1)]
  images = [_pixels(rng, v, 1), None, _pixels(rng, v, 2)]
  want = [maxnnx.generate(model, [p], max_new_tokens=6, eos_ids=None, pixel_values=im)
          .tokens[0].tolist() for p, im in zip(prompts, images)]
  # A 24-token budget would end a chunk inside every image: the scheduler stops before it.
  engine = Engine(model, max_batch=3, token_budget=24, page_size=8, max_model_len=96)
  got = engine.generate(prompts, _greedy(6), images=images)
  assert [list(c.token_ids) for c in got] == want
  assert any('images' in shape for shape in engine.step_shapes)
  assert engine.compile_count <= engine.max_compiles()


def test_cached_pages_are_shared_only_by_the_same_images(model):
  v = model.config.vision
  rng = np.random.default_rng()
  prompt = _prompt(rng, v, 3, 1, 20)
  first, second = _pixels(rng, v, 1), _pixels(rng, v, 1)
  engine = Engine(model, max_batch=2, token_budget=64, page_size=8, max_model_len=96)
  alone = engine.generate([prompt], _greedy(4), images=[first])[0]
  same = engine.generate([prompt], _greedy(4), images=[first])[0]
  other = engine.generate([prompt], _greedy(4), images=[second])[0]
  assert alone.num_cached_tokens == 0 and same.num_cached_tokens > 0
  assert other.num_cached_tokens == 0
  assert same.token_ids == alone.token_ids
  want = maxnnx.generate(model, [prompt], max_new_tokens=4, eos_ids=None, pixel_values=second)
  assert list(other.token_ids) == want.tokens[0].tolist()


def test_bad_images_are_refused_with_the_reason(model):
  v = model.config.vision
  rng = np.random.default_rng()
  engine = Engine(model, max_batch=2, token_budget=64, page_size=8, max_model_len=96)
  prompt = _prompt(rng, v, 3, 1, 2)
  with pytest.raises(ValueError, match=r'one run of 16 placeholder tokens .* runs of \[16\] '
                                       r'for 2 image'):
    engine.add_request(prompt, images=_pixels(rng, v, 2))
  with pytest.raises(ValueError, match=r'images must be \[num_images, 3, 64, 64\]'):
    engine.add_request(prompt, images=np.zeros((1, 3, 32, 32), np.float32))
  with pytest.raises(ValueError, match='token_budget=8 must be at least'):
    Engine(model, max_batch=2, token_budget=8, page_size=8,
           max_model_len=96).add_request(prompt, images=_pixels(rng, v, 1))
  text_only = maxnnx.Transformer(maxnnx.get_preset('tiny'), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='images need a model with a vision tower'):
    Engine(text_only, max_model_len=64).add_request([1, 2, 3], images=_pixels(rng, v, 1))


def test_the_server_answers_chats_with_image_url_data_urls(model, gemma3_tokenizer_dir):
  """An OpenAI client's chat with a base64 PNG: the reply equals generate on the rendered
  prompt (markers expanded) with the processed image; a URL the server would have to
  fetch is a 400 naming the part."""
  import base64
  import os

  import openai
  from conftest import FIXTURES
  from test_serving_server import _running

  from maxnnx.data import ImageProcessor, load_tokenizer
  from maxnnx.data.chat import encode_with_specials, load_chat_template
  from maxnnx.serving.server import make_app
  v = model.config.vision
  tokenizer = load_tokenizer(str(gemma3_tokenizer_dir / 'tokenizer.json'))
  png = os.path.join(os.path.dirname(FIXTURES), 'images', 'portrait.png')
  with open(png, 'rb') as f:
    url = 'data:image/png;base64,' + base64.b64encode(f.read()).decode()
  messages = [{'role': 'user', 'content': [
      {'type': 'text', 'text': 'Look:'}, {'type': 'image_url', 'image_url': {'url': url}},
      {'type': 'text', 'text': 'What is it?'}]}]
  template = load_chat_template(str(gemma3_tokenizer_dir))
  text = template.render([{'role': 'user', 'content': [
      {'type': 'text', 'text': 'Look:'}, {'type': 'image'},
      {'type': 'text', 'text': 'What is it?'}]}], add_generation_prompt=True)
  text, count = gemma3.image_prompt(tokenizer, v).expand(text)
  ids = encode_with_specials(tokenizer, text)
  pixels = ImageProcessor(height=v.image_size, width=v.image_size)([png])[0]
  want = maxnnx.generate(model, [ids], max_new_tokens=5, eos_ids=None, pixel_values=pixels)
  engine = Engine(model, tokenizer, max_batch=2, token_budget=64, page_size=8,
                  max_model_len=128)
  with _running(make_app(engine, model_name='vision')) as (base, _):
    client = openai.OpenAI(base_url=f'{base}/v1', api_key='none')
    reply = client.chat.completions.create(
        model='vision', messages=messages, max_tokens=5, temperature=0,
        extra_body={'return_token_ids': True, 'ignore_eos': True})
    assert list(reply.choices[0].token_ids) == want.tokens[0].tolist()
    assert reply.usage.prompt_tokens == len(ids) and count == 1
    messages[0]['content'][1]['image_url']['url'] = 'https://example.com/cat.png'
    with pytest.raises(openai.BadRequestError, match='must be a data: URL'):
      client.chat.completions.create(model='vision', messages=messages, max_tokens=2)

"""One engine over several processes: process 0's calls replayed by the others.

The fast tests replay a leader's recorded calls on a second engine in this process (what a
follower process does) and check both engines produce the same outputs, step by step. The
slow test runs ``maxnnx serve`` and ``maxnnx generate`` over two processes (2 CPU devices
each, the model sharded over all 4) against one process.
"""

import asyncio
import base64
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import openai
import pytest
from conftest import free_port
from flax import nnx

import maxnnx
from maxnnx.data import load_tokenizer
from maxnnx.inference.structured import StructuredOutput
from maxnnx.serving import Engine, SamplingParams
from maxnnx.serving.lockstep import LeaderEngine, decode_call, encode_call, follow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Recorded:
  """A channel that keeps what the leader publishes, for a follower to read afterwards."""

  def __init__(self):
    self.messages = []

  def publish(self, message: bytes) -> None:
    self.messages.append(message)

  def receive(self) -> bytes:
    return self.messages.pop(0)


def _outputs(outputs):
  return [(o.request_id, o.new_token_ids, o.new_logprobs, o.finished, o.finish_reason)
          for o in outputs]


@pytest.fixture(scope='module')
def tiny_model():
  return maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=256, num_layers=1),
                            rngs=nnx.Rngs(0))


def test_a_follower_replaying_the_leader_gives_its_outputs(tiny_model):
  """Sampled requests without seeds, a refused one, a cancellation mid-run, requests joining
  while others decode: the follower's engine gives the leader's outputs at every step."""
  rng = np.random.default_rng()
  kwargs = dict(max_batch=3, token_budget=24, page_size=8, max_model_len=64, seed=int(
      rng.integers(1000)))
  channel = Recorded()
  leader = LeaderEngine(Engine(tiny_model, **kwargs), channel)
  steps = []
  ids = [leader.add_request(rng.integers(0, 256, int(rng.integers(1, 30))).tolist(),
                            SamplingParams(max_tokens=int(rng.integers(2, 12)), temperature=0.8,
                                           top_k=40, logprobs=2))
         for _ in range(4)]
  with pytest.raises(ValueError, match='at least one token'):
    leader.add_request([], SamplingParams())
  steps.append(_outputs(leader.step()))
  assert leader.cancel(ids[1])
  steps.append(_outputs(leader.step()))
  leader.add_request(rng.integers(0, 256, 9).tolist(), SamplingParams(max_tokens=5))
  while leader.has_unfinished():
    steps.append(_outputs(leader.step()))
  leader.close()
  leader.close()  # once only

  follower = Engine(tiny_model, **kwargs)
  replayed = []
  step = follower.step
  follower.step = lambda: (replayed.append(_outputs(out := step())), out)[1]
  assert follow(follower, channel) == len(steps)
  assert replayed == steps
  assert channel.messages == []  # everything up to the one stop was read


def test_a_follower_replays_requests_with_images():
  """Image requests reach the follower's engine with their pixels: its steps give the
  leader's outputs (a request without its images would be refused there)."""
  model = maxnnx.Transformer(maxnnx.get_preset('tiny-gemma3-vision'), rngs=nnx.Rngs(3))
  v = model.config.vision
  rng = np.random.default_rng()
  kwargs = dict(max_batch=2, token_budget=24, page_size=8, max_model_len=64)
  channel = Recorded()
  leader = LeaderEngine(Engine(model, **kwargs), channel)
  for text in (3, 7):
    prompt = rng.integers(3, 200, text).tolist() + [v.image_token_id] * v.tokens_per_image
    pixels = rng.normal(size=(1, v.num_channels, v.image_size, v.image_size))
    leader.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.7, seed=text),
                       pixels.astype(np.float32))
  steps = []
  while leader.has_unfinished():
    steps.append(_outputs(leader.step()))
  leader.close()
  follower = Engine(model, **kwargs)
  replayed = []
  step = follower.step
  follower.step = lambda: (replayed.append(_outputs(out := step())), out)[1]
  assert follow(follower, channel) == len(steps)
  assert replayed == steps and sum(len(s) for s in steps) == 8  # 4 tokens each


def test_calls_travel_as_json_with_images_as_npy():
  pixels = np.random.default_rng().standard_normal((2, 3, 4, 4)).astype(np.float32)
  params = SamplingParams(max_tokens=3, stop=('x', 'yz'), stop_token_ids=(5,), seed=7)
  op, prompt, back, images = decode_call(encode_call('add', np.array([[1, 2, 3]]), params,
                                                     pixels))
  assert (op, prompt, back) == ('add', [1, 2, 3], params)
  np.testing.assert_array_equal(images, pixels)
  constrained = SamplingParams(max_tokens=3, structured=StructuredOutput('regex', '[ab]+'))
  assert decode_call(encode_call('add', [1], constrained, None))[2] == constrained
  assert decode_call(encode_call('cancel', np.int64(4))) == ('cancel', 4)
  assert decode_call(encode_call('step')) == ('step',)
  body = json.loads(encode_call('add', [1], params, pixels))  # the whole message is JSON
  assert set(body) == {'op', 'prompt', 'params', 'images'}
  with pytest.raises(ValueError, match='pickle'):  # objects are never sent ...
    encode_call('add', [1], params, np.array([{}], dtype=object))
  buffer = io.BytesIO()
  np.save(buffer, np.array([{}], dtype=object), allow_pickle=True)
  forged = json.dumps({**body, 'images': base64.b64encode(buffer.getvalue()).decode()})
  with pytest.raises(ValueError, match='pickle'):  # ... nor unpickled when received
    decode_call(forged.encode())


def test_tensor_parallel_mesh_names_the_counts_it_can_place(capsys, served_dir):
  from maxnnx.cli import main  # noqa: PLC0415
  from maxnnx.sharding import tensor_parallel_mesh  # noqa: PLC0415
  assert tensor_parallel_mesh(1) is None
  assert (tensor_parallel_mesh(4).data, tensor_parallel_mesh(4).tensor) == (1, 4)
  with pytest.raises(ValueError, match=r'tensor_parallel=9: this process has 8 device\(s\); '
                                       r'use 1 to 8'):
    tensor_parallel_mesh(9)
  assert main(['generate', f'output_dir={served_dir.parent}', 'tensor_parallel=0']) == 2
  assert 'tensor_parallel=0: this process has 8 device(s)' in capsys.readouterr().err
  assert main(['generate', f'output_dir={served_dir.parent}', 'tensor_parallel=2',
               'max_new_tokens=3', 'temperature=0']) == 0
  assert capsys.readouterr().out.startswith('ROMEO:')


def test_a_model_from_an_orbax_checkpoint_is_placed_on_the_tensor_parallel_mesh(tiny_model):
  """``maxnnx generate tensor_parallel=2`` of an unfinished run shards the checkpoint's model
  (each process placing its own shards): same values, same greedy tokens."""
  from maxnnx.cli import _placed  # noqa: PLC0415
  from maxnnx.sharding import tensor_parallel_mesh  # noqa: PLC0415
  placed = _placed(nnx.clone(tiny_model), tensor_parallel_mesh(2))
  kernel = placed.layers[0].attn.q_proj.kernel[...]
  assert len(kernel.sharding.device_set) == 2 and 'tensor' in str(kernel.sharding.spec)
  for a, b in zip(jax.tree.leaves(nnx.state(tiny_model)), jax.tree.leaves(nnx.state(placed))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ids = [[1, 2, 3, 4], [5, 6]]
  assert (maxnnx.generate(placed, ids, 6, eos_ids=None).tokens.tolist()
          == maxnnx.generate(tiny_model, ids, 6, eos_ids=None).tokens.tolist())


def _maxnnx(args, coordinator_port, process_id, devices=2):
  env = {**os.environ, 'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices}',
         'PYTHONPATH': ROOT + os.pathsep + os.environ.get('PYTHONPATH', '')}
  if coordinator_port is not None:
    args = [*args, f'coordinator=127.0.0.1:{coordinator_port}', 'num_processes=2',
            f'process_id={process_id}']
  return subprocess.Popen([sys.executable, '-m', 'maxnnx', *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope='module')
def served_dir(tmp_path_factory, chat_checkpoint):
  directory = tmp_path_factory.mktemp('lockstep') / 'final'
  model = maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=512, num_layers=2),
                             rngs=nnx.Rngs(1))
  maxnnx.save_pretrained(model, str(directory))
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(chat_checkpoint / name, directory / name)
  return directory


@pytest.mark.slow  # three processes that each import, load and compile: about a minute
def test_serve_and_generate_over_two_processes(served_dir):
  """``maxnnx serve tensor_parallel=4`` over 2 processes x 2 devices: 8 concurrent greedy
  requests (one cancelled by its client) give one device's ``maxnnx.generate`` tokens;
  SIGTERM to process 0 ends both. ``maxnnx generate`` over the same two processes prints
  one process's text."""
  reference = maxnnx.from_pretrained(str(served_dir))
  tokenizer = load_tokenizer(str(served_dir))
  rng = np.random.default_rng()
  prompts = [rng.integers(0, 512, int(rng.integers(1, 40))).tolist() for _ in range(8)]
  max_tokens = [int(m) for m in rng.integers(1, 16, 8)]
  want = maxnnx.generate(reference, prompts, max_new_tokens=max(max_tokens), eos_ids=None)

  port, http = free_port(), free_port()
  args = ['serve', f'model={served_dir}', f'port={http}', 'served_model_name=tiny',
          'tensor_parallel=4', 'max_batch=4', 'max_model_len=96']
  procs = [_maxnnx(args, port, i) for i in range(2)]
  try:
    url = f'http://127.0.0.1:{http}'
    deadline = time.monotonic() + 300
    while True:
      assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
          procs[0].stdout.read() if procs[0].poll() is not None else 'timed out'
      with contextlib.suppress(httpx.TransportError):
        if httpx.get(f'{url}/health').status_code == 200:
          break
      time.sleep(0.3)
    client = openai.AsyncOpenAI(base_url=f'{url}/v1', api_key='unused', max_retries=0)

    async def ask_all():
      async def cancelled():  # a client that goes away mid-stream
        stream = await client.completions.create(model='tiny', prompt=[1, 2, 3],
                                                 max_tokens=80, stream=True, temperature=0,
                                                 extra_body={'ignore_eos': True})
        async for _ in stream:
          break
        await stream.close()
      return await asyncio.gather(cancelled(), *(client.completions.create(
          model='tiny', prompt=p, max_tokens=m, temperature=0,
          extra_body={'ignore_eos': True, 'return_token_ids': True})
          for p, m in zip(prompts, max_tokens)))

    responses = asyncio.run(ask_all())[1:]
    for i, (response, m) in enumerate(zip(responses, max_tokens)):
      assert response.choices[0].token_ids == want.tokens[i, :m].tolist(), i
    procs[0].send_signal(15)
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] in ([0, 0], [-15, 0]), outputs[1][-3000:]
  finally:
    for p in procs:
      p.kill()

  run = served_dir.parent  # a run directory: final/ holds the model and its tokenizer
  text = 'ROMEO: what light'
  gen = ['generate', f'output_dir={run}', f'prompt={text}', 'max_new_tokens=12',
         'temperature=0', 'tensor_parallel=4']
  port = free_port()
  procs = [_maxnnx(gen, port, i) for i in range(2)]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outputs
  ids = [tokenizer.bos_id, *tokenizer.encode(text)]
  one = maxnnx.generate(reference, [ids], 12, eos_ids=[tokenizer.eos_id])
  assert outputs[0].strip().endswith((text + tokenizer.decode(one.as_lists()[0])).strip())
  assert text not in outputs[1]  # process 1 prints nothing

"""Shared test fixtures: paths of the committed Hugging Face reference checkpoints, and a fake
``gs://`` bucket.

The suite runs with 8 simulated CPU devices so the parallelism tests can build
real meshes; single-device tests ask for ``MeshConfig(data=1)`` or never touch
a mesh (plain computations run on the first device).

Compiling is most of the suite's time, and many tests compile the same programs (the same
tiny models' train and decode steps), so the run shares one JAX persistent compilation
cache: a fresh directory per run (removed at its end), which the pytest-xdist workers and
the processes the tests start inherit through the environment. A ``JAX_COMPILATION_CACHE_DIR``
already set is used as it is and kept.

On a GPU the suite checks the same arithmetic as on a CPU: float32 matmuls run at full
precision (jax's GPU default is TF32, about 1e-3 relative, which the float32 tolerances here are
tighter than), and no process preallocates the GPU's memory, so pytest-xdist workers can share it.
"""

import os
import shutil
import socket
import tempfile

import numpy as np
import pytest

if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()
_OWN_COMPILE_CACHE = None
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _OWN_COMPILE_CACHE = os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(
      prefix='maxnnx-tests-jit-')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')
os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')

import jax  # noqa: E402  (after the flags above)

if jax.default_backend() == 'gpu':
  jax.config.update('jax_default_matmul_precision', 'highest')


SLOW_TESTS = os.path.join(os.path.dirname(__file__), 'slow_tests.txt')


def _slow_test_ids() -> set[str]:
  with open(SLOW_TESTS) as f:
    return {line.strip() for line in f if line.strip() and not line.startswith('#')}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Marks the tests that ``slow_tests.txt`` lists slow, before ``-m`` selects.

  When whole files are collected, an entry naming a test that such a file no longer has
  (renamed, or its parameters changed) stops the run, so the list cannot silently rot.
  """
  slow = _slow_test_ids()
  collected = {item.nodeid for item in items}
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)
  if any('::' in arg for arg in config.args):
    return  # single tests were asked for: the other entries of their files are not collected
  files = {nodeid.split('::')[0] for nodeid in collected}
  stale = sorted(i for i in slow if i.split('::')[0] in files and i not in collected)
  if stale:
    raise pytest.UsageError(f'{SLOW_TESTS} lists tests that do not exist (update it): '
                            + ', '.join(stale))


def pytest_sessionfinish(session):
  """The run's own compilation cache goes when the run ends (in the controlling process)."""
  if _OWN_COMPILE_CACHE and not hasattr(session.config, 'workerinput'):
    shutil.rmtree(_OWN_COMPILE_CACHE, ignore_errors=True)


FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures', 'hf')
# Image+text fixtures (make_vision_fixtures.py) have their own reference format.
VISION_CASES = ['gemma3_vision', 'llama4_vision']
# quantized/ holds release-format checkpoints (make_quantized_fixtures.py), tested on their own.
HF_CASES = sorted(set(os.listdir(FIXTURES)) - set(VISION_CASES) - {'quantized'})


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now (for coordinators and servers)."""
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


def cli_losses(tmp_path, capsys, common: list[str], layouts: dict[str, list[str]]) -> dict:
  """``{name: per-step losses}`` of ``maxnnx <common> <layouts[name]>`` run into
  ``tmp_path/name`` through the CLI, each run required to succeed."""
  import json  # noqa: PLC0415

  from maxnnx import cli  # noqa: PLC0415
  losses = {}
  for name, extra in layouts.items():
    out = tmp_path / name
    assert cli.main([*common, *extra, f'output_dir={out}']) == 0, capsys.readouterr().err
    losses[name] = [json.loads(line)['loss'] for line in open(out / 'metrics.jsonl')]
  return losses


def reference(case: str):
  """The arrays a fixture's generator saved beside its checkpoint (``reference.npz``)."""
  return np.load(os.path.join(FIXTURES, case, 'reference.npz'))


def rel_error(ours, ref) -> float:
  """Max absolute difference from ``ref``, relative to ``ref``'s largest magnitude (float64)."""
  ref = np.asarray(ref, np.float64)
  return float(np.abs(np.asarray(ours, np.float64) - ref).max() / np.abs(ref).max())


def export_and_compare(case: str, directory) -> tuple[dict, dict]:
  """Load fixture ``case``, ``save_pretrained`` it into ``directory`` and check the written
  tensors are the fixture's (names, values; shapes up to a reshape). Returns the fixture's
  and the written ``config.json``."""
  import json  # noqa: PLC0415

  import numpy as np  # noqa: PLC0415

  import maxnnx  # noqa: PLC0415
  from maxnnx.checkpoint.safetensors import read_safetensors  # noqa: PLC0415
  source = os.path.join(FIXTURES, case)
  maxnnx.save_pretrained(maxnnx.from_pretrained(source), str(directory))
  original = read_safetensors(os.path.join(source, 'model.safetensors'))
  written = read_safetensors(os.path.join(str(directory), 'model.safetensors'))
  assert sorted(written) == sorted(original)
  for name in original:
    np.testing.assert_array_equal(written[name].reshape(original[name].shape), original[name],
                                  err_msg=name)
  configs = []
  for path in (os.path.join(source, 'config.json'), os.path.join(str(directory), 'config.json')):
    with open(path) as f:
      configs.append(json.load(f))
  return tuple(configs)


def legacy_checkpoint(case: str, directory: str) -> str:
  """A checkpoint dir with the case's older-layout config.json and the same weights."""
  shutil.copy(os.path.join(FIXTURES, case, 'legacy', 'config.json'), directory)
  os.symlink(os.path.join(FIXTURES, case, 'model.safetensors'),
             os.path.join(directory, 'model.safetensors'))
  return directory


@pytest.fixture
def checkpoint_copy(tmp_path):
  """Factory: a writable copy of a fixture checkpoint (config + weights)."""

  def make(case: str) -> str:
    target = tmp_path / case
    target.mkdir()
    for name in ('config.json', 'model.safetensors'):
      shutil.copy(os.path.join(FIXTURES, case, name), target / name)
    return str(target)

  return make


CHAT_SPECIALS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|begin_of_text|>',
                 '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>']


def _byte_level_bpe(vocab_size: int, specials: list[str]):
  """A byte-level BPE trained on the shipped corpus, its special tokens first."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  from maxnnx.data import DEFAULT_CORPUS
  with open(DEFAULT_CORPUS, encoding='utf-8') as f:
    text = f.read()[:200_000]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator([text], trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def _write_tokenizer_dir(directory, tok, config: dict):
  import json
  tok.save(str(directory / 'tokenizer.json'))
  with open(directory / 'tokenizer_config.json', 'w', encoding='utf-8') as f:
    json.dump(config, f)
  return directory


@pytest.fixture(scope='session')
def chat_checkpoint(tmp_path_factory):
  """A tokenizer directory like a chat model's: a byte-level BPE ``tokenizer.json`` (500
  tokens, trained on the shipped corpus, with ChatML and Llama 3 special tokens) and a
  ``tokenizer_config.json`` holding the ChatML template."""
  from maxnnx.data.chat import CHATML_TEMPLATE
  return _write_tokenizer_dir(
      tmp_path_factory.mktemp('qwen_like'), _byte_level_bpe(500, CHAT_SPECIALS),
      {'bos_token': '<|begin_of_text|>', 'eos_token': '<|im_end|>',
       'chat_template': CHATML_TEMPLATE})


GEMMA3_SPECIALS = ['<pad>', '<eos>', '<bos>', '<start_of_turn>', '<end_of_turn>',
                   '<start_of_image>', '<end_of_image>']


@pytest.fixture(scope='session')
def gemma3_tokenizer_dir(tmp_path_factory):
  """A byte-level BPE with Gemma 3's specials; ``<image_soft_token>`` gets the vision
  preset's ``image_token_id`` (the last id, as in the real checkpoints)."""
  from tokenizers import AddedToken

  import maxnnx
  from maxnnx.data.chat import GEMMA_TEMPLATE
  image_id = maxnnx.get_preset('tiny-gemma3-vision').vision.image_token_id
  tok = _byte_level_bpe(image_id, GEMMA3_SPECIALS)
  tok.add_special_tokens([AddedToken('<image_soft_token>', special=True)])
  assert tok.token_to_id('<image_soft_token>') == image_id
  return _write_tokenizer_dir(
      tmp_path_factory.mktemp('gemma3_like'), tok,
      {'bos_token': '<bos>', 'eos_token': '<eos>', 'pad_token': '<pad>',
       'chat_template': GEMMA_TEMPLATE})


class FakeGCS:
  """What the ``fake_gcs`` fixture yields: ``url(path)`` and the in-memory filesystem."""

  def __init__(self, fs, bucket: str):
    self.fs, self.bucket = fs, bucket

  def url(self, *names: str) -> str:
    """``gs://<bucket>/<names...>``."""
    return '/'.join([f'gs://{self.bucket}', *names])

  def files(self, prefix: str = '') -> dict[str, bytes]:
    """``{path below the bucket: content}`` of every object under ``prefix``."""
    root = f'/{self.bucket}/'
    return {name[len(root):]: f.getvalue() for name, f in self.fs.store.items()
            if name.startswith(root + prefix)}


@pytest.fixture
def fake_gcs(monkeypatch):
  """``gs://`` served from memory for the test: an fsspec MemoryFileSystem with a store of its
  own that, like Cloud Storage, refuses to append. Registered for the ``gcs`` and ``gs``
  protocols (what ``etils.epath`` asks fsspec for) and unregistered afterwards."""
  import importlib

  import fsspec
  from etils.epath import backend
  from fsspec.implementations.memory import MemoryFileSystem
  from fsspec.utils import stringify_path

  class FakeBucket(MemoryFileSystem):
    protocol = ('gs', 'gcs')
    store: dict = {}
    pseudo_dirs = ['']

    def __init__(self, *args, finalize_on_close=None, **kwargs):
      super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
      path = stringify_path(path)
      for prefix in ('gs://', 'gcs://'):
        path = path.removeprefix(prefix)
      return super()._strip_protocol(path)

    def _open(self, path, mode='rb', *args, **kwargs):
      if 'a' in mode:
        raise NotImplementedError('Cloud Storage objects cannot be appended to')
      return super()._open(path, mode, *args, **kwargs)

  registry = importlib.import_module('fsspec.registry')._registry  # monkeypatch restores it
  for name in ('gcs', 'gs'):
    monkeypatch.setitem(registry, name, FakeBucket)
  backend.fsspec_backend._get_filesystem.cache_clear()  # epath caches the filesystem it made
  try:
    yield FakeGCS(fsspec.filesystem('gcs', skip_instance_cache=True), 'fake-bucket')
  finally:
    backend.fsspec_backend._get_filesystem.cache_clear()

"""Shared test fixtures: paths of the committed Hugging Face reference checkpoints.

The suite runs with 8 simulated CPU devices so the parallelism tests can build
real meshes; single-device tests ask for ``MeshConfig(data=1)`` or never touch
a mesh (plain computations run on the first device).
"""

import os

if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()
import shutil

import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures', 'hf')
HF_CASES = sorted(os.listdir(FIXTURES))


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

"""Shared test fixtures: paths of the committed Hugging Face reference checkpoints."""

import os
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

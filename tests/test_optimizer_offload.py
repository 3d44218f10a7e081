"""optimizer_memory_host_offload: the optimizer's moments live in host memory between steps.

The numbers are those of a run that keeps them on the device (one device and an FSDP x data
mesh of 8 simulated devices), the moments are in ``pinned_host`` after every step while the
parameters are not, and a checkpoint written that way resumes exactly.
"""

import jax
import numpy as np
import pytest

from maxnnx.config import MeshConfig
from maxnnx.data import TokenWindows
from maxnnx.train import TrainConfig, Trainer

STEPS, BATCH, SEQ = 3, 8, 32


def _trainer(mesh, offload, steps=STEPS, **train):
  config = TrainConfig(steps=steps, global_batch_size=BATCH, seq_len=SEQ, learning_rate=1e-2,
                       warmup_steps=0, log_every=1, mesh=mesh,
                       optimizer_memory_host_offload=offload, **train)
  data = TokenWindows(np.tile(np.arange(48), 100), SEQ, BATCH, seed=1)
  return Trainer('tiny', config, data=data)


def _memory_kinds(tree):
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if hasattr(x, 'sharding')}


@pytest.fixture(scope='module')
def reference():
  return [m['loss'] for m in _trainer(MeshConfig(data=1), False).fit(log=lambda line: None)]


@pytest.mark.parametrize('mesh', [MeshConfig(data=1), MeshConfig(data=2, fsdp=4)],
                         ids=['one_device', 'data2_fsdp4'])
def test_offloaded_moments_train_like_device_ones(reference, mesh):
  trainer = _trainer(mesh, True)
  losses = [m['loss'] for m in trainer.fit(log=lambda line: None)]
  np.testing.assert_allclose(losses, reference, rtol=1e-4)
  model_state, optimizer_state = trainer._state[0], trainer._state[1]
  assert _memory_kinds(optimizer_state['opt_state']) == {'pinned_host'}
  assert _memory_kinds(optimizer_state['step']) == {'device'}
  assert _memory_kinds(model_state) == {'device'}


def _resumed_loss(directory, offload):
  """Train 2 steps with a checkpoint, then resume in a fresh Trainer for the third."""
  first = _trainer(MeshConfig(data=1), offload, steps=2, checkpoint_dir=directory,
                   checkpoint_every=2)
  first.fit(log=lambda line: None)
  first.close()
  second = _trainer(MeshConfig(data=1), offload, checkpoint_dir=directory, checkpoint_every=2)
  history = second.fit(log=lambda line: None)
  second.close()
  assert [m['step'] for m in history] == [3]
  return history[0]['loss'], second


@pytest.mark.slow  # 30 s: four trainers
def test_a_checkpoint_of_offloaded_moments_resumes_exactly(tmp_path):
  on_device, _ = _resumed_loss(str(tmp_path / 'device'), False)
  offloaded, trainer = _resumed_loss(str(tmp_path / 'host'), True)
  assert offloaded == pytest.approx(on_device, rel=1e-6)
  assert _memory_kinds(trainer._state[1]['opt_state']) == {'pinned_host'}

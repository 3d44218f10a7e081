"""Where the optimizer's moments live: split over ``data`` (ZeRO-1) or in host memory.

Either way the numbers are those of one device that keeps them whole (8 simulated devices).
ZeRO-1 moments name the ``data`` axis while the parameters do not; offloaded moments are in
``pinned_host`` after every step while the parameters are not, and a checkpoint written that way
resumes exactly.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from maxnnx.config import MeshConfig
from maxnnx.data import TokenWindows
from maxnnx.train import TrainConfig, Trainer

STEPS, BATCH, SEQ = 3, 8, 32


def _trainer(mesh, offload=False, steps=STEPS, **train):
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


@pytest.mark.parametrize('mesh', [pytest.param(MeshConfig(data=1), marks=pytest.mark.slow),
                                  MeshConfig(data=2, fsdp=4)], ids=['one_device', 'data2_fsdp4'])
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


def _mesh_axes(tree) -> list[set[str]]:
  """The mesh axes each array of ``tree`` is split over (scalars, such as Adam's count, left
  out: they cannot be split)."""
  axes = []
  for x in jax.tree.leaves(tree):
    if hasattr(x, 'sharding') and x.ndim:
      named = set()
      for entry in x.sharding.spec:
        named |= {entry} if isinstance(entry, str) else set(entry or ())
      axes.append(named)
  return axes


@pytest.mark.parametrize('mesh', [MeshConfig(data=8),
                                  pytest.param(MeshConfig(data=4, fsdp=2), marks=pytest.mark.slow)],
                         ids=['data8', 'data4_fsdp2'])
def test_zero1_splits_the_moments_over_data_and_trains_like_one_device(reference, mesh):
  trainer = _trainer(mesh, shard_optimizer_over_data=True)
  losses = [m['loss'] for m in trainer.fit(log=lambda line: None)]
  np.testing.assert_allclose(losses, reference, rtol=1e-4)
  moments = _mesh_axes(trainer._state[1]['opt_state'])
  # Every moment of a matrix is split over data; norms' [64] vectors too (64 % 8 == 0).
  assert moments and all('data' in axes for axes in moments)
  assert not any('data' in axes for axes in _mesh_axes(trainer._state[0]))
  plain = _trainer(mesh)
  assert not any('data' in axes for axes in _mesh_axes(plain._abstract_state[1]['opt_state']))


def test_zero1_and_offload_together():
  trainer = _trainer(MeshConfig(data=8), True, steps=1, shard_optimizer_over_data=True)
  trainer.fit(log=lambda line: None)
  assert _memory_kinds(trainer._state[1]['opt_state']) == {'pinned_host'}
  assert all('data' in axes for axes in _mesh_axes(trainer._state[1]['opt_state']))


@pytest.mark.slow  # three trainers over 8 devices; the moments' offload runs by default
def test_offloaded_parameters_train_and_evaluate_like_device_ones(reference):
  """parameter_memory_host_offload (with the moments offloaded too): the losses of the device
  run, the held-out loss of the device run, and between steps the whole training state is in
  pinned_host but the step counter, while ``trainer.model`` holds device arrays."""
  trainer = _trainer(MeshConfig(data=2, fsdp=4), True, parameter_memory_host_offload=True)
  losses = [m['loss'] for m in trainer.fit(log=lambda line: None)]
  np.testing.assert_allclose(losses, reference, rtol=1e-4)
  model_state, optimizer_state = trainer._state[0], trainer._state[1]
  assert _memory_kinds(model_state) == {'pinned_host'}
  assert _memory_kinds(optimizer_state['opt_state']) == {'pinned_host'}
  assert _memory_kinds(optimizer_state['step']) == {'device'}
  assert _memory_kinds(nnx.state(trainer.model)) == {'device'}  # what code outside steps uses
  on_device = _trainer(MeshConfig(data=2, fsdp=4))
  on_device.fit(log=lambda line: None)
  assert trainer.evaluate(2) == pytest.approx(on_device.evaluate(2), rel=1e-5)

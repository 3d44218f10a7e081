"""Per-layer streaming of the scanned layer stacks from host memory (``parameter_streaming``).

The CPU backend lowers memory kinds to plain copies, so the numbers are checked here (losses and
the held-out loss equal those of a run that keeps the parameters on one device) and the
transfers in the program lowered for TPU: with streaming each scan iteration copies its own
layer's slice to the device; with the whole-step offload the whole stacks are copied before the
loop.
"""

import functools
import re

import jax
import numpy as np
import pytest

from maxnnx.config import ConfigError, MeshConfig
from maxnnx.data import TokenWindows
from maxnnx.presets import get_preset
from maxnnx.train import TrainConfig, Trainer
from maxnnx.train import step as step_lib

STEPS, BATCH, SEQ = 3, 8, 32


def _model(**runtime):
  runtime = {'scan_layers': True, 'remat_policy': 'full', **runtime}
  return get_preset('tiny', **{f'runtime.{k}': v for k, v in runtime.items()})


def _trainer(mesh, model=None, steps=STEPS, **train):
  config = TrainConfig(steps=steps, global_batch_size=BATCH, seq_len=SEQ, learning_rate=1e-2,
                       warmup_steps=0, log_every=1, mesh=mesh, **train)
  data = TokenWindows(np.tile(np.arange(48), 100), SEQ, BATCH, seed=1)
  return Trainer(model or _model(), config, data=data)


def _memory_kinds(tree):
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if hasattr(x, 'sharding')}


STREAMED = dict(parameter_memory_host_offload=True, parameter_streaming=True)


def test_streamed_layers_train_and_evaluate_like_one_device():
  reference = _trainer(MeshConfig(data=1))
  expected = [m['loss'] for m in reference.fit(log=lambda line: None)]
  trainer = _trainer(MeshConfig(data=2, fsdp=4), **STREAMED)
  losses = [m['loss'] for m in trainer.fit(log=lambda line: None)]
  np.testing.assert_allclose(losses, expected, rtol=1e-4)
  assert _memory_kinds(trainer._state[0]) == {'pinned_host'}  # between steps
  assert trainer.evaluate(2) == pytest.approx(reference.evaluate(2), rel=1e-5)


def test_streamed_layers_accumulate_gradients_like_one_device():
  """With micro-batches the host-memory gradients of each are copied in and summed."""
  expected = [m['loss'] for m in _trainer(MeshConfig(data=1), steps=2,
                                          grad_accum_steps=2).fit(log=lambda line: None)]
  trainer = _trainer(MeshConfig(data=1, fsdp=8), steps=2, grad_accum_steps=2, **STREAMED)
  losses = [m['loss'] for m in trainer.fit(log=lambda line: None)]
  np.testing.assert_allclose(losses, expected, rtol=1e-4)


def _device_copies(streaming: bool) -> tuple[set[str], set[str]]:
  """The tensor types the train step, lowered for TPU, copies to the device, and those of
  its host-memory arguments."""
  trainer = _trainer(MeshConfig(data=1, fsdp=8), steps=1, parameter_memory_host_offload=True,
                     parameter_streaming=streaming)
  step = functools.partial(step_lib.train_step, trainer._graphdef, objective=trainer.objective,
                           config=trainer.config, schedule=trainer.schedule,
                           trainable=trainer.trainable)
  with trainer._context():
    jitted = jax.jit(step, in_shardings=(trainer._state_shardings, trainer._extra_sharding,
                                         trainer._batch_sharding, None))
    text = jitted.trace(trainer._abstract_state, trainer._abstract_extra,
                        trainer._abstract_batch(), None).lower(
                            lowering_platforms=('tpu',)).as_text()
  copied = set(re.findall(r'_xla_buffer_placement = "device"}} : \((tensor<[^>]*>)\)', text))
  main = text[text.index('func.func public @main'):].split('\n', 1)[0]
  on_host = set(re.findall(r'(tensor<[^>]*>) \{mhlo.memory_kind = "pinned_host"', main))
  return copied, on_host


def test_streaming_copies_one_layer_per_iteration_in_the_program_for_tpu():
  q_stack, q_layer = 'tensor<4x128x4x32xf32>', 'tensor<128x4x32xf32>'  # tiny's query kernel
  copied, on_host = _device_copies(True)
  assert q_stack in on_host
  assert q_layer in copied  # a layer's slice, inside the scan (the update copies the stack)
  whole, _ = _device_copies(False)
  assert q_stack in whole and q_layer not in whole  # the whole stack, before the scan


@pytest.mark.parametrize('model,train,field', [
    (None, dict(parameter_streaming=True), 'parameter_memory_host_offload'),
    (None, dict(STREAMED, mesh=MeshConfig(stage=2)), 'mesh.stage'),
    (_model(scan_layers=False), STREAMED, 'scan_layers=False'),
    (_model(remat_policy='none'), STREAMED, 'remat_policy=none'),
], ids=['no_offload', 'stages', 'unscanned', 'no_remat'])
def test_streaming_refuses_what_it_cannot_stream(model, train, field):
  train = dict(train)
  mesh = train.pop('mesh', MeshConfig(data=1))
  with pytest.raises(ConfigError, match=re.escape(field)):
    _trainer(mesh, model, **train)


def _resumed_loss(directory, **train):
  """Train 2 steps with a checkpoint, then resume in a fresh Trainer for the third."""
  first = _trainer(MeshConfig(data=1), steps=2, checkpoint_dir=directory, checkpoint_every=2,
                   **train)
  first.fit(log=lambda line: None)
  first.close()
  second = _trainer(MeshConfig(data=1), checkpoint_dir=directory, checkpoint_every=2, **train)
  history = second.fit(log=lambda line: None)
  second.close()
  assert [m['step'] for m in history] == [3]
  return history[0]['loss']


@pytest.mark.slow  # four trainers (over 40 s); a streamed step's numbers are checked above
def test_a_checkpoint_of_a_streamed_run_resumes_exactly(tmp_path):
  on_device = _resumed_loss(str(tmp_path / 'device'))
  streamed = _resumed_loss(str(tmp_path / 'host'), **STREAMED)
  assert streamed == pytest.approx(on_device, rel=1e-6)

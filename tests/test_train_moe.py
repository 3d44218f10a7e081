"""Aux-loss-free balancing (DeepSeek V3) in the train step: the router bias moves by
``moe.router_bias_update_rate`` from the step's loads, is logged, and is checkpointed."""

import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import ConfigError, MeshConfig
from maxnnx.data import TokenWindows
from maxnnx.layers.moe import RouterBias, moe_stats
from maxnnx.train import TrainConfig, Trainer

VOCAB, SEQ, BATCH = 64, 16, 8


def _trainer(rate, steps, start_bias=None, scan_layers=False, learning_rate=1e-3,
             num_layers=1, mesh=None, **kw) -> Trainer:
  """A tiny MoE's Trainer (one layer by default) whose balancing bias starts at
  ``start_bias`` (default: one that sends every token to experts 0 and 1)."""
  cfg = maxnnx.get_preset('tiny-moe', vocab_size=VOCAB, num_layers=num_layers, d_model=32,
                          mlp_dim=32, **{'runtime.scan_layers': scan_layers,
                                         'runtime.dtype': 'float32'},
                          **{'moe.router_score_bias': True,
                             'moe.router_bias_update_rate': rate})
  config = TrainConfig(steps=steps, learning_rate=learning_rate, global_batch_size=BATCH,
                       seq_len=SEQ, log_every=1, mesh=mesh or MeshConfig(data=1), **kw)
  data = TokenWindows(np.random.default_rng(0).integers(0, VOCAB, 20_000), SEQ, BATCH, seed=0)
  trainer = Trainer(cfg, config, data=data)
  (bias,) = _biases(trainer.model)
  bias[...] = (bias[...].at[..., :2].set(0.3) if start_bias is None
               else np.asarray(start_bias, np.float32).reshape(bias.shape))
  return trainer


def _biases(model) -> list[RouterBias]:
  return [node for _, node in nnx.iter_graph(model) if isinstance(node, RouterBias)]


def _loads(model, windows) -> np.ndarray:
  """Tokens per expert ``[layers, experts]`` of a forward pass over ``windows``' inputs."""
  model(windows[:, :-1])
  return moe_stats(model).astype(np.float64)


@pytest.fixture(scope='module')
def one_step(tmp_path_factory):
  """One step of two micro-batches, checkpointed: the trainer, the bias before it and the
  loads of each micro-batch measured by forward passes of the model before the step. The
  learning rate is on from the first step and every parameter decays (``decay_all``), so
  only the balancing rule may move the bias."""
  directory = str(tmp_path_factory.mktemp('balance'))
  rate = 0.01
  start = np.random.default_rng(2).normal(0, 0.02, 8)
  trainer = _trainer(rate, 1, start, scan_layers=True, grad_accum_steps=2,
                     checkpoint_dir=directory, schedule='constant', warmup_steps=0,
                     learning_rate=0.1, weight_decay=0.5, decay_all=True)
  windows = np.random.default_rng(1).integers(0, VOCAB, (BATCH, SEQ + 1))
  (bias,) = _biases(trainer.model)
  before = np.asarray(bias[...], np.float64)
  halves = [_loads(trainer.model, rows) for rows in np.split(windows, 2)]
  metrics = trainer.step(windows)
  trainer.save_checkpoint()
  return trainer, rate, before, halves, metrics


def _deepseek_rule(bias, load, rate):
  """DeepSeek V3's update in float64: ``bias + rate * sign(mean load - load)`` per layer."""
  return bias + rate * np.sign(load.mean(axis=-1, keepdims=True) - load)


def test_train_step_moves_the_bias_by_deepseeks_rule_on_the_summed_loads(one_step):
  """The bias after a step equals the float64 rule on the loads of both micro-batches
  summed (not of the last one alone), and the spread of those loads is logged."""
  trainer, rate, before, halves, metrics = one_step
  loads = halves[0] + halves[1]
  assert loads.sum() == BATCH * SEQ * 2  # top-2 of every token
  (bias,) = _biases(trainer.model)
  after = np.asarray(bias[...], np.float64).reshape(loads.shape)
  expected = _deepseek_rule(before.reshape(loads.shape), loads, rate)
  np.testing.assert_allclose(after, expected, rtol=0, atol=1e-7)
  assert not np.allclose(expected, _deepseek_rule(before.reshape(loads.shape), halves[1], rate))
  mean = loads.mean(axis=-1)
  assert metrics['moe_load_cv'] == pytest.approx((loads.std(axis=-1) / mean).mean(), rel=1e-5)
  assert metrics['moe_max_violation'] == pytest.approx(
      ((loads.max(axis=-1) - mean) / mean).mean(), rel=1e-5)


def test_a_fresh_trainer_restores_the_moved_bias_from_the_checkpoint(one_step):
  trainer, _, before, _, _ = one_step
  (bias,) = _biases(trainer.model)
  moved = np.asarray(bias[...])
  assert not np.array_equal(moved, before)
  resumed = _trainer(0.01, 1, scan_layers=True, grad_accum_steps=2,
                     checkpoint_dir=trainer.config.checkpoint_dir)
  assert resumed.restore_checkpoint() == 1
  (restored,) = _biases(resumed.model)
  np.testing.assert_array_equal(np.asarray(restored[...]), moved)


@pytest.mark.slow
def test_balancing_evens_the_load_against_the_same_run_without_it():
  """From a bias that sends every token to two experts, ten steps with the update bring
  the load spread down; the same run with the rate at 0 stays as uneven."""
  spread = {}
  for rate in (0.0, 0.05):
    history = _trainer(rate, 10).fit(log=lambda line: None)
    spread[rate] = [m['moe_load_cv'] for m in history]
  assert spread[0.05][0] == pytest.approx(spread[0.0][0])  # the same first step
  assert min(spread[0.0][-3:]) > 1.0
  assert max(spread[0.05][-3:]) < 0.6 * spread[0.05][0]
  assert max(spread[0.05][-3:]) < 0.6 * min(spread[0.0][-3:])


def test_balancing_under_pipeline_stages_sees_the_whole_batchs_loads():
  """Two layers over two pipeline stages (two micro-batches): the loads the step reads come out
  of the pipeline summed over micro-batches, so the bias moves, and the load statistics are
  logged, exactly as on one device. (Slow-listed, ~75 s; the fast check of the same loads is
  ``tests/test_pipeline_schedule.py``'s model test.)"""
  start = np.random.default_rng(5).normal(0, 0.02, (2, 8))
  runs = {}
  for name, mesh in (('one device', MeshConfig(data=1)),
                     ('two stages', MeshConfig(data=4, stage=2))):
    trainer = _trainer(0.01, 2, start, scan_layers=True, num_layers=2, mesh=mesh,
                       router_aux_loss_coef=0.0)
    history = trainer.fit(log=lambda line: None)
    (bias,) = _biases(trainer.model)
    runs[name] = np.asarray(bias[...]), history
  (bias_one, history_one), (bias_pipe, history_pipe) = runs.values()
  assert not np.allclose(bias_one, start.reshape(bias_one.shape))
  np.testing.assert_allclose(bias_pipe, bias_one, rtol=0, atol=1e-6)
  for one, pipe in zip(history_one, history_pipe):
    assert pipe['loss'] == pytest.approx(one['loss'], rel=1e-5)
    assert pipe['moe_load_cv'] == pytest.approx(one['moe_load_cv'], rel=1e-5)


@pytest.mark.parametrize('bad, match', [
    ({'moe.router_bias_update_rate': 0.01}, 'needs router_score_bias=True'),
    ({'moe.router_bias_update_rate': -1.0, 'moe.router_score_bias': True}, 'must be >= 0'),
])
def test_a_bad_update_rate_is_one_clear_line(bad, match):
  with pytest.raises(ConfigError, match=f'ModelConfig.moe.router_bias_update_rate {match}'):
    maxnnx.get_preset('tiny-moe', **bad)

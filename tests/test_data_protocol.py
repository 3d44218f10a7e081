"""The data-source protocol: what the Trainer takes as ``data`` and what it does with each
optional capability (checkpointed position, held-out batches, metrics per batch)."""

import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.data import (
  Checkpointable,
  DataSource,
  HasEvalBatches,
  ReportsMetrics,
  TokenWindows,
  check_data_source,
  make_pipeline,
)
from maxnnx.train import TrainConfig, Trainer, synthetic_batches
from maxnnx.train.batches import HeldOutBatches

VOCAB, BATCH, SEQ = 64, 4, 16


def _tiny():
  cfg = maxnnx.get_preset('tiny', vocab_size=VOCAB, num_layers=1, d_model=32, mlp_dim=64)
  return maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))


def _config(**kw):
  return TrainConfig(**{'steps': 2, 'global_batch_size': BATCH, 'seq_len': SEQ,
                        'learning_rate': 1e-3, 'log_every': 1, 'eval_every': 0,
                        'mesh': MeshConfig(data=1), **kw})


def _windows(seed):
  return np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)


class FullSource:
  """Token windows numbered by a counter, with every optional capability."""

  def __init__(self):
    self.count, self.restored = 0, None

  def __iter__(self):
    return self

  def __next__(self):
    self.count += 1
    return _windows(self.count)

  def get_state(self):
    return {'count': self.count}

  def set_state(self, state):
    self.restored = state
    self.count = state['count']

  def eval_batches(self, num_batches):
    return [_windows(1000 + i) for i in range(num_batches)]

  def pop_metrics(self):
    return {'source/count': float(self.count)}


def test_sources_conform_to_the_capabilities_they_have():
  windows = TokenWindows(np.arange(2000) % VOCAB, SEQ, BATCH)
  generator = (_windows(i) for i in range(3))
  pipeline = make_pipeline('synthetic', batch_size=2, seq_len=SEQ, vocab_size=VOCAB)
  held_out = HeldOutBatches(iter([_windows(0)] * 2), 'eval_data=test')
  for source, capabilities in ((windows, {Checkpointable, HasEvalBatches}),
                               (generator, set()),
                               (pipeline, {Checkpointable}),
                               (synthetic_batches(VOCAB, BATCH, SEQ, 0), {Checkpointable}),
                               (FullSource(), {Checkpointable, HasEvalBatches, ReportsMetrics})):
    assert isinstance(source, DataSource)
    assert check_data_source(source) is source
    for capability in (Checkpointable, HasEvalBatches, ReportsMetrics):
      assert isinstance(source, capability) == (capability in capabilities), (source, capability)
  pipeline.close()
  assert isinstance(held_out, HasEvalBatches) and not isinstance(held_out, DataSource)
  np.testing.assert_array_equal(next(TokenWindows(np.arange(2000) % VOCAB, SEQ, BATCH, seed=3)),
                                TokenWindows(np.arange(2000) % VOCAB, SEQ, BATCH, seed=3).next())


def test_a_plain_generator_trains_and_has_no_held_out_batches():
  batches = ({'inputs': w[:, :-1], 'targets': w[:, 1:]} for w in map(_windows, range(10)))
  trainer = Trainer(_tiny(), _config(), data=batches)
  history = trainer.fit(log=lambda line: None)
  assert [m['step'] for m in history] == [1, 2] and np.isfinite(history[-1]['loss'])
  with pytest.raises(ValueError, match='no eval_batches'):
    trainer.evaluate()


def test_the_optional_capabilities_are_used(tmp_path):
  source = FullSource()
  config = _config(eval_every=2, eval_batches=2, checkpoint_dir=str(tmp_path / 'ckpt'))
  trainer = Trainer(_tiny(), config, data=source)
  history = trainer.fit(log=lambda line: None)
  trainer.close()
  assert [m['source/count'] for m in history] == [1.0, 2.0]  # pop_metrics after each next
  assert np.isfinite(history[-1]['eval_loss'])  # eval_batches
  resumed = FullSource()
  again = Trainer(_tiny(), config, data=resumed)
  assert again.restore_checkpoint() == 2
  again.close()
  assert resumed.restored == {'count': 2} and next(resumed) is not None and resumed.count == 3


class StateOnly:
  """Has a position but gives no batches."""

  def get_state(self):
    return {}


@pytest.mark.parametrize('data, message', [
    ([_windows(0)], r'data= must be a data source.*a list has no __next__; pass '
                    r'data=iter\(\.\.\.\)'),
    (StateOnly(), r'a StateOnly has no __next__; give an iterator'),
])
def test_a_source_without_next_is_refused_naming_it(data, message):
  with pytest.raises(TypeError, match=message):
    Trainer(_tiny(), _config(), data=data)

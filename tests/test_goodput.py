"""Goodput: the recorder's arithmetic with a fake clock, and the accounting of a real fit."""

import json
import time

import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.data import TokenWindows
from maxnnx.train import TrainConfig, Trainer
from maxnnx.train.goodput import (
  CATEGORIES,
  GoodputRecorder,
  HighWater,
  read_high_water,
  write_high_water,
)


class FakeClock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now

  def advance(self, seconds):
    self.now += seconds


def test_nested_timers_take_their_time_out_of_the_outer_one():
  clock = FakeClock()
  recorder = GoodputRecorder(clock)
  with recorder.time('other'):
    clock.advance(1.0)
    with recorder.time('compile'):
      clock.advance(6.0)
    for _ in range(4):
      with recorder.time('productive'):
        clock.advance(2.0)
        with recorder.time('data'):
          clock.advance(0.5)
        with recorder.time('checkpoint'):
          clock.advance(0.25)
  seconds = recorder.seconds
  assert seconds['other'] == 1.0 and seconds['compile'] == 6.0
  assert seconds['productive'] == 8.0 and seconds['data'] == 2.0 and seconds['checkpoint'] == 1.0
  assert recorder.wall_seconds == pytest.approx(18.0)
  assert recorder.goodput == pytest.approx(8.0 / 18.0)
  summary = recorder.summary()
  assert summary['productive_s'] == 8.0 and summary['wall_s'] == pytest.approx(18.0)
  assert set(recorder.metrics()) == {f'goodput/{k}' for k in summary}


def test_summary_line_and_lost_steps():
  clock = FakeClock()
  recorder = GoodputRecorder(clock)
  with recorder.time('lost'):
    clock.advance(3.0)
  recorder.lost_steps = 3
  with recorder.time('productive'):
    clock.advance(9.0)
  assert recorder.format() == (
      'goodput 75.0% of 12.0 s: productive 9.0 s, compile 0.0 s, data 0.0 s, checkpoint 0.0 s, '
      'restore 0.0 s, eval 0.0 s, lost 3.0 s (3 steps re-done), init 0.0 s, '
      'other 0.0 s')
  with pytest.raises(ValueError, match='Unknown goodput category'):
    with recorder.time('sleeping'):
      pass
  assert GoodputRecorder().goodput == 0.0  # nothing timed yet


def test_timer_counts_time_when_the_block_raises():
  clock = FakeClock()
  recorder = GoodputRecorder(clock)
  with pytest.raises(RuntimeError), recorder.time('other'):
    with recorder.time('eval'):
      clock.advance(2.0)
      raise RuntimeError
  assert recorder.seconds['eval'] == 2.0 and recorder.seconds['other'] == 0.0


def test_high_water_file(tmp_path):
  assert read_high_water(str(tmp_path)) == 0
  write_high_water(str(tmp_path / 'new'), 17)
  assert read_high_water(str(tmp_path / 'new')) == 17
  (tmp_path / 'high_water.json').write_text('not json')
  assert read_high_water(str(tmp_path)) == 0


def test_high_water_is_read_once_and_written_when_it_rose_and_time_passed(tmp_path):
  clock, directory = FakeClock(), str(tmp_path)
  write_high_water(directory, 5)
  mark = HighWater(clock)
  assert mark.load(directory) == 5 and mark.reach(directory, 3) == 5  # never falls
  write_high_water(directory, 9)
  assert mark.load(directory) == 5  # read once
  assert mark.reach(directory, 7) == 7
  mark.write(directory, every=5.0, primary=False)
  assert read_high_water(directory) == 9  # only the primary process writes
  mark.write(directory, every=5.0)
  assert read_high_water(directory) == 7
  mark.reach(directory, 8)
  clock.advance(1.0)
  mark.write(directory, every=5.0)
  assert read_high_water(directory) == 7  # too soon after the last write
  clock.advance(5.0)
  mark.write(directory, every=5.0)
  assert read_high_water(directory) == 8
  assert HighWater(clock).load(None) == 0


def _trainer(steps, **kw):
  cfg = maxnnx.get_preset('tiny', vocab_size=64, num_layers=2, d_model=64, mlp_dim=128)
  tokens = np.random.default_rng(0).integers(0, 64, 20000)
  config = TrainConfig(steps=steps, global_batch_size=4, seq_len=32, mesh=MeshConfig(data=1),
                       **kw)
  return Trainer(maxnnx.Transformer(cfg, rngs=nnx.Rngs(0)), config,
                 data=TokenWindows(tokens, 32, 4, seed=0))


def test_fit_accounts_its_wall_time(tmp_path):
  """Categories add up to fit's wall time; the totals are in the last record and the log."""
  lines = []
  trainer = _trainer(8, log_every=2, checkpoint_dir=str(tmp_path / 'ckpt'), checkpoint_every=4,
                     metrics_jsonl=str(tmp_path / 'metrics.jsonl'))
  start = time.perf_counter()
  trainer.fit(log=lines.append)
  wall = time.perf_counter() - start
  trainer.close()
  summary = trainer.goodput()
  accounted = sum(summary[f'{name}_s'] for name in CATEGORIES)
  assert accounted == pytest.approx(summary['wall_s'])
  assert summary['wall_s'] == pytest.approx(wall, rel=0.02, abs=0.05)
  assert summary['compile_s'] > 0 and summary['productive_s'] > 0
  assert summary['checkpoint_s'] > 0 and summary['data_s'] > 0
  assert summary['lost_s'] == 0 and summary['lost_steps'] == 0
  assert summary['other_s'] < 0.2 * wall  # little time goes unexplained
  assert lines[-1].startswith('goodput ') and 'productive' in lines[-1]
  records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert [r['step'] for r in records] == list(range(1, 9))
  assert records[-1]['goodput/wall_s'] == pytest.approx(summary['wall_s'])
  assert 'goodput/productive_s' not in records[-2] and 'step_time_s' in records[-2]
  assert read_high_water(str(tmp_path / 'ckpt')) == 8


@pytest.mark.slow
def test_steps_redone_after_a_resume_are_lost_time(tmp_path):
  """A run that dies after step 6 with its last checkpoint at 4 re-does steps 5 and 6."""

  def crash(trainer, record):
    if record['step'] == 6:
      raise KeyboardInterrupt

  trainer = _trainer(10, log_every=1, checkpoint_dir=str(tmp_path), checkpoint_every=4)
  trainer.callbacks.append(crash)
  with pytest.raises(KeyboardInterrupt):
    trainer.fit(log=lambda line: None)
  trainer.close()
  assert read_high_water(str(tmp_path)) == 6
  resumed = _trainer(10, log_every=1, checkpoint_dir=str(tmp_path), checkpoint_every=4)
  resumed.fit(log=lambda line: None)
  resumed.close()
  summary = resumed.goodput()
  assert resumed.history[0]['step'] == 5
  assert summary['lost_steps'] == 2 and summary['lost_s'] > 0 and summary['restore_s'] > 0
  assert read_high_water(str(tmp_path)) == 10

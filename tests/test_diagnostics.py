"""Diagnostics: profiles, HLO dumps, outlier warnings, the hang watchdog, the compile cache."""

import functools
import glob
import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import ConfigError, MeshConfig
from maxnnx.data import TokenWindows
from maxnnx.train import TrainConfig, Trainer, monitor
from maxnnx.train.diagnostics import parse_profile_spec, run_directory
from maxnnx.train.watchdog import StepTimes, Watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _trainer(steps, data=None, **kw):
  cfg = maxnnx.get_preset('tiny', vocab_size=64, num_layers=2, d_model=64, mlp_dim=128)
  tokens = np.random.default_rng(0).integers(0, 64, 20000)
  config = TrainConfig(steps=steps, global_batch_size=4, seq_len=32, mesh=MeshConfig(data=1),
                       **kw)
  return Trainer(maxnnx.Transformer(cfg, rngs=nnx.Rngs(0)), config,
                 data=data if data is not None else TokenWindows(tokens, 32, 4, seed=0))


# -- config ---------------------------------------------------------------------------------

def test_profile_spec():
  assert parse_profile_spec('steps:10-15') == (10, 15)
  assert parse_profile_spec('steps:7') == (7, 7)
  for bad in ('10-15', 'steps:0-3', 'steps:5-2', 'steps:a-b', 'epochs:1-2'):
    with pytest.raises(ConfigError) as error:
      TrainConfig(profile=bad)
    assert "TrainConfig.profile must be 'steps:FIRST-LAST'" in str(error.value)
    assert '\n' not in str(error.value)
  with pytest.raises(ConfigError, match='watchdog_factor'):
    TrainConfig(watchdog_factor=0.5)
  TrainConfig(watchdog_factor=0, outlier_factor=0)  # off


def test_run_directory_defaults(tmp_path):
  assert run_directory(TrainConfig(metrics_jsonl=str(tmp_path / 'run' / 'm.jsonl'))) == str(
      tmp_path / 'run')
  assert run_directory(TrainConfig(checkpoint_dir=str(tmp_path / 'run' / 'ckpt/'))) == str(
      tmp_path / 'run')
  assert run_directory(TrainConfig(tensorboard_dir='tb')) == 'tb'


# -- step times and the watchdog, on their own ------------------------------------------------

def test_step_times_median_outliers_and_rate_limit():
  now = [0.0]
  times = StepTimes(3.0, warmup_windows=1, min_samples=2, min_interval=10.0, clock=lambda: now[0])
  assert times.add(1, 5.0) is None  # warm-up window: ignored
  assert times.add(2, 0.1) is None and times.median is None
  assert times.add(3, 0.1) is None and times.median == pytest.approx(0.1)
  line = times.add(4, 1.0)
  assert line == 'Slow step 4: 1.000 s per step, 10.0x the median 0.100 s.'
  now[0] = 5.0
  assert times.add(5, 1.0) is None  # rate limited, but counted
  assert times.add(6, 0.1) is None
  now[0] = 20.0
  line = times.add(16, 2.0, steps=10)
  assert line.startswith('Slow steps 7-16: 2.000 s per step')
  assert '(1 more slow windows since the last warning)' in line
  assert times.outliers == 3
  assert StepTimes(0, warmup_windows=0, min_samples=1).add(1, 1.0) is None


def test_watchdog_dumps_stacks_once_per_hang(tmp_path):
  path = tmp_path / 'stacks.txt'
  stream = open(tmp_path / 'stderr.txt', 'w')  # noqa: SIM115
  watchdog = Watchdog(5.0, 0.1, str(path), stream=stream, poll=0.01).start()
  try:
    watchdog.step_started(1)
    time.sleep(0.2)  # no median yet: not watching
    assert watchdog.dumps == 0
    watchdog.set_median(0.01)
    watchdog.step_started(2, in_flight=2)
    assert watchdog.limit() == pytest.approx(0.1)
    time.sleep(0.4)
    assert watchdog.dumps == 1  # once per hang
    watchdog.step_finished()
    watchdog.step_started(3)
    time.sleep(0.3)
    assert watchdog.dumps == 2
  finally:
    watchdog.close()
    stream.close()
  text = path.read_text()
  assert text.count('maxnnx watchdog: step') == 2 and 'step 2 has run' in text
  assert 'test_watchdog_dumps_stacks_once_per_hang' in text  # the main thread's stack
  assert 'maxnnx watchdog: step 3' in (tmp_path / 'stderr.txt').read_text()


# -- in a real fit ----------------------------------------------------------------------------

class SlowBatches:
  """Token windows that take ``seconds`` to produce batch number ``slow`` (1-based)."""

  def __init__(self, slow, seconds):
    tokens = np.random.default_rng(0).integers(0, 64, 20000)
    self.windows = TokenWindows(tokens, 32, 4, seed=0)
    self.slow, self.seconds, self.count = slow, seconds, 0

  def __iter__(self):
    return self

  def __next__(self):
    self.count += 1
    if self.count == self.slow:
      time.sleep(self.seconds)
    return self.windows.next()


def test_slow_step_warns_and_the_watchdog_dumps_stacks(tmp_path, caplog, monkeypatch):
  """A batch that takes 1.5 s: an outlier warning, one stack dump, and the run finishes."""
  # No rate limit, so a chance slow step on a busy machine cannot hide step 9's warning.
  monkeypatch.setattr(monitor, 'StepTimes', functools.partial(StepTimes, min_interval=0))
  trainer = _trainer(12, data=SlowBatches(9, 1.5), log_every=1, outlier_factor=3,
                     watchdog_factor=3, watchdog_min_seconds=0.4,
                     metrics_jsonl=str(tmp_path / 'metrics.jsonl'))
  with caplog.at_level(logging.WARNING):
    history = trainer.fit(log=lambda line: None)
  assert len(history) == 12
  warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith('Slow step')]
  assert [w for w in warnings if w.startswith('Slow step 9: ')]
  assert history[8]['step_time_s'] > 1.4
  stacks = (tmp_path / 'watchdog_stacks.txt').read_text()
  assert stacks.count('maxnnx watchdog: step 9 has run') == 1
  assert 'in __next__' in stacks  # the stack shows where the main thread waits
  assert any('watchdog' in r.getMessage() for r in caplog.records)


def test_watchdog_sees_a_first_step_that_hangs_before_any_median(tmp_path):
  """Step 1 stalls in its data (a rollout whose reward hangs): no median is known yet, so the
  first-step limit applies and the stacks show where the step waits."""
  trainer = _trainer(3, data=SlowBatches(1, 1.5), log_every=1, watchdog_factor=3,
                     watchdog_min_seconds=0.4, watchdog_first_step_seconds=0.5,
                     metrics_jsonl=str(tmp_path / 'metrics.jsonl'))
  trainer.fit(log=lambda line: None)
  stacks = (tmp_path / 'watchdog_stacks.txt').read_text()
  assert stacks.count('maxnnx watchdog: step 1 has run') == 1
  assert 'no median yet, limit 0.5 s' in stacks and 'in __next__' in stacks


def test_profile_and_hlo_dump(tmp_path):
  """profile= writes an XProf/TensorBoard trace; dump_hlo= the step's jaxpr and HLO text.
  (Defaults: profile/ and hlo/ next to the metrics file.)"""
  trainer = _trainer(4, profile='steps:2-3', dump_hlo=True,
                     metrics_jsonl=str(tmp_path / 'metrics.jsonl'))
  trainer.fit(log=lambda line: None)
  traces = glob.glob(str(tmp_path / 'profile' / 'plugins' / 'profile' / '*' / '*.xplane.pb'))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
  hlo = tmp_path / 'hlo'
  assert sorted(os.listdir(hlo)) == ['train_step.hlo.txt', 'train_step.jaxpr.txt',
                                     'train_step.optimized.hlo.txt', 'train_step.stablehlo.mlir']
  assert 'jit_train_step' in (hlo / 'train_step.stablehlo.mlir').read_text()
  assert 'HloModule jit_train_step' in (hlo / 'train_step.optimized.hlo.txt').read_text()
  jaxpr = (hlo / 'train_step.jaxpr.txt').read_text()
  assert 'dot_general' in jaxpr and 'lambda' in jaxpr


# -- the persistent compilation cache -----------------------------------------------------------

_COMPILE = textwrap.dedent('''
  import json, sys
  import maxnnx
  from maxnnx.config import MeshConfig
  from maxnnx.train import TrainConfig, Trainer
  cfg = maxnnx.get_preset('tiny', vocab_size=64, num_layers=2, d_model=64, mlp_dim=128)
  config = TrainConfig(steps=2, global_batch_size=4, seq_len=32, mesh=MeshConfig(data=1),
                       compile_cache=sys.argv[1])
  report = Trainer(cfg, config).compile(verbose=False)
  print(json.dumps({k: report[k] for k in ('compile_seconds', 'compile_cache')}))
''')


@pytest.mark.slow
def test_compile_cache_makes_the_second_start_a_hit(tmp_path):
  cache = str(tmp_path / 'cache')
  env = {**os.environ, 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu'}

  def compile_once():
    out = subprocess.run([sys.executable, '-c', _COMPILE, cache], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])

  first, second = compile_once(), compile_once()
  assert first['compile_cache'] == 'miss' and second['compile_cache'] == 'hit'
  assert second['compile_seconds'] < first['compile_seconds']
  assert os.listdir(cache)


@pytest.mark.slow  # ~30 s: two CLI runs in fresh processes
def test_generate_with_a_compile_cache_compiles_nothing_new_the_second_time(tmp_path,
                                                                           chat_checkpoint):
  """``maxnnx generate compile_cache=DIR`` fills DIR; a second run in a fresh process finds
  every program there (it adds no entry) and prints the same greedy text."""
  import shutil  # noqa: PLC0415
  run = tmp_path / 'run'
  cfg = maxnnx.get_preset('tiny', vocab_size=512, num_layers=1)
  maxnnx.save_pretrained(maxnnx.Transformer(cfg, rngs=nnx.Rngs(0)), str(run / 'final'))
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(chat_checkpoint / name, run / 'final' / name)
  cache = tmp_path / 'cache'
  env = {**os.environ, 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu'}

  def generate():
    return subprocess.run(
        [sys.executable, '-m', 'maxnnx', 'generate', f'output_dir={run}', 'prompt=Once',
         'max_new_tokens=5', 'temperature=0', f'compile_cache={cache}'],
        env=env, check=True, capture_output=True, text=True).stdout

  first = generate()
  entries = sorted(os.listdir(cache))
  assert entries
  assert generate() == first
  assert sorted(os.listdir(cache)) == entries

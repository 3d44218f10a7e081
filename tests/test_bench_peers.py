"""The peer launchers without their peers: arguments, MaxText overrides, log parsing, result lines.

Nothing here imports torch or MaxText or builds a virtual environment.
"""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.configs import get_config, train_flops_per_token
from benchmarks.peers import _common
from benchmarks.peers import maxtext as mt
from benchmarks.peers import pytorch as pt


def test_pytorch_args_and_spec():
  args = pt.parse_args(['--config', 'cpu-tiny', '--mode', 'compile', '--steps', '7',
                        '--dtype', 'float32', '--json', 'x.jsonl'])
  assert (args.steps, args.warmup, args.dtype, args.torch_spec) == (7, 3, 'float32',
                                                                    'torch==2.13.0')
  assert pt.framework_name(args.mode) == 'pytorch-compile'
  spec = pt.inner_spec(args, 'raw.json')
  assert spec['cfg'] == get_config('cpu-tiny')
  assert (spec['mode'], spec['dtype'], spec['steps'], spec['warmup']) == ('compile', 'float32',
                                                                          7, 3)
  json.dumps(spec)  # travels to the inner script as JSON


def test_pytorch_python_skips_the_venv(monkeypatch, tmp_path):
  """``--python`` runs the inner script with that interpreter and creates no environment."""
  calls = []

  def fake_run(cmd, check):
    calls.append(cmd)
    raw = dict(step_times_s=[0.5] * 5, ceiling_tflops=1.0, compile_s=None, peak_memory_gib=1.0,
               device_type='cuda', device_name='Fake GPU', versions={'torch': 'fake'})
    Path(json.loads(cmd[2])['out']).write_text(json.dumps(raw))

  monkeypatch.setattr(pt._common, 'ensure_env', lambda *a, **k: pytest.fail('made a venv'))
  monkeypatch.setattr(pt.subprocess, 'run', fake_run)
  result = pt.main(['--config', 'cpu-tiny', '--mode', 'eager', '--steps', '2',
                    '--json', str(tmp_path / 'r.jsonl'), '--python', '/opt/torch/python3'])
  assert calls[0][:2] == ['/opt/torch/python3', str(pt.INNER)]
  assert result['device'] == 'gpu: Fake GPU' and result['framework'] == 'pytorch-eager'


@pytest.mark.parametrize('argv', [
    ['--config', 'cpu-tiny', '--mode', 'compile', '--warmup', '0', '--json', 'x'],
    ['--config', 'cpu-tiny', '--mode', 'eager', '--steps', '0', '--json', 'x'],
    ['--config', 'nope', '--mode', 'eager', '--json', 'x'],
    ['--config', 'cpu-tiny', '--mode', 'jit', '--json', 'x'],
    ['--config', 'cpu-tiny', '--mode', 'eager', '--dtype', 'float16', '--json', 'x'],
])
def test_pytorch_bad_args(argv):
  with pytest.raises(SystemExit):
    pt.parse_args(argv)


def test_maxtext_args():
  args = mt.parse_args(['--config', 'cpu-medium', '--json', 'x.jsonl'])
  assert (args.steps, args.warmup, args.python) == (10, 3, None)
  assert mt.resolve_hardware(args) == 'cpu'
  assert mt.maxtext_spec(args, 'cpu') == 'maxtext[tpu]==0.2.5'
  assert mt.maxtext_spec(args, 'gpu') == 'maxtext[cuda12]==0.2.5'
  gpu = mt.parse_args(['--config', 'gpu-1b', '--json', 'x', '--python', 'py'])
  assert mt.resolve_hardware(gpu) == 'gpu' and gpu.python == 'py'
  for bad in (['--steps', '0'], ['--warmup', '0'], ['--override', 'nokey']):
    with pytest.raises(SystemExit):
      mt.parse_args(['--config', 'cpu-tiny', '--json', 'x', *bad])


def test_maxtext_overrides_cpu_tiny():
  got = mt.maxtext_overrides(get_config('cpu-tiny'), run_name='bench-cpu-tiny',
                             output_dir='/tmp/o', steps=10, hardware='cpu')
  assert got == [
      'run_name=bench-cpu-tiny', 'base_output_directory=/tmp/o',
      'jax_cache_dir=/tmp/o/jax_cache', 'hardware=cpu', 'dataset_type=synthetic',
      'skip_jax_distributed_system=True', 'enable_checkpointing=False', 'steps=10',
      'decoder_block=llama2', 'base_emb_dim=256', 'base_num_decoder_layers=4',
      'base_num_query_heads=4', 'base_num_kv_heads=4', 'head_dim=64', 'base_mlp_dim=1024',
      'vocab_size=32000', 'max_target_length=256', 'per_device_batch_size=4',
      'rope_max_timescale=10000']


def test_maxtext_overrides_moe_and_devices():
  got = dict(kv.split('=', 1) for kv in mt.maxtext_overrides(
      get_config('gpu-moe'), run_name='r', output_dir='o', steps=5, hardware='gpu',
      num_devices=4))
  assert got['decoder_block'] == 'mixtral'
  assert (got['num_experts'], got['num_experts_per_tok'], got['base_moe_mlp_dim']) == (
      '64', '8', '768')
  assert (got['per_device_batch_size'], got['rope_max_timescale']) == ('2', '1000000')
  with pytest.raises(ValueError, match='num-devices'):
    mt.maxtext_overrides(get_config('cpu-tiny'), run_name='r', output_dir='o', steps=5,
                         hardware='cpu', num_devices=3)


def _fake_log(seconds, compile_s=None):
  lines = ['I1121 some startup line']
  if compile_s is not None:  # MaxText's lines around its ahead-of-time compile
    minutes, secs = divmod(compile_s - 1.5, 60)  # from 1.5 s before midnight
    lines += [
        'I1121 23:59:58.500000 1398 checkpointing.py:803] No existing checkpoints found.',
        'I1121 00:00:01.000000   21 dump.cc:725] HloModule dump enabled',
        f'I1122 00:{int(minutes):02d}:{secs:09.6f} 1398 max_utils.py:823] [train] Total '
        'estimated memory size: 0.6 GB, estimated output size: 0.2 GB']
  lines.append('Memstats: After params initialized:')
  for step, sec in enumerate(seconds):
    lines.append(f'completed step: {step}, seconds: {sec:.3f}, TFLOP/s/device: 0.010, '
                 f'Tokens/s/device: {1024 / sec:.3f}, total_weights: 1024, loss: 10.373')
  return '\n'.join(lines) + '\n'


def test_maxtext_result_from_log():
  rng = random.Random()
  seconds = [round(rng.uniform(20, 40), 3)] + [round(rng.uniform(0.5, 2.0), 3) for _ in range(9)]
  compile_s = round(rng.uniform(5, 200), 3)
  log = _fake_log(seconds, compile_s)
  assert mt.parse_step_times(log) == dict(enumerate(seconds))
  assert mt.parse_compile_seconds(log) == pytest.approx(compile_s)
  assert mt.parse_compile_seconds(_fake_log(seconds)) is None
  args = mt.parse_args(['--config', 'cpu-tiny', '--steps', '10', '--json', 'x'])
  raw = dict(ceiling_tflops=0.2, peak_rss_gib=1.5, device_kind='cpu', device_count=1,
             versions={'maxtext': '0.2.5', 'jax': '0.11.1'})
  res = mt.result_from_run(args, log, raw, 'cmd')
  timed = sorted(seconds[3:])
  assert res['steps_timed'] == 7 and res['step_time_s'] == pytest.approx(timed[3])
  assert res['compile_s'] == pytest.approx(compile_s) and res['framework'] == 'maxtext'
  cfg = get_config('cpu-tiny')
  assert res['tokens_per_s'] == pytest.approx(cfg['batch'] * cfg['seq'] / timed[3])
  assert res['tflops_per_device'] == pytest.approx(
      res['tokens_per_s'] * train_flops_per_token(cfg) / 1e12)
  assert res['mfu'] == pytest.approx(res['tflops_per_device'] / 0.2)
  with pytest.raises(SystemExit, match='completed step'):
    mt.result_from_run(args, 'nothing logged\n', raw, 'cmd')


def test_result_line_schema(tmp_path):
  args = pt.parse_args(['--config', 'cpu-medium', '--mode', 'eager', '--json', 'x'])
  times = [random.uniform(0.5, 3.0) for _ in range(args.warmup + 5)]
  raw = dict(step_times_s=times, ceiling_tflops=None, compile_s=None, peak_memory_gib=2.0,
             device_name=None, device_type='cpu', threads=2, versions={'torch': '2.13.0+cpu'})
  res = pt.result_from_raw(args, raw, 'python -m benchmarks.peers.pytorch ...')
  assert tuple(res) == _common.RESULT_KEYS
  assert res['steps_timed'] == 5 and res['mfu'] is None and res['num_devices'] == 1
  assert res['step_time_s'] == pytest.approx(sorted(times[args.warmup:])[2])
  assert res['device'].startswith('cpu: ') and res['device'].endswith(' cores')
  path = tmp_path / 'sub' / 'r.jsonl'
  _common.append_json_line(path, res)
  _common.append_json_line(path, res)
  lines = path.read_text().splitlines()
  assert len(lines) == 2 and json.loads(lines[1]) == res
  with pytest.raises(ValueError, match='--steps'):
    _common.median([])


def test_find_python_explains_the_requirement(monkeypatch):
  monkeypatch.setattr(mt, 'candidate_pythons', lambda: [])
  with pytest.raises(SystemExit, match=r'Python >= 3\.12.*--python'):
    mt.find_python(None)
  if sys.version_info[:2] < (3, 12):
    with pytest.raises(SystemExit, match='not a working Python'):
      mt.find_python(sys.executable)
  else:
    assert mt.find_python(sys.executable) == sys.executable


def test_launcher_help_runs_without_torch():
  for module in ('benchmarks.peers.pytorch', 'benchmarks.peers.maxtext'):
    out = subprocess.run([sys.executable, '-m', module, '--help'], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0 and '--config' in out.stdout


def test_result_lines_pass_the_shared_validator():
  results = pytest.importorskip('benchmarks.results')  # the shared schema, where present
  args = mt.parse_args(['--config', 'cpu-tiny', '--json', 'x'])
  raw = dict(ceiling_tflops=0.2, peak_rss_gib=1.5, device_kind='cpu', device_count=1,
             versions={'maxtext': '0.2.5'})
  res = mt.result_from_run(args, _fake_log([random.uniform(0.5, 2) for _ in range(10)], 30.0),
                           raw, 'cmd')
  results.validate_result(res)
  args = pt.parse_args(['--config', 'cpu-tiny', '--mode', 'compile', '--json', 'x'])
  raw = dict(step_times_s=[random.uniform(0.5, 3) for _ in range(8)], ceiling_tflops=0.1,
             compile_s=40.0, peak_memory_gib=1.0, device_name=None, device_type='cpu',
             threads=2, versions={'torch': '2.13.0+cpu'})
  results.validate_result(pt.result_from_raw(args, raw, 'cmd'))

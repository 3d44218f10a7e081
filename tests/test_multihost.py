"""Two processes joined by jax.distributed over 127.0.0.1 train like one device."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import free_port

from maxnnx.train import Trainer
from tests.multihost.common import global_batches, model_config, train_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_processes_match_one_device(tmp_path):
  port, out = free_port(), str(tmp_path / 'losses.json')
  env = {**os.environ, 'PYTHONPATH': ROOT + os.pathsep + os.environ.get('PYTHONPATH', '')}
  procs = [subprocess.Popen([sys.executable, '-m', 'tests.multihost.worker', str(port), str(i),
                             out], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  for proc in procs:
    try:
      logs.append(proc.communicate(timeout=240)[0])
    finally:
      proc.kill()
  assert all(p.returncode == 0 for p in procs), '\n\n'.join(log[-3000:] for log in logs)
  result = json.load(open(out))
  assert result['processes'] == 2 and result['devices'] == 4

  trainer = Trainer(model_config(), train_config(), data=global_batches())
  reference = [m['loss'] for m in trainer.fit(log=lambda line: None)]
  np.testing.assert_allclose(result['losses'], reference, rtol=1e-4)


# float32: dtype=auto is bfloat16 on a CPU with bf16 matmuls, where two processes' reduction order
# alone moves the losses by about 1e-4.
CLI_ARGS = ['train', 'model=tiny', 'model.num_layers=2', 'steps=3', 'global_batch_size=8',
            'seq_len=32', 'log_every=1', 'eval_every=0', 'checkpoint_every=2', 'sample_tokens=0',
            'dtype=float32']


def _cli(args, devices, port=None, process_id=None):
  env = {**os.environ, 'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices}',
         'PYTHONPATH': ROOT + os.pathsep + os.environ.get('PYTHONPATH', '')}
  if port is not None:
    args = [*args, f'coordinator=127.0.0.1:{port}', 'num_processes=2', f'process_id={process_id}']
  return subprocess.Popen([sys.executable, '-m', 'maxnnx', *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs):
  outputs = []
  for proc in procs:
    try:
      outputs.append(proc.communicate(timeout=400))
    finally:
      proc.kill()
  assert all(p.returncode == 0 for p in procs), '\n\n'.join(o[1][-3000:] for o in outputs)
  return [o[0] for o in outputs]


@pytest.mark.slow  # ~40 s: two processes; test_two_processes_match_one_device stays
def test_cli_train_over_two_processes_matches_one_process(tmp_path):
  """``maxnnx train coordinator=... num_processes=2 process_id=I`` (2 x 2 CPU devices, data x
  fsdp) against one process on one device, same global batches: the same losses and final
  weights; process 0 alone prints and writes the run's files, every process writes its
  checkpoint shards and its layers of final/."""
  from maxnnx.checkpoint import read_safetensors_dir  # noqa: PLC0415
  from maxnnx.data import SentencePieceTokenizer  # noqa: PLC0415
  two, one = tmp_path / 'two', tmp_path / 'one'
  port = free_port()
  procs = [_cli([*CLI_ARGS, f'output_dir={two}', 'mesh.data=2', 'mesh.fsdp=2',
                 'sample_tokens=6'], 2, port, i) for i in range(2)]
  procs.append(_cli([*CLI_ARGS, f'output_dir={one}', 'mesh.data=1'], 1))
  first, second, single = _finish(procs)
  assert "mesh {'data': 2, 'fsdp': 2}" in first and 'step      3/3' in first
  assert '\nSample:\nROMEO:' in first  # sampled by both processes from the sharded model
  ours_printed = [line for line in second.splitlines() if not line.startswith('[Gloo]')]
  assert ours_printed == []  # process 1 runs silently (the collectives' own log aside)
  losses = [[json.loads(line)['loss'] for line in open(d / 'metrics.jsonl')] for d in (two, one)]
  assert len(losses[0]) == 3
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
  ours, reference = (read_safetensors_dir(str(d / 'final')) for d in (two, one))
  assert sorted(ours) == sorted(reference)
  for name, (_, array) in reference.items():
    np.testing.assert_allclose(ours[name][1], array, atol=1e-5, err_msg=name)
  assert len({file for file, _ in ours.values()}) == 2  # each process wrote its layers
  assert (two / 'final' / 'tokenizer.model').exists() and not (two / 'final.tmp').exists()
  pieces = [SentencePieceTokenizer(str(d / 'tokenizer.model')) for d in (two, one)]
  text = 'ROMEO: But soft, what light'
  assert pieces[0].encode(text) == pieces[1].encode(text)  # trained once, on process 0
  assert sorted(os.listdir(two / 'checkpoints')) == ['2', '3', 'high_water.json']
  assert not (two / '.tokenizer-new').exists()


def test_cli_multi_process_keys_go_together(capsys):
  from maxnnx.cli import main  # noqa: PLC0415
  assert main(['train', 'coordinator=10.0.0.1:1234', 'num_processes=2']) == 2
  assert 'coordinator=10.0.0.1:1234 needs num_processes=N' in capsys.readouterr().err
  assert main(['train', 'process_id=1']) == 2
  assert 'num_processes= and process_id= go with coordinator' in capsys.readouterr().err


def _chat_base(tmp_path, chat_checkpoint):
  """A small random chat model in Hugging Face format, with its tokenizer and template."""
  import shutil  # noqa: PLC0415

  from flax import nnx  # noqa: PLC0415

  import maxnnx  # noqa: PLC0415
  base = tmp_path / 'base'
  cfg = maxnnx.get_preset('tiny', vocab_size=512, num_layers=2)
  maxnnx.save_pretrained(maxnnx.Transformer(cfg, rngs=nnx.Rngs(0)), str(base))
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(chat_checkpoint / name, base / name)
  return base


@pytest.mark.slow  # ~40 s: three processes
def test_cli_lora_sft_over_two_processes_matches_one_process(tmp_path, chat_checkpoint):
  """``maxnnx sft lora.rank=4`` over 2 processes x 2 devices (data x fsdp) merges the adapters
  on the sharded model (each process gathers one kernel at a time and writes its layers of
  final/): final/ equals the base with the run's PEFT adapter loaded and merged in one
  process. (The runs' losses differ from one process's: a JSONL pipeline deals each process
  every other record.)"""
  import maxnnx  # noqa: PLC0415
  from maxnnx.checkpoint import read_safetensors_dir  # noqa: PLC0415
  from maxnnx.train.lora import load_adapter, merge_adapters  # noqa: PLC0415
  base = _chat_base(tmp_path, chat_checkpoint)
  data = tmp_path / 'chats.jsonl'
  data.write_text(''.join(json.dumps({'messages': [
      {'role': 'user', 'content': f'Who speaks line {i}?'},
      {'role': 'assistant', 'content': name}]}) + '\n'
      for i, name in enumerate(['ROMEO', 'JULIET', 'MERCUTIO', 'TYBALT'] * 4)))
  args = ['sft', f'model={base}', f'data={data}', 'lora.rank=4', 'steps=3',
          'global_batch_size=8', 'seq_len=32', 'log_every=1', 'learning_rate=1e-2',
          'eval_every=0', 'checkpoint_every=0', 'sample_tokens=0']
  two = tmp_path / 'two'
  port = free_port()
  _finish([_cli([*args, f'output_dir={two}', 'mesh.data=2', 'mesh.fsdp=2'], 2, port, i)
           for i in range(2)])
  reference = tmp_path / 'reference'
  merged = merge_adapters(load_adapter(maxnnx.from_pretrained(str(base)), str(two / 'adapter')))
  maxnnx.save_pretrained(merged, str(reference))
  ours, want = (read_safetensors_dir(str(d)) for d in (two / 'final', reference))
  assert sorted(ours) == sorted(want)
  for name, (_, array) in want.items():
    np.testing.assert_allclose(ours[name][1], array, rtol=1e-6, atol=1e-7, err_msg=name)
  base_up = read_safetensors_dir(str(base))['model.layers.0.mlp.up_proj.weight'][1]
  assert np.abs(ours['model.layers.0.mlp.up_proj.weight'][1] - base_up).max() > 1e-4  # merged
  assert len({file for file, _ in ours.values()}) == 2  # each process wrote its layers
  assert json.loads((two / 'adapter' / 'adapter_config.json').read_text())['r'] == 4


@pytest.mark.slow  # ~40 s each: three processes sample, score and train
@pytest.mark.parametrize('sampler', ['generate', 'engine'])
def test_cli_grpo_over_two_processes_matches_one_process(sampler, tmp_path, chat_checkpoint):
  """``maxnnx grpo`` over 2 processes x 2 devices (data x fsdp) against one process on one
  device: the same rewards, completions and losses, step by step; only process 0 calls
  the reward function and writes the rollouts."""
  base = _chat_base(tmp_path, chat_checkpoint)
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text(''.join(json.dumps({'prompt': [
      {'role': 'user', 'content': f'Who speaks line {i}?'}]}) + '\n' for i in range(16)))
  calls = tmp_path / 'calls'
  (tmp_path / 'rewards.py').write_text(
      'import os\n\n'
      'def brief(prompts, completions, **kwargs):\n'
      f'  with open({str(calls)!r}, "a") as f:\n'
      '    f.write(os.environ.get("MAXNNX_TEST_RANK", "?"))\n'
      '  return [1.0 / (1 + len(c)) for c in completions]\n')
  args = ['grpo', f'model={base}', f'prompts={prompts}', f"reward={tmp_path / 'rewards.py'}:brief",
          'num_generations=2', 'max_new_tokens=6', 'steps=3', 'global_batch_size=8',
          'seq_len=48', 'log_every=1', 'learning_rate=1e-3', 'beta=0.05', 'eval_every=0',
          'checkpoint_every=0', 'temperature=1.0', f'sampler={sampler}', 'dtype=float32']
  two, one = tmp_path / 'two', tmp_path / 'one'
  port = free_port()
  procs = []
  for i in range(2):
    os.environ['MAXNNX_TEST_RANK'] = str(i)
    procs.append(_cli([*args, f'output_dir={two}', 'mesh.data=2', 'mesh.fsdp=2'], 2, port, i))
  os.environ['MAXNNX_TEST_RANK'] = 'single'
  procs.append(_cli([*args, f'output_dir={one}', 'mesh.data=1'], 1))
  del os.environ['MAXNNX_TEST_RANK']
  _finish(procs)
  records = [[json.loads(line) for line in open(d / 'metrics.jsonl')] for d in (two, one)]
  assert [len(r) for r in records] == [3, 3]
  for key in ('reward', 'completions/mean_length', 'loss', 'kl'):
    np.testing.assert_allclose([m[key] for m in records[0]], [m[key] for m in records[1]],
                               rtol=1e-4, atol=1e-6, err_msg=key)
  rollouts = [[json.loads(line)['completion'] for line in open(d / 'rollouts.jsonl')]
              for d in (two, one)]
  assert rollouts[0] == rollouts[1] and len(rollouts[0]) == 3 * 8
  assert calls.read_text().replace('single', '') == '000'  # process 0, once per rollout


@pytest.mark.slow  # ~30 s: two processes start a GRPO run that cannot be rewarded
def test_a_reward_error_on_process_0_ends_every_process(tmp_path, chat_checkpoint):
  """Only process 0 calls the reward functions; when one raises, process 1 does not wait for
  values that never come: both processes exit with the error."""
  base = _chat_base(tmp_path, chat_checkpoint)
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text(''.join(json.dumps({'prompt': f'line {i}'}) + '\n' for i in range(8)))
  (tmp_path / 'rewards.py').write_text(
      'def broken(prompts, completions, **kwargs):\n'
      '  raise ValueError("the judge is out")\n')
  args = ['grpo', f'model={base}', f'prompts={prompts}', f"reward={tmp_path / 'rewards.py'}:broken",
          'num_generations=2', 'max_new_tokens=4', 'steps=2', 'global_batch_size=8',
          'seq_len=32', 'eval_every=0', 'checkpoint_every=0', 'mesh.data=2', 'mesh.fsdp=2',
          f"output_dir={tmp_path / 'run'}"]
  port = free_port()
  procs = [_cli(args, 2, port, i) for i in range(2)]
  errors = []
  for proc in procs:
    try:
      errors.append(proc.communicate(timeout=300)[1])
    finally:
      proc.kill()
  assert [p.returncode != 0 for p in procs] == [True, True], errors
  cause = "Reward function 'broken' raised ValueError: the judge is out"
  assert f'error: {cause}' in errors[0], errors[0]  # the CLI's one line
  assert f'The reward functions failed on process 0: {cause}' in errors[1], errors[1]

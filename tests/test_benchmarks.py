"""The benchmark harness: FLOP count, result lines, the train/decode harnesses, compare, and
that the train loop compiles its step exactly once."""

import gzip
import json
import logging
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

import maxnnx
from benchmarks import (
  compare,
  decode,
  hf_decode,
  profile_summary,
  results,
  serving,
  serving_load,
  train_throughput,
)
from benchmarks.configs import BENCH_CONFIGS, get_config, train_flops_per_token
from benchmarks.model import model_config
from maxnnx.config import MeshConfig
from maxnnx.host_memory import host_memory_status
from maxnnx.models.counting import num_params
from maxnnx.train import TrainConfig, Trainer
from maxnnx.train import flops as flops_lib
from maxnnx.train.trainer import synthetic_batches

MICRO = dict(d_model=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, mlp_dim=128,
             vocab_size=256, seq=32, batch=8, rope_theta=10_000.0, num_experts=0,
             num_experts_per_tok=0)


@pytest.mark.parametrize('name', sorted(BENCH_CONFIGS))
def test_flops_agree_with_maxnnx_count(name):
  """configs.train_flops_per_token and maxnnx.train.flops count the same matmuls; they differ
  only in causal attention: maxnnx averages (seq + 1) / 2 keys per query, the shared count
  seq / 2, which is exactly 3 (fwd+bwd) x 2 (QK and PV) x 2 (FLOPs per MAC) x 1/2 key x q_dim
  = 6 * q_dim per layer more."""
  cfg = get_config(name)
  ours = train_flops_per_token(cfg)
  theirs = flops_lib.training_flops_per_token(model_config(cfg), cfg['seq'])
  q_dim = cfg['num_heads'] * cfg['head_dim']
  assert theirs - ours == pytest.approx(6 * q_dim * cfg['num_layers'], rel=1e-12)
  assert (theirs - ours) / ours < 1e-3  # a rounding-level difference for these shapes


def test_model_config_has_the_config_shapes():
  """The maxnnx model has exactly the parameters the shapes imply (MoE: all experts)."""
  for name in ('cpu-tiny', 'moe-small'):
    cfg = get_config(name)
    d, f, v, layers = cfg['d_model'], cfg['mlp_dim'], cfg['vocab_size'], cfg['num_layers']
    attn = 4 * d * cfg['num_heads'] * cfg['head_dim']  # MHA: q, k, v, o all d x d here
    mlp = 3 * d * f * max(cfg['num_experts'], 1) + d * cfg['num_experts']
    expected = layers * (attn + mlp + 2 * d) + 2 * v * d + d
    mcfg = model_config(cfg)
    assert num_params(mcfg) == expected
    assert mcfg.family == ('mixtral' if cfg['num_experts'] else 'llama')


def _record(**changes):
  fields = dict(framework='pytorch-eager', config='cpu-tiny', device='cpu: test x2 cores',
                num_devices=2, dtype='bfloat16', batch=4, seq=256, steps_timed=10,
                step_time_s=0.5, flops_per_token=1e8, ceiling_tflops=0.4, compile_s=None,
                peak_memory_gib=1.5, versions={'torch': '2'}, command='python -m x')
  fields.update(changes)
  return results.make_result(**fields)


def test_result_record_arithmetic_and_validation(tmp_path):
  """make_result derives tokens/s, per device, TFLOP/s and MFU; validate_result rejects a
  missing field, a wrong type, an unknown framework and inconsistent numbers."""
  r = _record()
  assert r['tokens_per_s'] == pytest.approx(4 * 256 / 0.5)
  assert r['tokens_per_s_per_device'] == pytest.approx(r['tokens_per_s'] / 2)
  assert r['tflops_per_device'] == pytest.approx(1e8 * r['tokens_per_s_per_device'] / 1e12)
  assert r['mfu'] == pytest.approx(r['tflops_per_device'] / 0.4)
  path = tmp_path / 'r.jsonl'
  results.append_result(str(path), r)
  results.append_result(str(path), _record(framework='maxnnx', ceiling_tflops=None))
  back = results.read_results(str(path))
  assert back[0] == r and back[1]['mfu'] is None
  for bad, message in [({k: v for k, v in r.items() if k != 'seq'}, 'missing'),
                       ({**r, 'batch': '4'}, "'batch'"),
                       ({**r, 'framework': 'jax'}, 'framework'),
                       ({**r, 'tokens_per_s': r['tokens_per_s'] * 1.1}, 'tokens_per_s'),
                       ({**r, 'date': 'yesterday'}, 'date')]:
    with pytest.raises(results.ResultError, match=message):
      results.validate_result(bad)


def test_train_throughput_harness_writes_a_consistent_result(tmp_path):
  """Three timed steps of a micro config: the JSON line has every field, tokens/s is
  batch * seq / median step time, and MFU is TFLOP/s over the measured ceiling."""
  path = tmp_path / 'out.jsonl'
  lines = []
  record = train_throughput.run(MICRO, name='micro', dtype='float32', steps=3, warmup=1,
                                ceiling_seconds=0.05, ceiling_size=256, json_path=str(path),
                                mesh=MeshConfig(data=1), log=lines.append)
  (line,) = path.read_text().splitlines()
  saved = json.loads(line)
  assert saved == json.loads(json.dumps(record))
  assert set(results.SCHEMA) <= set(saved)
  assert saved['framework'] == 'maxnnx' and saved['steps_timed'] == 3
  assert saved['batch'] == 8 and saved['seq'] == 32 and saved['num_devices'] == 1
  assert saved['tokens_per_s'] == pytest.approx(8 * 32 / saved['step_time_s'])
  assert saved['tokens_per_s_per_device'] == pytest.approx(
      saved['tokens_per_s'] / saved['num_devices'])
  assert saved['tflops_per_device'] == pytest.approx(
      train_flops_per_token(MICRO) * saved['tokens_per_s_per_device'] / 1e12)
  assert saved['ceiling_tflops'] == max(saved['ceiling_tflops_before'],
                                        saved['ceiling_tflops_after']) > 0
  assert saved['mfu'] == pytest.approx(saved['tflops_per_device'] / saved['ceiling_tflops'])
  assert saved['step_time_p10_s'] <= saved['step_time_s'] <= saved['step_time_p90_s']
  assert saved['compile_s'] > 0 and saved['peak_memory_gib'] > 0
  assert all(math.isfinite(x) for x in saved['loss_first_last'])
  assert saved['versions']['jax'] == jax.__version__
  assert saved['host_memory'] == host_memory_status()  # which allocator the figures had
  assert any('tokens/s' in line for line in lines)
  assert any('host allocator' in line for line in lines)


def test_train_throughput_with_bf16_parameters_and_a_profile(tmp_path):
  """The Trainer settings the GPU runs use reach the Trainer (bf16 parameters and moments), and
  ``profile_dir`` adds the kernel summary to the record."""
  record = train_throughput.run(MICRO, name='micro', dtype='float32', steps=2, warmup=1,
                                ceiling_seconds=0.05, ceiling_size=256, mesh=MeshConfig(data=1),
                                param_dtype='bfloat16', mu_dtype='bfloat16',
                                profile_dir=str(tmp_path), profile_steps=2, log=lambda _: None)
  assert record['param_dtype'] == 'bfloat16' and record['mu_dtype'] == 'bfloat16'
  assert record['quantization'] == 'none' and not record['optimizer_offload']
  assert record['profile'].startswith('profile (') and 'top kernels' in record['profile']
  assert all(math.isfinite(x) for x in record['loss_first_last'])


def test_train_step_compiles_once_across_logging_and_eval():
  """Over a fit that crosses log_every boundaries and evaluates, the train step and the eval
  step are each compiled exactly once; a second fit compiles nothing at all."""
  cfg = maxnnx.get_preset('tiny', vocab_size=64, num_layers=2, d_model=64, mlp_dim=128)
  train_cfg = TrainConfig(steps=12, global_batch_size=4, seq_len=16, log_every=2, eval_every=3,
                          eval_batches=2, mesh=MeshConfig(data=1))
  eval_data = [next(synthetic_batches(64, 4, 16, seed=1)) for _ in range(2)]
  trainer = Trainer(cfg, train_cfg, data=synthetic_batches(64, 4, 16), eval_data=eval_data)

  messages = []

  class Capture(logging.Handler):
    def emit(self, record):
      messages.append(record.getMessage())

  handler = Capture(logging.DEBUG)
  jax_logger = logging.getLogger('jax')
  jax_logger.addHandler(handler)
  try:
    with jax.log_compiles():
      trainer.fit(7, log=lambda line: None)
  finally:
    jax_logger.removeHandler(handler)
  compiled = [m for m in messages if m.startswith('Compiling ')]
  assert sum('jit(train_step)' in m for m in compiled) == 1, compiled
  assert sum('jit(eval_step)' in m for m in compiled) == 1, compiled
  assert sum('eval_loss' in h for h in trainer.history) == 3  # steps 3, 6 and the last

  backend_compiles = []
  def listener(event, duration, **kwargs):
    if event == '/jax/core/compile/backend_compile_duration':
      backend_compiles.append(duration)
  monitoring.register_event_duration_secs_listener(listener)
  try:
    trainer.fit(5, log=lambda line: None)  # crosses log_every and eval_every again
  finally:
    monitoring.unregister_event_duration_listener(listener)
  assert backend_compiles == []
  assert len(trainer.history) == 12


def test_compare_table_ratio_and_failed_peer(monkeypatch, tmp_path):
  """compare: the newest line per framework wins, the ratio is maxnnx / peer in tokens/s per
  device, and a peer that fails is a row saying why (not a crash)."""
  ours = _record(framework='maxnnx', step_time_s=0.25)
  old_peer = _record(step_time_s=0.1)
  old_peer['date'] = '2000-01-01T00:00:00+00:00'
  peer = _record(step_time_s=1.0)
  monkeypatch.setattr(compare, 'peer_command', lambda framework, *a, **k: [
      sys.executable, '-c', f'import sys; sys.exit("{framework} exploded")'])
  failures = compare.run_all(['cpu-tiny'], ['maxtext'], 3, str(tmp_path / 'x.jsonl'), 60,
                             log=lambda line: None)
  assert failures == {('cpu-tiny', 'maxtext'): 'exit 1: maxtext exploded'}
  table = compare.format_comparison([ours, old_peer, peer], failures)
  rows = {line.split()[0]: line for line in table.splitlines()[2:]}
  assert '4.00x' in rows['pytorch-eager'] and '1.00x' in rows['maxnnx']
  assert 'no result: exit 1: maxtext exploded' in rows['maxtext']


def test_compare_keeps_quantized_and_remat_variants_apart():
  """A maxnnx fp8 run and a bf16 run of the same config are two rows, the ratio against the
  plain maxnnx row."""
  plain = _record(framework='maxnnx', step_time_s=0.5)
  fp8 = dict(_record(framework='maxnnx', step_time_s=0.25), quantization='fp8')
  remat = dict(_record(framework='maxnnx', step_time_s=1.0), remat='full',
               param_dtype='bfloat16')
  assert [compare.label(r) for r in (plain, fp8, remat)] == [
      'maxnnx', 'maxnnx fp8', 'maxnnx remat=full params=bfloat16']
  table = compare.format_comparison([plain, fp8, remat])
  rows = {line[:36].strip(): line for line in table.splitlines()[2:]}
  assert '1.00x' in rows['maxnnx'] and '0.50x' in rows['maxnnx fp8']
  assert '2.00x' in rows['maxnnx remat=full params=bfloat16']


def test_profile_summary_sums_device_kernels_by_group(tmp_path):
  """A trace with a device track: kernels summed per step and grouped by name; the device's
  summary tracks and host events are left out."""
  events = [
      {'ph': 'M', 'name': 'process_name', 'pid': 1, 'args': {'name': '/host:CPU'}},
      {'ph': 'M', 'name': 'process_name', 'pid': 2, 'args': {'name': '/device:GPU:0'}},
      {'ph': 'M', 'name': 'thread_name', 'pid': 2, 'tid': 7, 'args': {'name': 'Stream #13'}},
      {'ph': 'M', 'name': 'thread_name', 'pid': 2, 'tid': 8, 'args': {'name': 'XLA Ops'}},
      {'ph': 'X', 'pid': 1, 'tid': 1, 'name': 'PjitFunction(step)', 'dur': 9000},
      {'ph': 'X', 'pid': 2, 'tid': 8, 'name': 'fusion.1', 'dur': 9000},  # a summary track
  ]
  kernels = {'nvjet_sm90_gemm': 600.0, 'cudnn_sdpa_flash_fprop': 300.0,
             'loop_add_fusion_3': 80.0, 'ncclAllReduce': 20.0}
  for name, dur in kernels.items():
    events += [{'ph': 'X', 'pid': 2, 'tid': 7, 'name': name, 'dur': dur / 2}] * 2
  path = tmp_path / 'plugins' / 'profile' / 'run' / 'perfetto_trace.json.gz'
  path.parent.mkdir(parents=True)
  with gzip.open(path, 'wt') as f:
    json.dump({'traceEvents': events}, f)
  assert profile_summary.find_trace(str(tmp_path)) == str(path)
  totals, where = profile_summary.kernel_times(str(path))
  assert where == 'device' and totals == kernels
  text = profile_summary.summarize(str(path), steps=2, step_time_s=0.001)
  assert text.splitlines()[0].startswith('profile (device, 2 steps): 0.50 ms of kernels per step')
  groups = {line.split()[0]: line.split()[1:] for line in text.splitlines()[2:7]}
  assert groups['matmul'] == ['0.300', '60.0%'] and groups['attention'] == ['0.150', '30.0%']
  assert groups['fusion'][0] == '0.040' and groups['collective'][0] == '0.010'


def test_profile_summary_of_a_real_trace(tmp_path):
  """jax.profiler's own trace of a jitted function on this host: its XLA ops are found."""
  f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
  a = jnp.ones((128, 128))
  f(a).block_until_ready()
  text = profile_summary.profile_steps(lambda: f(a).block_until_ready(), 2, str(tmp_path))
  assert text.startswith('profile (') and 'top kernels' in text, text


def test_compare_peer_commands_follow_the_interface():
  """The commands compare launches are the ones the peers implement."""
  assert compare.peer_command('pytorch-compile', 'cpu-tiny', 7, 'r.jsonl', python='py') == [
      'py', '-m', 'benchmarks.peers.pytorch', '--config', 'cpu-tiny', '--mode', 'compile',
      '--steps', '7', '--json', 'r.jsonl']
  assert compare.peer_command('maxtext', 'moe-small', 7, 'r.jsonl', python='py') == [
      'py', '-m', 'benchmarks.peers.maxtext', '--config', 'moe-small', '--steps', '7',
      '--json', 'r.jsonl']


def test_decode_bytes_match_the_parameter_count():
  """A decode step reads every parameter except the embedding table (only the batch's rows);
  an MoE layer with many tokens touches every expert, with one token only top-k of them."""
  dense = get_config('cpu-tiny')
  n = num_params(model_config(dense))
  d, v = dense['d_model'], dense['vocab_size']
  moved = decode.bytes_per_decode_step(dense, 3, 100, param_bytes=4, cache_bytes=2)
  assert moved['weights'] == 4 * (n - v * d + 3 * d)
  assert moved['kv_cache'] == 2 * 2 * dense['num_layers'] * 3 * 256 * 100
  moe = get_config('moe-small')
  n = num_params(model_config(moe))
  many = decode.bytes_per_decode_step(moe, 10_000, 1, param_bytes=1, cache_bytes=1)
  assert many['weights'] == pytest.approx(n - v * d + 10_000 * d)
  one = decode.bytes_per_decode_step(moe, 1, 1, param_bytes=1, cache_bytes=1)
  unused = 6 * 3 * d * moe['mlp_dim'] * moe['num_layers']  # 8 experts, top-2
  assert one['weights'] == pytest.approx(n - v * d + d - unused)


@pytest.mark.slow  # a benchmark harness end to end; the training harness runs by default
def test_decode_harness_smoke():
  """The decode harness runs generate on a micro config and reports consistent rates."""
  rows = decode.run(MICRO, name='micro', batches=(2,), prefill=8, decode=4, repeats=1,
                    bandwidth_seconds=0.05, bandwidth_mib=16, log=lambda line: None)
  (row,) = rows
  assert row['decode_tokens_per_s'] == pytest.approx(2 / row['decode_step_s'])
  assert row['prefill_tokens_per_s'] == pytest.approx(2 * 8 / row['prefill_s'])
  assert row['fraction_of_bound'] == pytest.approx(
      row['decode_tokens_per_s'] / row['bound_decode_tokens_per_s'])
  assert row['bandwidth_gbs'] > 0 and np.isfinite(row['fraction_of_bound'])


@pytest.mark.slow  # a benchmark harness end to end; the training harness runs by default
def test_speculative_decode_harness_smoke(tmp_path):
  """The speculative-decoding harness times plain and prompt-lookup decoding on a micro
  config, with consistent rates and the same greedy tokens."""
  from benchmarks import speculative_decode  # noqa: PLC0415
  path = tmp_path / 'spec.jsonl'
  rows = speculative_decode.run(MICRO, name='micro', drafts=(2,), prompt_chars=12, repeat=2,
                                decode=6, repeats=1, json_path=str(path),
                                log=lambda line: None)
  assert [r['drafter'] for r in rows] == ['none', 'prompt_lookup']
  assert len(path.read_text().splitlines()) == 2
  for row in rows:
    assert row['decode_tokens_per_s'] == pytest.approx(5 / row['decode_s'])
    assert row['same_tokens']
  assert rows[0]['speedup'] == 1.0 and rows[0]['acceptance_rate'] is None
  assert rows[1]['proposed_draft_tokens'] > 0
  assert rows[1]['speedup'] == pytest.approx(rows[0]['decode_s'] / rows[1]['decode_s'])


@pytest.mark.slow  # a benchmark harness end to end; the training harness runs by default
def test_speculative_decode_mtp_harness_smoke():
  """With MTP, the harness trains the tiny DeepSeek V3 a few steps and times MTP drafts too,
  with the same greedy tokens as plain decoding."""
  from benchmarks import speculative_decode  # noqa: PLC0415
  rows = speculative_decode.run(None, name='mtp', drafts=(1,), prompt_chars=12, repeat=2,
                                decode=6, repeats=1, mtp_steps=2, log=lambda line: None)
  assert [r['drafter'] for r in rows] == ['none', 'prompt_lookup', 'mtp']
  assert all(r['same_tokens'] and r['train_steps'] == 2 for r in rows)
  assert rows[2]['proposed_draft_tokens'] > 0
  assert np.isfinite(rows[0]['final_mtp_loss'])


@pytest.mark.slow  # a benchmark harness end to end; the training harness runs by default
def test_speculative_engine_harness_smoke(tmp_path):
  """The harness's engine mode times a warm engine without and with n-gram speculation and
  with the model drafting for itself on a micro config, with consistent rates, counted drafts
  (every draft model's kept) and the same greedy tokens."""
  from benchmarks import speculative_decode  # noqa: PLC0415
  path = tmp_path / 'spec.jsonl'
  rows = speculative_decode.run_engine(MICRO, name='micro', drafts=(2,), prompt_chars=12,
                                       repeat=2, decode=6, repeats=1, json_path=str(path),
                                       draft_model='self', log=lambda line: None)
  assert [r['drafter'] for r in rows] == ['none', 'prompt_lookup', 'draft:self']
  assert len(path.read_text().splitlines()) == 3
  assert rows[2]['acceptance_rate'] == 1.0 and rows[2]['num_draft_tokens'] == 2
  for row in rows:
    assert row['decode_tokens_per_s'] == pytest.approx(5 / row['decode_s'])
    assert row['same_tokens'] and row['warmup_s'] > 0
  assert rows[0]['speedup'] == 1.0 and rows[0]['acceptance_rate'] is None
  assert rows[1]['proposed_draft_tokens'] > 0
  assert rows[1]['speedup'] == pytest.approx(rows[0]['decode_s'] / rows[1]['decode_s'])


@pytest.mark.slow  # a benchmark harness end to end; the training harness runs by default
def test_rollouts_harness_smoke():
  """The rollout harness times both samplers on a micro config with consistent rates."""
  from benchmarks import rollouts  # noqa: PLC0415
  rows = rollouts.run(MICRO, name='micro', num_prompts=2, group=2, max_new_tokens=4,
                      prompt_len=(4, 8), eos_fraction=0.05, rollouts=1, warmup=0,
                      log=lambda line: None)
  assert [r['sampler'] for r in rows] == ['generate', 'engine']
  for row in rows:
    assert 4 <= row['completion_tokens'] <= 2 * 2 * 4
    assert row['completion_tokens_per_s'] == pytest.approx(
        row['completion_tokens'] / row['rollout_s'])
    assert row['mfu'] == pytest.approx(row['tflops'] / row['ceiling_tflops'])
  assert rows[1]['engine_compiles'] >= 1


class _FakeClock:
  """A clock that only moves when the loop sleeps or a batch runs."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now

  def sleep(self, seconds):
    self.now += seconds


def test_serving_load_closed_loop_batches_and_statistics():
  """Closed loop: a client sends its next request when the previous one completes; the batch
  server takes full batches (or what waits when nothing else can arrive); the statistics
  follow from the recorded times."""
  workload = serving_load.make_workload(5, 100, (3, 6), (2, 4), seed=1)
  assert [len(p) for p in serving_load.same_lengths(workload, 100, 2).prompts] == [
      len(p) for p in workload.prompts]
  clock, groups = _FakeClock(), []

  def run_batch(indices):  # 0.25 s to the first token, 1 s in all
    groups.append(indices)
    first = clock.now + 0.25
    clock.now += 1.0
    return first, [[7] * workload.output_lens[i] for i in indices]

  arrivals = serving_load.Arrivals(5, concurrency=2)
  records = serving_load.serve_in_batches(workload, arrivals, 2, run_batch, clock, clock.sleep)
  assert groups == [[0, 1], [2, 3], [4]]  # the last batch runs alone: nothing else can come
  assert [r.arrival for r in records] == [0, 0, 1, 1, 2]
  assert [r.last for r in records] == [1, 1, 2, 2, 3]
  stats = serving_load.summarize(records)
  assert stats['output_tokens'] == sum(workload.output_lens)
  assert stats['output_tokens_per_s'] == pytest.approx(sum(workload.output_lens) / 3)
  assert stats['ttft_p50_s'] == pytest.approx(0.25) and stats['latency_p99_s'] == 1.0
  tpot = sorted(0.75 / (n - 1) for n in workload.output_lens)
  assert stats['tpot_p50_s'] == pytest.approx(tpot[2])

  clock.now = 10.0  # open loop: Poisson arrivals one at a time, in index order
  poisson = serving_load.Arrivals(5, rate=2.0, seed=3)
  groups.clear()
  records = serving_load.serve_in_batches(workload, poisson, 1, run_batch, clock, clock.sleep)
  assert groups == [[0], [1], [2], [3], [4]]
  arrived = [r.arrival for r in records]
  assert arrived == sorted(arrived) and arrived[0] == 10.0
  assert all(r.first >= r.arrival for r in records)
  assert serving_load.percentile([1, 2, 3, 4], 50) == 2.5


@pytest.mark.slow  # a benchmark harness end to end; the training harness runs by default
def test_serving_harness_smoke(tmp_path):
  """The serving benchmark on a micro config: the engine and generate serve every request with
  exactly its output length, greedy engine tokens equal generate's, nothing compiles in the
  timed run, and a transformers run that cannot start is a row saying why."""
  path = tmp_path / 'serving.jsonl'
  rows = serving.run(MICRO, name='micro', systems=('engine', 'single', 'hf-single'),
                     num_requests=4, concurrency=2, prompt_lens=(4, 6), output_lens=(2, 4),
                     batch_size=2, max_batch=2, token_budget=16, page_size=4,
                     checkpoint=str(tmp_path / 'ckpt'), hf_python_path=str(tmp_path / 'none'),
                     json_path=str(path), log=lambda line: None)
  saved = [json.loads(line) for line in path.read_text().splitlines()]
  assert [r['system'] for r in saved] == ['engine', 'single', 'hf-single']
  by = {r['system']: r for r in saved}
  assert 'no such file' in by['hf-single']['error'].lower()
  for name in ('engine', 'single'):
    r = by[name]
    assert r['kind'] == 'serving' and r['num_requests'] == 4 and r['compiles_timed'] == 0
    assert r['output_tokens_per_s'] == pytest.approx(r['output_tokens'] / r['duration_s'])
    assert 0 < r['ttft_p50_s'] <= r['ttft_p99_s'] <= r['latency_p99_s']
    assert r['tpot_p50_s'] > 0 and r['same_tokens'] == 4
  assert by['single']['vs_single'] == 1.0
  assert by['engine']['engine_step_compiles'] <= by['engine']['engine_max_compiles']
  buckets = by['engine']['engine_steps_by_shape']  # every step's time, by its bucket
  assert sum(b['steps'] for b in buckets) == by['engine']['engine_steps']
  assert sum(b['seconds'] for b in buckets) == pytest.approx(
      by['engine']['engine_step_ms'] * by['engine']['engine_steps'] / 1e3)
  assert [b['seconds'] for b in buckets] == sorted((b['seconds'] for b in buckets),
                                                   reverse=True)
  expected = sum(serving_load.make_workload(4, MICRO['vocab_size'], (4, 6), (2, 4)).output_lens)
  assert rows[0]['output_tokens'] == by['single']['output_tokens'] == expected


def test_hf_decode_step_times_and_agreement():
  """One decode step is the 1-token/(decode + 1)-token difference over decode; agreement counts
  the leading tokens two greedy runs share."""
  times = hf_decode.step_times(4, short_s=0.5, full_s=2.5, decode=10)
  assert times['decode_step_s'] == pytest.approx(0.2)
  assert times['decode_tokens_per_s'] == pytest.approx(20.0)
  assert times['prefill_s'] == pytest.approx(0.3)
  assert hf_decode.agreement([5, 6, 7, 8], [5, 6, 9, 8]) == 2
  assert hf_decode.agreement([1, 2], [1, 2, 3]) == 2
  assert hf_decode.agreement([], [1]) == 0


@pytest.mark.slow  # a benchmark harness end to end; the training harness runs by default
def test_hf_decode_loads_the_peer_checkpoint_and_times_both(monkeypatch, tmp_path):
  """The launcher gives the torch side the run's settings, loads the checkpoint it saved with
  from_pretrained, times maxnnx on the same prompts and reports both (torch side faked here
  with a committed transformers checkpoint)."""
  import shutil

  from conftest import FIXTURES

  with open(FIXTURES + '/llama/config.json') as f:
    llama = json.load(f)
  monkeypatch.setitem(BENCH_CONFIGS, 'fixture-llama', dict(
      d_model=llama['hidden_size'], num_layers=llama['num_hidden_layers'],
      num_heads=llama['num_attention_heads'], num_kv_heads=llama['num_key_value_heads'],
      head_dim=llama['head_dim'], mlp_dim=llama['intermediate_size'],
      vocab_size=llama['vocab_size'], seq=16, batch=2, device='cpu'))
  seen = {}
  hf_tokens = [3, 1, 4, 1, 5]

  def fake_torch_side(cfg, spec, python):
    seen.update(spec, cfg=cfg, python=python)
    shutil.copytree(FIXTURES + '/llama', spec['checkpoint'])
    return {'rows': [{'batch': b, 'short_s': 0.1, 'full_s': 0.5} for b in spec['batches']],
            'first_row_tokens': hf_tokens, 'device_type': 'cpu', 'device_name': 'cpu',
            'threads': 1, 'versions': {'torch': 'fake', 'transformers': 'fake'}}

  monkeypatch.setattr(hf_decode, 'run_hf', fake_torch_side)
  out = tmp_path / 'decode.jsonl'
  rows = hf_decode.run('fixture-llama', batches=(1, 3), prefill=6, decode=4, repeats=1,
                       python='/fake/python', json_path=str(out), log=lambda line: None)
  assert seen['python'] == '/fake/python' and seen['batches'] == [1, 3]
  assert (seen['decode'], seen['dtype'], seen['max_positions']) == (4, 'float32', 11)
  assert [(r['framework'], r['batch']) for r in rows] == [
      ('maxnnx', 1), ('transformers', 1), ('maxnnx', 3), ('transformers', 3)]
  hf_row = rows[1]
  assert hf_row['decode_step_s'] == pytest.approx(0.1) and hf_row['decode_tokens_per_s'] == 10
  model = maxnnx.from_pretrained(FIXTURES + '/llama')
  rng = np.random.default_rng(0)
  first_prompt = rng.integers(0, llama['vocab_size'], (1, 6))  # the launcher's first draw
  ours = maxnnx.generate(model, first_prompt, 5, eos_ids=None).tokens[0].tolist()
  assert rows[0]['greedy_tokens_agreeing'] == f'{hf_decode.agreement(ours, hf_tokens)}/5'
  assert [json.loads(line)['framework'] for line in out.read_text().splitlines()] == [
      r['framework'] for r in rows]
  assert hf_decode.format_table(rows).count('\n') == 2  # header + one line per batch


def test_hf_decode_refuses_moe_configs():
  """The transformers peer builds dense Llamas only; an MoE config is a clear error."""
  with pytest.raises(ValueError, match='MoE config'):
    hf_decode.run('moe-small', python='/unused')


def test_collective_census_counts_what_a_sharded_program_exchanges():
  """A gradient summed over devices (all-reduce) and gathered whole (all-gather) are found,
  each once, with their result bytes per device."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from benchmarks.collectives import census, type_bytes
  assert type_bytes('(f32[8,128]{1,0}, bf16[4]{0})') == 8 * 128 * 4 + 4 * 2
  mesh = jax.make_mesh((8,), ('d',))
  w = jax.ShapeDtypeStruct((64, 32), np.float32, sharding=NamedSharding(mesh, P('d', None)))
  x = jax.ShapeDtypeStruct((16, 64), np.float32, sharding=NamedSharding(mesh, P('d', None)))

  def step(w, x):  # rows of x on each device: partial gradients of the whole w, summed
    return jax.grad(lambda w: (x @ w).sum())(w)

  out = NamedSharding(mesh, P())
  counts = census(jax.jit(step, out_shardings=out).lower(w, x).compile().as_text())
  whole = {'count': 1, 'bytes': 64 * 32 * 4, 'count_in_loops': 0, 'bytes_in_loops': 0}
  assert counts == {'all-gather': whole, 'all-reduce': whole}
  replicated = NamedSharding(mesh, P())
  w1 = jax.ShapeDtypeStruct((64, 32), np.float32, sharding=replicated)
  x1 = jax.ShapeDtypeStruct((16, 64), np.float32, sharding=replicated)
  assert census(jax.jit(step).lower(w1, x1).compile().as_text()) == {}

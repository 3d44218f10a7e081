"""Training throughput of maxnnx on one benchmark config: step time, tokens/s, TFLOP/s, MFU.

::

  python -m benchmarks.train_throughput --config cpu-tiny
  python -m benchmarks.train_throughput --config gpu-1b --steps 30 --json results.jsonl
  python -m benchmarks.train_throughput --config cpu-tiny --stall-check   # + input/checkpoint

Builds a maxnnx model with exactly the config's shapes (``benchmarks.model``), trains it with
``maxnnx.train.Trainer`` on synthetic tokens (the config's batch and sequence length), and
reports:

* the median step time (and p10/p90) over ``--steps`` steps after ``--warmup`` steps; every
  step is timed from the call to the moment its metrics reached the host and the new state is
  ready (``block_until_ready``), with no other host sync inside;
* tokens/s (= batch * seq / median step time), per device, TFLOP/s per device from
  ``benchmarks.configs.train_flops_per_token`` (the count every peer uses);
* MFU against a matmul ceiling measured in this process right before and right after the timed
  steps (the larger of the two; bf16 inputs with float32 accumulation for bfloat16 runs), and
  against the published peak where ``maxnnx.train.flops`` knows the device;
* compile time (lower + compile of the train step, measured alone) and peak memory.

``--stall-check`` then times the real loop (``Trainer.fit``, metrics fetched once per window)
with synthetic tokens, with the shipped corpus through the grain pipeline and through token
windows, and with checkpoints every ``--checkpoint-every`` steps saved asynchronously and
synchronously, so an input or checkpoint stall shows as a slower step.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np

from benchmarks import measure, results
from benchmarks.configs import BENCH_CONFIGS, get_config, train_flops_per_token
from benchmarks.model import model_config
from maxnnx.config import MeshConfig
from maxnnx.host_memory import host_memory_status
from maxnnx.models.counting import num_params
from maxnnx.train import TrainConfig, Trainer
from maxnnx.train.trainer import synthetic_batches

REMAT_POLICIES = ('none', 'minimal', 'save_dot_except_mlp', 'save_qkv_proj', 'save_out_proj',
                  'save_attention_out', 'full')
# Measured on cpu-tiny (see benchmarks/RESULTS.md): bfloat16 compute trained about 1.3x faster
# than float32 on a Zen 5 CPU with AVX-512 BF16, so it is the CPU default too. Recheck on other
# CPUs with --dtype float32.
CPU_DEFAULT_DTYPE = 'bfloat16'


def default_dtype() -> str:
  """The compute dtype a run uses when ``--dtype`` is not given (the faster one here)."""
  return CPU_DEFAULT_DTYPE if measure.on_cpu() else 'bfloat16'


def _fmt(value, spec: str = '.3g', none: str = 'n/a') -> str:
  return none if value is None else format(value, spec)


def _timed_steps(trainer: Trainer, batches: list[dict], count: int) -> list[float]:
  """Seconds of each of ``count`` synced optimizer steps (batches cycle through ``batches``)."""
  times = []
  for i in range(count):
    batch = batches[i % len(batches)]
    start = time.perf_counter()
    trainer.step(batch)  # places the batch, runs the compiled step, fetches its metrics
    jax.block_until_ready(trainer._state)  # noqa: SLF001 (the new parameters, not only the loss)
    times.append(time.perf_counter() - start)
  return times


def run(cfg: dict, *, name: str, dtype: str | None = None, steps: int = 20, warmup: int = 3,
        remat: str = 'none', scan: bool = False, attention_impl: str = 'auto',
        ragged_dot_impl: str | None = None,
        ceiling_seconds: float = 1.0, ceiling_size: int | None = None,
        json_path: str | None = None, stall_check: bool = False, stall_steps: int = 10,
        checkpoint_every: int = 5, mesh: MeshConfig | None = None,
        quantization: str = 'none', param_dtype: str = 'float32', mu_dtype: str | None = None,
        optimizer_offload: bool = False, profile_dir: str | None = None, profile_steps: int = 3,
        log=print) -> dict:
  """Benchmark the train step of config ``cfg`` (a dict like ``BENCH_CONFIGS[name]``).

  Returns the result record (see :mod:`benchmarks.results`), also appended to ``json_path``.
  With ``stall_check`` the record gets a ``loop`` entry: seconds per step of
  ``Trainer.fit`` per input/checkpoint mode. ``mesh`` defaults to data parallelism over every
  device.
  """
  if steps < 1 or warmup < 0:
    raise ValueError(f'--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}')
  dtype = dtype or default_dtype()
  mcfg = model_config(cfg, dtype=dtype, remat=remat, scan=scan, attention_impl=attention_impl,
                      ragged_dot_impl=ragged_dot_impl, param_dtype=param_dtype)
  batch, seq = cfg['batch'], cfg['seq']
  tcfg = TrainConfig(steps=max(warmup + steps, 1), global_batch_size=batch, seq_len=seq,
                     log_every=1000, learning_rate=1e-4, warmup_steps=0,
                     schedule='constant', mesh=mesh or MeshConfig(),
                     router_aux_loss_coef=0.01 if mcfg.moe.num_experts else 0.0,
                     quantization=quantization, mu_dtype=mu_dtype,
                     optimizer_memory_host_offload=optimizer_offload)
  device = measure.device_description()
  log(f'{name}: {num_params(mcfg):,} parameters, batch {batch} x seq {seq}, {dtype}, '
      f'remat {remat}, scan {scan}, attention {attention_impl}, quantization {quantization}, '
      f'params {param_dtype}, mu {mu_dtype or param_dtype}'
      f"{', optimizer on host' if optimizer_offload else ''}; {device}")
  trainer = Trainer(mcfg, tcfg)
  compile_s = trainer.compile(verbose=False)['compile_seconds']
  source = synthetic_batches(mcfg.vocab_size, batch, seq, seed=0)
  batches = [next(source) for _ in range(4)]
  _timed_steps(trainer, batches, max(warmup, 1))  # first call also initialises the parameters

  ceiling_before = measure.matmul_ceiling_tflops(dtype, ceiling_size, ceiling_seconds)
  times = _timed_steps(trainer, batches, steps)
  ceiling_after = measure.matmul_ceiling_tflops(dtype, ceiling_size, ceiling_seconds)
  ceiling = max(ceiling_before, ceiling_after)
  losses = [trainer.history[0]['loss'], trainer.history[-1]['loss']]
  if not all(math.isfinite(x) for x in losses):
    raise RuntimeError(f'{name}: the loss is not finite ({losses}); the timing means nothing.')

  stats = measure.percentiles(times)
  memory_gib, memory_kind = measure.peak_memory()
  nominal = measure.nominal_peak_tflops()
  flops_per_token = train_flops_per_token(cfg)
  record = results.make_result(
      framework='maxnnx', config=name, device=device, num_devices=trainer.mesh.size,
      dtype=dtype, batch=batch, seq=seq, steps_timed=steps, step_time_s=stats['median'],
      flops_per_token=flops_per_token, ceiling_tflops=ceiling, compile_s=compile_s,
      peak_memory_gib=memory_gib, versions=measure.versions(),
      step_time_p10_s=stats['p10'], step_time_p90_s=stats['p90'],
      ceiling_tflops_before=ceiling_before, ceiling_tflops_after=ceiling_after,
      nominal_peak_tflops=nominal, peak_memory_kind=memory_kind,
      remat=remat, scan=scan, attention_impl=attention_impl, quantization=quantization,
      param_dtype=param_dtype, mu_dtype=mu_dtype or param_dtype,
      optimizer_offload=optimizer_offload,
      ragged_dot_impl=mcfg.runtime.ragged_dot_impl, loss_first_last=losses,
      host_memory=host_memory_status())
  if nominal:
    record['mfu_nominal'] = record['tflops_per_device'] / nominal
  log(format_table(record))
  if profile_dir:
    from benchmarks.profile_summary import profile_steps as trace  # noqa: PLC0415
    record['profile'] = trace(lambda: _timed_steps(trainer, batches, 1), profile_steps,
                              profile_dir, stats['median'])
    log(record['profile'])
  if stall_check:
    record['loop'] = stall_table(trainer, mcfg, tcfg, stall_steps, checkpoint_every, log)
  trainer.close()
  if json_path:
    results.append_result(json_path, record)
    log(f'appended to {json_path}')
  return record


def format_table(r: dict) -> str:
  """The human-readable summary of one result record."""
  nominal = (f"{_fmt(r.get('mfu_nominal'), '.1%')} of {r['nominal_peak_tflops']:.0f} TFLOP/s "
             'nominal' if r.get('nominal_peak_tflops') else 'n/a (no published peak for a CPU)')
  rows = [
      ('step time (median)', f"{r['step_time_s'] * 1e3:.1f} ms over {r['steps_timed']} steps "
       f"(p10 {r['step_time_p10_s'] * 1e3:.1f}, p90 {r['step_time_p90_s'] * 1e3:.1f})"),
      ('tokens/s', f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s_per_device']:,.0f} per device, "
       f"{r['num_devices']} device(s))"),
      ('TFLOP/s per device', f"{r['tflops_per_device']:.4g}"),
      ('matmul ceiling', f"{r['ceiling_tflops']:.4g} TFLOP/s ({r['dtype']}; before "
       f"{r['ceiling_tflops_before']:.4g}, after {r['ceiling_tflops_after']:.4g})"),
      ('MFU (measured ceiling)', _fmt(r['mfu'], '.1%')),
      ('MFU (nominal peak)', nominal),
      ('compile', f"{r['compile_s']:.1f} s (lower + compile of the train step)"),
      ('peak memory', f"{_fmt(r['peak_memory_gib'], '.2f')} GiB ({r['peak_memory_kind']})"),
      ('loss first/last', ' -> '.join(f'{x:.3f}' for x in r['loss_first_last'])),
  ]
  if 'host_memory' in r:
    kept = r['host_memory'].get('applied') and r['host_memory'].get('before_backend')
    rows.append(('host allocator', 'freed memory kept mapped (maxnnx.host_memory)' if kept
                 else 'glibc defaults'))
  width = max(len(k) for k, _ in rows)
  return '\n'.join(f'  {k:<{width}}  {v}' for k, v in rows)


# -- the real loop: input pipeline and checkpoint stalls ------------------------------------------

def _corpus_sources(mcfg, batch: int, seq: int, workdir: str) -> dict:
  """The shipped corpus as the grain pipeline and as token windows (a small BPE tokenizer)."""
  from maxnnx.data import (  # noqa: PLC0415
    DEFAULT_CORPUS,
    DataConfig,
    SentencePieceTokenizer,
    TokenWindows,
    make_pipeline,
    train_sentencepiece,
  )
  from maxnnx.data.text import read_text  # noqa: PLC0415
  tokenizer = SentencePieceTokenizer(train_sentencepiece(
      DEFAULT_CORPUS, os.path.join(workdir, 'tokenizer'), min(2048, mcfg.vocab_size)))
  pipeline = make_pipeline(DataConfig.from_string(DEFAULT_CORPUS), tokenizer, batch_size=batch,
                           seq_len=seq, seed=0, vocab_size=mcfg.vocab_size)
  tokens = np.asarray(tokenizer.encode(read_text(DEFAULT_CORPUS)), np.int32)
  return {'grain pipeline (shipped corpus)': pipeline,
          'token windows (shipped corpus)': TokenWindows(tokens, seq, batch, seed=0)}


def _loop_seconds(trainer: Trainer, base: TrainConfig, steps: int, data, *,
                  checkpoint_dir: str | None = None, async_save: bool = True,
                  checkpoint_every: int = 0) -> dict:
  """Seconds per step of ``Trainer.fit`` over ``steps`` steps (``step_time_s``), how long each
  checkpoint save blocked the loop (``save_blocked_s``, median) and how long ``close()`` then
  waited for writes still in flight (``close_wait_s``)."""
  from maxnnx.checkpoint.manager import CheckpointManager  # noqa: PLC0415
  trainer.close()
  trainer.data = data
  trainer.config = dataclasses.replace(base, log_every=steps, checkpoint_dir=checkpoint_dir,
                                       checkpoint_every=checkpoint_every, keep_checkpoints=2)
  if checkpoint_dir:
    # The Trainer always saves asynchronously; the synchronous case needs its own manager.
    trainer._checkpoints = CheckpointManager(checkpoint_dir, keep=2,  # noqa: SLF001
                                             async_save=async_save)
  quiet = lambda line: None  # noqa: E731
  trainer.fit(2, log=quiet)  # first batch of a new source, first save: not steady state
  jax.block_until_ready(trainer._state)  # noqa: SLF001
  if checkpoint_dir:
    trainer._checkpoints.wait()  # noqa: SLF001 (the warm-up's save must not overlap the timing)
  blocked = []
  save = trainer.save_checkpoint

  def timed_save():
    start = time.perf_counter()
    out = save()
    blocked.append(time.perf_counter() - start)
    return out

  trainer.save_checkpoint = timed_save  # fit() calls it through the instance
  try:
    start = time.perf_counter()
    trainer.fit(steps, log=quiet)
    jax.block_until_ready(trainer._state)  # noqa: SLF001
    per_step = (time.perf_counter() - start) / steps
  finally:
    del trainer.save_checkpoint
  start = time.perf_counter()
  trainer.close()
  return {'step_time_s': per_step, 'saves': len(blocked),
          'save_blocked_s': float(np.median(blocked)) if blocked else None,
          'close_wait_s': time.perf_counter() - start}


def stall_table(trainer: Trainer, mcfg, base: TrainConfig, steps: int, checkpoint_every: int,
                log=print) -> dict:
  """Time ``Trainer.fit`` with each input source and checkpoint mode; print and return
  ``{mode: seconds per step}``."""
  batch, seq = base.global_batch_size, base.seq_len
  workdir = tempfile.mkdtemp(prefix='maxnnx-bench-')
  try:
    sources = _corpus_sources(mcfg, batch, seq, workdir)
    loader = {}
    for label, source in sources.items():
      start = time.perf_counter()
      for _ in range(steps):
        source.next() if hasattr(source, 'next') and not hasattr(source, '__next__') \
            else next(source)
      loader[label] = (time.perf_counter() - start) / steps
    synthetic = synthetic_batches(mcfg.vocab_size, batch, seq, seed=1)
    rows = {'synthetic tokens': _loop_seconds(trainer, base, steps, synthetic)}
    for label, source in sources.items():
      rows[label] = _loop_seconds(trainer, base, steps, source)
    for async_save in (True, False):
      label = f"synthetic + {'async' if async_save else 'sync'} checkpoint every " \
              f'{checkpoint_every} steps'
      rows[label] = _loop_seconds(trainer, base, steps, synthetic,
                                  checkpoint_dir=os.path.join(workdir, f'ckpt-{async_save}'),
                                  async_save=async_save, checkpoint_every=checkpoint_every)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  reference = rows['synthetic tokens']['step_time_s']
  width = max(len(k) for k in rows)
  log(f'\n  the real loop (Trainer.fit, {steps} steps, metrics fetched once per window):')
  log(f"  {'mode':<{width}}  {'s/step':>8}  {'tokens/s':>9}  {'vs synthetic':>12}  "
      'each save blocked  close() waited')
  for label, row in rows.items():
    per_step = row['step_time_s']
    saves = ('' if not row['saves'] else
             f"{row['save_blocked_s']:.2f} s x {row['saves']}")
    log(f'  {label:<{width}}  {per_step:8.4f}  {batch * seq / per_step:9,.0f}  '
        f"{per_step / reference - 1:+12.1%}  {saves:>17}  {row['close_wait_s']:.2f} s")
  for label, seconds in loader.items():
    log(f'  {label} alone (no training): {seconds * 1e3:.2f} ms per batch')
  return {**rows, 'loader_alone_s_per_batch': loader}


def main(argv: list[str] | None = None) -> int:
  """Command line entry point."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', required=True, choices=sorted(BENCH_CONFIGS))
  parser.add_argument('--device', choices=('cpu', 'gpu'), default=None,
                      help='platform to run on (default: JAX default backend)')
  parser.add_argument('--steps', type=int, default=20, help='timed steps (default 20)')
  parser.add_argument('--warmup', type=int, default=3, help='untimed steps after compile')
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default=None,
                      help=f'compute dtype (default: {CPU_DEFAULT_DTYPE} on CPU, bfloat16 on GPU)')
  parser.add_argument('--remat', choices=REMAT_POLICIES, default='none')
  parser.add_argument('--scan', action=argparse.BooleanOptionalAction, default=False,
                      help='scan the layer stack (default: a list of layers)')
  parser.add_argument('--attention-impl', default='auto',
                      help='attention strategy (default auto: cudnn on GPU, xla_flash elsewhere)')
  parser.add_argument('--ragged-dot-impl', default=None,
                      help='MoE grouped-matmul strategy (default: tiled)')
  parser.add_argument('--quantization', choices=('none', 'int8', 'fp8'), default='none',
                      help='quantization-aware training through qwix (default none)')
  parser.add_argument('--param-dtype', choices=('float32', 'bfloat16'), default='float32',
                      help='dtype the parameters (and, unless --mu-dtype, the moments) live in')
  parser.add_argument('--mu-dtype', choices=('float32', 'bfloat16'), default=None,
                      help="AdamW's first moment dtype (default: the parameters')")
  parser.add_argument('--optimizer-offload', action='store_true',
                      help="keep the optimizer's moments in host memory between steps")
  parser.add_argument('--profile', default=None, metavar='DIR',
                      help='trace --profile-steps more steps into DIR and print where the '
                           'kernels spend the step')
  parser.add_argument('--profile-steps', type=int, default=3)
  parser.add_argument('--ceiling-seconds', type=float, default=1.0,
                      help='seconds each matmul-ceiling measurement runs (before and after)')
  parser.add_argument('--json', default=None, help='append the result line to this JSONL file')
  parser.add_argument('--stall-check', action='store_true',
                      help='also time Trainer.fit with the real input pipeline and checkpoints')
  parser.add_argument('--stall-steps', type=int, default=10)
  parser.add_argument('--checkpoint-every', type=int, default=5)
  args = parser.parse_args(argv)
  if args.device:
    jax.config.update('jax_platforms', {'gpu': 'cuda', 'cpu': 'cpu'}[args.device])
  run(get_config(args.config), name=args.config, dtype=args.dtype, steps=args.steps,
      warmup=args.warmup, remat=args.remat, scan=args.scan, attention_impl=args.attention_impl,
      ragged_dot_impl=args.ragged_dot_impl,
      ceiling_seconds=args.ceiling_seconds, json_path=args.json, stall_check=args.stall_check,
      stall_steps=args.stall_steps, checkpoint_every=args.checkpoint_every,
      quantization=args.quantization, param_dtype=args.param_dtype, mu_dtype=args.mu_dtype,
      optimizer_offload=args.optimizer_offload, profile_dir=args.profile,
      profile_steps=args.profile_steps)
  return 0


if __name__ == '__main__':
  sys.exit(main())

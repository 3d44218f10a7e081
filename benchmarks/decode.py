"""Decoding speed of ``maxnnx.generate`` against the memory-bandwidth bound.

::

  python -m benchmarks.decode --config cpu-tiny                      # batches 1 and 32
  python -m benchmarks.decode --config cpu-medium --batch 1 --prefill 128 --decode 32

For each batch size it times ``generate`` (greedy, no early stop) with ``--decode`` + 1 new
tokens and with 1 new token after a ``--prefill``-token prompt; the difference over ``--decode``
is the time of one decode step, the rest is the prefill. Each is the median of ``--repeats``
calls after a warm-up call (which compiles).

A decode step is bound by memory bandwidth: it reads every weight once (the embedding table
only for the batch's rows; an MoE layer only the experts its tokens pick, on average
``E * (1 - (1 - k/E)^B)`` of them under uniform routing) and the keys and values of the context
so far (on average ``prefill + (decode + 1) / 2`` positions). The ceiling is
``bandwidth / bytes per step`` steps per second, with the bandwidth measured in this process
before and after the timings: the largest of a reduction over a large array and an in-place
copy of it (on CPU XLA's reduction does not reach the copy's rate). The report gives decode
tokens/s and the fraction of that ceiling, and the prefill's tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from flax import nnx

from benchmarks import measure, results
from benchmarks.configs import BENCH_CONFIGS, get_config
from benchmarks.model import model_config
from maxnnx.inference import generate
from maxnnx.models.counting import num_params
from maxnnx.models.transformer import Transformer


def bytes_per_decode_step(cfg: dict, batch: int, context: float, *, param_bytes: int,
                          cache_bytes: int) -> dict[str, float]:
  """Bytes one decode step must read: ``weights`` and ``kv_cache`` (see the module doc)."""
  d, v, layers = cfg['d_model'], cfg['vocab_size'], cfg['num_layers']
  q_dim, kv_dim = cfg['num_heads'] * cfg['head_dim'], cfg['num_kv_heads'] * cfg['head_dim']
  attention = d * (q_dim + 2 * kv_dim) + q_dim * d
  experts, top_k = cfg.get('num_experts', 0), cfg.get('num_experts_per_tok', 0)
  expert = 3 * d * cfg['mlp_dim']
  if experts:
    touched = experts * (1 - (1 - top_k / experts) ** batch)
    mlp = d * experts + touched * expert
  else:
    mlp = expert
  weights = layers * (attention + mlp + 2 * d) + d + d * v + batch * d  # + lm_head, used rows
  kv_cache = 2 * layers * batch * kv_dim * context
  return {'weights': weights * param_bytes, 'kv_cache': kv_cache * cache_bytes}


def median_seconds(fn, repeats: int) -> float:
  """Median wall seconds of ``repeats`` calls of ``fn`` after one untimed (compiling) call."""
  fn()  # compile and warm
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def run(cfg: dict, *, name: str, batches=(1, 32), prefill: int = 512, decode: int = 128,
        dtype: str | None = None, repeats: int = 3, bandwidth_seconds: float = 1.0,
        bandwidth_mib: int | None = None,
        json_path: str | None = None, log=print) -> list[dict]:
  """Benchmark ``generate`` on config ``cfg``; returns one dict per batch size."""
  if prefill < 1 or decode < 1 or repeats < 1:
    raise ValueError('--prefill, --decode and --repeats must be >= 1')
  dtype = dtype or ('float32' if measure.on_cpu() else 'bfloat16')
  mcfg = model_config(cfg, dtype=dtype, max_length=prefill + decode + 1)
  model = Transformer(mcfg, rngs=nnx.Rngs(0))
  param_bytes = np.dtype(mcfg.runtime.param_dtype).itemsize
  cache_bytes = np.dtype(mcfg.jnp_dtype()).itemsize
  device = measure.device_description()
  log(f'{name}: {num_params(mcfg):,} parameters ({mcfg.runtime.param_dtype}), '
      f'compute/cache {dtype}, prefill {prefill}, decode {decode}; {device}')
  bandwidth_before = measure.memory_bandwidth_gbs(bandwidth_mib, bandwidth_seconds)
  rng = np.random.default_rng(0)
  timings = []
  for batch in batches:
    prompts = rng.integers(0, mcfg.vocab_size, (batch, prefill), dtype=np.int32)
    short = median_seconds(lambda p=prompts: generate(model, p, 1, eos_ids=None), repeats)
    full = median_seconds(lambda p=prompts: generate(model, p, decode + 1, eos_ids=None),
                           repeats)
    timings.append((batch, short, full))
  bandwidth_after = measure.memory_bandwidth_gbs(bandwidth_mib, bandwidth_seconds)
  bandwidth = max(*bandwidth_before.values(), *bandwidth_after.values()) * 1e9

  rows = []
  for batch, short, full in timings:
    step_s = max(full - short, 1e-12) / decode
    prefill_s = max(short - step_s, 1e-12)
    moved = bytes_per_decode_step(cfg, batch, prefill + (decode + 1) / 2,
                                  param_bytes=param_bytes, cache_bytes=cache_bytes)
    bound_step_s = (moved['weights'] + moved['kv_cache']) / bandwidth
    rows.append({
        'kind': 'decode', 'framework': 'maxnnx', 'config': name, 'device': device,
        'dtype': dtype, 'batch': batch, 'prefill': prefill, 'decode': decode,
        'prefill_s': prefill_s, 'prefill_tokens_per_s': batch * prefill / prefill_s,
        'decode_step_s': step_s, 'decode_tokens_per_s': batch / step_s,
        'weight_bytes_per_step': moved['weights'], 'kv_bytes_per_step': moved['kv_cache'],
        'bandwidth_gbs': bandwidth / 1e9, 'bound_decode_tokens_per_s': batch / bound_step_s,
        'fraction_of_bound': bound_step_s / step_s, 'generate_s': full,
        'date': results.make_date(), 'versions': measure.versions(),
        'command': results.current_command()})
  log(format_table(rows, bandwidth_before, bandwidth_after))
  if json_path:
    results.append_lines(json_path, rows)
    log(f'appended to {json_path}')
  return rows


def format_table(rows: list[dict], before: dict, after: dict) -> str:
  """The human-readable decode report."""
  lines = [f"  memory bandwidth: read (sum) {before['read']:.1f} before / {after['read']:.1f} "
           f"after, copy (in place) {before['copy']:.1f} / {after['copy']:.1f} GB/s; the bound "
           'uses the largest',
           f"  {'batch':>5} {'prefill tok/s':>13} {'prefill s':>9} {'decode ms/step':>14} "
           f"{'decode tok/s':>12} {'bound tok/s':>11} {'of bound':>8} {'MB/step':>8}"]
  for r in rows:
    mb = (r['weight_bytes_per_step'] + r['kv_bytes_per_step']) / 1e6
    lines.append(f"  {r['batch']:>5} {r['prefill_tokens_per_s']:>13,.0f} {r['prefill_s']:>9.3f} "
                 f"{r['decode_step_s'] * 1e3:>14.2f} {r['decode_tokens_per_s']:>12,.1f} "
                 f"{r['bound_decode_tokens_per_s']:>11,.1f} {r['fraction_of_bound']:>8.1%} "
                 f'{mb:>8.1f}')
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
  """Command line entry point."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', required=True, choices=sorted(BENCH_CONFIGS))
  parser.add_argument('--batch', type=int, nargs='+', default=[1, 32])
  parser.add_argument('--prefill', type=int, default=512, help='prompt tokens (default 512)')
  parser.add_argument('--decode', type=int, default=128, help='decode steps timed (default 128)')
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default=None,
                      help='compute and KV-cache dtype (default float32 on CPU, bf16 on GPU)')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--json', default=None, help='append one JSON line per batch size here')
  args = parser.parse_args(argv)
  run(get_config(args.config), name=args.config, batches=args.batch, prefill=args.prefill,
      decode=args.decode, dtype=args.dtype, repeats=args.repeats, json_path=args.json)
  return 0


if __name__ == '__main__':
  sys.exit(main())

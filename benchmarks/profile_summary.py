"""Where a step's time goes: trace a few steps with ``jax.profiler`` and summarize the kernels.

::

  python -m benchmarks.train_throughput --config gpu-1b --profile runs/profile
  python -m benchmarks.profile_summary runs/profile        # summarize a trace written earlier

The trace is the profiler's Perfetto file (``perfetto_trace.json.gz``, Chrome trace events), read
with the standard library alone, so the summary needs neither TensorBoard nor xprof. On a GPU it
sums the kernels the device ran (CUPTI events on the ``/device:GPU:*`` tracks); on a CPU, where
there is no device track, it sums the XLA ops of the host's runtime threads instead. Kernels are
put into coarse groups by name (matmul, attention, collective, copy, elementwise fusion) so the
table says at a glance whether a step is bound by matmuls or by what sits between them.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
from collections.abc import Callable

# Checked in order; the first pattern that matches a kernel's name (lower case) names its group.
KERNEL_GROUPS: tuple[tuple[str, str], ...] = (
    ('collective', r'nccl|all_reduce|all_gather|reduce_scatter|all_to_all|collective'),
    ('copy/memset', r'memcpy|memset|copy'),
    ('attention', r'cudnn|fmha|flash|attention|sdpa|dot_product_attention'),
    ('matmul', r'gemm|cutlass|cublas|xmma|nvjet|wgmma|matmul|dot|ragged'),
    ('fusion', r'fusion|triton|loop_|input_|reduce|convert|transpose|select|ynn'),
)


def kernel_group(name: str) -> str:
  """The coarse group (``matmul``, ``attention``, ...) of a kernel or op named ``name``."""
  lowered = name.lower()
  for group, pattern in KERNEL_GROUPS:
    if re.search(pattern, lowered):
      return group
  return 'other'


def find_trace(log_dir: str) -> str:
  """The newest ``perfetto_trace.json.gz`` under ``log_dir`` (where ``jax.profiler`` put it)."""
  found = sorted(glob.glob(os.path.join(log_dir, '**', 'perfetto_trace.json.gz'), recursive=True),
                 key=os.path.getmtime)
  if not found:
    raise FileNotFoundError(f'no perfetto_trace.json.gz under {log_dir}: trace with '
                            'jax.profiler.trace(..., create_perfetto_trace=True)')
  return found[-1]


def kernel_times(trace_path: str) -> tuple[dict[str, float], str]:
  """``({kernel name: total microseconds}, where)`` from one Perfetto trace file.

  ``where`` is ``'device'`` when the trace has device tracks (their complete events are summed),
  else ``'host XLA ops'`` (complete events on the host's runtime threads, less the Python
  tracer's and the runtime's own wrappers).
  """
  with gzip.open(trace_path, 'rt') as f:
    data = json.load(f)
  events = data['traceEvents'] if isinstance(data, dict) else data
  processes, threads = {}, {}
  for e in events:
    if e.get('ph') == 'M' and e.get('name') == 'process_name':
      processes[e['pid']] = e['args'].get('name', '')
    elif e.get('ph') == 'M' and e.get('name') == 'thread_name':
      threads[(e['pid'], e['tid'])] = e['args'].get('name', '')
  device_pids = {pid for pid, name in processes.items()
                 if re.search(r'/device:(GPU|TPU)', name)}
  totals: dict[str, float] = collections.defaultdict(float)
  for e in events:
    if e.get('ph') != 'X':
      continue
    pid = e.get('pid')
    if device_pids:
      if pid not in device_pids:
        continue
      thread = threads.get((pid, e.get('tid')), '')
      if re.search(r'xla ops|xla modules|steps|launch stats|source', thread.lower()):
        continue  # the device's summary tracks repeat the kernels' time
    elif (threads.get((pid, e.get('tid')), '') == 'python' or '::' in e['name']
          or e['name'].startswith(('$', 'end:', 'while', 'call', 'conditional'))):
      continue  # the Python tracer, runtime wrappers and control flow around the ops
    totals[e['name']] += float(e.get('dur', 0.0))
  return dict(totals), 'device' if device_pids else 'host XLA ops'


def summarize(trace_path: str, steps: int, step_time_s: float | None = None,
              top: int = 25) -> str:
  """A plain-text table: time per step by kernel group, then the ``top`` kernels."""
  totals, where = kernel_times(trace_path)
  busy_us = sum(totals.values())
  if not busy_us:
    return f'profile: no kernel events in {trace_path}'
  groups: dict[str, float] = collections.defaultdict(float)
  for name, us in totals.items():
    groups[kernel_group(name)] += us
  per_step_ms = busy_us / steps / 1e3
  lines = [f'profile ({where}, {steps} steps): {per_step_ms:.2f} ms of kernels per step'
           + (f' in a {step_time_s * 1e3:.2f} ms step ({per_step_ms / (step_time_s * 1e3):.0%} '
              'busy)' if step_time_s else '')]
  lines.append(f"  {'group':<14} {'ms/step':>9} {'share':>7}")
  for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
    lines.append(f'  {group:<14} {us / steps / 1e3:9.3f} {us / busy_us:7.1%}')
  lines.append(f"  {'top kernels':<70} {'group':<12} {'ms/step':>9} {'share':>7}")
  for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
    short = name if len(name) <= 70 else name[:67] + '...'
    lines.append(f'  {short:<70} {kernel_group(name):<12} {us / steps / 1e3:9.3f} '
                 f'{us / busy_us:7.1%}')
  return '\n'.join(lines)


def profile_steps(step: Callable[[], None], steps: int, log_dir: str,
                  step_time_s: float | None = None) -> str:
  """Run ``step()`` ``steps`` times under ``jax.profiler.trace`` into ``log_dir``; return the
  :func:`summarize` table (each ``step`` must wait for its own results)."""
  import jax  # noqa: PLC0415 (the summary alone needs no jax)
  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    for _ in range(steps):
      step()
  return summarize(find_trace(log_dir), steps, step_time_s)


def main(argv: list[str] | None = None) -> int:
  """``python -m benchmarks.profile_summary LOG_DIR [STEPS]``: summarize a trace on disk."""
  args = sys.argv[1:] if argv is None else argv
  if not args:
    print(__doc__)
    return 2
  print(summarize(find_trace(args[0]), int(args[1]) if len(args) > 1 else 1))
  return 0


if __name__ == '__main__':
  sys.exit(main())

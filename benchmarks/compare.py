"""maxnnx next to its peers: read result lines (and optionally run everything first).

::

  python -m benchmarks.compare results.jsonl peers.jsonl
  python -m benchmarks.compare --run cpu-tiny cpu-medium --peers pytorch-eager,maxtext

For every config it prints each framework's tokens/s per device, TFLOP/s per device, MFU (each
against the matmul ceiling its own process measured) and the ratio maxnnx / that framework in
tokens/s. With ``--run`` it first runs, one after another, maxnnx
(``benchmarks.train_throughput``) and each requested peer (``benchmarks.peers.pytorch``,
``benchmarks.peers.maxtext``) as subprocesses with the same ``--steps``, so each framework
times the same number of tokens; a peer that is missing or fails shows as a row saying why.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

from benchmarks.results import FRAMEWORKS, read_results

PEERS = ('pytorch-eager', 'pytorch-compile', 'maxtext')


def peer_command(framework: str, config: str, steps: int, json_path: str,
                 python: str = sys.executable, maxnnx_dtype: str | None = None) -> list[str]:
  """The command line that benchmarks ``framework`` on ``config`` into ``json_path``."""
  if framework == 'maxnnx':
    dtype = ['--dtype', maxnnx_dtype] if maxnnx_dtype else []
    return [python, '-m', 'benchmarks.train_throughput', '--config', config, '--steps',
            str(steps), '--json', json_path, *dtype]
  if framework in ('pytorch-eager', 'pytorch-compile'):
    return [python, '-m', 'benchmarks.peers.pytorch', '--config', config, '--mode',
            framework.split('-')[1], '--steps', str(steps), '--json', json_path]
  if framework == 'maxtext':
    return [python, '-m', 'benchmarks.peers.maxtext', '--config', config, '--steps', str(steps),
            '--json', json_path]
  raise ValueError(f'unknown framework {framework!r}; known: {", ".join(FRAMEWORKS)}')


def _count_lines(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for line in f if line.strip())


def run_all(configs: list[str], frameworks: list[str], steps: int, json_path: str,
            timeout_s: float, maxnnx_dtype: str | None = None,
            log=print) -> dict[tuple[str, str], str]:
  """Run every framework on every config, one at a time; returns ``{(config, framework): why}``
  for the runs that wrote no result."""
  failures = {}
  for config in configs:
    for framework in frameworks:
      command = peer_command(framework, config, steps, json_path, maxnnx_dtype=maxnnx_dtype)
      log(f'== {framework} on {config}: {" ".join(command[1:])}')
      before = _count_lines(json_path)
      try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
      except subprocess.TimeoutExpired:
        failures[(config, framework)] = f'timed out after {timeout_s:.0f} s'
        continue
      except OSError as e:
        failures[(config, framework)] = f'could not start: {e}'
        continue
      tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
      log('\n'.join('   ' + line for line in tail))
      if proc.returncode != 0 or _count_lines(json_path) == before:
        last = next((line for line in reversed(tail) if line.strip()), 'no output')
        if 'No module named' in last:
          last = 'not available: ' + last[last.index('No module named'):].rstrip(')')
        failures[(config, framework)] = f'exit {proc.returncode}: {last.strip()[:160]}'
  return failures


def label(record: dict) -> str:
  """The row name of a record: its framework, plus the settings that make it another variant
  of that framework (``maxnnx fp8``, ``maxnnx remat=full``, ``maxnnx params=bfloat16``)."""
  parts = [record['framework']]
  if record.get('quantization', 'none') != 'none':
    parts.append(record['quantization'])
  if record.get('remat', 'none') != 'none':
    parts.append(f"remat={record['remat']}")
  if record.get('param_dtype', 'float32') != 'float32':
    parts.append(f"params={record['param_dtype']}")
  return ' '.join(parts)


def latest(records: list[dict]) -> dict[tuple[str, str], dict]:
  """The newest record per ``(config, label)`` (later lines win at equal dates)."""
  out = {}
  for record in records:
    key = (record['config'], label(record))
    if key not in out or record['date'] >= out[key]['date']:
      out[key] = record
  return out


def _pct(x) -> str:
  return 'n/a' if x is None else f'{x:.1%}'


def format_comparison(records: list[dict], failures: dict | None = None) -> str:
  """The comparison table, one block per config."""
  failures = failures or {}
  best = latest(records)
  configs = sorted({c for c, _ in best} | {c for c, _ in failures})
  lines = []
  header = (f"  {'framework':<34} {'dtype':<9} {'tok/s/dev':>10} {'TFLOP/s':>8} {'ceiling':>8} "
            f"{'MFU':>6} {'step s':>8} {'compile s':>9} {'maxnnx/this':>11}  device")
  for config in configs:
    lines.append(f'{config}:')
    lines.append(header)
    ours = best.get((config, 'maxnnx'))
    frameworks = [f for f in FRAMEWORKS if (config, f) in best or (config, f) in failures]
    frameworks += sorted({f for c, f in best if c == config} - set(frameworks))
    tokens = {r['steps_timed'] * r['batch'] * r['seq'] for (c, _), r in best.items()
              if c == config}
    for framework in frameworks:
      record = best.get((config, framework))
      if record is None:
        lines.append(f'  {framework:<34} no result: {failures[(config, framework)]}')
        continue
      ratio = (f"{ours['tokens_per_s_per_device'] / record['tokens_per_s_per_device']:.2f}x"
               if ours else 'n/a')
      ceiling = 'n/a' if record['ceiling_tflops'] is None else f"{record['ceiling_tflops']:.3g}"
      compile_s = 'n/a' if record['compile_s'] is None else f"{record['compile_s']:.1f}"
      lines.append(
          f"  {framework:<34} {record['dtype']:<9} {record['tokens_per_s_per_device']:>10,.0f} "
          f"{record['tflops_per_device']:>8.3g} {ceiling:>8} {_pct(record['mfu']):>6} "
          f"{record['step_time_s']:>8.4f} {compile_s:>9} {ratio:>11}  {record['device']}")
    if len(tokens) > 1:
      lines.append(f'  note: the frameworks timed different token counts {sorted(tokens)} '
                   '(steps x batch x seq); rerun with the same --steps.')
    dtypes = {r['dtype'] for (c, _), r in best.items() if c == config}
    if len(dtypes) > 1:
      lines.append(f'  note: mixed compute dtypes {sorted(dtypes)}: compare MFU, not tokens/s.')
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
  """Command line entry point."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('files', nargs='*', help='result .jsonl files to read')
  parser.add_argument('--run', nargs='+', metavar='CONFIG', default=[],
                      help='run maxnnx and the peers on these configs first')
  parser.add_argument('--peers', default=','.join(PEERS),
                      help=f'comma-separated peers to run (default {",".join(PEERS)}; '
                      'empty for maxnnx alone)')
  parser.add_argument('--steps', type=int, default=20, help='timed steps for every framework')
  parser.add_argument('--json', default=None,
                      help='where --run writes (default benchmarks/results/<date>.jsonl)')
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default=None,
                      help="maxnnx's compute dtype with --run (default: its per-device default)")
  parser.add_argument('--timeout', type=float, default=3600, help='seconds per run at most')
  args = parser.parse_args(argv)
  peers = [p.strip() for p in args.peers.split(',') if p.strip()]
  unknown = set(peers) - set(PEERS)
  if unknown:
    parser.error(f'unknown peers {sorted(unknown)}; choose from {",".join(PEERS)}')
  files, failures = list(args.files), {}
  if args.run:
    path = args.json or os.path.join(
        'benchmarks', 'results', f'{datetime.date.today().isoformat()}.jsonl')
    start = datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')
    failures = run_all(args.run, ['maxnnx', *peers], args.steps, path, args.timeout, args.dtype)
    files.append(path)
  if not files:
    parser.error('give result files to read, or --run CONFIG ...')
  records = [r for path in files if os.path.exists(path) for r in read_results(path)]
  if args.run:  # this run's configs; a framework that failed now shows why, not an old line
    records = [r for r in records if r['config'] in args.run
               and ((r['config'], r['framework']) not in failures or r['date'] >= start)]
  print(format_comparison(records, failures))
  return 0


if __name__ == '__main__':
  sys.exit(main())

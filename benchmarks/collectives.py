"""A collective census of the compiled train step: which collectives each mesh layout makes
XLA emit, how many and how many bytes, without running anything.

Each (config, layout) pair builds a :class:`~maxnnx.train.Trainer` on simulated CPU
devices, compiles its train step ahead of time (parameters and optimizer state stay
abstract, so a 1B model costs compile time, not memory) and reads the optimized HLO:

```bash
python -m benchmarks.collectives                       # cpu-tiny and gpu-1b, every layout
python -m benchmarks.collectives --config cpu-tiny --layouts fsdp dp_fsdp_tp --json out.jsonl
```

Counts are per device and per step, of the partitioned program: an ``all-gather`` counts its
gathered result, an ``all-reduce`` its reduced buffer, asynchronous pairs once (at ``-done``).
Layers are unrolled (``scan_layers=False``) so every layer's collectives appear in the
program; collectives inside a loop body that remains (a pipeline's stage loop) are counted
once and reported apart. The batch is 8 sequences (the product of the layout's batch axes);
sequence length, widths and vocabulary are the config's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import sys
import tempfile
import time

KINDS = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'collective-permute')
LAYOUTS = {
    'dp': dict(data=8),
    'fsdp': dict(fsdp=8),
    'fsdp_tp': dict(fsdp=4, tensor=2),
    'dp_fsdp_tp': dict(data=2, fsdp=2, tensor=2),
    'tp_sequence_parallel': dict(data=2, tensor=4, sequence_parallel=True),
    'cp': dict(data=2, context=4),
}
_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4,
          'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8}
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+'
                          r'(?P<op>[a-z\-]+)\(')
_ARRAY = re.compile(r'\b(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]')
_COMPUTATION = re.compile(r'^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$')
_WHILE_BODY = re.compile(r'\bwhile\(.*\bbody=%?(?P<body>[\w.\-]+)')


def type_bytes(hlo_type: str) -> int:
  """Bytes of an HLO result type: one array ``f32[8,128]{1,0}`` or a tuple of them."""
  total = 0
  for match in _ARRAY.finditer(hlo_type):
    dims = [int(d) for d in match['dims'].split(',') if d]
    size = 1
    for d in dims:
      size *= d
    total += size * _BYTES.get(match['dtype'], 4)
  return total


def census(hlo_text: str) -> dict[str, dict[str, int]]:
  """``{kind: {'count', 'bytes', 'count_in_loops', 'bytes_in_loops'}}`` of an optimized
  HLO module's collectives (kinds of :data:`KINDS` that occur)."""
  lines = hlo_text.splitlines()
  loop_bodies = {m['body'] for line in lines for m in [_WHILE_BODY.search(line)] if m}
  out: dict[str, dict[str, int]] = collections.defaultdict(
      lambda: {'count': 0, 'bytes': 0, 'count_in_loops': 0, 'bytes_in_loops': 0})
  computation = None
  for line in lines:
    header = _COMPUTATION.match(line)
    if header and '=' not in line.split('{')[0]:
      computation = header['name']
      continue
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    op = match['op']
    if op.endswith('-start'):
      continue
    kind = op[:-len('-done')] if op.endswith('-done') else op
    if kind not in KINDS:
      continue
    hlo_type = match['type']  # a -done's is the output buffer; a combined op's, a tuple
    suffix = '_in_loops' if computation in loop_bodies else ''
    out[kind]['count' + suffix] += 1
    out[kind]['bytes' + suffix] += type_bytes(hlo_type)
  return {kind: dict(out[kind]) for kind in KINDS if kind in out}


def bytes_by_dtype(hlo_text: str, kind: str = 'all-gather') -> dict[str, int]:
  """``{element type: bytes}`` of the ``kind`` collectives' results in an HLO module."""
  sizes: dict[str, int] = {}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match or match['op'] not in (kind, kind + '-start'):
      continue
    for array in _ARRAY.finditer(match['type']):
      sizes[array['dtype']] = sizes.get(array['dtype'], 0) + type_bytes(array[0])
  return sizes


def partitioned_hlo(dump_dir: str, module: str = 'jit_train_step') -> str:
  """The HLO of ``module`` right after SPMD partitioning, from an XLA dump made with
  ``--xla_dump_to=<dump_dir> --xla_dump_hlo_pass_re=spmd-partitioning``: which collectives
  the partitioner chose, in their element types, before a backend rewrites them (XLA's CPU
  pipeline widens bf16 collectives to float32, so its optimized HLO cannot show them)."""
  names = sorted(n for n in os.listdir(dump_dir)
                 if module in n and 'after_spmd-partitioning' in n and n.endswith('.txt'))
  if not names:
    raise FileNotFoundError(f'no {module} after spmd-partitioning in {dump_dir}')
  with open(os.path.join(dump_dir, names[-1]), encoding='utf-8') as f:
    return f.read()


def compiled_step_hlo(config_name: str, layout: dict) -> tuple[str, float]:
  """The optimized HLO of the train step of ``config_name`` on ``layout``, and compile s."""
  from benchmarks.configs import get_config  # noqa: PLC0415
  from benchmarks.model import model_config  # noqa: PLC0415
  from maxnnx.config import MeshConfig  # noqa: PLC0415
  from maxnnx.train import TrainConfig, Trainer  # noqa: PLC0415
  cfg = get_config(config_name)
  model = model_config(cfg, dtype='bfloat16', scan=False)
  train = TrainConfig(global_batch_size=8, seq_len=cfg['seq'], mesh=MeshConfig(**layout),
                      memory_limit_gib=1e6)
  trainer = Trainer(model, train)
  start = time.perf_counter()
  trainer.compile(verbose=False)
  return trainer._compiled.as_text(), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
  """Print (and optionally append as JSON lines) the census of each config x layout."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', nargs='+', default=['cpu-tiny', 'gpu-1b'])
  parser.add_argument('--layouts', nargs='+', default=list(LAYOUTS), choices=list(LAYOUTS))
  parser.add_argument('--json', help='append one JSON line per config x layout to this file')
  parser.add_argument('--gather-dtypes', action='store_true',
                      help='also print the all-gather bytes by element type right after SPMD '
                           'partitioning (before the backend rewrites them)')
  args = parser.parse_args(argv)
  dump_dir = None
  if args.gather_dtypes:
    dump_dir = tempfile.mkdtemp(prefix='collectives-')
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + f' --xla_dump_to={dump_dir}'
                               ' --xla_dump_hlo_pass_re=spmd-partitioning')
  import jax  # noqa: PLC0415
  if jax.device_count() < 8:
    print('needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8',
          file=sys.stderr)
    return 2
  header = f'{"config":10} {"layout":22} {"compile s":>9}  ' + '  '.join(
      f'{k:>22}' for k in KINDS)
  print(header + '\n' + '-' * len(header))
  for config_name in args.config:
    for name in args.layouts:
      text, seconds = compiled_step_hlo(config_name, LAYOUTS[name])
      counts = census(text)
      cells = []
      for kind in KINDS:
        c = counts.get(kind, {})
        cell = f'{c.get("count", 0)} / {c.get("bytes", 0) / 2**20:,.1f} MiB'
        if c.get('count_in_loops'):
          cell += f' +{c["count_in_loops"]} in loop'
        cells.append(f'{cell:>22}')
      print(f'{config_name:10} {name:22} {seconds:9.1f}  ' + '  '.join(cells), flush=True)
      if dump_dir:
        gathered = bytes_by_dtype(partitioned_hlo(dump_dir))
        counts['all-gather_bytes_by_dtype_partitioned'] = gathered
        print(f'{"":33}all-gather after partitioning: ' + ', '.join(
            f'{d} {b / 2**20:,.1f} MiB' for d, b in sorted(gathered.items())), flush=True)
        shutil.rmtree(dump_dir)
        os.makedirs(dump_dir)
      if args.json:
        with open(args.json, 'a', encoding='utf-8') as f:
          f.write(json.dumps({'config': config_name, 'layout': name, 'mesh': LAYOUTS[name],
                              'compile_s': round(seconds, 1), 'collectives': counts,
                              'date': time.strftime('%Y-%m-%d'),
                              'device': f'{jax.device_count()} simulated '
                                        f'{jax.devices()[0].platform} devices'}) + '\n')
  return 0


if __name__ == '__main__':
  os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  sys.exit(main())

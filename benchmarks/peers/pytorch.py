"""Training throughput of a plain PyTorch Llama with the same shapes as a maxnnx benchmark config.

Run with the project's Python (this module imports no torch)::

  python -m benchmarks.peers.pytorch --config cpu-tiny --mode eager --steps 20 --json out.jsonl
  python -m benchmarks.peers.pytorch --config cpu-tiny --mode compile --dtype float32 \
      --json out.jsonl

The first run creates ``benchmarks/.peer-envs/pytorch`` (a virtual environment of this
interpreter) and installs ``torch==2.13.0`` there, the CPU build where a local CPU wheel is
offered; on a GPU machine pass ``--torch-spec`` (e.g. ``'torch==2.13.0'`` from the CUDA index
with ``--pip-arg=--index-url=...``), or ``--python PATH`` to use an interpreter that already has
torch (no environment is made). The model and timing loop are in ``_pytorch_llama.py``;
this launcher turns its step times into one JSON line appended to ``--json``.

Timing: ``--warmup`` steps are dropped (in ``compile`` mode the first of them includes
``torch.compile``'s compilation, reported as ``compile_s``: the wall time of that first step),
then the median of ``--steps`` timed steps gives ``step_time_s``. The matmul ceiling is a
2048x2048 (CPU) or 8192x8192 (GPU) matmul in the run's dtype, timed in the same process.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.configs import BENCH_CONFIGS, get_config
from benchmarks.peers import _common

DEFAULT_TORCH_SPEC = 'torch==2.13.0'
INNER = Path(__file__).resolve().parent / '_pytorch_llama.py'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The launcher's command line."""
  p = argparse.ArgumentParser(prog='python -m benchmarks.peers.pytorch',
                              description='Plain PyTorch Llama training throughput.')
  p.add_argument('--config', required=True, choices=sorted(BENCH_CONFIGS))
  p.add_argument('--mode', required=True, choices=['eager', 'compile'])
  p.add_argument('--steps', type=int, default=20, help='timed steps (after the warm-up)')
  p.add_argument('--warmup', type=int, default=3, help='untimed first steps (>= 1 to compile)')
  p.add_argument('--dtype', default='bfloat16', choices=['bfloat16', 'float32'],
                 help='bfloat16: autocast over float32 weights; float32: no autocast')
  p.add_argument('--json', required=True, help='append one JSON result line to this file')
  p.add_argument('--device', default='auto', choices=['auto', 'cpu', 'cuda'])
  p.add_argument('--threads', type=int, default=0, help='torch threads; 0 = every usable core')
  p.add_argument('--torch-spec', default=DEFAULT_TORCH_SPEC,
                 help=f'pip requirement for torch in the peer venv (default {DEFAULT_TORCH_SPEC})')
  p.add_argument('--pip-arg', action='append', default=[],
                 help='extra argument for pip install (repeatable), e.g. --pip-arg=--index-url=URL')
  p.add_argument('--python', default=None,
                 help='an interpreter that already has torch (e.g. a GPU image\'s); skips the venv')
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error('--steps must be at least 1')
  if args.warmup < 0 or (args.mode == 'compile' and args.warmup < 1):
    p.error('--warmup must be >= 0, and >= 1 with --mode compile (the compile step is untimed)')
  return args


def framework_name(mode: str) -> str:
  """The ``framework`` field of a result line: ``pytorch-eager`` or ``pytorch-compile``."""
  return f'pytorch-{mode}'


def inner_spec(args: argparse.Namespace, out_path: str) -> dict:
  """What ``_pytorch_llama.py`` needs: the config shapes and the run's settings."""
  return dict(cfg=get_config(args.config), mode=args.mode, dtype=args.dtype, steps=args.steps,
              warmup=args.warmup, device=args.device, threads=args.threads, out=out_path)


def result_from_raw(args: argparse.Namespace, raw: dict, command: str) -> dict:
  """The result line from the inner script's raw measurements."""
  cfg = get_config(args.config)
  if raw['device_type'] == 'cuda':
    device = f'gpu: {raw["device_name"]}'
  else:
    device = _common.cpu_device_name()
  return _common.build_result(
      framework=framework_name(args.mode), config_name=args.config, cfg=cfg, device=device,
      num_devices=1, dtype=args.dtype, step_times_s=raw['step_times_s'][args.warmup:],
      ceiling_tflops=raw['ceiling_tflops'], compile_s=raw['compile_s'],
      peak_memory_gib=raw['peak_memory_gib'], versions=raw['versions'], command=command)


def main(argv: list[str] | None = None) -> dict:
  """Set up the venv, run the inner script, append and return the result line."""
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.python:
    python = args.python
  else:
    python = _common.ensure_env('pytorch', [*args.pip_arg, args.torch_spec, 'numpy'])
  with tempfile.TemporaryDirectory() as tmp:
    out_path = str(Path(tmp) / 'raw.json')
    spec = inner_spec(args, out_path)
    subprocess.run([str(python), str(INNER), json.dumps(spec)], check=True)
    raw = json.loads(Path(out_path).read_text())
  result = result_from_raw(args, raw, _common.command_line('benchmarks.peers.pytorch', argv))
  _common.append_json_line(args.json, result)
  print(json.dumps(result, indent=1))
  return result


if __name__ == '__main__':
  main()

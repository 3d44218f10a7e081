"""Training throughput of MaxText (from PyPI, at its defaults) on a maxnnx benchmark config.

Run with the project's Python (this module imports neither jax nor MaxText)::

  python -m benchmarks.peers.maxtext --config cpu-tiny --steps 10 --json out.jsonl
  python -m benchmarks.peers.maxtext --config cpu-tiny --json out.jsonl --python /path/to/python3.12

MaxText needs Python >= 3.12. The first run creates ``benchmarks/.peer-envs/maxtext`` from the
interpreter given by ``--python``, else the first of ``python3.13``/``python3.12`` on PATH (or
under ``pyenv root``) that runs, and installs ``maxtext[tpu]==0.2.5`` there (``[cuda12]`` for
``--hardware gpu``; change with ``--maxtext-spec``). The ``tpu`` extra is MaxText's plain jax
install; on a machine without a TPU jax falls back to the CPU.

MaxText runs as ``python -m maxtext.trainers.pre_train.train key=value ...`` with the overrides
from :func:`maxtext_overrides`: the config's shapes (``base_emb_dim``, ``base_num_decoder_layers``,
``base_num_query_heads``, ``base_num_kv_heads``, ``head_dim``, ``base_mlp_dim``, ``vocab_size``,
``max_target_length``, ``per_device_batch_size``, ``rope_max_timescale``; MoE configs add
``decoder_block=mixtral``, ``num_experts``, ``num_experts_per_tok``, ``base_moe_mlp_dim``) and
what a local run needs (``hardware``, ``dataset_type=synthetic``,
``skip_jax_distributed_system=True``, ``enable_checkpointing=False``, ``steps``, ``run_name``,
``base_output_directory`` and ``jax_cache_dir`` inside a temporary folder, so nothing is written
to the home folder and every run compiles afresh). Everything else stays at MaxText's defaults:
bfloat16 activations over float32 weights, ``remat_policy=full``, ``scan_layers=True``,
``attention=autoselected``, AdamW.

Timing: MaxText logs ``completed step: S, seconds: T, ...`` per step: the time between successive
step dispatches, which equals the step time once its one-step-deep metrics buffer keeps the host
waiting on the device (steps 0 and 1 show dispatch time only). The first ``--warmup`` steps are
dropped and the median of the rest gives ``step_time_s``. MaxText compiles the train step ahead
of time, before step 0; ``compile_s`` is read from its log (see :func:`parse_compile_seconds`).
``peak_memory_gib`` is the peak resident memory of the MaxText process on a CPU run (not measured
on GPU). The matmul ceiling is a bfloat16 jax matmul timed in the same run, after MaxText exits.

MaxText 0.2.5 ran on CPU with no overrides beyond the ones above.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.configs import BENCH_CONFIGS, get_config
from benchmarks.peers import _common

MAXTEXT_VERSION = '0.2.5'
MIN_PYTHON = (3, 12)
INNER = Path(__file__).resolve().parent / '_maxtext_run.py'
STEP_LINE = re.compile(r'completed step: (\d+), seconds: ([0-9.]+)')
# An absl log line written from Python: 'I1121 12:51:20.868957 1398... checkpointing.py:803] ...'
PY_LOG_LINE = re.compile(r'^[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) +\d+ [\w.]+\.py:\d+\]')
COMPILED_LINE = '[train] Total estimated memory size'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The launcher's command line."""
  p = argparse.ArgumentParser(prog='python -m benchmarks.peers.maxtext',
                              description='MaxText (PyPI, defaults) training throughput.')
  p.add_argument('--config', required=True, choices=sorted(BENCH_CONFIGS))
  p.add_argument('--steps', type=int, default=10,
                 help='timed steps (MaxText runs --warmup more before them, like every peer)')
  p.add_argument('--warmup', type=int, default=3,
                 help='first steps not timed (steps 0 and 1 log dispatch time only)')
  p.add_argument('--json', required=True, help='append one JSON result line to this file')
  p.add_argument('--python', default=None,
                 help='a Python >= 3.12 to build the MaxText venv from (only on the first run)')
  p.add_argument('--hardware', default='auto', choices=['auto', 'cpu', 'gpu', 'tpu'],
                 help="MaxText's hardware= (auto: the config's device)")
  p.add_argument('--num-devices', type=int, default=1,
                 help='devices the global batch is split over (per_device_batch_size)')
  p.add_argument('--maxtext-spec', default=None,
                 help=f'pip requirement (default maxtext[tpu]=={MAXTEXT_VERSION}, '
                      f'[cuda12] for gpu)')
  p.add_argument('--override', action='append', default=[],
                 help='extra MaxText key=value (repeatable); the result is then not "defaults"')
  args = p.parse_args(argv)
  if args.warmup < 1:
    p.error('--warmup must be at least 1 (MaxText logs step 0 before it has run)')
  if args.steps < 1:
    p.error(f'--steps ({args.steps}) must be at least 1')
  for kv in args.override:
    if '=' not in kv:
      p.error(f'--override {kv!r} must look like key=value')
  return args


def resolve_hardware(args: argparse.Namespace) -> str:
  """MaxText's ``hardware`` value: the flag, or the config's device for ``auto``."""
  if args.hardware != 'auto':
    return args.hardware
  return get_config(args.config)['device']


def maxtext_spec(args: argparse.Namespace, hardware: str) -> str:
  """The pip requirement for MaxText."""
  if args.maxtext_spec:
    return args.maxtext_spec
  extra = 'cuda12' if hardware == 'gpu' else 'tpu'
  return f'maxtext[{extra}]=={MAXTEXT_VERSION}'


def maxtext_overrides(cfg: dict, *, run_name: str, output_dir: str, steps: int, hardware: str,
                      num_devices: int = 1) -> list[str]:
  """MaxText ``key=value`` overrides for the benchmark config ``cfg``, the rest left default."""
  if cfg['batch'] % num_devices:
    raise ValueError(f"batch {cfg['batch']} does not split over --num-devices {num_devices}")
  kv = dict(
      run_name=run_name, base_output_directory=output_dir,
      jax_cache_dir=os.path.join(output_dir, 'jax_cache'), hardware=hardware,
      dataset_type='synthetic', skip_jax_distributed_system=True, enable_checkpointing=False,
      steps=steps,
      decoder_block='mixtral' if cfg['num_experts'] else 'llama2',
      base_emb_dim=cfg['d_model'], base_num_decoder_layers=cfg['num_layers'],
      base_num_query_heads=cfg['num_heads'], base_num_kv_heads=cfg['num_kv_heads'],
      head_dim=cfg['head_dim'], base_mlp_dim=cfg['mlp_dim'], vocab_size=cfg['vocab_size'],
      max_target_length=cfg['seq'], per_device_batch_size=cfg['batch'] // num_devices,
      rope_max_timescale=int(cfg['rope_theta']))
  if cfg['num_experts']:
    kv.update(num_experts=cfg['num_experts'], num_experts_per_tok=cfg['num_experts_per_tok'],
              base_moe_mlp_dim=cfg['mlp_dim'])
  return [f'{k}={v}' for k, v in kv.items()]


def parse_step_times(log_text: str) -> dict[int, float]:
  """``{step: seconds}`` from MaxText's ``completed step: S, seconds: T`` log lines."""
  return {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(log_text)}


def parse_compile_seconds(log_text: str) -> float | None:
  """Seconds MaxText spent tracing and compiling the train step ahead of time.

  MaxText compiles the train step before step 0 and then logs the compiled program's memory
  (``[train] Total estimated memory size ...``); this is the time from the Python log line just
  before that compile to that report. None when either line is missing.
  """
  lines = log_text.splitlines()
  done = next((i for i, line in enumerate(lines) if COMPILED_LINE in line), None)
  if done is None or not (end := PY_LOG_LINE.match(lines[done])):
    return None
  start = next((m for line in reversed(lines[:done]) if (m := PY_LOG_LINE.match(line))), None)
  if start is None:
    return None
  seconds = lambda m: int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
  return (seconds(end) - seconds(start)) % 86_400  # across midnight too


def python_version_of(python: str) -> tuple[int, int] | None:
  """``(major, minor)`` of the interpreter ``python``, or None if it does not run."""
  try:
    out = subprocess.run([python, '-c', 'import sys; print(*sys.version_info[:2])'],
                         capture_output=True, text=True, timeout=60)
  except (OSError, subprocess.TimeoutExpired):
    return None
  if out.returncode != 0:
    return None
  major, minor = out.stdout.split()
  return int(major), int(minor)


def candidate_pythons() -> list[str]:
  """Interpreters that might be Python >= 3.12: this one, python3.13/3.12 on PATH, pyenv's."""
  found = []
  if sys.version_info[:2] >= MIN_PYTHON:
    found.append(sys.executable)
  for name in ('python3.14', 'python3.13', 'python3.12'):
    path = shutil.which(name)
    if path:
      found.append(path)
  pyenv = shutil.which('pyenv')
  if pyenv:
    try:
      root = subprocess.run([pyenv, 'root'], capture_output=True, text=True,
                            timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
      root = ''
    if root:
      found += sorted((str(p) for p in Path(root).glob('versions/3.1[2-9]*/bin/python')),
                      reverse=True)
  return found


def find_python(explicit: str | None) -> str:
  """A working Python >= 3.12: ``explicit`` if given (checked), else the first candidate."""
  need = '.'.join(map(str, MIN_PYTHON))
  if explicit:
    version = python_version_of(explicit)
    if version is None or version < MIN_PYTHON:
      raise SystemExit(f'--python {explicit} is not a working Python >= {need} '
                       f'(found {version}); MaxText {MAXTEXT_VERSION} needs Python >= {need}.')
    return explicit
  for python in candidate_pythons():
    version = python_version_of(python)
    if version is not None and version >= MIN_PYTHON:
      return python
  raise SystemExit(f'MaxText {MAXTEXT_VERSION} needs Python >= {need}, and none was found '
                   f'(looked for python3.13 / python3.12 on PATH and under pyenv). Install one '
                   f'and pass it with --python /path/to/python3.12.')


def result_from_run(args: argparse.Namespace, log_text: str, raw: dict, command: str) -> dict:
  """The result line from MaxText's log and the inner script's measurements."""
  cfg = get_config(args.config)
  hardware = resolve_hardware(args)
  steps = parse_step_times(log_text)
  if 0 not in steps:
    raise SystemExit('no "completed step: 0, seconds: ..." line in the MaxText log: did it train?')
  timed = [t for s, t in sorted(steps.items()) if s >= args.warmup]
  device = (_common.cpu_device_name() if hardware == 'cpu'
            else f'{hardware}: {raw["device_kind"]}')
  return _common.build_result(
      framework='maxtext', config_name=args.config, cfg=cfg, device=device,
      num_devices=args.num_devices, dtype='bfloat16', step_times_s=timed,
      ceiling_tflops=raw['ceiling_tflops'], compile_s=parse_compile_seconds(log_text),
      peak_memory_gib=raw['peak_rss_gib'] if hardware == 'cpu' else None,
      versions=raw['versions'], command=command)


def main(argv: list[str] | None = None) -> dict:
  """Set up MaxText's venv, run it, append and return the result line."""
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  hardware = resolve_hardware(args)
  env_python = _common.env_python(_common.PEER_ENVS / 'maxtext')
  base = find_python(args.python) if args.python or not env_python.exists() else None
  python = _common.ensure_env('maxtext', [maxtext_spec(args, hardware)], base_python=base)
  with tempfile.TemporaryDirectory(prefix='maxtext-bench-') as tmp:
    overrides = maxtext_overrides(get_config(args.config), run_name=f'bench-{args.config}',
                                  output_dir=os.path.join(tmp, 'out'),
                                  steps=args.warmup + args.steps,
                                  hardware=hardware, num_devices=args.num_devices)
    overrides += args.override
    log = os.path.join(tmp, 'maxtext.log')
    spec = dict(overrides=overrides, log=log, out=os.path.join(tmp, 'raw.json'),
                hardware=hardware)
    subprocess.run([str(python), str(INNER), json.dumps(spec)], check=True)
    raw = json.loads(Path(spec['out']).read_text())
    log_text = Path(log).read_text()
  result = result_from_run(args, log_text, raw,
                           _common.command_line('benchmarks.peers.maxtext', argv))
  _common.append_json_line(args.json, result)
  print(json.dumps(result, indent=1))
  return result


if __name__ == '__main__':
  main()

"""What every peer launcher shares: its virtual environment, the device name and the result line.

Plain Python (no torch, no jax): the launchers run under the project's interpreter, and the peer
itself runs in a dedicated virtual environment under ``benchmarks/.peer-envs/<name>``.
"""

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import venv
from pathlib import Path

from benchmarks.configs import train_flops_per_token

PEER_ENVS = Path(__file__).resolve().parent.parent / '.peer-envs'
RESULT_KEYS = ('framework', 'config', 'device', 'num_devices', 'dtype', 'batch', 'seq',
               'steps_timed', 'step_time_s', 'tokens_per_s', 'tokens_per_s_per_device',
               'tflops_per_device', 'ceiling_tflops', 'mfu', 'compile_s', 'peak_memory_gib',
               'date', 'versions', 'command')


def env_python(env_dir: Path) -> Path:
  """The interpreter inside the virtual environment ``env_dir``."""
  return env_dir / ('Scripts/python.exe' if os.name == 'nt' else 'bin/python')


# torch and transformers for the benchmarks that run Hugging Face ``generate`` (hf_decode, serving).
TRANSFORMERS_PACKAGES = ['torch==2.13.0', 'transformers==5.23.0', 'safetensors', 'numpy']


def transformers_python(python: str | None = None, log=print) -> str:
  """The interpreter that runs transformers: ``python`` if given, else
  ``benchmarks/.peer-envs/transformers`` (created once with :data:`TRANSFORMERS_PACKAGES`)."""
  if python:
    return python
  return str(ensure_env('transformers', TRANSFORMERS_PACKAGES, log=log))


def ensure_env(name: str, packages: list[str], base_python: str | None = None,
               marker_text: str | None = None, log=print) -> Path:
  """Create ``benchmarks/.peer-envs/<name>`` once and ``pip install`` ``packages`` into it.

  A marker file records what was installed; when ``packages`` (or ``marker_text``) change the
  packages are installed again into the same environment. Returns the environment's python.
  """
  env_dir = PEER_ENVS / name
  python = env_python(env_dir)
  marker = env_dir / '.installed'
  wanted = marker_text if marker_text is not None else ' '.join(packages)
  if python.exists() and marker.exists() and marker.read_text() == wanted:
    return python
  if not python.exists():
    log(f'[{name}] creating virtual environment {env_dir}')
    if base_python is None or Path(base_python).resolve() == Path(sys.executable).resolve():
      venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    else:
      subprocess.run([base_python, '-m', 'venv', '--clear', str(env_dir)], check=True)
  log(f'[{name}] pip install {" ".join(packages)} (once; later runs reuse it)')
  subprocess.run([str(python), '-m', 'pip', 'install', '-q', '--upgrade', 'pip'], check=True)
  subprocess.run([str(python), '-m', 'pip', 'install', *packages], check=True)
  marker.write_text(wanted)
  return python


def cpu_device_name() -> str:
  """``'cpu: <model name> x<N> cores'`` for this machine (N = the cores this process may use)."""
  model = platform.processor() or platform.machine()
  try:
    for line in Path('/proc/cpuinfo').read_text().splitlines():
      if line.startswith('model name'):
        model = line.split(':', 1)[1].strip()
        break
  except OSError:
    pass
  return f'cpu: {model} x{usable_cores()} cores'


def usable_cores() -> int:
  """How many CPU cores this process may run on."""
  if hasattr(os, 'sched_getaffinity'):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def median(values: list[float]) -> float:
  """The median of a non-empty list, with a clear error for an empty one."""
  if not values:
    raise ValueError('no timed steps: raise --steps above --warmup')
  return float(statistics.median(values))


def build_result(*, framework: str, config_name: str, cfg: dict, device: str, num_devices: int,
                 dtype: str, step_times_s: list[float], ceiling_tflops: float | None,
                 compile_s: float | None, peak_memory_gib: float | None,
                 versions: dict[str, str], command: str) -> dict:
  """One result line: median step time over ``step_times_s`` (warm-up already dropped),
  tokens/s from the config's global batch, model TFLOP/s per device from
  ``train_flops_per_token``, and MFU against the peer's own measured matmul ceiling."""
  step = median(step_times_s)
  tokens_per_step = cfg['batch'] * cfg['seq']
  tokens_per_s = tokens_per_step / step
  per_device = tokens_per_s / num_devices
  tflops = per_device * train_flops_per_token(cfg) / 1e12
  mfu = tflops / ceiling_tflops if ceiling_tflops else None
  result = dict(framework=framework, config=config_name, device=device, num_devices=num_devices,
                dtype=dtype, batch=cfg['batch'], seq=cfg['seq'], steps_timed=len(step_times_s),
                step_time_s=step, tokens_per_s=tokens_per_s, tokens_per_s_per_device=per_device,
                tflops_per_device=tflops, ceiling_tflops=ceiling_tflops, mfu=mfu,
                compile_s=compile_s, peak_memory_gib=peak_memory_gib,
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
                versions=dict(versions), command=command)
  assert tuple(result) == RESULT_KEYS
  return result


def append_json_line(path: str | Path, result: dict) -> None:
  """Append ``result`` as one JSON object on its own line to ``path`` (parents created)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open('a') as f:
    f.write(json.dumps(result, sort_keys=False) + '\n')


def command_line(module: str, argv: list[str]) -> str:
  """The command that reproduces this run, as one shell-quoted string."""
  return shlex.join(['python', '-m', module, *argv])


def python_version() -> str:
  """This interpreter's version, e.g. ``'3.11.7'``."""
  return platform.python_version()

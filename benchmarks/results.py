"""The result record every benchmark writes: one JSON object per line (plain Python, no jax).

maxnnx and every peer (PyTorch, MaxText, each in its own virtual environment) append one line
per run to a ``.jsonl`` file; ``python -m benchmarks.compare`` reads them side by side. Build a
record with :func:`make_result` (it fills ``tokens_per_s``, ``tokens_per_s_per_device``,
``date``, ``command`` and checks everything), then :func:`append_result`.

Fields (``None`` where a number is unknown, e.g. no ceiling was measured)::

  framework               'maxnnx' | 'pytorch-eager' | 'pytorch-compile' | 'maxtext'
  config                  a name from benchmarks.configs
  device                  'cpu: <model> x<N> cores' or 'gpu: <device name>'
  num_devices             devices the step ran on
  dtype                   compute dtype ('float32', 'bfloat16')
  batch, seq              global batch (sequences) and tokens per sequence
  steps_timed             steps behind the timing (warm-up and compile excluded)
  step_time_s             median seconds per step
  tokens_per_s            batch * seq / step_time_s
  tokens_per_s_per_device tokens_per_s / num_devices
  tflops_per_device       train_flops_per_token * tokens_per_s_per_device / 1e12
  ceiling_tflops          measured matmul TFLOP/s per device (the MFU denominator)
  mfu                     tflops_per_device / ceiling_tflops
  compile_s               seconds to compile the step (jit lower+compile, torch.compile)
  peak_memory_gib         peak memory (device memory on GPU, process peak RSS on CPU)
  date                    ISO 8601 time of the run
  versions                {package: version}
  command                 the command line that produced it
Extra keys are allowed (e.g. ``nominal_peak_tflops``, ``mfu_nominal``, ``notes``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import sys

FRAMEWORKS = ('maxnnx', 'pytorch-eager', 'pytorch-compile', 'maxtext')

# field -> allowed Python types (a tuple containing type(None) means the field may be null).
SCHEMA: dict[str, tuple[type, ...]] = {
    'framework': (str,),
    'config': (str,),
    'device': (str,),
    'num_devices': (int,),
    'dtype': (str,),
    'batch': (int,),
    'seq': (int,),
    'steps_timed': (int,),
    'step_time_s': (float,),
    'tokens_per_s': (float,),
    'tokens_per_s_per_device': (float,),
    'tflops_per_device': (float,),
    'ceiling_tflops': (float, type(None)),
    'mfu': (float, type(None)),
    'compile_s': (float, type(None)),
    'peak_memory_gib': (float, type(None)),
    'date': (str,),
    'versions': (dict,),
    'command': (str,),
}


class ResultError(ValueError):
  """A result record is missing a field or has a wrong value."""


def validate_result(record: dict) -> dict:
  """Check ``record`` against :data:`SCHEMA` and its arithmetic; returns it unchanged.

  Raises:
    ResultError: naming the field and what is wrong with it.
  """
  if not isinstance(record, dict):
    raise ResultError(f'a result must be a dict, got {type(record).__name__}')
  missing = [k for k in SCHEMA if k not in record]
  if missing:
    raise ResultError(f'result is missing {missing}; every result needs {list(SCHEMA)}')
  for key, types in SCHEMA.items():
    value = record[key]
    if float in types and isinstance(value, int) and not isinstance(value, bool):
      continue  # an int where a float is expected is fine (JSON writes 2.0 as 2.0, but be kind)
    if not isinstance(value, types) or isinstance(value, bool):
      names = ' or '.join('null' if t is type(None) else t.__name__ for t in types)
      raise ResultError(f'result field {key!r} = {value!r} should be {names}')
  if record['framework'] not in FRAMEWORKS:
    raise ResultError(f"result field 'framework' = {record['framework']!r} should be one of "
                      f'{FRAMEWORKS}')
  for key in ('num_devices', 'batch', 'seq', 'steps_timed'):
    if record[key] < 1:
      raise ResultError(f'result field {key!r} must be >= 1, got {record[key]}')
  if not record['step_time_s'] > 0:
    raise ResultError(f"result field 'step_time_s' must be > 0, got {record['step_time_s']}")
  expected = record['batch'] * record['seq'] / record['step_time_s']
  if not math.isclose(record['tokens_per_s'], expected, rel_tol=1e-6):
    raise ResultError(f"result field 'tokens_per_s' = {record['tokens_per_s']} but batch * seq / "
                      f'step_time_s = {expected}')
  per_device = record['tokens_per_s'] / record['num_devices']
  if not math.isclose(record['tokens_per_s_per_device'], per_device, rel_tol=1e-6):
    raise ResultError(f"result field 'tokens_per_s_per_device' = "
                      f"{record['tokens_per_s_per_device']} but tokens_per_s / num_devices = "
                      f'{per_device}')
  try:
    datetime.datetime.fromisoformat(record['date'])
  except ValueError:
    raise ResultError(f"result field 'date' = {record['date']!r} is not ISO 8601") from None
  return record


def make_result(*, framework: str, config: str, device: str, num_devices: int, dtype: str,
                batch: int, seq: int, steps_timed: int, step_time_s: float,
                flops_per_token: float, ceiling_tflops: float | None = None,
                compile_s: float | None = None, peak_memory_gib: float | None = None,
                versions: dict | None = None, command: str | None = None, **extra) -> dict:
  """A validated result record; throughput, TFLOP/s and MFU are derived here, the same way
  for every framework. ``flops_per_token`` is training FLOPs per token
  (``benchmarks.configs.train_flops_per_token``)."""
  tokens_per_s = batch * seq / step_time_s
  per_device = tokens_per_s / num_devices
  tflops = flops_per_token * per_device / 1e12
  record = {
      'framework': framework, 'config': config, 'device': device, 'num_devices': int(num_devices),
      'dtype': dtype, 'batch': int(batch), 'seq': int(seq), 'steps_timed': int(steps_timed),
      'step_time_s': float(step_time_s), 'tokens_per_s': float(tokens_per_s),
      'tokens_per_s_per_device': float(per_device), 'tflops_per_device': float(tflops),
      'ceiling_tflops': None if ceiling_tflops is None else float(ceiling_tflops),
      'mfu': None if not ceiling_tflops else float(tflops / ceiling_tflops),
      'compile_s': None if compile_s is None else float(compile_s),
      'peak_memory_gib': None if peak_memory_gib is None else float(peak_memory_gib),
      'date': make_date(),
      'versions': dict(versions or {}),
      'command': command if command is not None else current_command(),
  }
  record.update(extra)
  return validate_result(record)


def append_result(path: str, record: dict) -> None:
  """Validate ``record`` and append it as one line to the JSONL file ``path``."""
  validate_result(record)
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  with open(path, 'a') as f:
    f.write(json.dumps(record) + '\n')


def append_lines(path: str, rows: list[dict]) -> None:
  """Append ``rows`` (records of any kind: decode, serving, rollouts) to the JSONL file ``path``,
  one line each, creating its directory."""
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  with open(path, 'a') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')


def read_results(path: str) -> list[dict]:
  """Every valid record of a JSONL file (blank lines skipped); a bad line raises
  :class:`ResultError` naming the file and line."""
  records = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        records.append(validate_result(json.loads(line)))
      except (ValueError, ResultError) as e:
        raise ResultError(f'{path}:{number}: {e}') from None
  return records


def make_date() -> str:
  """Now, as the ISO 8601 UTC string results carry in ``date``."""
  return datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')


def current_command() -> str:
  """The command line of this process, as a shell would run it."""
  args = sys.argv[:]
  if args and args[0].endswith('.py') and sys.modules.get('__main__') is not None:
    spec = getattr(sys.modules['__main__'], '__spec__', None)
    if spec is not None and spec.name:
      return shlex.join(['python', '-m', spec.name.removesuffix('.__main__'), *args[1:]])
  return shlex.join(['python', *args])


def cpu_description() -> str:
  """``'cpu: <model name> x<N> cores'`` (the cores this process may use)."""
  model = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          model = line.split(':', 1)[1].strip()
          break
  except OSError:
    pass
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:
    cores = os.cpu_count() or 1
  return f'cpu: {model} x{cores} cores'


#: The CPU flags that decide how fast XLA:CPU computes (recorded beside every CPU figure).
CPU_FLAGS = ('fma', 'avx', 'f16c', 'avx2', 'avx512f', 'avx512_bf16', 'avx512_fp16', 'amx_bf16',
             'amx_tile', 'amx_int8')


def cpu_flags() -> str:
  """The :data:`CPU_FLAGS` this CPU has, space-separated (``''`` where /proc/cpuinfo is not
  readable)."""
  try:
    with open('/proc/cpuinfo') as f:
      flags = next((line.split(':', 1)[1].split() for line in f if line.startswith('flags')), [])
  except OSError:
    return ''
  return ' '.join(flag for flag in CPU_FLAGS if flag in flags)


def package_versions(*names: str) -> dict[str, str]:
  """``{name: version}`` of the installed packages among ``names`` (plus python)."""
  from importlib import metadata  # noqa: PLC0415
  versions = {'python': platform.python_version()}
  for name in names:
    try:
      versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  return versions

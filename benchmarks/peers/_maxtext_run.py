"""Run MaxText's pre-training entry point and time a large matmul (runs in MaxText's venv).

Started by ``benchmarks.peers.maxtext`` as ``python _maxtext_run.py '<spec json>'``. The spec
holds the ``key=value`` overrides for ``maxtext.trainers.pre_train.train`` and the paths for the
log and the raw measurements. MaxText runs in a child process of this interpreter with its output
copied to the terminal and to the log; the launcher parses the per-step times from that log. The
matmul ceiling is measured afterwards in this process (after MaxText has released the device)
with jax in MaxText's default activation dtype, bfloat16.
"""

import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import sys
import time


def run_maxtext(overrides: list[str], log_path: str) -> tuple[int, float]:
  """Run MaxText's trainer with ``overrides``; return its exit code and wall time (s)."""
  cmd = [sys.executable, '-m', 'maxtext.trainers.pre_train.train', *overrides]
  print('running:', ' '.join(cmd), flush=True)
  start = time.perf_counter()
  with open(log_path, 'w') as log:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
      sys.stdout.write(line)
      log.write(line)
    rc = proc.wait()
  return rc, time.perf_counter() - start


def matmul_ceiling_tflops(n: int, repeats: int) -> tuple[float, str, int]:
  """Best TFLOP/s of an ``n``x``n`` bfloat16 matmul under jit, over both result dtypes
  (bfloat16, and float32 accumulation via ``preferred_element_type``); also the device kind
  and count."""
  import jax
  import jax.numpy as jnp

  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.bfloat16)
  b = jax.random.normal(kb, (n, n), jnp.bfloat16)
  best = float('inf')
  for out_dtype in (jnp.bfloat16, jnp.float32):
    f = jax.jit(lambda x, y, t=out_dtype: jnp.matmul(x, y, preferred_element_type=t))
    f(a, b).block_until_ready()
    for _ in range(repeats):
      start = time.perf_counter()
      f(a, b).block_until_ready()
      best = min(best, time.perf_counter() - start)
  device = jax.devices()[0]
  return 2 * n**3 / best / 1e12, device.device_kind, jax.device_count()


def versions() -> dict[str, str]:
  """Versions of MaxText and the stack it ran on."""
  out = {}
  for name in ('maxtext', 'jax', 'jaxlib', 'flax', 'optax'):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  out['python'] = platform.python_version()
  return out


def main(spec: dict) -> dict:
  """Run MaxText, then the ceiling; return the raw measurements."""
  rc, wall = run_maxtext(spec['overrides'], spec['log'])
  if spec['hardware'] == 'cpu':  # only for this process's own matmul: skip libtpu's probing
    os.environ['JAX_PLATFORMS'] = 'cpu'
  peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 2**30
  if rc != 0:
    raise SystemExit(f'MaxText exited with status {rc}; its output is in {spec["log"]}')
  ceiling, device_kind, device_count = matmul_ceiling_tflops(
      2048 if spec['hardware'] == 'cpu' else 8192, repeats=spec.get('ceiling_repeats', 5))
  return dict(wall_s=wall, peak_rss_gib=peak_gib, ceiling_tflops=ceiling,
              device_kind=device_kind, device_count=device_count, versions=versions())


if __name__ == '__main__':
  spec = json.loads(sys.argv[1])
  out = main(spec)
  with open(spec['out'], 'w') as f:
    json.dump(out, f)

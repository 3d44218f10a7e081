"""``maxnnx.host_memory``: importing maxnnx keeps the CPU backend's step buffers mapped.

Each case runs in a fresh interpreter, because the allocator setting only takes full
effect before JAX starts its backend. The page-fault counts are exact kernel counters
(``ru_minflt``), not timings.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from maxnnx.host_memory import _glibc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(_glibc() is None, reason='needs Linux with glibc')

# A jitted step with a 64 MiB temporary, as a train step has. The median over calls
# counts: while the heap grows to the process's high-water mark (a few calls, more on a
# loaded machine, where buffers are freed later) calls fault even with the setting.
_FAULTS_PER_CALL = textwrap.dedent('''
    import json, resource, statistics
    {imports}
    import jax, jax.numpy as jnp
    from maxnnx.host_memory import host_memory_status
    x = jnp.ones((2048, 256), jnp.float32)
    w = jnp.ones((256, 8192), jnp.float32)
    step = jax.jit(lambda x, w: jnp.sum(jnp.sin(x @ w), axis=0))  # a 64 MiB temporary
    faults = []
    for _ in range(30):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      step(x, w).block_until_ready()
      faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(dict(host_memory_status(), faults=statistics.median(faults))))
''')
_PAGES_PER_CALL = 2048 * 8192 * 4 // 4096


def jax_version() -> tuple[int, ...]:
  return tuple(int(p) for p in jax.__version__.split('.')[:2])


def _run(script: str, **env) -> dict:
  environ = {k: v for k, v in os.environ.items()
             if k not in ('MAXNNX_KEEP_HOST_MEMORY', 'JAX_PLATFORMS')}
  environ.update(env, PYTHONPATH=REPO + os.pathsep + environ.get('PYTHONPATH', ''))
  out = subprocess.run([sys.executable, '-c', script], env=environ, capture_output=True,
                       text=True, timeout=120, check=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def test_import_before_jax_stops_per_step_page_faults():
  tuned = _run(_FAULTS_PER_CALL.format(imports='import maxnnx'), JAX_PLATFORMS='cpu')
  assert tuned['applied'] and tuned['before_backend']
  assert tuned['faults'] < 0.01 * _PAGES_PER_CALL, tuned
  # The same program with the setting turned off faults in every page of the result with jax
  # 0.10's CPU runtime; jax 0.12's keeps its step temporaries itself (2-3 faults per call,
  # measured 2026-11-26), so there the setting saves nothing and costs nothing.
  untouched = _run(_FAULTS_PER_CALL.format(imports='import maxnnx'), JAX_PLATFORMS='cpu',
                   MAXNNX_KEEP_HOST_MEMORY='0')
  assert not untouched['applied']
  if jax_version() < (0, 11):
    assert untouched['faults'] > 0.5 * _PAGES_PER_CALL, untouched


def test_import_after_the_backend_started_says_so():
  late = _run(_FAULTS_PER_CALL.format(imports='import jax; jax.devices(); import maxnnx'),
              JAX_PLATFORMS='cpu')
  assert late['applied'] and not late['before_backend']


@pytest.mark.parametrize('platforms, env, applied', [
    ('cuda', '', False),        # an accelerator backend: the allocator is left alone
    ('cuda', '1', True),        # ... unless asked for
    ('cpu,cuda', '', True),
    ('cpu', 'off', False),
])
def test_applied_only_for_the_cpu_backend_or_when_asked(platforms, env, applied):
  script = ('import json, maxnnx\n'
            'from maxnnx.host_memory import host_memory_status, cpu_is_default_backend\n'
            'print(json.dumps(dict(host_memory_status(), cpu=cpu_is_default_backend())))')
  status = _run(script, JAX_PLATFORMS=platforms, MAXNNX_KEEP_HOST_MEMORY=env)
  assert status['applied'] is applied
  assert status['cpu'] is platforms.startswith('cpu')

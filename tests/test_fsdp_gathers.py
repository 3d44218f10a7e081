"""FSDP gathers the compute-dtype copy of the weights, not the float32 master.

The partitioner's choice is read from the HLO right after SPMD partitioning (XLA's CPU
pipeline later widens bf16 collectives to float32, so the optimized CPU HLO cannot show it).
The embedding lookup casts before its gather and still sums its gradient in float32.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxnnx.layers.embedding import lookup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_lookup_gradient_sums_repeated_rows_in_float32():
  rng = np.random.default_rng(0)
  table = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
  ids = jnp.asarray(np.concatenate([np.full(4000, 3), rng.integers(0, 16, 96)]).reshape(8, 512))
  dy = jnp.asarray(rng.normal(size=(8, 512, 8)), jnp.bfloat16)
  grad = jax.grad(lambda t: jnp.sum(lookup(t, ids, jnp.bfloat16).astype(jnp.float32)
                                    * dy.astype(jnp.float32)))(table)
  want = np.zeros((16, 8))
  np.add.at(want, np.asarray(ids), np.asarray(dy, np.float64))
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-4)
  assert grad.dtype == jnp.float32
  np.testing.assert_array_equal(lookup(table, ids, jnp.bfloat16),
                                jnp.take(table, ids, axis=0).astype(jnp.bfloat16))


_CHILD = textwrap.dedent('''
  import json, os, shutil, sys
  sys.path.insert(0, sys.argv[1])
  import maxnnx
  from benchmarks.collectives import bytes_by_dtype, partitioned_hlo
  from maxnnx.config import MeshConfig
  from maxnnx.train import TrainConfig, Trainer
  gathered = {}
  for tied in (True, False):
    model = maxnnx.get_preset('tiny', dtype='bfloat16', scan_layers=True,
                              tie_word_embeddings=tied)
    Trainer(model, TrainConfig(global_batch_size=8, seq_len=32,
                               mesh=MeshConfig(data=1, fsdp=8))).compile(verbose=False)
    gathered[str(tied)] = bytes_by_dtype(partitioned_hlo(sys.argv[2]))
    shutil.rmtree(sys.argv[2])
    os.makedirs(sys.argv[2])
  print(json.dumps(gathered))
''')


@pytest.mark.slow  # two compiles in a subprocess, 25-80 s
def test_fsdp_gathers_bf16_weights_tied_or_not(tmp_path):
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8 '
             f'--xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=spmd-partitioning')
  out = subprocess.run([sys.executable, '-c', _CHILD, ROOT, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  gathered = json.loads(out.stdout.strip().splitlines()[-1])
  for tied, sizes in gathered.items():
    assert set(sizes) == {'bf16'}, (tied, sizes)

"""Two processes joined by jax.distributed over 127.0.0.1 train like one device."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

from maxnnx.train import Trainer
from tests.multihost.common import global_batches, model_config, train_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_two_processes_match_one_device(tmp_path):
  port, out = _free_port(), str(tmp_path / 'losses.json')
  env = {**os.environ, 'PYTHONPATH': ROOT + os.pathsep + os.environ.get('PYTHONPATH', '')}
  procs = [subprocess.Popen([sys.executable, '-m', 'tests.multihost.worker', str(port), str(i),
                             out], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  for proc in procs:
    try:
      logs.append(proc.communicate(timeout=240)[0])
    finally:
      proc.kill()
  assert all(p.returncode == 0 for p in procs), '\n\n'.join(log[-3000:] for log in logs)
  result = json.load(open(out))
  assert result['processes'] == 2 and result['devices'] == 4

  trainer = Trainer(model_config(), train_config(), data=global_batches())
  reference = [m['loss'] for m in trainer.fit(log=lambda line: None)]
  np.testing.assert_allclose(result['losses'], reference, rtol=1e-4)

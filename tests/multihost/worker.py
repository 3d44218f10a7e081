"""One process of the 2-process training test (run by tests/test_multihost.py).

Usage: python worker.py PORT PROCESS_ID OUT_JSON. Each process owns 2 CPU
devices, joins the run through maxnnx.train.distributed, feeds only its own
rows of every global batch, and process 0 writes the per-step losses.
"""

import json
import os
import sys

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'

import jax  # noqa: E402

from maxnnx.train import distributed  # noqa: E402


def main(port: str, process_id: str, out: str) -> None:
  distributed.initialize(f'127.0.0.1:{port}', 2, int(process_id))
  from maxnnx.train import Trainer  # noqa: PLC0415
  from tests.multihost.common import global_batches, model_config, train_config  # noqa: PLC0415

  rows = train_config().global_batch_size // jax.process_count()
  start = jax.process_index() * rows
  local = (b[start:start + rows] for b in global_batches())
  trainer = Trainer(model_config(), train_config(mesh_data=2, mesh_fsdp=2), data=local)
  history = trainer.fit(log=lambda line: None)
  if jax.process_index() == 0:
    with open(out, 'w') as f:
      json.dump({'losses': [m['loss'] for m in history], 'devices': jax.device_count(),
                 'processes': jax.process_count()}, f)


if __name__ == '__main__':
  main(*sys.argv[1:])

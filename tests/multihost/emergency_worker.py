"""One process of the emergency-checkpoint tests (run by tests/test_emergency_multiprocess.py).

Usage: python -m tests.multihost.emergency_worker PORT PROCESS_ID PROCESSES ROOT DIE_AT.
Each process owns 2 CPU devices (mesh data=-1 x fsdp=2) and trains float32 steps on its rows
of the same global batches, with persistent checkpoints every 4 steps in ROOT/persistent and
local ones every step in ROOT/local; it first resumes from the newest complete checkpoint.
Process 0 appends each step's loss to ROOT/losses.jsonl; every process writes what its resume
found to ROOT/resume-<process>.json. With DIE_AT > 0, process 1 kills itself when step DIE_AT's
metrics arrive (its local checkpoint of the step before is written, this one is not).
"""

import json
import os
import sys

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'

import jax  # noqa: E402

from maxnnx.train import distributed  # noqa: E402

STEPS = 8


def main(port: str, process_id: str, processes: str, root: str, die_at: str) -> None:
  if int(processes) > 1:
    distributed.initialize(f'127.0.0.1:{port}', int(processes), int(process_id))
  import maxnnx  # noqa: PLC0415
  from maxnnx.config import MeshConfig  # noqa: PLC0415
  from maxnnx.train import TrainConfig, Trainer  # noqa: PLC0415
  from tests.multihost.common import BATCH, SEQ, StepBatches  # noqa: PLC0415

  me = jax.process_index()
  config = TrainConfig(steps=STEPS, global_batch_size=BATCH, seq_len=SEQ, learning_rate=1e-2,
                       warmup_steps=0, log_every=1, checkpoint_dir=os.path.join(root, 'persistent'),
                       checkpoint_every=4, enable_emergency_checkpoint=True,
                       local_checkpoint_directory=os.path.join(root, 'local'),
                       local_checkpoint_period=1, mesh=MeshConfig(data=-1, fsdp=2))

  def callback(trainer, record):
    if me == 0:
      with open(os.path.join(root, 'losses.jsonl'), 'a') as f:
        f.write(json.dumps({'step': record['step'], 'loss': record['loss'],
                            'processes': jax.process_count()}) + '\n')
    if me == 1 and record['step'] == int(die_at):
      os._exit(17)

  model = maxnnx.get_preset('tiny', num_layers=2,
                            runtime={'scan_layers': True, 'dtype': 'float32'})
  trainer = Trainer(model, config, data=StepBatches(me, jax.process_count()),
                    callbacks=[callback])
  step = trainer.restore_checkpoint()
  own = os.path.join(root, 'local', f'process-{me}', str(step), f'shards-{me}.npz')
  with open(os.path.join(root, f'resume-{me}.json'), 'w') as f:
    json.dump({'step': step, 'own_copy': os.path.exists(own),
               'grad_accum_steps': trainer.config.grad_accum_steps,
               'batch_note': trainer.batch_note}, f)
  trainer.fit(log=lambda line: None)
  trainer.close()


if __name__ == '__main__':
  main(*sys.argv[1:])

"""Model, run and data shared by the 2-process test and its 1-process reference."""

import numpy as np

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.train import TrainConfig

STEPS, BATCH, SEQ = 3, 8, 32


def model_config():
  return maxnnx.get_preset('tiny', scan_layers=True, num_layers=2)


def train_config(mesh_data: int = 1, mesh_fsdp: int = 1) -> TrainConfig:
  return TrainConfig(steps=STEPS, global_batch_size=BATCH, seq_len=SEQ, learning_rate=1e-2,
                     warmup_steps=0, log_every=STEPS,
                     mesh=MeshConfig(data=mesh_data, fsdp=mesh_fsdp))


def global_batches():
  """The same global [BATCH, SEQ + 1] token windows in every process."""
  rng = np.random.default_rng(7)
  stream = np.tile(np.arange(40), 50)
  while True:
    starts = rng.integers(0, len(stream) - SEQ - 1, BATCH)
    yield np.stack([stream[s:s + SEQ + 1] for s in starts])

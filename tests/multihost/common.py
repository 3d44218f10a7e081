"""Model, run and data shared by the 2-process test and its 1-process reference."""

import numpy as np

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.train import TrainConfig

STEPS, BATCH, SEQ = 3, 8, 32


def model_config():
  return maxnnx.get_preset('tiny', num_layers=2, runtime={'scan_layers': True})


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


def global_batch(n: int) -> np.ndarray:
  """Global batch ``n`` ([BATCH, SEQ + 1] token windows), drawn from ``n`` alone."""
  rng = np.random.default_rng((7, n))
  stream = np.tile(np.arange(40), 50)
  starts = rng.integers(0, len(stream) - SEQ - 1, BATCH)
  return np.stack([stream[s:s + SEQ + 1] for s in starts])


class StepBatches:
  """This process's rows of global batch 0, 1, 2... (all of them in one process), with its
  position saved in checkpoints: a run restarted on another number of processes goes on with
  the same global batches."""

  def __init__(self, process_index: int = 0, process_count: int = 1):
    self.rows = BATCH // process_count
    self.start = process_index * self.rows
    self.next = 0

  def __iter__(self):
    return self

  def __next__(self) -> np.ndarray:
    batch = global_batch(self.next)[self.start:self.start + self.rows]
    self.next += 1
    return batch

  def get_state(self) -> dict:
    return {'next': self.next}

  def set_state(self, state: dict) -> None:
    self.next = state['next']

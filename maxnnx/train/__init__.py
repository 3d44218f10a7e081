"""Training: a Trainer that owns model, optimizer, mesh and data."""

from maxnnx.train.config import TrainConfig
from maxnnx.train.optimizers import make_optimizer, make_schedule
from maxnnx.train.trainer import (
                                  Trainer,
                                  TrainingError,
                                  as_batch,
                                  cross_entropy_loss,
                                  synthetic_batches,
)

__all__ = ['TrainConfig', 'Trainer', 'TrainingError', 'as_batch', 'cross_entropy_loss',
           'make_optimizer', 'make_schedule', 'synthetic_batches']

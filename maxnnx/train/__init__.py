"""Training: a Trainer that owns model, optimizer, mesh and data."""

from maxnnx.train.config import TrainConfig
from maxnnx.train.distillation import DistillationObjective
from maxnnx.train.memory import device_memory_limit, format_memory_report, memory_report
from maxnnx.train.objectives import Objective, PretrainObjective
from maxnnx.train.optimizers import make_optimizer, make_schedule
from maxnnx.train.preference import DPOObjective
from maxnnx.train.trainer import (
                                  Trainer,
                                  TrainingError,
                                  as_batch,
                                  cross_entropy_loss,
                                  synthetic_batches,
)

__all__ = ['DPOObjective', 'DistillationObjective', 'Objective', 'PretrainObjective',
           'TrainConfig', 'Trainer', 'TrainingError', 'as_batch', 'cross_entropy_loss',
           'device_memory_limit', 'format_memory_report', 'make_optimizer', 'make_schedule',
           'memory_report', 'synthetic_batches']

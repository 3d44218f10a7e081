"""Training: a Trainer that owns model, optimizer, mesh and data, and :func:`run`, a whole
run as ``maxnnx train`` does it (run directory, tokenizer, ``final/`` export)."""

from maxnnx.train.config import TrainConfig
from maxnnx.train.distillation import DistillationObjective
from maxnnx.train.memory import device_memory_limit, format_memory_report, memory_report
from maxnnx.train.objectives import Objective, PretrainObjective
from maxnnx.train.optimizers import make_optimizer, make_schedule
from maxnnx.train.policy import PolicyView
from maxnnx.train.preference import DPOObjective
from maxnnx.train.run_settings import (
                                       PRETRAINING,
                                       PROCESS_SETTINGS,
                                       RUN_SETTINGS,
                                       RUN_TRAIN_DEFAULTS,
                                       RunRecipe,
                                       run_settings,
                                       split_settings,
)
from maxnnx.train.run_tokenizer import run_model_config
from maxnnx.train.runner import build_trainer, run, sample_text
from maxnnx.train.trainer import (
                                  Trainer,
                                  TrainingError,
                                  as_batch,
                                  cross_entropy_loss,
                                  synthetic_batches,
)

__all__ = ['PRETRAINING', 'PROCESS_SETTINGS', 'RUN_SETTINGS', 'RUN_TRAIN_DEFAULTS',
           'DPOObjective', 'DistillationObjective', 'Objective', 'PolicyView',
           'PretrainObjective', 'RunRecipe', 'TrainConfig', 'Trainer', 'TrainingError',
           'as_batch', 'build_trainer', 'cross_entropy_loss', 'device_memory_limit',
           'format_memory_report', 'make_optimizer', 'make_schedule', 'memory_report', 'run',
           'run_model_config', 'run_settings', 'sample_text', 'split_settings',
           'synthetic_batches']

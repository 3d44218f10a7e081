"""Training: a Trainer that owns model, optimizer and data."""

from maxnnx.train.trainer import Trainer, cross_entropy_loss, default_optimizer

__all__ = ['Trainer', 'cross_entropy_loss', 'default_optimizer']

"""The Trainer's checks: what a config, model and mesh must agree on before anything is built,
and what a batch must hold for its step to train.

Each check raises a one-line error naming the setting and the fix; the Trainer calls them while
it is constructed (and :func:`check_trains_on_something` on every batch ``fit`` takes).
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from maxnnx.config import ConfigError, MeshConfig, ModelConfig
from maxnnx.layers.qk_clip import records_max_logits
from maxnnx.parallel.pipeline import describe_schedule
from maxnnx.train.config import TrainConfig
from maxnnx.train.lora.adapters import has_adapters
from maxnnx.train.quantization import check_supported, is_quantized

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
  """Training cannot go on: a non-finite metric, or a config that cannot fit."""


def check_qk_clip(config: TrainConfig, model_config: ModelConfig, model) -> None:
  """Refuse ``qk_clip_threshold`` where QK-clip cannot hold the logits down."""
  if not config.qk_clip_threshold:
    return
  where = f'TrainConfig.qk_clip_threshold={config.qk_clip_threshold:g}'
  if model_config.attention.qk_norm != 'none':
    raise ConfigError(f"{where}: this model normalises queries and keys "
                      f"(model.attention.qk_norm={model_config.attention.qk_norm}), which fixes "
                      "each head's scale, so rescaling the projections cannot lower its logits "
                      '(the norm bounds them already); set qk_clip_threshold=0.')
  if config.lora.enabled:
    raise ConfigError(f'{where} rescales the base query/key projections, which LoRA freezes; '
                      'train without LoRA or set qk_clip_threshold=0.')
  if not records_max_logits(model):
    raise ConfigError(f'{where} needs attention layers that record their max logits: build '
                      'the model with ModelConfig.runtime.record_max_logits=True (QK-clip '
                      'covers multi-head, grouped-query and MLA attention).')


def check_parameter_streaming(config: TrainConfig, model_config: ModelConfig) -> None:
  """``parameter_streaming`` streams a scanned layer stack into rematerialised blocks: refuse
  an unscanned stack, and ``remat_policy=none`` (the backward pass would keep every layer's
  device copy)."""
  if not config.parameter_streaming:
    return
  if not model_config.runtime.scan_layers:
    raise ConfigError('TrainConfig.parameter_streaming=True streams a scanned layer stack one '
                      'layer at a time, but the model has scan_layers=False: set '
                      'scan_layers=True, or use parameter_memory_host_offload alone.')
  if model_config.runtime.remat_policy == 'none':
    raise ConfigError('TrainConfig.parameter_streaming=True needs a remat policy: with '
                      'remat_policy=none the backward pass keeps every layer\'s device copy of '
                      'its parameters; set remat_policy=full (or another policy).')


def check_mtp_context(model_config: ModelConfig, mesh_config: MeshConfig, mesh: Mesh) -> None:
  """Refuse multi-token prediction under the context load-balancing permutation."""
  if (model_config.mtp.num_layers and mesh_config.context_load_balance
      and dict(mesh.shape).get('context', 1) > 1):
    raise ValueError('Multi-token prediction shifts tokens along the sequence, which the '
                     'context load-balancing permutation reorders: set '
                     'MeshConfig.context_load_balance=False (or mtp.num_layers=0).')


#: Batches in a row without a token to train on after which ``fit`` stops. One such batch can be
#: bad luck with a small batch of sparse data (its step changes little); several in a row mean
#: the data trains on nothing.
EMPTY_BATCHES_BEFORE_STOP = 3


def trains_on_nothing(batch) -> bool:
  """Whether ``batch`` holds no token to train on (``loss_mask`` 0 everywhere: loss 0, gradient
  0). Told on one process only: with several, each sees just its rows."""
  if not isinstance(batch, dict) or 'loss_mask' not in batch or jax.process_count() > 1:
    return False
  return not np.asarray(batch['loss_mask']).any()


def check_trains_on_something(empty_in_a_row: int, step: int) -> None:
  """Stop before the step that would be the ``EMPTY_BATCHES_BEFORE_STOP``-th in a row to train
  on nothing."""
  if empty_in_a_row >= EMPTY_BATCHES_BEFORE_STOP:
    raise TrainingError(
        f'The batches of steps {step - empty_in_a_row + 1}-{step} hold no token to train on '
        '(their loss_mask is 0 everywhere), so the steps would change nothing; the records in '
        'them lack trained tokens (e.g. chat records without an assistant answer within '
        'seq_len). Check the data.')


def row_range(indices, num_rows: int) -> slice:
  """The rows that device ``indices`` (tuples of slices, rows first) cover together, as one
  slice; a ``ValueError`` when they leave a gap."""
  held = sorted({index[0].indices(num_rows)[:2] for index in indices})
  if any(stop < start for (_, stop), (start, _) in zip(held, held[1:])):
    raise ValueError(f'This process holds batch rows {held} (start, stop), not one contiguous '
                     'range; order the mesh devices by process (MeshConfig, make_mesh).')
  return slice(held[0][0], max(stop for _, stop in held))


def quantization_name(config: TrainConfig, model_config: ModelConfig, model, mesh) -> str:
  """``config.quantization``, or ``custom`` for a model quantized by the caller."""
  if config.quantization != 'none' and (config.lora.enabled or (model is not None
                                                                and has_adapters(model))):
    raise ValueError(f"TrainConfig.quantization='{config.quantization}' (quantization-aware "
                     'training) does not combine with LoRA adapters; set quantization=\'none\' '
                     "and keep the base quantized with lora.base_quantization='int8' or 'int4'.")
  if model is not None and has_adapters(model):
    if config.lora.enabled:
      raise ValueError('The model already has LoRA adapters and TrainConfig.lora.rank > 0 '
                       'would add more: set lora.rank=0 to train the adapters it has.')
    return 'none'  # qwix's LoRA wrapper, not quantization-aware training
  if model is not None and is_quantized(model):
    if config.quantization != 'none':
      raise ValueError(f"TrainConfig.quantization='{config.quantization}' but the model is "
                       "already quantized; set quantization='none' to train it as it is.")
    return 'custom'
  if config.quantization != 'none':
    check_supported(model_config, config.quantization, mesh_shape=dict(mesh.shape))
  return config.quantization


def check_pipeline_schedule(model_config: ModelConfig, mesh: MeshConfig, stages: int) -> str:
  """Refuse a pipeline schedule the stack cannot follow; returns a line describing its bubble
  (the Trainer logs it)."""
  micro, repeats = mesh.pipeline_microbatches or stages, mesh.pipeline_repeats
  layers = model_config.num_layers
  if layers % (stages * repeats):
    raise ValueError(f'Pipeline: num_layers={layers} must be divisible by stage x '
                     f'pipeline_repeats = {stages} x {repeats} (the chunks of the stack); pick '
                     'a stage count and MeshConfig.pipeline_repeats that divide it.')
  if repeats > 1 and micro < stages:
    raise ValueError(f'MeshConfig.pipeline_repeats={repeats} (a circular pipeline) needs '
                     f'pipeline_microbatches >= stage ({stages}), got {micro}.')
  return describe_schedule(stages, micro, repeats)


def check_pipeline_layout(model: nnx.Module, stages: int, what: str) -> None:
  """A built model on a mesh with ``stage > 1`` must have a scanned layer stack."""
  model_config = getattr(model, 'config', None)
  scanned = model_config.runtime.scan_layers if isinstance(model_config, ModelConfig) else True
  if stages > 1 and not scanned:
    raise ValueError(f'The mesh has stage={stages} (pipeline parallelism), which runs a scanned '
                     f'layer stack, but the {what} was built with scan_layers=False: build it '
                     'with scan_layers=True (e.g. Transformer(config.replace(scan_layers=True)) '
                     'or from_pretrained(..., scan_layers=True)), or pass its config or preset '
                     'name so the Trainer builds it scanned.')


def image_shape(config: TrainConfig, model_config: ModelConfig) -> tuple[int, ...] | None:
  """``(images_per_row, channels, H, W)`` of image+text batches, or ``None``."""
  if not config.images_per_row:
    return None
  v = model_config.vision
  if not v.num_layers:
    raise ValueError('TrainConfig.images_per_row > 0 needs a model with a vision tower '
                     '(ModelConfig.vision.num_layers > 0).')
  return (config.images_per_row, v.num_channels, v.image_size, v.image_size)


def check_batch_and_length(config: TrainConfig, model_config: ModelConfig, mesh: Mesh,
                            rules) -> None:
  """Refuse a ``seq_len`` past the model's positions, and a batch the mesh axes that split it
  do not divide (an axis sized by ``-1`` only warns: the batch is then replicated along it)."""
  if config.seq_len > model_config.max_position_embeddings:
    raise ValueError(f'seq_len={config.seq_len} is longer than the model\'s '
                     f'max_position_embeddings={model_config.max_position_embeddings}.')
  axes = dict(rules).get('activation_batch') or ()
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  sizes = dict(mesh.shape)
  split = [a for a in axes if sizes.get(a, 1) > 1]
  product = int(np.prod([sizes[a] for a in split])) if split else 1
  if config.global_batch_size % product == 0:
    return
  named = ' * '.join(f'mesh.{a}={sizes[a]}' for a in split)
  message = (f'global_batch_size={config.global_batch_size} is not divisible by {named} '
             f'(= {product}), the mesh axes that split the batch')
  automatic = any(getattr(config.mesh, a, 1) == -1 or getattr(config.mesh, f'dcn_{a}', 1) == -1
                  for a in split)
  if not automatic:
    raise ValueError(message + ': change one of them.')
  logger.warning('%s; the batch is replicated along them instead. Set mesh.%s to a divisor of '
                 'the batch to split it.', message, split[0])


__all__ = ['EMPTY_BATCHES_BEFORE_STOP', 'TrainingError', 'check_batch_and_length',
           'check_mtp_context', 'check_pipeline_layout',
           'check_pipeline_schedule', 'check_qk_clip', 'check_trains_on_something', 'image_shape',
           'quantization_name', 'row_range', 'trains_on_nothing']

"""``Trainer``: model, optimizer, mesh and data in one object a notebook can drive.

::

  trainer = Trainer('tiny', TrainConfig(steps=200, mesh=MeshConfig(fsdp=-1)), data=batches)
  trainer.compile()          # lower + compile for the mesh; prints per-device memory
  trainer.fit()              # or trainer.step() by hand, looking at trainer.model in between
  trainer.history            # one dict of metrics per step

The loss is an objective (:mod:`maxnnx.train.objectives`, default
:class:`PretrainObjective`); the step itself is the pure functions of
:mod:`maxnnx.train.step`, which the Trainer jits over the split nnx state of
``(model, optimizer)`` with explicit input/output shardings and donated buffers.
The Trainer does the orchestration: placement, compile, fit, evaluate,
checkpoints, callbacks and metric writers. Inside
the loop nothing waits for the device except when metrics are fetched every
``log_every`` steps; per-step metrics stay on the device until then.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from maxnnx import sharding
from maxnnx.config import ConfigError, MeshConfig, ModelConfig, check_expert_split
from maxnnx.layers.qk_clip import records_max_logits
from maxnnx.parallel.pipeline import describe_schedule
from maxnnx.train import diagnostics
from maxnnx.train import flops as flops_lib
from maxnnx.train import step as step_lib
from maxnnx.train.batches import (  # noqa: F401 (re-exported)
  BATCH_AXES,
  BATCH_KEYS,
  IMAGE_AXES,
  as_batch,
  context_permutation,
  synthetic_batches,
)
from maxnnx.train.config import TrainConfig
from maxnnx.train.goodput import GoodputRecorder, read_high_water, write_high_water
from maxnnx.train.lora.adapters import apply_lora, has_adapters, trainable_filter
from maxnnx.train.loss import cross_entropy_loss, masked_cross_entropy
from maxnnx.train.memory import (
  compiler_oom_message,
  device_memory_limit,
  format_memory_report,
  memory_report,
  overshoot_message,
)
from maxnnx.train.metrics import JsonlWriter, ProgressBar, TensorBoardWriter, format_metrics
from maxnnx.train.monitor import FitMonitor
from maxnnx.train.objectives import Objective, PretrainObjective
from maxnnx.train.optimizer_placement import (
  optimizer_state_on_host,
  optimizer_state_over_data,
  parameters_on_device,
  parameters_on_host,
)
from maxnnx.train.optimizers import make_optimizer, make_schedule, schedule_change
from maxnnx.train.preemption import StopRequest, StopRequested
from maxnnx.train.quantization import check_supported, is_quantized, quantize

logger = logging.getLogger(__name__)



class TrainingError(RuntimeError):
  """Training cannot go on: a non-finite metric, or a config that cannot fit."""


def _check_qk_clip(config: TrainConfig, model_config: ModelConfig, model, stages: int) -> None:
  """Refuse ``qk_clip_threshold`` where QK-clip cannot hold the logits down."""
  if not config.qk_clip_threshold:
    return
  where = f'TrainConfig.qk_clip_threshold={config.qk_clip_threshold:g}'
  if model_config.qk_norm != 'none':
    raise ConfigError(f"{where}: this model normalises queries and keys (model.qk_norm="
                      f"{model_config.qk_norm}), which fixes each head's scale, so rescaling the "
                      'projections cannot lower its logits (the norm bounds them already); '
                      'set qk_clip_threshold=0.')
  if stages > 1:
    raise ConfigError(f'{where}: pipeline stages (mesh.stage={stages}) do not carry '
                      "the layers' max logits out yet; set mesh.stage=1 or qk_clip_threshold=0.")
  if config.lora.enabled:
    raise ConfigError(f'{where} rescales the base query/key projections, which LoRA freezes; '
                      'train without LoRA or set qk_clip_threshold=0.')
  if not records_max_logits(model):
    raise ConfigError(f'{where} needs attention layers that record their max logits: build '
                      'the model with ModelConfig.runtime.record_max_logits=True (QK-clip '
                      'covers multi-head, grouped-query and MLA attention).')


def _next_batch(data) -> Any:
  if hasattr(data, 'next') and not hasattr(data, '__next__'):
    return data.next()  # TokenWindows-style sources
  return next(data)


#: Batches in a row without a token to train on after which ``fit`` stops. One such batch can be
#: bad luck with a small batch of sparse data (its step changes little); several in a row mean
#: the data trains on nothing.
EMPTY_BATCHES_BEFORE_STOP = 3


def _trains_on_nothing(batch) -> bool:
  """Whether ``batch`` holds no token to train on (``loss_mask`` 0 everywhere: loss 0, gradient
  0). Told on one process only: with several, each sees just its rows."""
  if not isinstance(batch, dict) or 'loss_mask' not in batch or jax.process_count() > 1:
    return False
  return not np.asarray(batch['loss_mask']).any()


def _check_trains_on_something(empty_in_a_row: int, step: int) -> None:
  """Stop before the step that would be the ``EMPTY_BATCHES_BEFORE_STOP``-th in a row to train
  on nothing."""
  if empty_in_a_row >= EMPTY_BATCHES_BEFORE_STOP:
    raise TrainingError(
        f'The batches of steps {step - empty_in_a_row + 1}-{step} hold no token to train on '
        '(their loss_mask is 0 everywhere), so the steps would change nothing; the records in '
        'them lack trained tokens (e.g. chat records without an assistant answer within '
        'seq_len). Check the data.')


# -- the trainer -------------------------------------------------------------------

def row_range(indices, num_rows: int) -> slice:
  """The rows that device ``indices`` (tuples of slices, rows first) cover together, as one
  slice; a ``ValueError`` when they leave a gap."""
  held = sorted({index[0].indices(num_rows)[:2] for index in indices})
  if any(stop < start for (_, stop), (start, _) in zip(held, held[1:])):
    raise ValueError(f'This process holds batch rows {held} (start, stop), not one contiguous '
                     'range; order the mesh devices by process (MeshConfig, make_mesh).')
  return slice(held[0][0], max(stop for _, stop in held))


class Trainer:
  """Trains a maxnnx model on a device mesh.

  Args:
    model: a model instance (e.g. ``maxnnx.Transformer`` or one from
      ``from_pretrained``), a :class:`ModelConfig`, or a preset name. Configs and
      names are initialised directly in their sharded layout, never on one device.
    config: the :class:`TrainConfig` (steps, batch, optimizer, mesh, logging…).
    objective: what the step minimises (:mod:`maxnnx.train.objectives`);
      ``None`` is :class:`PretrainObjective` with ``config``'s loss weights.
      Its ``frozen_models`` are placed on the mesh like the model and passed
      to its loss, but never trained. With ``mesh.stage > 1`` a model built
      here from a config or preset gets ``scan_layers=True``; a model given
      built must already have it.
    data: training batches: an iterator of batch dicts (see :func:`as_batch`),
      or an object with ``next()`` returning ``[batch, seq_len + 1]`` token
      windows. ``None`` uses random tokens. In a multi-host run each process
      gives its own rows (``global_batch_size / process_count`` of them).
      A source with ``pop_metrics()`` (RL rollouts) adds the host-side metrics
      it returns after each ``next`` to that step's record.
    eval_data: held-out batches: an iterable of batches, or an object with
      ``eval_batches(n)`` (``data`` is asked for that when this is ``None``).
    optimizer: an optax transformation overriding the one ``config`` describes.
    mesh: a ``jax.sharding.Mesh`` overriding the one ``config.mesh`` describes.
    callbacks: functions ``callback(trainer, metrics)`` called for every step
      once its metrics reach the host.
    trainable: the nnx filter of the parameters to train (differentiated and in
      the optimizer); ``None`` derives it from the model: its LoRA adapters
      (``nnx.LoRAParam``) when it has some, else every ``nnx.Param``. With
      ``config.lora.rank > 0`` the Trainer first adds adapters to the model
      (:func:`maxnnx.train.lora.apply_lora`).

  Attributes:
    history: one metrics dict per step (``step``, ``loss``, ``lr``,
      ``grad_norm``, ``tokens_per_s``, ``step_time_s`` (seconds per step over
      its ``log_every`` window), ``tflops_per_device``, ``mfu``, the
      ``goodput/...`` totals in the last step of a ``fit``,
      ``mtp_loss`` with multi-token prediction (mean over depths, unscaled),
      and ``eval_loss`` where evaluated).
    mesh: the device mesh; ``rules`` the logical-axis rules in use.
    model_config: the model's :class:`ModelConfig`.
    quantization: ``config.quantization``, or ``custom`` when ``model`` came
      quantized (see :mod:`maxnnx.train.quantization`).
    trainable: the nnx filter of the trained parameters.
    objective: the objective in use, bound to ``config``.
    reached_target: ``{'step', 'eval_loss', 'target'}`` when the last ``fit`` ended early
      because the held-out loss reached ``config.target_eval_loss``; else ``None``.
    stopped_by: the signal (``'SIGTERM'``, ``'SIGINT'``) that ended the last ``fit`` early,
      after finishing its step and saving a checkpoint (with ``checkpoint_dir``); else ``None``.
  """

  def __init__(self, model: nnx.Module | ModelConfig | str, config: TrainConfig | None = None,
               objective: Objective | None = None, *, data=None, eval_data=None,
               optimizer: optax.GradientTransformation | None = None,
               mesh: Mesh | None = None, callbacks: Iterable[Callable] = (), trainable=None):
    self.config = config = config or TrainConfig()
    self.mesh = mesh if mesh is not None else sharding.make_mesh(config.mesh)
    self.rules = sharding.logical_rules(config.mesh)
    self.schedule = make_schedule(config)
    self.callbacks = list(callbacks)
    self.history: list[dict] = []
    self._pending: list[tuple[int, Any, dict]] = []  # (step, device metrics, host metrics)
    self._compiled = None
    self._eval_compiled = None
    self._writers: list = []
    self._checkpoints = None  # a CheckpointManager once checkpoint_dir is used
    self._step_offset = 0  # steps taken before the restored checkpoint, not in history
    # What resuming a checkpoint made for another `steps` does to the schedule (one line).
    self.schedule_note: str | None = None
    self.stopped_by: str | None = None
    self.reached_target: dict | None = None
    self._goodput = GoodputRecorder()
    self._empty_batches_in_a_row = 0
    self._high_water: int | None = None  # the furthest step any run of checkpoint_dir reached
    self._high_water_saved, self._high_water_written = 0, -float('inf')

    if isinstance(model, str):
      from maxnnx.presets import get_preset  # noqa: PLC0415 (presets import models)
      model = get_preset(model)
    self.objective = (objective if objective is not None else PretrainObjective()).bind(config)
    stages = dict(self.mesh.shape).get('stage', 1)
    concrete = None
    if isinstance(model, ModelConfig):
      if config.qk_clip_threshold and not model.runtime.record_max_logits:
        model = model.replace(record_max_logits=True)  # what QK-clip reads
      if stages > 1 and not model.runtime.scan_layers:
        logger.info('mesh.stage=%d: building the model with scan_layers=True (pipeline '
                    'parallelism runs a scanned layer stack).', stages)
        model = model.replace(scan_layers=True)
      self.model_config = model
      abstract_model = nnx.eval_shape(lambda: _new_model(model, config.seed))
    else:
      _check_pipeline_layout(model, stages, 'model')
      self.model_config = model.config
      concrete = abstract_model = model
    if stages > 1:
      _check_pipeline_schedule(self.model_config, config.mesh, stages)
    check_expert_split(config.mesh.expert_parallel_strategy, self.model_config.moe.num_experts,
                       dict(self.mesh.shape).get('expert', 1))
    self.quantization = _quantization_name(config, self.model_config, concrete, self.mesh)
    if concrete is not None and config.quantization != 'none':
      concrete = quantize(concrete, config.quantization)
    if config.lora.enabled:
      if concrete is not None:
        concrete = abstract_model = apply_lora(concrete, config.lora, seed=config.seed)
      else:
        abstract_model = nnx.eval_shape(lambda: apply_lora(_new_model(model, config.seed),
                                                           config.lora, seed=config.seed))
    _check_qk_clip(config, self.model_config, abstract_model, stages)
    self.trainable = trainable if trainable is not None else trainable_filter(abstract_model)
    indexer_stage = self.model_config.mla.indexer_training
    if indexer_stage != 'off' and stages > 1:
      raise ConfigError(f'model.mla.indexer_training={indexer_stage}: pipeline stages (mesh.stage='
                        f"{stages}) do not carry the layers' indexer loss out yet; set "
                        'mesh.stage=1.')
    if indexer_stage == 'dense_warmup' and trainable is None:
      # DeepSeek V3.2's warm-up: everything but the indexer stays frozen.
      self.trainable = nnx.All(self.trainable, nnx.PathContains('indexer'))
    if (self.model_config.mtp.num_layers and config.mesh.context_load_balance
        and dict(self.mesh.shape).get('context', 1) > 1):
      raise ValueError('Multi-token prediction shifts tokens along the sequence, which the '
                       'context load-balancing permutation reorders: set '
                       'MeshConfig.context_load_balance=False (or mtp.num_layers=0).')
    self.tx = optimizer if optimizer is not None else make_optimizer(config, abstract_model)
    build = self._builder(self.model_config) if concrete is None else None

    # Built outside the mesh context: flax would read logical names as mesh axes there.
    if concrete is not None:
      optimizer_obj = nnx.Optimizer(concrete, self.tx, wrt=self.trainable)
      self._graphdef, state = nnx.split((concrete, optimizer_obj))
    else:
      self._graphdef, state = nnx.split(nnx.eval_shape(build))
      self._build = build
    self._state_shardings = sharding.state_shardings(state, self.mesh, self.rules)
    if config.shard_optimizer_over_data:
      self._state_shardings = optimizer_state_over_data(self._state_shardings, state)
    if config.optimizer_memory_host_offload:
      self._state_shardings = optimizer_state_on_host(self._state_shardings)
    # What trainer.model / trainer.optimizer hold: device arrays even when the step's state
    # keeps the parameters in host memory (code outside the step computes with them).
    self._object_shardings = self._state_shardings
    if config.parameter_memory_host_offload:
      self._state_shardings = parameters_on_host(self._state_shardings)
      self._object_shardings = parameters_on_device(self._state_shardings)
    self._abstract_state = _abstract_tree(state, self._state_shardings)
    # A given model is placed now; a built one on first use, after compile() had its say.
    self._state = jax.device_put(state, self._state_shardings) if concrete is not None else None
    self._extra_sharding = NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    self._abstract_extra = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._extra_sharding),
        jax.eval_shape(step_lib.initial_guard_state))
    self._place_frozen(stages)
    self._objects = None
    self._extra = None
    _check_batch_and_length(config, self.model_config, self.mesh, self.rules)
    self._token_sharding = NamedSharding(
        self.mesh, sharding.spec_for(BATCH_AXES, self.rules, self.mesh,
                                     (config.global_batch_size, config.seq_len)))
    self._image_shape = _image_shape(config, self.model_config)
    self._batch_sharding = self._token_sharding
    if self._image_shape is not None:  # one sharding per batch field
      image_sharding = NamedSharding(
          self.mesh, sharding.spec_for(IMAGE_AXES, self.rules, self.mesh,
                                       (config.global_batch_size, *self._image_shape)))
      self._batch_sharding = {**{k: self._token_sharding for k in self._abstract_batch()},
                              'pixel_values': image_sharding}
    self.data = data if data is not None else synthetic_batches(
        self.model_config.vocab_size, self._local_batch_size(), config.seq_len, config.seed)
    self.eval_data = eval_data
    self.flops_per_token = flops_lib.training_flops_per_token(self.model_config, config.seq_len)
    self.peak_flops, self.peak_source = (
        (config.peak_tflops * 1e12, 'TrainConfig.peak_tflops') if config.peak_tflops
        else flops_lib.peak_flops_per_device(self.mesh.devices.flat[0]))

  # -- construction helpers ------------------------------------------------------

  def _builder(self, model_config: ModelConfig) -> Callable:
    seed, tx, trainable = self.config.seed, self.tx, self.trainable
    recipe, lora = self.config.quantization, self.config.lora

    def build():
      model = _new_model(model_config, seed)
      if recipe != 'none':
        model = quantize(model, recipe)
      if lora.enabled:
        model = apply_lora(model, lora, seed=seed)
      return model, nnx.Optimizer(model, tx, wrt=trainable)

    return build

  def _place_frozen(self, stages: int) -> None:
    """Shard the objective's frozen models by the model's rules (never trained or donated)."""
    frozen = dict(self.objective.frozen_models)
    for name, module in frozen.items():
      if not isinstance(module, nnx.Module):
        raise TypeError(f'objective.frozen_models[{name!r}] must be an nnx.Module, got '
                        f'{type(module).__name__}.')
      _check_pipeline_layout(module, stages, f'frozen model {name!r}')
    self._frozen_graphdef, self._frozen_state, self._frozen_shardings = None, None, None
    if frozen:
      self._frozen_graphdef, state = nnx.split(frozen)
      self._frozen_shardings = sharding.state_shardings(state, self.mesh, self.rules)
      # Never alias: a frozen model may share arrays with the trained one (nnx.clone, or
      # the policy itself as DPO's reference), whose buffers the step donates.
      self._frozen_state = jax.device_put(state, self._frozen_shardings, may_alias=False)
    self._frozen_objects = None

  @property
  def frozen_models(self) -> dict[str, nnx.Module]:
    """The objective's frozen models as placed on the mesh (name -> module)."""
    if self._frozen_graphdef is None:
      return {}
    if self._frozen_objects is None:
      self._frozen_objects = nnx.merge(self._frozen_graphdef, self._frozen_state)
    return self._frozen_objects

  def _context(self):
    mesh = self.config.mesh
    return sharding.use_mesh(self.mesh, self.rules,
                             pipeline_microbatches=mesh.pipeline_microbatches,
                             pipeline_repeats=mesh.pipeline_repeats,
                             context_parallel_strategy=mesh.context_parallel_strategy,
                             expert_parallel_strategy=mesh.expert_parallel_strategy)

  def mesh_context(self):
    """A context in which the trainer's mesh and logical-axis rules apply (to run the model
    outside the step, e.g. RL rollouts on the same mesh)."""
    return self._context()

  def place_batch(self, batch) -> dict:
    """``batch`` checked (shape, token ids, the objective's fields) and laid out on the
    mesh as the step takes it."""
    return self._place(batch)

  def local_rows(self) -> slice:
    """The rows of the global batch that this process's devices hold, where
    :meth:`place_batch` puts this process's batch (in order). A single process: all of them.

    Raises:
      ValueError: if they are not one contiguous range (a mesh whose data axis interleaves
        the processes' devices).
    """
    shape = (self.config.global_batch_size, self.config.seq_len)
    return row_range(self._token_sharding.addressable_devices_indices_map(shape).values(),
                     shape[0])

  def _local_batch_size(self) -> int:
    return self.config.global_batch_size // jax.process_count()

  def _materialise(self) -> None:
    if self._state is None:
      init = jax.jit(lambda: nnx.state(self._build()), out_shardings=self._state_shardings)
      self._state = init()
    if self._extra is None:
      self._extra = jax.device_put(step_lib.initial_guard_state(), self._extra_sharding)

  # -- the live objects ---------------------------------------------------------------

  @property
  def model(self) -> nnx.Module:
    """The model, with the current (sharded) parameters; edit it freely between steps."""
    return self._live()[0]

  @property
  def optimizer(self) -> nnx.Optimizer:
    """The ``nnx.Optimizer`` (its ``step`` and optimizer state)."""
    return self._live()[1]

  def _live(self):
    self._materialise()
    if self._objects is None:
      self._objects = nnx.merge(self._graphdef, self._object_view(self._state))
    return self._objects

  def _object_view(self, state):
    """``state`` as the live objects hold it: with the parameters on the devices."""
    if self._object_shardings is self._state_shardings:
      return state
    return jax.device_put(state, self._object_shardings)

  def _sync_from_objects(self) -> None:
    """Take back edits a user made to ``trainer.model`` between steps."""
    if self._objects is not None:
      self._state = jax.device_put(nnx.state(self._objects), self._state_shardings)

  def _sync_to_objects(self) -> None:
    """Point the live model/optimizer (if a user holds them) at the new state."""
    if self._objects is not None:
      nnx.update(self._objects, self._object_view(self._state))

  @property
  def step_count(self) -> int:
    """Optimizer steps taken so far."""
    return self._step_offset + len(self.history) + len(self._pending)

  # -- the compiled step ------------------------------------------------------------------

  def _abstract_batch(self) -> dict:
    shape = (self.config.global_batch_size, self.config.seq_len)
    dtypes = {'inputs': jnp.int32, 'targets': jnp.int32, 'segment_ids': jnp.int32,
              'positions': jnp.int32, 'loss_mask': jnp.float32,
              **dict(self.objective.batch_fields)}
    out = {k: jax.ShapeDtypeStruct(shape, dtypes[k], sharding=self._token_sharding)
           for k in dtypes}
    if self._image_shape is not None and isinstance(self._batch_sharding, dict):
      out['pixel_values'] = jax.ShapeDtypeStruct(
          (shape[0], *self._image_shape), jnp.float32,
          sharding=self._batch_sharding['pixel_values'])
    return out

  def compile(self, *, verbose: bool = True) -> dict:
    """Lower and compile the train step for the mesh without running it.

    Nothing is allocated: parameters and optimizer state are abstract here.
    Returns a memory report (bytes per device) and raises :class:`TrainingError`
    when the step needs more memory per device than the limit
    (``TrainConfig.memory_limit_gib`` or the device's own).
    """
    with self._goodput.time('compile'):
      report, compiled = self._compile_train_step()
    self.memory = report
    quantized = f'; {self.quantization} quantized training' if self.quantization != 'none' else ''
    if verbose:
      print(format_memory_report(report) + quantized)
    else:
      logger.info(format_memory_report(report) + quantized)
    overshoot = overshoot_message(report)
    if overshoot:
      raise TrainingError(overshoot)
    self._compiled = compiled
    return report

  def _compile_train_step(self) -> tuple[dict, Any]:
    cfg = self.config
    if cfg.compile_cache:
      diagnostics.enable_compile_cache(cfg.compile_cache)
    start = time.perf_counter()
    train_step = functools.partial(step_lib.train_step, self._graphdef,
                                   frozen_graphdef=self._frozen_graphdef,
                                   objective=self.objective, config=self.config,
                                   schedule=self.schedule, trainable=self.trainable)
    with self._context():
      jitted = jax.jit(train_step,
                       in_shardings=(self._state_shardings, self._extra_sharding,
                                     self._batch_sharding, self._frozen_shardings),
                       out_shardings=(self._state_shardings, self._extra_sharding, None),
                       donate_argnums=(0, 1))
      args = (self._abstract_state, self._abstract_extra, self._abstract_batch(),
              self._frozen_state)
      traced = jitted.trace(*args) if cfg.dump_hlo else None
      lowered = traced.lower() if traced is not None else jitted.lower(*args)
      with diagnostics.CacheEvents().watch() as cache:
        try:
          compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
          message = compiler_oom_message(e)
          if message is None:
            raise
          raise TrainingError(message) from None
    report = memory_report(compiled, self.mesh, cfg.memory_limit_gib)
    report['compile_seconds'] = time.perf_counter() - start
    report['compile_cache'] = cache.outcome
    if cfg.dump_hlo:
      diagnostics.dump_hlo(diagnostics.hlo_directory(cfg), 'train_step', traced, lowered, compiled)
    return report, compiled

  # -- stepping ---------------------------------------------------------------------------

  def _place(self, batch: dict) -> dict:
    cfg = self.config
    local = as_batch(batch, extra=self.objective.batch_fields, image_shape=self._image_shape)
    rows, length = local['inputs'].shape
    if rows != self._local_batch_size() or length != cfg.seq_len:
      raise ValueError(f'Batch is {rows} x {length} tokens but this process expects '
                       f'{self._local_batch_size()} x {cfg.seq_len} (global_batch_size '
                       f'{cfg.global_batch_size} over {jax.process_count()} process(es), '
                       f'seq_len {cfg.seq_len}).')
    bad = (local['inputs'] < 0) | (local['inputs'] >= self.model_config.vocab_size)
    bad |= (local['targets'] < 0) | (local['targets'] >= self.model_config.vocab_size)
    if bad.any():
      raise ValueError(f'Batch has token ids outside [0, {self.model_config.vocab_size}); '
                       'check the tokenizer matches the model (vocab_size).')
    context = dict(self.mesh.shape).get('context', 1)
    if context > 1 and cfg.mesh.context_load_balance:
      order = context_permutation(length, context)
      local = {k: v if k == 'pixel_values' else v[:, order] for k, v in local.items()}
    shardings = (self._batch_sharding if isinstance(self._batch_sharding, dict)
                 else dict.fromkeys(local, self._batch_sharding))
    return {k: jax.make_array_from_process_local_data(shardings[k], v)
            for k, v in local.items()}

  def step(self, batch=None) -> dict | None:
    """One optimizer step on ``batch`` (default: the next batch of ``data``).

    Returns the step's metrics when they are fetched this step (every
    ``log_every`` steps and when stepping by hand with ``fetch``), else ``None``.
    """
    return self._step(batch, fetch=True)

  def _step(self, batch, fetch: bool) -> dict | None:
    if self._compiled is None:
      self.compile(verbose=False)
    self._sync_from_objects()
    self._materialise()
    if not self._pending:
      self._window_start = time.perf_counter()
    host_metrics = {}
    if batch is None:
      with self._goodput.time('data'):
        batch = _next_batch(self.data)
      self._empty_batches_in_a_row = (self._empty_batches_in_a_row + 1
                                      if _trains_on_nothing(batch) else 0)
      _check_trains_on_something(self._empty_batches_in_a_row, self.step_count + 1)
      if hasattr(self.data, 'pop_metrics'):  # e.g. RL rollouts: rewards, lengths
        host_metrics = dict(self.data.pop_metrics() or {})
    placed = self._place(batch)
    self._state, self._extra, metrics = self._compiled(self._state, self._extra, placed,
                                                       self._frozen_state)
    self._sync_to_objects()
    self._pending.append((self.step_count + 1, metrics, host_metrics))
    return self.flush_metrics() if fetch else None

  def flush_metrics(self) -> dict | None:
    """Bring pending per-step metrics to the host; returns the latest step's."""
    self._emit(self._fetch())
    return self.history[-1] if self.history else None

  def _emit(self, records: list[dict]) -> None:
    for record in records:
      for writer in self._writers:
        _write(writer, record)
      for callback in self.callbacks:
        callback(self, record)

  def _fetch(self) -> list[dict]:
    if not self._pending:
      return []
    pending, self._pending = self._pending, []
    fetched = jax.device_get([m for _, m, _ in pending])
    elapsed = time.perf_counter() - self._window_start
    self._check_finite()
    cfg = self.config
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    tokens_per_s = tokens_per_step * len(pending) / elapsed
    tflops = self.flops_per_token * tokens_per_s / self.mesh.size / 1e12
    for (step, _, host_metrics), values in zip(pending, fetched):
      record = {'step': step, **{k: float(v) for k, v in values.items()}, **host_metrics,
                'tokens_per_s': tokens_per_s, 'step_time_s': elapsed / len(pending),
                'tflops_per_device': tflops,
                'mfu': tflops * 1e12 / self.peak_flops}
      record['skipped'] = bool(values['skipped'])
      self.history.append(record)
    return self.history[-len(pending):]

  def _check_finite(self) -> None:
    first_bad = int(self._extra['first_bad_step'])
    if first_bad:
      metric = {1: 'loss', 2: 'grad_norm'}[int(self._extra['bad_metric'])]
      raise TrainingError(f'Non-finite {metric} at step {first_bad}; that update was skipped, '
                          'so the parameters are those of the step before. Lower the learning '
                          'rate, enable clip_norm, or check the data.')

  def evaluate(self, num_batches: int | None = None) -> float:
    """Mean held-out loss over ``num_batches`` batches: the objective's ``eval_loss``
    totals over their weights (for the default, the cross-entropy per token)."""
    with self._goodput.time('eval'):
      return self._evaluate(num_batches)

  def _evaluate(self, num_batches: int | None) -> float:
    num_batches = num_batches or self.config.eval_batches
    source = self.eval_data if self.eval_data is not None else self.data
    if hasattr(source, 'eval_batches'):
      batches = source.eval_batches(num_batches)
    elif self.eval_data is not None:
      iterator = iter(source)
      batches = [next(iterator) for _ in range(num_batches)]
    else:
      raise ValueError('evaluate() needs held-out batches: pass eval_data= to the Trainer (the '
                       'training data has no eval_batches()), or set eval_every=0.')
    self._sync_from_objects()
    self._materialise()
    if self._eval_compiled is None:
      self._compile_eval_step()
    totals = [self._eval_compiled(self._state, self._place(b), self._frozen_state)
              for b in batches]
    total, count = map(sum, zip(*jax.device_get(totals)))
    return float(total / max(count, 1.0))

  def _compile_eval_step(self) -> None:
    with self._goodput.time('compile'):
      eval_step = functools.partial(
          step_lib.eval_step, self._graphdef, frozen_graphdef=self._frozen_graphdef,
          objective=self.objective,
          parameters_on_host=self.config.parameter_memory_host_offload)
      with self._context():
        self._eval_compiled = jax.jit(eval_step).lower(
            self._abstract_state, self._abstract_batch(), self._frozen_state).compile()

  def fit(self, steps: int | None = None, *, log: Callable[[str], None] | None = None
          ) -> list[dict]:
    """Train for ``steps`` (default ``config.steps``) more steps; returns ``history``.

    Prints a progress bar (or lines) with loss, tokens/s and MFU every
    ``log_every`` steps, evaluates every ``eval_every`` steps, and writes
    ``metrics_jsonl`` / ``tensorboard_dir`` when set. With ``checkpoint_dir``
    it first resumes from the newest complete checkpoint there, trains up to
    ``config.steps`` in total, and saves every ``checkpoint_every`` steps and
    at the end. SIGTERM or SIGINT (while ``fit`` runs in the main thread) ends it after the
    current step, with a checkpoint, and sets :attr:`stopped_by`. It ends with a goodput line
    (:meth:`goodput`), whose totals are also in the last step's record (``goodput/...``);
    ``config.profile``, ``outlier_factor`` and ``watchdog_factor`` watch the steps
    (:mod:`maxnnx.train.monitor`).
    """
    deferred: list[dict] = []  # the last step's records, emitted with the goodput totals
    try:
      with self._goodput.time('other'):  # everything the categories inside do not claim
        self._fit(steps, log, deferred)
    finally:
      if self.history:
        self.history[-1].update(self._goodput.metrics())
      self._emit(deferred)
      self._record_high_water(every=0)
      if isinstance(self._writers, list):
        for writer in self._writers:
          if isinstance(writer, TensorBoardWriter):
            writer.flush()
    (log or print)(self._goodput.format())
    return self.history

  def _fit(self, steps: int | None, log: Callable[[str], None] | None,
           deferred: list[dict]) -> None:
    cfg = self.config
    self.stopped_by = self.reached_target = None
    if cfg.checkpoint_dir and self._checkpoints is None:
      self.restore_checkpoint()  # resume where an earlier run of this config stopped
    if steps is None:  # with checkpoints, config.steps is the total over resumed runs
      steps = max(cfg.steps - self.step_count, 0) if cfg.checkpoint_dir else cfg.steps
    if self._compiled is None:
      self.compile(verbose=log is None)
    self._open_writers()
    self._materialise()
    high_water = self._load_high_water()
    bar = ProgressBar(self.step_count + steps)
    stop, saved = StopRequest(), None
    monitor = FitMonitor(cfg)
    try:
      stop.__enter__()
      for i in range(1, steps + 1):
        last = i == steps
        step = self.step_count + 1
        redo = step <= high_water  # re-doing a step an earlier run already took
        self._goodput.lost_steps += redo
        monitor.step_started(step, in_flight=len(self._pending) + 1)
        try:
          with self._goodput.time('lost' if redo else 'productive'):
            self._step(None, fetch=False)
        except StopRequested:  # stopped while the step waited for its data: it is not taken
          self._goodput.lost_steps -= redo
          monitor.step_finished()
          self._stop_early(stop.signal_name, saved, bar, log)
          break
        with self._goodput.time('lost' if redo else 'productive'):
          monitor.step_dispatched(step, self._state)
          evaluate = cfg.eval_every and (self.step_count % cfg.eval_every == 0 or last)
          save = cfg.checkpoint_dir and (last or (cfg.checkpoint_every
                                                  and self.step_count % cfg.checkpoint_every == 0))
          records = []
          if evaluate or last or self.step_count % cfg.log_every == 0:
            records = self._fetch()
            monitor.metrics_fetched(records)
            self._record_high_water()
          elif save:
            jax.block_until_ready(self._state)  # the step's compute is not the checkpoint's
        monitor.step_finished()
        if records and evaluate:
          records[-1].update(self._held_out_metrics())
          if self._target_reached(records[-1]['eval_loss']) and not last:
            last, save = True, bool(cfg.checkpoint_dir)
            bar.total = self.step_count
        if records:
          if last:
            deferred.extend(records)
          else:
            self._emit(records)
          if log is None:
            bar.update(records[-1])
          else:
            log(format_metrics(records[-1], bar.total))
        if save:
          saved = self.save_checkpoint()
        if last:  # the last step, or the held-out loss reached target_eval_loss
          break
        if stop:
          self._stop_early(stop.signal_name, saved, bar, log)
          break
    finally:
      stop.__exit__(None, None, None)
      monitor.close(self._state)

  def _held_out_metrics(self) -> dict[str, float]:
    """``eval_loss`` (:meth:`evaluate`) and its perplexity, ``exp(eval_loss)``."""
    loss = self.evaluate()
    return {'eval_loss': loss, 'eval_perplexity': math.exp(min(loss, 700.0))}

  def _target_reached(self, eval_loss: float) -> bool:
    """Whether ``eval_loss`` reaches ``config.target_eval_loss`` (kept in
    :attr:`reached_target`)."""
    target = self.config.target_eval_loss
    if target is None or not eval_loss <= target:
      return False
    self.reached_target = {'step': self.step_count, 'eval_loss': eval_loss, 'target': target}
    logger.info('Held-out loss %.4f reached target_eval_loss=%g at step %d.', eval_loss, target,
                self.step_count)
    return True

  def goodput(self) -> dict[str, float]:
    """Where this Trainer's time went (:mod:`maxnnx.train.goodput`).

    ``goodput`` (productive step time over wall time), ``wall_s`` and seconds
    per category: ``productive_s``, ``compile_s``, ``data_s`` (blocked in
    ``next(data)``), ``checkpoint_s``, ``restore_s``, ``eval_s``, ``lost_s``
    (steps re-done after a resume; ``lost_steps`` of them) and ``other_s``.
    """
    return self._goodput.summary()

  def _load_high_water(self) -> int:
    if self._high_water is None:
      directory = self.config.checkpoint_dir
      self._high_water = self._high_water_saved = read_high_water(directory) if directory else 0
    return self._high_water

  def _record_high_water(self, every: float = 5.0) -> None:
    """Keep the furthest step reached; written to ``checkpoint_dir`` at most every ``every`` s."""
    reached = self._step_offset + len(self.history)  # fetched steps are complete
    self._high_water = max(self._load_high_water(), reached)
    now = time.monotonic()
    if (not self.config.checkpoint_dir or jax.process_index() != 0
        or self._high_water <= self._high_water_saved or now - self._high_water_written < every):
      return
    write_high_water(self.config.checkpoint_dir, self._high_water)
    self._high_water_saved, self._high_water_written = self._high_water, now

  def _stop_early(self, signal_name: str, saved: int | None, bar, log) -> None:
    """End ``fit`` on a stop request: flush the metrics and checkpoint the step just taken."""
    records = self._fetch()
    self._emit(records)
    if records and log is None:
      bar.update(records[-1])
    elif records:
      log(format_metrics(records[-1], bar.total))
    if self.config.checkpoint_dir and saved != self.step_count:
      self.save_checkpoint()
    self.stopped_by = signal_name
    logger.info('%s: stopped after step %d.', signal_name, self.step_count)

  def _open_writers(self) -> None:
    if self._writers:
      return
    if self.config.metrics_jsonl and jax.process_index() == 0:
      self._writers.append(JsonlWriter(self.config.metrics_jsonl))
    if self.config.tensorboard_dir and jax.process_index() == 0:
      self._writers.append(TensorBoardWriter(self.config.tensorboard_dir))

  def close(self) -> None:
    """Close metric files and wait for checkpoints still being written."""
    for writer in self._writers:
      writer.close()
    self._writers = []
    if self._checkpoints is not None:
      self._checkpoints.close()
      self._checkpoints = None

  # -- checkpoints ------------------------------------------------------------------------

  def _checkpoint_manager(self):
    from maxnnx.checkpoint.manager import CheckpointManager  # noqa: PLC0415
    if not self.config.checkpoint_dir:
      raise ValueError('TrainConfig.checkpoint_dir is not set: give it a directory to save '
                       'checkpoints in.')
    if self._checkpoints is None:
      self._checkpoints = CheckpointManager(self.config.checkpoint_dir,
                                            keep=self.config.keep_checkpoints)
    return self._checkpoints

  def save_checkpoint(self) -> int:
    """Start an asynchronous save of the current step into ``config.checkpoint_dir``.

    Saves model and optimizer state, the loss average, the data position
    (when ``data`` has ``get_state``) and the step. Returns the step.
    """
    with self._goodput.time('checkpoint'):
      return self._save_checkpoint()

  def _save_checkpoint(self) -> int:
    self._sync_from_objects()
    self._materialise()
    data_state = self.data.get_state() if hasattr(self.data, 'get_state') else None
    if data_state is None:
      logger.warning('The data source has no get_state(): a resumed run restarts its stream.')
    meta = {'history_len': self.step_count, 'data': data_state,
            'model_config': self.model_config.to_dict(),
            'schedule_steps': self.config.resolved_schedule_steps}
    self._checkpoint_manager().save(self.step_count, self._state, self._extra, meta)
    return self.step_count

  def restore_checkpoint(self, step: int | None = None) -> int | None:
    """Load checkpoint ``step`` (default: the newest complete one) from ``config.checkpoint_dir``.

    Parameters, optimizer state and the data position are replaced and steps
    continue counting from there. A damaged newest checkpoint is reported and
    the one before it used. Returns the step, or ``None`` when there is none.
    Steps taken again after it, up to the furthest step any run reached,
    count as lost time in :meth:`goodput`. When the checkpoint was made by a run
    with a learning-rate schedule of another length (``steps``, or
    ``learning_rate_schedule_steps``), :attr:`schedule_note` says what that
    does to the schedule in one line.
    """
    with self._goodput.time('restore'):
      return self._restore_checkpoint(step)

  def _restore_checkpoint(self, step: int | None) -> int | None:
    self._high_water = max(self._load_high_water(), self._step_offset + len(self.history))
    manager = self._checkpoint_manager()
    restored = manager.restore(self._abstract_state, self._abstract_extra, step)
    if restored is None:
      return None
    step, self._state, self._extra, meta = restored
    self._pending = []
    self.history = [m for m in self.history if m['step'] <= step]
    self._step_offset = step - len(self.history)
    self._sync_to_objects()
    made_for = meta.get('schedule_steps')
    self.schedule_note = (schedule_change(self.config, made_for, step)
                          if isinstance(made_for, int) else None)
    if self.schedule_note:
      logger.info('%s', self.schedule_note)
    if meta.get('data') is not None:
      if hasattr(self.data, 'set_state'):
        self.data.set_state(meta['data'])
      else:
        logger.warning('Checkpoint %d has a data position but the data source has no '
                       'set_state(): its stream restarts.', step)
    logger.info('Restored checkpoint step %d from %s.', step, manager.directory)
    return step

  # -- inspection ---------------------------------------------------------------------------

  def describe_sharding(self) -> str:
    """A table of every parameter's shape and how it is laid out on the mesh."""
    rows = sharding.describe_sharding(self.model, self.mesh, self.rules)
    width = max(len(path) for path, _, _ in rows)
    lines = [f"mesh {dict(self.mesh.shape)}"]
    lines += [f'{path:<{width}}  {str(shape):<22} {spec}' for path, shape, spec in rows]
    return '\n'.join(lines)


def _write(writer, record: dict) -> None:
  if isinstance(writer, JsonlWriter):
    writer.write(record)
  else:
    writer.scalars(record['step'], {k: v for k, v in record.items() if k != 'step'})


def _abstract_tree(state, shardings):
  """``state`` with every array replaced by a sharded ``ShapeDtypeStruct``."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)


def _quantization_name(config: TrainConfig, model_config: ModelConfig, model, mesh) -> str:
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


def _check_pipeline_schedule(model_config: ModelConfig, mesh: MeshConfig, stages: int) -> None:
  """Refuse a pipeline schedule the stack cannot follow, and log its bubble."""
  micro, repeats = mesh.pipeline_microbatches or stages, mesh.pipeline_repeats
  layers = model_config.num_layers
  if layers % (stages * repeats):
    raise ValueError(f'Pipeline: num_layers={layers} must be divisible by stage x '
                     f'pipeline_repeats = {stages} x {repeats} (the chunks of the stack); pick '
                     'a stage count and MeshConfig.pipeline_repeats that divide it.')
  if repeats > 1 and micro < stages:
    raise ValueError(f'MeshConfig.pipeline_repeats={repeats} (a circular pipeline) needs '
                     f'pipeline_microbatches >= stage ({stages}), got {micro}.')
  logger.info(describe_schedule(stages, micro, repeats))


def _check_pipeline_layout(model: nnx.Module, stages: int, what: str) -> None:
  """A built model on a mesh with ``stage > 1`` must have a scanned layer stack."""
  model_config = getattr(model, 'config', None)
  scanned = model_config.runtime.scan_layers if isinstance(model_config, ModelConfig) else True
  if stages > 1 and not scanned:
    raise ValueError(f'The mesh has stage={stages} (pipeline parallelism), which runs a scanned '
                     f'layer stack, but the {what} was built with scan_layers=False: build it '
                     'with scan_layers=True (e.g. Transformer(config.replace(scan_layers=True)) '
                     'or from_pretrained(..., scan_layers=True)), or pass its config or preset '
                     'name so the Trainer builds it scanned.')


def _image_shape(config: TrainConfig, model_config: ModelConfig) -> tuple[int, ...] | None:
  """``(images_per_row, channels, H, W)`` of image+text batches, or ``None``."""
  if not config.images_per_row:
    return None
  v = model_config.vision
  if not v.num_layers:
    raise ValueError('TrainConfig.images_per_row > 0 needs a model with a vision tower '
                     '(ModelConfig.vision.num_layers > 0).')
  return (config.images_per_row, v.num_channels, v.image_size, v.image_size)


def _check_batch_and_length(config: TrainConfig, model_config: ModelConfig, mesh: Mesh,
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


def _new_model(model_config: ModelConfig, seed: int) -> nnx.Module:
  from maxnnx.models.transformer import Transformer  # noqa: PLC0415 (train sits above models)
  return Transformer(model_config, rngs=nnx.Rngs(seed))


__all__ = ['BATCH_KEYS', 'Objective', 'PretrainObjective', 'Trainer', 'TrainingError', 'as_batch',
           'context_permutation', 'cross_entropy_loss', 'device_memory_limit',
           'format_memory_report', 'masked_cross_entropy', 'memory_report', 'synthetic_batches']

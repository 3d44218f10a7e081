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

This module builds the Trainer and steps it; its loop (:mod:`maxnnx.train.fit_loop`),
compilation (:mod:`maxnnx.train.compilation`) and checkpoints
(:mod:`maxnnx.train.checkpointing`) are mixins of their own modules, and the checks it makes
are in :mod:`maxnnx.train.checks`. Data comes through the protocol of
:mod:`maxnnx.data.protocol`; code that samples from the policy gets :meth:`Trainer.policy_view`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from maxnnx import sharding
from maxnnx.config import ModelConfig, check_expert_split
from maxnnx.data.protocol import HasEvalBatches, ReportsMetrics, check_data_source
from maxnnx.train import checks
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
from maxnnx.train.checkpointing import Checkpointing
from maxnnx.train.checks import (  # noqa: F401 (re-exported)
  EMPTY_BATCHES_BEFORE_STOP,
  TrainingError,
  row_range,
)
from maxnnx.train.compilation import Compilation
from maxnnx.train.config import TrainConfig
from maxnnx.train.fit_loop import FitLoop
from maxnnx.train.goodput import GoodputRecorder, HighWater
from maxnnx.train.lora.adapters import apply_lora, trainable_filter
from maxnnx.train.loss import cross_entropy_loss, masked_cross_entropy
from maxnnx.train.memory import (
  device_memory_limit,
  format_memory_report,
  memory_report,
)
from maxnnx.train.metrics import JsonlWriter, TensorBoardWriter
from maxnnx.train.objectives import Objective, PretrainObjective
from maxnnx.train.optimizer_placement import (
  optimizer_state_on_host,
  optimizer_state_over_data,
  parameters_on_device,
  parameters_on_host,
)
from maxnnx.train.optimizers import make_optimizer, make_schedule
from maxnnx.train.policy import PolicyView
from maxnnx.train.quantization import quantize

logger = logging.getLogger(__name__)


class Trainer(FitLoop, Checkpointing, Compilation):
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
    data: training batches, a :class:`~maxnnx.data.protocol.DataSource`: an iterator (a
      generator will do) of batch dicts (see :func:`as_batch`) or of ``[batch, seq_len + 1]``
      token windows. ``None`` uses random tokens. In a multi-host run each process
      gives its own rows (``global_batch_size / process_count`` of them). A source that is
      also :class:`~maxnnx.data.protocol.Checkpointable` has its position saved with
      checkpoints, and one that :class:`~maxnnx.data.protocol.ReportsMetrics` (RL rollouts)
      adds the host-side metrics it returns after each ``next`` to that step's record.
    eval_data: held-out batches: an iterable of batches, or a
      :class:`~maxnnx.data.protocol.HasEvalBatches` (``data`` is asked for that when this is
      ``None``).
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
    restored_from: the directory the last restored checkpoint came from (``checkpoint_dir``, or
      ``local_checkpoint_directory`` for an emergency checkpoint); else ``None``.
    batch_note: one line when restoring a checkpoint saved by more processes raised
      ``grad_accum_steps`` to keep the per-process micro-batch; else ``None``.
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
    self._init_bookkeeping()
    self.objective = (objective if objective is not None else PretrainObjective()).bind(config)
    stages = dict(self.mesh.shape).get('stage', 1)
    concrete, abstract_model = self._resolve_model(model, stages)
    self.trainable = self._trainable_filter(trainable, abstract_model)
    self.tx = optimizer if optimizer is not None else make_optimizer(config, abstract_model)
    self._init_state(concrete)
    self._place_frozen(stages)
    self._init_batch_layout()
    self.data = (check_data_source(data, 'data') if data is not None
                 else synthetic_batches(self.model_config.vocab_size, self._local_batch_size(),
                                        config.seq_len, config.seed))
    self.eval_data = eval_data
    self.flops_per_token = flops_lib.training_flops_per_token(self.model_config, config.seq_len)
    self.peak_flops, self.peak_source = (
        (config.peak_tflops * 1e12, 'TrainConfig.peak_tflops') if config.peak_tflops
        else flops_lib.peak_flops_per_device(self.mesh.devices.flat[0]))

  # -- construction steps --------------------------------------------------------

  def _init_bookkeeping(self) -> None:
    """History, pending metrics, compiled steps and the counters a run keeps."""
    self.history: list[dict] = []
    self._pending: list[tuple[int, Any, dict]] = []  # (step, device metrics, host metrics)
    self._compiled = None
    self._eval_compiled = None
    self._writers: list = []
    self._checkpoints = None  # a CheckpointManager once checkpoint_dir is used
    self._local = None  # the LocalCheckpoints of enable_emergency_checkpoint, once used
    # What restoring a checkpoint of more processes did to grad_accum_steps (one line).
    self.batch_note: str | None = None
    self.restored_from: str | None = None  # the directory of the last restored checkpoint
    self._step_offset = 0  # steps taken before the restored checkpoint, not in history
    # What resuming a checkpoint made for another `steps` does to the schedule (one line).
    self.schedule_note: str | None = None
    self.stopped_by: str | None = None
    self.reached_target: dict | None = None
    self._goodput = GoodputRecorder()
    self._empty_batches_in_a_row = 0
    self._high_water = HighWater()  # the furthest step any run of checkpoint_dir reached

  def _resolve_model(self, model, stages: int) -> tuple[nnx.Module | None, nnx.Module]:
    """``(concrete model or None, abstract model)`` of what ``model`` names, checked against
    the mesh, quantized and given LoRA adapters as the config asks; sets ``model_config`` and
    ``quantization``."""
    config = self.config
    if isinstance(model, str):
      from maxnnx.presets import get_preset  # noqa: PLC0415 (presets import models)
      model = get_preset(model)
    concrete = None
    if isinstance(model, ModelConfig):
      model = self._model_config_for(model, stages)
      self.model_config = model
      abstract_model = nnx.eval_shape(lambda: _new_model(model, config.seed))
    else:
      checks.check_pipeline_layout(model, stages, 'model')
      self.model_config = model.config
      concrete = abstract_model = model
    if stages > 1:
      logger.info(checks.check_pipeline_schedule(self.model_config, config.mesh, stages))
    check_expert_split(config.mesh.expert_parallel_strategy, self.model_config.moe.num_experts,
                       dict(self.mesh.shape).get('expert', 1),
                       self.model_config.moe.ragged_buffer_factor)
    self.quantization = checks.quantization_name(config, self.model_config, concrete, self.mesh)
    if concrete is not None and config.quantization != 'none':
      concrete = quantize(concrete, config.quantization)
    if config.lora.enabled:
      if concrete is not None:
        concrete = abstract_model = apply_lora(concrete, config.lora, seed=config.seed)
      else:
        abstract_model = nnx.eval_shape(lambda: apply_lora(_new_model(model, config.seed),
                                                           config.lora, seed=config.seed))
    checks.check_qk_clip(config, self.model_config, abstract_model)
    checks.check_parameter_streaming(config, self.model_config)
    return concrete, abstract_model

  def _model_config_for(self, model_config: ModelConfig, stages: int) -> ModelConfig:
    """``model_config`` with what QK-clip and pipeline stages need of a model built here."""
    if self.config.qk_clip_threshold and not model_config.runtime.record_max_logits:
      model_config = model_config.replace(**{'runtime.record_max_logits': True})  # QK-clip
    if stages > 1 and not model_config.runtime.scan_layers:
      logger.info('mesh.stage=%d: building the model with scan_layers=True (pipeline '
                  'parallelism runs a scanned layer stack).', stages)
      model_config = model_config.replace(**{'runtime.scan_layers': True})
    return model_config

  def _trainable_filter(self, trainable, abstract_model: nnx.Module):
    """The nnx filter of the trained parameters: ``trainable``, else derived from the model."""
    checks.check_mtp_context(self.model_config, self.config.mesh, self.mesh)
    if trainable is not None:
      return trainable
    derived = trainable_filter(abstract_model)
    if self.model_config.mla.indexer_training == 'dense_warmup':
      # DeepSeek V3.2's warm-up: everything but the indexer stays frozen.
      return nnx.All(derived, nnx.PathContains('indexer'))
    return derived

  def _init_state(self, concrete: nnx.Module | None) -> None:
    """Split ``(model, optimizer)`` into graph and state and decide where the state lives; a
    given model is placed now, a built one on first use (after compile() had its say)."""
    config = self.config
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
    self._state = jax.device_put(state, self._state_shardings) if concrete is not None else None
    self._extra_sharding = NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    self._abstract_extra = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._extra_sharding),
        jax.eval_shape(step_lib.initial_guard_state))
    self._objects = None
    self._extra = None

  def _init_batch_layout(self) -> None:
    """The shardings of a step's batch: tokens, and images for image+text batches."""
    config = self.config
    checks.check_batch_and_length(config, self.model_config, self.mesh, self.rules)
    self._token_sharding = NamedSharding(
        self.mesh, sharding.spec_for(BATCH_AXES, self.rules, self.mesh,
                                     (config.global_batch_size, config.seq_len)))
    self._image_shape = checks.image_shape(config, self.model_config)
    self._batch_sharding = self._token_sharding
    if self._image_shape is not None:  # one sharding per batch field
      image_sharding = NamedSharding(
          self.mesh, sharding.spec_for(IMAGE_AXES, self.rules, self.mesh,
                                       (config.global_batch_size, *self._image_shape)))
      self._batch_sharding = {**{k: self._token_sharding for k in self._abstract_batch()},
                              'pixel_values': image_sharding}

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
      checks.check_pipeline_layout(module, stages, f'frozen model {name!r}')
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

  def policy_view(self) -> PolicyView:
    """The narrow view of this Trainer that code sampling from its policy gets (RL
    rollouts): live model, mesh context, batch shape, local rows and the objective."""
    return PolicyView(self)

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

  def count_steps_taken(self, step: int) -> None:
    """Count ``step`` optimizer steps as already taken (a run that continues another
    framework's training state): the next step is ``step + 1`` and :meth:`fit` stops at
    ``config.steps`` in all."""
    self._step_offset = step - len(self.history) - len(self._pending)

  @property
  def step_count(self) -> int:
    """Optimizer steps taken so far."""
    return self._step_offset + len(self.history) + len(self._pending)

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
        batch = next(self.data)
      self._empty_batches_in_a_row = (self._empty_batches_in_a_row + 1
                                      if checks.trains_on_nothing(batch) else 0)
      checks.check_trains_on_something(self._empty_batches_in_a_row, self.step_count + 1)
      if isinstance(self.data, ReportsMetrics):  # e.g. RL rollouts: rewards, lengths
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
    if isinstance(source, HasEvalBatches):
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


def _new_model(model_config: ModelConfig, seed: int) -> nnx.Module:
  from maxnnx.models.transformer import Transformer  # noqa: PLC0415 (train sits above models)
  return Transformer(model_config, rngs=nnx.Rngs(seed))


__all__ = ['BATCH_KEYS', 'Objective', 'PretrainObjective', 'Trainer', 'TrainingError', 'as_batch',
           'context_permutation', 'cross_entropy_loss', 'device_memory_limit',
           'format_memory_report', 'masked_cross_entropy', 'memory_report', 'synthetic_batches']

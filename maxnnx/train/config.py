"""``TrainConfig``: everything about a training run that is not the model."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

from maxnnx.config import ConfigError, MeshConfig, ValidatedConfig, check_ring_split
from maxnnx.train.diagnostics import parse_profile_spec
from maxnnx.train.lora.config import LoraConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig(ValidatedConfig):
  """Optimizer, schedule, batch, precision, parallelism and logging of a run.

  Attributes:
    steps: optimizer steps (also the length of the learning-rate schedule unless
      ``learning_rate_schedule_steps`` is set).
    global_batch_size: sequences per optimizer step, over all devices and hosts.
    seq_len: tokens per sequence.
    images_per_row: image+text training (a model with a vision tower): every row of a
      batch holds this many images, ``pixel_values`` ``[batch, images_per_row, channels,
      H, W]``, whose embeddings take the places of the row's image placeholders; 0 = text.
    grad_accum_steps: split each step's batch into this many micro-batches and
      sum their gradients; the update equals one step on the whole batch.
    seed: seed of parameter init (when the Trainer builds the model) and dropout.
    optimizer: ``adamw``, ``sgd``, ``adafactor`` or ``muon``.
    learning_rate: peak learning rate.
    schedule: ``cosine`` (warmup then cosine), ``wsd`` (warmup, stable, decay)
      or ``constant`` (warmup then flat).
    learning_rate_schedule_steps: length of the learning-rate schedule when it differs
      from ``steps`` (a run cut short of, or continued past, its schedule: after the
      schedule's end the rate stays at its final value); ``None`` means ``steps``.
    warmup_steps: linear warmup from 0; ``None`` means 5% of the schedule's length.
    decay_fraction: ``wsd`` only: the last fraction of steps that decays.
    decay_shape: ``wsd`` only: ``linear`` or ``cosine`` decay.
    final_lr_fraction: the learning rate at the end, as a fraction of the peak.
    weight_decay: decoupled weight decay (AdamW, Muon), applied to matmul
      kernels only unless ``decay_all`` is set.
    decay_all: also decay norms, biases and embeddings.
    weight_decay_exclude: regular expressions on parameter paths (names joined by ``/``,
      e.g. ``layers/0/attn/q_proj/kernel``, ``embed/embedding``); a parameter whose path
      any of them matches (``re.search``) is never decayed, whatever ``decay_all`` says.
    b1, b2, eps: Adam moments and epsilon (AdamW, the Adam part of Muon).
    adam_eps_root: epsilon added to the second moment inside the square root (AdamW, the
      Adam part of Muon): ``m / (sqrt(v + eps_root) + eps)``.
    mu_dtype: dtype of the first moment (AdamW, Muon's momentum, SGD's momentum), e.g.
      ``bfloat16`` to halve its memory; ``None`` keeps the parameters' dtype.
    shard_optimizer_over_data: ZeRO-1: split the optimizer's moments over the ``data``
      mesh axis too, while the parameters stay replicated over it
      (:mod:`maxnnx.train.optimizer_placement`).
    optimizer_memory_host_offload: keep the optimizer's moments in host memory between
      steps (copied to the devices for each update; :mod:`maxnnx.train.optimizer_placement`).
    parameter_memory_host_offload: keep the model's parameters in host memory between steps
      (copied to the devices at the start of each train and eval step).
    parameter_streaming: with ``parameter_memory_host_offload``, leave the scanned layer
      stacks in host memory inside the step too: each iteration of the layers' scan copies
      its own layer to the device (forward, and again in the backward pass's recomputation),
      so the forward and backward passes hold about one layer's parameters on the device, not
      all of them (torchtitan's FSDP CPU offload behaves this way); the update copies the
      stacks and their gradients in. A bool of its own rather than a third value of
      MaxText's ``parameter_memory_host_offload``, so that key keeps its boolean type and
      meaning (where the parameters live between steps) and this one says how a step brings
      them in. Needs ``scan_layers=True``, a ``remat_policy`` other than ``none`` and no
      pipeline stages (:mod:`maxnnx.train.optimizer_placement`).
    momentum: SGD momentum (0 = plain SGD).
    clip_norm: clip gradients to this global norm (``None``: no clipping).
    z_loss: weight of ``logsumexp(logits)^2`` added to the loss (PaLM).
    router_aux_loss_coef: weight of the MoE load-balancing loss added to the loss.
    router_z_loss_coef: weight of the MoE router z-loss added to the loss.
    mtp_loss_scaling_factor: weight of the mean multi-token-prediction cross-entropy
      added to the loss (DeepSeek V3 used 0.3, then 0.1).
    fused_loss: apply the output head and the cross-entropy together, one
      sequence slice at a time (:mod:`maxnnx.train.loss`): the ``[B, T, vocab]``
      logits are never held at once, and on CPU the step is faster. ``False``
      computes full logits first (the plain reference).
    loss_chunk_length: sequence positions per slice of the fused loss; ``None``
      picks the longest divisor of ``seq_len`` whose float32 logits slice fits
      in 32 MiB on CPU or 1 GiB on an accelerator.
    indexer_loss_weight: weight of DeepSeek V3.2's indexer KL in the loss when the model trains
      its indexer (``model.mla.indexer_training``).
    qk_clip_threshold: QK-clip (Kimi K2's MuonClip with ``optimizer='muon'``; any optimizer
      takes it): after each update, every attention head whose largest pre-softmax logit in
      the step passed this value has its query/key projections rescaled to bring it back
      (:mod:`maxnnx.layers.qk_clip`; K2 uses 100). 0: off.
    skip_spike_factor: skip the update when the loss exceeds this many times
      its running average (``None``: never skip).
    quantization: ``none``, or quantization-aware training through qwix:
      ``int8`` (int8 weights and activations) or ``fp8`` (e4m3 forward, e5m2
      gradients) on the decoder layers' projections and experts; see
      :mod:`maxnnx.train.quantization`.
    log_every: fetch metrics to the host and log every N steps (the only host
      sync in the loop).
    eval_every: evaluate every N steps (0: never during ``fit``).
    eval_batches: held-out batches per evaluation.
    target_eval_loss: end ``fit`` early, with a checkpoint, at the first evaluation whose
      held-out loss is at or below this (``None``: train all ``steps``); see
      :attr:`Trainer.reached_target`.
    metrics_jsonl: write one JSON object per step to this file.
    tensorboard_dir: write TensorBoard event files here.
    peak_tflops: per-device peak used for MFU; ``None`` picks a default by
      device kind (measured with a matmul on CPU).
    memory_limit_gib: per-device memory for the ahead-of-time fit check;
      ``None`` reads it from the device (host RAM split over devices on CPU).
    checkpoint_dir: save checkpoints here; ``fit`` resumes from the newest
      complete one it finds there (``None``: no checkpoints).
    checkpoint_every: save a checkpoint every N steps (0: only at the end of
      ``fit``); only with ``checkpoint_dir`` (the CLI defaults it to
      ``<output_dir>/checkpoints``).
    keep_checkpoints: how many of the newest checkpoints to keep.
    enable_emergency_checkpoint: also save frequent local checkpoints (MaxText's name):
      every ``local_checkpoint_period`` steps each process writes its own shards to
      ``local_checkpoint_directory`` and a replica to its peer's (process ``(i + 1) % n``);
      a resume takes the newest step complete anywhere, local or persistent
      (:mod:`maxnnx.checkpoint.emergency`). Needs ``checkpoint_dir`` too.
    local_checkpoint_directory: the local disks of the emergency checkpoints: a local path
      every process sees whole, process ``k``'s disk under ``process-<k>/``.
    local_checkpoint_period: save a local checkpoint every N steps (usually much more often
      than ``checkpoint_every``).
    profile: trace optimizer steps with ``jax.profiler``, as ``'steps:FIRST-LAST'``
      (e.g. ``'steps:10-15'``), for TensorBoard's profile plugin or XProf.
    profile_dir: where the trace goes; ``None``: ``profile/`` next to the
      metrics file (or the checkpoint directory).
    dump_hlo: write the train step's jaxpr, StableHLO and HLO text when it compiles.
    dump_hlo_dir: where ``dump_hlo`` writes; ``None``: ``hlo/`` next to the metrics file.
    watchdog_factor: dump every thread's stack when a step runs this many times
      the median step time (0: no watchdog).
    watchdog_min_seconds: the watchdog never fires before a step has run this long.
    watchdog_first_step_seconds: while no median is known (the first steps: the first
      rollout of RL compiles its sampler), a step is hung after this many seconds
      (0: the first steps are not watched).
    outlier_factor: log a warning for steps this many times slower than the
      running median (0: never).
    compile_cache: directory of JAX's persistent compilation cache; a restart
      loads the compiled step from it instead of compiling (``None``: off).
    mesh: device mesh and parallelism (:class:`~maxnnx.config.MeshConfig`).
    lora: LoRA / QLoRA adapters (:class:`~maxnnx.train.lora.LoraConfig`); with
      ``lora.rank > 0`` the Trainer adds them to the model and trains only them.
  """

  steps: int = 100
  global_batch_size: int = 8
  seq_len: int = 128
  images_per_row: int = 0
  grad_accum_steps: int = 1
  seed: int = 0
  optimizer: Literal['adamw', 'sgd', 'adafactor', 'muon'] = 'adamw'
  learning_rate: float = 3e-4
  learning_rate_schedule_steps: int | None = None
  schedule: Literal['cosine', 'wsd', 'constant'] = 'cosine'
  warmup_steps: int | None = None
  decay_fraction: float = 0.2
  decay_shape: Literal['linear', 'cosine'] = 'linear'
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.1
  decay_all: bool = False
  weight_decay_exclude: tuple[str, ...] = ()
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  adam_eps_root: float = 0.0
  mu_dtype: Literal['float32', 'bfloat16'] | None = None
  shard_optimizer_over_data: bool = False
  optimizer_memory_host_offload: bool = False
  parameter_memory_host_offload: bool = False
  parameter_streaming: bool = False
  momentum: float = 0.9
  clip_norm: float | None = 1.0
  z_loss: float = 0.0
  router_aux_loss_coef: float = 0.0
  router_z_loss_coef: float = 0.0
  mtp_loss_scaling_factor: float = 0.1
  fused_loss: bool = True
  loss_chunk_length: int | None = None
  skip_spike_factor: float | None = None
  qk_clip_threshold: float = 0.0
  indexer_loss_weight: float = 1.0
  quantization: Literal['none', 'int8', 'fp8'] = 'none'
  log_every: int = 10
  eval_every: int = 0
  eval_batches: int = 4
  target_eval_loss: float | None = None
  metrics_jsonl: str | None = None
  tensorboard_dir: str | None = None
  peak_tflops: float | None = None
  memory_limit_gib: float | None = None
  checkpoint_dir: str | None = None
  checkpoint_every: int = 0
  keep_checkpoints: int = 3
  enable_emergency_checkpoint: bool = False
  local_checkpoint_directory: str | None = None
  local_checkpoint_period: int = 0
  profile: str | None = None
  profile_dir: str | None = None
  dump_hlo: bool = False
  dump_hlo_dir: str | None = None
  watchdog_factor: float = 10.0
  watchdog_min_seconds: float = 60.0
  watchdog_first_step_seconds: float = 600.0
  outlier_factor: float = 3.0
  compile_cache: str | None = None
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

  def _validate(self):
    for name in ('steps', 'global_batch_size', 'seq_len', 'grad_accum_steps', 'log_every',
                 'eval_batches'):
      if getattr(self, name) < 1:
        raise ConfigError(f'TrainConfig.{name} must be >= 1, got {getattr(self, name)}.')
    if self.images_per_row < 0:
      raise ConfigError(f'TrainConfig.images_per_row must be >= 0, got {self.images_per_row}.')
    if self.global_batch_size % self.grad_accum_steps:
      raise ConfigError(f'TrainConfig.global_batch_size ({self.global_batch_size}) must be a '
                        f'multiple of grad_accum_steps ({self.grad_accum_steps}).')
    if not math.isfinite(self.learning_rate) or self.learning_rate < 0:  # 0: frozen weights
      raise ConfigError(f'TrainConfig.learning_rate must be finite and >= 0, got '
                        f'{self.learning_rate}.')
    if self.learning_rate_schedule_steps is not None and self.learning_rate_schedule_steps < 1:
      raise ConfigError(f'TrainConfig.learning_rate_schedule_steps must be >= 1 (or None for '
                        f'steps), got {self.learning_rate_schedule_steps}.')
    length = self.resolved_schedule_steps
    if self.warmup_steps is not None and not 0 <= self.warmup_steps <= length:
      raise ConfigError(f'TrainConfig.warmup_steps must be in [0, the schedule length {length}]'
                        f', got {self.warmup_steps}.')
    if not self.adam_eps_root >= 0:
      raise ConfigError(f'TrainConfig.adam_eps_root must be >= 0, got {self.adam_eps_root}.')
    for pattern in self.weight_decay_exclude:
      try:
        re.compile(pattern)
      except re.error as e:
        raise ConfigError(f'TrainConfig.weight_decay_exclude: {pattern!r} is not a regular '
                          f'expression ({e}).') from None
    if self.parameter_streaming and not self.parameter_memory_host_offload:
      raise ConfigError('TrainConfig.parameter_streaming=True streams the layers from host '
                        'memory: set parameter_memory_host_offload=True too.')
    if self.parameter_streaming and (self.mesh.stage, self.mesh.dcn_stage) != (1, 1):
      raise ConfigError(f'TrainConfig.parameter_streaming=True does not run with pipeline stages '
                        f'(mesh.stage={self.mesh.stage}, mesh.dcn_stage={self.mesh.dcn_stage}): '
                        'the pipeline splits the layer stacks over the stages; use '
                        'parameter_memory_host_offload alone.')
    if not 0 <= self.decay_fraction <= 1:
      raise ConfigError('TrainConfig.decay_fraction must be in [0, 1].')
    if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
      raise ConfigError('TrainConfig.checkpoint_every must be >= 0 and keep_checkpoints >= 1.')
    self._validate_emergency()
    if self.loss_chunk_length is not None and (
        self.loss_chunk_length < 1 or self.seq_len % self.loss_chunk_length):
      raise ConfigError(f'TrainConfig.loss_chunk_length ({self.loss_chunk_length}) must divide '
                        f'seq_len ({self.seq_len}); or leave it None to pick one.')
    for name in ('router_aux_loss_coef', 'router_z_loss_coef', 'mtp_loss_scaling_factor'):
      if getattr(self, name) < 0:
        raise ConfigError(f'TrainConfig.{name} must be >= 0, got {getattr(self, name)}.')
    check_ring_split(self.mesh.context_parallel_strategy, self.seq_len,
                     self.mesh.context * self.mesh.dcn_context)  # -1 (not known yet): at trace
    if self.target_eval_loss is not None:
      if not math.isfinite(self.target_eval_loss) or self.target_eval_loss <= 0:
        raise ConfigError(f'TrainConfig.target_eval_loss must be a finite loss > 0 (or None), '
                          f'got {self.target_eval_loss}.')
      if not self.eval_every:
        raise ConfigError('TrainConfig.target_eval_loss is checked at evaluations: set '
                          'eval_every to how often to evaluate.')
    if not self.indexer_loss_weight >= 0:
      raise ConfigError('TrainConfig.indexer_loss_weight must be >= 0, got '
                        f'{self.indexer_loss_weight}.')
    if not self.qk_clip_threshold >= 0:
      raise ConfigError('TrainConfig.qk_clip_threshold must be >= 0 (0: no QK-clip), got '
                        f'{self.qk_clip_threshold}.')
    if self.skip_spike_factor is not None and self.skip_spike_factor <= 1:
      raise ConfigError('TrainConfig.skip_spike_factor must be > 1 (or None to never skip).')
    if self.profile:
      parse_profile_spec(self.profile)
    for name in ('watchdog_factor', 'outlier_factor'):
      value = getattr(self, name)
      if value and not value > 1:
        raise ConfigError(f'TrainConfig.{name} must be > 1 (or 0 for off), got {value}.')
    for name in ('watchdog_min_seconds', 'watchdog_first_step_seconds'):
      if not getattr(self, name) >= 0:
        raise ConfigError(f'TrainConfig.{name} must be >= 0, got {getattr(self, name)}.')

  def _validate_emergency(self):
    if self.local_checkpoint_period < 0:
      raise ConfigError(f'TrainConfig.local_checkpoint_period must be >= 0, got '
                        f'{self.local_checkpoint_period}.')
    if not self.enable_emergency_checkpoint:
      return
    if not self.local_checkpoint_directory:
      raise ConfigError('TrainConfig.enable_emergency_checkpoint needs '
                        'local_checkpoint_directory: set it to a directory on local disk.')
    if '://' in self.local_checkpoint_directory:
      raise ConfigError(f'TrainConfig.local_checkpoint_directory must be a local path, got the '
                        f'URL {self.local_checkpoint_directory!r}; URLs go in checkpoint_dir.')
    if self.local_checkpoint_period < 1:
      raise ConfigError('TrainConfig.enable_emergency_checkpoint needs local_checkpoint_period '
                        '>= 1: set how many steps apart local checkpoints are.')
    if not self.checkpoint_dir:
      raise ConfigError('TrainConfig.enable_emergency_checkpoint needs checkpoint_dir too (the '
                        'persistent checkpoints it falls back to): set checkpoint_dir.')

  @property
  def resolved_schedule_steps(self) -> int:
    """The learning-rate schedule's length: ``learning_rate_schedule_steps`` or ``steps``."""
    return self.learning_rate_schedule_steps or self.steps

  @property
  def resolved_warmup_steps(self) -> int:
    """``warmup_steps`` with its default (5% of the schedule, at least 1) applied."""
    if self.warmup_steps is not None:
      return self.warmup_steps
    return max(1, self.resolved_schedule_steps // 20)

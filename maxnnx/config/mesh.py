"""``MeshConfig``: how devices are arranged into named parallelism axes."""

from __future__ import annotations

import dataclasses
from typing import Literal

from maxnnx.config.base import ConfigError, ValidatedConfig

MESH_AXES = ('stage', 'data', 'fsdp', 'expert', 'context', 'tensor')


@dataclasses.dataclass(frozen=True)
class MeshConfig(ValidatedConfig):
  """How devices are arranged into named parallelism axes.

  Each size is the number of devices along that axis within a slice (fast
  interconnect); ``dcn_*`` sizes multiply them across slices or hosts (slow
  interconnect). ``-1`` (at most one per group) takes whatever devices are left.

  Attributes:
    data: data parallelism (replicated params, split batch).
    fsdp: fully sharded data parallelism (params and optimizer state split,
      gathered per layer; batch split).
    tensor: tensor (model) parallelism over heads and MLP width.
    expert: expert parallelism for MoE layers (batch split elsewhere).
    context: context (sequence) parallelism for long sequences.
    stage: pipeline stages (scanned layer stack split into consecutive stages).
    dcn_data, dcn_fsdp, dcn_tensor, dcn_expert, dcn_context, dcn_stage: the
      same axes across slices/hosts.
    sequence_parallel: shard the residual stream between blocks along the
      sequence over ``tensor`` (norms run on a slice of the tokens).
    context_load_balance: reorder tokens so every ``context`` shard gets an
      equal share of causal-attention work.
    context_parallel_strategy: how attention reaches the keys of other ``context``
      shards. ``all_gather`` (the default and the reference): every shard gathers
      the whole sequence's keys and values (GSPMD). ``ring``: each shard keeps
      its queries and passes key/value blocks around the ``context`` axis, one
      neighbour per step, merging the partial results with an online softmax
      (``maxnnx.layers.context_parallel``); no shard holds the whole sequence's
      keys in the forward pass.
    expert_parallel_strategy: how MoE tokens reach the experts of other ``expert``
      shards. ``gspmd`` (the default and the reference): the compiler moves tokens
      however it partitions the global sort (or the per-expert buffers). ``all_to_all``:
      each shard routes its own tokens, packs them per destination shard into
      fixed-size buffers, exchanges them with one ``all_to_all``, runs its own experts
      and sends the results back the same way (``maxnnx.layers.expert_parallel``).
      It is a mesh key, not a ``moe.dispatch`` value, because it is orthogonal to
      dispatch: ``dropless`` sends every assignment (buffers of the worst case) and
      ``capacity`` keeps its per-expert slots (counted per source shard). Needs
      ``moe.num_experts`` divisible by ``expert``.
    pipeline_microbatches: microbatches per step when ``stage > 1``; ``None``
      means one per stage.
    pipeline_repeats: rounds of the stages each micro-batch makes (MaxText's
      ``num_pipeline_repeats``). 1 is GPipe: stage ``s`` holds layers
      ``[s L/S, (s+1) L/S)``. ``R > 1`` is a circular pipeline: the stack is cut into
      ``R S`` chunks, chunk ``c`` runs on stage ``c mod S``, and the bubble shrinks from
      ``(S-1)/(M+S-1)`` to ``(S-1)/(R M+S-1)`` of the step; needs
      ``pipeline_microbatches >= stage`` and ``num_layers`` divisible by ``R S``.
    rules: extra ``(logical name, mesh axes)`` pairs that override the
      defaults in :data:`maxnnx.sharding.DEFAULT_RULES`.
  """

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  expert: int = 1
  context: int = 1
  stage: int = 1
  dcn_data: int = 1
  dcn_fsdp: int = 1
  dcn_tensor: int = 1
  dcn_expert: int = 1
  dcn_context: int = 1
  dcn_stage: int = 1
  sequence_parallel: bool = False
  context_load_balance: bool = True
  context_parallel_strategy: Literal['all_gather', 'ring'] = 'all_gather'
  expert_parallel_strategy: Literal['gspmd', 'all_to_all'] = 'gspmd'
  pipeline_microbatches: int | None = None
  pipeline_repeats: int = 1
  rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] = ()

  def _validate(self):
    for group in ('', 'dcn_'):
      sizes = [getattr(self, group + a) for a in MESH_AXES]
      if any(s == 0 or s < -1 for s in sizes):
        raise ConfigError(f'MeshConfig {group}sizes must be positive or -1, got '
                          f'{dict(zip(MESH_AXES, sizes))}.')
      if sizes.count(-1) > 1:
        raise ConfigError(f'At most one {group}mesh axis may be -1, got '
                          f'{dict(zip(MESH_AXES, sizes))}.')
    if self.pipeline_microbatches is not None and self.pipeline_microbatches < 1:
      raise ConfigError('MeshConfig.pipeline_microbatches must be >= 1.')
    if self.pipeline_repeats < 1:
      raise ConfigError(f'MeshConfig.pipeline_repeats={self.pipeline_repeats}: must be >= 1 '
                        '(1 is GPipe).')


def check_ring_split(strategy: str, length: int, shards: int) -> None:
  """Refuse a ``ring`` context strategy whose sequence of ``length`` tokens does not split
  evenly over ``shards`` context shards (``all_gather`` takes any length).

  Raises:
    ConfigError: naming ``seq_len`` and the multiple it needs.
  """
  if strategy == 'ring' and shards > 1 and length % shards:
    raise ConfigError(f'mesh.context_parallel_strategy=ring splits the sequence over '
                      f'{shards} context shards, but it is {length} tokens long: use a seq_len '
                      f'that is a multiple of {shards}.')


def check_expert_split(strategy: str, num_experts: int, shards: int,
                       ragged_buffer_factor: float | None = None) -> None:
  """Refuse the ``all_to_all`` expert strategy when ``num_experts`` (0: a dense model, nothing
  to split) does not split evenly over ``shards`` expert shards (``gspmd`` takes any count),
  and a ``moe.ragged_buffer_factor`` under any other strategy (it caps the ``all_to_all``
  exchange's buffers; ``gspmd`` has none).

  Raises:
    ConfigError: naming ``moe.num_experts``, the shards and the way out, or
      ``moe.ragged_buffer_factor`` and the strategy.
  """
  if ragged_buffer_factor is not None and strategy != 'all_to_all':
    raise ConfigError(f'moe.ragged_buffer_factor={ragged_buffer_factor} caps the buffers of '
                      f'mesh.expert_parallel_strategy=all_to_all, not {strategy}: set the '
                      'strategy to all_to_all, or the factor to None.')
  if strategy == 'all_to_all' and shards > 1 and num_experts and num_experts % shards:
    raise ConfigError(f'mesh.expert_parallel_strategy=all_to_all splits moe.num_experts='
                      f'{num_experts} over {shards} expert shards: use a mesh.expert that '
                      f'divides it, or mesh.expert_parallel_strategy=gspmd.')

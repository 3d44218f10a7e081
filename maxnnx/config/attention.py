"""``AttentionConfig``: the attention settings of :class:`~maxnnx.config.ModelConfig`.

The head counts and widths (``num_heads``, ``num_kv_heads``, ``head_dim``), the layer
types and the rotary embedding stay at the top level of ``ModelConfig``; the latent
attention shapes stay in its ``mla`` group. Everything else about how a layer
attends lives here (``cfg.attention.sliding_window``, ``cfg.attention.qk_norm``…).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from maxnnx.config.base import ConfigError, ValidatedConfig
from maxnnx.config.groups import GlobalAttentionConfig


@dataclasses.dataclass(frozen=True)
class AttentionConfig(ValidatedConfig):
  """How the attention layers attend (``ModelConfig.attention``).

  Attributes:
    type: ``mha`` (multi/grouped-query attention) or ``mla`` (DeepSeek multi-head
      latent attention, shaped by ``ModelConfig.mla``).
    qkv_bias: bias on the query/key/value projections (Qwen2).
    out_bias: bias on the attention output projection.
    qk_norm: ``none``; ``head`` (RMSNorm over ``head_dim`` of each head, Qwen3,
      Gemma3); ``projection`` (over all heads of q and of k, OLMo 2); or ``l2``
      (Llama 4: RMSNorm over ``head_dim`` without a learned scale, in the layers
      with rotary embeddings only).
    query_scale: multiplier of q·k; ``None`` means ``head_dim ** -0.5``
      (Gemma 2/3 use ``query_pre_attn_scalar ** -0.5``).
    logit_softcap: ``cap * tanh(scores / cap)`` before the softmax.
    sinks: a learned logit per query head joins every softmax as a value-less
      extra key, so a head can attend to nothing (GPT-OSS).
    sliding_window: keys at most this many positions back (query included) are
      visible in sliding layers; with ``ModelConfig.layer_types=None`` every layer
      is sliding when it is set.
    chunk_size: in chunked layers the sequence is cut into chunks of this many
      positions and a query sees only the keys of its own chunk (Llama 4's local
      attention, ``attention_chunk_size``).
    nope_layers: indices of the layers whose attention rotates nothing ("NoPE"
      layers, Llama 4's ``no_rope_layers`` zeros); the others use ``ModelConfig.rope``.
    temperature_tuning: multiply the queries of NoPE layers by
      ``1 + temperature_scale * log1p(floor((position + 1) / temperature_floor))``
      (Llama 4), which sharpens attention far into long contexts.
    temperature_floor: the position scale of that multiplier (``floor_scale``).
    temperature_scale: its strength (``attn_scale``).
    output_gate: the query projection also yields a per-head gate, and the
      attention output is multiplied by its sigmoid before ``o_proj``
      (Qwen3-Next's gated attention).
    value_norm: normalise each value head to unit RMS over ``head_dim``, without a
      learned scale (Gemma 4).
    global_layers: attention shapes of the ``full`` layers when they differ from the
      others' (:class:`GlobalAttentionConfig`, Gemma 4); see
      ``ModelConfig.attention_shape``.
  """

  _PATH = 'ModelConfig.attention'

  type: Literal['mha', 'mla'] = 'mha'
  qkv_bias: bool = False
  out_bias: bool = False
  qk_norm: Literal['none', 'head', 'projection', 'l2'] = 'none'
  query_scale: float | None = None
  logit_softcap: float | None = None
  sinks: bool = False
  sliding_window: int | None = None
  chunk_size: int | None = None
  nope_layers: tuple[int, ...] = ()
  temperature_tuning: bool = False
  temperature_floor: float = 8192.0
  temperature_scale: float = 0.1
  output_gate: bool = False
  value_norm: bool = False
  global_layers: GlobalAttentionConfig = dataclasses.field(
      default_factory=GlobalAttentionConfig)

  def _validate(self):
    p = self._PATH
    for name in ('sliding_window', 'chunk_size'):
      value = getattr(self, name)
      if value is not None and value <= 0:
        raise ConfigError(f'{p}.{name} must be > 0 (or None), got {value}.')
    if self.temperature_floor <= 0:
      raise ConfigError(f'{p}.temperature_floor must be > 0, got {self.temperature_floor}.')
    if len(set(self.nope_layers)) != len(self.nope_layers) or any(
        i < 0 for i in self.nope_layers):
      raise ConfigError(f'{p}.nope_layers must list distinct layer indices >= 0, got '
                        f'{self.nope_layers}.')
    if self.type != 'mha':
      for name, used in (('sinks', self.sinks), ('nope_layers', self.nope_layers),
                         ('global_layers', self.global_layers.is_set)):
        if used:
          raise ConfigError(f"{p}.{name} needs {p}.type='mha'.")

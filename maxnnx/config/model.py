"""``ModelConfig``: the architecture of a decoder-only transformer and its groups."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

from maxnnx.config.attention import AttentionConfig
from maxnnx.config.base import ConfigError, ValidatedConfig
from maxnnx.config.groups import (
  LayerType,
  LinearAttentionConfig,
  MLAConfig,
  MoEConfig,
  MTPConfig,
  RopeConfig,
  RuntimeConfig,
  VisionConfig,
)

# Attention settings that earlier versions kept at the top level -> their dotted path now.
ATTENTION_KEYS: dict[str, str] = {
    **{name: f'attention.{name}' for name in (
        'qkv_bias', 'out_bias', 'qk_norm', 'query_scale', 'sliding_window', 'nope_layers',
        'value_norm')},
    'attn_logit_softcap': 'attention.logit_softcap',
    'attention_sinks': 'attention.sinks',
    'attention_chunk_size': 'attention.chunk_size',
    'attn_temperature_tuning': 'attention.temperature_tuning',
    'attn_temperature_floor': 'attention.temperature_floor',
    'attn_temperature_scale': 'attention.temperature_scale',
    'attention_output_gate': 'attention.output_gate',
    'attention_type': 'attention.type',
    'global_attn': 'attention.global_layers',
}

# The flat keys of earlier versions for the other groups -> their dotted path now.
FLAT_GROUP_KEYS: dict[str, str] = {
    **{name: f'moe.{name}' for name in (
        'num_experts', 'num_experts_per_tok', 'num_shared_experts', 'first_k_dense_layers',
        'router_score', 'router_norm_topk', 'router_scaling_factor', 'router_groups',
        'router_topk_groups', 'router_group_score', 'router_score_bias', 'router_bias',
        'capacity_factor', 'expert_bias', 'swiglu_limit', 'swiglu_alpha')},
    'moe_mlp_dim': 'moe.mlp_dim',
    'moe_layer_step': 'moe.layer_step',
    'moe_dispatch': 'moe.dispatch',
    **{name: f'mla.{name}' for name in (
        'q_lora_rank', 'kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim')},
    'mtp_num_layers': 'mtp.num_layers',
    **{name: f'runtime.{name}' for name in (
        'param_dtype', 'dtype', 'logits_dtype', 'scan_layers', 'attention_impl',
        'paged_attention_impl', 'ragged_dot_impl', 'remat_policy', 'remat_save', 'remat_offload',
        'kernel_on_unsupported', 'record_max_logits')},
}

# Training-loss weights that earlier versions kept in ModelConfig -> where they live now.
TRAINING_KEYS: dict[str, str] = {
    name: f'TrainConfig.{name}'
    for name in ('router_aux_loss_coef', 'router_z_loss_coef', 'mtp_loss_scaling_factor')}


@dataclasses.dataclass(frozen=True)
class ModelConfig(ValidatedConfig):
  """Architecture and numerics of a decoder-only transformer.

  One config covers every family; a family is a choice of these fields plus its
  Hugging Face mapping (see :mod:`maxnnx.models.registry` and ``docs/families.md``).
  Attention, Mixture-of-Experts, latent attention, multi-token prediction and the
  runtime settings are nested groups (``cfg.attention.sliding_window``,
  ``cfg.moe.num_experts``, ``cfg.runtime.dtype``…). ``from_dict`` and ``replace`` also
  take dotted keys (``'moe.num_experts'``). The flat names of earlier versions
  (``num_experts``, ``dtype``, ``sliding_window``…) are refused, and the error names the
  dotted key to use (:data:`ATTENTION_KEYS`, :data:`FLAT_GROUP_KEYS`).

  Attributes:
    family: model family, used for Hugging Face export (``llama``, ``gemma2``…).
    vocab_size: number of token ids.
    d_model: width of the residual stream (``hidden_size``).
    num_layers: number of decoder blocks.
    num_heads: query heads.
    num_kv_heads: key/value heads (``num_heads`` for MHA, 1 for MQA, else GQA).
    head_dim: per-head width; ``None`` means ``d_model // num_heads``.
    mlp_dim: hidden width of the MLP (``intermediate_size``).
    max_position_embeddings: longest context the model supports.
    norm_type: ``rms`` (RMSNorm) or ``layer`` (LayerNorm).
    norm_eps: epsilon added to the variance in every norm.
    norm_scale_offset: norms multiply by ``offset + w``; Gemma uses 1.0.
    pre_norm: normalise the input of each attention/MLP sub-block.
    post_norm: normalise the output of each attention/MLP sub-block before the
      residual add (Gemma 2/3 use both, OLMo 2 only this one).
    layer_types: ``full``, ``sliding``, ``chunked`` or ``linear`` (Gated DeltaNet,
      configured by ``linear_attn``) per layer; ``None`` means all sliding when
      ``attention.sliding_window`` is set, else all full.
    layer_scale: every block's output is multiplied by a learned scalar
      (``layer_scalar``, Gemma 4).
    per_layer_input_dim: width of the per-layer inputs (Gemma 4 E2B/E4B's
      ``hidden_size_per_layer_input``; 0 = none): every layer gets its own
      ``[per_layer_input_dim]`` vector per token, from a table indexed by the token id
      plus a projection of its embedding, and adds ``proj(act(gate(x)) * input)`` to the
      residual stream after its MLP (:mod:`maxnnx.layers.per_layer_inputs`).
    per_layer_input_vocab_size: rows of that table; ``None`` means ``vocab_size``.
    num_kv_shared_layers: the last this many layers compute no keys or values: each
      attends with the keys and values of the last earlier layer of its type (Gemma 4
      E2B/E4B); see :attr:`kv_donors`.
    kv_shared_mlp_dim: MLP width of those layers; ``None`` means ``mlp_dim`` (E2B
      doubles it).
    position_embedding: how token positions enter the model: ``rope`` rotates
      queries and keys in every attention layer (``rope``, ``local_rope``);
      ``learned`` adds a trained ``[max_position_embeddings, d_model]`` table to
      the token embeddings and rotates nothing (GPT-2, GPT-3).
    rope: rotary embedding of full-attention layers (and of all layers unless
      ``local_rope`` is set); unused when ``position_embedding='learned'``.
    local_rope: rotary embedding of sliding layers when it differs (Gemma 3).
    rope_interleave: rotary pairs are adjacent dims ``(x0, x1), (x2, x3)…``
      rather than the two halves (DeepSeek and Llama 4 checkpoints).
    mlp_activation: ``silu``, ``gelu_tanh``, ``gelu`` or ``relu``.
    mlp_gated: gated MLP (SwiGLU/GeGLU) rather than a plain two-layer MLP.
    mlp_bias: biases in the MLP projections.
    tie_word_embeddings: the output projection reuses the input embedding.
    scale_embeddings: multiply embeddings by ``sqrt(d_model)`` (Gemma).
    final_logit_softcap: ``cap * tanh(logits / cap)`` on the output logits.
    initializer_range: std of the normal init of the embedding table.
    dropout_rate: while training, drop the embeddings and each layer's attention and MLP
      outputs with this probability (:mod:`maxnnx.layers.dropout`; 0 = none). Never
      in evaluation, generation or serving.
    bos_token_id: beginning-of-sequence id of the model's tokenizer, if any.
    eos_token_id: end-of-sequence id(s); ``generate`` stops at them by default.
    pad_token_id: padding id, if the tokenizer has one.
    attention: how the attention layers attend (:class:`AttentionConfig`): biases,
      q/k norms, scale and soft-cap, sinks, sliding window and chunks, NoPE layers,
      gates and the full layers' own shapes.
    moe: Mixture-of-Experts layers (:class:`MoEConfig`); ``moe.num_experts=0`` is dense.
    mla: latent attention shapes (:class:`MLAConfig`), used when ``attention.type='mla'``.
    mtp: multi-token prediction modules (:class:`MTPConfig`).
    linear_attn: shapes of the Gated DeltaNet layers (:class:`LinearAttentionConfig`),
      used by ``linear`` layers.
    vision: the image encoder and projector (:class:`VisionConfig`); ``vision.num_layers=0``
      is a text-only model.
    runtime: dtypes, layer-stack layout, remat and kernels (:class:`RuntimeConfig`).
  """

  # Former names: refused like any unknown key, the error naming where the setting is now.
  _MOVED = {**ATTENTION_KEYS, **FLAT_GROUP_KEYS, **TRAINING_KEYS}

  family: str = 'llama'
  vocab_size: int = 32_000
  d_model: int = 4096
  num_layers: int = 32
  num_heads: int = 32
  num_kv_heads: int = 32
  head_dim: int | None = None
  mlp_dim: int = 11_008
  max_position_embeddings: int = 4096
  norm_type: Literal['rms', 'layer'] = 'rms'
  norm_eps: float = 1e-6
  norm_scale_offset: float = 0.0
  pre_norm: bool = True
  post_norm: bool = False
  layer_types: tuple[LayerType, ...] | None = None
  layer_scale: bool = False
  per_layer_input_dim: int = 0
  per_layer_input_vocab_size: int | None = None
  num_kv_shared_layers: int = 0
  kv_shared_mlp_dim: int | None = None
  position_embedding: Literal['rope', 'learned'] = 'rope'
  rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
  local_rope: RopeConfig | None = None
  rope_interleave: bool = False
  mlp_activation: Literal['silu', 'gelu_tanh', 'gelu', 'relu'] = 'silu'
  mlp_gated: bool = True
  mlp_bias: bool = False
  tie_word_embeddings: bool = False
  scale_embeddings: bool = False
  final_logit_softcap: float | None = None
  initializer_range: float = 0.02
  dropout_rate: float = 0.0
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
  mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)
  mtp: MTPConfig = dataclasses.field(default_factory=MTPConfig)
  linear_attn: LinearAttentionConfig = dataclasses.field(default_factory=LinearAttentionConfig)
  vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
  runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

  @classmethod
  def from_stored_dict(cls, data: dict[str, Any]) -> ModelConfig:
    """:meth:`from_dict` for a config read back from disk (a checkpoint's metadata).

    Configs saved by earlier versions may hold the training-loss weights
    (:data:`TRAINING_KEYS`); they are dropped with a log line instead of refused. Flat
    keys of earlier versions (:data:`ATTENTION_KEYS`, :data:`FLAT_GROUP_KEYS`) are not
    rewritten: they are refused as in :meth:`from_dict`, naming the dotted key.
    """
    if isinstance(data, dict) and any(key in TRAINING_KEYS for key in data):
      dropped = {k: data[k] for k in data if k in TRAINING_KEYS}
      logging.info('Stored ModelConfig: dropping training settings %s (set them in '
                   'TrainConfig instead).', dropped)
      data = {k: v for k, v in data.items() if k not in TRAINING_KEYS}
    return cls.from_dict(data)

  def _validate(self):
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ConfigError(f'ModelConfig.dropout_rate must be in [0, 1), got {self.dropout_rate}.')
    positive = ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'mlp_dim',
                'max_position_embeddings')
    for name in positive:
      if getattr(self, name) <= 0:
        raise ConfigError(f'ModelConfig.{name} must be > 0, got {getattr(self, name)}.')
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f'ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads '
          f'({self.num_kv_heads}).')
    if self.head_dim is None and self.d_model % self.num_heads:
      raise ConfigError(f'ModelConfig.d_model ({self.d_model}) is not divisible by num_heads '
                        f'({self.num_heads}); set head_dim explicitly.')
    if self.layer_types is not None:
      if len(self.layer_types) != self.num_layers:
        raise ConfigError(f'ModelConfig.layer_types has {len(self.layer_types)} entries but '
                          f'num_layers is {self.num_layers}.')
      if 'sliding' in self.layer_types and self.attention.sliding_window is None:
        raise ConfigError("ModelConfig.layer_types has 'sliding' layers but "
                          'attention.sliding_window is None; set attention.sliding_window.')
      if 'chunked' in self.layer_types and self.attention.chunk_size is None:
        raise ConfigError("ModelConfig.layer_types has 'chunked' layers but "
                          'attention.chunk_size is None; set attention.chunk_size.')
    if 'chunked' in self.resolved_layer_types and self.attention.type != 'mha':
      raise ConfigError("ModelConfig: chunked layers need attention.type='mha'.")
    if 'linear' in self.resolved_layer_types:
      if self.runtime.scan_layers and set(self.resolved_layer_types) != {'linear'}:
        raise ConfigError("ModelConfig.runtime.scan_layers=True needs one kind of token mixer; "
                          "this model mixes 'linear' (Gated DeltaNet) layers with attention "
                          'layers: use scan_layers=False.')
      if self.mtp.num_layers:
        raise ConfigError("ModelConfig.mtp.num_layers > 0 is not supported with 'linear' "
                          'layers.')
    self._validate_global_attn()
    self._validate_layer_sharing()
    self._validate_nope()
    if (self.rope_interleave and self.attention.type == 'mha'
        and self.rope.partial_rotary_factor != 1.0):
      raise ConfigError('ModelConfig.rope_interleave with attention.type=\'mha\' needs '
                        'rope.partial_rotary_factor=1.0.')
    if self.rope.partial_rotary_factor * self.resolved_head_dim % 2:
      raise ConfigError('ModelConfig: the rotated part of head_dim '
                        f'({self.rope.partial_rotary_factor} * {self.resolved_head_dim}) '
                        'must be even.')
    if self.position_embedding == 'learned':
      if self.attention.type != 'mha':
        raise ConfigError("ModelConfig.position_embedding='learned' needs attention.type='mha' "
                          '(latent attention rotates part of every key).')
      if self.local_rope is not None:
        raise ConfigError("ModelConfig.local_rope is set but position_embedding='learned' "
                          'rotates nothing; set local_rope=None.')
    if self.moe.num_experts:
      self._validate_moe()

  def _validate_global_attn(self):
    """Checks of ``attention.global_layers`` (the full layers' own attention shapes)."""
    if not self.attention.global_layers.is_set:
      return
    head_dim, kv_heads, _ = self.attention_shape('full')
    if self.num_heads % kv_heads:
      raise ConfigError(f'ModelConfig.num_heads ({self.num_heads}) must be a multiple of '
                        f'attention.global_layers.num_kv_heads ({kv_heads}).')
    if self.rope.partial_rotary_factor * head_dim % 2:
      raise ConfigError('ModelConfig: the rotated part of attention.global_layers.head_dim '
                        f'({self.rope.partial_rotary_factor} * {head_dim}) must be even.')
    types = set(self.resolved_layer_types)
    if 'chunked' in types:
      raise ConfigError('ModelConfig.attention.global_layers cannot be combined with chunked '
                        'layers.')
    if self.runtime.scan_layers and 'full' in types and len(types) > 1:
      raise ConfigError('ModelConfig.runtime.scan_layers=True needs every layer to have the '
                        'same parameter shapes; attention.global_layers gives the '
                        'full-attention layers their own: use scan_layers=False.')

  def _validate_layer_sharing(self):
    """Checks of the per-layer inputs and of key/value sharing across layers."""
    for name in ('per_layer_input_dim', 'num_kv_shared_layers'):
      if getattr(self, name) < 0:
        raise ConfigError(f'ModelConfig.{name} must be >= 0, got {getattr(self, name)}.')
    for name in ('per_layer_input_vocab_size', 'kv_shared_mlp_dim'):
      value = getattr(self, name)
      if value is not None and value <= 0:
        raise ConfigError(f'ModelConfig.{name} must be > 0 (or None), got {value}.')
    if not (self.per_layer_input_dim or self.num_kv_shared_layers):
      return
    if self.runtime.scan_layers:
      raise ConfigError('ModelConfig.runtime.scan_layers=True does not support per-layer '
                        'inputs or key/value sharing across layers (per_layer_input_dim, '
                        'num_kv_shared_layers): use scan_layers=False.')
    if self.mtp.num_layers:
      raise ConfigError('ModelConfig.mtp.num_layers > 0 is not supported with per_layer_input_dim '
                        'or num_kv_shared_layers.')
    if self.num_kv_shared_layers:
      if self.attention.type != 'mha' or 'linear' in self.resolved_layer_types:
        raise ConfigError("ModelConfig.num_kv_shared_layers needs attention.type='mha' and no "
                          "'linear' layers.")
      if self.num_kv_shared_layers >= self.num_layers:
        raise ConfigError(f'ModelConfig.num_kv_shared_layers ({self.num_kv_shared_layers}) '
                          f'must leave at least one of num_layers={self.num_layers} layers '
                          'that computes keys and values.')
      missing = sorted({self.resolved_layer_types[i] for i, d in enumerate(self.kv_donors)
                        if d is None and i >= self.num_layers - self.num_kv_shared_layers})
      if missing:
        raise ConfigError(f'ModelConfig.num_kv_shared_layers={self.num_kv_shared_layers}: no '
                          f'earlier layer of type {missing} computes keys and values for the '
                          'sharing layers of that type.')

  @property
  def kv_donors(self) -> tuple[int | None, ...]:
    """For every layer, the layer whose keys and values it attends with instead of its own
    (``num_kv_shared_layers``): the last layer of its type before the sharing ones; ``None``
    for layers that compute their own."""
    first = self.num_layers - self.num_kv_shared_layers
    types = self.resolved_layer_types
    donors = []
    for i in range(self.num_layers):
      earlier = [j for j in range(first) if types[j] == types[i]] if i >= first else []
      donors.append(earlier[-1] if earlier else None)
    return tuple(donors)

  def attention_shape(self, layer_type: LayerType) -> tuple[int, int, bool]:
    """``(head_dim, num_kv_heads, values_from_keys)`` of the attention of a
    ``layer_type`` layer: ``attention.global_layers``' values in ``full`` layers where
    set, else the model's."""
    head_dim, kv_heads = self.resolved_head_dim, self.num_kv_heads
    if layer_type != 'full':
      return head_dim, kv_heads, False
    g = self.attention.global_layers
    return (g.head_dim or head_dim, g.num_kv_heads or kv_heads, g.values_from_keys)

  def _validate_nope(self):
    """Checks of ``attention.nope_layers`` that need the rest of the model."""
    nope = self.attention.nope_layers
    if any(i >= self.num_layers for i in nope):
      raise ConfigError(f'ModelConfig.attention.nope_layers must list layer indices in '
                        f'[0, num_layers={self.num_layers}), got {nope}.')
    if nope and self.position_embedding != 'rope':
      raise ConfigError("ModelConfig.attention.nope_layers needs position_embedding='rope' "
                        '(with learned positions no layer rotates anything).')

  def _validate_moe(self):
    """Checks of the MoE group that need the rest of the model."""
    moe = self.moe
    if moe.first_k_dense_layers >= self.num_layers:
      raise ConfigError(f'ModelConfig.moe.first_k_dense_layers ({moe.first_k_dense_layers}) '
                        f'leaves no MoE layer of num_layers={self.num_layers}; set '
                        'moe.num_experts=0 for a dense model.')
    if not self.mlp_gated:
      raise ConfigError('ModelConfig.moe.num_experts > 0 needs mlp_gated=True (MoE experts are '
                        'gated: SwiGLU/GeGLU).')
    if self.runtime.scan_layers and moe.layer_step > 1:
      raise ConfigError('ModelConfig.runtime.scan_layers=True needs ModelConfig.moe.layer_step=1 '
                        '(dense layers only as a first_k_dense_layers prefix); use '
                        'scan_layers=False for interleaved MoE layers.')

  @property
  def rope_head_dim(self) -> int:
    """Per-head width the rotary tables are built for (``mla.qk_rope_head_dim`` under MLA)."""
    return self.mla.qk_rope_head_dim if self.attention.type == 'mla' else self.resolved_head_dim

  @property
  def resolved_moe_mlp_dim(self) -> int:
    """``moe.mlp_dim`` with its default (``mlp_dim``) applied."""
    return self.moe.mlp_dim if self.moe.mlp_dim is not None else self.mlp_dim

  @property
  def resolved_shared_mlp_dim(self) -> int:
    """Width of the MoE layers' fused shared-expert MLP (0: none)."""
    if self.moe.shared_mlp_dim is not None:
      return self.moe.shared_mlp_dim
    return self.moe.num_shared_experts * self.resolved_moe_mlp_dim

  @property
  def moe_layers(self) -> tuple[bool, ...]:
    """For every layer, whether its feed-forward block is a Mixture-of-Experts."""
    k, step = self.moe.first_k_dense_layers, self.moe.layer_step
    return tuple(self.moe.num_experts > 0 and i >= k and (i - k) % step == 0
                 for i in range(self.num_layers))

  @property
  def resolved_head_dim(self) -> int:
    """``head_dim`` with its default (``d_model // num_heads``) applied."""
    return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

  @property
  def resolved_layer_types(self) -> tuple[LayerType, ...]:
    """The attention type of every layer."""
    if self.layer_types is not None:
      return self.layer_types
    return (('sliding' if self.attention.sliding_window else 'full'),) * self.num_layers

  @property
  def resolved_query_scale(self) -> float:
    """The multiplier applied to q·k before the softmax (``attention.query_scale``)."""
    scale = self.attention.query_scale
    return scale if scale is not None else self.resolved_head_dim**-0.5

  def jnp_dtype(self, which: Literal['dtype', 'param_dtype', 'logits_dtype'] = 'dtype'):
    """The ``jnp`` dtype of ``runtime.dtype``, ``runtime.param_dtype`` or
    ``runtime.logits_dtype``."""
    return self.runtime.jnp_dtype(which)

"""Typed, validated configuration for maxnnx models.

Configs are frozen dataclasses. Every field is type-checked on construction, and
``from_dict`` rejects unknown keys with the nearest valid name, so a typo in a
YAML file or a ``key=value`` override fails at once instead of being ignored.

Two classes matter to users:

* :class:`RopeConfig`: how rotary position embeddings are computed.
* :class:`ModelConfig`: the architecture of a decoder-only transformer, with
  nested groups for Mixture-of-Experts (:class:`MoEConfig`), latent attention
  (:class:`MLAConfig`), multi-token prediction (:class:`MTPConfig`) and the
  runtime settings: dtypes, layer-stack layout, kernels (:class:`RuntimeConfig`).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import types
import typing
from typing import Any, ClassVar, Literal

import jax.numpy as jnp


class ConfigError(ValueError):
  """A configuration value is missing, unknown or of the wrong type."""


_DTYPES = ('float32', 'bfloat16', 'float16', 'float64')


def _nearest(name: str, choices) -> str:
  match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
  return f" Did you mean '{match[0]}'?" if match else ''


def _check_type(value: Any, annotation: Any) -> bool:
  """True if ``value`` conforms to the (resolved) type ``annotation``."""
  origin = typing.get_origin(annotation)
  if annotation is Any:
    return True
  if origin is Literal:
    return value in typing.get_args(annotation)
  if origin in (typing.Union, types.UnionType):
    return any(_check_type(value, a) for a in typing.get_args(annotation))
  if annotation is type(None):
    return value is None
  if origin is tuple:
    args = typing.get_args(annotation)
    if not isinstance(value, tuple):
      return False
    if len(args) == 2 and args[1] is Ellipsis:
      return all(_check_type(v, args[0]) for v in value)
    return len(args) == len(value) and all(_check_type(v, a) for v, a in zip(value, args))
  if annotation is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if annotation is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if isinstance(annotation, type):
    return isinstance(value, annotation)
  return True


def _describe(annotation: Any) -> str:
  origin = typing.get_origin(annotation)
  if origin is Literal:
    return 'one of ' + ', '.join(repr(a) for a in typing.get_args(annotation))
  if origin in (typing.Union, types.UnionType):
    return ' or '.join(_describe(a) for a in typing.get_args(annotation))
  if annotation is type(None):
    return 'None'
  return getattr(annotation, '__name__', str(annotation))


class ValidatedConfig:
  """Mixin: type-check every field after construction; build from dicts.

  Subclasses may set ``_PATH`` (how error messages name the class, e.g.
  ``ModelConfig.moe``), ``_ALIASES`` (an accepted input key -> the dotted path of
  the field it sets) and ``_MOVED`` (a key that is refused -> where it lives now).
  """

  _PATH: ClassVar[str | None] = None
  _ALIASES: ClassVar[dict[str, str]] = {}
  _MOVED: ClassVar[dict[str, str]] = {}

  def __post_init__(self):
    hints = typing.get_type_hints(type(self))
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, list):  # lists from YAML/JSON become tuples
        value = tuple(value)
        object.__setattr__(self, field.name, value)
      nested = _nested_config_type(hints[field.name])
      if nested is not None and isinstance(value, dict):
        value = nested.from_dict(value)
        object.__setattr__(self, field.name, value)
      if not _check_type(value, hints[field.name]):
        raise ConfigError(
            f'{self._name()}.{field.name} = {value!r} is invalid: '
            f'expected {_describe(hints[field.name])}.')
    self._validate()

  @classmethod
  def _name(cls) -> str:
    return cls._PATH or cls.__name__

  def _validate(self):
    """Cross-field checks; subclasses override."""

  @classmethod
  def from_dict(cls, data: dict[str, Any]):
    """Build from a plain dict, recursing into nested config fields.

    Keys may be field names, dotted paths into nested configs (``'moe.num_experts'``)
    or the accepted aliases of the class; a dict given for a nested config
    updates that config's defaults.

    Raises:
      ConfigError: on an unknown key (naming the nearest valid one) or a bad value.
    """
    if isinstance(data, cls):
      return data
    if not isinstance(data, dict):
      raise ConfigError(f'{cls.__name__} expects a dict, got {type(data).__name__}.')
    return cls._build({}, data)

  def to_dict(self) -> dict[str, Any]:
    """A plain, JSON-serialisable dict (nested configs become dicts)."""
    return dataclasses.asdict(self)

  def replace(self, **changes):
    """A copy with ``changes`` applied (validated like ``from_dict``).

    A dict given for a nested config (``moe={'num_experts': 4}``) is merged
    into the current one; dotted keys (``**{'moe.num_experts': 4}``) and the
    class's aliases work as in :meth:`from_dict`.
    """
    current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return type(self)._build(current, changes)

  @classmethod
  def _build(cls, current: dict[str, Any], changes: dict[str, Any]):
    """``cls(**current)`` with ``changes`` (plain, dotted, aliased or nested keys) applied."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs, nested_changes = dict(current), {}
    for key, value in changes.items():
      if key in cls._MOVED:
        raise ConfigError(f"'{key}' is not a {cls._name()} field: it is a training setting now, "
                          f'set {cls._MOVED[key]} instead.')
      key = cls._ALIASES.get(key, key)
      head, _, rest = key.partition('.')
      if head not in names:
        raise ConfigError(f"Unknown {cls._name()} field '{key}'."
                          f'{_nearest(key, [*names, *cls._ALIASES])}')
      nested = _nested_config_type(hints[head])
      if rest:
        if nested is None:
          raise ConfigError(f"{cls._name()}.{head} has no field '{rest}' ('{key}').")
        nested_changes.setdefault(head, {})[rest] = value
      elif nested is not None and isinstance(value, dict):
        nested_changes.setdefault(head, {}).update(value)
      else:
        kwargs[head] = value
        nested_changes.pop(head, None)
    for head, group_changes in nested_changes.items():
      nested = _nested_config_type(hints[head])
      base = kwargs.get(head)
      kwargs[head] = (base.replace(**group_changes) if isinstance(base, nested)
                      else nested.from_dict(group_changes))
    return cls(**kwargs)


def _nested_config_type(annotation):
  for a in (annotation, *typing.get_args(annotation)):
    if isinstance(a, type) and issubclass(a, ValidatedConfig):
      return a
  return None


RopeScaling = Literal['none', 'linear', 'llama3', 'yarn', 'longrope']


@dataclasses.dataclass(frozen=True)
class RopeConfig(ValidatedConfig):
  """Rotary position embedding settings.

  Attributes:
    theta: base of the geometric frequency progression (``rope_theta``).
    scaling: context-extension method: ``none``, ``linear`` (positions divided
      by ``factor``), ``llama3`` (Llama 3.1 band-wise scaling), ``yarn`` or
      ``longrope`` (Phi-3).
    factor: scaling factor for ``linear``, ``llama3``, ``yarn`` and ``longrope``;
      ``None`` means ``max_position_embeddings / original_max_position_embeddings``
      for ``yarn`` and ``longrope``, and is an error for ``linear``/``llama3``.
    original_max_position_embeddings: context length the model was pre-trained
      with; ``llama3``, ``yarn`` and ``longrope`` use it.
    low_freq_factor: ``llama3`` only: wavelengths above
      ``original_max_position_embeddings / low_freq_factor`` are fully scaled.
    high_freq_factor: ``llama3`` only: wavelengths below
      ``original_max_position_embeddings / high_freq_factor`` are untouched.
    beta_fast: ``yarn`` only: rotations at which interpolation starts.
    beta_slow: ``yarn`` only: rotations at which interpolation ends.
    mscale: ``yarn`` only: the DeepSeek-style attention-scale numerator.
    mscale_all_dim: ``yarn`` only: the DeepSeek-style attention-scale denominator.
    truncate: ``yarn`` only: round the correction range to whole dimensions.
    attention_factor: multiplier applied to cos/sin (``yarn``, ``longrope``);
      ``None`` derives it from ``factor`` as the method defines.
    short_factor: ``longrope`` only: per-frequency divisors used while the
      sequence fits ``original_max_position_embeddings``.
    long_factor: ``longrope`` only: per-frequency divisors beyond it.
    partial_rotary_factor: fraction of ``head_dim`` that is rotated (the rest
      passes through unchanged), e.g. 0.5 for half-rotary models.
  """

  theta: float = 10_000.0
  scaling: RopeScaling = 'none'
  factor: float | None = None
  original_max_position_embeddings: int | None = None
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True
  attention_factor: float | None = None
  short_factor: tuple[float, ...] | None = None
  long_factor: tuple[float, ...] | None = None
  partial_rotary_factor: float = 1.0

  def _validate(self):
    if self.theta <= 0:
      raise ConfigError(f'RopeConfig.theta must be > 0, got {self.theta}.')
    if not 0 < self.partial_rotary_factor <= 1:
      raise ConfigError('RopeConfig.partial_rotary_factor must be in (0, 1], '
                        f'got {self.partial_rotary_factor}.')
    needs_original = ('llama3', 'yarn', 'longrope')
    if self.scaling in needs_original and self.original_max_position_embeddings is None:
      raise ConfigError(f"RopeConfig.scaling='{self.scaling}' needs "
                        'original_max_position_embeddings.')
    if self.scaling in ('linear', 'llama3') and self.factor is None:
      raise ConfigError(f"RopeConfig.scaling='{self.scaling}' needs factor.")
    if self.scaling == 'longrope' and (self.short_factor is None or self.long_factor is None):
      raise ConfigError("RopeConfig.scaling='longrope' needs short_factor and long_factor.")


LayerType = Literal['full', 'sliding']

RematPolicy = Literal['none', 'minimal', 'save_dot_except_mlp', 'save_qkv_proj', 'save_out_proj',
                      'save_attention_out', 'full']


@dataclasses.dataclass(frozen=True)
class MoEConfig(ValidatedConfig):
  """Mixture-of-Experts feed-forward layers (see :class:`maxnnx.layers.moe.MoE`).

  Attributes:
    num_experts: routed experts per MoE layer; 0 means a dense model.
    num_experts_per_tok: experts each token is routed to (top-k).
    mlp_dim: hidden width of each expert; ``None`` means the model's ``mlp_dim``.
    num_shared_experts: always-on experts, fused into one MLP of width
      ``num_shared_experts * mlp_dim`` (DeepSeek).
    first_k_dense_layers: the first layers use the dense MLP (DeepSeek).
    layer_step: after those, every ``layer_step``-th layer is MoE (layer ``i`` is
      MoE iff ``(i - first_k_dense_layers) % layer_step == 0``).
    router_score: ``softmax`` or ``sigmoid`` (DeepSeek V3) expert scores.
    router_norm_topk: renormalise the top-k weights to sum to 1.
    router_scaling_factor: multiplier of the routed output (``routed_scaling_factor``).
    router_groups: experts are split into this many groups (``n_group``).
    router_topk_groups: only experts of the best groups are eligible (``topk_group``).
    router_group_score: group score: its best expert (``max``, DeepSeek V2) or the
      sum of its best two (``top2_sum``, DeepSeek V3).
    router_score_bias: aux-loss-free load balancing: a per-expert bias added to the
      scores for choosing experts only (``e_score_correction_bias``).
    router_bias: bias on the router projection (GPT-OSS).
    dispatch: ``dropless`` (sort by expert + ragged dot) or ``capacity`` (fixed
      per-expert buffers; overflowing assignments are dropped).
    capacity_factor: ``capacity`` dispatch: buffer size per expert is
      ``ceil(capacity_factor * tokens * top_k / num_experts)``.
    expert_bias: biases in the expert projections (GPT-OSS).
    swiglu_limit: GPT-OSS clamped SwiGLU: ``gate <= limit``, ``|up| <= limit``,
      ``out = (up + 1) * gate * sigmoid(swiglu_alpha * gate)``; ``None`` = plain.
    swiglu_alpha: the sigmoid sharpness of the clamped SwiGLU.
  """

  _PATH = 'ModelConfig.moe'

  num_experts: int = 0
  num_experts_per_tok: int = 2
  mlp_dim: int | None = None
  num_shared_experts: int = 0
  first_k_dense_layers: int = 0
  layer_step: int = 1
  router_score: Literal['softmax', 'sigmoid'] = 'softmax'
  router_norm_topk: bool = True
  router_scaling_factor: float = 1.0
  router_groups: int = 1
  router_topk_groups: int = 1
  router_group_score: Literal['max', 'top2_sum'] = 'max'
  router_score_bias: bool = False
  router_bias: bool = False
  dispatch: Literal['dropless', 'capacity'] = 'dropless'
  capacity_factor: float = 1.25
  expert_bias: bool = False
  swiglu_limit: float | None = None
  swiglu_alpha: float = 1.702

  def _validate(self):
    p = self._PATH
    if self.num_experts < 0:
      raise ConfigError(f'{p}.num_experts must be >= 0 (0 = dense), got {self.num_experts}.')
    if not self.num_experts:
      return
    if not 1 <= self.num_experts_per_tok <= self.num_experts:
      raise ConfigError(f'{p}.num_experts_per_tok must be in [1, num_experts='
                        f'{self.num_experts}], got {self.num_experts_per_tok}.')
    if self.mlp_dim is not None and self.mlp_dim <= 0:
      raise ConfigError(f'{p}.mlp_dim must be > 0, got {self.mlp_dim}.')
    for name, low in (('num_shared_experts', 0), ('first_k_dense_layers', 0), ('layer_step', 1)):
      if getattr(self, name) < low:
        raise ConfigError(f'{p}.{name} must be >= {low}, got {getattr(self, name)}.')
    if self.router_groups < 1 or self.num_experts % self.router_groups:
      raise ConfigError(f'{p}.num_experts ({self.num_experts}) must be a multiple of '
                        f'router_groups ({self.router_groups}).')
    if not 1 <= self.router_topk_groups <= self.router_groups:
      raise ConfigError(f'{p}.router_topk_groups must be in [1, router_groups='
                        f'{self.router_groups}], got {self.router_topk_groups}.')
    per_group = self.num_experts // self.router_groups
    if self.router_topk_groups * per_group < self.num_experts_per_tok:
      raise ConfigError(f'{p}.router_topk_groups={self.router_topk_groups} groups of '
                        f'{per_group} experts cannot supply num_experts_per_tok='
                        f'{self.num_experts_per_tok}.')
    if self.router_group_score == 'top2_sum' and self.router_groups > 1 and per_group < 2:
      raise ConfigError(f"{p}.router_group_score='top2_sum' needs >= 2 experts per group.")
    if self.capacity_factor <= 0:
      raise ConfigError(f'{p}.capacity_factor must be > 0, got {self.capacity_factor}.')
    if self.swiglu_limit is not None and self.swiglu_limit <= 0:
      raise ConfigError(f'{p}.swiglu_limit must be > 0, got {self.swiglu_limit}.')


@dataclasses.dataclass(frozen=True)
class MLAConfig(ValidatedConfig):
  """Multi-head latent attention (DeepSeek, :class:`maxnnx.layers.mla.MLA`); used when
  ``ModelConfig.attention_type='mla'``.

  Attributes:
    q_lora_rank: rank of the query down-projection; ``None`` = full-rank queries.
    kv_lora_rank: width of the compressed key/value latent (what the cache holds).
    qk_nope_head_dim: per-head query/key width without rotary embedding.
    qk_rope_head_dim: per-head query/key width with rotary embedding (the key part
      is shared by all heads).
    v_head_dim: per-head value width.
  """

  _PATH = 'ModelConfig.mla'

  q_lora_rank: int | None = None
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128

  def _validate(self):
    p = self._PATH
    for name in ('kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim'):
      if getattr(self, name) <= 0:
        raise ConfigError(f'{p}.{name} must be > 0, got {getattr(self, name)}.')
    if self.q_lora_rank is not None and self.q_lora_rank <= 0:
      raise ConfigError(f'{p}.q_lora_rank must be > 0 or None (full-rank queries), '
                        f'got {self.q_lora_rank}.')
    if self.qk_rope_head_dim % 2:
      raise ConfigError(f'{p}.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even.')


@dataclasses.dataclass(frozen=True)
class MTPConfig(ValidatedConfig):
  """Multi-token prediction (DeepSeek V3, :class:`maxnnx.layers.mtp.MTPLayer`).

  Attributes:
    num_layers: extra modules, each one decoder block deep, that predict the token
      ``k + 1`` positions ahead (``k = 1..num_layers``); trained as an auxiliary
      loss (weighted by ``TrainConfig.mtp_loss_scaling_factor``), ignored when
      generating. 0 = none.
  """

  _PATH = 'ModelConfig.mtp'

  num_layers: int = 0

  def _validate(self):
    if self.num_layers < 0:
      raise ConfigError(f'{self._PATH}.num_layers must be >= 0 (0 = no multi-token '
                        f'prediction), got {self.num_layers}.')


@dataclasses.dataclass(frozen=True)
class RuntimeConfig(ValidatedConfig):
  """Numerics, layer-stack layout and kernel choices: how a model runs, not what it is.

  Attributes:
    param_dtype: dtype parameters are stored in.
    dtype: dtype activations and matmuls are computed in.
    logits_dtype: dtype of the returned logits.
    scan_layers: hold the layer stack as one scanned module (fast compile for deep
      models) instead of a list of modules (easy to inspect and edit).
    attention_impl: attention kernel strategy by name. ``xla_flash`` (the default:
      plain XLA, skips the masked causal blocks and recomputes the softmax in the
      backward pass) and ``xla`` (the reference) run everywhere.
    ragged_dot_impl: grouped-matmul strategy of MoE layers by name (``lax``, the
      ``dense`` reference and ``tiled`` always exist; ``tiled`` is about 2x faster
      than ``lax`` on CPUs, whose ``ragged_dot`` multiplies every row by every expert).
    remat_policy: what each block keeps for the backward pass (the rest is
      recomputed): ``none`` keeps everything; ``minimal`` keeps matmul outputs
      without batch dims; ``save_dot_except_mlp`` keeps the attention projections
      and outputs; ``save_qkv_proj`` / ``save_out_proj`` / ``save_attention_out``
      keep only those; ``full`` keeps nothing but the block inputs.
    kernel_on_unsupported: what a kernel strategy does with a call it declares it
      cannot serve: ``fallback`` (compute it with ``xla``/``lax`` and log a warning
      once) or ``error`` (raise).
  """

  _PATH = 'ModelConfig.runtime'

  param_dtype: Literal[_DTYPES] = 'float32'
  dtype: Literal[_DTYPES] = 'float32'
  logits_dtype: Literal[_DTYPES] = 'float32'
  scan_layers: bool = False
  attention_impl: str = 'xla_flash'
  ragged_dot_impl: str = 'lax'
  remat_policy: RematPolicy = 'none'
  kernel_on_unsupported: Literal['fallback', 'error'] = 'fallback'

  def jnp_dtype(self, which: Literal['dtype', 'param_dtype', 'logits_dtype'] = 'dtype'):
    """The ``jnp`` dtype of ``dtype``, ``param_dtype`` or ``logits_dtype``."""
    return jnp.dtype(getattr(self, which))


# The flat ModelConfig keys of earlier versions, accepted as input: old name -> new dotted path.
LEGACY_MODEL_KEYS: dict[str, str] = {
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
        'ragged_dot_impl', 'remat_policy', 'kernel_on_unsupported')},
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
  Mixture-of-Experts, latent attention, multi-token prediction and the runtime
  settings are nested groups (``cfg.moe.num_experts``, ``cfg.runtime.dtype``…).
  ``from_dict`` and ``replace`` also take dotted keys (``'moe.num_experts'``) and the
  flat names of earlier versions (:data:`LEGACY_MODEL_KEYS`, e.g. ``num_experts``,
  ``dtype``).

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
    qkv_bias: bias on the query/key/value projections (Qwen2).
    out_bias: bias on the attention output projection.
    qk_norm: ``none``; ``head`` (RMSNorm over ``head_dim`` of each head, Qwen3,
      Gemma3) or ``projection`` (over all heads of q and of k, OLMo 2).
    query_scale: multiplier of q·k; ``None`` means ``head_dim ** -0.5``
      (Gemma 2/3 use ``query_pre_attn_scalar ** -0.5``).
    attn_logit_softcap: ``cap * tanh(scores / cap)`` before the softmax.
    attention_sinks: a learned logit per query head joins every softmax as a
      value-less extra key, so a head can attend to nothing (GPT-OSS).
    sliding_window: keys at most this many positions back (query included) are
      visible in sliding layers.
    layer_types: ``full`` or ``sliding`` per layer; ``None`` means all sliding
      when ``sliding_window`` is set, else all full.
    rope: rotary embedding of full-attention layers (and of all layers unless
      ``local_rope`` is set).
    local_rope: rotary embedding of sliding layers when it differs (Gemma 3).
    rope_interleave: rotary pairs are adjacent dims ``(x0, x1), (x2, x3)…``
      rather than the two halves (DeepSeek checkpoints).
    mlp_activation: ``silu``, ``gelu_tanh``, ``gelu`` or ``relu``.
    mlp_gated: gated MLP (SwiGLU/GeGLU) rather than a plain two-layer MLP.
    mlp_bias: biases in the MLP projections.
    tie_word_embeddings: the output projection reuses the input embedding.
    scale_embeddings: multiply embeddings by ``sqrt(d_model)`` (Gemma).
    final_logit_softcap: ``cap * tanh(logits / cap)`` on the output logits.
    initializer_range: std of the normal init of the embedding table.
    bos_token_id: beginning-of-sequence id of the model's tokenizer, if any.
    eos_token_id: end-of-sequence id(s); ``generate`` stops at them by default.
    pad_token_id: padding id, if the tokenizer has one.
    attention_type: ``mha`` (multi/grouped-query attention) or ``mla`` (DeepSeek
      multi-head latent attention, configured by ``mla``).
    moe: Mixture-of-Experts layers (:class:`MoEConfig`); ``moe.num_experts=0`` is dense.
    mla: latent attention shapes (:class:`MLAConfig`), used when ``attention_type='mla'``.
    mtp: multi-token prediction modules (:class:`MTPConfig`).
    runtime: dtypes, layer-stack layout, remat and kernels (:class:`RuntimeConfig`).
  """

  _ALIASES = LEGACY_MODEL_KEYS
  _MOVED = TRAINING_KEYS

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
  qkv_bias: bool = False
  out_bias: bool = False
  qk_norm: Literal['none', 'head', 'projection'] = 'none'
  query_scale: float | None = None
  attn_logit_softcap: float | None = None
  attention_sinks: bool = False
  sliding_window: int | None = None
  layer_types: tuple[LayerType, ...] | None = None
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
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  attention_type: Literal['mha', 'mla'] = 'mha'
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
  mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)
  mtp: MTPConfig = dataclasses.field(default_factory=MTPConfig)
  runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

  @classmethod
  def from_stored_dict(cls, data: dict[str, Any]) -> ModelConfig:
    """:meth:`from_dict` for a config read back from disk (a checkpoint's metadata).

    Configs saved by earlier versions may hold the training-loss weights
    (:data:`TRAINING_KEYS`); they are dropped with a log line instead of refused.
    """
    if isinstance(data, dict) and any(key in TRAINING_KEYS for key in data):
      dropped = {k: data[k] for k in data if k in TRAINING_KEYS}
      logging.info('Stored ModelConfig: dropping training settings %s (set them in '
                   'TrainConfig instead).', dropped)
      data = {k: v for k, v in data.items() if k not in TRAINING_KEYS}
    return cls.from_dict(data)

  def _validate(self):
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
      if 'sliding' in self.layer_types and self.sliding_window is None:
        raise ConfigError("ModelConfig.layer_types has 'sliding' layers but sliding_window "
                          'is None; set sliding_window.')
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise ConfigError(f'ModelConfig.sliding_window must be > 0, got {self.sliding_window}.')
    if self.rope.partial_rotary_factor * self.resolved_head_dim % 2:
      raise ConfigError('ModelConfig: the rotated part of head_dim '
                        f'({self.rope.partial_rotary_factor} * {self.resolved_head_dim}) '
                        'must be even.')
    if self.attention_sinks and self.attention_type != 'mha':
      raise ConfigError("ModelConfig.attention_sinks needs attention_type='mha'.")
    if self.moe.num_experts:
      self._validate_moe()

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
    return self.mla.qk_rope_head_dim if self.attention_type == 'mla' else self.resolved_head_dim

  @property
  def resolved_moe_mlp_dim(self) -> int:
    """``moe.mlp_dim`` with its default (``mlp_dim``) applied."""
    return self.moe.mlp_dim if self.moe.mlp_dim is not None else self.mlp_dim

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
    return (('sliding' if self.sliding_window else 'full'),) * self.num_layers

  @property
  def resolved_query_scale(self) -> float:
    """The multiplier applied to q·k before the softmax."""
    return self.query_scale if self.query_scale is not None else self.resolved_head_dim**-0.5

  def jnp_dtype(self, which: Literal['dtype', 'param_dtype', 'logits_dtype'] = 'dtype'):
    """The ``jnp`` dtype of ``runtime.dtype``, ``runtime.param_dtype`` or
    ``runtime.logits_dtype``."""
    return self.runtime.jnp_dtype(which)


def resolve_dtype(name: str):
  """``jnp.dtype`` for a dtype name, with an error naming the valid ones."""
  if name not in _DTYPES:
    raise ConfigError(f"Unknown dtype '{name}'.{_nearest(name, _DTYPES)} "
                      f'Valid: {", ".join(_DTYPES)}.')
  return jnp.dtype(name)


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
    pipeline_microbatches: microbatches per step when ``stage > 1``; ``None``
      means one per stage.
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
  pipeline_microbatches: int | None = None
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

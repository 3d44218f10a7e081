"""Config groups: rotary embeddings and the nested groups of :class:`ModelConfig`.

:class:`RopeConfig` (rotary embeddings), :class:`MoEConfig` (Mixture-of-Experts),
:class:`MLAConfig` (multi-head latent attention), :class:`MTPConfig` (multi-token prediction)
and :class:`RuntimeConfig` (dtypes, layer layout, kernels). Each layer takes the group it uses.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from maxnnx.config.base import _DTYPES, ConfigError, ValidatedConfig
from maxnnx.hardware import resolve_compute_dtype

RopeScaling = Literal['none', 'linear', 'llama3', 'yarn', 'longrope', 'proportional']


@dataclasses.dataclass(frozen=True)
class RopeConfig(ValidatedConfig):
  """Rotary position embedding settings.

  Attributes:
    theta: base of the geometric frequency progression (``rope_theta``).
    scaling: context-extension method: ``none``, ``linear`` (positions divided
      by ``factor``), ``llama3`` (Llama 3.1 band-wise scaling), ``yarn``,
      ``longrope`` (Phi-3) or ``proportional`` (Gemma 4's full layers: the first
      ``partial_rotary_factor`` of the frequencies of a rotation over the *whole*
      head, ``theta ** (-2i / head_dim)``, the others zero; ``factor`` divides them).
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
      passes through unchanged), e.g. 0.5 for half-rotary models; under
      ``proportional`` the fraction of the frequency pairs that are non-zero.
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


LayerType = Literal['full', 'sliding', 'chunked', 'linear']

RematPolicy = Literal['none', 'minimal', 'save_dot_except_mlp', 'save_qkv_proj', 'save_out_proj',
                      'save_attention_out', 'full', 'custom']

# The intermediates layers tag with ``checkpoint_name`` (see :mod:`maxnnx.layers.remat`).
RematTensor = Literal['query_proj', 'key_proj', 'value_proj', 'attention_out', 'out_proj',
                      'mlp_hidden', 'mlp_out']


@dataclasses.dataclass(frozen=True)
class MoEConfig(ValidatedConfig):
  """Mixture-of-Experts feed-forward layers (see :class:`maxnnx.layers.moe.MoE`).

  Attributes:
    num_experts: routed experts per MoE layer; 0 means a dense model.
    num_experts_per_tok: experts each token is routed to (top-k).
    mlp_dim: hidden width of each expert; ``None`` means the model's ``mlp_dim``.
    num_shared_experts: always-on experts, fused into one MLP of width
      ``num_shared_experts * mlp_dim`` (DeepSeek).
    shared_mlp_dim: width of that fused shared MLP when it is not a multiple of
      the routed experts' (Qwen3-Next, Qwen3.5); ``None`` means
      ``num_shared_experts * mlp_dim``. Needs ``num_shared_experts >= 1``.
    shared_expert_gate: scale the shared experts' output per token by
      ``sigmoid(x . w)`` of a learned ``[d_model]`` vector (Qwen3-Next).
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
    router_bias_update_rate: training: after every optimizer step, move each expert's
      ``router_score_bias`` by this much towards balance, ``bias += rate * sign(mean
      load - load)`` over the step's tokens (DeepSeek V3 used 0.001); 0 = frozen bias.
    router_bias: bias on the router projection (GPT-OSS).
    router_weights_on_input: scale each expert's *input* by the token's routing
      weight instead of its output (Llama 4; the two differ because an expert is
      not linear).
    router_input_norm: the router reads ``rms_normalise(x) * scale * d_model ** -0.5``
      with a learned ``[d_model]`` ``scale`` instead of ``x`` (Gemma 4).
    per_expert_scale: a learned ``[num_experts]`` multiplier of each chosen expert's
      routing weight, applied after the top-k renormalisation (Gemma 4).
    dense_branch: MoE layers keep the dense MLP (width ``ModelConfig.mlp_dim``) and
      add the experts beside it: the MLP reads the pre-normed residual, the router
      the residual itself, the experts their own pre-normed copy; each branch's
      output has its own post-norm and their sum the block's post-norm (Gemma 4).
    dispatch: ``dropless`` (sort by expert + ragged dot) or ``capacity`` (fixed
      per-expert buffers; overflowing assignments are dropped).
    capacity_factor: ``capacity`` dispatch: buffer size per expert is
      ``ceil(capacity_factor * tokens * top_k / num_experts)``, ``tokens`` those of one
      capacity group (``capacity_group``).
    capacity_group: ``capacity`` dispatch under the ``gspmd`` expert strategy: which tokens
      share an expert's slots and decide its drops. ``sequence`` (as MaxText's dropping path,
      whose capacity is per batch row): each sequence is a group of ``seq_len`` tokens with
      its own slots, so a batch split over ``data``/``fsdp`` dispatches without exchanging
      any routing and each device holds only its rows' buffers. ``batch``: the whole global
      batch is one group (the rule before ``sequence``; its slot positions count every
      shard's tokens). The ``all_to_all`` strategy keeps its own per-shard slots.
    ragged_buffer_factor: ``dropless`` dispatch under ``mesh.expert_parallel_strategy=
      all_to_all`` (MaxText's ``ragged_buffer_factor``): each device's receive buffer holds
      this many times its balanced share of the exchanged assignments (its own ``tokens *
      top_k``) instead of ``expert`` times it (the worst case); assignments that overflow are
      dropped (see :mod:`maxnnx.layers.expert_parallel` for which) and counted in
      ``MoE.dropped_assignments``. ``None`` (default): the worst case, nothing dropped;
      ``>= expert`` drops nothing either.
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
  shared_mlp_dim: int | None = None
  shared_expert_gate: bool = False
  first_k_dense_layers: int = 0
  layer_step: int = 1
  router_score: Literal['softmax', 'sigmoid'] = 'softmax'
  router_norm_topk: bool = True
  router_scaling_factor: float = 1.0
  router_groups: int = 1
  router_topk_groups: int = 1
  router_group_score: Literal['max', 'top2_sum'] = 'max'
  router_score_bias: bool = False
  router_bias_update_rate: float = 0.0
  router_bias: bool = False
  router_weights_on_input: bool = False
  router_input_norm: bool = False
  per_expert_scale: bool = False
  dense_branch: bool = False
  dispatch: Literal['dropless', 'capacity'] = 'dropless'
  capacity_factor: float = 1.25
  ragged_buffer_factor: float | None = None
  capacity_group: Literal['sequence', 'batch'] = 'sequence'
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
    if self.shared_mlp_dim is not None and (self.shared_mlp_dim <= 0
                                            or not self.num_shared_experts):
      raise ConfigError(f'{p}.shared_mlp_dim must be > 0 and needs num_shared_experts >= 1, '
                        f'got {self.shared_mlp_dim} with num_shared_experts='
                        f'{self.num_shared_experts}.')
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
    if not self.router_bias_update_rate >= 0:
      raise ConfigError(f'{p}.router_bias_update_rate must be >= 0 (0 = off), got '
                        f'{self.router_bias_update_rate}.')
    if self.router_bias_update_rate and not self.router_score_bias:
      raise ConfigError(f'{p}.router_bias_update_rate needs router_score_bias=True (the bias '
                        'it moves); set both, or the rate to 0.')
    if self.capacity_factor <= 0:
      raise ConfigError(f'{p}.capacity_factor must be > 0, got {self.capacity_factor}.')
    if self.ragged_buffer_factor is not None:
      if not self.ragged_buffer_factor > 0:
        raise ConfigError(f'{p}.ragged_buffer_factor must be > 0 (None = worst-case buffers, '
                          f'nothing dropped), got {self.ragged_buffer_factor}.')
      if self.dispatch != 'dropless':
        raise ConfigError(f"{p}.ragged_buffer_factor caps the dropless dispatch's exchange "
                          f"buffers; dispatch='{self.dispatch}' sizes its own with "
                          'capacity_factor: set one or the other.')
    if self.swiglu_limit is not None and self.swiglu_limit <= 0:
      raise ConfigError(f'{p}.swiglu_limit must be > 0, got {self.swiglu_limit}.')


@dataclasses.dataclass(frozen=True)
class MLAConfig(ValidatedConfig):
  """Multi-head latent attention (DeepSeek, :class:`maxnnx.layers.mla.MLA`); used when
  ``ModelConfig.attention.type='mla'``.

  Attributes:
    q_lora_rank: rank of the query down-projection; ``None`` = full-rank queries.
    kv_lora_rank: width of the compressed key/value latent (what the cache holds).
    qk_nope_head_dim: per-head query/key width without rotary embedding.
    qk_rope_head_dim: per-head query/key width with rotary embedding (the key part
      is shared by all heads).
    v_head_dim: per-head value width.
    index_topk: DeepSeek Sparse Attention (V3.2): each query attends only to the
      ``index_topk`` keys a lightning indexer scores highest; ``None`` = dense MLA.
    index_num_heads: heads of the indexer (``index_n_heads``).
    index_head_dim: width of the indexer's queries and keys (``index_head_dim``).
    indexer_training: the stage of DeepSeek V3.2's indexer training: ``off``;
      ``dense_warmup`` (attention stays dense, the indexer alone trains, by the KL from the
      dense attention distribution to its scores over every visible key); ``sparse``
      (attention uses the indexer's selection, everything trains, the indexer by the same KL
      over its selected keys, its input detached). The loss is
      :func:`~maxnnx.layers.indexer.indexer_kl_loss`, weighted by
      ``TrainConfig.indexer_loss_weight``.
  """

  _PATH = 'ModelConfig.mla'

  q_lora_rank: int | None = None
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  index_topk: int | None = None
  index_num_heads: int = 64
  index_head_dim: int = 128
  indexer_training: Literal['off', 'dense_warmup', 'sparse'] = 'off'

  def _validate(self):
    p = self._PATH
    if self.indexer_training != 'off' and self.index_topk is None:
      raise ConfigError(f'{p}.indexer_training={self.indexer_training} trains the lightning '
                        f'indexer of sparse attention: set {p}.index_topk (DeepSeek V3.2: 2048).')
    if self.index_topk is not None:
      if self.index_topk <= 0 or self.index_num_heads <= 0:
        raise ConfigError(f'{p}.index_topk and index_num_heads must be > 0.')
      if self.q_lora_rank is None:
        raise ConfigError(f'{p}.index_topk needs q_lora_rank (the indexer reads the low-rank '
                          'query).')
      if not self.qk_rope_head_dim <= self.index_head_dim:
        raise ConfigError(f'{p}.index_head_dim ({self.index_head_dim}) must be >= '
                          f'qk_rope_head_dim ({self.qk_rope_head_dim}).')
    for name in ('kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim'):
      if getattr(self, name) <= 0:
        raise ConfigError(f'{p}.{name} must be > 0, got {getattr(self, name)}.')
    if self.q_lora_rank is not None and self.q_lora_rank <= 0:
      raise ConfigError(f'{p}.q_lora_rank must be > 0 or None (full-rank queries), '
                        f'got {self.q_lora_rank}.')
    if self.qk_rope_head_dim % 2:
      raise ConfigError(f'{p}.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even.')


@dataclasses.dataclass(frozen=True)
class GlobalAttentionConfig(ValidatedConfig):
  """Attention shapes of the ``full`` layers when they differ from the other layers'
  (Gemma 4: wider heads, fewer key/value heads and values taken from the keys in
  the global layers). ``None`` fields keep the model's value.

  Attributes:
    head_dim: per-head width of the full-attention layers (``global_head_dim``).
    num_kv_heads: their key/value heads (``num_global_key_value_heads``).
    values_from_keys: they have no value projection; values are the key
      projection before the key norm and rotation (``attention_k_eq_v``).
  """

  _PATH = 'ModelConfig.attention.global_layers'

  head_dim: int | None = None
  num_kv_heads: int | None = None
  values_from_keys: bool = False

  def _validate(self):
    for name in ('head_dim', 'num_kv_heads'):
      value = getattr(self, name)
      if value is not None and value <= 0:
        raise ConfigError(f'{self._PATH}.{name} must be > 0 (or None), got {value}.')

  @property
  def is_set(self) -> bool:
    """Whether the full layers differ from the others at all."""
    return self != GlobalAttentionConfig()


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig(ValidatedConfig):
  """Gated DeltaNet linear attention (:class:`maxnnx.layers.GatedDeltaNet`), used by the
  ``linear`` layers of ``ModelConfig.layer_types`` (Qwen3-Next, Qwen3.5).

  Attributes:
    num_key_heads: query/key heads (``linear_num_key_heads``).
    num_value_heads: value heads, a multiple of ``num_key_heads`` (each key head
      serves ``num_value_heads // num_key_heads`` consecutive value heads).
    key_head_dim: per-head query/key width.
    value_head_dim: per-head value width.
    conv_kernel_size: taps of the causal depthwise convolution over q/k/v.
    projections: how the input projections are laid out: ``grouped`` (Qwen3-Next:
      ``in_proj_qkvz`` and ``in_proj_ba``, interleaved per key head) or ``split``
      (Qwen3.5: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
  """

  _PATH = 'ModelConfig.linear_attn'

  num_key_heads: int = 16
  num_value_heads: int = 32
  key_head_dim: int = 128
  value_head_dim: int = 128
  conv_kernel_size: int = 4
  projections: Literal['grouped', 'split'] = 'grouped'

  def _validate(self):
    p = self._PATH
    for name in ('num_key_heads', 'num_value_heads', 'key_head_dim', 'value_head_dim',
                 'conv_kernel_size'):
      if getattr(self, name) <= 0:
        raise ConfigError(f'{p}.{name} must be > 0, got {getattr(self, name)}.')
    if self.num_value_heads % self.num_key_heads:
      raise ConfigError(f'{p}.num_value_heads ({self.num_value_heads}) must be a multiple of '
                        f'num_key_heads ({self.num_key_heads}).')


@dataclasses.dataclass(frozen=True)
class VisionConfig(ValidatedConfig):
  """An image encoder and projector feeding the language model (Gemma 3's SigLIP tower;
  :mod:`maxnnx.layers.vision`). ``num_layers=0`` is a text-only model.

  Images are ``[batch, num_channels, image_size, image_size]`` float32 pixels, already
  resized and normalised (:mod:`maxnnx.data.images`). The tower cuts them into
  ``patch_size`` squares, adds a learned position per patch, runs ``num_layers``
  pre-LayerNorm ViT blocks (bidirectional attention, biased projections, a GELU MLP)
  and a final LayerNorm; the projector average-pools the patch grid down to
  ``tokens_per_image`` tokens, RMS-normalises them and maps them to ``d_model``. Those
  replace the ``image_token_id`` placeholders of the text, whose tokens attend to each
  other in both directions within an image.

  Attributes:
    num_layers: encoder blocks; 0 = no vision tower.
    hidden_size: encoder width.
    intermediate_size: encoder MLP width.
    num_heads: encoder attention heads.
    image_size: side of the square input images, in pixels.
    patch_size: side of a patch, in pixels.
    num_channels: colour channels.
    norm_eps: epsilon of the encoder's LayerNorms and of the projector's RMSNorm.
    activation: encoder MLP activation (``gelu_tanh`` in SigLIP).
    tokens_per_image: text-side tokens per image (a square number dividing the patch
      grid; ``mm_tokens_per_image``). With ``pixel_shuffle``, one image is one tile.
    image_token_id: the placeholder token the image embeddings replace.
    patch_bias: the patch projection has a bias (SigLIP; not Llama 4).
    class_token: a learned class token joins the patches (after them, as Llama 4 puts
      it) and is dropped after the final LayerNorm.
    pre_norm: a LayerNorm before the first block (Llama 4's ``layernorm_pre``).
    rope_theta: 2-D rotary embeddings in the tower's attention (Llama 4: the first half of
      the rotated pairs turn with the patch's column, the second with its row, counted
      from 1; ``None``: no rotary embedding).
    projector: ``pooled`` (Gemma 3: average-pool, RMSNorm, one map) or
      ``pixel_shuffle`` (Llama 4: fold ``s x s`` neighbouring patches, ``s = 1 /
      pixel_shuffle_ratio``, into one token, a two-layer GELU MLP to ``adapter_dim`` and
      one map to ``d_model``).
    pixel_shuffle_ratio: tokens per patch along each side with ``pixel_shuffle``.
    adapter_dim: width of the ``pixel_shuffle`` projector's MLP.
    bidirectional: the tokens of an image attend to each other in both directions in the
      language model (Gemma 3); ``False``: plain causal attention (Llama 4).
  """

  _PATH = 'ModelConfig.vision'

  num_layers: int = 0
  hidden_size: int = 1152
  intermediate_size: int = 4304
  num_heads: int = 16
  image_size: int = 896
  patch_size: int = 14
  num_channels: int = 3
  norm_eps: float = 1e-6
  activation: Literal['silu', 'gelu_tanh', 'gelu', 'relu'] = 'gelu_tanh'
  tokens_per_image: int = 256
  image_token_id: int | None = None
  patch_bias: bool = True
  class_token: bool = False
  pre_norm: bool = False
  rope_theta: float | None = None
  projector: Literal['pooled', 'pixel_shuffle'] = 'pooled'
  pixel_shuffle_ratio: float = 0.5
  adapter_dim: int = 0
  bidirectional: bool = True

  def _validate(self):
    p = self._PATH
    if self.num_layers < 0:
      raise ConfigError(f'{p}.num_layers must be >= 0 (0 = no vision tower), got '
                        f'{self.num_layers}.')
    if not self.num_layers:
      return
    for name in ('hidden_size', 'intermediate_size', 'num_heads', 'image_size', 'patch_size',
                 'num_channels', 'tokens_per_image'):
      if getattr(self, name) <= 0:
        raise ConfigError(f'{p}.{name} must be > 0, got {getattr(self, name)}.')
    if self.hidden_size % self.num_heads:
      raise ConfigError(f'{p}.hidden_size ({self.hidden_size}) must be a multiple of '
                        f'num_heads ({self.num_heads}).')
    if self.image_size % self.patch_size:
      raise ConfigError(f'{p}.image_size ({self.image_size}) must be a multiple of '
                        f'patch_size ({self.patch_size}).')
    side = round(self.tokens_per_image**0.5)
    if side * side != self.tokens_per_image or self.patches_per_side % side:
      raise ConfigError(f'{p}.tokens_per_image ({self.tokens_per_image}) must be a square '
                        f'whose side divides the {self.patches_per_side} patches per side.')
    if self.projector == 'pixel_shuffle':
      fold = round(1 / self.pixel_shuffle_ratio)
      if abs(fold * self.pixel_shuffle_ratio - 1) > 1e-6 or self.patches_per_side % fold:
        raise ConfigError(f'{p}.pixel_shuffle_ratio ({self.pixel_shuffle_ratio}) must be 1/s '
                          f'for an s dividing the {self.patches_per_side} patches per side.')
      if side != self.patches_per_side // fold:
        raise ConfigError(f'{p}.tokens_per_image must be {(self.patches_per_side // fold)**2} '
                          f'with pixel_shuffle_ratio={self.pixel_shuffle_ratio}, got '
                          f'{self.tokens_per_image}.')
      if self.adapter_dim <= 0:
        raise ConfigError(f'{p}.adapter_dim must be > 0 with projector=pixel_shuffle.')
    if self.rope_theta is not None and (self.hidden_size // self.num_heads) % 4:
      raise ConfigError(f'{p}.rope_theta needs a head size ({self.hidden_size // self.num_heads}) '
                        'divisible by 4 (pairs turn with the column, then the row).')
    if self.image_token_id is None:
      raise ConfigError(f'{p}.image_token_id is needed with a vision tower: the token whose '
                        'places the image embeddings take.')

  @property
  def patches_per_side(self) -> int:
    """Patches along each side of an image."""
    return self.image_size // self.patch_size


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
    dtype: dtype activations and matmuls are computed in; ``'auto'`` is the one this
      machine is fastest at (bfloat16 on GPU/TPU and on CPUs with native bf16, else
      float32; see :mod:`maxnnx.hardware`), decided when the model computes.
    logits_dtype: dtype of the returned logits.
    scan_layers: hold the layer stack as one scanned module (fast compile for deep
      models) instead of a list of modules (easy to inspect and edit).
    attention_impl: attention kernel strategy by name. ``auto`` (the default) runs
      ``cudnn`` for bf16/f16 on NVIDIA GPUs and ``xla_flash`` elsewhere (see
      :mod:`maxnnx.kernels.attention_auto`); ``xla_flash`` (plain XLA, skips the
      masked causal blocks and recomputes the softmax in the backward pass) and
      ``xla`` (the reference) run everywhere.
    paged_attention_impl: attention strategy of the serving engine's paged KV cache
      by name (``xla``, the reference, runs everywhere; see
      :mod:`maxnnx.kernels.paged_attention`).
    ragged_dot_impl: grouped-matmul strategy of MoE layers by name (``lax``, the
      ``dense`` reference and ``tiled`` always exist; ``tiled`` is about 2x faster
      than ``lax`` on CPUs, whose ``ragged_dot`` multiplies every row by every expert).
    gated_delta_impl: strategy of the gated delta rule in Gated DeltaNet layers by
      name: ``chunked`` (the default) or ``recurrent`` (the token-by-token reference);
      see :mod:`maxnnx.kernels.gated_delta`.
    remat_policy: what each block keeps for the backward pass (the rest is
      recomputed): ``none`` keeps everything; ``minimal`` keeps matmul outputs
      without batch dims; ``save_dot_except_mlp`` keeps the attention projections
      and outputs; ``save_qkv_proj`` / ``save_out_proj`` / ``save_attention_out``
      keep only those; ``full`` keeps nothing but the block inputs; ``custom``
      decides per tagged tensor with ``remat_save`` and ``remat_offload``.
    remat_save: with ``remat_policy='custom'``, the tagged tensors kept in device
      memory for the backward pass (``query_proj``, ``key_proj``, ``value_proj``,
      ``attention_out``, ``out_proj``, ``mlp_hidden``, ``mlp_out``).
    remat_offload: with ``remat_policy='custom'``, the tagged tensors moved to host
      memory (``pinned_host``) after the forward pass and brought back for the
      backward pass. Tagged tensors in neither list, and everything untagged, are
      recomputed.
    record_max_logits: give each attention layer a ``max_logits`` variable that every
      forward pass fills with each head's largest pre-softmax logit (what QK-clip,
      ``TrainConfig.qk_clip_threshold``, reads; ``xla_flash`` takes it from its own blocks,
      other strategies cost one more dense score pass per layer).
    kernel_on_unsupported: what a kernel strategy does with a call it declares it
      cannot serve: ``fallback`` (compute it with ``xla``/``lax`` and log a warning
      once) or ``error`` (raise).
  """

  _PATH = 'ModelConfig.runtime'

  param_dtype: Literal[_DTYPES] = 'float32'
  dtype: Literal[(*_DTYPES, 'auto')] = 'float32'
  logits_dtype: Literal[_DTYPES] = 'float32'
  scan_layers: bool = False
  attention_impl: str = 'auto'
  paged_attention_impl: str = 'xla'
  ragged_dot_impl: str = 'lax'
  gated_delta_impl: str = 'chunked'
  remat_policy: RematPolicy = 'none'
  remat_save: tuple[RematTensor, ...] = ()
  remat_offload: tuple[RematTensor, ...] = ()
  kernel_on_unsupported: Literal['fallback', 'error'] = 'fallback'
  record_max_logits: bool = False

  def _validate(self):
    chosen = self.remat_save + self.remat_offload
    if chosen and self.remat_policy != 'custom':
      raise ConfigError(f"{self._PATH}.remat_save / remat_offload choose tensors for "
                        f"remat_policy='custom', but remat_policy={self.remat_policy!r}: set "
                        "remat_policy='custom' (or drop them).")
    both = sorted(set(self.remat_save) & set(self.remat_offload))
    if both:
      raise ConfigError(f'{self._PATH}: {", ".join(both)} is in both remat_save and '
                        'remat_offload; keep each tensor in one.')

  def jnp_dtype(self, which: Literal['dtype', 'param_dtype', 'logits_dtype'] = 'dtype'):
    """The ``jnp`` dtype of ``dtype``, ``param_dtype`` or ``logits_dtype`` (``'auto'``
    resolved for this machine)."""
    return jnp.dtype(resolve_compute_dtype(getattr(self, which)))

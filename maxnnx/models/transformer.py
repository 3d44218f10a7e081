"""The decoder-only transformer shared by every dense family.

``Transformer(cfg, rngs=...)`` is embed -> N x DecoderBlock -> norm -> logits.
Families differ only in their :class:`ModelConfig` and Hugging Face mapping.
With ``mtp.num_layers``, multi-token-prediction modules (:mod:`maxnnx.layers.mtp`)
follow the stack; ``model(ids, mtp=True)`` also returns their logits.

The layer stack is either an ``nnx.List`` of blocks (``scan_layers=False``: easy
to index, inspect and edit in a notebook) or one block whose parameters carry a
leading ``layers`` axis, run with ``jax.lax.scan`` (``scan_layers=True``: one
compiled block however deep the model). Both draw the same weights from a seed
(see :func:`layer_rngs`) and give identical outputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxnnx.config import ModelConfig
from maxnnx.kernels.masks import AttentionMask, default_segments_and_positions
from maxnnx.kernels.paged_attention import PagedBatch
from maxnnx.layers.block import RESIDUAL_AXES, DecoderBlock, make_block
from maxnnx.layers.dropout import EMBEDDING_SEED, DropoutSeed, dropout
from maxnnx.layers.embedding import Embed, LearnedPositions
from maxnnx.layers.layer_call import LayerCall
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.mtp import MTPLayer, shift_left
from maxnnx.layers.norm_factory import make_norm
from maxnnx.layers.params import ForwardStat
from maxnnx.layers.parts import BlockParts, build_part
from maxnnx.layers.per_layer_inputs import PerLayerInputs
from maxnnx.layers.remat import in_host_memory, remat
from maxnnx.layers.rope import RotaryEmbedding
from maxnnx.layers.vision import VisionEncoder, make_projector
from maxnnx.models.kv_caches import KVCaches
from maxnnx.models.vision_inputs import VisionInputs
from maxnnx.parallel.pipeline import pipeline_stack
from maxnnx.sharding import constrain, mesh_axis_size

_NO_WINDOW = np.iinfo(np.int32).max  # also "no chunk": every position is in chunk 0
_LAYER_KINDS = ('full', 'sliding', 'chunked', 'linear')  # layer type -> code in traced stacks


STACK_NAMES = ('dense_layers', 'layers')  # the attributes a scanned stack can have


def layer_stacks(cfg: ModelConfig) -> tuple[tuple[str, int, int, bool], ...]:
  """``(attribute, first layer, num layers, use_moe)`` of each scanned stack.

  One ``layers`` stack, except for MoE models with dense first layers
  (``first_k_dense_layers``): those form a second stack, ``dense_layers``.
  """
  n, k = cfg.num_layers, cfg.moe.first_k_dense_layers if cfg.moe.num_experts else 0
  if k:
    return ((STACK_NAMES[0], 0, k, False), (STACK_NAMES[1], k, n - k, True))
  return ((STACK_NAMES[1], 0, n, cfg.moe.num_experts > 0),)


def layer_rngs(stack_key: jax.Array, index: int | jax.Array) -> nnx.Rngs:
  """The random streams decoder layer ``index`` (counted over the whole model) draws on.

  ``stack_key`` is one key the model draws for all its layers; each layer folds in its
  global index. The loop builds layer ``i`` from ``layer_rngs(key, i)`` and the scan
  vmaps the same call over the indices, so a seed gives the same weights whatever the
  layout (scanned, looped, one or two stacks, pipelined), and whatever the model builds
  after the stack draws from the same place in its stream.
  """
  return nnx.Rngs(jax.random.fold_in(stack_key, index))


def with_dropout_seed(block: DecoderBlock, index) -> DecoderBlock:
  """``block`` carrying its layer ``index`` as a :class:`~maxnnx.layers.dropout.DropoutSeed`
  when the model has dropout (the masks then depend on the layer, not on the layout)."""
  if block.dropout_rate:
    block.dropout_seed = DropoutSeed(jnp.asarray(index, jnp.uint32))
  return block


def _stacked_blocks(cfg: ModelConfig, stack_key: jax.Array, start: int, count: int,
                    use_moe: bool, parts: BlockParts) -> DecoderBlock:
  """Layers ``start .. start + count - 1`` as one DecoderBlock whose every variable has a
  leading ``layers`` axis (one vmapped build, however many layers)."""
  types = set(cfg.resolved_layer_types)
  linear = types == {'linear'}  # ModelConfig refuses a mixed scan
  # With attention.global_layers, ModelConfig allows a scan only when every layer has one type.
  layer_type = next(iter(types)) if len(types) == 1 else None

  @nnx.vmap(in_axes=(None, 0), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
  def create(key, index):
    return with_dropout_seed(
        make_block(cfg, layer_rngs(key, index), use_moe, parts, linear, layer_type), index)

  return create(stack_key, jnp.arange(start, start + count))


class Transformer(KVCaches, VisionInputs, nnx.Module):
  """A decoder-only language model built from a :class:`ModelConfig`.

  Call it on token ids ``[B, T]`` to get logits ``[B, T, vocab]``. Optional
  ``segment_ids``/``positions`` describe packed or padded batches (see
  :class:`~maxnnx.kernels.masks.AttentionMask`). After :meth:`init_cache`,
  ``decode=True`` runs incrementally against the KV cache.

  ``parts`` (:class:`~maxnnx.layers.parts.BlockParts`) plugs in your own
  attention, MLP, MoE, norm or block class (e.g. a subclass of
  :class:`~maxnnx.layers.attention.Attention`) for every layer, scanned or not,
  and the MTP layers; its ``None`` fields keep the config's choice.

  Attributes:
    config: the model's :class:`ModelConfig`.
    parts: the :class:`~maxnnx.layers.parts.BlockParts` the model was built with.
    embed: token embedding (also the output projection when tied).
    pos_embed: learned position table (``position_embedding='learned'``) or ``None``.
    per_layer_inputs: :class:`~maxnnx.layers.per_layer_inputs.PerLayerInputs`
      (``per_layer_input_dim > 0``) or ``None``.
    vision_tower, multi_modal_projector: :class:`~maxnnx.layers.vision.VisionEncoder`
      and the projector ``vision.projector`` names (``PooledProjector`` or
      ``PixelShuffleProjector``) when ``vision.num_layers > 0``, else ``None``.
    layers: ``nnx.List`` of :class:`DecoderBlock`, or one stacked block.
    final_norm: norm before the output projection.
    lm_head: untied output projection ``[d_model] -> [vocab]`` or ``None``.
    mtp: ``nnx.List`` of :class:`~maxnnx.layers.mtp.MTPLayer` (``mtp.num_layers``
      of them) or ``None``.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, parts: BlockParts | None = None):
    self.config = config
    self.parts = parts = BlockParts() if parts is None else parts
    dtype, param_dtype = config.jnp_dtype(), config.jnp_dtype('param_dtype')
    self.embed = Embed(config.vocab_size, config.d_model, init_std=config.initializer_range,
                       dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.pos_embed = (LearnedPositions(config.max_position_embeddings, config.d_model,
                                       init_std=config.initializer_range, dtype=dtype,
                                       param_dtype=param_dtype, rngs=rngs)
                      if config.position_embedding == 'learned' else None)
    self.per_layer_inputs = (PerLayerInputs(config, rngs=rngs) if config.per_layer_input_dim
                             else None)
    vision = config.vision.num_layers > 0
    self.vision_tower = VisionEncoder(config, rngs=rngs) if vision else None
    self.multi_modal_projector = make_projector(config, rngs=rngs) if vision else None
    self.dense_layers = nnx.data(None)  # the first_k_dense_layers stack when scanned
    stack_key = rngs.params()  # one draw for every layer, whatever the layout
    if config.runtime.scan_layers:
      for name, start, count, use_moe in layer_stacks(config):
        setattr(self, name, _stacked_blocks(config, stack_key, start, count, use_moe, parts))
    else:
      self.layers = nnx.List([
          with_dropout_seed(make_block(config, layer_rngs(stack_key, i), m, parts,
                                       t == 'linear', t, kv_shared=donor is not None), i)
          for i, (m, t, donor) in enumerate(zip(config.moe_layers, config.resolved_layer_types,
                                                config.kv_donors))])
    self.final_norm = (make_norm(config, rngs=rngs) if parts.norm is None else
                       build_part(parts.norm, config, rngs, 'norm'))
    self.lm_head = (None if config.tie_word_embeddings else
                    DenseGeneral((config.d_model,), (config.vocab_size,), axes=('embed', 'vocab'),
                                 dtype=dtype, param_dtype=param_dtype, rngs=rngs))
    self.mtp = (nnx.List([MTPLayer(config, rngs=rngs, parts=parts)
                          for _ in range(config.mtp.num_layers)])
                if config.mtp.num_layers else nnx.data(None))
    head_dim = local_head_dim = config.rope_head_dim
    if config.attention.global_layers.is_set:  # full layers rotate heads of their own width
      head_dim = config.attention_shape('full')[0]
    self.rotary = (RotaryEmbedding.from_config(config.rope, head_dim,
                                               config.max_position_embeddings)
                   if config.position_embedding == 'rope' else None)
    if config.local_rope is not None:
      self.local_rotary = RotaryEmbedding.from_config(config.local_rope, local_head_dim,
                                                      config.max_position_embeddings)
    elif head_dim != local_head_dim and self.rotary is not None:
      self.local_rotary = RotaryEmbedding.from_config(config.rope, local_head_dim,
                                                      config.max_position_embeddings)
    else:
      self.local_rotary = self.rotary
    self.cache_segment_ids = nnx.data(None)
    self.cache_positions = nnx.data(None)
    self.cache_index = nnx.data(None)
    self.cache_blocks = nnx.data(None)  # image-block ids of the cached keys (vision models)

  def cache_blocks_in_order(self) -> list:
    """The decoder blocks as :mod:`maxnnx.models.kv_caches` allocates caches in them: each
    scanned stack (one module per stack), else every layer."""
    if self.config.runtime.scan_layers:
      return [getattr(self, name) for name, *_ in layer_stacks(self.config)]
    return list(self.layers)

  # -- forward ----------------------------------------------------------------

  def __call__(self, input_ids_BT: jax.Array, *, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None, decode: bool = False, mtp: bool = False,
               paged: PagedBatch | None = None, pixel_values: jax.Array | None = None,
               token_type_ids: jax.Array | None = None
               ) -> jax.Array | tuple[jax.Array, tuple[jax.Array, ...]]:
    """Logits ``[B, T, vocab]`` (in ``config.runtime.logits_dtype``).

    The same as ``model.logits(model.hidden_states(...))``; the arguments are
    those of :meth:`hidden_states`. With ``mtp=True`` the result is
    ``(logits, mtp_logits)``, where ``mtp_logits[k - 1]`` ``[B, T, vocab]`` holds
    MTP depth ``k``'s prediction of token ``t_{i+k+1}`` at position ``i`` (see
    :func:`maxnnx.layers.mtp.mtp_targets`).
    """
    out = self.hidden_states(input_ids_BT, segment_ids=segment_ids, positions=positions,
                             decode=decode, mtp=mtp, paged=paged, pixel_values=pixel_values,
                             token_type_ids=token_type_ids)
    if not mtp:
      return self.logits(out)
    x_BTD, mtp_hidden = out
    return self.logits(x_BTD), tuple(self.logits(h_BTD) for h_BTD in mtp_hidden)

  def hidden_states(self, input_ids_BT: jax.Array, *, segment_ids: jax.Array | None = None,
                    positions: jax.Array | None = None, decode: bool = False, mtp: bool = False,
                    paged: PagedBatch | None = None, pixel_values: jax.Array | None = None,
                    token_type_ids: jax.Array | None = None,
                    image_embeddings: jax.Array | None = None, pre_norm: bool = False
                    ) -> jax.Array | tuple[jax.Array, tuple[jax.Array, ...]]:
    """Final hidden states ``[B, T, d_model]``, after the final norm and before the head.

    A trainer that fuses the head with its loss (see ``maxnnx.train.loss``) calls
    this and :meth:`head_weight` instead of ``__call__``.

    Args:
      input_ids_BT: int token ids ``[B, T]`` in ``[0, vocab_size)``.
      segment_ids: ``[B, T]`` document ids for packed input (0 = padding);
        default all ones.
      positions: ``[B, T]`` position of each token within its document;
        default ``0..T-1``, or, when decoding, the next ``T`` cache slots (pass
        positions explicitly for left-padded batches).
      decode: append to the KV cache (see :meth:`init_cache`) and attend over it.
      mtp: also return each MTP depth's final hidden states (after its own norm):
        ``(hidden, mtp_hidden)``. Training only.
      paged: a :class:`~maxnnx.kernels.paged_attention.PagedBatch` (serving, after
        :meth:`init_paged_cache`): ``input_ids_BT`` is ``[1, T]``, the flat tokens
        of many requests, ``positions`` each token's position in its request
        (required), and every layer writes and reads the page pools.
        ``segment_ids`` is ignored.
      pixel_values: ``[num_images, channels, H, W]`` float32 images (normalised as the
        checkpoint's image processor does; models with a vision tower): their
        embeddings replace the ``vision.image_token_id`` placeholders of
        ``input_ids_BT``, in order, ``vision.tokens_per_image`` per image. Or
        ``[B, images_per_row, channels, H, W]`` (training batches): the
        placeholders of row ``b`` take row ``b``'s images in order, and images a
        row has no placeholders for (padding) are ignored.
      token_type_ids: ``[B, T]``, 1 for image tokens (as transformers' processors give
        them); by default the placeholders. The tokens of each image attend to each
        other in both directions, also when a prompt with images fills the KV cache.
        With ``paged=...`` the blocks are the batch's (``PagedBatch.blocks_T``).
      image_embeddings: ``[B, T, d_model]``, the image embeddings already computed
        (:meth:`image_features`) and laid out at the placeholders' places (other
        rows are ignored); the serving engine computes them once per request.
      pre_norm: return the last block's output, before the final norm (what the MTP
        modules take; :mod:`maxnnx.inference.mtp_draft`). Not with ``mtp=True``.
    """
    cfg = self.config
    if image_embeddings is not None and pixel_values is not None:
      raise ValueError('Give pixel_values or image_embeddings, not both.')
    blocks_BT = self._image_blocks(input_ids_BT, pixel_values, token_type_ids, paged,
                                   image_embeddings is not None)
    if mtp and (self.mtp is None or decode):
      raise ValueError('mtp=True needs a model with MTP modules (ModelConfig.mtp.num_layers > 0) '
                       'and decode=False.')
    _check_token_ids(input_ids_BT, cfg.vocab_size)
    default_segments, default_positions = default_segments_and_positions(input_ids_BT)
    segment_ids = default_segments if segment_ids is None else segment_ids.astype(jnp.int32)
    positions = None if positions is None else positions.astype(jnp.int32)

    positions, mask, cache_index = self._attention_inputs(
        input_ids_BT, segment_ids, positions, blocks_BT, decode=decode, mtp=mtp, paged=paged,
        default_positions=default_positions)
    x_BTD = dropout(self._embed(self._text_ids(input_ids_BT), positions),
                    self.config.dropout_rate, EMBEDDING_SEED)  # in the train step only
    if pixel_values is not None:
      x_BTD = self._place_images(x_BTD, input_ids_BT, pixel_values)
    if image_embeddings is not None:
      is_image_BT = input_ids_BT == cfg.vision.image_token_id
      x_BTD = jnp.where(is_image_BT[..., None], image_embeddings.astype(x_BTD.dtype), x_BTD)
    x_BTD = self._run_layers(x_BTD, input_ids_BT, segment_ids, positions, mask, cache_index,
                             paged, blocks_BT)
    if pre_norm and not mtp:
      return x_BTD
    if not mtp:
      return self.final_norm(x_BTD)
    return self.final_norm(x_BTD), self._mtp_hidden(x_BTD, input_ids_BT, positions, mask)

  def _attention_inputs(self, input_ids_BT, segment_ids, positions, blocks_BT, *, decode: bool,
                        mtp: bool, paged, default_positions):
    """``(positions, mask, cache_index)`` of a call: the paged batch's (no mask: the pages
    hold it), the KV cache's after this step's tokens are appended to it (``decode``), or
    the causal mask of the tokens alone."""
    if paged is not None:
      if decode or mtp or positions is None or input_ids_BT.shape[0] != 1:
        raise ValueError('paged=... takes input_ids [1, T] with their positions, and no '
                         'decode=True or mtp=True.')
      return positions, None, None
    if not decode:
      positions = default_positions if positions is None else positions
      return positions, AttentionMask.causal(segment_ids, positions, blocks_BT), None
    if self.cache_index is None:
      raise ValueError('decode=True needs a KV cache: call model.init_cache(batch, max_length).')
    cache_index = self.cache_index[...]
    length, capacity = input_ids_BT.shape[1], self.cache_positions.shape[1]
    if not isinstance(cache_index, jax.core.Tracer) and int(cache_index) + length > capacity:
      raise ValueError(f'The KV cache holds {capacity} tokens (init_cache max_length) and '
                       f'{int(cache_index)} are used; {length} more do not fit.')
    if positions is None:
      positions = default_positions + cache_index
    start = (0, cache_index)
    self.cache_segment_ids[...] = jax.lax.dynamic_update_slice(
        self.cache_segment_ids[...], segment_ids, start)
    self.cache_positions[...] = jax.lax.dynamic_update_slice(
        self.cache_positions[...], positions, start)
    self.cache_index[...] = cache_index + length
    q_blocks = kv_blocks = None
    if self.cache_blocks is not None:
      q_blocks = self._cache_image_blocks(blocks_BT, input_ids_BT.shape, start)
      kv_blocks = self.cache_blocks[...]
    mask = AttentionMask(segment_ids, positions, self.cache_segment_ids[...],
                         self.cache_positions[...], q_blocks, kv_blocks)
    return positions, mask, cache_index

  def _run_layers(self, x_BTD, input_ids_BT, segment_ids, positions, mask, cache_index, paged,
                  blocks_BT):
    """The layer stack: pipelined over ``stage`` devices, scanned, or one layer at a time."""
    stages = mesh_axis_size('stage')
    if stages > 1:
      if (not self.config.runtime.scan_layers or cache_index is not None or paged is not None
          or blocks_BT is not None):
        raise ValueError('Pipeline parallelism (mesh stage > 1) needs scan_layers=True and '
                         'runs training/scoring only, not KV-cache decoding.')
      return self._pipeline_layers(x_BTD, segment_ids, positions, stages)
    cos_sin = self._cos_sin(positions)
    if self.config.runtime.scan_layers:
      return self._scan_layers(x_BTD, cos_sin, mask, cache_index, paged)
    return self._list_layers(x_BTD, input_ids_BT, cos_sin, mask, cache_index, paged)

  def _list_layers(self, x_BTD, ids_BT, cos_sin, mask, cache_index, paged):
    """The unscanned stack, with each layer's per-layer input and shared keys/values."""
    donors = self.config.kv_donors
    wanted = {d for d in donors if d is not None}  # layers whose keys/values others reuse
    per_layer_BTLP = (None if self.per_layer_inputs is None
                      else self.per_layer_inputs(ids_BT, x_BTD))
    shared = {}
    for i, block in enumerate(self.layers):
      call = self._layer_call(i, cos_sin, mask, cache_index=cache_index, return_kv=i in wanted,
                              per_layer_input=(None if per_layer_BTLP is None
                                               else per_layer_BTLP[:, :, i]),
                              shared_kv=None if donors[i] is None else shared[donors[i]])
      if paged is not None:
        call = call.replace(paged=paged if call.sliding_window is None
                            else paged.sliding_layers())
      out = self._apply_block(block, x_BTD, call)
      x_BTD, shared[i] = out if i in wanted else (out, None)
    return x_BTD

  def _embed(self, ids_BT, positions_BT):
    x_BTD = self.embed(ids_BT)
    if self.config.scale_embeddings:
      x_BTD = x_BTD * jnp.asarray(self.config.d_model**0.5, x_BTD.dtype)
    if self.pos_embed is not None:
      x_BTD = x_BTD + self.pos_embed(positions_BT)
    return constrain(x_BTD, RESIDUAL_AXES)

  def _mtp_hidden(self, h_BTD, input_ids_BT, positions_BT, mask):
    """Normed hidden states of every MTP depth; ``h_BTD`` is the last block's output."""
    cfg = self.config
    # MTP blocks attend like the last layer.
    call = self._layer_call(cfg.num_layers - 1, self._cos_sin(positions_BT), mask)
    out = []
    for k, layer in enumerate(self.mtp, start=1):
      h_BTD = self._mtp_block(layer, h_BTD, shift_left(input_ids_BT, k), positions_BT, call)
      out.append(layer.final_norm(h_BTD))
    return tuple(out)

  def _mtp_block(self, layer, h_BTD, next_ids_BT, positions_BT, call: LayerCall):
    """One MTP depth's block output (before its final norm) at ``positions_BT``, from the
    previous depth's hidden states and the embeddings of the tokens one further ahead."""
    h_BTD = layer(h_BTD, self._embed(next_ids_BT, positions_BT))
    return self._apply_block(layer.block, h_BTD, call)

  def mtp_decode(self, depth: int, hidden_BTD: jax.Array, next_ids_BT: jax.Array,
                 mask: AttentionMask, cache_index: jax.Array) -> jax.Array:
    """MTP module ``depth`` (0-based) against its own KV cache: speculative drafting.

    Args:
      depth: which module of ``self.mtp`` (its attention's cache set up with
        ``init_cache``).
      hidden_BTD: the hidden states it merges, before any final norm (the main model's
        last block output, ``hidden_states(..., pre_norm=True)``, or its own output).
      next_ids_BT: the token after each query position.
      mask: the queries' and the module's cached keys' segment ids and positions (the
        caller keeps them; this call's keys are written at ``cache_index``).
      cache_index: the slot of the first query.

    Returns:
      The block output ``[B, T, d_model]`` before the module's final norm.
    """
    positions_BT = mask.q_positions
    call = self._layer_call(self.config.num_layers - 1, self._cos_sin(positions_BT), mask,
                            cache_index=cache_index)
    return self._mtp_block(self.mtp[depth], hidden_BTD, next_ids_BT, positions_BT, call)

  def mtp_paged(self, depth: int, hidden_1TD: jax.Array, next_ids_1T: jax.Array,
                positions_1T: jax.Array, paged: PagedBatch) -> jax.Array:
    """MTP module ``depth`` (0-based) over a paged step's flat tokens (serving drafts; its
    attention's pools set up with ``init_paged_cache``; :mod:`maxnnx.serving.mtp_runner`).

    ``hidden_1TD`` are the hidden states it merges (as for :meth:`mtp_decode`),
    ``next_ids_1T`` the token after each position, ``positions_1T`` each token's position
    in its request. Returns the block output ``[1, T, d_model]`` before the module's final
    norm.
    """
    call = self._layer_call(self.config.num_layers - 1, self._cos_sin(positions_1T), None,
                            paged=paged)
    return self._mtp_block(self.mtp[depth], hidden_1TD, next_ids_1T, positions_1T, call)

  def _cos_sin(self, positions_BT):
    """Each layer type's ``(cos, sin)``; ``None`` when the model has no rotary embedding.

    Chunked layers rotate like full ones; sliding layers use ``local_rope`` when set;
    linear (Gated DeltaNet) layers rotate nothing.
    """
    if self.rotary is None:
      return dict.fromkeys(_LAYER_KINDS)
    full = self.rotary.cos_sin(positions_BT)
    sliding = (self.local_rotary.cos_sin(positions_BT) if self.local_rotary is not self.rotary
               else full)
    return {'full': full, 'sliding': sliding, 'chunked': full, 'linear': None}

  def _layer_call(self, layer: int, cos_sin: dict, mask, **fields) -> LayerCall:
    """Layer ``layer``'s :class:`LayerCall`: its rotary tables (``None`` in NoPE layers),
    sliding window or chunk size (``None`` where unused), ``mask`` and ``fields``."""
    cfg = self.config
    layer_type = cfg.resolved_layer_types[layer]
    attention = cfg.attention
    return LayerCall(cos_sin=None if layer in attention.nope_layers else cos_sin[layer_type],
                     mask=mask,
                     sliding_window=attention.sliding_window if layer_type == 'sliding' else None,
                     chunk_size=attention.chunk_size if layer_type == 'chunked' else None,
                     **fields)

  def _apply_block(self, block, x_BTD, call: LayerCall, stream: bool = False):
    """``block(x_BTD, call)``, rematerialised per ``config.runtime.remat_policy`` when
    training (not when decoding or paged). ``stream``: the block's state is a layer's slice
    of a stack in host memory, copied to the device inside the remat (forward and backward;
    :func:`~maxnnx.layers.remat.remat`)."""
    if (call.paged is not None or call.cache_index is not None
        or self.config.runtime.remat_policy == 'none'):
      return block(x_BTD, call)
    graphdef, state = nnx.split(block)

    def run(state, x, call):
      block = nnx.merge(graphdef, state)
      return block(x, call), nnx.state(block, ForwardStat)

    runtime = self.config.runtime
    out, aux = remat(run, runtime.remat_policy, save=runtime.remat_save,
                     offload=runtime.remat_offload, stream=stream)(state, x_BTD, call)
    nnx.update(block, aux)  # forward statistics (ForwardStat) computed inside the remat
    return out

  def _scan_layers(self, x_BTD, cos_sin, mask, cache_index, paged=None):
    for name, start, count, _ in layer_stacks(self.config):
      types = self.config.resolved_layer_types[start:start + count]
      x_BTD = self._scan_stack(getattr(self, name), types, x_BTD, cos_sin, mask, cache_index,
                               _layer_kinds(self.config, start, count), paged=paged)
    return x_BTD

  def _scan_stack(self, layers, layer_types, x_BTD, cos_sin, mask, cache_index, kinds_L,
                  paged=None):
    """Run stacked ``layers`` (leading axis = layers) over ``x`` with ``lax.scan``.

    ``kinds_L`` (see :func:`_layer_kinds`) may be traced (a pipeline stage's share
    of the layers); ``layer_types`` are the types the stack holds (static). A stack whose
    arrays are in host memory inside a jitted step (``TrainConfig.parameter_streaming``) is
    streamed: each iteration copies only its own layer to the device.
    """
    cfg = self.config
    mixed = len(set(layer_types)) > 1
    num_nope = len(cfg.attention.nope_layers)
    if num_nope == cfg.num_layers:  # nothing rotates
      cos_sin = dict.fromkeys(_LAYER_KINDS)
    # Stacks mixing NoPE and rotary layers: the flag rides in the kind (+ len(_LAYER_KINDS)).
    mixed_nope = 0 < num_nope < cfg.num_layers
    static = layer_types[0]
    static_window = cfg.attention.sliding_window if static == 'sliding' else None
    static_chunk = cfg.attention.chunk_size if static == 'chunked' else None
    graphdef, state = nnx.split(layers)
    stream = any(in_host_memory(v) for v in jax.tree.leaves(state))

    def body(x, xs):
      layer_state, kind = xs
      block = nnx.merge(graphdef, layer_state)
      nope = None
      if mixed_nope:
        nope, kind = kind >= len(_LAYER_KINDS), kind % len(_LAYER_KINDS)
      if mixed:
        is_sliding = kind == _LAYER_KINDS.index('sliding')
        window = (jnp.where(is_sliding, cfg.attention.sliding_window, _NO_WINDOW)
                  if 'sliding' in layer_types else None)
        chunk = (jnp.where(kind == _LAYER_KINDS.index('chunked'), cfg.attention.chunk_size,
                           _NO_WINDOW) if 'chunked' in layer_types else None)
        layer_cos_sin = jax.tree.map(lambda s, f: jnp.where(is_sliding, s, f),
                                     cos_sin['sliding'], cos_sin['full'])
      else:
        window, chunk, layer_cos_sin = static_window, static_chunk, cos_sin[static]
      call = LayerCall(cos_sin=layer_cos_sin, mask=mask, sliding_window=window,
                       chunk_size=chunk, nope=nope, cache_index=cache_index, paged=paged)
      x = self._apply_block(block, x, call, stream)
      return x, nnx.state(block, (nnx.Cache, ForwardStat))

    x_BTD, carried_state = jax.lax.scan(body, x_BTD, (state, kinds_L))
    nnx.update(layers, carried_state)  # KV caches and forward statistics (ForwardStat)
    return x_BTD

  def _pipeline_layers(self, x_BTD, segment_ids_BT, positions_BT, stages: int):
    """The scanned stack pipelined over the ``stage`` mesh axis (:mod:`maxnnx.parallel`)."""
    cfg = self.config
    if len(layer_stacks(cfg)) > 1:
      raise ValueError('Pipeline parallelism needs one uniform layer stack; this model has a '
                       'separate dense prefix (first_k_dense_layers). Use fsdp/tensor/expert '
                       'parallelism instead of mesh.stage.')

    def run_stage(layers, kinds_L, x_BTD, rows):
      segment_ids_BT, positions_BT = rows
      mask = AttentionMask.causal(segment_ids_BT, positions_BT)
      return self._scan_stack(layers, cfg.resolved_layer_types, x_BTD,
                              self._cos_sin(positions_BT), mask, None, kinds_L)

    kinds_L = _layer_kinds(cfg, 0, cfg.num_layers)
    return pipeline_stack(self.layers, x_BTD, kinds_L, (segment_ids_BT, positions_BT),
                          run_stage, stages=stages)

  def head_weight(self) -> tuple[jax.Array, bool]:
    """The output head's weight and whether it is vocab-major: ``([vocab, d_model], True)``
    for tied embeddings, else the ``lm_head`` kernel ``([d_model, vocab], False)``."""
    if self.lm_head is None:
      return self.embed.embedding[...], True
    return self.lm_head.kernel[...], False

  def logits(self, x_BTD: jax.Array) -> jax.Array:
    """Logits ``[B, T, vocab]`` of final hidden states (head, dtype, soft-cap)."""
    cfg = self.config
    if self.lm_head is None:
      logits = self.embed.attend(x_BTD)
    else:
      logits = self.lm_head(x_BTD)
    logits = constrain(logits.astype(cfg.jnp_dtype('logits_dtype')),
                       ('activation_batch', 'activation_length', 'activation_vocab'))
    if cfg.final_logit_softcap is not None:
      cap = cfg.final_logit_softcap
      logits = cap * jnp.tanh(logits / cap)
    return logits


def _layer_kinds(cfg: ModelConfig, start: int, count: int) -> jax.Array:
  """``[count]`` int32 codes of layers ``start…``: the type's index in ``_LAYER_KINDS``,
  plus ``len(_LAYER_KINDS)`` for NoPE layers."""
  return jnp.asarray([_LAYER_KINDS.index(cfg.resolved_layer_types[i])
                      + len(_LAYER_KINDS) * (i in cfg.attention.nope_layers)
                      for i in range(start, start + count)], jnp.int32)


def _check_token_ids(ids, vocab_size: int) -> None:
  """Reject bad ids eagerly when they are concrete (no host sync under jit)."""
  if ids.ndim != 2:
    raise ValueError(f'input_ids must be [batch, length], got shape {ids.shape}.')
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f'input_ids must be integers, got dtype {ids.dtype}.')
  if isinstance(ids, jax.core.Tracer):
    return
  ids = np.asarray(ids)
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    raise ValueError(f'input_ids contain {bad.size} id(s) outside [0, {vocab_size}), e.g. '
                     f'{int(bad.flat[0])}; check the tokenizer matches the model (vocab_size).')

"""The engine's model runner: a step's batch layout, its bucket, and the jitted model call.

**Where the KV cache lives.** The page pools are ``nnx.Cache`` variables of the attention
layers of a private working copy of the model (``Transformer.init_paged_cache``; the caller's
model gets no new variables). The runner splits that copy once into parameters and a cache
state, owns both, and passes the cache state through its jitted step, which donates and
returns it, as ``maxnnx.generate`` does with its contiguous cache. Keeping the pools inside the
layers means the layers carry them through both layer layouts (a list, or ``lax.scan`` over
stacked layers) with the code that already carries ``nnx.Cache``, and the runner never needs a
family's cache layout: GQA pages hold keys and values, MLA pages the compressed latent and
rotated key part (and DeepSeek V3.2's indexer keys), Gated DeltaNet layers a state per slot.
What changes every step, the block tables, write slots and lengths, is a plain argument
(:class:`~maxnnx.kernels.paged_attention.PagedBatch`) built on the host by
:meth:`ModelRunner.layout`.

**Buckets.** The model step's shapes are bucketed, ``(T, max_q, M, wide rows)``, so that it
compiles once per bucket, not per request mix (see :mod:`maxnnx.serving.engine` for the rule);
:meth:`ModelRunner.step_buckets` lists them all, and :meth:`ModelRunner.warm` compiles each.

**Speculative decoding.** With ``num_verify`` drafts per row, the step also returns the logits
at each row's last ``num_verify + 1`` scheduled tokens (``[max_batch, num_verify + 1, vocab]``:
a decoding row's last token and its drafts; other rows repeat their last token), and a step
whose rows all hold at most ``num_verify + 1`` tokens takes a bucket of its own, gathered that
wide, ``(T, num_verify + 1, M, None)`` with ``T`` the smallest token bucket that holds every
row at that width.

**Hidden states.** With ``return_hidden=True`` the step also keeps the target's last block
output (before the final norm) at every flat token, ``[T, d_model]``, in
:attr:`ModelRunner.hidden_TD` after each :meth:`ModelRunner.run`: what DeepSeek V3's MTP module
drafts from (:mod:`maxnnx.serving.mtp_runner`). The buckets stay the same; off, the step is
unchanged.

**Images.** A vision-language model's images are embedded once, when a request is added
(:meth:`ModelRunner.embed_images`); a step whose tokens include image placeholders passes the
embeddings of those tokens (``[T, d_model]``) and their image-block ids to the model.
"""

import contextlib
import dataclasses
import functools
import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxnnx.kernels.paged_attention import PagedBatch
from maxnnx.processes import host_value
from maxnnx.serving.lora import install_adapters, missing_stacks, set_token_slots, write_slot
from maxnnx.serving.params import TokenLogprobs
from maxnnx.serving.scheduler import Request
from maxnnx.sharding import state_shardings

MIN_TOKEN_BUCKET = 8
BACKEND_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'  # a program built
CACHE_HIT_EVENT = '/jax/compilation_cache/cache_hits'  # ... read from the persistent cache


def bucket(n: int, floor: int, cap: int) -> int:
  """The smallest power of two ``>= n`` (at least ``floor``), but at most ``cap``."""
  size = floor
  while size < n:
    size *= 2
  return min(size, cap)


def default_buckets(lowest: int, cap: int) -> tuple[int, ...]:
  """The powers of two from ``lowest`` below ``cap``, and ``cap``."""
  sizes, size = [], lowest
  while size < cap:
    sizes.append(size)
    size *= 2
  return (*sizes, cap)


def bucket_set(name: str, given, cap: int, lowest: int) -> tuple[int, ...]:
  """``given`` (a sequence of sizes, or ``None``: :func:`default_buckets`) as a sorted tuple
  that ends with ``cap``; one error names the setting and the fix when a size is out of range."""
  if given is None:
    return default_buckets(lowest, cap)
  sizes = [given] if isinstance(given, (int, np.integer)) else list(given)
  bad = [v for v in sizes if isinstance(v, bool) or not isinstance(v, (int, np.integer))
         or not 1 <= v <= cap]
  if bad or not sizes:
    raise ValueError(f'Engine {name}={given!r}: expected sizes in [1, {cap}] (the largest, '
                     f'{cap}, is always added).')
  return tuple(sorted({int(v) for v in sizes} | {cap}))


def smallest_holding(sizes: Sequence[int], n: int) -> int:
  """The first of the sorted ``sizes`` ``>= n`` (the last one holds every ``n``)."""
  return next((size for size in sizes if size >= n), sizes[-1])


@dataclasses.dataclass
class CompileCounts:
  """Programs an engine built inside its own calls (see :meth:`Engine.warmup`).

  Attributes:
    programs: programs built: compiled, or read back from the persistent cache.
    cache_hits: of those, the ones read back (``compile_cache``).
    after_warmup: programs built after :meth:`Engine.warmup` ended (0 while every request
      meets a warm bucket).
    warm: whether :meth:`Engine.warmup` has ended.
  """

  programs: int = 0
  cache_hits: int = 0
  after_warmup: int = 0
  warm: bool = False

  @property
  def compiled(self) -> int:
    """Programs compiled (not read back from the persistent cache)."""
    return self.programs - self.cache_hits


_counting = threading.local()  # .counts: the CompileCounts of the engine call this thread runs
_listening = threading.Lock()
_listeners: list = []


def _on_duration(event: str, duration: float, **_) -> None:
  counts = getattr(_counting, 'counts', None)
  if counts is not None and event == BACKEND_COMPILE_EVENT:
    counts.programs += 1
    counts.after_warmup += counts.warm


def _on_event(event: str, **_) -> None:
  counts = getattr(_counting, 'counts', None)
  if counts is not None and event == CACHE_HIT_EVENT:
    counts.cache_hits += 1


def listen_to_compiles() -> None:
  """Register (once per process) the listeners that count the programs JAX builds."""
  with _listening:
    if not _listeners:
      jax.monitoring.register_event_duration_secs_listener(_on_duration)
      jax.monitoring.register_event_listener(_on_event)
      _listeners.extend((_on_duration, _on_event))


@contextlib.contextmanager
def counting_compiles(counts: CompileCounts) -> Iterator[None]:
  """Count in ``counts`` the programs JAX builds on this thread inside the block."""
  outer = getattr(_counting, 'counts', None)
  _counting.counts = counts
  try:
    yield
  finally:
    _counting.counts = outer


class ModelRunner:
  """Runs the model over a scheduled batch on the paged cache (see the module docstring).

  Args:
    model: the :class:`~maxnnx.Transformer` served (not modified).
    num_pages: pages per pool, the scratch page included.
    page_size: tokens per page.
    max_batch: rows of a step.
    token_buckets: the flat token counts a step is padded to.
    page_buckets: the pages per row a step gathers.
    num_state_slots: recurrent-state slots, scratch slot 0 included (0 without recurrent
      layers).
    window_pages: pages of the sliding layers' own pool, scratch included (``None``: one pool).
    rules: logical-axis rules for the pools of a sharded model.
    kv_cache_dtype: ``auto``, or ``int8`` / ``fp8`` pools (``EngineConfig.kv_cache_dtype``).
    num_verify: draft tokens a row may verify per step (0: no speculative decoding).
    lora: ``(adapters, slots, rank, targets)``: the
      :class:`~maxnnx.serving.lora.LoadedAdapter`\\ s installed in the working copy, in slots
      1.., and the projection names given slots besides; ``None``: no adapters.
    return_hidden: keep each step's hidden states before the final norm (see
      :attr:`hidden_TD`).

  Attributes:
    params, cache: the parameters and the cache state the step runs on (the adapters'
      stacks are in ``cache``).
    lora_stacks: ``{adapted projection's path: its layers' unscanned paths}``.
    mesh: the mesh of a sharded model, else ``None``.
    step_shapes: the buckets run so far; ``last_step_shape`` the latest one.
    num_pages: pages per pool, the scratch page included.
    hidden_TD: with ``return_hidden``, the last step's hidden states before the final norm
      at every flat token ``[T, d_model]`` (on the device), else ``None``.
  """

  def __init__(self, model, *, num_pages: int, page_size: int, max_batch: int,
               token_buckets: tuple[int, ...], page_buckets: tuple[int, ...],
               num_state_slots: int = 0, window_pages: int | None = None,
               rules: dict | None = None, kv_cache_dtype: str = 'auto',
               num_verify: int = 0, lora: tuple | None = None, return_hidden: bool = False):
    self.model_config = model.config
    self.num_pages = num_pages
    self.return_hidden = return_hidden
    self.hidden_TD = None
    self.lora = lora is not None
    self.num_verify = num_verify
    self.page_size = page_size
    self.max_batch = max_batch
    self.token_buckets = token_buckets
    self.page_buckets = page_buckets
    self.recurrent = bool(num_state_slots)
    self.window_pool = window_pages is not None
    # The model without pools, for scoring whole prompts in one plain forward pass.
    self._plain_graphdef, _, self._plain_rest = nnx.split(model, nnx.Param, ...)
    work = working_copy(model)  # the pools are not added to `model`
    work.init_paged_cache(num_pages, page_size, num_slots=num_state_slots,
                          window_pages=window_pages, kv_cache_dtype=kv_cache_dtype)
    self.lora_stacks: dict[tuple, list[tuple]] = {}  # adapted projections: their layers' paths
    if lora is not None:  # each token's adapter is picked inside the projections
      self.lora_stacks = install_adapters(work, *lora)
    self._graphdef, self.params, self.cache = nnx.split(work, nnx.Param, ...)
    self.mesh = _mesh_of(self.params)
    if self.mesh is not None:  # a model sharded by from_pretrained(mesh=...): pools alike
      self.cache = jax.device_put(self.cache, state_shardings(self.cache, self.mesh, rules))
    self.traces = [0]
    self.step_shapes: set[tuple] = set()
    self.last_step_shape: tuple | None = None
    self._step_fn = _make_step(self._graphdef, self.traces, return_hidden)
    self._score_fn = _make_scorer(self._plain_graphdef)
    self._features_fn = (_make_features(self._graphdef) if model.config.vision.num_layers
                         else None)

  @property
  def has_vision(self) -> bool:
    """Whether the model has an image tower."""
    return self._features_fn is not None

  def step_buckets(self) -> list[tuple]:
    """Every bucket a model step can take, smallest first."""
    decode_tokens = smallest_holding(self.token_buckets, self.max_batch)
    wide = sorted({1, self.max_batch})
    variants = [()] + ([('images',)] if self.has_vision else [])
    shapes = []
    for pages in self.page_buckets:
      shapes.append((decode_tokens, 1, pages, None))
      if self.num_verify:
        shapes.append(self._verify_bucket(pages))
      shapes += [(tokens, tokens, pages, rows) + kind for kind in variants
                 for tokens in self.token_buckets for rows in wide]
    return shapes

  def _verify_bucket(self, pages: int) -> tuple:
    """The bucket of a step whose rows hold ``num_verify + 1`` tokens at most."""
    width = self.num_verify + 1
    return (smallest_holding(self.token_buckets, self.max_batch * width), width, pages, None)

  def warm(self, progress: Callable[[], None] | None = None,
           shapes: Sequence[tuple] | None = None):
    """Run a step of every bucket (of ``shapes`` when given) with every row empty (it writes
    the scratch page and state slot 0 only); returns the last step's outputs (:meth:`run`'s)."""
    logits_BV = None
    for shape in self.step_buckets() if shapes is None else shapes:
      logits_BV = self.run(self._model_inputs(shape, self._blank_inputs(shape)))
      self.step_shapes.add(shape)
      if progress is not None:
        progress()
    if self.has_vision:
      v = self.model_config.vision
      jax.block_until_ready(self._features_fn(self.params, self.cache, np.zeros(
          (1, v.num_channels, v.image_size, v.image_size), np.float32)))
    return logits_BV

  def run(self, inputs: tuple):
    """Run the model step on :meth:`layout`'s inputs; the logits of each row's last token
    ``[max_batch, vocab]``, and with ``num_verify`` those of its last ``num_verify + 1``
    scheduled tokens ``[max_batch, num_verify + 1, vocab]`` (else ``None``). On the device:
    the call returns before they are computed. With ``return_hidden`` the step's hidden
    states land in :attr:`hidden_TD`."""
    logits_BV, logits_BSV, self.cache, hidden_TD = self._step_fn(self.params, self.cache,
                                                                 *inputs)
    if self.return_hidden:
      self.hidden_TD = hidden_TD
    return logits_BV, logits_BSV

  def layout(self, scheduled: list[tuple[Request, int]], state_slot: Callable[[Request], int],
             image_embeddings: dict[int, np.ndarray]) -> tuple:
    """The model step's inputs for ``scheduled`` (rows with prefill chunks first): the flat
    tokens, their positions and cache slots, each row's pages, lengths and state slot, and
    the image embeddings of image tokens, padded to the step's bucket."""
    ps = self.page_size
    width = self.num_verify + 1
    images = [(r, n) for r, n in scheduled if any(
        start < r.num_computed + n and r.num_computed < stop for start, stop in r.image_spans)]
    shape = self._step_bucket(scheduled, bool(images))
    a = self._blank_inputs(shape)
    offset = 0
    for row, (request, count) in enumerate(scheduled):
      positions = np.arange(request.num_computed, request.num_computed + count)
      if a['embeddings_TD'] is not None and request.image_spans:
        self._place_images(a, request, positions, offset, image_embeddings[request.request_id])
      pages = np.asarray(request.pages, np.int32)
      span = slice(offset, offset + count)
      ids = request.token_ids[request.num_computed:request.num_computed + count]
      a['ids_T'][span] = ids + request.draft_ids[:count - len(ids)]
      a['positions_T'][span] = positions
      a['slots_T'][span] = pages[positions // ps] * ps + positions % ps
      a['page_table_BM'][row, :len(pages)] = pages
      if a['window_table_BM'] is not None:
        window_pages = np.asarray(request.window_pages, np.int32)
        a['window_slots_T'][span] = window_pages[positions // ps] * ps + positions % ps
        a['window_table_BM'][row, :len(window_pages)] = window_pages
      a['kv_lens_B'][row], a['q_starts_B'][row], a['q_lens_B'][row] = (
          positions[-1] + 1, offset, count)
      # Drafts (scheduled past the request's tokens) are verified at their own positions.
      drafts = max(0, request.num_computed + count - request.num_tokens)
      a['last_BS'][row] = offset + count - 1 - drafts + np.minimum(np.arange(width), drafts)
      a['state_slots_B'][row] = state_slot(request)
      if a['lora_T'] is not None:
        a['lora_T'][span] = request.lora_slot
      offset += count
    self.last_step_shape = shape
    self.step_shapes.add(shape)
    return self._model_inputs(shape, a)

  def decode_inputs(self, rows: Sequence[tuple[int, Sequence[int]] | None],
                    num_pages: int) -> tuple:
    """The model step's inputs for one token per row, bucket ``(T, 1, num_pages, None)``
    (``T`` the decode steps'): ``rows[r]`` is ``(position, pages)`` of row ``r``'s token, or
    ``None`` for an empty row. The token ids are zeros: the caller sets ``ids_T[r]``. For a
    runner with one pool and no state slots (a draft model's: the sliding layers' pool and
    the recurrent slots are left at their scratch entries)."""
    ps = self.page_size
    shape = (smallest_holding(self.token_buckets, self.max_batch), 1, num_pages, None)
    a = self._blank_inputs(shape)
    for row, entry in enumerate(rows):
      if entry is None:
        continue
      position, pages = entry
      a['positions_T'][row] = position
      a['slots_T'][row] = pages[position // ps] * ps + position % ps
      a['page_table_BM'][row, :len(pages)] = pages
      a['kv_lens_B'][row], a['q_starts_B'][row], a['q_lens_B'][row] = position + 1, row, 1
      a['last_BS'][row] = row
    return self._model_inputs(shape, a)

  @staticmethod
  def _place_images(a: dict, request: Request, positions: np.ndarray, offset: int,
                    embedded: np.ndarray) -> None:
    """Write the image-block ids and embeddings of ``request``'s tokens at ``positions``."""
    if a['blocks_T'] is not None:
      for block, (start, stop) in enumerate(request.image_spans):
        first, last = max(start, positions[0]), min(stop, positions[-1] + 1)
        if first < last:
          a['blocks_T'][offset + first - positions[0]:offset + last - positions[0]] = block
    inside = positions[positions < len(embedded)]
    a['embeddings_TD'][offset:offset + len(inside)] = embedded[inside]

  def _step_bucket(self, scheduled: list[tuple[Request, int]], images: bool) -> tuple:
    """The ``(T, max_q, pages per row, wide rows)`` bucket of a step (``+ ('images',)`` with
    image tokens)."""
    num_pages = smallest_holding(self.page_buckets, max(len(r.pages) for r, _ in scheduled))
    chunks = sum(count > 1 for _, count in scheduled)
    if not chunks:
      return (smallest_holding(self.token_buckets, self.max_batch), 1, num_pages, None)
    if self.num_verify and not images and max(c for _, c in scheduled) <= self.num_verify + 1:
      return self._verify_bucket(num_pages)
    width = smallest_holding(self.token_buckets, sum(count for _, count in scheduled))
    wide_rows = 1 if chunks == 1 else self.max_batch  # the chunk rows come first
    return (width, width, num_pages, wide_rows) + (('images',) if images else ())

  def _blank_inputs(self, shape: tuple) -> dict:
    """Zeroed arrays of one step of bucket ``shape`` (every row empty: it reads and writes the
    scratch page and state slot 0)."""
    width, _, num_pages, _, *kind = shape
    rows, cfg = self.max_batch, self.model_config
    arrays = {name: np.zeros(width, np.int32) for name in ('ids_T', 'positions_T', 'slots_T')}
    arrays['page_table_BM'] = np.zeros((rows, num_pages), np.int32)
    arrays['window_table_BM'] = arrays['window_slots_T'] = None
    if self.window_pool:
      arrays['window_table_BM'] = np.zeros_like(arrays['page_table_BM'])
      arrays['window_slots_T'] = np.zeros_like(arrays['slots_T'])
    for name in ('kv_lens_B', 'q_starts_B', 'q_lens_B', 'state_slots_B'):
      arrays[name] = np.zeros(rows, np.int32)
    arrays['last_BS'] = np.zeros((rows, self.num_verify + 1), np.int32)
    arrays['embeddings_TD'] = arrays['blocks_T'] = None
    arrays['lora_T'] = np.zeros(width, np.int32) if self.lora else None
    if kind:
      arrays['embeddings_TD'] = np.zeros((width, cfg.d_model), np.float32)
      if cfg.vision.bidirectional:
        arrays['blocks_T'] = np.full(width, -1, np.int32)
    return arrays

  def _model_inputs(self, shape: tuple, arrays: dict) -> tuple:
    """The model step's arguments after the parameters and cache (see :class:`PagedBatch`)."""
    _, max_q, _, wide_rows, *_ = shape
    a = arrays
    batch = PagedBatch(a['page_table_BM'], a['kv_lens_B'], a['q_starts_B'], a['q_lens_B'],
                       a['slots_T'], max_q, a['blocks_T'], wide_rows,
                       a['state_slots_B'] if self.recurrent else None,
                       a['window_table_BM'], a['window_slots_T'])
    return (a['ids_T'], a['positions_T'], batch, a['last_BS'], a['embeddings_TD'],
            a['lora_T'])

  def embed_images(self, ids: list[int], images, token_budget: int):
    """``(image spans, cache salt, [prompt, d_model] embeddings at the placeholders)`` of a
    request's images; ``((), b'', None)`` without. Raises ``ValueError`` naming what does
    not match."""
    v = self.model_config.vision
    if images is None:
      return (), b'', None
    if not self.has_vision:
      raise ValueError('images need a model with a vision tower '
                       '(ModelConfig.vision.num_layers > 0).')
    pixels = np.asarray(images, np.float32)
    expected = (v.num_channels, v.image_size, v.image_size)
    if pixels.ndim != 4 or pixels.shape[1:] != expected:
      raise ValueError(f'images must be [num_images, {", ".join(map(str, expected))}] pixels '
                       f'(ModelConfig.vision), got shape {pixels.shape}.')
    is_image = np.asarray(ids) == v.image_token_id
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
    spans = tuple((int(a), int(b)) for a, b in zip(edges[::2], edges[1::2]))
    if len(spans) != len(pixels) or any(b - a != v.tokens_per_image for a, b in spans):
      raise ValueError(f'the prompt must hold one run of {v.tokens_per_image} placeholder '
                       f'tokens (id {v.image_token_id}) per image; it has runs of '
                       f'{[b - a for a, b in spans]} for {len(pixels)} image(s).')
    if v.tokens_per_image > token_budget:
      raise ValueError(f'an image is {v.tokens_per_image} tokens, computed in one step: '
                       f'token_budget={token_budget} must be at least that.')
    embeddings = np.zeros((len(ids), self.model_config.d_model), np.float32)
    for (start, stop), image in zip(spans, pixels):
      embeddings[start:stop] = np.asarray(host_value(
          self._features_fn(self.params, self.cache, image[None])), np.float32)
    return spans, hashlib.blake2b(pixels.tobytes(), digest_size=16).digest(), embeddings

  def score(self, ids: list[int], num_top: int, max_len: int) -> tuple[TokenLogprobs, ...]:
    """The log-probability of each token of ``ids`` after the first and the ``num_top`` most
    likely there (one plain forward pass over the model without pools; see
    :meth:`Engine.score_prompt`)."""
    padded = np.zeros(bucket(len(ids), MIN_TOKEN_BUCKET, max_len), np.int32)
    padded[:len(ids)] = ids
    chosen_T, top_ids_TN, top_lps_TN = (host_value(a) for a in self._score_fn(
        max(num_top, 1), self.params, self._plain_rest, jnp.asarray(padded)))
    return tuple(
        TokenLogprobs(ids[t], float(chosen_T[t - 1]),
                      tuple((int(i), float(p)) for i, p in
                            zip(top_ids_TN[t - 1, :num_top], top_lps_TN[t - 1, :num_top])))
        for t in range(1, len(ids)))

  def write_adapter(self, slot: int, adapter) -> None:
    """Put a :class:`~maxnnx.serving.lora.LoadedAdapter` (zeros for ``None``) into adapter
    slot ``slot`` of every stack; same shapes, so the compiled step runs on unchanged.

    Raises:
      ValueError: the adapter adapts a projection that has no stack, naming it and the fix.
    """
    if adapter is not None and (missing := missing_stacks(adapter, self.lora_stacks)):
      stacked = sorted({path[-1] for path in self.lora_stacks}) or ['none']
      name = missing[0]
      raise ValueError(f'adapter {adapter.name!r} ({adapter.path}) adapts {name}, which has no '
                       f"adapter slots in this engine (slotted: {', '.join(stacked)}); start the "
                       f"engine with lora_target_modules naming {name.rsplit('.', 1)[-1]}.")
    write_slot(self.cache, self.lora_stacks, slot, adapter)

  def load_weights(self, model) -> None:
    """Run ``model``'s current parameters from now on (same architecture and shapes)."""
    params = nnx.state(model, nnx.Param)
    same = jax.tree.structure(params) == jax.tree.structure(self.params) and all(
        a.shape == b.shape and a.dtype == b.dtype
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(self.params)))
    if not same:
      raise ValueError('load_weights() needs a model of the same architecture and shapes.')
    self.params = params


def working_copy(model):
  """A copy of ``model`` sharing its parameters, with copies of its other state (a MoE
  layer's statistics, say): a runner's step donates that state, which must not delete the
  model's own, nor another runner's built from the same model."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return nnx.merge(graphdef, params, jax.tree.map(jnp.copy, rest))


def _mesh_of(params) -> jax.sharding.Mesh | None:
  """The mesh the parameters are laid out on, when they are (``NamedSharding``, > 1 device)."""
  for leaf in jax.tree.leaves(params):
    sharding = getattr(leaf, 'sharding', None)
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
      return sharding.mesh
  return None


def _make_step(graphdef, traces: list[int], return_hidden: bool = False):
  """The jitted model step over ``graphdef``'s model; ``traces[0]`` counts its traces.

  ``lora_T`` (``None`` without adapters) is each token's LoRA slot.
  Returns the logits of each row's last token ``[B, vocab]``, those at each of ``last_BS``'s
  ``S`` tokens per row ``[B, S, vocab]`` when ``S > 1`` (speculative decoding: the last is
  the row's last scheduled token; else ``None``), the new cache state, and with
  ``return_hidden`` the last block's output (before the final norm) at every flat token
  ``[T, d_model]`` (else ``None``).
  """

  @functools.partial(jax.jit, donate_argnums=(1,))
  def step(params, cache, ids_T, positions_T, batch, last_BS, embeddings_TD, lora_T):
    traces[0] += 1
    model = nnx.merge(graphdef, params, cache)
    if lora_T is not None:
      set_token_slots(model, lora_T)
    x_1TD = model.hidden_states(
        ids_T[None], positions=positions_T[None], paged=batch,
        image_embeddings=None if embeddings_TD is None else embeddings_TD[None],
        pre_norm=return_hidden)
    hidden_TD = None
    if return_hidden:  # the final norm as hidden_states applies it, on every token
      hidden_TD, x_1TD = x_1TD[0], model.final_norm(x_1TD)
    if lora_T is not None:
      set_token_slots(model, None)  # the returned state keeps its shapes
    rows, width = last_BS.shape
    # The head on the tokens whose logits are used only.
    logits_BSV = model.logits(x_1TD[:, last_BS.reshape(-1)])[0].reshape(rows, width, -1)
    return (logits_BSV[:, -1], logits_BSV if width > 1 else None,
            nnx.state(model, nnx.Not(nnx.Param)), hidden_TD)

  return step


def _make_scorer(graphdef):
  """The jitted prompt scorer over ``graphdef``'s model (without page pools): for tokens
  ``ids_T``, the log-probability of each next token ``[T - 1]`` and the ``num_top`` most likely
  ids and log-probabilities after each position ``[T, num_top]``."""

  @functools.partial(jax.jit, static_argnums=(0,))
  def score(num_top, params, rest, ids_T):
    model = nnx.merge(graphdef, params, rest)
    logprobs_TV = jax.nn.log_softmax(model(ids_T[None])[0].astype(jnp.float32), axis=-1)
    chosen_T = jnp.take_along_axis(logprobs_TV[:-1], ids_T[1:, None], axis=-1)[:, 0]
    top_lps_TN, top_ids_TN = jax.lax.top_k(logprobs_TV, num_top)
    return chosen_T, top_ids_TN, top_lps_TN

  return score


def _make_features(graphdef):
  """The jitted ``image_features`` of one image ``[1, C, H, W]`` over ``graphdef``'s model."""

  @jax.jit
  def features(params, cache, pixels_1CHW):
    return nnx.merge(graphdef, params, cache).image_features(pixels_1CHW)[0]

  return features

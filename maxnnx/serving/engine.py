"""``Engine``: continuous batching over a paged KV cache, one jitted step at a time.

The caller drives it from one thread::

  engine = Engine(model, max_batch=8, token_budget=256)
  rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=64, temperature=0.7))
  while engine.has_unfinished():
    for out in engine.step():          # new tokens of each request that produced one
      ...
  engine.cancel(rid)                   # any time; its pages are released at once

Each :meth:`Engine.step` asks the :class:`~maxnnx.serving.scheduler.Scheduler`
for the next batch (decoding requests first, then prefill chunks, within the
token budget), lays the tokens of every scheduled request out as one flat
sequence, runs the model once over it, samples one token for every request whose
tokens are all computed, and applies the stop rules on the host.

**Where the KV cache lives.** The page pools are ``nnx.Cache`` variables of the
attention layers of a private working copy of the model
(``Transformer.init_paged_cache``; the caller's model gets no new variables). The
engine splits that copy once into parameters and a cache state, owns both, and
passes the cache state through its jitted step, which donates and returns it,
as ``maxnnx.generate`` does with its contiguous cache. Keeping the pools inside
the layers, rather than threading explicit arrays through every layer call,
means the layers carry them through both layer layouts (a list, or ``lax.scan``
over stacked layers) with the code that already carries ``nnx.Cache``, and the
engine never needs a family's cache layout: GQA pages hold keys and values,
MLA pages the compressed latent and rotated key part (and DeepSeek V3.2's indexer
keys), Gated DeltaNet layers a state per slot. What changes every step, the block
tables, write slots and lengths, is a plain argument
(:class:`~maxnnx.kernels.paged_attention.PagedBatch`) built on the host.

**Compiled shapes, and warm-up.** A step is two jitted calls: the model, whose shapes are
bucketed so that it compiles once per bucket, not per request mix, and the sampler, whose
``[max_batch, vocab]`` logits never change shape. The buckets form a small set known when
the engine is built (:meth:`Engine.step_buckets`, :meth:`Engine.sampler_variants`), so
:meth:`Engine.warmup` compiles every one of them before any request, and a warm engine never
compiles while it serves. The model's buckets ``(T, max_q, M, wide rows)``:

* ``T``, the flat token count, is one of ``token_buckets`` (default the powers of two from 8
  below ``token_budget``, and ``token_budget``): the smallest that holds the step's tokens. A
  pure decode step (every row one token) always takes the smallest that holds ``max_batch``.
* ``max_q`` is 1 in a pure decode step, else ``T``.
* ``M``, the pages gathered per row, is one of ``page_buckets`` (default the powers of two
  below ``ceil(max_model_len / page_size)``, and that).
* In a step with rows of more than one token (prefill chunks), those rows come first and
  are gathered ``max_q`` wide: the first row only when it is the one chunk
  (``PagedBatch.wide_rows`` 1), else every row (``max_batch``); the other rows (decoding, or a
  one-token chunk) are gathered one token wide, so a chunk does not give each decode row its
  work.

So there are ``len(page_buckets) * (1 + len(token_buckets) * 2)`` model buckets at most (one
wide-row choice when ``max_batch`` is 1), twice that for a vision-language model (steps with
image tokens; only the prefill buckets have them). The sampler's variants: with or without
log-probabilities, times no control, or logit-bias pairs of a width among the powers of 8
from 8 up to the first at least the vocabulary (each with or without the penalties' counts).
Fewer buckets warm faster but pad more: shrink ``token_buckets`` and ``page_buckets`` for a
quick start, or keep the defaults and a ``compile_cache`` so that a restart reads the
programs back. :attr:`Engine.compile_count` counts the model step's traces,
:attr:`Engine.step_shapes` lists the buckets run, :meth:`Engine.max_compiles` is the bound,
and :attr:`Engine.compiles` counts the programs built (compiled, or read from the persistent
cache) inside the engine's calls, before and after warm-up.

**Sampling controls.** ``logit_bias`` and ``min_tokens`` (its stop ids get a bias of
``-inf`` until enough tokens are out) travel as ``(id, bias)`` pairs per row, 64 of them
(the vocabulary's size in a step where a row has more), in every step. The
penalties need each request's token counts: rather than sending its history every step,
the engine keeps two device arrays ``[max_batch + 1, vocab]`` (allocated at warm-up or the
first step), passed to every step (penalties skipped by ``lax.cond`` when none): the count
of each generated token and whether it is in the prompt,
one row per running penalised request (row 0 scratch). A request's row is filled from its
history when it is scheduled without one (at admission, or again after a preemption), and
the sampler adds each new token to it on the device, so a step moves ``O(batch)`` numbers,
not ``O(batch * history)``.

**Structured outputs.** A request with ``SamplingParams.structured`` gets a grammar matcher
(llguidance, :mod:`maxnnx.inference.structured`) kept on the host beside it. Before a step,
each such row that samples writes the tokens its grammar allows next into a packed mask
``[max_batch, ceil(vocab / 32)]`` int32, which every step passes to the sampler (rows
without a grammar: every bit set), so one program serves both kinds of rows and warm-up
compiles nothing more. After the step the matcher takes the sampled token; once the
grammar can take no further token the request finishes (reason ``stop``), and the
end-of-sequence and stop ids are allowed only where the grammar accepts the output.

Page 0 of the pool is a scratch page: padding tokens write there and empty
block-table entries point there (masked by the row lengths).

**Sliding windows.** When every attention layer slides, a request's pages behind the
window of its next token go back to the pool as it advances. When sliding and full layers
mix (unscanned), the sliding layers have a smaller pool of their own
(:attr:`Engine.window_allocator`, ``PagedBatch.window_page_table_BM``) whose pages go back
the same way, while the full layers keep every page.

**Recurrent layers.** A model with Gated DeltaNet layers (Qwen3-Next, Qwen3.5) keeps,
in those layers, a fixed-size state per request instead of pages: the engine gives each
running request one of ``max_batch`` state slots (``PagedBatch.state_slots_B``; slot 0
is scratch) and takes it back when the request finishes, is cancelled or is preempted.
A request that starts (or restarts after preemption) at position 0 starts from a zero
state, and chunked prefill carries the state from chunk to chunk. Its attention layers
are paged as usual. Prefix caching is off for such a model: pages could be shared, but
the state after a shared prefix is not kept.

**Images.** A vision-language model's requests may bring images
(``add_request(ids, params, images=pixel_values)``, the prompt holding each image's
placeholders). Their embeddings are computed once, when the request is added; a step
whose tokens include image placeholders passes the embeddings of those tokens
(``[T, d_model]``) and their image-block ids (``PagedBatch.blocks_T``) to the model,
so each image's tokens attend to each other in both directions. The scheduler never
cuts an image between prefill chunks, and such requests share cached pages only with
requests of the same images. Steps with image tokens are a second variant of each
bucket (two compiles at most per bucket).
"""

import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxnnx.inference.sampling import Controls, apply_controls, row_keys, sample_rows
from maxnnx.inference.structured import fill_allowed, grammar_tokenizer, mask_words, new_matcher
from maxnnx.kernels.paged_attention import PagedBatch
from maxnnx.processes import host_value
from maxnnx.serving.pages import PageAllocator
from maxnnx.serving.params import (
  MAX_SEED,
  Completion,
  RequestOutput,
  SamplingParams,
  TokenLogprobs,
)
from maxnnx.serving.scheduler import Request, Scheduler
from maxnnx.sharding import state_shardings

logger = logging.getLogger(__name__)

MIN_TOKEN_BUCKET = 8
FEW_BIAS_ENTRIES = 64  # logit-bias pairs per row: 64, else the vocabulary's size
BACKEND_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'  # a program built
CACHE_HIT_EVENT = '/jax/compilation_cache/cache_hits'  # ... read from the persistent cache


def bucket(n: int, floor: int, cap: int) -> int:
  """The smallest power of two ``>= n`` (at least ``floor``), but at most ``cap``."""
  size = floor
  while size < n:
    size *= 2
  return min(size, cap)


def fine_bucket(n: int, cap: int) -> int:
  """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (a power of two, or three quarters
  of one) ``>= n``, but at most ``cap``: half the padding of :func:`bucket`."""
  power = 1 << max(n - 1, 0).bit_length()
  three_quarters = power * 3 // 4
  return min(three_quarters if power >= 4 and three_quarters >= n else power, cap)


def bias_bucket(n: int, vocab: int) -> int:
  """Logit-bias pairs per row for ``n`` entries (at most one per id): 64, or the vocabulary's
  size beyond that."""
  return FEW_BIAS_ENTRIES if n <= FEW_BIAS_ENTRIES else max(vocab, FEW_BIAS_ENTRIES)


def bias_widths(vocab: int) -> tuple[int, ...]:
  """Every width :func:`bias_bucket` gives for a vocabulary of ``vocab``."""
  return tuple(sorted({FEW_BIAS_ENTRIES, max(vocab, FEW_BIAS_ENTRIES)}))


def default_buckets(lowest: int, cap: int) -> tuple[int, ...]:
  """The powers of two from ``lowest`` below ``cap``, and ``cap``."""
  sizes, size = [], lowest
  while size < cap:
    sizes.append(size)
    size *= 2
  return (*sizes, cap)


def _bucket_set(name: str, given, cap: int, lowest: int) -> tuple[int, ...]:
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


def _listen_to_compiles() -> None:
  """Register (once per process) the listeners that count the programs JAX builds."""
  with _listening:
    if not _listeners:
      jax.monitoring.register_event_duration_secs_listener(_on_duration)
      jax.monitoring.register_event_listener(_on_event)
      _listeners.extend((_on_duration, _on_event))


def _check_settings(**settings) -> None:
  """Each engine setting has its type and range, or one error names it and the fix."""
  lowest = {'page_size': 1, 'max_batch': 1, 'token_budget': 1, 'max_pages': 1,
            'max_model_len': 1, 'max_logprobs': 0, 'seed': 0, 'max_window_pages': 1}
  for name, value in settings.items():
    if name == 'prefix_caching':
      if not isinstance(value, bool):
        raise ValueError(f'Engine prefix_caching={value!r}: expected True or False.')
      continue
    if value is None and name in ('max_pages', 'max_model_len', 'max_window_pages'):
      continue  # the default size
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ValueError(f'Engine {name}={value!r}: expected an integer >= {lowest[name]}.')
    if value < lowest[name]:
      raise ValueError(f'Engine {name}={value}: must be >= {lowest[name]}.')


class Engine:
  """Serves many requests at once from one model, with a paged KV cache.

  Args:
    model: a :class:`~maxnnx.Transformer` (not modified; its parameters are
      shared, not copied). Its token-mixing layers must have a paged path
      (``init_paged_cache``): multi-head / GQA attention, MLA and Gated DeltaNet do.
    tokenizer: optional; with one, prompts may be strings (encoded as they are,
      no BOS added), outputs carry ``text`` and stop strings work. Anything with
      ``encode(str) -> ids``, ``decode(ids) -> str`` and ``eos_id``.
    max_pages: pages in the pool (per layer), each ``page_size`` tokens; default
      enough for ``max_batch`` requests of ``max_model_len`` tokens. One more
      page is allocated as scratch. The sliding layers of a model that mixes sliding
      and full layers get ``max_window_pages`` instead.
    max_window_pages: pages in the sliding layers' own pool (a model mixing sliding and
      full layers, unscanned; ignored otherwise); default ``min(max_pages, 2 * max_batch
      * window_pages_per_request)``: room for the running requests' windows and as many
      released pages kept for prefix-cache hits. A hit needs the sliding pages of the
      prefix's last window, which a small pool evicts first: give more pages (up to
      ``max_pages``) where prompts are reused long after they were served.
    page_size: tokens per page.
    max_batch: requests computed in one step at most.
    token_budget: tokens computed in one step at most (decode tokens plus
      prefill chunks); at least ``max_batch``.
    max_model_len: prompt plus output tokens of one request at most; default
      ``model.config.max_position_embeddings``.
    prefix_caching: reuse the pages of full prompt pages already computed by an
      earlier or concurrent request with the same prefix. Turned off (with a warning)
      for a model with recurrent layers (see the module docstring).
    max_logprobs: the largest ``SamplingParams.logprobs`` accepted.
    seed: derives the seed of requests that give none.
    rules: logical-axis rules for the page pools of a sharded model (default
      :data:`maxnnx.sharding.DEFAULT_RULES`).
    token_buckets: the flat token counts a step is padded to (``token_budget`` is always
      one); default the powers of two from 8 below it. See the module docstring.
    page_buckets: the pages per row a step gathers (``ceil(max_model_len / page_size)`` is
      always one); default the powers of two below it.

  A model placed on a mesh (``from_pretrained(dir, mesh=MeshConfig(tensor=4))``)
  is served on it: every step runs over the model's devices, and the page pools
  split over the kv heads the way the projections do.

  Attributes:
    scheduler: the :class:`~maxnnx.serving.scheduler.Scheduler` (queues, preemption count).
    allocator: the :class:`~maxnnx.serving.pages.PageAllocator` of the pool.
    window_allocator: the sliding layers' own pool when sliding and full layers mix
      (unscanned), else ``None``.
    window_pages_per_request: pages a request's sliding layers hold at most (its
      window, a step's tokens and a page's edge; all its pages without sliding layers).
    max_window_pages: pages of the sliding layers' own pool (0 without one).
    tokenizer: the tokenizer, or ``None``.
    eos_ids: ids that end a request unless ``ignore_eos``: ``model.config.eos_token_id``,
      else the tokenizer's ``eos_id``.
    step_shapes: the ``(tokens, max_q, pages per row, wide rows)`` buckets run so far.
    last_step_shape: the bucket of the latest step that ran the model (``None`` before one).
    mesh: the mesh of a sharded model, else ``None``.
    prefix_caching: whether prompt pages are shared (off for recurrent models).
    token_buckets, page_buckets: the sorted bucket sizes in use.
    compiles: the :class:`CompileCounts` of the programs built in the engine's calls.
  """

  def __init__(self, model, tokenizer=None, *, max_pages: int | None = None,
               page_size: int = 16, max_batch: int = 8, token_budget: int = 256,
               max_model_len: int | None = None, prefix_caching: bool = True,
               max_logprobs: int = 5, seed: int = 0, rules: dict | None = None,
               max_window_pages: int | None = None,
               token_buckets: Sequence[int] | None = None,
               page_buckets: Sequence[int] | None = None):
    _check_settings(page_size=page_size, max_batch=max_batch, token_budget=token_budget,
                    max_pages=max_pages, max_model_len=max_model_len,
                    max_logprobs=max_logprobs, seed=seed, max_window_pages=max_window_pages,
                    prefix_caching=prefix_caching)
    cfg = model.config
    self.model_config = cfg
    self.tokenizer = tokenizer
    self.page_size = page_size
    self.max_batch = max_batch
    self.token_budget = token_budget
    self.max_model_len = max_model_len or cfg.max_position_embeddings
    self.max_logprobs = min(max_logprobs, cfg.vocab_size)
    self.seed = seed
    self.pages_per_request = math.ceil(self.max_model_len / page_size)
    self.max_pages = (max_batch * self.pages_per_request if max_pages is None else max_pages)
    self.token_buckets = _bucket_set('token_buckets', token_buckets, token_budget,
                                     MIN_TOKEN_BUCKET)
    self.page_buckets = _bucket_set('page_buckets', page_buckets, self.pages_per_request, 1)
    if min(page_size, max_batch, token_budget, self.max_pages, self.max_model_len) < 1 or (
        max_logprobs < 0):
      raise ValueError('page_size, max_batch, token_budget, max_pages and max_model_len must '
                       'be >= 1 and max_logprobs >= 0.')
    if self.max_model_len > cfg.max_position_embeddings:
      logger.warning('max_model_len=%d is beyond the model\'s max_position_embeddings=%d; '
                     'positions beyond it were never trained.', self.max_model_len,
                     cfg.max_position_embeddings)
    for rotary in (model.rotary, model.local_rotary):
      if rotary.long_inv_freq is not None and self.max_model_len > rotary.long_threshold:
        raise NotImplementedError(
            f'LongRoPE switches every position to its long factors once a sequence passes '
            f'{rotary.long_threshold} tokens, which a batch of independent requests cannot do; '
            f'serve this model with max_model_len <= {rotary.long_threshold}.')
    self.allocator = PageAllocator(self.max_pages + 1, reserved=1)
    types = set(cfg.resolved_layer_types)
    window = cfg.sliding_window if 'sliding' in types else None
    # A request's pages that its sliding layers still attend to, at most.
    self.window_pages_per_request = (
        self.pages_per_request if window is None else
        min(self.pages_per_request, math.ceil((window + token_budget) / page_size) + 1))
    # Mixed sliding and full layers (unscanned): the sliding layers get a pool of their own,
    # twice what the running requests hold, so released pages stay cached for prefix hits.
    self.window_allocator = None
    self.max_window_pages = 0
    if window is not None and types == {'sliding', 'full'} and not cfg.runtime.scan_layers:
      if max_window_pages is not None and max_window_pages < 1:
        raise ValueError(f'max_window_pages={max_window_pages}: the sliding layers\' pool '
                         'needs at least one page (None: the default size).')
      self.max_window_pages = (min(self.max_pages, 2 * max_batch * self.window_pages_per_request)
                               if max_window_pages is None else max_window_pages)
      self.window_allocator = PageAllocator(self.max_window_pages + 1, reserved=1)
    elif types != {'sliding'}:
      window = None  # full (or chunked) layers read every page
    recurrent = 'linear' in cfg.resolved_layer_types
    if recurrent and prefix_caching:
      logger.warning('prefix_caching is off: this model\'s Gated DeltaNet layers keep a state '
                     'per request, which is not kept for shared prefixes.')
    self.prefix_caching = prefix_caching and not recurrent
    self._recurrent = recurrent
    # Recurrent-state slots: 1..max_batch for running requests, 0 scratch (empty rows).
    self._slots: dict[int, int] = {}  # request id -> its state slot
    # Penalised requests' token counts on the device (see the module docstring).
    self._history_rows: dict[int, int] = {}  # request id -> its row of _counts_SV
    self._counts_SV = self._prompt_seen_SV = None
    self._matchers: dict = {}  # request id -> its structured output's grammar matcher
    self._grammar_tokenizer = None  # the tokenizer as llguidance reads it, built when needed
    self.scheduler = Scheduler(self.allocator, page_size=page_size, max_batch=max_batch,
                               token_budget=token_budget, prefix_caching=self.prefix_caching,
                               window=window, window_allocator=self.window_allocator)
    # The model without pools, for scoring whole prompts in one plain forward pass.
    self._plain_graphdef, _, self._plain_rest = nnx.split(model, nnx.Param, ...)
    work = nnx.merge(*nnx.split(model))  # a working copy: the pools are not added to `model`
    work.init_paged_cache(self.max_pages + 1, page_size,
                          num_slots=max_batch + 1 if recurrent else 0,
                          window_pages=self.max_window_pages + 1 if self.max_window_pages
                          else None)
    self._graphdef, self._params, self._cache = nnx.split(work, nnx.Param, ...)
    self.mesh = _mesh_of(self._params)
    if self.mesh is not None:  # a model sharded by from_pretrained(mesh=...): pools alike
      self._cache = jax.device_put(self._cache,
                                   state_shardings(self._cache, self.mesh, rules))
    eos = cfg.eos_token_id
    if eos is None and tokenizer is not None:
      eos = getattr(tokenizer, 'eos_id', None)
    self.eos_ids = frozenset(int(i) for i in np.atleast_1d(eos)) if eos is not None else frozenset()
    self._requests: dict[int, Request] = {}
    self._image_embeddings: dict[int, np.ndarray] = {}  # request id -> [prompt, d_model]
    self._cancelled: list[RequestOutput] = []
    self._next_id = 0
    self._traces = [0]
    self.step_shapes: set[tuple] = set()
    self.last_step_shape: tuple | None = None
    self._step_fn = _make_step(self._graphdef, self._traces)
    self._score_fn = _make_scorer(self._plain_graphdef)
    self._features_fn = _make_features(self._graphdef) if cfg.vision.num_layers else None
    self.compiles = CompileCounts()
    _listen_to_compiles()

  # -- requests ---------------------------------------------------------------

  def prompt_ids(self, prompt: Sequence[int] | str) -> Sequence[int]:
    """``prompt``'s token ids: a string encoded by the tokenizer as it is (no BOS added)."""
    if not isinstance(prompt, str):
      return prompt
    if self.tokenizer is None:
      raise ValueError('A text prompt needs an Engine with a tokenizer.')
    return self.tokenizer.encode(prompt)

  def add_request(self, prompt: Sequence[int] | str, params: SamplingParams | None = None,
                  images: np.ndarray | None = None) -> int:
    """Queue a request; returns its id. It starts at the next :meth:`step` with room.

    ``images``: ``[num_images, channels, H, W]`` pixels (a vision-language model;
    :class:`~maxnnx.data.ImageProcessor`), one per run of ``tokens_per_image``
    placeholders in the prompt, in order.

    Raises:
      ValueError: for an empty prompt, ids outside the vocabulary, a prompt that
        leaves no room under ``max_model_len``, a request that could never fit in
        the page pool, parameters the engine cannot honour, images that do not
        match the prompt's placeholders, or a structured output whose grammar does not
        compile.
    """
    params = SamplingParams() if params is None else params
    prompt = self.prompt_ids(prompt)
    ids = [int(i) for i in np.asarray(prompt).reshape(-1)]
    vocab = self.model_config.vocab_size
    if not ids or min(ids) < 0 or max(ids) >= vocab:
      raise ValueError(f'A prompt needs at least one token, each in [0, {vocab}).')
    if len(ids) >= self.max_model_len:
      raise ValueError(f'The prompt has {len(ids)} tokens; max_model_len={self.max_model_len} '
                       'leaves no room for output.')
    longest = min(len(ids) + params.max_tokens, self.max_model_len) - 1  # tokens ever cached
    pages_held = math.ceil(longest / self.page_size)
    window_pages_held = min(pages_held, self.window_pages_per_request)
    if self.scheduler.window is not None and self.window_allocator is None:
      pages_held = window_pages_held  # every layer slides: pages behind the window go back
    sliding_pool = (f'; {self.max_window_pages} for sliding layers'
                    if self.window_allocator is not None else '')
    if pages_held > self.max_pages or (self.window_allocator is not None
                                       and window_pages_held > self.max_window_pages):
      raise ValueError(f'The request can reach {longest} cached tokens, more than the pool '
                       f'holds ({self.max_pages} pages of {self.page_size}{sliding_pool}).')
    if params.logprobs is not None and params.logprobs > self.max_logprobs:
      raise ValueError(f'logprobs={params.logprobs} is more than the engine returns '
                       f'(max_logprobs={self.max_logprobs}).')
    if params.stop and self.tokenizer is None:
      raise ValueError('Stop strings need an Engine with a tokenizer.')
    if params.logit_bias and params.logit_bias[-1][0] >= vocab:
      raise ValueError(f'logit_bias names token {params.logit_bias[-1][0]}, outside the '
                       f'vocabulary [0, {vocab}).')
    matcher = None if params.structured is None else self._new_matcher(params.structured)
    with self._counting_compiles():
      spans, salt, embeddings = self._images(ids, images)
    request_id = self._next_id
    self._next_id += 1
    seed = params.seed
    if seed is None:
      seed = (self.seed * 1_000_003 + request_id * 7_919) % (MAX_SEED + 1)
    request = Request(request_id=request_id, token_ids=ids, num_prompt=len(ids), params=params,
                      seed=seed, image_spans=spans, cache_salt=salt)
    if embeddings is not None:
      self._image_embeddings[request_id] = embeddings
    if matcher is not None:
      self._matchers[request_id] = matcher
    self._requests[request_id] = request
    self.scheduler.add(request)
    return request_id

  def cancel(self, request_id: int) -> bool:
    """Stop a request now and release its pages; ``False`` if it is unknown or finished.

    The next :meth:`step` reports it as finished with reason ``cancelled``.
    """
    request = self._requests.pop(request_id, None)
    if request is None:
      return False
    self._image_embeddings.pop(request_id, None)
    self._slots.pop(request_id, None)
    self._matchers.pop(request_id, None)
    self.scheduler.finish(request, 'cancelled')
    self._cancelled.append(self._output(request, (), None))
    return True

  def has_unfinished(self) -> bool:
    """Whether any request waits or runs (or a cancellation is still to be reported)."""
    return self.scheduler.has_unfinished() or bool(self._cancelled)

  @property
  def compile_count(self) -> int:
    """How many times the model step was traced (one compile per bucket run).

    Equals ``len(step_shapes)``, the ``(tokens, max_q, pages per row, wide rows)`` buckets
    run so far (warm-up included).
    """
    return self._traces[0]

  def step_buckets(self) -> list[tuple]:
    """Every bucket a model step can take (see the module docstring), smallest first."""
    decode_tokens = smallest_holding(self.token_buckets, self.max_batch)
    wide = sorted({1, self.max_batch})
    variants = [()] + ([('images',)] if self._features_fn is not None else [])
    shapes = []
    for pages in self.page_buckets:
      shapes.append((decode_tokens, 1, pages, None))
      shapes += [(tokens, tokens, pages, rows) + kind for kind in variants
                 for tokens in self.token_buckets for rows in wide]
    return shapes

  def max_compiles(self) -> int:
    """How many model step buckets exist, hence its compiles at most."""
    return len(self.step_buckets())

  def sampler_variants(self) -> list[tuple[int, int]]:
    """Every ``(log-probabilities, logit-bias width)`` the sampler is called with (see the
    module docstring)."""
    logprobs = sorted({0, max(self.max_logprobs, 1)})
    return [(n, width) for n in logprobs for width in bias_widths(self.model_config.vocab_size)]

  def warmup(self, progress=None) -> float:
    """Compile every model bucket and sampler variant (and the image tower and the penalty
    counts' writer) before serving, so that no request meets a cold program, and wrap the
    tokenizer for structured outputs; returns the seconds it took. ``progress(done, total)``
    is called after each program. Idle engine only.

    A step of each bucket runs with every row empty: it writes the scratch page and state
    slot 0 only, and samples nothing that is kept. With JAX's persistent cache on
    (``compile_cache``) a restart reads the programs back instead of compiling them.
    """
    if self.has_unfinished():
      raise RuntimeError('warmup() needs an idle engine.')
    start = time.monotonic()
    shapes, variants = self.step_buckets(), self.sampler_variants()
    total, done = len(shapes) + len(variants) + 1, 0
    with self._counting_compiles():
      logits_BV = None
      for shape in shapes:
        inputs = self._model_inputs(shape, self._blank_inputs(shape))
        logits_BV, self._cache = self._step_fn(self._params, self._cache, *inputs)
        self.step_shapes.add(shape)
        done += 1
        if progress is not None:
          progress(done, total)
      sampling = self._sampling_inputs(self._blank_inputs(shapes[0]))
      for num_logprobs, width in variants:
        self._warm_sampler(logits_BV, sampling, num_logprobs, width)
        done += 1
        if progress is not None:
          progress(done, total)
      if self._features_fn is not None:
        v = self.model_config.vision
        jax.block_until_ready(self._features_fn(self._params, self._cache, np.zeros(
            (1, v.num_channels, v.image_size, v.image_size), np.float32)))
      jax.block_until_ready(logits_BV)
    if self.tokenizer is not None and self._grammar_tokenizer is None:
      # Wrapping a large vocabulary for llguidance takes a second: not on the first request.
      with contextlib.suppress(ValueError, ImportError):
        self._grammar_tokenizer = grammar_tokenizer(
            self.tokenizer, self.model_config.vocab_size, self.eos_ids)
    self.compiles.warm = True
    return time.monotonic() - start

  def _warm_sampler(self, logits_BV, sampling, num_logprobs: int, width: int) -> None:
    """Run the sampler once in one of :meth:`sampler_variants` (no row emits a token)."""
    rows, vocab = self.max_batch, self.model_config.vocab_size
    controls = Controls(np.full((rows, width), vocab, np.int32),
                        np.zeros((rows, width), np.float32), np.zeros(rows, np.float32),
                        np.zeros(rows, np.float32), np.ones(rows, np.float32),
                        allowed_BW=np.full((rows, mask_words(vocab)), -1, np.int32))
    self._history([])  # the count arrays, and their writer
    self._write_row(0, [], [])
    tokens_B, *_, self._counts_SV = _sample(
        num_logprobs, logits_BV, *sampling, controls, self._counts_SV, self._prompt_seen_SV,
        np.zeros(rows, np.int32), np.zeros(rows, bool))
    jax.block_until_ready(tokens_B)

  @contextlib.contextmanager
  def _counting_compiles(self) -> Iterator[None]:
    """Count in :attr:`compiles` the programs JAX builds on this thread inside the block."""
    outer = getattr(_counting, 'counts', None)
    _counting.counts = self.compiles
    try:
      yield
    finally:
      _counting.counts = outer

  def score_prompt(self, prompt: Sequence[int], num_top: int = 0) -> tuple[TokenLogprobs, ...]:
    """The log-probability of each token of ``prompt`` after the first, given the tokens
    before it, and the ``num_top`` most likely tokens there (one plain forward pass, float32
    log-softmax of the model's logits; the OpenAI API's ``echo``).

    It touches neither the page pools nor the requests, so any thread may call it while
    another drives :meth:`step`. The prompt is padded to a power of two (at least
    :data:`MIN_TOKEN_BUCKET`, at most ``max_model_len``), so it compiles once per bucket and
    ``num_top``.

    Returns:
      ``len(prompt) - 1`` :class:`TokenLogprobs`, for ``prompt[1:]``.

    Raises:
      ValueError: an empty prompt or one longer than ``max_model_len``, a token id outside
        the vocabulary, or ``num_top`` beyond ``max_logprobs``.
    """
    ids = [int(i) for i in prompt]
    vocab = self.model_config.vocab_size
    if not 1 <= len(ids) <= self.max_model_len:
      raise ValueError(f'A scored prompt has 1 to max_model_len={self.max_model_len} tokens, '
                       f'not {len(ids)}.')
    if min(ids) < 0 or max(ids) >= vocab:
      raise ValueError(f'The prompt holds token ids outside [0, {vocab}).')
    if not 0 <= num_top <= self.max_logprobs:
      raise ValueError(f'num_top={num_top} is outside [0, max_logprobs={self.max_logprobs}].')
    padded = np.zeros(bucket(len(ids), MIN_TOKEN_BUCKET, self.max_model_len), np.int32)
    padded[:len(ids)] = ids
    chosen_T, top_ids_TN, top_lps_TN = (host_value(a) for a in self._score_fn(
        max(num_top, 1), self._params, self._plain_rest, jnp.asarray(padded)))
    return tuple(
        TokenLogprobs(ids[t], float(chosen_T[t - 1]),
                      tuple((int(i), float(p)) for i, p in
                            zip(top_ids_TN[t - 1, :num_top], top_lps_TN[t - 1, :num_top])))
        for t in range(1, len(ids)))

  # -- stepping ---------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Run one batch; returns an output for every request that got a token or ended."""
    with self._counting_compiles():
      return self._step()

  def _step(self) -> list[RequestOutput]:
    outputs, self._cancelled = self._cancelled, []
    # Rows with prefill chunks first: only those are gathered max_q wide (PagedBatch.wide_rows).
    scheduled = sorted(self.scheduler.schedule(), key=lambda rc: rc[1] == 1)
    if self._recurrent:
      self._assign_slots(scheduled)
    if not scheduled:
      return outputs
    model_inputs, sampling_inputs = self._inputs(scheduled)
    controls, history_B = self._controls(scheduled), self._history(scheduled)
    logits_BV, self._cache = self._step_fn(self._params, self._cache, *model_inputs)
    # Log-probabilities (a softmax and a top-k over the vocabulary) only when a row asks.
    wants_logprobs = any(r.params.logprobs is not None for r, _ in scheduled)
    num_logprobs = max(self.max_logprobs, 1) if wants_logprobs else 0
    tokens_B, chosen_B, top_ids_BN, top_lps_BN, self._counts_SV = _sample(
        num_logprobs, logits_BV, *sampling_inputs, controls, self._counts_SV,
        self._prompt_seen_SV, *history_B)
    tokens_B = host_value(tokens_B)  # whole on every process of a model spread over several
    if wants_logprobs:
      chosen_B = host_value(chosen_B)
      top_ids_BN, top_lps_BN = host_value(top_ids_BN), host_value(top_lps_BN)
    for row, (request, count) in enumerate(scheduled):
      self.scheduler.advance(request, count)
      if request.num_computed < request.num_tokens:
        continue  # a prefill chunk: no token yet
      token = int(tokens_B[row])
      self.scheduler.append_token(request, token)
      matcher = self._matchers.get(request.request_id)
      grammar_done = matcher is not None and self._advance_grammar(matcher, request, token)
      logprobs = None
      n = request.params.logprobs
      if n is not None:
        top = tuple(zip(top_ids_BN[row, :n].tolist(), top_lps_BN[row, :n].tolist()))
        logprobs = (TokenLogprobs(token, float(chosen_B[row]), top),)
        request.logprobs.extend(logprobs)
      reason = self._finish_reason(request, token, grammar_done)
      if reason is not None:
        self.scheduler.finish(request, reason)
        del self._requests[request.request_id]
        self._image_embeddings.pop(request.request_id, None)
        self._slots.pop(request.request_id, None)
        self._matchers.pop(request.request_id, None)
      outputs.append(self._output(request, (token,), logprobs))
    return outputs

  def generate(self, prompts: Sequence[Sequence[int] | str],
               params: SamplingParams | Sequence[SamplingParams] | None = None,
               images: Sequence[np.ndarray | None] | None = None) -> list[Completion]:
    """Run ``prompts`` to completion; one :class:`Completion` per prompt, in order.

    ``params`` is one :class:`SamplingParams` for all prompts or one per prompt;
    ``images`` one pixel array (or ``None``) per prompt, as for :meth:`add_request`.
    The engine must be idle (no request of its own would be reported otherwise).
    """
    if self.has_unfinished():
      raise RuntimeError('generate() needs an idle engine; step() until has_unfinished() is '
                         'False, or cancel the running requests.')
    if params is None or isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f'{len(prompts)} prompts but {len(params)} SamplingParams.')
    images = [None] * len(prompts) if images is None else list(images)
    if len(images) != len(prompts):
      raise ValueError(f'{len(prompts)} prompts but {len(images)} image entries.')
    requests = [self._requests[self.add_request(p, sp, im)]
                for p, sp, im in zip(prompts, params, images)]
    while self.has_unfinished():
      self.step()
    return [Completion(request_id=r.request_id, prompt_ids=tuple(r.token_ids[:r.num_prompt]),
                       token_ids=tuple(r.output_ids), finish_reason=r.finish_reason,
                       logprobs=None if r.params.logprobs is None else tuple(r.logprobs),
                       text=r.text, num_cached_tokens=r.num_cached_tokens) for r in requests]

  def load_weights(self, model) -> None:
    """Serve ``model``'s current parameters from now on (same architecture and shapes).

    For a policy being trained between rollouts. The prefix cache is emptied
    (its keys and values came from the old weights); no request may be unfinished.
    """
    if self.has_unfinished():
      raise RuntimeError('load_weights() needs an idle engine.')
    params = nnx.state(model, nnx.Param)
    same = jax.tree.structure(params) == jax.tree.structure(self._params) and all(
        a.shape == b.shape and a.dtype == b.dtype
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(self._params)))
    if not same:
      raise ValueError('load_weights() needs a model of the same architecture and shapes.')
    self._params = params
    self.allocator.clear_cache()
    if self.window_allocator is not None:
      self.window_allocator.clear_cache()

  # -- internals --------------------------------------------------------------

  def _assign_slots(self, scheduled: list[tuple[Request, int]]) -> None:
    """Take back the state slots of requests no longer running (preempted; finished and
    cancelled ones gave theirs back already) and give a free one to each scheduled request
    without one."""
    running = {request.request_id for request in self.scheduler.running}
    self._slots = {i: slot for i, slot in self._slots.items() if i in running}
    free = sorted(set(range(1, self.max_batch + 1)) - set(self._slots.values()), reverse=True)
    for request, _ in scheduled:
      if request.request_id not in self._slots:
        self._slots[request.request_id] = free.pop()

  def _controls(self, scheduled: list[tuple[Request, int]]):
    """The rows' logit bias, penalties and token masks as :class:`Controls` arrays (without
    the counts, which :meth:`_history` keeps): every step passes them, so that the sampler's
    shapes stay among :meth:`sampler_variants` (rows without a control add nothing)."""
    entries = [self._bias_entries(request) for request, _ in scheduled]
    rows, vocab = self.max_batch, self.model_config.vocab_size
    width = bias_bucket(max(len(e) for e in entries), vocab)
    ids_BK = np.full((rows, width), vocab, np.int32)  # ids >= vocab are padding
    values_BK = np.zeros((rows, width), np.float32)
    presence_B, frequency_B = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    repetition_B = np.ones(rows, np.float32)
    allowed_BW = np.full((rows, mask_words(vocab)), -1, np.int32)
    for row, ((request, count), pairs) in enumerate(zip(scheduled, entries)):
      if pairs:
        ids_BK[row, :len(pairs)], values_BK[row, :len(pairs)] = zip(*pairs)
      params = request.params
      presence_B[row], frequency_B[row] = params.presence_penalty, params.frequency_penalty
      repetition_B[row] = params.repetition_penalty
      matcher = self._matchers.get(request.request_id)
      if matcher is not None and request.num_computed + count >= request.num_tokens:
        fill_allowed(matcher, allowed_BW, row, params.stop_token_ids)
    return Controls(ids_BK, values_BK, presence_B, frequency_B, repetition_B,
                    allowed_BW=allowed_BW)

  def _new_matcher(self, structured):
    """A grammar matcher for a request's structured output (the tokenizer wrapped for
    llguidance the first time)."""
    if self.tokenizer is None:
      raise ValueError('Structured outputs need an Engine with a tokenizer.')
    if self._grammar_tokenizer is None:
      self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.model_config.vocab_size,
                                                  self.eos_ids)
    return new_matcher(self._grammar_tokenizer, structured)

  def _advance_grammar(self, matcher, request: Request, token: int) -> bool:
    """Feed ``token`` to the request's matcher; whether the grammar is done (it can take no
    further token, or refused this one: a ``min_tokens`` ban can leave no allowed token)."""
    params = request.params
    if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids):
      return False  # the request stops at it anyway
    if not matcher.consume_token(token):
      logger.warning('request %d: token %d is outside its grammar (%s); it stops here.',
                     request.request_id, token, matcher.get_error())
      return True
    return matcher.is_stopped()

  def _bias_entries(self, request: Request) -> list[tuple[int, float]]:
    """``(token id, bias)`` pairs of the request's next token: its ``logit_bias``, and
    ``-inf`` on its stop ids while fewer than ``min_tokens`` tokens are out."""
    params = request.params
    pairs = dict(params.logit_bias)  # one entry per id: at most the vocabulary
    if len(request.output_ids) < params.min_tokens:
      stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
      pairs.update((i, -np.inf) for i in sorted(stops) if i < self.model_config.vocab_size)
    return list(pairs.items())

  def _history(self, scheduled: list[tuple[Request, int]]):
    """``(row of the count arrays, whether a token is added)`` per batch row, both ``[B]``
    (row 0, nothing added, for rows without a penalty).

    Allocates the count arrays the first time. Frees the count rows of requests no longer
    running and fills one from its history for each penalised request scheduled without
    one (new, or back after a preemption).
    """
    penalised = [(row, r) for row, (r, _) in enumerate(scheduled) if r.params.penalized]
    running = {request.request_id for request in self.scheduler.running}
    self._history_rows = {i: n for i, n in self._history_rows.items() if i in running}
    vocab = self.model_config.vocab_size
    if self._counts_SV is None:
      self._counts_SV = jnp.zeros((self.max_batch + 1, vocab), jnp.int32)
      self._prompt_seen_SV = jnp.zeros((self.max_batch + 1, vocab), bool)
    free = sorted(set(range(1, self.max_batch + 1)) - set(self._history_rows.values()),
                  reverse=True)
    rows_B, emits_B = np.zeros(self.max_batch, np.int32), np.zeros(self.max_batch, bool)
    for row, request in penalised:
      if request.request_id not in self._history_rows:
        self._history_rows[request.request_id] = n = free.pop()
        self._write_row(n, request.output_ids, request.token_ids[:request.num_prompt])
      rows_B[row] = self._history_rows[request.request_id]
      # A prefill chunk that does not reach the last token samples nothing that is kept.
      emits_B[row] = request.num_computed + scheduled[row][1] >= request.num_tokens
    return rows_B, emits_B

  def _write_row(self, row: int, output_ids: Sequence[int], prompt_ids: Sequence[int]) -> None:
    """Set row ``row`` of the count arrays to these tokens' counts and prompt presence."""
    vocab = self.model_config.vocab_size
    self._counts_SV, self._prompt_seen_SV = _write_history(
        self._counts_SV, self._prompt_seen_SV, row,
        np.bincount(np.asarray(output_ids, np.int64), minlength=vocab).astype(np.int32),
        np.bincount(np.asarray(prompt_ids, np.int64), minlength=vocab) > 0)

  def _step_bucket(self, scheduled: list[tuple[Request, int]], images: bool) -> tuple:
    """The ``(T, max_q, pages per row, wide rows)`` bucket of a step (``+ ('images',)`` with
    image tokens): see the module docstring."""
    num_pages = smallest_holding(self.page_buckets, max(len(r.pages) for r, _ in scheduled))
    chunks = sum(count > 1 for _, count in scheduled)
    if not chunks:
      return (smallest_holding(self.token_buckets, self.max_batch), 1, num_pages, None)
    width = smallest_holding(self.token_buckets, sum(count for _, count in scheduled))
    wide_rows = 1 if chunks == 1 else self.max_batch  # step() lists the chunk rows first
    return (width, width, num_pages, wide_rows) + (('images',) if images else ())

  def _blank_inputs(self, shape: tuple) -> dict:
    """Zeroed arrays of one step of bucket ``shape`` (every row empty: it reads and writes the
    scratch page and state slot 0)."""
    width, _, num_pages, _, *kind = shape
    rows, cfg = self.max_batch, self.model_config
    arrays = {name: np.zeros(width, np.int32) for name in ('ids_T', 'positions_T', 'slots_T')}
    arrays['page_table_BM'] = np.zeros((rows, num_pages), np.int32)
    arrays['window_table_BM'] = arrays['window_slots_T'] = None
    if self.window_allocator is not None:
      arrays['window_table_BM'] = np.zeros_like(arrays['page_table_BM'])
      arrays['window_slots_T'] = np.zeros_like(arrays['slots_T'])
    for name in ('kv_lens_B', 'q_starts_B', 'q_lens_B', 'last_B', 'seeds_B', 'counters_B',
                 'top_k_B', 'state_slots_B'):
      arrays[name] = np.zeros(rows, np.int32)
    arrays['temperature_B'] = np.zeros(rows, np.float32)
    arrays['top_p_B'] = np.ones(rows, np.float32)
    arrays['logprob_temperature_B'] = np.ones(rows, np.float32)
    arrays['embeddings_TD'] = arrays['blocks_T'] = None
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
                       a['state_slots_B'] if self._recurrent else None,
                       a['window_table_BM'], a['window_slots_T'])
    return a['ids_T'], a['positions_T'], batch, a['last_B'], a['embeddings_TD']

  @staticmethod
  def _sampling_inputs(arrays: dict) -> tuple:
    """The sampler's per-row arguments after the logits."""
    return tuple(arrays[name] for name in ('temperature_B', 'top_k_B', 'top_p_B', 'seeds_B',
                                           'counters_B', 'logprob_temperature_B'))

  def _inputs(self, scheduled: list[tuple[Request, int]]):
    """The model step's arrays (see :class:`PagedBatch`) and the sampler's, for ``scheduled``."""
    ps = self.page_size
    images = [(r, n) for r, n in scheduled if any(
        start < r.num_computed + n and r.num_computed < stop for start, stop in r.image_spans)]
    shape = self._step_bucket(scheduled, bool(images))
    a = self._blank_inputs(shape)
    embeddings_TD, blocks_T = a['embeddings_TD'], a['blocks_T']
    offset = 0
    for row, (request, count) in enumerate(scheduled):
      positions = np.arange(request.num_computed, request.num_computed + count)
      if embeddings_TD is not None and request.image_spans:
        for block, (start, stop) in enumerate(request.image_spans):
          first, last = max(start, positions[0]), min(stop, positions[-1] + 1)
          if first < last and blocks_T is not None:
            blocks_T[offset + first - positions[0]:offset + last - positions[0]] = block
        embedded = self._image_embeddings[request.request_id]
        inside = positions[positions < len(embedded)]
        embeddings_TD[offset:offset + len(inside)] = embedded[inside]
      pages = np.asarray(request.pages, np.int32)
      span = slice(offset, offset + count)
      a['ids_T'][span] = request.token_ids[request.num_computed:request.num_computed + count]
      a['positions_T'][span] = positions
      a['slots_T'][span] = pages[positions // ps] * ps + positions % ps
      a['page_table_BM'][row, :len(pages)] = pages
      if a['window_table_BM'] is not None:
        window_pages = np.asarray(request.window_pages, np.int32)
        a['window_slots_T'][span] = window_pages[positions // ps] * ps + positions % ps
        a['window_table_BM'][row, :len(window_pages)] = window_pages
      a['kv_lens_B'][row], a['q_starts_B'][row], a['q_lens_B'][row] = (
          positions[-1] + 1, offset, count)
      a['last_B'][row] = offset + count - 1
      a['state_slots_B'][row] = self._slots.get(request.request_id, 0)
      params = request.params
      a['temperature_B'][row] = params.temperature
      a['top_k_B'][row] = params.top_k or 0
      a['top_p_B'][row] = 1.0 if params.top_p is None else params.top_p
      if params.scaled_logprobs and params.temperature > 0:
        a['logprob_temperature_B'][row] = params.temperature
      a['seeds_B'][row], a['counters_B'][row] = request.seed, len(request.output_ids)
      offset += count
    self.last_step_shape = shape
    self.step_shapes.add(shape)
    return self._model_inputs(shape, a), self._sampling_inputs(a)

  def _images(self, ids: list[int], images):
    """``(image spans, cache salt, [prompt, d_model] embeddings at the placeholders)`` of a
    request's images; ``((), b'', None)`` without."""
    v = self.model_config.vision
    if images is None:
      return (), b'', None
    if self._features_fn is None:
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
    if v.tokens_per_image > self.token_budget:
      raise ValueError(f'an image is {v.tokens_per_image} tokens, computed in one step: '
                       f'token_budget={self.token_budget} must be at least that.')
    embeddings = np.zeros((len(ids), self.model_config.d_model), np.float32)
    for (start, stop), image in zip(spans, pixels):
      embeddings[start:stop] = np.asarray(host_value(
          self._features_fn(self._params, self._cache, image[None])), np.float32)
    return spans, hashlib.blake2b(pixels.tobytes(), digest_size=16).digest(), embeddings

  def _finish_reason(self, request: Request, token: int,
                     grammar_done: bool = False) -> str | None:
    params = request.params
    stop = grammar_done or token in params.stop_token_ids or (
        not params.ignore_eos and token in self.eos_ids)
    if self.tokenizer is not None:
      request.text = self.tokenizer.decode(request.output_ids)
      if not stop and params.stop:
        found = [i for i in (request.text.find(s) for s in params.stop) if i >= 0]
        if found:
          request.text = request.text[:min(found)]
          stop = True
    if stop:
      return 'stop'
    if len(request.output_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
      return 'length'
    return None

  def _output(self, request: Request, new_ids, new_logprobs) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id, new_token_ids=tuple(new_ids), new_logprobs=new_logprobs,
        token_ids=tuple(request.output_ids), finished=request.finish_reason is not None,
        finish_reason=request.finish_reason, text=request.text,
        num_cached_tokens=request.num_cached_tokens)


def _mesh_of(params) -> jax.sharding.Mesh | None:
  """The mesh the parameters are laid out on, when they are (``NamedSharding``, > 1 device)."""
  for leaf in jax.tree.leaves(params):
    sharding = getattr(leaf, 'sharding', None)
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
      return sharding.mesh
  return None


def _make_step(graphdef, traces: list[int]):
  """The jitted model step over ``graphdef``'s model; ``traces[0]`` counts its traces.

  Returns the logits of each row's last token ``[B, vocab]`` and the new cache state.
  """

  @functools.partial(jax.jit, donate_argnums=(1,))
  def step(params, cache, ids_T, positions_T, batch, last_B, embeddings_TD):
    traces[0] += 1
    model = nnx.merge(graphdef, params, cache)
    x_1TD = model.hidden_states(
        ids_T[None], positions=positions_T[None], paged=batch,
        image_embeddings=None if embeddings_TD is None else embeddings_TD[None])
    logits_BV = model.logits(x_1TD[:, last_B])[0]  # the head on each row's last token only
    return logits_BV, nnx.state(model, nnx.Not(nnx.Param))

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


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_history(counts_SV, prompt_seen_SV, row, counts_V, prompt_seen_V):
  """The count arrays with row ``row`` set to one request's counts and prompt tokens."""
  return counts_SV.at[row].set(counts_V), prompt_seen_SV.at[row].set(prompt_seen_V)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(9,))
def _sample(num_logprobs, logits_BV, temperature_B, top_k_B, top_p_B, seeds_B, counters_B,
            logprob_temperature_B, controls, counts_SV, prompt_seen_SV, history_rows_B, emits_B):
  """Tokens, their log-probabilities and the top ones, and the new token counts.

  ``[B, vocab]`` never changes shape, so this compiles once per ``num_logprobs`` (0 when no
  row asks for log-probabilities: then only the tokens are computed and the log-probability
  outputs are None) and per logit-bias width of ``controls`` (:func:`bias_bucket`), apart
  from the bucketed model step. ``counts_SV`` is each penalised request's token counts
  (row 0 scratch), ``history_rows_B`` each batch row's row of it, and ``emits_B`` which rows
  keep their token (added to the counts, which are returned).
  Log-probabilities are of the model's logits (before the controls) divided by
  ``logprob_temperature_B`` (1: the model's own).
  """
  if counts_SV is not None:
    controls = dataclasses.replace(controls, counts_BV=counts_SV[history_rows_B],
                                   prompt_seen_BV=prompt_seen_SV[history_rows_B])
  tokens_B = sample_rows(apply_controls(logits_BV, controls), row_keys(seeds_B, counters_B),
                         temperature_B, top_k_B, top_p_B)
  if counts_SV is not None:
    counts_SV = counts_SV.at[history_rows_B, tokens_B].add(emits_B.astype(jnp.int32))
  if not num_logprobs:
    return tokens_B, None, None, None, counts_SV
  scaled_BV = logits_BV.astype(jnp.float32) / logprob_temperature_B[:, None]
  logprobs_BV = jax.nn.log_softmax(scaled_BV, axis=-1)
  chosen_B = jnp.take_along_axis(logprobs_BV, tokens_B[:, None], axis=-1)[:, 0]
  top_lps_BN, top_ids_BN = jax.lax.top_k(logprobs_BV, num_logprobs)
  return tokens_B, chosen_B, top_ids_BN, top_lps_BN, counts_SV

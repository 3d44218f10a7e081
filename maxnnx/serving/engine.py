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

**Compiled shapes.** A step is two jitted calls: the model, whose shapes are
bucketed so that it compiles once per bucket, not per request mix, and the
sampler, whose ``[max_batch, vocab]`` logits never change shape (it compiles
once, and once more for steps where a row asks for log-probabilities, which
it otherwise skips, and for steps where a row uses a logit control, by the power of two
of logit-bias entries; the logits stay on the device between the two). The model's buckets:
the flat token count ``T`` is a power of two from 8 up to ``token_budget``; the
widest row ``max_q`` is 1 (a pure decode step) or a power of two from 8 up to
``T``; the pages gathered per row ``M`` is a power of two or three quarters of one
(1, 2, 3, 4, 6, 8, 12, ...) up to ``ceil(max_model_len / page_size)``; the rows are
always ``max_batch``. In a step with rows of more than one token (prefill chunks),
those rows come first and only they are gathered ``max_q`` wide
(``PagedBatch.wide_rows``: a power of two, or ``max_batch``); the other rows (decoding,
or a one-token chunk) are gathered one token wide, so a chunk does not give each decode
row its work.
:attr:`Engine.compile_count` counts the model step's traces,
:attr:`Engine.step_shapes` lists the buckets run, and
:meth:`Engine.max_compiles` is the bound.

**Sampling controls.** ``logit_bias`` and ``min_tokens`` (its stop ids get a bias of
``-inf`` until enough tokens are out) travel as a few ``(id, bias)`` pairs per row. The
penalties need each request's token counts: rather than sending its history every step,
the engine keeps two device arrays ``[max_batch + 1, vocab]`` (allocated with the first
penalised request): the count of each generated token and whether it is in the prompt,
one row per running penalised request (row 0 scratch). A request's row is filled from its
history when it is scheduled without one (at admission, or again after a preemption), and
the sampler adds each new token to it on the device, so a step moves ``O(batch)`` numbers,
not ``O(batch * history)``.

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

import dataclasses
import functools
import hashlib
import logging
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxnnx.inference.sampling import Controls, apply_controls, row_keys, sample_rows
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
MIN_BIAS_BUCKET = 8  # logit-bias entries per row: a power of two from 8


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
  """

  def __init__(self, model, tokenizer=None, *, max_pages: int | None = None,
               page_size: int = 16, max_batch: int = 8, token_budget: int = 256,
               max_model_len: int | None = None, prefix_caching: bool = True,
               max_logprobs: int = 5, seed: int = 0, rules: dict | None = None,
               max_window_pages: int | None = None):
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
    self.scheduler = Scheduler(self.allocator, page_size=page_size, max_batch=max_batch,
                               token_budget=token_budget, prefix_caching=self.prefix_caching,
                               window=window, window_allocator=self.window_allocator)
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
    self._features_fn = _make_features(self._graphdef) if cfg.vision.num_layers else None

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
        the page pool, parameters the engine cannot honour, or images that do not
        match the prompt's placeholders.
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
    self.scheduler.finish(request, 'cancelled')
    self._cancelled.append(self._output(request, (), None))
    return True

  def has_unfinished(self) -> bool:
    """Whether any request waits or runs (or a cancellation is still to be reported)."""
    return self.scheduler.has_unfinished() or bool(self._cancelled)

  @property
  def compile_count(self) -> int:
    """How many times the step function was traced (one compile per bucketed shape).

    Equals ``len(step_shapes)``, the ``(tokens, max_q, pages per row, wide rows)`` buckets
    run so far.
    """
    return self._traces[0]

  def max_compiles(self) -> int:
    """How many bucketed step shapes exist, hence compiles at most."""
    def sizes(to_bucket, cap):
      return len({to_bucket(n, cap) for n in range(1, cap + 1)})

    tokens = sizes(lambda n, cap: bucket(n, MIN_TOKEN_BUCKET, cap), self.token_budget)
    variants = 2 if self._features_fn is not None else 1  # with and without image tokens
    wide = sizes(lambda n, cap: bucket(n, 1, cap), self.max_batch)  # rows with chunks
    return variants * tokens * (1 + tokens * wide) * sizes(fine_bucket, self.pages_per_request)

  # -- stepping ---------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Run one batch; returns an output for every request that got a token or ended."""
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
    history = (None,) * 4 if history_B is None else (self._counts_SV, self._prompt_seen_SV,
                                                     *history_B)
    tokens_B, chosen_B, top_ids_BN, top_lps_BN, counts_SV = _sample(
        num_logprobs, logits_BV, *sampling_inputs, controls, *history)
    if history_B is not None:
      self._counts_SV = counts_SV
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
      logprobs = None
      n = request.params.logprobs
      if n is not None:
        top = tuple(zip(top_ids_BN[row, :n].tolist(), top_lps_BN[row, :n].tolist()))
        logprobs = (TokenLogprobs(token, float(chosen_B[row]), top),)
        request.logprobs.extend(logprobs)
      reason = self._finish_reason(request, token)
      if reason is not None:
        self.scheduler.finish(request, reason)
        del self._requests[request.request_id]
        self._image_embeddings.pop(request.request_id, None)
        self._slots.pop(request.request_id, None)
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
    """The rows' logit bias and penalties as :class:`Controls` arrays (without the counts,
    which :meth:`_history` keeps), or ``None`` when no scheduled row uses a control."""
    entries = [self._bias_entries(request) for request, _ in scheduled]
    if not any(entries) and not any(r.params.penalized for r, _ in scheduled):
      return None
    rows, vocab = self.max_batch, self.model_config.vocab_size
    width = bucket(max(len(e) for e in entries), MIN_BIAS_BUCKET, 1 << 30)
    ids_BK = np.full((rows, width), vocab, np.int32)  # ids >= vocab are padding
    values_BK = np.zeros((rows, width), np.float32)
    presence_B, frequency_B = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    repetition_B = np.ones(rows, np.float32)
    for row, ((request, _), pairs) in enumerate(zip(scheduled, entries)):
      if pairs:
        ids_BK[row, :len(pairs)], values_BK[row, :len(pairs)] = zip(*pairs)
      params = request.params
      presence_B[row], frequency_B[row] = params.presence_penalty, params.frequency_penalty
      repetition_B[row] = params.repetition_penalty
    return Controls(ids_BK, values_BK, presence_B, frequency_B, repetition_B)

  def _bias_entries(self, request: Request) -> list[tuple[int, float]]:
    """``(token id, bias)`` pairs of the request's next token: its ``logit_bias``, and
    ``-inf`` on its stop ids while fewer than ``min_tokens`` tokens are out."""
    params = request.params
    pairs = list(params.logit_bias)
    if len(request.output_ids) < params.min_tokens:
      stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
      pairs += [(i, -np.inf) for i in sorted(stops)]
    return pairs

  def _history(self, scheduled: list[tuple[Request, int]]):
    """``(row of the count arrays, whether a token is added)`` per batch row, both ``[B]``,
    for a step with penalised rows (else ``None``).

    Frees the count rows of requests no longer running and fills one from its history for
    each penalised request scheduled without one (new, or back after a preemption).
    """
    penalised = [(row, r) for row, (r, _) in enumerate(scheduled) if r.params.penalized]
    running = {request.request_id for request in self.scheduler.running}
    self._history_rows = {i: n for i, n in self._history_rows.items() if i in running}
    if not penalised:
      return None
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
        prompt = np.asarray(request.token_ids[:request.num_prompt])
        self._counts_SV, self._prompt_seen_SV = _write_history(
            self._counts_SV, self._prompt_seen_SV, n,
            np.bincount(request.output_ids, minlength=vocab).astype(np.int32),
            np.bincount(prompt, minlength=vocab) > 0)
      rows_B[row] = self._history_rows[request.request_id]
      # A prefill chunk that does not reach the last token samples nothing that is kept.
      emits_B[row] = request.num_computed + scheduled[row][1] >= request.num_tokens
    return rows_B, emits_B

  def _inputs(self, scheduled: list[tuple[Request, int]]):
    """The model step's arrays (see :class:`PagedBatch`) and the sampler's, for ``scheduled``."""
    ps, rows = self.page_size, self.max_batch
    total = sum(count for _, count in scheduled)
    width = bucket(total, MIN_TOKEN_BUCKET, self.token_budget)
    widest = max(count for _, count in scheduled)
    max_q = 1 if widest == 1 else bucket(widest, MIN_TOKEN_BUCKET, width)
    num_pages = fine_bucket(max(len(r.pages) for r, _ in scheduled), self.pages_per_request)
    # step() lists the rows of more than one token first; the wide rows reach the last one.
    last_wide = max((row for row, (_, count) in enumerate(scheduled) if count > 1), default=-1)
    wide_rows = None if max_q == 1 else bucket(last_wide + 1, 1, rows)
    ids_T, positions_T, slots_T = (np.zeros(width, np.int32) for _ in range(3))
    page_table_BM = np.zeros((rows, num_pages), np.int32)
    window_table_BM = window_slots_T = None
    if self.window_allocator is not None:
      window_table_BM, window_slots_T = np.zeros_like(page_table_BM), np.zeros_like(slots_T)
    kv_lens_B, q_starts_B, q_lens_B, last_B, seeds_B, counters_B, top_k_B, state_slots_B = (
        np.zeros(rows, np.int32) for _ in range(8))
    temperature_B, top_p_B = np.zeros(rows, np.float32), np.ones(rows, np.float32)
    logprob_temperature_B = np.ones(rows, np.float32)
    images = [(r, n) for r, n in scheduled if any(
        start < r.num_computed + n and r.num_computed < stop for start, stop in r.image_spans)]
    blocks_T = embeddings_TD = None
    if images:
      embeddings_TD = np.zeros((width, self.model_config.d_model), np.float32)
    if images and self.model_config.vision.bidirectional:
      blocks_T = np.full(width, -1, np.int32)
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
      ids_T[span] = request.token_ids[request.num_computed:request.num_computed + count]
      positions_T[span] = positions
      slots_T[span] = pages[positions // ps] * ps + positions % ps
      page_table_BM[row, :len(pages)] = pages
      if window_table_BM is not None:
        window_pages = np.asarray(request.window_pages, np.int32)
        window_slots_T[span] = window_pages[positions // ps] * ps + positions % ps
        window_table_BM[row, :len(window_pages)] = window_pages
      kv_lens_B[row], q_starts_B[row], q_lens_B[row] = positions[-1] + 1, offset, count
      last_B[row] = offset + count - 1
      state_slots_B[row] = self._slots.get(request.request_id, 0)
      params = request.params
      temperature_B[row] = params.temperature
      top_k_B[row] = params.top_k or 0
      top_p_B[row] = 1.0 if params.top_p is None else params.top_p
      if params.scaled_logprobs and params.temperature > 0:
        logprob_temperature_B[row] = params.temperature
      seeds_B[row], counters_B[row] = request.seed, len(request.output_ids)
      offset += count
    batch = PagedBatch(page_table_BM, kv_lens_B, q_starts_B, q_lens_B, slots_T, max_q,
                       blocks_T, wide_rows,
                       state_slots_B if self._recurrent else None,
                       window_table_BM, window_slots_T)
    self.last_step_shape = (width, max_q, num_pages, wide_rows) + (('images',) if images else ())
    self.step_shapes.add(self.last_step_shape)
    return ((ids_T, positions_T, batch, last_B, embeddings_TD),
            (temperature_B, top_k_B, top_p_B, seeds_B, counters_B, logprob_temperature_B))

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

  def _finish_reason(self, request: Request, token: int) -> str | None:
    params = request.params
    stop = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids)
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
  outputs are None) and per kind of ``controls`` (``None``, or :class:`Controls` without
  counts and a power of two of bias entries), apart from the bucketed model step.
  ``counts_SV`` (``None`` in a step without penalised rows) is each penalised request's
  token counts, ``history_rows_B`` each batch row's row of it, and ``emits_B`` which rows
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

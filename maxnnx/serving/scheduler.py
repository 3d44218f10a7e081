"""Continuous batching: which requests run in the next step, and how many tokens each.

A request is a list of tokens (prompt, then generated ones) of which the first
``num_computed`` have their keys and values in the cache. Prefill, chunked
prefill, decoding, recomputation after preemption and prefix-cache hits are all
the same thing: the next step computes some of the remaining tokens, and once a
request's tokens are all computed, the step's logits at its last token give the
next token (sampled by the engine, appended with :meth:`Scheduler.append_token`).

Each :meth:`Scheduler.schedule` fills a budget of ``token_budget`` tokens:

1. running requests first, in the order they were admitted; a decoding request
   takes one token, a request still prefilling takes what is left of its prompt,
   cut to the budget that remains (chunked prefill);
2. then waiting requests, first come first served, while the budget, the
   ``max_batch`` rows and the free pages last. A new request first takes the
   pages of the longest prefix of full pages already in the prefix cache.

With speculative decoding a decoding request may carry draft tokens
(``Request.draft_ids``, set by the engine before :meth:`Scheduler.schedule`): they are
scheduled after its last token, count in the budget and get pages like any token, are cut
to the budget that remains, and are dropped rather than preempt another request for pages.
After the step, :meth:`Scheduler.release_rejected` gives back the pages past the tokens kept.

When a running request needs a page and none is left, the most recently admitted
running request is preempted: its pages are released (they stay in the prefix
cache while nothing evicts them) and it goes back to the front of the queue, to be
recomputed from its tokens. No new request is admitted in a step that preempted.

What a request holds of the cache is the scheduler's
:class:`~maxnnx.serving.kv_cache.CacheManager` (:attr:`Scheduler.kv_cache`), one manager
per kind of layer. With a ``window`` (sliding-window attention), pages that lie wholly
before the window of a request's next token go back to the pool as it advances. When every
attention layer slides, those are the request's pages; when sliding and full layers mix
(Gemma 2/3, GPT-OSS, OLMo 3), the sliding layers keep their pages apart, from a second pool
(``window_allocator``, ``Request.window_pages``): the full layers' pages are kept, the
sliding layers' go back. A prefix-cache hit is as long as every pool can serve: the full
layers need every page of the prefix, the sliding layers only those of its last window.
Recurrent layers (``num_state_slots``) get a state slot per scheduled request, given back
when it finishes or is preempted.

A request with images (a vision-language model) lists its images' token spans: a
prefill chunk never ends inside one (an image's tokens attend to each other in both
directions, so they are computed in one step), and its pages are hashed after a digest
of its pixels, so only requests with the same images share them.

This module runs no model and is tested on its own.
"""

import collections
import dataclasses

from maxnnx.serving.kv_cache import CacheManager
from maxnnx.serving.pages import PageAllocator
from maxnnx.serving.params import SamplingParams


@dataclasses.dataclass(eq=False)
class Request:
  """One request's state, owned by the scheduler.

  Attributes:
    request_id: the engine's id.
    token_ids: prompt then generated tokens.
    num_prompt: prompt length.
    params: its :class:`SamplingParams`.
    seed: the seed of its samples.
    num_computed: leading tokens whose keys and values are in the cache.
    pages: its pages, in sequence order (when every layer slides, the first
      ``num_released`` are given back: see ``Scheduler``'s ``window``; they read as the
      scratch page 0).
    window_pages: its sliding layers' pages when sliding and full layers mix (the first
      ``num_released`` given back), else empty.
    num_released: leading pages (of ``window_pages`` when there are, else of ``pages``)
      released because no later token attends to them.
    hashes: content hashes of its first ``len(hashes)`` pages (full and computed).
    num_cached_tokens: prompt tokens taken from the prefix cache at admission.
    finish_reason: ``None`` until finished.
    logprobs: the :class:`~maxnnx.serving.params.TokenLogprobs` of its tokens so far.
    text: its decoded output so far (only with a tokenizer).
    image_spans: ``(start, stop)`` token positions of each image's placeholders.
    cache_salt: where its page hashes start (a digest of its images; ``b''`` without).
    draft_ids: speculative tokens to verify after its last token in the next step (decoding
      requests only; the scheduler may cut them).
    lora_slot: the slot of its LoRA adapter in the engine's stacks (0: the base model).
  """

  request_id: int
  token_ids: list[int]
  num_prompt: int
  params: SamplingParams
  seed: int
  num_computed: int = 0
  pages: list[int] = dataclasses.field(default_factory=list)
  window_pages: list[int] = dataclasses.field(default_factory=list)
  num_released: int = 0
  hashes: list[bytes] = dataclasses.field(default_factory=list)
  num_cached_tokens: int = 0
  finish_reason: str | None = None
  logprobs: list = dataclasses.field(default_factory=list)
  text: str | None = None
  image_spans: tuple[tuple[int, int], ...] = ()
  cache_salt: bytes = b''
  draft_ids: list[int] = dataclasses.field(default_factory=list)
  lora_slot: int = 0

  @property
  def num_tokens(self) -> int:
    """Prompt plus generated tokens."""
    return len(self.token_ids)

  @property
  def output_ids(self) -> list[int]:
    """The generated tokens."""
    return self.token_ids[self.num_prompt:]


class Scheduler:
  """Admits, schedules, preempts and retires requests over one :class:`PageAllocator`.

  Args:
    allocator: the page pool.
    page_size: tokens per page.
    max_batch: requests running at once at most (rows of a step).
    token_budget: tokens computed per step at most; at least ``max_batch``.
    prefix_caching: share full prompt pages between requests by content hash.
    window: the sliding layers' window: a request's pages that lie wholly before the
      window of its next token are given back to the pool as it advances (they stay in
      the prefix cache when hashed), so a long request holds about
      ``window / page_size + 1`` of them. They are its pages when every attention layer
      slides (no ``window_allocator``).
    window_allocator: the sliding layers' own pool, when sliding and full layers mix;
      requests then hold pages of both pools, and only the sliding layers' go back.
    num_state_slots: recurrent-state slots (a model with recurrent layers: ``max_batch``),
      else 0.

  Attributes:
    kv_cache: the :class:`~maxnnx.serving.kv_cache.CacheManager` of the requests' pages
      and state slots.
  """

  def __init__(self, allocator: PageAllocator, *, page_size: int, max_batch: int,
               token_budget: int, prefix_caching: bool = True, window: int | None = None,
               window_allocator: PageAllocator | None = None, num_state_slots: int = 0):
    if min(max_batch, token_budget, page_size) < 1 or token_budget < max_batch:
      raise ValueError(f'Need page_size >= 1 and token_budget >= max_batch >= 1 (every running '
                       f'request can decode in each step); got page_size={page_size}, '
                       f'max_batch={max_batch}, token_budget={token_budget}.')
    self.allocator = allocator
    self.page_size = page_size
    self.max_batch = max_batch
    self.token_budget = token_budget
    self.prefix_caching = prefix_caching
    self.window = window
    self.window_allocator = window_allocator
    self.kv_cache = CacheManager.for_layers(allocator, page_size=page_size, window=window,
                                            window_allocator=window_allocator,
                                            num_state_slots=num_state_slots)
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.num_preemptions = 0

  def add(self, request: Request) -> None:
    """Queue a new request."""
    self.waiting.append(request)

  def has_unfinished(self) -> bool:
    """Whether any request waits or runs."""
    return bool(self.waiting or self.running)

  def schedule(self) -> list[tuple[Request, int]]:
    """The next step's requests, each with the number of its tokens to compute."""
    budget = self.token_budget
    scheduled: list[tuple[Request, int]] = []
    preempted = False
    index = 0
    while index < len(self.running) and budget > 0:
      request = self.running[index]
      count = self._chunk(request, budget)
      if not count:  # the rest of an image does not fit this step's budget
        index += 1
        continue
      while not self._reserve(request, count):
        if request.draft_ids:  # drafts are optional: drop them before preempting anyone
          count -= len(request.draft_ids)
          request.draft_ids = []
          continue
        victim = self.running[-1]
        self._preempt(victim)
        preempted = True
        if victim is request:
          break
      else:
        scheduled.append((request, count))
        budget -= count
        index += 1
    while (self.waiting and budget > 0 and not preempted
           and len(self.running) < self.max_batch):
      request = self.waiting[0]
      if self.prefix_caching and request.num_computed == 0 and not request.pages:
        self.kv_cache.take_cached_prefix(request)
      count = self._chunk(request, budget)
      if not count or not self._reserve(request, count):
        self._drop_pages(request)
        break
      self.waiting.popleft()
      self.running.append(request)
      scheduled.append((request, count))
      budget -= count
    if self.kv_cache.state_slots is not None:
      self.kv_cache.state_slots.assign([request for request, _ in scheduled])
    return scheduled

  def _chunk(self, request: Request, budget: int) -> int:
    """How many of ``request``'s remaining tokens to compute within ``budget``: all that
    fit, cut back to before an image the chunk would end inside (0: wait for room)."""
    remaining = request.num_tokens - request.num_computed
    if request.draft_ids:  # a decoding request: its last token, then the drafts that fit
      del request.draft_ids[max(budget - remaining, 0):]
      remaining += len(request.draft_ids)
    count = min(remaining, budget)
    end = request.num_computed + count
    for start, stop in request.image_spans:
      if start < end < stop:
        return max(0, start - request.num_computed)
    return count

  def advance(self, request: Request, count: int) -> None:
    """Record that a step computed ``count`` more of ``request``'s tokens.

    Newly completed pages get their content hash, and join the prefix cache; with a
    ``window``, pages no later token attends to go back to the pool.
    """
    request.num_computed += count
    self.kv_cache.computed(request, self.prefix_caching)

  def release_rejected(self, request: Request) -> None:
    """After a step verified ``request``'s drafts (its kept tokens appended and computed):
    forget the drafts and give back the pages past its computed tokens, which hold only
    rejected drafts' keys and values (the next step writes over those on the pages kept)."""
    request.draft_ids = []
    self.kv_cache.trim(request)

  def append_token(self, request: Request, token_id: int) -> None:
    """Append a generated token; it is computed in a later step."""
    request.token_ids.append(int(token_id))

  def finish(self, request: Request, reason: str) -> None:
    """Retire ``request`` (running or waiting) and release its pages."""
    if request in self.running:
      self.running.remove(request)
    elif request in self.waiting:
      self.waiting.remove(request)
    self._drop_pages(request)
    request.finish_reason = reason

  def _reserve(self, request: Request, count: int) -> bool:
    return self.kv_cache.reserve(request, count)

  def _drop_pages(self, request: Request) -> None:
    self.kv_cache.drop(request)

  def _preempt(self, request: Request) -> None:
    self.running.remove(request)
    request.draft_ids = []
    self._drop_pages(request)
    self.waiting.appendleft(request)
    self.num_preemptions += 1

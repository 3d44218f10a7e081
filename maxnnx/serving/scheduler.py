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

When a running request needs a page and none is left, the most recently admitted
running request is preempted: its pages are released (they stay in the prefix
cache while nothing evicts them) and it goes back to the front of the queue, to be
recomputed from its tokens. No new request is admitted in a step that preempted.

With a ``window`` (sliding-window attention), pages that lie wholly before the window of
a request's next token go back to the pool as it advances. When every attention layer
slides, those are the request's pages; when sliding and full layers mix (Gemma 2/3,
GPT-OSS, OLMo 3), the sliding layers keep their pages apart, from a second pool
(``window_allocator``, ``Request.window_pages``): the full layers' pages are kept, the
sliding layers' go back. A prefix-cache hit then needs both: the full layers' pages of the
prefix and the sliding layers' pages of its last window (the hit is cut shorter until
both are cached).

A request with images (a vision-language model) lists its images' token spans: a
prefill chunk never ends inside one (an image's tokens attend to each other in both
directions, so they are computed in one step), and its pages are hashed after a digest
of its pixels, so only requests with the same images share them.

This module runs no model and is tested on its own.
"""

import collections
import dataclasses

from maxnnx.serving.pages import PageAllocator, page_hashes
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

  @property
  def num_tokens(self) -> int:
    """Prompt plus generated tokens."""
    return len(self.token_ids)

  @property
  def output_ids(self) -> list[int]:
    """The generated tokens."""
    return self.token_ids[self.num_prompt:]


#: The pool's scratch page (never handed out): padding writes there, released pages read it.
SCRATCH_PAGE = 0


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
  """

  def __init__(self, allocator: PageAllocator, *, page_size: int, max_batch: int,
               token_budget: int, prefix_caching: bool = True, window: int | None = None,
               window_allocator: PageAllocator | None = None):
    if min(max_batch, token_budget, page_size) < 1 or token_budget < max_batch:
      raise ValueError(f'Need page_size >= 1 and token_budget >= max_batch >= 1 (every running '
                       f'request can decode in each step); got page_size={page_size}, '
                       f'max_batch={max_batch}, token_budget={token_budget}.')
    self.allocator = allocator
    self.page_size = page_size
    self.max_batch = max_batch
    self.token_budget = token_budget
    self.prefix_caching = prefix_caching
    if window_allocator is not None and window is None:
      raise ValueError('A window_allocator needs the sliding layers\' window.')
    self.window = window
    self.window_allocator = window_allocator
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
        self._take_cached_prefix(request)
      count = self._chunk(request, budget)
      if not count or not self._reserve(request, count):
        self._drop_pages(request)
        break
      self.waiting.popleft()
      self.running.append(request)
      scheduled.append((request, count))
      budget -= count
    return scheduled

  def _chunk(self, request: Request, budget: int) -> int:
    """How many of ``request``'s remaining tokens to compute within ``budget``: all that
    fit, cut back to before an image the chunk would end inside (0: wait for room)."""
    count = min(request.num_tokens - request.num_computed, budget)
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
    full = request.num_computed // self.page_size
    if len(request.hashes) < full:
      parent = request.hashes[-1] if request.hashes else request.cache_salt
      new = page_hashes(request.token_ids[:full * self.page_size], self.page_size,
                        start=len(request.hashes), parent=parent)
      for index, content_hash in enumerate(new, start=len(request.hashes)):
        if self.prefix_caching:
          self.allocator.register(request.pages[index], content_hash)
          if self.window_allocator is not None:  # released pages are older than any new hash
            self.window_allocator.register(request.window_pages[index], content_hash)
      request.hashes.extend(new)
    if self.window is not None:
      first_kept = self._first_in_window(request.num_computed)
      if first_kept > request.num_released:
        pages, allocator = self._sliding_pages(request)
        allocator.release(pages[request.num_released:first_kept])
        pages[request.num_released:first_kept] = (
            [SCRATCH_PAGE] * (first_kept - request.num_released))
        request.num_released = first_kept

  def _first_in_window(self, num_computed: int) -> int:
    """The first page the token at position ``num_computed`` (the next one) attends to:
    it sees the positions after ``num_computed - window``."""
    return max(0, num_computed - self.window + 1) // self.page_size

  def _sliding_pages(self, request: Request) -> tuple[list[int], PageAllocator]:
    """The pages that go back behind the window, and their pool."""
    if self.window_allocator is None:
      return request.pages, self.allocator
    return request.window_pages, self.window_allocator

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
    """Make ``request``'s pages cover ``num_computed + count`` tokens, if pages are left."""
    needed = -(-(request.num_computed + count) // self.page_size) - len(request.pages)
    if needed <= 0:
      return True
    pages = self.allocator.allocate(needed)
    if pages is None:
      return False
    if self.window_allocator is not None:
      window_pages = self.window_allocator.allocate(needed)
      if window_pages is None:
        self.allocator.release(pages)
        return False
      request.window_pages.extend(window_pages)
    request.pages.extend(pages)
    return True

  def _take_cached_prefix(self, request: Request) -> None:
    """Start ``request`` on the cached pages of its longest cached prefix.

    The last prompt token is always computed (its logits give the first output),
    so a prompt of whole pages takes at most all pages but the last.
    """
    hashes = page_hashes(request.token_ids[:request.num_tokens - 1], self.page_size,
                         parent=request.cache_salt)
    pages = []
    for content_hash in hashes:
      page = self.allocator.lookup(content_hash)
      if page is None:
        break
      pages.append(page)
    window_pages, first_kept = [], 0
    if self.window_allocator is not None:
      # The sliding layers need their pages of the hit's last window: cut the hit shorter
      # until those are cached too.
      while pages:
        first_kept = self._first_in_window(len(pages) * self.page_size)
        window_pages = [self.window_allocator.lookup(h) for h in hashes[first_kept:len(pages)]]
        if None not in window_pages:
          break
        pages.pop()
      if not pages:
        window_pages, first_kept = [], 0
      for page in window_pages:
        self.window_allocator.retain(page)
      request.window_pages = [SCRATCH_PAGE] * first_kept + window_pages
      request.num_released = first_kept
    for page in pages:
      self.allocator.retain(page)
    request.pages = pages
    request.hashes = hashes[:len(pages)]
    request.num_computed = len(request.pages) * self.page_size
    if request.num_tokens == request.num_prompt:  # not a recomputation after preemption
      request.num_cached_tokens = request.num_computed

  def _drop_pages(self, request: Request) -> None:
    if self.window_allocator is None:
      self.allocator.release(request.pages[request.num_released:])
    else:
      self.allocator.release(request.pages)
      self.window_allocator.release(request.window_pages[request.num_released:])
    request.pages, request.window_pages, request.hashes = [], [], []
    request.num_released = request.num_computed = 0

  def _preempt(self, request: Request) -> None:
    self.running.remove(request)
    self._drop_pages(request)
    self.waiting.appendleft(request)
    self.num_preemptions += 1

"""What each request holds of the cache, one manager per kind of layer.

A model's token-mixing layers keep three kinds of per-request cache:

* **full pages**: attention that reads every earlier token keeps all of a request's pages;
* **sliding pages**: attention over a window gives back the pages that lie wholly before
  the window of a request's next token (they stay in the prefix cache while nothing evicts
  them);
* **state slots**: recurrent layers (Gated DeltaNet) keep a fixed-size state per request in
  one of ``max_batch`` slots, not pages.

:class:`PageManager` is one kind of paged layer over one :class:`PageAllocator`, its pages in
one list field of :class:`Request`; :class:`StateSlots` hands out the recurrent slots; and
:class:`CacheManager` keeps them in step for the scheduler: a reservation is all or nothing
across the pools, a prefix-cache hit is as long as every manager can serve, and a request that
leaves gives everything back. A model whose attention layers all slide has one sliding pool; a
model mixing sliding and full layers (unscanned) has a full pool (``Request.pages``) and a
sliding one (``Request.window_pages``); one with recurrent layers adds the slots.

This module runs no model and is tested on its own (``tests/test_serving_pages.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from maxnnx.serving.pages import PageAllocator, page_hashes

if TYPE_CHECKING:
  from maxnnx.serving.scheduler import Request

#: The pool's scratch page (never handed out): padding writes there, released pages read it.
SCRATCH_PAGE = 0


class PageManager:
  """A request's pages of one kind of paged layer, from one pool.

  Args:
    allocator: the pool.
    page_size: tokens per page.
    window: the layers' sliding window (``None``: full attention, every page kept).
    field: the :class:`Request` list that holds these pages (``'pages'`` or
      ``'window_pages'``).
  """

  def __init__(self, allocator: PageAllocator, page_size: int, window: int | None = None,
               field: str = 'pages'):
    self.allocator = allocator
    self.page_size = page_size
    self.window = window
    self.field = field

  def pages(self, request: Request) -> list[int]:
    """The request's pages of this kind (the first ``num_released`` read as scratch when
    sliding)."""
    return getattr(request, self.field)

  def first_in_window(self, num_computed: int) -> int:
    """The first page the token at position ``num_computed`` (the next one) attends to: it
    sees the positions after ``num_computed - window`` (0 for full attention)."""
    if self.window is None:
      return 0
    return max(0, num_computed - self.window + 1) // self.page_size

  def allocate(self, request: Request, count: int) -> list[int] | None:
    """``count`` new pages appended to the request's, or ``None`` (nothing taken) when the
    pool has too few."""
    pages = self.allocator.allocate(count)
    if pages is not None:
      self.pages(request).extend(pages)
    return pages

  def undo(self, request: Request, new_pages: list[int]) -> None:
    """Give back the pages of an :meth:`allocate` another pool could not match."""
    del self.pages(request)[-len(new_pages):]
    self.allocator.release(new_pages)

  def register(self, request: Request, index: int, content_hash: bytes) -> None:
    """Put the request's page ``index`` (full and computed) in the prefix cache, in the group
    of its adapter slot."""
    self.allocator.register(self.pages(request)[index], content_hash, request.lora_slot)

  def release_behind(self, request: Request) -> None:
    """Give back the pages no later token attends to (sliding layers only)."""
    first_kept = self.first_in_window(request.num_computed)
    if self.window is None or first_kept <= request.num_released:
      return
    pages = self.pages(request)
    self.allocator.release(pages[request.num_released:first_kept])
    pages[request.num_released:first_kept] = [SCRATCH_PAGE] * (first_kept - request.num_released)
    request.num_released = first_kept

  def cached(self, hashes: Sequence[bytes], limit: int) -> tuple[int, int, list[int]]:
    """The longest prefix of at most ``limit`` pages this pool can serve from its cache:
    ``(pages in the prefix, first page read, the cached pages from that one on)``.

    Full layers need every page of the prefix; sliding layers only those of the window of
    the token after it (the hit is cut shorter until those are cached).
    """
    if self.window is None:
      found = []
      for content_hash in hashes[:limit]:
        page = self.allocator.lookup(content_hash)
        if page is None:
          break
        found.append(page)
      return len(found), 0, found
    for length in range(limit, 0, -1):
      first = self.first_in_window(length * self.page_size)
      found = [self.allocator.lookup(h) for h in hashes[first:length]]
      if None not in found:
        return length, first, found
    return 0, 0, []

  def take(self, request: Request, first: int, pages: list[int]) -> None:
    """Start the request on cached ``pages`` (from page ``first``; scratch before it)."""
    for page in pages:
      self.allocator.retain(page)
    self.pages(request)[:] = [SCRATCH_PAGE] * first + pages
    if self.window is not None:
      request.num_released = first

  def drop(self, request: Request) -> None:
    """Give back every page the request still holds."""
    held = self.pages(request)
    self.allocator.release(held[request.num_released:] if self.window is not None else held)
    held.clear()


class StateSlots:
  """Recurrent-state slots ``1..num_slots`` for running requests (slot 0 is scratch: the
  state that empty rows write)."""

  def __init__(self, num_slots: int):
    self.num_slots = num_slots
    self.slots: dict[int, int] = {}  # request id -> its slot

  def slot(self, request: Request) -> int:
    """The request's slot (0 when it holds none)."""
    return self.slots.get(request.request_id, 0)

  def assign(self, requests: Sequence[Request]) -> None:
    """Give a free slot to each of ``requests`` without one."""
    free = sorted(set(range(1, self.num_slots + 1)) - set(self.slots.values()), reverse=True)
    for request in requests:
      if request.request_id not in self.slots:
        self.slots[request.request_id] = free.pop()

  def free(self, request: Request) -> None:
    """Take back the request's slot (finished, cancelled or preempted: a restart begins from
    position 0, hence a zero state)."""
    self.slots.pop(request.request_id, None)


class CacheManager:
  """Every kind of cache a model keeps per request, reserved, shared and released together.

  Args:
    managers: one :class:`PageManager` per pool; the first is the one ``Request.pages``
      names (full layers, or the sliding layers when every attention layer slides). Each
      pool's page ``i`` holds the same tokens, so the pools grow and hash in step.
    page_size: tokens per page.
    state_slots: the recurrent layers' :class:`StateSlots`, or ``None``.
  """

  def __init__(self, managers: Sequence[PageManager], page_size: int,
               state_slots: StateSlots | None = None):
    self.managers = tuple(managers)
    self.page_size = page_size
    self.state_slots = state_slots

  @classmethod
  def for_layers(cls, allocator: PageAllocator, *, page_size: int, window: int | None = None,
                 window_allocator: PageAllocator | None = None,
                 num_state_slots: int = 0) -> CacheManager:
    """The managers of a model's layer kinds: ``window`` alone (every attention layer slides:
    one sliding pool), ``window`` and ``window_allocator`` (sliding and full layers: a full
    pool and a sliding one), neither (full layers), plus ``num_state_slots`` recurrent slots."""
    if window_allocator is not None and window is None:
      raise ValueError('A window_allocator needs the sliding layers\' window.')
    if window_allocator is None:
      managers = [PageManager(allocator, page_size, window)]
    else:
      managers = [PageManager(allocator, page_size),
                  PageManager(window_allocator, page_size, window, field='window_pages')]
    return cls(managers, page_size, StateSlots(num_state_slots) if num_state_slots else None)

  def reserve(self, request: Request, count: int) -> bool:
    """Make the request's pages cover ``num_computed + count`` tokens in every pool, if pages
    are left in all of them (else nothing is taken)."""
    needed = -(-(request.num_computed + count) // self.page_size) - len(request.pages)
    if needed <= 0:
      return True
    taken = []
    for manager in self.managers:
      pages = manager.allocate(request, needed)
      if pages is None:
        for done, new_pages in reversed(taken):
          done.undo(request, new_pages)
        return False
      taken.append((manager, pages))
    return True

  def computed(self, request: Request, prefix_caching: bool) -> None:
    """After a step computed more of the request's tokens: hash its newly full pages (into
    the prefix cache when ``prefix_caching``) and give back the pages behind its windows."""
    full = request.num_computed // self.page_size
    if len(request.hashes) < full:
      parent = request.hashes[-1] if request.hashes else request.cache_salt
      new = page_hashes(request.token_ids[:full * self.page_size], self.page_size,
                        start=len(request.hashes), parent=parent)
      if prefix_caching:  # released pages are older than any new hash
        for index, content_hash in enumerate(new, start=len(request.hashes)):
          for manager in self.managers:
            manager.register(request, index, content_hash)
      request.hashes.extend(new)
    for manager in self.managers:
      manager.release_behind(request)

  def take_cached_prefix(self, request: Request) -> None:
    """Start a new request on the cached pages of its longest prefix every pool can serve.

    The last prompt token is always computed (its logits give the first output), so a prompt
    of whole pages takes at most all pages but the last.
    """
    hashes = page_hashes(request.token_ids[:request.num_tokens - 1], self.page_size,
                         parent=request.cache_salt)
    length = len(hashes)
    while True:  # shorten until every pool serves the same prefix
      found = [manager.cached(hashes, length) for manager in self.managers]
      shortest = min(n for n, _, _ in found)
      if shortest == length:
        break
      length = shortest
    if length:
      for manager, (_, first, pages) in zip(self.managers, found):
        manager.take(request, first, pages)
    request.hashes = hashes[:length]
    request.num_computed = length * self.page_size
    if request.num_tokens == request.num_prompt:  # not a recomputation after preemption
      request.num_cached_tokens = request.num_computed

  def trim(self, request: Request) -> None:
    """Give back the request's pages past those its computed tokens fill (they held only
    speculative drafts that were rejected; never hashed, so never shared)."""
    keep = -(-request.num_computed // self.page_size)
    for manager in self.managers:
      pages = manager.pages(request)
      if len(pages) > keep:
        manager.allocator.release(pages[keep:])
        del pages[keep:]

  def drop(self, request: Request) -> None:
    """Give back all the request holds: pages of every pool, and its state slot."""
    for manager in self.managers:
      manager.drop(request)
    if self.state_slots is not None:
      self.state_slots.free(request)
    request.hashes = []
    request.num_released = request.num_computed = 0

  def forget_adapter(self, slot: int) -> int:
    """Free at once the cached pages of LoRA adapter slot ``slot``'s requests in every pool
    (its adapter was unloaded: no later request hits them). Returns the pages freed."""
    return sum(manager.allocator.forget_group(slot) for manager in self.managers)

  def state_slot(self, request: Request) -> int:
    """The request's recurrent-state slot (0 without recurrent layers or a slot)."""
    return 0 if self.state_slots is None else self.state_slots.slot(request)

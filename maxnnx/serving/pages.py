"""The page pool's bookkeeping: free pages, reference counts, and the prefix cache.

Every page is in exactly one of three states:

* **in use**: held by one or more requests (``ref_count > 0``). A full page
  whose content hash is registered may be held by several requests that share
  that prompt prefix;
* **cached**: no request holds it, but its content hash is registered, so a
  later request with the same prefix can take it back without recomputing it.
  Cached pages are evicted least recently released first when free pages run out;
* **free**: no content worth keeping.

A page's hash covers its tokens and, through the previous page's hash, every
token before them (:func:`page_hashes`), so equal hashes mean equal prefixes.
Only full pages are hashed: a request appends to its last page, never to a
full one, so a shared page is never written again.

Each registered page also records its ``group`` (the engine's LoRA adapter slot, 0 for the
base model): :meth:`PageAllocator.forget_group` drops the cached pages of one group at once,
when no later request can hit them (an unloaded adapter's).

Pages below ``reserved`` are never handed out; the engine uses page 0 as a
scratch page that padding tokens write to.
"""

import collections
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np


def page_hashes(token_ids: Sequence[int], page_size: int, *, start: int = 0,
                parent: bytes = b'') -> list[bytes]:
  """Chained content hashes of the full pages of ``token_ids`` from page ``start``.

  ``parent`` is the hash of page ``start - 1`` (empty for the first page).
  """
  hashes = []
  for first in range(start * page_size, len(token_ids) - page_size + 1, page_size):
    chunk = np.asarray(token_ids[first:first + page_size], np.int64).tobytes()
    parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
    hashes.append(parent)
  return hashes


class PageAllocator:
  """Hands out pages of a pool of ``num_pages``, counting references, with a prefix cache.

  Args:
    num_pages: pages in the pool, reserved ones included.
    reserved: the first ``reserved`` pages are never handed out.
  """

  def __init__(self, num_pages: int, *, reserved: int = 1):
    if num_pages <= reserved:
      raise ValueError(f'A pool of {num_pages} pages with {reserved} reserved has none to '
                       'hand out.')
    self.num_pages = num_pages
    self.reserved = reserved
    self.ref_counts = [0] * num_pages
    self._free = collections.deque(range(reserved, num_pages))
    self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
    self._page_of_hash: dict[bytes, int] = {}
    self._hash_of_page: dict[int, bytes] = {}
    self._group_of_page: dict[int, int] = {}  # registered pages: their group
    self.evictions = 0

  @property
  def num_usable(self) -> int:
    """Pages that can ever be handed out (the pool less the reserved ones)."""
    return self.num_pages - self.reserved

  @property
  def num_available(self) -> int:
    """Pages :meth:`allocate` can hand out now: free ones plus evictable cached ones."""
    return len(self._free) + len(self._cached)

  @property
  def num_cached(self) -> int:
    """Pages held by no request but kept for their content."""
    return len(self._cached)

  def allocate(self, count: int) -> list[int] | None:
    """``count`` pages with one reference each, or ``None`` (nothing taken) if too few."""
    if count > self.num_available:
      return None
    pages = []
    for _ in range(count):
      if self._free:
        page = self._free.popleft()
      else:
        page, _ = self._cached.popitem(last=False)
        self._unregister(page)
        self.evictions += 1
      self.ref_counts[page] = 1
      pages.append(page)
    return pages

  def lookup(self, content_hash: bytes) -> int | None:
    """The page registered under ``content_hash`` (in use or cached), or ``None``."""
    return self._page_of_hash.get(content_hash)

  def retain(self, page: int) -> None:
    """Add a reference to a registered page (a prefix-cache hit)."""
    if self.ref_counts[page] == 0:
      if page not in self._cached:
        raise ValueError(f'Page {page} is free: only registered pages can be retained.')
      del self._cached[page]
    self.ref_counts[page] += 1

  def release(self, pages: Iterable[int]) -> None:
    """Drop one reference to each of ``pages``; unreferenced pages become cached or free.

    Pages are released last first, so a sequence's tail is evicted before its prefix.
    """
    for page in reversed(list(pages)):
      if self.ref_counts[page] <= 0:
        raise ValueError(f'Page {page} is released more often than it was taken.')
      self.ref_counts[page] -= 1
      if self.ref_counts[page] == 0:
        if page in self._hash_of_page:
          self._cached[page] = None
        else:
          self._free.append(page)

  def register(self, page: int, content_hash: bytes, group: int = 0) -> bool:
    """Record that in-use ``page`` holds the full prefix ``content_hash``, of ``group`` (what
    :meth:`forget_group` drops).

    Returns ``False`` (and records nothing) when another page already holds it.
    """
    if content_hash in self._page_of_hash or page in self._hash_of_page:
      return False
    self._page_of_hash[content_hash] = page
    self._hash_of_page[page] = content_hash
    self._group_of_page[page] = group
    return True

  def _unregister(self, page: int) -> None:
    del self._page_of_hash[self._hash_of_page.pop(page)]
    del self._group_of_page[page]

  def forget_group(self, group: int) -> int:
    """Forget the content hashes of ``group``'s pages: its cached pages become free at once
    (and pages still in use become free when released). Returns the cached pages freed."""
    pages = [page for page, of in self._group_of_page.items() if of == group]
    freed = [page for page in pages if page in self._cached]
    for page in pages:
      self._unregister(page)
    for page in freed:
      del self._cached[page]
    self._free.extend(freed)
    return len(freed)

  def clear_cache(self) -> None:
    """Forget every content hash (e.g. after the weights changed); cached pages become free."""
    self._free.extend(self._cached)
    self._cached.clear()
    self._page_of_hash.clear()
    self._hash_of_page.clear()
    self._group_of_page.clear()

  def check(self) -> None:
    """Raise ``AssertionError`` unless every page is in exactly one state, consistently."""
    free, cached = set(self._free), set(self._cached)
    in_use = {p for p in range(self.reserved, self.num_pages) if self.ref_counts[p] > 0}
    assert len(free) == len(self._free), 'a page is free twice'
    assert not (free & cached) and not (free & in_use) and not (cached & in_use)
    assert free | cached | in_use == set(range(self.reserved, self.num_pages)), 'a page leaked'
    assert all(c >= 0 for c in self.ref_counts)
    assert all(self.ref_counts[p] == 0 for p in range(self.reserved))
    assert cached <= set(self._hash_of_page), 'a cached page has no hash'
    assert not free & set(self._hash_of_page), 'a free page has a hash'
    assert {self._page_of_hash[h]: h for h in self._page_of_hash} == self._hash_of_page
    assert self._group_of_page.keys() == self._hash_of_page.keys(), 'a hash has no group'

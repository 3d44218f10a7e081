"""Page allocator and scheduler on their own (no model): sharing, eviction, preemption, leaks."""

import numpy as np
import pytest

from maxnnx.serving import PageAllocator, Request, SamplingParams, Scheduler, page_hashes
from maxnnx.serving.kv_cache import CacheManager


def _request(request_id, prompt, max_tokens=4):
  return Request(request_id=request_id, token_ids=list(prompt), num_prompt=len(prompt),
                 params=SamplingParams(max_tokens=max_tokens), seed=0)


def test_allocate_release_and_reserved_pages():
  """Reserved pages are never handed out; released unhashed pages are free again."""
  alloc = PageAllocator(5, reserved=1)
  pages = alloc.allocate(4)
  assert sorted(pages) == [1, 2, 3, 4] and alloc.allocate(1) is None
  alloc.release(pages)
  assert alloc.num_available == 4 and alloc.num_cached == 0
  alloc.check()
  with pytest.raises(ValueError, match='released more often'):
    alloc.release([1])


def test_hashed_pages_are_cached_shared_and_evicted_least_recent_first():
  """A released hashed page stays findable until allocation needs it; LRU goes first."""
  alloc = PageAllocator(4, reserved=1)
  a, b, c = alloc.allocate(3)
  assert alloc.register(a, b'ha') and alloc.register(b, b'hb')
  assert not alloc.register(c, b'ha')  # another page holds that prefix already
  alloc.retain(a)  # a second request shares it
  assert alloc.ref_counts[a] == 2
  alloc.release([a, b, c])  # released last first: c free, b then a cached
  assert alloc.ref_counts[a] == 1 and alloc.num_cached == 1 and alloc.lookup(b'hb') == b
  alloc.release([a])
  assert alloc.num_cached == 2 and alloc.num_available == 3
  first = alloc.allocate(2)  # the free page, then the least recently released cached one (b)
  assert first == [c, b] and alloc.lookup(b'hb') is None and alloc.lookup(b'ha') == a
  alloc.retain(a)  # a cache hit takes it back out of the cache
  assert alloc.num_available == 0
  alloc.check()



def test_forgetting_a_group_frees_its_cached_pages_and_unhashes_those_in_use():
  """forget_group(1) frees group 1's cached pages at once and forgets its hashes (a page still
  held becomes free, not cached, when released); group 0's and group 2's stay cached."""
  alloc = PageAllocator(7, reserved=1)
  a, b, c, d, e = alloc.allocate(5)
  for page, content_hash, group in ((a, b'a', 0), (b, b'b', 1), (c, b'c', 1), (d, b'd', 2),
                                    (e, b'e', 1)):
    assert alloc.register(page, content_hash, group)
  alloc.release([a, b, c, d])  # e stays in use
  assert alloc.num_cached == 4 and alloc.num_available == 5
  assert alloc.forget_group(1) == 2
  assert alloc.num_cached == 2 and alloc.num_available == 5 and alloc.evictions == 0
  assert [alloc.lookup(h) for h in (b'a', b'b', b'c', b'd', b'e')] == [a, None, None, d, None]
  alloc.check()
  alloc.release([e])
  assert alloc.num_cached == 2 and alloc.num_available == 6 and alloc.forget_group(1) == 0
  alloc.check()

def test_page_hashes_chain_the_prefix():
  """Equal pages after different prefixes hash differently; only full pages hash."""
  x = page_hashes([1, 2, 3, 4, 5, 6, 7], 2)
  y = page_hashes([9, 9, 3, 4, 5, 6], 2)
  assert len(x) == 3 and len(y) == 3 and x[1] != y[1]
  assert page_hashes([1, 2, 3, 4, 5, 6], 2, start=1, parent=x[0]) == x[1:]


def test_scheduler_shares_a_cached_prefix():
  """A second request with the same full prompt pages starts on the first one's pages."""
  alloc = PageAllocator(20)
  sched = Scheduler(alloc, page_size=4, max_batch=4, token_budget=64)
  first = _request(0, list(range(10)))
  sched.add(first)
  [(req, count)] = sched.schedule()
  assert count == 10
  sched.advance(req, count)
  second = _request(1, list(range(9)) + [42, 43])
  sched.add(second)
  sched.append_token(first, 7)
  scheduled = dict((r.request_id, n) for r, n in sched.schedule())
  assert scheduled == {0: 1, 1: 3}  # 8 of 11 prompt tokens come from the cache
  assert second.pages[:2] == first.pages[:2] and second.num_cached_tokens == 8
  assert alloc.ref_counts[first.pages[0]] == 2
  alloc.check()


def test_chunked_prefill_respects_the_budget_and_decodes_first():
  """Running decodes are scheduled before a long prompt, whose chunks fill the rest."""
  sched = Scheduler(PageAllocator(40), page_size=4, max_batch=4, token_budget=8)
  short, long = _request(0, [1, 2]), _request(1, list(range(20)))
  sched.add(short)
  sched.add(long)
  steps = []
  for _ in range(4):
    batch = sched.schedule()
    steps.append([(r.request_id, n) for r, n in batch])
    for r, n in batch:
      sched.advance(r, n)
      if r.num_computed == r.num_tokens:
        sched.append_token(r, 5)
  assert steps == [[(0, 2), (1, 6)], [(0, 1), (1, 7)], [(0, 1), (1, 7)], [(0, 1), (1, 1)]]


def test_preemption_frees_pages_and_requeues_first():
  """Out of pages, the last admitted request is preempted and recomputed later."""
  alloc = PageAllocator(5)  # 4 usable pages of 2 tokens
  sched = Scheduler(alloc, page_size=2, max_batch=4, token_budget=16, prefix_caching=False)
  a, b = _request(0, [1, 2, 3, 4]), _request(1, [5, 6, 7, 8])
  sched.add(a)
  sched.add(b)
  for r, n in sched.schedule():  # both prefill: 2 pages each, pool full
    sched.advance(r, n)
    sched.append_token(r, 9)
  batch = sched.schedule()  # a needs a 3rd page for its 5th token -> b is preempted
  assert [(r.request_id, n) for r, n in batch] == [(0, 1)]
  assert sched.num_preemptions == 1 and list(sched.waiting) == [b] and b.num_computed == 0
  assert b.token_ids == [5, 6, 7, 8, 9]  # recomputed from prompt and output so far
  alloc.check()


@pytest.mark.parametrize('layers', ['full', 'every_layer_sliding', 'sliding_and_full'])
def test_thousand_random_requests_leave_no_page_behind(layers):
  """Random arrivals, prefixes, lengths, cancellations: every page comes back, from both
  pools when sliding layers have their own (which then hold only a window's pages)."""
  rng = np.random.default_rng(0)
  alloc = PageAllocator(13 if layers == 'every_layer_sliding' else 41)  # preempts in all 3
  window_alloc = PageAllocator(21) if layers == 'sliding_and_full' else None
  window = None if layers == 'full' else 5
  sched = Scheduler(alloc, page_size=4, max_batch=8, token_budget=24, window=window,
                    window_allocator=window_alloc)
  prefixes = [rng.integers(0, 50, 12).tolist() for _ in range(5)]
  live, next_id, cached = {}, 0, 0
  while next_id < 1000 or sched.has_unfinished():
    while next_id < 1000 and rng.random() < 0.6:
      shared = prefixes[rng.integers(5)] if rng.random() < 0.5 else []
      prompt = shared + rng.integers(0, 50, rng.integers(1, 20)).tolist()
      live[next_id] = _request(next_id, prompt, int(rng.integers(1, 12)))
      sched.add(live[next_id])
      next_id += 1
    for req, count in sched.schedule():
      sched.advance(req, count)
      if req.num_computed == req.num_tokens:
        sched.append_token(req, int(rng.integers(0, 50)))
        if len(req.output_ids) >= req.params.max_tokens:
          cached += req.num_cached_tokens
          sched.finish(req, 'length')
          del live[req.request_id]
    if live and rng.random() < 0.05:
      sched.finish(live.pop(int(rng.choice(list(live)))), 'cancelled')
    alloc.check()
    for req in sched.running:
      sliding = req.pages if window_alloc is None else req.window_pages
      if window_alloc is not None:
        assert len(req.window_pages) == len(req.pages) and 0 not in req.pages
      assert sliding[:req.num_released] == [0] * req.num_released
      assert 0 not in sliding[req.num_released:]
      if window is not None:  # the window and a step's tokens, and a page's edge
        assert len(sliding) - req.num_released <= -(-(window + 24) // 4) + 1
    if window_alloc is not None:
      window_alloc.check()
  for pool in (alloc,) if window_alloc is None else (alloc, window_alloc):
    assert pool.num_available == pool.num_usable and not any(pool.ref_counts)
  assert sched.num_preemptions > 0 and alloc.evictions > 0 and cached > 0


def test_scheduler_needs_a_budget_for_every_row():
  """A budget smaller than the batch would starve running requests: refused."""
  with pytest.raises(ValueError, match='token_budget >= max_batch'):
    Scheduler(PageAllocator(4), page_size=2, max_batch=4, token_budget=3)


@pytest.mark.parametrize('window_pool, cached', [(20, 0), (64, 44)])
def test_a_mixed_models_prefix_hit_needs_the_sliding_pages_of_its_last_window(window_pool,
                                                                               cached):
  """Sliding and full layers (window 6): a prompt served again after a long generation hits
  the full layers' 11 cached pages only while the sliding layers' pool still caches the
  pages of that prefix's last window. A pool the size of the running windows (20) has
  evicted them, so the hit is lost; one as large as the full pool (64) keeps them."""
  alloc, window_alloc = PageAllocator(65), PageAllocator(window_pool + 1)
  sched = Scheduler(alloc, page_size=4, max_batch=2, token_budget=8, window=6,
                    window_allocator=window_alloc)
  prompt = list(range(48))
  first = _request(0, prompt, max_tokens=80)
  sched.add(first)
  while first.finish_reason is None:
    for request, count in sched.schedule():
      sched.advance(request, count)
      if request.num_computed == request.num_tokens:
        sched.append_token(request, 7)
        if len(request.output_ids) == 80:
          sched.finish(request, 'length')
  again = _request(1, prompt)
  sched.add(again)
  [(request, count)] = sched.schedule()
  assert request is again and again.num_cached_tokens == cached and count == min(8, 48 - cached)
  assert again.window_pages[:again.num_released] == [0] * again.num_released
  alloc.check()
  window_alloc.check()


def test_a_sliding_pool_serves_a_prefix_whose_early_pages_were_evicted():
  """Every attention layer sliding (window 6, one pool): a prompt served again hits its
  cached prefix as long as the pages of that prefix's last window are cached, even after the
  pages behind that window were evicted (they read as scratch)."""
  prompt = list(range(48))
  alloc = PageAllocator(65)
  cache = CacheManager.for_layers(alloc, page_size=4, window=6)
  first = _request(0, prompt)
  assert cache.reserve(first, 48)
  for computed in range(4, 49, 4):  # a page at a time: the pages behind go back in order
    first.num_computed = computed
    cache.computed(first, prefix_caching=True)
  cache.drop(first)
  alloc.allocate(alloc.num_available - alloc.num_cached + 5)  # evicts pages 0 to 4
  assert [alloc.lookup(h) is None for h in page_hashes(prompt, 4)[:6]] == [True] * 5 + [False]
  again = _request(1, prompt)
  cache.take_cached_prefix(again)
  assert again.num_cached_tokens == 44 and again.num_released == 9  # the last window: 9, 10
  assert again.pages[:9] == [0] * 9 and 0 not in again.pages[9:] and len(again.pages) == 11
  alloc.check()


def test_state_slots_are_given_and_taken_back_with_the_request():
  """Recurrent layers: each scheduled request holds one of the slots, distinct from the
  others'; a preempted or finished request gives its slot back at once."""
  alloc = PageAllocator(5)  # 4 usable pages of 2 tokens
  sched = Scheduler(alloc, page_size=2, max_batch=2, token_budget=8, prefix_caching=False,
                    num_state_slots=2)
  slots = sched.kv_cache.state_slots
  a, b = _request(0, [1, 2, 3, 4]), _request(1, [5, 6, 7, 8])
  sched.add(a)
  sched.add(b)
  batch = sched.schedule()
  assert {sched.kv_cache.state_slot(r) for r, _ in batch} == {1, 2}
  for request, count in batch:
    sched.advance(request, count)
    sched.append_token(request, 9)
  sched.schedule()  # each needs a third page: none is left, so b is preempted
  assert sched.num_preemptions == 1 and list(slots.slots) == [0]
  sched.finish(a, 'length')
  assert not slots.slots and sched.kv_cache.state_slot(a) == 0

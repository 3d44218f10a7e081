"""The engine's sizes: :class:`EngineSizing`, a part of :class:`~maxnnx.serving.Engine` that
checks its positions, makes its page pools and refuses a request it could never serve."""

from __future__ import annotations

import logging
import math

from maxnnx.serving.pages import PageAllocator
from maxnnx.serving.params import SamplingParams

logger = logging.getLogger('maxnnx.serving.engine')  # the engine's own log


class EngineSizing:
  """Positions, page pools and request limits of an engine.

  The engine provides ``model_config``, ``max_model_len``, ``max_pages``, ``max_batch``,
  ``page_size``, ``pages_per_request``, ``token_budget``, ``max_logprobs``, ``tokenizer`` and
  (for requests) ``scheduler``.
  """

  def _check_positions(self, model) -> None:
    """Warn about positions beyond the trained ones; refuse what a batch cannot serve."""
    cfg = self.model_config
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

  def _plan_pools(self, max_window_pages: int | None) -> int | None:
    """Make the page pools; returns the window the scheduler frees pages behind (``None``:
    every page is kept)."""
    cfg = self.model_config
    self.allocator = PageAllocator(self.max_pages + 1, reserved=1)
    types = set(cfg.resolved_layer_types)
    window = cfg.attention.sliding_window if 'sliding' in types else None
    # A request's pages that its sliding layers still attend to, at most.
    self.window_pages_per_request = (
        self.pages_per_request if window is None else
        min(self.pages_per_request, math.ceil((window + self.token_budget) / self.page_size) + 1))
    # Mixed sliding and full layers (unscanned): the sliding layers get a pool of their own,
    # twice what the running requests hold, so released pages stay cached for prefix hits.
    self.window_allocator = None
    self.max_window_pages = 0
    if window is not None and types == {'sliding', 'full'} and not cfg.runtime.scan_layers:
      self.max_window_pages = (
          min(self.max_pages, 2 * self.max_batch * self.window_pages_per_request)
          if max_window_pages is None else max_window_pages)
      self.window_allocator = PageAllocator(self.max_window_pages + 1, reserved=1)
    elif types != {'sliding'}:
      window = None  # full (or chunked) layers read every page
    return window

  def _check_request(self, ids: list[int], params: SamplingParams) -> None:
    """Refuse a request the engine could never serve, with the reason (``ValueError``)."""
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

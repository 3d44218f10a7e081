"""Paged attention: queries of many requests against keys and values held in a pool of pages.

A serving engine keeps every request's keys and values in fixed-size pages of one
pool, ``k_pages [num_pages, page_size, kv_heads, head_dim]`` per layer, and a
block table per request listing its pages in order. One engine step runs the
tokens of all scheduled requests as one flat sequence of ``T`` tokens (decode
steps contribute one token, prefill chunks several); :class:`PagedBatch` says
where each token goes:

* row ``b`` (a request) owns the flat tokens ``q_starts[b] : q_starts[b] + q_lens[b]``;
* those tokens are its sequence positions ``kv_lens[b] - q_lens[b] … kv_lens[b] - 1``
  (they are appended to what the cache already holds), and key ``i`` of a row
  is at position ``i``;
* token ``t``'s key and value are written at flat slot ``slots[t]``
  (``page * page_size + offset``) before attention reads them;
* the row's pages are ``page_table[b, :ceil(kv_lens[b] / page_size)]``.

Padding tokens (the flat length is bucketed) and empty rows write to a scratch
page of the engine's choosing and are ignored.

Rows are gathered ``max_q`` tokens wide, the longest row's bound. In a step that
mixes a few prefill chunks with many decode rows, that would give every decode row
the work of a chunk; so ``wide_rows`` (when set) says only the first rows are
gathered ``max_q`` wide and every later row holds one token at most. Strategies run
each such group of rows on its own (:meth:`PagedBatch.map_row_groups`).

A paged-attention strategy is a frozen dataclass like the dense ones
(:mod:`maxnnx.kernels.attention`): it declares
:class:`~maxnnx.kernels.capabilities.PagedAttentionCapabilities`, implements
``attend(q_TNH, k_pages, v_pages, batch, options)`` and is registered by name
(``cfg.runtime.paged_attention_impl``). ``xla`` gathers each row's pages into a
contiguous ``[B, pages * page_size]`` key range and calls the dense ``xla``
reference with the mask the batch implies; it supports every feature and is the
fallback. A ragged paged kernel (Pallas on GPU/TPU) can be registered beside it.

A pool may also be quantized (``kv_cache_dtype`` ``int8`` or ``fp8``): a
:class:`~maxnnx.kernels.kv_quant.QuantizedPages` of int8 or e4m3 pages and a float32 scale per
token and KV head. :meth:`PagedBatch.write` quantizes each new token as it stores it, and
``xla`` dequantizes the rows' pages as it gathers them; a strategy whose capabilities do not
list the pages' dtype (``kv_dtypes``) falls back to ``xla`` or refuses, by its policy.
"""

import abc
import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp

from maxnnx.kernels.attention import XlaAttention
from maxnnx.kernels.capabilities import (
  ALL_PLATFORMS,
  FLOAT_DTYPES,
  KernelStrategy,
  PagedAttentionCapabilities,
  PagedAttentionRequest,
  lookup_kernel,
)
from maxnnx.kernels.kv_quant import QUANTIZED_KV_DTYPES, QuantizedPages, quantize_kv
from maxnnx.kernels.masks import AttentionMask
from maxnnx.kernels.options import AttentionOptions


@dataclasses.dataclass(frozen=True)
class PagedBatch:
  """Where one step's flat tokens sit in the page pool (see the module docstring).

  A pytree: the arrays are traced, ``max_q`` and ``wide_rows`` are static (part of the
  compiled shape).

  Attributes:
    page_table_BM: ``[B, M]`` int32 page ids of each row, in sequence order.
    kv_lens_B: ``[B]`` int32 tokens of each row in the cache once this step is written.
    q_starts_B: ``[B]`` int32 index of each row's first token in the flat sequence.
    q_lens_B: ``[B]`` int32 tokens each row adds this step (0 for an empty row).
    slots_T: ``[T]`` int32 flat slot (``page * page_size + offset``) of each token.
    max_q: a bound on ``q_lens_B`` (static): rows are gathered ``max_q`` tokens wide
      (only the first ``wide_rows`` of them, when that is set).
    blocks_T: ``[T]`` int32 image-block id of each flat token (-1: none), or ``None``.
      Tokens of one block attend to each other in both directions; a block lies
      wholly within one step (the engine never cuts an image between prefill chunks).
    wide_rows: (static) only rows ``:wide_rows`` may hold more than one token; the rest
      are gathered one token wide. ``None``: every row is ``max_q`` wide.
    state_slots_B: ``[B]`` int32 recurrent-state slot of each row (layers with a state
      per request, such as Gated DeltaNet; 0: scratch, for empty rows), or ``None``.
    window_page_table_BM, window_slots_T: the sliding layers' page table and write slots
      when they have a pool of their own (a model mixing sliding and full layers; see
      :meth:`sliding_layers`), else ``None``.
  """

  page_table_BM: jax.Array
  kv_lens_B: jax.Array
  q_starts_B: jax.Array
  q_lens_B: jax.Array
  slots_T: jax.Array
  max_q: int
  blocks_T: jax.Array | None = None
  wide_rows: int | None = None
  state_slots_B: jax.Array | None = None
  window_page_table_BM: jax.Array | None = None
  window_slots_T: jax.Array | None = None

  def sliding_layers(self) -> 'PagedBatch':
    """The batch as a sliding layer reads it: its own pool's page table and write slots
    when it has one (pages behind the window read as the scratch page, masked by the
    window), else this batch."""
    if self.window_page_table_BM is None:
      return self
    return dataclasses.replace(self, page_table_BM=self.window_page_table_BM,
                               slots_T=self.window_slots_T, window_page_table_BM=None,
                               window_slots_T=None)

  def _row_index(self):
    """``[B, Q]`` flat index of each row's tokens, and which of them exist."""
    offsets_Q = jnp.arange(self.max_q, dtype=jnp.int32)
    valid_BQ = offsets_Q[None] < self.q_lens_B[:, None]
    return self.q_starts_B[:, None] + offsets_Q[None], valid_BQ

  def gather_rows(self, x_T: jax.Array) -> jax.Array:
    """``[T, ...] -> [B, max_q, ...]``: each row's tokens; rows shorter than ``max_q``
    are padded with token 0 (masked by :meth:`row_mask`)."""
    index_BQ, valid_BQ = self._row_index()
    return jnp.take(x_T, jnp.where(valid_BQ, index_BQ, 0), axis=0)

  def scatter_rows(self, x_BQ: jax.Array, num_tokens: int,
                   into: jax.Array | None = None) -> jax.Array:
    """``[B, max_q, ...] -> [num_tokens, ...]``: the inverse of :meth:`gather_rows`;
    padding tokens get zeros, or keep what ``into`` holds there."""
    index_BQ, valid_BQ = self._row_index()
    if into is None:
      into = jnp.zeros((num_tokens,) + x_BQ.shape[2:], x_BQ.dtype)
    return into.at[jnp.where(valid_BQ, index_BQ, num_tokens)].set(x_BQ, mode='drop')

  def row_groups(self) -> tuple['PagedBatch', ...]:
    """The rows split by width: ``(self,)``, or with :attr:`wide_rows` set, the first
    ``wide_rows`` rows (``max_q`` wide) and the rest (one token wide), each a
    :class:`PagedBatch` over the same flat tokens and pool."""
    rows = self.kv_lens_B.shape[0]
    if self.wide_rows is None or self.wide_rows >= rows or self.max_q == 1:
      return (self,)  # the row methods read max_q alone: one group of every row

    def part(span, max_q):
      return dataclasses.replace(
          self, page_table_BM=self.page_table_BM[span], kv_lens_B=self.kv_lens_B[span],
          q_starts_B=self.q_starts_B[span], q_lens_B=self.q_lens_B[span], max_q=max_q,
          wide_rows=None, window_page_table_BM=None, window_slots_T=None,
          state_slots_B=None if self.state_slots_B is None else self.state_slots_B[span])

    return part(slice(None, self.wide_rows), self.max_q), part(slice(self.wide_rows, None), 1)

  def map_row_groups(self, attend_rows: Callable[['PagedBatch'], jax.Array],
                     num_tokens: int) -> jax.Array:
    """``[num_tokens, ...]``: ``attend_rows(group) -> [group rows, group.max_q, ...]`` run
    on each of :meth:`row_groups` and scattered back to the flat tokens (padding: zeros)."""
    out = None
    for group in self.row_groups():
      out = group.scatter_rows(attend_rows(group), num_tokens, into=out)
    return out

  def positions(self, num_tokens: int) -> jax.Array:
    """``[num_tokens]`` int32: each flat token's position in its request (0 for padding)."""
    def q_positions_BQ(group):
      offsets_Q = jnp.arange(group.max_q, dtype=jnp.int32)
      return (group.kv_lens_B - group.q_lens_B)[:, None] + offsets_Q[None]

    return self.map_row_groups(q_positions_BQ, num_tokens)

  def gather_pages(self, pages_PS: jax.Array, dtype=None) -> jax.Array:
    """``[num_pages, page_size, ...] -> [B, M * page_size, ...]``: each row's cache in order,
    in ``dtype`` when given. A :class:`~maxnnx.kernels.kv_quant.QuantizedPages` pool is
    gathered quantized, then dequantized (to ``dtype``, float32 by default): only the rows'
    pages are ever held as floats."""
    if isinstance(pages_PS, QuantizedPages):
      rows = pages_PS.gather(self.page_table_BM)
      values = rows.values.reshape((rows.values.shape[0], -1) + rows.values.shape[3:])
      scales = rows.scales.reshape((rows.scales.shape[0], -1) + rows.scales.shape[3:])
      return QuantizedPages(values, scales).dequantize(dtype or jnp.float32)
    rows = pages_PS[self.page_table_BM]
    rows = rows.reshape((rows.shape[0], -1) + pages_PS.shape[2:])
    return rows if dtype is None else rows.astype(dtype)

  def write(self, pages_PS, new_T: jax.Array):
    """``pages`` with token ``t``'s entry ``new_T[t]`` stored at slot ``slots_T[t]``; a
    :class:`~maxnnx.kernels.kv_quant.QuantizedPages` pool stores each token quantized with a
    scale of its own (the tokens already there keep theirs)."""
    if isinstance(pages_PS, QuantizedPages):
      values_T, scales_T = quantize_kv(new_T, QUANTIZED_KV_DTYPES[pages_PS.values.dtype])
      return QuantizedPages(self.write(pages_PS.values, values_T),
                            self.write(pages_PS.scales, scales_T))
    num_pages, page_size = pages_PS.shape[:2]
    flat = pages_PS.reshape((num_pages * page_size,) + pages_PS.shape[2:])
    flat = flat.at[self.slots_T].set(new_T.astype(pages_PS.dtype))
    return flat.reshape(pages_PS.shape)

  def row_mask(self, kv_length: int) -> AttentionMask:
    """The mask of :meth:`gather_rows` queries against :meth:`gather_pages` keys.

    Segment 1 marks real tokens and filled cache slots, 0 padding; positions
    follow the module docstring's rule, so causality and sliding windows apply
    as in any :class:`~maxnnx.kernels.masks.AttentionMask`.
    """
    _, valid_BQ = self._row_index()
    offsets_Q = jnp.arange(self.max_q, dtype=jnp.int32)
    q_positions_BQ = (self.kv_lens_B - self.q_lens_B)[:, None] + offsets_Q[None]
    kv_positions_S = jnp.arange(kv_length, dtype=jnp.int32)
    kv_valid_BS = kv_positions_S[None] < self.kv_lens_B[:, None]
    batch = self.kv_lens_B.shape[0]
    q_blocks_BQ = kv_blocks_BS = None
    if self.blocks_T is not None:  # this step's keys carry their queries' blocks
      q_blocks_BQ = jnp.where(valid_BQ, self.gather_rows(self.blocks_T), -1)
      first_B = self.kv_lens_B - self.q_lens_B
      offset_BS = kv_positions_S[None] - first_B[:, None]
      new_BS = (offset_BS >= 0) & kv_valid_BS
      kv_blocks_BS = jnp.where(new_BS, jnp.take_along_axis(
          q_blocks_BQ, jnp.clip(offset_BS, 0, self.max_q - 1), axis=1), -1)
    return AttentionMask(valid_BQ.astype(jnp.int32), q_positions_BQ,
                         kv_valid_BS.astype(jnp.int32),
                         jnp.broadcast_to(kv_positions_S, (batch, kv_length)),
                         q_blocks_BQ, kv_blocks_BS)


jax.tree_util.register_dataclass(
    PagedBatch, data_fields=['page_table_BM', 'kv_lens_B', 'q_starts_B', 'q_lens_B', 'slots_T',
                             'blocks_T', 'state_slots_B', 'window_page_table_BM',
                             'window_slots_T'],
    meta_fields=['max_q', 'wide_rows'])


@dataclasses.dataclass(frozen=True)
class PagedAttentionKernel(KernelStrategy):
  """Base class of paged-attention strategies; instances are stateless and hashable.

  A strategy declares :attr:`capabilities` and implements :meth:`attend`;
  ``__call__`` checks each call first and applies the ``on_unsupported`` policy
  (``fallback`` to the ``xla`` paged reference, or ``error``).
  """

  kind: ClassVar[str] = 'paged_attention'

  def __call__(self, q_TNH: jax.Array, k_pages_PSKH: jax.Array, v_pages_PSKH: jax.Array,
               batch: PagedBatch, options: AttentionOptions) -> jax.Array:
    """Attention output ``[T, heads, v_head_dim]`` of the flat tokens ``q_TNH``.

    The pages must already hold this step's keys and values (:meth:`PagedBatch.write`).
    Either pool may be a :class:`~maxnnx.kernels.kv_quant.QuantizedPages` (int8 or fp8
    pages and their scales), which a strategy serves when its capabilities list the pages'
    dtype in ``kv_dtypes``.
    Padding tokens' output is unspecified.
    """
    request = PagedAttentionRequest.of(q_TNH, k_pages_PSKH, v_pages_PSKH, options,
                                       blocks=batch.blocks_T is not None)
    return self.run_checked(request, self.attend, XlaPagedAttention().attend,
                            q_TNH, k_pages_PSKH, v_pages_PSKH, batch, options)

  @abc.abstractmethod
  def attend(self, q_TNH: jax.Array, k_pages_PSKH: jax.Array, v_pages_PSKH: jax.Array,
             batch: PagedBatch, options: AttentionOptions) -> jax.Array:
    """Compute paged attention for a call already checked against the capabilities."""


@dataclasses.dataclass(frozen=True)
class XlaPagedAttention(PagedAttentionKernel):
  """Reference: gather each row's pages, then the dense ``xla`` reference.

  Work and memory are those of dense attention over ``[B, max_q]`` queries and
  ``[B, M * page_size]`` keys (for each group of :meth:`PagedBatch.row_groups`),
  whatever the rows' real lengths.
  """

  name: str = 'xla'

  @property
  def capabilities(self) -> PagedAttentionCapabilities:
    """Everything, everywhere, int8 and fp8 pages included (dequantized on read)."""
    return PagedAttentionCapabilities(
        platforms=ALL_PLATFORMS, dtypes=FLOAT_DTYPES, gqa=True, sliding_window=True,
        traced_window=True, softcap=True, sinks=True, distinct_v_head_dim=True, chunked=True,
        blocks=True, kv_dtypes=('int8', 'float8_e4m3fn'))

  def attend(self, q_TNH, k_pages_PSKH, v_pages_PSKH, batch, options):
    """Rows of queries, contiguous keys per row, dense attention, back to flat tokens."""
    def attend_rows(group):
      k_BSKH = group.gather_pages(k_pages_PSKH, q_TNH.dtype)
      v_BSKH = group.gather_pages(v_pages_PSKH, q_TNH.dtype)
      return XlaAttention().attend(group.gather_rows(q_TNH), k_BSKH, v_BSKH,
                                   group.row_mask(k_BSKH.shape[1]), options)

    return batch.map_row_groups(attend_rows, q_TNH.shape[0])


PAGED_ATTENTION_IMPLEMENTATIONS: dict[str, Callable[[], PagedAttentionKernel]] = {
    'xla': XlaPagedAttention}


def register_paged_attention_kernel(name: str,
                                    factory: Callable[[], PagedAttentionKernel]) -> None:
  """Make ``factory`` available as ``ModelConfig.runtime.paged_attention_impl = name``."""
  PAGED_ATTENTION_IMPLEMENTATIONS[name] = factory


def get_paged_attention_kernel(name: str, *,
                               on_unsupported: str | None = None) -> PagedAttentionKernel:
  """The paged strategy registered as ``name``; ``on_unsupported`` overrides its policy."""
  return lookup_kernel(PAGED_ATTENTION_IMPLEMENTATIONS, 'paged_attention', name, on_unsupported)

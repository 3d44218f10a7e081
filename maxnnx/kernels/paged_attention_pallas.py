"""A Pallas (Triton) paged-attention kernel that reads the page pool in place.

``pallas_gpu`` serves every row of an engine step, decode rows and prefill chunks alike,
without gathering each row's pages into a contiguous copy as the ``xla`` reference does.
One program per (row, key/value head) holds the row's queries of that head group,
``[max_q * groups, head_dim]`` (``max_q`` of the row's group: :meth:`PagedBatch.row_groups`,
one kernel call per group), and walks the row's block table a few pages at a time:
it loads those pages of the pool ``[num_pages, page_size, kv_heads, head_dim]`` by their
ids, masks keys past the row's length, after each query's position (causal), outside a
static sliding window or chunk, applies the soft-cap, and keeps an online softmax in
float32. Blocks entirely behind a sliding window are skipped. Work per row follows its
length, not the batch's longest row.

Not served (the call falls back to ``xla``, or raises under ``on_unsupported='error'``):
attention sinks, traced (per-layer array) windows or chunks, image blocks, a ``v`` head
size different from the key's, page sizes below 16 or head sizes that are not a power of
two of at least 16 (Triton's dot tiles). ``interpret=True`` runs the same kernel in the
Pallas interpreter on any platform (slow; how it is tested without a GPU).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from maxnnx.kernels.capabilities import ALL_PLATFORMS, FLOAT_DTYPES, PagedAttentionCapabilities
from maxnnx.kernels.paged_attention import (
  PagedAttentionKernel,
  PagedBatch,
  register_paged_attention_kernel,
)

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
_MIN_TILE = 16  # Triton's smallest dot tile


def _power_of_two_at_least(n: int, floor: int) -> int:
  return max(floor, 1 << max(n - 1, 0).bit_length())


def _paged_kernel(q_ref, k_ref, v_ref, table_ref, kv_len_ref, q_len_ref, o_ref, *,
                  scale: float, softcap: float | None, window: int | None,
                  chunk: int | None, groups: int, pages_per_block: int):
  """One (row, kv head): ``q_ref [QG, H]`` (query token ``r // groups``, head
  ``r % groups`` of the group), ``k_ref``/``v_ref`` ``[P, S, H]`` (this head's slice of the
  pool), ``table_ref [M]`` the row's pages; writes ``o_ref [QG, H]``."""
  rows, head_dim = q_ref.shape
  page_size = k_ref.shape[1]
  block_k = pages_per_block * page_size
  kv_len, q_len = kv_len_ref[0], q_len_ref[0]
  token_R = jnp.arange(rows, dtype=jnp.int32) // groups
  q_pos_R = kv_len - q_len + token_R
  q = q_ref[...]

  def body(block, carry):
    o_RH, m_R, l_R = carry
    pages = table_ref[pl.ds(block * pages_per_block, pages_per_block)]
    k_KH = k_ref[pages].reshape(block_k, head_dim)
    v_KH = v_ref[pages].reshape(block_k, head_dim)
    s_RK = plgpu.dot(q, k_KH.T).astype(jnp.float32) * scale
    if softcap is not None:
      s_RK = softcap * jnp.tanh(s_RK / softcap)
    k_pos_K = block * block_k + jnp.arange(block_k, dtype=jnp.int32)
    allowed = (k_pos_K[None] < kv_len) & (k_pos_K[None] <= q_pos_R[:, None])
    allowed &= (token_R < q_len)[:, None]
    if window is not None:
      allowed &= q_pos_R[:, None] - k_pos_K[None] < window
    if chunk is not None:
      allowed &= q_pos_R[:, None] // chunk == k_pos_K[None] // chunk
    s_RK = jnp.where(allowed, s_RK, _MASKED)
    m_next = jnp.maximum(m_R, s_RK.max(axis=-1))
    correction = jnp.exp(m_R - m_next)
    p_RK = jnp.where(allowed, jnp.exp(s_RK - m_next[:, None]), 0.0)
    l_next = correction * l_R + p_RK.sum(axis=-1)
    o_next = correction[:, None] * o_RH + plgpu.dot(p_RK.astype(v_KH.dtype), v_KH).astype(
        jnp.float32)
    return o_next, m_next, l_next

  end = pl.cdiv(kv_len, block_k)
  start = 0
  if window is not None:  # blocks wholly behind every query's window hold nothing visible
    start = jnp.maximum(kv_len - q_len - window + 1, 0) // block_k
  init = (jnp.zeros((rows, head_dim), jnp.float32),
          jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32))
  o_RH, _, l_R = lax.fori_loop(start, end, body, init)
  o_ref[...] = (o_RH / jnp.where(l_R > 0, l_R, 1.0)[:, None]).astype(o_ref.dtype)


@dataclasses.dataclass(frozen=True)
class PallasPagedAttention(PagedAttentionKernel):
  """Paged attention over the pool in place (see the module docstring).

  Attributes:
    pages_per_block: pages loaded together per loop step (``* page_size`` keys).
    num_warps, num_stages: Triton launch settings.
    interpret: run in the Pallas interpreter (any platform, slow).
  """

  name: str = 'pallas_gpu'
  pages_per_block: int = 4
  num_warps: int = 4
  num_stages: int = 2
  interpret: bool = False

  @property
  def capabilities(self) -> PagedAttentionCapabilities:
    """GQA, static windows and chunks, soft-caps; GPU (or the interpreter)."""
    return PagedAttentionCapabilities(
        platforms=ALL_PLATFORMS if self.interpret else ('gpu',), dtypes=FLOAT_DTYPES,
        gqa=True, sliding_window=True, traced_window=False, softcap=True, sinks=False,
        distinct_v_head_dim=False, chunked=True, blocks=False, kv_dtypes=())

  def unsupported_reasons(self, request):
    """The declared limits, traced chunks, and Triton's tile sizes."""
    reasons = self.capabilities.missing(request)
    if request.page_size < _MIN_TILE:
      reasons.append(f'page_size {request.page_size} is below {_MIN_TILE}')
    if request.head_dim < _MIN_TILE or request.head_dim & (request.head_dim - 1):
      reasons.append(f'head size {request.head_dim} is not a power of two >= {_MIN_TILE}')
    return reasons

  def attend(self, q_TNH, k_pages_PSKH, v_pages_PSKH, batch: PagedBatch, options):
    """Group each row's queries by kv head, run the kernel per (row, kv head), scatter back."""
    if options.chunk_size is not None and not isinstance(options.chunk_size, int):
      raise NotImplementedError('traced (per-layer array) chunk sizes')
    num_tokens, num_heads, head_dim = q_TNH.shape
    num_pages, page_size, num_kv_heads, _ = k_pages_PSKH.shape
    groups = num_heads // num_kv_heads
    per_block = self.pages_per_block
    kernel = functools.partial(
        _paged_kernel, scale=float(options.scale), softcap=options.softcap,
        window=options.sliding_window, chunk=options.chunk_size, groups=groups,
        pages_per_block=per_block)
    pool_spec = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda b, k: (0, 0, k, 0))

    def attend_rows(group: PagedBatch):
      rows_B, max_q = group.kv_lens_B.shape[0], group.max_q
      q_BQNH = group.gather_rows(q_TNH)
      q_BKRH = q_BQNH.reshape(rows_B, max_q, num_kv_heads, groups, head_dim).transpose(
          0, 2, 1, 3, 4).reshape(rows_B, num_kv_heads, max_q * groups, head_dim)
      width = _power_of_two_at_least(max_q * groups, _MIN_TILE)
      q_BKRH = jnp.pad(q_BKRH, ((0, 0), (0, 0), (0, width - max_q * groups), (0, 0)))
      table_BM = group.page_table_BM
      padded = -(-table_BM.shape[1] // per_block) * per_block
      table_BM = jnp.pad(table_BM, ((0, 0), (0, padded - table_BM.shape[1])))
      out_BKRH = pl.pallas_call(
          kernel,
          grid=(rows_B, num_kv_heads),
          in_specs=[pl.BlockSpec((None, None, width, head_dim), lambda b, k: (b, k, 0, 0)),
                    pool_spec, pool_spec,
                    pl.BlockSpec((None, padded), lambda b, k: (b, 0)),
                    pl.BlockSpec((1,), lambda b, k: (b,)),
                    pl.BlockSpec((1,), lambda b, k: (b,))],
          out_specs=pl.BlockSpec((None, None, width, head_dim), lambda b, k: (b, k, 0, 0)),
          out_shape=jax.ShapeDtypeStruct(q_BKRH.shape, q_TNH.dtype),
          compiler_params=plgpu.CompilerParams(num_warps=self.num_warps,
                                               num_stages=self.num_stages),
          interpret=self.interpret,
          name=f'paged_attention_{page_size=}_{per_block=}',
      )(q_BKRH, k_pages_PSKH, v_pages_PSKH.astype(k_pages_PSKH.dtype), table_BM,
        group.kv_lens_B, group.q_lens_B)
      return out_BKRH[:, :, :max_q * groups].reshape(
          rows_B, num_kv_heads, max_q, groups, head_dim).transpose(0, 2, 1, 3, 4).reshape(
          rows_B, max_q, num_heads, head_dim)

    return batch.map_row_groups(attend_rows, num_tokens)


register_paged_attention_kernel('pallas_gpu', PallasPagedAttention)

"""Blockwise causal attention in plain XLA (``xla_flash``): skips masked key blocks everywhere.

The ``xla`` reference forms every query-key score, lets autodiff keep the
softmax for the backward pass and masks half of the work away afterwards. This
strategy computes the same function as flash attention does, in plain XLA:

* the queries are cut into at most ``max_blocks`` blocks of about
  ``block_size`` rows, and each block is scored only against the keys that can
  be visible to it (keys up to its last row; with a static sliding window, from
  its first row minus the window), so a causal training step does
  ``(n + 1) / 2n`` of the score work for ``n`` blocks;
* a ``custom_vjp`` keeps only the output and the log-sum-exp of each row and
  recomputes the probabilities in the backward pass (no ``[B, H, T, S]``
  residual), with the ``D = rowsum(dO * O)`` shortcut of flash attention.

Skipping blocks by index is right only while no query sees a key beyond its
block's range. The kernel checks, at run time and in O(B·T) from the mask's
segment ids and positions (:func:`~maxnnx.kernels.masks.index_order_matches_positions`),
a condition that implies it: queries and keys share segment ids and positions,
and along each row's non-padding tokens segment ids never decrease and positions
strictly increase inside a segment, so a visible key (same segment, position not
after the query's) is never after the query by index; with a static window or
chunk of ``W``, positions must also rise by at least the index distance between
neighbouring tokens of a segment, so a key fewer than ``W`` positions back is
fewer than ``W`` indices back (the plan's first key). Plain, packed and
left-padded rows pass. Where the check fails (context-parallel load balancing
reorders tokens, user positions out of order, padding inside a windowed
document), the kernel scores each of the same query blocks against all keys, in
a loop (one block's scores alive at a time):
the answer is never wrong, only slower. Either way no buffer holds a score per
head for every query-key pair (``[B, H, T, S]`` float32, 8 GiB at 128 heads and
4,096 tokens, which the compiled step would reserve even where the check
passes): the largest is one block's ``[B, H, T / n, S]``. Nor is the mask ever
whole: each block's ``[B, T / n, S]`` part is built from the segment ids and
positions where it is used (a ``[B, T, S]`` bool is 16 MiB a row at 4,096
tokens); only an extra ``key_mask_BTS`` the caller passes is dense. Decoding
(queries shorter than the cache) takes one block over all keys. Where the length does not
split evenly, the fallback pads the queries to the largest block's rows with rows in
segment 0 (they see no key, get a zero output gradient, and are cut off), so it loops too.

For QK-clip, :meth:`BlockwiseAttention.attend_and_max_logits` also returns each head's
largest visible logit ``scale * q . k`` (before the soft-cap), a masked max over the scores
each block forms anyway, so recording it needs no dense mask or score pass either.

Everything ``xla`` supports is supported: GQA/MQA, packed and padded rows,
static and traced sliding windows, chunked attention (a static chunk bounds the
keys a block scores like a window does), soft-capping, sinks, a ``v`` head size of
its own. Query rows that see no key get the mean of the values in their range
(``xla``: of all values); both are unspecified outputs of padding rows.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxnnx.kernels.attention import AttentionKernel, XlaAttention, register_attention_kernel
from maxnnx.kernels.capabilities import AttentionRequest
from maxnnx.kernels.masks import AttentionMask, index_order_matches_positions

_NEG = float(jnp.finfo(jnp.float32).min)

#: One block's rows and keys: ``(q_start, q_end, k_start, k_end)``.
Block = tuple[int, int, int, int]


def block_plan(q_length: int, kv_length: int, *, block_size: int, max_blocks: int,
               window: int | None) -> tuple[Block, ...]:
  """The query blocks and the key range each one scores; one full block when nothing skips.

  Queries and keys must be the same sequence (``q_length == kv_length``) for a
  block to skip anything; a static ``window`` also drops the keys more than
  ``window - 1`` rows before a block's first query.
  """
  full = ((0, q_length, 0, kv_length),)
  if q_length != kv_length or q_length < 2 * block_size:
    return full
  num_blocks = min(max_blocks, q_length // block_size)
  edges = [round(i * q_length / num_blocks) for i in range(num_blocks + 1)]
  plan = []
  for start, end in zip(edges[:-1], edges[1:]):
    key_start = 0 if window is None else max(0, start - window + 1)
    plan.append((start, end, key_start, end))
  return tuple(plan)


def all_keys(plan: tuple[Block, ...], kv_length: int) -> tuple[Block, ...]:
  """The plan's query blocks, each scoring every key: the fallback when skipping is unsafe.

  Cutting the queries keeps its largest score buffer at one block's rows, as the
  skipping plan's; one block of all rows would be ``[B, H, T, S]``.
  """
  return tuple((q_start, q_end, 0, kv_length) for q_start, q_end, _, _ in plan)


def covered_by(plan: tuple[Block, ...], q_length: int, kv_length: int) -> np.ndarray:
  """``[T, S]`` bool: the query-key pairs the plan scores (for tests and inspection)."""
  key_start_T, key_end_T = _key_range(plan, q_length)
  keys_S = np.arange(kv_length)
  return (keys_S >= key_start_T[:, None]) & (keys_S < key_end_T[:, None])


def _key_range(plan: tuple[Block, ...], q_length: int) -> tuple[np.ndarray, np.ndarray]:
  """Per query row, the first key and one past the last key its block scores (``[T]`` each)."""
  key_start_T, key_end_T = np.zeros(q_length, np.int32), np.zeros(q_length, np.int32)
  for q_start, q_end, k_start, k_end in plan:
    key_start_T[q_start:q_end], key_end_T[q_start:q_end] = k_start, k_end
  return key_start_T, key_end_T


def _visible(vis, rows, keys):
  """``[B, t, s]`` bool: which keys of ``keys`` (a slice) the queries ``rows`` (a slice) see.

  ``vis`` is ``(mask, sliding_window, chunk_size, key_mask_BTS)``: the mask is
  built per block from the segment ids and positions, never whole.
  """
  mask, window, chunk, key_mask_BTS = vis
  q_blocks, kv_blocks = mask.q_blocks, mask.kv_blocks
  part = AttentionMask(mask.q_segment_ids[:, rows], mask.q_positions[:, rows],
                       mask.kv_segment_ids[:, keys], mask.kv_positions[:, keys],
                       None if q_blocks is None else q_blocks[:, rows],
                       None if kv_blocks is None else kv_blocks[:, keys])
  allowed_Bts = part.dense(window, chunk)
  return allowed_Bts if key_mask_BTS is None else allowed_Bts & key_mask_BTS[:, rows, keys]


def _query_parts(vis):
  """The per-query arrays of ``vis`` (segment ids, positions, image blocks, key mask)."""
  mask, _, _, key_mask_BTS = vis
  return mask.q_segment_ids, mask.q_positions, mask.q_blocks, key_mask_BTS


def _with_query_parts(vis, parts):
  """``vis`` with its per-query arrays replaced by ``parts`` (one block's, in a loop)."""
  mask, window, chunk, _ = vis
  seg, pos, blocks, key_mask_BTS = parts
  mask = dataclasses.replace(mask, q_segment_ids=seg, q_positions=pos, q_blocks=blocks)
  return mask, window, chunk, key_mask_BTS


def _scores(q_BKGtH, k_BKsH, allowed_Bts, scale, softcap, track=False):
  """Masked float32 scores of one block, ``tanh`` of the soft-cap (``None`` without it) and,
  with ``track``, each head's largest visible logit before the soft-cap (``[K, G]``, ``-inf``
  where the block sees nothing; else ``None``)."""
  raw = jnp.einsum('bkgth,bksh->bkgts', q_BKGtH, k_BKsH,
                   preferred_element_type=jnp.float32) * scale
  top_KG = None
  if track:
    top_KG = jnp.max(jnp.where(allowed_Bts[:, None, None], raw, -jnp.inf), axis=(0, 3, 4))
  tanh = None
  if softcap is not None:
    tanh = jnp.tanh(raw / softcap)
    raw = softcap * tanh
  return jnp.where(allowed_Bts[:, None, None], raw, _NEG), tanh, top_KG


def _forward(q_BKGTH, k_BKSH, v_BKSV, vis, sinks_KG, scale, softcap, plan, track=False):
  """Output ``[B, K, G, T, V]``, log-sum-exp ``[B, K, G, T, 1]`` (float32) of a plan and, with
  ``track``, each head's largest visible logit ``[K, G]`` (else ``None``)."""
  outs, lses, tops = [], [], []
  for q_start, q_end, k_start, k_end in plan:
    s, _, top_KG = _scores(q_BKGTH[:, :, :, q_start:q_end], k_BKSH[:, :, k_start:k_end],
                           _visible(vis, slice(q_start, q_end), slice(k_start, k_end)), scale,
                           softcap, track)
    tops.append(top_KG)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks_KG is not None:
      m = jnp.maximum(m, sinks_KG[None, :, :, None, None])
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=-1, keepdims=True)
    if sinks_KG is not None:
      total += jnp.exp(sinks_KG[None, :, :, None, None] - m)
    o = jnp.einsum('bkgts,bksv->bkgtv', p.astype(v_BKSV.dtype), v_BKSV[:, :, k_start:k_end],
                   preferred_element_type=jnp.float32)
    outs.append((o / total).astype(v_BKSV.dtype))
    lses.append(m + jnp.log(total))
  top_KG = functools.reduce(jnp.maximum, tops) if track else None
  return jnp.concatenate(outs, axis=3), jnp.concatenate(lses, axis=3), top_KG


def _backward(q_BKGTH, k_BKSH, v_BKSV, vis, sinks_KG, out_BKGTV, lse_BKGT1, dout_BKGTV,
              scale, softcap, plan):
  """Gradients of q, k, v and the sinks, recomputing each block's probabilities."""
  dq, dk, dv, dsinks = _backward_f32(q_BKGTH, k_BKSH, v_BKSV, vis, sinks_KG, out_BKGTV,
                                     lse_BKGT1, dout_BKGTV, scale, softcap, plan)
  return (dq, dk.astype(k_BKSH.dtype), dv.astype(v_BKSV.dtype),
          None if dsinks is None else dsinks.astype(sinks_KG.dtype))


def _backward_f32(q_BKGTH, k_BKSH, v_BKSV, vis, sinks_KG, out_BKGTV, lse_BKGT1,
                  dout_BKGTV, scale, softcap, plan):
  """:func:`_backward` with the key, value and sink gradients left in float32."""
  delta_BKGT1 = jnp.sum(dout_BKGTV.astype(jnp.float32) * out_BKGTV.astype(jnp.float32),
                        axis=-1, keepdims=True)
  dk = jnp.zeros(k_BKSH.shape, jnp.float32)
  dv = jnp.zeros(v_BKSV.shape, jnp.float32)
  dqs = []
  for q_start, q_end, k_start, k_end in plan:
    rows, keys = slice(q_start, q_end), slice(k_start, k_end)
    q_blk, dout_blk = q_BKGTH[:, :, :, rows], dout_BKGTV[:, :, :, rows]
    s, tanh, _ = _scores(q_blk, k_BKSH[:, :, keys], _visible(vis, rows, keys), scale,
                         softcap)
    p = jnp.exp(s - lse_BKGT1[:, :, :, rows])
    dv = dv.at[:, :, keys].add(jnp.einsum('bkgts,bkgtv->bksv', p.astype(dout_blk.dtype),
                                          dout_blk, preferred_element_type=jnp.float32))
    dp = jnp.einsum('bkgtv,bksv->bkgts', dout_blk, v_BKSV[:, :, keys],
                    preferred_element_type=jnp.float32)
    ds = p * (dp - delta_BKGT1[:, :, :, rows])
    if tanh is not None:
      ds *= 1.0 - tanh * tanh
    ds = (ds * scale).astype(q_BKGTH.dtype)
    dqs.append(jnp.einsum('bkgts,bksh->bkgth', ds, k_BKSH[:, :, keys],
                          preferred_element_type=jnp.float32).astype(q_BKGTH.dtype))
    dk = dk.at[:, :, keys].add(jnp.einsum('bkgts,bkgth->bksh', ds, q_blk,
                                          preferred_element_type=jnp.float32))
  dsinks = None
  if sinks_KG is not None:
    # The sink takes probability exp(sink - lse) and gives nothing: d out / d sink = -p_sink out.
    p_sink = jnp.exp(sinks_KG[None, :, :, None, None] - lse_BKGT1)
    dsinks = -jnp.sum(p_sink * delta_BKGT1, axis=(0, 3, 4))
  return jnp.concatenate(dqs, axis=3), dk, dv, dsinks


def _loop_rows(plan: tuple[Block, ...], kv_length: int) -> int | None:
  """Rows per looped block when the plan is two or more query blocks over all keys (its
  largest block's: uneven blocks are padded to it), else None."""
  if len(plan) < 2 or plan != all_keys(plan, kv_length):
    return None
  return max(q_end - q_start for q_start, q_end, _, _ in plan)


def _pad_rows(x, length, axis, value=0):
  """``x`` with ``axis`` padded with ``value`` at the end to ``length`` (unchanged if there)."""
  if x is None or x.shape[axis] == length:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _padded_query_blocks(vis, rows, num_blocks):
  """The per-query arrays of ``vis`` padded to ``rows * num_blocks`` queries (padding rows are
  in segment 0, so they see no key) and cut into blocks of ``rows``, the block index first."""
  seg, pos, blocks, key_mask_BTS = _query_parts(vis)
  length = rows * num_blocks
  parts = (_pad_rows(seg, length, 1), _pad_rows(pos, length, 1),
           _pad_rows(blocks, length, 1, -1), _pad_rows(key_mask_BTS, length, 1, False))
  return jax.tree.map(lambda x: _blocks_first(x, rows, 1), parts)


def _blocks_first(x, rows, axis):
  """``x`` with ``axis`` cut into blocks of ``rows``, the block index moved to the front."""
  x = x.reshape(x.shape[:axis] + (x.shape[axis] // rows, rows) + x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _blocks_back(x, axis, length):
  """Undo :func:`_blocks_first`: the leading block index joins ``axis`` again, cut back to
  ``length`` rows (dropping the padding)."""
  x = jnp.moveaxis(x, 0, axis)
  x = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
  return jax.lax.slice_in_dim(x, 0, length, axis=axis)


def _forward_in_turn(q_BKGTH, k_BKSH, v_BKSV, vis, sinks_KG, scale, softcap, track, plan):
  """:func:`_forward`; query blocks over all keys run in a loop, so one block's scores are
  alive at a time (unrolled, XLA may keep every block's at once). Uneven blocks are padded
  to the largest with rows that see no key, which the result drops."""
  length = q_BKGTH.shape[3]
  rows = _loop_rows(plan, k_BKSH.shape[2])
  if rows is None:
    return _forward(q_BKGTH, k_BKSH, v_BKSV, vis, sinks_KG, scale, softcap, plan, track)
  one = ((0, rows, 0, k_BKSH.shape[2]),)
  q_blocks = _blocks_first(_pad_rows(q_BKGTH, rows * len(plan), 3), rows, 3)
  out, lse, top = jax.lax.map(
      lambda xs: _forward(xs[0], k_BKSH, v_BKSV, _with_query_parts(vis, xs[1]), sinks_KG, scale,
                          softcap, one, track),
      (q_blocks, _padded_query_blocks(vis, rows, len(plan))))
  top_KG = None if top is None else jnp.max(top, axis=0)
  return _blocks_back(out, 3, length), _blocks_back(lse, 3, length), top_KG


def _backward_in_turn(q_BKGTH, k_BKSH, v_BKSV, vis, sinks_KG, out_BKGTV, lse_BKGT1,
                      dout_BKGTV, scale, softcap, plan):
  """:func:`_backward`, looping over query blocks over all keys like :func:`_forward_in_turn`
  (padding rows get a zero output gradient, so they add nothing to any gradient)."""
  length = q_BKGTH.shape[3]
  rows = _loop_rows(plan, k_BKSH.shape[2])
  if rows is None:
    return _backward(q_BKGTH, k_BKSH, v_BKSV, vis, sinks_KG, out_BKGTV, lse_BKGT1,
                     dout_BKGTV, scale, softcap, plan)
  one = ((0, rows, 0, k_BKSH.shape[2]),)

  def step(carry, xs):
    q_blk, parts, out_blk, lse_blk, dout_blk = xs
    dq, dk, dv, dsinks = _backward_f32(q_blk, k_BKSH, v_BKSV, _with_query_parts(vis, parts),
                                       sinks_KG, out_blk, lse_blk, dout_blk, scale, softcap, one)
    total = (carry[0] + dk, carry[1] + dv, None if dsinks is None else carry[2] + dsinks)
    return total, dq

  init = (jnp.zeros(k_BKSH.shape, jnp.float32), jnp.zeros(v_BKSV.shape, jnp.float32),
          None if sinks_KG is None else jnp.zeros(sinks_KG.shape, jnp.float32))
  cut = lambda x: _blocks_first(_pad_rows(x, rows * len(plan), 3), rows, 3)  # noqa: E731
  xs = (cut(q_BKGTH), _padded_query_blocks(vis, rows, len(plan)), cut(out_BKGTV),
        cut(lse_BKGT1), cut(dout_BKGTV))
  (dk, dv, dsinks), dq = jax.lax.scan(step, init, xs)
  return (_blocks_back(dq, 3, length), dk.astype(k_BKSH.dtype), dv.astype(v_BKSV.dtype),
          None if dsinks is None else dsinks.astype(sinks_KG.dtype))


def _choose(skip_ok, skipping, full):
  """``skipping()`` where the check passed, ``full()`` (every key) otherwise; only one runs."""
  if skip_ok is None:
    return full()
  return jax.lax.cond(skip_ok, skipping, full)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _attention(q, k, v, vis, sinks, skip_ok, scale, softcap, track, plan, full_plan):
  """Output and, with ``track``, each head's largest visible logit (no gradient flows
  through it), else ``None``."""
  outs, _ = _attention_fwd(q, k, v, vis, sinks, skip_ok, scale, softcap, track, plan,
                           full_plan)
  return outs


def _attention_fwd(q, k, v, vis, sinks, skip_ok, scale, softcap, track, plan, full_plan):
  run = functools.partial(_forward_in_turn, q, k, v, vis, sinks, scale, softcap, track)
  out, lse, top = _choose(skip_ok, lambda: run(plan), lambda: run(full_plan))
  return (out, top), (q, k, v, vis, sinks, skip_ok, out, lse)


def _attention_bwd(scale, softcap, track, plan, full_plan, residuals, cotangents):
  q, k, v, vis, sinks, skip_ok, out, lse = residuals
  dout = cotangents[0]  # the max logits are a statistic: their cotangent is dropped
  run = functools.partial(_backward_in_turn, q, k, v, vis, sinks, out, lse, dout, scale,
                          softcap)
  dq, dk, dv, dsinks = _choose(skip_ok, lambda: run(plan), lambda: run(full_plan))
  return dq, dk, dv, None, dsinks, None


_attention.defvjp(_attention_fwd, _attention_bwd)


@dataclasses.dataclass(frozen=True)
class BlockwiseAttention(AttentionKernel):
  """Flash-style attention in plain XLA: causal block skipping and a recomputing backward.

  Attributes:
    block_size: target rows per query block (smaller blocks skip more but run
      smaller matmuls; 128 is fastest on CPU for sequences of 512).
    max_blocks: the most query blocks (bounds the unrolled graph for long
      sequences; blocks grow beyond ``block_size`` instead).
  """

  name: str = 'xla_flash'
  block_size: int = 128
  max_blocks: int = 8

  def __post_init__(self):
    super().__post_init__()
    if self.block_size < 1 or self.max_blocks < 1:
      raise ValueError(f'block_size and max_blocks must be >= 1, got {self.block_size} and '
                       f'{self.max_blocks}.')

  @property
  def capabilities(self):
    """The same as ``xla`` but image blocks (it skips key blocks after the query block)."""
    return dataclasses.replace(XlaAttention().capabilities, blocks=False)

  def attend(self, q_BTNH, k_BSKH, v_BSKH, mask, options):
    """Skip the key blocks no query of a block can see (checked at run time), then attend."""
    return self._blockwise(q_BTNH, k_BSKH, v_BSKH, mask, options, track=False)[0]

  def attend_and_max_logits(self, q_BTNH, k_BSKH, v_BSKH, mask, options):
    """The output and each head's largest visible logit, taken from the same blocks' scores
    (no dense mask or score pass); a call this strategy cannot serve gets ``xla``'s output
    and ``None`` (or the policy's error)."""
    return self.run_checked(AttentionRequest.of(q_BTNH, k_BSKH, v_BSKH, options, mask),
                            functools.partial(self._blockwise, track=True),
                            lambda *args: (XlaAttention().attend(*args), None),
                            q_BTNH, k_BSKH, v_BSKH, mask, options)

  def _blockwise(self, q_BTNH, k_BSKH, v_BSKH, mask, options, track):
    """Output ``[B, T, N, V]`` and, with ``track``, the per-head max logits ``[N]`` (else
    ``None``)."""
    scale, softcap, sinks_N = options.scale, options.softcap, options.sinks_N
    sliding_window = options.sliding_window
    batch, length, num_heads, head_dim = q_BTNH.shape
    kv_length, num_kv_heads = k_BSKH.shape[1], k_BSKH.shape[2]
    groups = num_heads // num_kv_heads
    q_BKGTH = q_BTNH.reshape(batch, length, num_kv_heads, groups, head_dim).transpose(
        0, 2, 3, 1, 4)
    k_BKSH, v_BKSV = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)
    # A chunk of C positions bounds the look-back like a window of C does.
    bounds = [b for b in (sliding_window, options.chunk_size) if isinstance(b, int | np.integer)]
    static_window = min(bounds) if bounds else None
    plan = block_plan(length, kv_length, block_size=self.block_size,
                      max_blocks=self.max_blocks, window=static_window)
    full_plan = all_keys(plan, kv_length)
    skip_ok = None
    if plan != full_plan and mask.q_blocks is None:
      # O(B T) from the segment ids and positions: see the module docstring.
      skip_ok = index_order_matches_positions(mask, step_per_index=static_window is not None)
    vis = (mask, options.sliding_window, options.chunk_size, options.key_mask_BTS)
    sinks_KG = (None if sinks_N is None
                else sinks_N.astype(jnp.float32).reshape(num_kv_heads, groups))
    out_BKGTV, top_KG = _attention(q_BKGTH, k_BKSH, v_BKSV, vis, sinks_KG, skip_ok, scale,
                                   softcap, track, plan, full_plan)
    out_BTNV = out_BKGTV.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads, -1)
    return out_BTNV, None if top_KG is None else jax.lax.stop_gradient(top_KG.reshape(-1))


register_attention_kernel('xla_flash', BlockwiseAttention)

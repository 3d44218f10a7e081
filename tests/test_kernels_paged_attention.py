"""Paged attention: the xla strategy against dense attention, the registry and policy, and
the layers' paged path against a plain forward pass."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.kernels import (
  AttentionMask,
  AttentionOptions,
  KernelUnsupportedError,
  PagedAttentionCapabilities,
  PagedBatch,
  XlaAttention,
  XlaPagedAttention,
  get_kernel,
  register_paged_attention_kernel,
)
from maxnnx.kernels.capabilities import reset_warnings
from maxnnx.kernels.paged_attention import PAGED_ATTENTION_IMPLEMENTATIONS

PAGE = 4


def _layout(rows, num_pages, rng, wide_rows=None):
  """Pages, slots and a PagedBatch for rows of ``(cached, new)`` token counts."""
  free = list(rng.permutation(np.arange(1, num_pages)))
  page_table = np.zeros((len(rows) + 1, 8), np.int32)  # one empty row
  kv_lens, q_starts, q_lens, slots = [], [], [], []
  for b, (cached, new) in enumerate(rows):
    total = cached + new
    pages = [free.pop() for _ in range(-(-total // PAGE))]
    page_table[b, :len(pages)] = pages
    pos = np.arange(cached, total)
    q_starts.append(len(slots))
    slots.extend(np.asarray(pages)[pos // PAGE] * PAGE + pos % PAGE)
    kv_lens.append(total)
    q_lens.append(new)
  pad = 3  # padding tokens write to scratch page 0
  slots = np.asarray(slots + [0] * pad, np.int32)
  batch = PagedBatch(jnp.asarray(page_table), jnp.asarray(kv_lens + [0], jnp.int32),
                     jnp.asarray(q_starts + [0], jnp.int32), jnp.asarray(q_lens + [0], jnp.int32),
                     jnp.asarray(slots), max(q_lens), wide_rows=wide_rows)
  return batch, page_table


@pytest.mark.parametrize('wide_rows', [None, 2], ids=['all_wide', 'two_wide'])
@pytest.mark.parametrize('features', [
    {}, {'window': 3}, {'softcap': 2.0}, {'sinks': True}, {'v_dim': 6},
    {'window': jnp.asarray(4), 'softcap': 3.0}], ids=['plain', 'window', 'softcap', 'sinks',
                                                      'v_head_dim', 'traced_window_softcap'])
def test_xla_paged_equals_dense_attention_per_row(features, wide_rows):
  """Each row's tokens attend over its pages as dense attention over its whole sequence,
  whether every row is gathered max_q wide or only the first two (the decode row and the
  empty row one wide)."""
  rng = np.random.default_rng(0)
  heads, kv_heads, head_dim = 4, 2, 8
  v_dim = features.get('v_dim', head_dim)
  rows = [(0, 7), (9, 3), (5, 1)]  # (cached, new): prefill, chunk, decode
  batch, page_table = _layout(rows, 12, rng, wide_rows)
  assert len(batch.row_groups()) == (1 if wide_rows is None else 2)
  seqs = [(rng.normal(size=(c + n, kv_heads, head_dim)), rng.normal(size=(c + n, kv_heads, v_dim)),
           rng.normal(size=(c + n, heads, head_dim))) for c, n in rows]
  k_pages = np.zeros((12, PAGE, kv_heads, head_dim), np.float32)
  v_pages = np.zeros((12, PAGE, kv_heads, v_dim), np.float32)
  q_T = []
  slots = np.asarray(batch.slots_T)
  start = 0
  for row, ((cached, new), (k, v, q)) in enumerate(zip(rows, seqs)):
    # Every position of the row lands in its page slot (the cached ones as if written before).
    pos = np.arange(cached + new)
    flat = page_table[row, pos // PAGE] * PAGE + pos % PAGE
    np.testing.assert_array_equal(flat[cached:], slots[start:start + new])
    k_pages.reshape(-1, kv_heads, head_dim)[flat] = k
    v_pages.reshape(-1, kv_heads, v_dim)[flat] = v
    q_T.extend(q[cached:])
    start += new
  q_T = np.concatenate([np.asarray(q_T), rng.normal(size=(3, heads, head_dim))]).astype(np.float32)
  sinks = jnp.asarray(rng.normal(size=heads), jnp.float32) if features.get('sinks') else None
  options = AttentionOptions(scale=0.3, softcap=features.get('softcap'),
                             sliding_window=features.get('window'), sinks_N=sinks)
  paged = jax.jit(lambda q, k, v, batch: XlaPagedAttention()(q, k, v, batch, options))
  out = paged(jnp.asarray(q_T), jnp.asarray(k_pages), jnp.asarray(v_pages), batch)
  dense = jax.jit(lambda q, k, v, mask: XlaAttention().attend(q, k, v, mask, options))
  start = 0
  for (cached, new), (k, v, q) in zip(rows, seqs):
    pos = jnp.arange(cached + new)[None]
    mask = AttentionMask(jnp.ones((1, new), jnp.int32), pos[:, cached:], jnp.ones_like(pos), pos)
    want = dense(jnp.asarray(q[None, cached:], jnp.float32), jnp.asarray(k[None], jnp.float32),
                 jnp.asarray(v[None], jnp.float32), mask)
    np.testing.assert_allclose(out[start:start + new], want[0], atol=1e-5, rtol=1e-5)
    start += new


def test_write_puts_each_token_in_its_slot():
  """PagedBatch.write scatters token rows into the flat slots and leaves the rest."""
  pages = jnp.zeros((3, 2, 1))
  batch = PagedBatch(jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32),
                     jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.asarray([5, 2]), 1)
  out = batch.write(pages, jnp.asarray([[7.0], [9.0]]))
  np.testing.assert_array_equal(out.reshape(-1), [0, 0, 9, 0, 0, 7])


@dataclasses.dataclass(frozen=True)
class _NoSoftcap(XlaPagedAttention):
  """The reference, declaring no soft-cap support (to exercise the policy)."""

  name: str = 'test_no_softcap'

  @property
  def capabilities(self):
    return dataclasses.replace(super().capabilities, softcap=False)


def test_registry_and_unsupported_policy(caplog):
  """Strategies are found by name; a refused call falls back to xla or raises."""
  assert isinstance(get_kernel('paged_attention', 'xla'), XlaPagedAttention)
  with pytest.raises(ValueError, match="Unknown paged_attention_impl 'nope'.*xla"):
    get_kernel('paged_attention', 'nope')
  register_paged_attention_kernel('test_no_softcap', _NoSoftcap)
  try:
    rng = np.random.default_rng(1)
    batch, _ = _layout([(2, 2)], 4, rng)
    q = jnp.asarray(rng.normal(size=(5, 2, 4)), jnp.float32)
    pages = jnp.asarray(rng.normal(size=(4, PAGE, 2, 4)), jnp.float32)
    options = AttentionOptions(scale=0.5, softcap=1.0)
    want = XlaPagedAttention()(q, pages, pages, batch, options)
    reset_warnings()
    with caplog.at_level(logging.WARNING, logger='maxnnx.kernels'):
      got = get_kernel('paged_attention', 'test_no_softcap')(q, pages, pages, batch, options)
    np.testing.assert_allclose(got, want)
    assert 'soft-capping is not supported' in caplog.text
    strict = get_kernel('paged_attention', 'test_no_softcap', on_unsupported='error')
    with pytest.raises(KernelUnsupportedError, match="paged_attention_impl 'test_no_softcap'"):
      strict(q, pages, pages, batch, options)
  finally:
    del PAGED_ATTENTION_IMPLEMENTATIONS['test_no_softcap']


def test_every_paged_strategy_declares_capabilities():
  """Each registered factory builds a kernel of that name with a full declaration."""
  for name, factory in PAGED_ATTENTION_IMPLEMENTATIONS.items():
    kernel = factory()
    assert kernel.name == name and isinstance(kernel.capabilities, PagedAttentionCapabilities)


MODEL = dict(vocab_size=61, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=48,
             max_position_embeddings=64, initializer_range=1.0)


@pytest.mark.parametrize('overrides', [
    {},
    {'runtime.scan_layers': True, 'attention.sliding_window': 3, 'layer_types': ('sliding',
                                                                                 'full', 'sliding'),
     'attention.logit_softcap': 5.0, 'attention.sinks': True},
    pytest.param({'attention.type': 'mla', 'head_dim': None, 'mla.kv_lora_rank': 8,
                  'mla.qk_nope_head_dim': 8, 'mla.qk_rope_head_dim': 4, 'mla.v_head_dim': 6,
                  'mla.q_lora_rank': 12}, marks=pytest.mark.slow),  # the engine tests run MLA
], ids=['gqa', 'scan_sliding_softcap_sinks', 'mla'])
def test_paged_forward_in_chunks_equals_the_plain_forward(overrides):
  """Two requests prefilled together, one continued in a second chunk, through the model's
  paged path, give the logits of running each sequence whole."""
  model = maxnnx.Transformer(maxnnx.ModelConfig.from_dict({**MODEL, **overrides}),
                             rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  a, b = rng.integers(0, 61, 11), rng.integers(0, 61, 6)
  model.init_paged_cache(10, PAGE)
  table = {0: [3, 1, 7], 1: [2, 5]}
  paged_forward = nnx.jit(lambda model, ids, pos, batch: model(ids, positions=pos, paged=batch))
  plain_forward = nnx.jit(lambda model, ids, seg, pos: model(ids, segment_ids=seg, positions=pos))

  def run(chunks):
    ids, pos, slots = [], [], []
    page_table = np.zeros((3, 4), np.int32)
    kv_lens, q_starts, q_lens = np.zeros(3, np.int32), np.zeros(3, np.int32), np.zeros(3, np.int32)
    for row, (seq, tokens, start) in enumerate(chunks):
      p = np.arange(start, start + len(tokens))
      q_starts[row], q_lens[row], kv_lens[row] = len(ids), len(tokens), p[-1] + 1
      page_table[row, :len(table[seq])] = table[seq]
      ids.extend(tokens)
      pos.extend(p)
      slots.extend(np.asarray(table[seq])[p // PAGE] * PAGE + p % PAGE)
    pad = 16 - len(ids)
    batch = PagedBatch(jnp.asarray(page_table), jnp.asarray(kv_lens), jnp.asarray(q_starts),
                       jnp.asarray(q_lens), jnp.asarray(slots + [0] * pad, jnp.int32), 8)
    return paged_forward(model, jnp.asarray(ids + [0] * pad)[None],
                         jnp.asarray(pos + [0] * pad)[None], batch)[0]

  first = run([(0, a[:7], 0), (1, b, 0)])
  second = run([(0, a[7:], 7)])
  # Both sequences packed in one row (segments 1 and 2) give each one's plain logits.
  want = plain_forward(model, jnp.concatenate([a, b])[None],
                       jnp.asarray([1] * 11 + [2] * 6)[None],
                       jnp.concatenate([jnp.arange(11), jnp.arange(6)])[None])[0]
  want_a, want_b = want[:11], want[11:]
  np.testing.assert_allclose(first[:7], want_a[:7], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(first[7:13], want_b, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(second[:4], want_a[7:], atol=2e-5, rtol=1e-5)
  assert jax.tree.leaves(nnx.state(model, nnx.Cache))  # the pools live in the layers

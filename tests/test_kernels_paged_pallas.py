"""The Pallas paged-attention kernel (``pallas_gpu``) in the Pallas interpreter against the
``xla`` paged reference (itself checked against dense attention), and in the engine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.kernels import (
  AttentionOptions,
  KernelUnsupportedError,
  PagedBatch,
  PallasPagedAttention,
  XlaPagedAttention,
  register_paged_attention_kernel,
)
from maxnnx.kernels.paged_attention import PAGED_ATTENTION_IMPLEMENTATIONS

PAGE, HEADS, KV_HEADS, HEAD_DIM, NUM_PAGES = 16, 4, 2, 16, 12
ROWS = [(40, 1), (0, 7), (33, 5), (17, 1)]  # (cached, new): decode, prefill, chunk, decode


def _step(rng, rows=ROWS, pad=3, wide_rows=None):
  """Random pools and queries, and a PagedBatch of ``rows`` plus an empty row."""
  free = list(rng.permutation(np.arange(1, NUM_PAGES)))
  page_table = np.zeros((len(rows) + 1, 4), np.int32)
  kv_lens, q_starts, q_lens, slots = [], [], [], []
  for b, (cached, new) in enumerate(rows):
    pages = [free.pop() for _ in range(-(-(cached + new) // PAGE))]
    page_table[b, :len(pages)] = pages
    pos = np.arange(cached, cached + new)
    q_starts.append(len(slots))
    slots.extend(np.asarray(pages)[pos // PAGE] * PAGE + pos % PAGE)
    kv_lens.append(cached + new)
    q_lens.append(new)
  batch = PagedBatch(jnp.asarray(page_table), jnp.asarray(kv_lens + [0], jnp.int32),
                     jnp.asarray(q_starts + [0], jnp.int32), jnp.asarray(q_lens + [0], jnp.int32),
                     jnp.asarray(slots + [0] * pad, jnp.int32), max(q_lens),
                     wide_rows=wide_rows)
  tokens = len(slots) + pad
  q = jnp.asarray(rng.normal(size=(tokens, HEADS, HEAD_DIM)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(NUM_PAGES, PAGE, KV_HEADS, HEAD_DIM)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(NUM_PAGES, PAGE, KV_HEADS, HEAD_DIM)), jnp.float32)
  return q, k, v, batch, len(slots)


@pytest.mark.parametrize('options', [
    AttentionOptions(scale=0.25), AttentionOptions(scale=0.25, sliding_window=20),
    pytest.param(AttentionOptions(scale=0.25, softcap=2.0), marks=pytest.mark.slow),
    pytest.param(AttentionOptions(scale=0.25, chunk_size=16), marks=pytest.mark.slow)],
    ids=['plain', 'window', 'softcap', 'chunked'])
def test_interpreted_kernel_equals_the_xla_reference(options):
  """Decode rows, a prefill, a chunk after cached pages and an empty row, GQA."""
  q, k, v, batch, real = _step(np.random.default_rng())
  kernel = PallasPagedAttention(interpret=True, pages_per_block=2, on_unsupported='error')
  got = jax.jit(lambda *a: kernel(*a, options))(q, k, v, batch)
  want = jax.jit(lambda *a: XlaPagedAttention()(*a, options))(q, k, v, batch)
  np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=2e-5)


def test_only_the_wide_rows_are_run_max_q_wide():
  """With the chunk rows first and wide_rows=2, the decode rows and the empty row run one
  token wide (a second kernel call) and every row's output is the reference's."""
  rows = [(0, 7), (33, 5), (40, 1), (17, 1)]
  q, k, v, batch, real = _step(np.random.default_rng(), rows, wide_rows=2)
  options = AttentionOptions(scale=0.25)
  kernel = PallasPagedAttention(interpret=True, pages_per_block=2, on_unsupported='error')
  got = jax.jit(lambda *a: kernel(*a, options))(q, k, v, batch)
  all_wide = PagedBatch(*(getattr(batch, f) for f in (
      'page_table_BM', 'kv_lens_B', 'q_starts_B', 'q_lens_B', 'slots_T', 'max_q')))
  want = jax.jit(lambda *a: XlaPagedAttention()(*a, options))(q, k, v, all_wide)
  np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=2e-5)


def test_what_the_kernel_cannot_serve_falls_back_or_is_refused():
  q, k, v, batch, real = _step(np.random.default_rng())
  sinks = AttentionOptions(scale=0.25, sinks_N=jnp.ones(HEADS))
  got = PallasPagedAttention(interpret=True)(q, k, v, batch, sinks)
  np.testing.assert_allclose(got[:real], XlaPagedAttention()(q, k, v, batch, sinks)[:real],
                             atol=1e-6)
  strict = PallasPagedAttention(interpret=True, on_unsupported='error')
  with pytest.raises(KernelUnsupportedError, match='attention sinks'):
    strict(q, k, v, batch, sinks)
  with pytest.raises(KernelUnsupportedError, match='traced'):
    strict(q, k, v, batch, AttentionOptions(scale=0.25, chunk_size=jnp.asarray(16)))
  with pytest.raises(KernelUnsupportedError, match='page_size 8 is below 16'):
    strict(q, k.reshape(-1, 8, KV_HEADS, HEAD_DIM), v.reshape(-1, 8, KV_HEADS, HEAD_DIM),
           batch, AttentionOptions(scale=0.25))
  assert PallasPagedAttention().capabilities.platforms == ('gpu',)


@pytest.mark.slow  # ~40 s: every step shape compiles the interpreted kernel
def test_the_engine_serves_greedy_tokens_like_generate_through_the_kernel():
  """A tiny GQA model with a sliding-window layer, its paged attention interpreted."""
  register_paged_attention_kernel(
      'pallas_interpreted_test',
      lambda: PallasPagedAttention(name='pallas_interpreted_test', interpret=True,
                                   on_unsupported='error'))
  try:
    cfg = maxnnx.ModelConfig(vocab_size=61, d_model=32, num_layers=2, num_heads=2,
                             num_kv_heads=1, head_dim=16, mlp_dim=48,
                             max_position_embeddings=128, **{'attention.sliding_window': 12},
                             layer_types=('sliding', 'full'))
    cfg = cfg.replace(runtime=cfg.runtime.replace(paged_attention_impl='pallas_interpreted_test'))
    model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng()
    prompts = [rng.integers(1, 61, n).tolist() for n in (5, 19, 33)]
    from maxnnx.serving import Engine, SamplingParams
    engine = Engine(model, max_batch=3, token_budget=32, page_size=16, max_model_len=64)
    got = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0,
                                                  ignore_eos=True))
    for prompt, completion in zip(prompts, got):
      want = maxnnx.generate(model, [prompt], max_new_tokens=5, eos_ids=None).tokens[0]
      assert list(completion.token_ids) == np.asarray(want).tolist()
  finally:
    del PAGED_ATTENTION_IMPLEMENTATIONS['pallas_interpreted_test']

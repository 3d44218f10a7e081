"""The quantized KV cache (``kv_cache_dtype`` int8 / fp8): the rule against float64 NumPy,
paged attention on quantized pages against the float reference, the engine and generate on
quantized caches, the pools' bytes, and the errors."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import ConfigError, EngineConfig
from maxnnx.config.engine import KV_CACHE_DTYPES as CONFIG_KV_CACHE_DTYPES
from maxnnx.kernels import AttentionOptions, KernelUnsupportedError, PagedBatch, XlaPagedAttention
from maxnnx.kernels.capabilities import PagedAttentionRequest, reset_warnings
from maxnnx.kernels.kv_quant import (
  KV_CACHE_DTYPES,
  QuantizedPages,
  dequantize_kv,
  quantize_kv,
)
from maxnnx.kernels.paged_attention_pallas import PallasPagedAttention
from maxnnx.serving import Engine, SamplingParams
from tests.test_kernels_paged_attention import PAGE, _layout

VOCAB = 97
MODEL = dict(vocab_size=VOCAB, d_model=48, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=96,
             max_position_embeddings=128, initializer_range=1.0)
LARGEST = {'int8': 127.0, 'fp8': 448.0}


def _reference(x, kv_cache_dtype):
  """The rule in float64 NumPy: ``(values as float64, scales)``."""
  x = np.asarray(x, np.float64)
  scale = np.abs(x).max(-1) / LARGEST[kv_cache_dtype]
  scaled = x / np.where(scale > 0, scale, 1.0)[..., None]
  if kv_cache_dtype == 'int8':
    return np.clip(np.round(scaled), -127, 127), scale
  return scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64), scale


@pytest.mark.parametrize('kv_cache_dtype', ['int8', 'fp8'])
def test_quantize_round_trip_follows_the_rule(kv_cache_dtype):
  """Per token and head, scale = absmax / 127 (int8) or / 448 (e4m3): the values and scales
  are the float64 rule's, and a dequantized entry is within half a step of the original
  (int8: half the scale; e4m3: 2^-4 of it relative, 2^-10 of the scale near zero). A zero
  vector reads back as zeros, and rows of very different sizes each keep their precision."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 5, 3, 16)) * 10.0 ** rng.integers(-3, 3, (6, 5, 3, 1))
  x[2, 1, 0] = 0.0
  x = x.astype(np.float32)
  values, scales = quantize_kv(jnp.asarray(x), kv_cache_dtype)
  assert values.dtype == {'int8': jnp.int8, 'fp8': jnp.float8_e4m3fn}[kv_cache_dtype]
  assert scales.shape == x.shape[:-1] and scales.dtype == jnp.float32
  want_values, want_scales = _reference(x, kv_cache_dtype)
  np.testing.assert_allclose(np.asarray(scales), want_scales, rtol=1e-6)
  got = np.asarray(values.astype(jnp.float32), np.float64)
  # float32 and float64 may round an entry lying on a step's midpoint differently.
  ties = np.abs(got - want_values) > 0
  assert ties.mean() < 1e-3, ties.sum()
  back = np.asarray(dequantize_kv(values, scales, jnp.float32), np.float64)
  s = want_scales[..., None]
  bound = s / 2 if kv_cache_dtype == 'int8' else np.maximum(np.abs(x) * 2.0 ** -4, s * 2.0 ** -10)
  assert np.all(np.abs(back - x) <= bound * (1 + 1e-5) + 1e-30)
  np.testing.assert_array_equal(back[2, 1, 0], 0.0)


def test_write_quantizes_each_token_with_its_own_scale():
  """Writing a token into a quantized pool stores its values and scale at its slot; a later,
  larger token in the same page leaves the earlier one's bytes and scale as they were."""
  pool = QuantizedPages(jnp.zeros((3, 2, 1, 4), jnp.int8), jnp.zeros((3, 2, 1), jnp.float32))

  def batch(slots):
    return PagedBatch(jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32),
                      jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.asarray(slots), 1)

  first = jnp.asarray([[[0.5, -1.0, 0.25, 0.0]]])
  pool = batch([4]).write(pool, first)
  after_first = np.asarray(pool.values[2, 0]), float(pool.scales[2, 0, 0])
  pool = batch([5]).write(pool, jnp.asarray([[[100.0, 3.0, -50.0, 1.0]]]))
  np.testing.assert_array_equal(pool.values[2, 0], after_first[0])
  assert float(pool.scales[2, 0, 0]) == after_first[1] == pytest.approx(1.0 / 127)
  np.testing.assert_array_equal(pool.values[2, 0, 0], [64, -127, 32, 0])
  assert float(pool.scales[2, 1, 0]) == pytest.approx(100.0 / 127)
  assert not np.asarray(pool.values[:2]).any() and not np.asarray(pool.scales[:2]).any()


@pytest.mark.parametrize('kv_cache_dtype,atol', [('int8', 0.02), ('fp8', 0.1)])
def test_xla_paged_attention_reads_quantized_pages(kv_cache_dtype, atol):
  """The xla strategy on quantized pages equals it on float pages holding the dequantized
  keys and values (float error only), and stays close to it on the original float pages
  (the quantization error: int8 within 0.02, e4m3 within 0.1 of outputs of size ~1)."""
  rng = np.random.default_rng(0)
  heads, kv_heads, head_dim, num_pages = 4, 2, 8, 12
  batch, _ = _layout([(0, 7), (9, 3), (5, 1)], num_pages, rng, wide_rows=2)
  k = rng.normal(size=(num_pages, PAGE, kv_heads, head_dim)).astype(np.float32)
  v = rng.normal(size=(num_pages, PAGE, kv_heads, head_dim)).astype(np.float32)
  q = jnp.asarray(rng.normal(size=(batch.slots_T.shape[0], heads, head_dim)), jnp.float32)
  k_quantized = QuantizedPages(*quantize_kv(jnp.asarray(k), kv_cache_dtype))
  v_quantized = QuantizedPages(*quantize_kv(jnp.asarray(v), kv_cache_dtype))
  options = AttentionOptions(scale=0.35, sliding_window=6, softcap=3.0)
  paged = jax.jit(lambda q, k, v, batch: XlaPagedAttention()(q, k, v, batch, options))
  got = np.asarray(paged(q, k_quantized, v_quantized, batch))
  dequantized = np.asarray(paged(q, k_quantized.dequantize(jnp.float32),
                                 v_quantized.dequantize(jnp.float32), batch))
  exact = np.asarray(paged(q, jnp.asarray(k), jnp.asarray(v), batch))
  real = np.asarray(batch.q_lens_B).sum()  # padding tokens' output is unspecified
  np.testing.assert_allclose(got[:real], dequantized[:real], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got[:real], exact[:real], atol=atol)
  assert np.abs(got[:real] - exact[:real]).max() > 0  # the pages were quantized


@dataclasses.dataclass(frozen=True)
class _FloatPagesOnly(XlaPagedAttention):
  """The reference, declaring float pages only (to exercise the policy)."""

  name: str = 'test_float_pages_only'

  @property
  def capabilities(self):
    return dataclasses.replace(super().capabilities, kv_dtypes=())


def test_strategies_without_quantized_pages_fall_back_or_refuse(caplog):
  """A strategy that does not list the pages' dtype in kv_dtypes falls back to xla with a
  warning naming kv_cache_dtype, or refuses under on_unsupported='error'; the Pallas kernel
  declares float pages only."""
  rng = np.random.default_rng(1)
  batch, _ = _layout([(2, 2)], 4, rng)
  q = jnp.asarray(rng.normal(size=(5, 2, 4)), jnp.float32)
  pages = QuantizedPages(*quantize_kv(jnp.asarray(rng.normal(size=(4, PAGE, 2, 4))), 'int8'))
  options = AttentionOptions(scale=0.5)
  want = XlaPagedAttention()(q, pages, pages, batch, options)
  reset_warnings()
  with caplog.at_level(logging.WARNING, logger='maxnnx.kernels'):
    got = _FloatPagesOnly()(q, pages, pages, batch, options)
  np.testing.assert_allclose(got, want)
  assert 'quantized int8 pages (kv_cache_dtype) are not supported' in caplog.text
  with pytest.raises(KernelUnsupportedError, match='quantized int8 pages'):
    dataclasses.replace(_FloatPagesOnly(), on_unsupported='error')(q, pages, pages, batch,
                                                                   options)
  request = PagedAttentionRequest.of(q, pages, pages, options)
  assert request.kv_dtype == 'int8'
  assert any('float8_e4m3fn pages' in reason for reason in PallasPagedAttention(
      interpret=True).capabilities.missing(dataclasses.replace(request, kv_dtype='float8_e4m3fn')))
  assert XlaPagedAttention().capabilities.missing(request) == []


def _model(**overrides):
  return maxnnx.Transformer(maxnnx.ModelConfig.from_dict({**MODEL, **overrides}),
                            rngs=nnx.Rngs(3))


def _greedy(max_tokens):
  return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


SLIDING = dict(num_layers=4, head_dim=12, layer_types=('sliding', 'full', 'sliding', 'full'),
               attention={'sliding_window': 6, 'logit_softcap': 5.0})


@pytest.mark.parametrize('kv_cache_dtype,family', [
    ('int8', {}), ('fp8', {}), ('int8', SLIDING),
    ('int8', {'runtime.scan_layers': True}), ('int8', 'tiny-qwen3-next'),
], ids=['int8', 'fp8', 'int8_sliding_pool', 'int8_scanned', 'int8_recurrent'])
def test_engine_on_quantized_pages_gives_generates_tokens(kv_cache_dtype, family):
  """The engine's paged cache and generate's contiguous one quantize each token's keys and
  values by the same rule, so greedy requests (chunked prefill, a sliding layers' pool of its
  own, scanned layers, Gated DeltaNet's float states beside int8 pages) give the same tokens."""
  if family == 'tiny-qwen3-next':
    model = maxnnx.Transformer(maxnnx.get_preset(
        family, initializer_range=1.0, vocab_size=VOCAB, num_layers=2,
        layer_types=('linear', 'full'), moe={'num_experts': 0}), rngs=nnx.Rngs(5))
  else:
    model = _model(**family)
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 9, 14, 20)]
  want = maxnnx.generate(model, prompts, max_new_tokens=12, eos_ids=None,
                         kv_cache_dtype=kv_cache_dtype)
  engine = Engine(model, page_size=4, max_batch=3, token_budget=8, max_model_len=32,
                  page_buckets=8, kv_cache_dtype=kv_cache_dtype)  # few buckets: few compiles
  got = engine.generate(prompts, _greedy(12))
  assert [list(c.token_ids) for c in got] == want.tokens.tolist()
  storage = jnp.dtype({'int8': jnp.int8, 'fp8': jnp.float8_e4m3fn}[kv_cache_dtype])
  dtypes = {}
  for path, x in jax.tree_util.tree_leaves_with_path(engine.runner.cache):
    name = next(str(k.key) for k in reversed(path) if isinstance(getattr(k, 'key', None), str)
                and k.key != 'value')
    dtypes.setdefault(name, set()).add(x.dtype)
  assert dtypes['pages_k'] == dtypes['pages_v'] == {storage}
  assert dtypes['pages_k_scale'] == dtypes['pages_v_scale'] == {jnp.dtype(jnp.float32)}
  for name in ('conv_state', 'ssm_state'):  # recurrent states stay float
    assert dtypes.get(name, {model.config.jnp_dtype()}) == {model.config.jnp_dtype()}
  assert ('ssm_state' in dtypes) == (family == 'tiny-qwen3-next')


def test_int8_cache_greedy_tokens_agree_with_the_float_cache():
  """int8 keys and values change the logits by less than the top-2 margin in nearly every
  greedy step of a small random model: at least 95% of 96 tokens agree with the float cache
  (100% when measured; fp8's coarser e4m3 steps agree less, see benchmarks/RESULTS.md)."""
  model = _model()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 12, 20, 31, 8, 17)]
  float_cache = maxnnx.generate(model, prompts, max_new_tokens=16, eos_ids=None)
  int8_cache = maxnnx.generate(model, prompts, max_new_tokens=16, eos_ids=None,
                               kv_cache_dtype='int8')
  assert (float_cache.tokens == int8_cache.tokens).mean() >= 0.95


def _pool_bytes(engine):
  return sum(x.nbytes for x in jax.tree.leaves(engine.runner.cache))


@pytest.mark.parametrize('head_dim', [16, 64])
def test_int8_and_fp8_pages_take_about_half_a_bf16_pages_bytes(head_dim):
  """Per token and kv head, a bf16 page holds 2 * head_dim bytes, an int8 or fp8 one
  head_dim bytes and a float32 scale: (head_dim + 4) / (2 * head_dim) of the bytes."""
  model = _model(**{'runtime.dtype': 'bfloat16'}, head_dim=head_dim)
  sizes = {kv: _pool_bytes(Engine(model, page_size=16, max_batch=2, max_model_len=64,
                                  kv_cache_dtype=kv)) for kv in KV_CACHE_DTYPES}
  pages = 2 * 64 // 16 + 1
  assert sizes['auto'] == 3 * 2 * pages * 16 * 2 * head_dim * 2  # layers, k/v, ..., bf16
  for kv in ('int8', 'fp8'):
    assert sizes[kv] / sizes['auto'] == (head_dim + 4) / (2 * head_dim)


def test_bad_kv_cache_dtypes_and_unquantizable_caches_are_refused_in_one_line():
  """A bad kv_cache_dtype names the key and the values it takes (engine, generate); an MLA
  model's latent cache is refused naming kv_cache_dtype, its family and the fix."""
  assert CONFIG_KV_CACHE_DTYPES == KV_CACHE_DTYPES
  with pytest.raises(ConfigError, match=r"^Engine kv_cache_dtype='int4': expected one of "
                                        r'auto, int8, fp8\.$'):
    EngineConfig(kv_cache_dtype='int4')
  model = _model(num_layers=1)
  with pytest.raises(ValueError, match=r"^kv_cache_dtype='bf16': expected one of auto, int8, "
                                       r'fp8 \(auto: the compute dtype\)\.$'):
    maxnnx.generate(model, [[1, 2]], max_new_tokens=2, kv_cache_dtype='bf16')
  mla = _model(num_layers=1, family='deepseek_v3', attention={'type': 'mla'}, head_dim=None,
               mla={'kv_lora_rank': 8, 'qk_nope_head_dim': 8, 'qk_rope_head_dim': 4,
                    'v_head_dim': 6, 'q_lora_rank': 12})
  for run in (lambda: Engine(mla, max_model_len=16, kv_cache_dtype='fp8'),
              lambda: maxnnx.generate(mla, [[1, 2]], max_new_tokens=2, kv_cache_dtype='fp8')):
    with pytest.raises(ValueError) as error:
      run()
    message = str(error.value)
    assert '\n' not in message and "kv_cache_dtype='fp8'" in message
    assert 'deepseek_v3' in message and 'MLA' in message and 'kv_cache_dtype=auto' in message


def test_quantized_pages_and_scales_split_over_tensor_devices(tmp_path):
  """On a tensor=2 mesh the int8 pages and their scales split over the kv heads like float
  pages, and greedy requests give the one-device generate's int8 tokens."""
  from maxnnx.config import MeshConfig  # noqa: PLC0415
  model = _model()
  maxnnx.save_pretrained(model, str(tmp_path))
  sharded = maxnnx.from_pretrained(str(tmp_path), mesh=MeshConfig(data=1, tensor=2))
  engine = Engine(sharded, page_size=4, max_batch=4, token_budget=16, max_model_len=32,
                  page_buckets=8, kv_cache_dtype='int8')
  specs = {x.ndim: tuple(x.sharding.spec) for x in jax.tree.leaves(engine.runner.cache)}
  assert specs[4][:3] == (None, None, 'tensor') and not any(specs[4][3:])
  assert specs[3] == (None, None, 'tensor')
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 17, 9)]
  want = maxnnx.generate(model, prompts, max_new_tokens=6, eos_ids=None, kv_cache_dtype='int8')
  got = engine.generate(prompts, _greedy(6))
  assert [list(c.token_ids) for c in got] == want.tokens.tolist()

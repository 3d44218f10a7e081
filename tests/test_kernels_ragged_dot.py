"""Ragged-dot strategies agree with the ``dense`` reference, and refuse or fall back as declared."""

import contextlib
import importlib
import importlib.util
import logging
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxnnx.kernels import (
  RAGGED_DOT_IMPLEMENTATIONS,
  DenseRaggedDot,
  KernelUnsupportedError,
  RaggedDotCapabilities,
  RaggedDotKernel,
  RaggedDotOptions,
  RaggedDotRequest,
  TiledRaggedDot,
  get_ragged_dot_kernel,
)
from maxnnx.kernels.capabilities import current_platform, import_tokamax, reset_warnings

# Group sizes: uneven, an empty expert, and rows past the last group (must be zeros).
GROUP_SIZES = (5, 0, 9, 3)
M, K, N = 20, 12, 7


def _inputs(dtype, *key):
  rng = np.random.default_rng(zlib.crc32(repr(key).encode()))
  lhs = jnp.asarray(rng.normal(size=(M, K)), dtype)
  rhs = jnp.asarray(rng.normal(size=(len(GROUP_SIZES), K, N)), dtype)
  weights = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)
  return lhs, rhs, jnp.asarray(GROUP_SIZES, jnp.int32), weights


def _fwd_and_grad(kernel, lhs, rhs, group_sizes, weights, preferred_element_type=None):
  options = RaggedDotOptions(preferred_element_type=preferred_element_type)

  def loss(lhs, rhs):
    out = kernel(lhs, rhs, group_sizes, options)
    return jnp.sum(out.astype(jnp.float32) * weights), out

  return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(lhs, rhs)[::-1]


def _assert_close(actual, expected, rel):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  np.testing.assert_allclose(actual, expected, atol=rel * float(np.max(np.abs(expected))), rtol=0)


def _cannot_run_here(kernel, lhs, rhs, pet) -> list[str]:
  """The declared reasons why ``kernel`` refuses this call here; empty when it runs it."""
  return kernel.unsupported_reasons(RaggedDotRequest.of(lhs, rhs, RaggedDotOptions(pet)))


def _not_on_this_platform() -> list[str]:
  """Registered strategies whose declared platforms exclude this one (read at collection)."""
  platform = current_platform()
  return [name for name, factory in RAGGED_DOT_IMPLEMENTATIONS.items()
          if platform not in factory().capabilities.platforms]


@pytest.mark.parametrize('dtype,preferred', [('float32', None), ('bfloat16', None),
                                             ('bfloat16', 'float32')])
@pytest.mark.parametrize('name', list(RAGGED_DOT_IMPLEMENTATIONS))
def test_strategy_matches_dense(name, dtype, preferred):
  """Forward and gradients equal the dense reference (bf16 against the f32 reference).

  Every registered strategy is checked; one that cannot run here (its declared platforms or
  dtypes, a missing package) is skipped with its own reasons.
  """
  kernel = get_ragged_dot_kernel(name, on_unsupported='error')
  lhs, rhs, group_sizes, weights = _inputs(getattr(jnp, dtype), name, dtype, preferred)
  pet = None if preferred is None else getattr(jnp, preferred)
  cannot = _cannot_run_here(kernel, lhs, rhs, pet)
  if cannot:
    pytest.skip(f"ragged_dot_impl '{name}' cannot run here: {'; '.join(cannot)}")
  out, grads = _fwd_and_grad(kernel, lhs, rhs, group_sizes, weights, pet)
  assert out.dtype == (pet or lhs.dtype)
  ref_out, ref_grads = _fwd_and_grad(DenseRaggedDot(), lhs.astype(jnp.float32),
                                     rhs.astype(jnp.float32), group_sizes, weights)
  assert not np.any(np.asarray(ref_out)[sum(GROUP_SIZES):])  # rows past the groups are zeros
  rel = 1e-5 if dtype == 'float32' else 2e-2
  _assert_close(out, ref_out, rel)
  for grad, ref_grad in zip(grads, ref_grads):
    _assert_close(grad, ref_grad, 2 * rel)


@pytest.mark.parametrize('tile', [1, 4, 128])
def test_tiled_matches_dense_for_any_tile(tile):
  """Groups spanning several tiles, partial tiles, empty groups and trailing rows."""
  rng = np.random.default_rng()
  sizes = rng.multinomial(30, np.ones(5) / 5)
  sizes[rng.integers(5)] = 0
  lhs = jnp.asarray(rng.normal(size=(36, K)), jnp.float32)  # 6 rows past the last group
  rhs = jnp.asarray(rng.normal(size=(5, K, N)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(36, N)), jnp.float32)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  out, grads = _fwd_and_grad(TiledRaggedDot(tile=tile), lhs, rhs, group_sizes, weights)
  ref_out, ref_grads = _fwd_and_grad(DenseRaggedDot(), lhs, rhs, group_sizes, weights)
  _assert_close(out, ref_out, 1e-5)
  for grad, ref_grad in zip(grads, ref_grads):
    _assert_close(grad, ref_grad, 2e-5)


def test_dense_reference_matches_numpy():
  """The dense reference itself: each row times its own expert's matrix, float64 NumPy."""
  lhs, rhs, group_sizes, _ = _inputs(jnp.float32, 'numpy')
  expected = np.zeros((M, N))
  start = 0
  for g, size in enumerate(GROUP_SIZES):
    expected[start:start + size] = np.asarray(lhs, np.float64)[start:start + size] @ np.asarray(
        rhs[g], np.float64)
    start += size
  np.testing.assert_allclose(DenseRaggedDot()(lhs, rhs, group_sizes), expected, atol=1e-5)


@pytest.mark.parametrize('name', _not_on_this_platform())
def test_strategies_for_other_platforms_refuse_or_fall_back(name, caplog):
  """'error' raises naming this platform; 'fallback' equals lax and warns once."""
  reset_warnings()
  lhs, rhs, group_sizes, _ = _inputs(jnp.float32, name)
  with pytest.raises(KernelUnsupportedError,
                     match=f"ragged_dot_impl '{name}'.*platform '{current_platform()}'"):
    get_ragged_dot_kernel(name, on_unsupported='error')(lhs, rhs, group_sizes)
  kernel = get_ragged_dot_kernel(name)
  with caplog.at_level(logging.WARNING, logger='maxnnx.kernels'):
    out = kernel(lhs, rhs, group_sizes)
    kernel(lhs, rhs, group_sizes)
  np.testing.assert_array_equal(out, get_ragged_dot_kernel('lax')(lhs, rhs, group_sizes))
  assert len(caplog.records) == 1 and "with 'lax' instead" in caplog.records[0].getMessage()


def test_mixed_dtypes_follow_the_declaration(caplog):
  """tokamax declares lhs/rhs of one dtype: mixed ones raise or fall back to lax."""
  reset_warnings()
  lhs, rhs, group_sizes, _ = _inputs(jnp.float32, 'mixed')
  lhs = lhs.astype(jnp.bfloat16)
  with pytest.raises(KernelUnsupportedError, match='lhs dtype bfloat16 != rhs dtype float32'):
    get_ragged_dot_kernel('tokamax_xla', on_unsupported='error')(lhs, rhs, group_sizes)
  with caplog.at_level(logging.WARNING, logger='maxnnx.kernels'):
    out = get_ragged_dot_kernel('tokamax_xla')(lhs, rhs, group_sizes)
  np.testing.assert_array_equal(out, get_ragged_dot_kernel('lax')(lhs, rhs, group_sizes))
  assert 'lhs dtype' in caplog.records[0].getMessage()


def test_backend_not_implemented_follows_the_policy():
  """A backend's NotImplementedError while tracing is an unsupported call."""

  class Refusing(RaggedDotKernel):
    @property
    def capabilities(self):
      return get_ragged_dot_kernel('lax').capabilities

    def compute(self, *args, **kwargs):
      raise NotImplementedError('no tiling for this K')

  lhs, rhs, group_sizes, _ = _inputs(jnp.float32, 'refusing')
  with pytest.raises(KernelUnsupportedError, match='no tiling for this K'):
    Refusing(name='refusing', on_unsupported='error')(lhs, rhs, group_sizes)
  np.testing.assert_array_equal(Refusing(name='refusing')(lhs, rhs, group_sizes),
                                get_ragged_dot_kernel('lax')(lhs, rhs, group_sizes))


def test_tokamax_default_order_reports_what_it_skipped(caplog):
  """On CPU the default tokamax order ends at XLA, and says so."""
  if jax.default_backend() != 'cpu':
    pytest.skip('checks the CPU behaviour')
  reset_warnings()
  lhs, rhs, group_sizes, _ = _inputs(jnp.float32, 'order')
  with caplog.at_level(logging.WARNING, logger='maxnnx.kernels'):
    get_ragged_dot_kernel('tokamax')(lhs, rhs, group_sizes)
  message = caplog.records[0].getMessage()
  assert 'triton' in message and "using tokamax 'xla'" in message


def test_names_policies_and_declarations():
  """Unknown names list the known ones; every registered strategy declares capabilities."""
  with pytest.raises(ValueError, match="Unknown ragged_dot_impl 'megablox'.*dense.*lax.*tokamax"):
    get_ragged_dot_kernel('megablox')
  with pytest.raises(ValueError, match='on_unsupported must be one of'):
    get_ragged_dot_kernel('lax', on_unsupported='silently')
  for name, factory in RAGGED_DOT_IMPLEMENTATIONS.items():
    kernel = factory()
    assert kernel.name == name and isinstance(kernel.capabilities, RaggedDotCapabilities)


def test_kernels_check_script_runs_here():
  """The GPU check script imports and runs on CPU: everything is ok or refused, nothing fails."""
  kernels_check = pytest.importorskip('benchmarks.kernels_check')
  rows = kernels_check.check_ragged_dot(quick=True)
  assert {row[0] for row in rows} == set(RAGGED_DOT_IMPLEMENTATIONS)
  assert {row[3] for row in rows} <= {'ok', 'refused'}
  assert all(row[3] == 'ok' for row in rows if row[0] in ('lax', 'dense', 'tokamax_xla'))


@contextlib.contextmanager
def _chip_facts_of_a_tpu_v5p(monkeypatch):
  """Let Pallas TPU kernels ask for TPU chip facts (VMEM size, lanes) in interpret mode on this
  CPU: jax 0.12 looks the device kind up in its ``tpu_info.registry``; jax 0.10 reads them from
  the abstract device of the context mesh."""
  tpu_info = importlib.import_module('jax._src.tpu_info') if importlib.util.find_spec(
      'jax._src.tpu_info') else None
  if hasattr(tpu_info, 'registry'):
    monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind,
                        lambda: tpu_info._get_tpu_info_impl(tpu_info.ChipVersion.TPU_V5P, 1))
    yield
    return
  device = jax.sharding.AbstractDevice(device_kind='TPU v5p', num_cores=1, platform='tpu')
  with jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ('x',), abstract_device=device)):
    yield


def test_tokamax_mosaic_tpu_ragged_dot_in_interpret_mode(monkeypatch):
  """tokamax's Mosaic TPU grouped matmul (what ``tokamax_mosaic`` runs on a TPU) in Pallas
  interpret mode against ``lax.ragged_dot``, forward and gradients, told a TPU v5p's chip facts.
  It is the only tokamax kernel we route to that has an interpret switch (its Triton and Mosaic
  GPU kernels have none). Rows past the groups are left unwritten (NaN in interpret mode), so
  only the grouped rows are compared."""
  import_tokamax()  # absl flags marked parsed first
  pmt = pytest.importorskip('tokamax._src.ops.ragged_dot.pallas_mosaic_tpu')
  monkeypatch.setattr(pmt.PallasMosaicTpuRaggedDot, 'supported_on', lambda self, device: True)
  op = pmt.PallasMosaicTpuRaggedDot(interpret=True)
  rng = np.random.default_rng(zlib.crc32(b'tokamax-interpret'))
  lhs = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(4, 128, 128)) / np.sqrt(128), jnp.float32)
  group_sizes = jnp.asarray([100, 50, 0, 90], jnp.int32)
  rows = int(group_sizes.sum())

  def loss(fn):
    return lambda a, b: jnp.sum(fn(a, b)[:rows] ** 2)

  with _chip_facts_of_a_tpu_v5p(monkeypatch):
    out = op(lhs, rhs, group_sizes=group_sizes)
    grads = jax.grad(loss(lambda a, b: op(a, b, group_sizes=group_sizes)), (0, 1))(lhs, rhs)
  ref = jax.lax.ragged_dot(lhs, rhs, group_sizes)
  np.testing.assert_allclose(out[:rows], ref[:rows], rtol=1e-5, atol=1e-5)
  ref_grads = jax.grad(loss(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes)), (0, 1))(lhs, rhs)
  np.testing.assert_allclose(grads[0][:rows], ref_grads[0][:rows], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(grads[1], ref_grads[1], rtol=1e-4, atol=1e-4)

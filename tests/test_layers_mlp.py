"""MLP variants and DenseGeneral against NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from flax import nnx
from jaxpr_walk import equations

from maxnnx.config import ModelConfig
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.mlp import MLP


def _cfg(**overrides):
  base = dict(vocab_size=32, d_model=32, num_layers=1, num_heads=4, num_kv_heads=4, mlp_dim=48,
              max_position_embeddings=64)
  base.update(overrides)
  return ModelConfig.from_dict(base)


@nnx.jit
def _call(module, x):
  return module(x)


def _check_mlp(cfg, seed):
  mlp = MLP.from_config(cfg, rngs=nnx.Rngs(seed))
  ref.randomize_params(mlp, np.random.default_rng(seed))
  x = np.random.default_rng(seed + 1).normal(size=(2, 5, cfg.d_model)) * 2.0
  got = _call(mlp, jnp.asarray(x, jnp.float32))
  params = nnx.to_pure_dict(nnx.state(mlp, nnx.Param))
  expected = ref.mlp(x, params, cfg.mlp_activation, cfg.mlp_gated)
  ref.assert_close(got, expected)
  return mlp, x, expected


def test_swiglu():
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  mlp, _, _ = _check_mlp(_cfg(mlp_activation='silu'), 0)
  assert mlp.gate_proj is not None


def test_geglu_uses_tanh_gelu():
  """GeGLU: down(gelu_tanh(gate(x)) * up(x)), distinguishable from exact gelu."""
  cfg = _cfg(mlp_activation='gelu_tanh')
  mlp, x, expected = _check_mlp(cfg, 1)
  params = nnx.to_pure_dict(nnx.state(mlp, nnx.Param))
  exact = ref.mlp(x, params, 'gelu', gated=True)
  assert np.max(np.abs(exact - expected)) > 1e-5  # the two gelus really differ here


def test_exact_gelu_gated():
  """mlp_activation='gelu' is the erf GELU."""
  _check_mlp(_cfg(mlp_activation='gelu'), 2)


def test_plain_gelu_mlp():
  """mlp_gated=False: down(gelu(up(x))) and no gate projection."""
  mlp, _, _ = _check_mlp(_cfg(mlp_activation='gelu', mlp_gated=False), 3)
  assert mlp.gate_proj is None


def test_plain_relu_mlp_with_bias():
  """A plain ReLU MLP with biases on both projections."""
  mlp, _, _ = _check_mlp(_cfg(mlp_activation='relu', mlp_gated=False, mlp_bias=True), 4)
  assert mlp.up_proj.bias is not None and mlp.down_proj.bias is not None


def test_gated_mlp_with_bias():
  """A gated MLP with biases on gate, up and down."""
  _check_mlp(_cfg(mlp_bias=True), 5)


def test_mlp_axes():
  """MLP kernels are named ('embed', 'mlp') and ('mlp', 'embed')."""
  mlp = MLP.from_config(_cfg(), rngs=nnx.Rngs(0))
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(mlp, nnx.Param)))
  assert tuple(specs['gate_proj']['kernel']) == ('embed', 'mlp')
  assert tuple(specs['up_proj']['kernel']) == ('embed', 'mlp')
  assert tuple(specs['down_proj']['kernel']) == ('mlp', 'embed')


# -- DenseGeneral --------------------------------------------------------------------


def test_dense_general_multi_dim_contraction():
  """[..., 3, 4] x kernel[3, 4, 2, 5] (+ bias[2, 5]) equals the einsum reference."""
  rng = np.random.default_rng(6)
  dense = DenseGeneral((3, 4), (2, 5), axes=('a', 'b', 'c', 'd'), use_bias=True,
                       rngs=nnx.Rngs(0))
  kernel, bias = rng.normal(size=(3, 4, 2, 5)), rng.normal(size=(2, 5))
  dense.kernel[...] = jnp.asarray(kernel, jnp.float32)
  dense.bias[...] = jnp.asarray(bias, jnp.float32)
  x = rng.normal(size=(2, 6, 3, 4))
  y = dense(jnp.asarray(x, jnp.float32))
  assert y.shape == (2, 6, 2, 5)
  ref.assert_close(y, np.einsum('btij,ijkl->btkl', x, kernel) + bias)


def test_dense_general_heads_to_model():
  """An output projection [heads, head_dim] -> [d_model] contracts both dims."""
  rng = np.random.default_rng(7)
  dense = DenseGeneral((4, 8), (16,), axes=('heads', 'head_dim', 'embed'), rngs=nnx.Rngs(0))
  kernel = rng.normal(size=(4, 8, 16))
  dense.kernel[...] = jnp.asarray(kernel, jnp.float32)
  x = rng.normal(size=(2, 3, 4, 8))
  ref.assert_close(dense(jnp.asarray(x, jnp.float32)), np.einsum('btnh,nhd->btd', x, kernel))


def test_dense_general_init_scale():
  """The kernel is initialised with std fan_in ** -0.5 over all input dims (here 32)."""
  dense = DenseGeneral((4, 8), (16,), axes=('a', 'b', 'c'), rngs=nnx.Rngs(0))
  std = float(np.std(np.asarray(dense.kernel[...])))
  assert std == pytest.approx(32**-0.5, rel=0.1)


def test_dense_general_axes_metadata():
  """Kernel and bias carry the logical names of their dimensions."""
  dense = DenseGeneral((3, 4), (2, 5), axes=('embed', 'x', 'heads', 'head_dim'), use_bias=True,
                       rngs=nnx.Rngs(0))
  assert dense.kernel.get_metadata()['out_sharding'] == ('embed', 'x', 'heads', 'head_dim')
  assert dense.bias.get_metadata()['out_sharding'] == ('heads', 'head_dim')
  spec = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(dense, nnx.Param)))
  assert tuple(spec['kernel']) == ('embed', 'x', 'heads', 'head_dim')


def test_dense_general_wrong_axes_count():
  """axes must name every kernel dimension."""
  with pytest.raises(ValueError, match='axes'):
    DenseGeneral((8,), (4,), axes=('embed',), rngs=nnx.Rngs(0))


def test_dense_general_wrong_input_shape():
  """A mismatched trailing input shape is a clear ValueError."""
  dense = DenseGeneral((3, 4), (2, 5), axes=('a', 'b', 'c', 'd'), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='trailing dims'):
    dense(jnp.ones((2, 4, 3)))


def test_dense_general_dtypes():
  """param_dtype stores the kernel; dtype is the compute and output dtype."""
  dense = DenseGeneral((4, 8), (16,), axes=('a', 'b', 'c'), dtype=jnp.bfloat16,
                       param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  assert dense.kernel[...].dtype == jnp.float32
  assert dense(jnp.ones((2, 4, 8), jnp.float32)).dtype == jnp.bfloat16


def test_dense_general_is_one_dot_general():
  """The projection's forward is a single dot_general (what quantizers intercept)."""
  dense = DenseGeneral((4, 8), (16,), axes=('a', 'b', 'c'), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(dense)
  jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.ones((2, 3, 4, 8)))
  assert [e.primitive.name for e in equations(jaxpr.jaxpr)].count('dot_general') == 1


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_dense_general_gradients_match_float64(dtype):
  """Both gradients equal the float64 formulas; the kernel's comes back float32 and unrounded.

  In bf16 the gradient matmuls take bf16 operands (the float32-accumulated
  product's cotangent is not promoted to float32 matmuls).
  """
  rng = np.random.default_rng(7)
  dense = DenseGeneral((4, 8), (2, 16), axes=('a', 'b', 'c', 'd'), dtype=getattr(jnp, dtype),
                       rngs=nnx.Rngs(0))
  x = jnp.asarray(rng.normal(size=(3, 5, 4, 8)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(3, 5, 2, 16)), jnp.float32)
  graphdef, state = nnx.split(dense)

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x).astype(jnp.float32) * weights)

  g_state, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x)
  kernel = np.asarray(state['kernel'][...], np.float64)
  x64, w64 = np.asarray(x, np.float64), np.asarray(weights, np.float64)
  if dtype == 'bfloat16':  # the operands the matmuls see
    kernel = np.asarray(jnp.asarray(kernel, jnp.bfloat16), np.float64)
    x64 = np.asarray(jnp.asarray(x64, jnp.bfloat16), np.float64)
    w64 = np.asarray(jnp.asarray(w64, jnp.bfloat16), np.float64)
  ref_kernel = np.einsum('btij,btok->ijok', x64, w64)
  ref_x = np.einsum('btok,ijok->btij', w64, kernel)
  assert g_state['kernel'][...].dtype == jnp.float32 and g_x.dtype == jnp.float32
  tol = 1e-5 if dtype == 'float32' else 1e-2
  np.testing.assert_allclose(g_state['kernel'][...], ref_kernel, rtol=0,
                             atol=tol * np.abs(ref_kernel).max())
  np.testing.assert_allclose(g_x, ref_x, rtol=0, atol=tol * np.abs(ref_x).max())
  if dtype == 'bfloat16':  # float32 accumulation, no bf16 rounding of the kernel gradient
    assert np.abs(np.asarray(g_state['kernel'][...]) - ref_kernel).max() < 1e-4 * np.abs(
        ref_kernel).max()
    grad_jaxpr = jax.make_jaxpr(jax.grad(loss))(state, x).jaxpr
    dots = [e for e in equations(grad_jaxpr) if e.primitive.name == 'dot_general']
    assert len(dots) == 3
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


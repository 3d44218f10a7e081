"""Quantized training through qwix: numbers vs a float64 NumPy fake-quant, Trainer runs."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx import cli
from maxnnx.config import MeshConfig
from maxnnx.data import TokenWindows
from maxnnx.layers.linear import DenseGeneral
from maxnnx.models.transformer import Transformer
from maxnnx.train import TrainConfig, Trainer
from maxnnx.train.quantization import (
                                       EXPERTS_PATH,
                                       PROJECTIONS_PATH,
                                       is_quantized,
                                       quantization_rules,
                                       quantize,
                                       rule,
)

HEADROOM = 1.0001  # the recipes' absmax calibration ('absmax,1.0001')
INT8_BOUND, FP8_MAX = 127.5, 448.0  # qwix: int8 scale = absmax / 127.5; e4m3fn max 448


def _no_ties(x, contract_axes, bound):
  """``x`` with every value nudged off the int8 rounding ties (float32 vs float64 noise).

  The scale is the absmax over ``contract_axes``; the largest value of each
  channel is made positive so it maps to +127 whatever the last bit says.
  """
  x = np.array(x, np.float64)
  absmax = np.max(np.abs(x), axis=contract_axes, keepdims=True)
  x = np.where(np.abs(x) == absmax, absmax, x)
  t = x / (absmax * HEADROOM / bound)
  near_tie = np.abs(np.abs(t - np.trunc(t)) - 0.5) < 1e-3
  x = np.where(near_tie, x - 0.01 * np.sign(x) * absmax * HEADROOM / bound, x)
  return x.astype(np.float32)


def _fake_quant(x, contract_axes, qtype):
  """Symmetric absmax quantize-dequantize in float64, one scale per non-contracted index."""
  x = np.asarray(x, np.float64)
  bound = INT8_BOUND if qtype == 'int8' else FP8_MAX
  scale = np.max(np.abs(x), axis=contract_axes, keepdims=True) * HEADROOM / bound
  t = x / scale
  if qtype == 'int8':
    q = np.clip(np.rint(t), -128, 127)
  else:
    q = np.clip(t, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  return q * scale


def _dense(in_shape, out_shape, seed):
  names = {1: ('embed',), 2: ('heads', 'head_dim')}
  axes = (names[len(in_shape)] + names[len(out_shape)] if len(in_shape) != len(out_shape)
          else ('embed', 'mlp'))
  return DenseGeneral(in_shape, out_shape, axes=axes, rngs=nnx.Rngs(seed))


def _dense_case(in_shape, out_shape, qtype, seed=0):
  """A DenseGeneral with tie-free weights and input, its kernel, input and contraction."""
  rng = np.random.default_rng(seed)
  layer = _dense(in_shape, out_shape, seed)
  n_in = len(in_shape)
  bound = INT8_BOUND if qtype == 'int8' else FP8_MAX
  kernel = rng.normal(size=in_shape + out_shape) * 0.2
  x = rng.normal(size=(3, 5) + in_shape)
  if qtype == 'int8':
    kernel = _no_ties(kernel, tuple(range(n_in)), bound)
    x = _no_ties(x, tuple(range(2, 2 + n_in)), bound)
  layer.kernel[...] = jnp.asarray(kernel, jnp.float32)
  return layer, np.asarray(kernel, np.float32), np.asarray(x, np.float32), n_in


@pytest.mark.parametrize('qtype', ['int8', 'fp8'])
@pytest.mark.parametrize('in_shape, out_shape', [((32,), (4, 8)), ((4, 8), (24,))])
def test_quantized_dense_matches_float64_fake_quant(qtype, in_shape, out_shape):
  """Per-output-channel weight scales, per-token activation scales, as qwix's QAT does."""
  layer, kernel, x, n_in = _dense_case(in_shape, out_shape, qtype)
  quantized = quantize(layer, [rule(qtype)])
  y = np.asarray(jax.jit(lambda m, x: m(x))(quantized, x), np.float64)

  x_q = _fake_quant(x, tuple(range(2, 2 + n_in)), qtype)
  k_q = _fake_quant(kernel, tuple(range(n_in)), qtype)
  contract = (tuple(range(2, 2 + n_in)), tuple(range(n_in)))
  y_ref = np.tensordot(x_q, k_q, axes=contract)
  y_fp = np.tensordot(x.astype(np.float64), kernel.astype(np.float64), axes=contract)
  tol = 2e-5 * np.abs(y_ref).max()
  np.testing.assert_allclose(y, y_ref, rtol=0, atol=tol)
  assert np.abs(y - y_fp).max() > 20 * tol  # the quantization is really there
  assert np.abs(y - y_fp).max() < (0.05 if qtype == 'int8' else 0.2) * np.abs(y_fp).max()
  assert not is_quantized(layer) and is_quantized(quantized)


def test_int8_gradients_are_straight_through():
  """d/dW and d/dx of 0.5 * |y_q|^2: the float formulas evaluated at the quantized output."""
  layer, kernel, x, _ = _dense_case((32,), (24,), 'int8', seed=1)
  quantized = quantize(layer, [rule('int8')])

  def loss(model, x):
    return 0.5 * jnp.sum(model(x) ** 2)

  grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
  g_model, g_x = grad_fn(quantized, x)
  g_kernel = np.asarray(g_model.kernel[...], np.float64)
  y_q = np.tensordot(_fake_quant(x, (2,), 'int8'), _fake_quant(kernel, (0,), 'int8'), axes=1)
  x64, k64 = x.astype(np.float64), kernel.astype(np.float64)
  ref_kernel = np.einsum('bti,bto->io', x64, y_q)
  ref_x = np.einsum('bto,io->bti', y_q, k64)
  tol = 2e-5
  np.testing.assert_allclose(g_kernel, ref_kernel, rtol=0, atol=tol * np.abs(ref_kernel).max())
  np.testing.assert_allclose(np.asarray(g_x), ref_x, rtol=0, atol=tol * np.abs(ref_x).max())
  # Close to the float gradient, yet not it.
  fp_kernel = np.einsum('bti,bto->io', x64, np.tensordot(x64, k64, axes=1))
  gap = np.abs(g_kernel - fp_kernel).max() / np.abs(fp_kernel).max()
  assert 20 * tol < gap < 0.05


def test_default_rules_pick_projections_and_experts_only():
  """Attention/MLP/expert matmuls are quantized; embeddings, LM head, routers, norms are not."""
  for scan in (False, True):
    cfg = maxnnx.get_preset('tiny-moe', **{'runtime.scan_layers': scan,
                                           'moe.first_k_dense_layers': 1})
    model = nnx.eval_shape(lambda cfg=cfg: Transformer(cfg, rngs=nnx.Rngs(0)))
    nodes = {'/'.join(map(str, p)): node for p, node in nnx.iter_modules(model)}
    paths = list(nodes)
    projections = {p for p in paths if re.fullmatch(PROJECTIONS_PATH, p)}
    experts = {p for p in paths if re.fullmatch(EXPERTS_PATH, p)}
    assert {p.rsplit('/', 1)[-1] for p in projections} == {
        'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'}
    assert all(isinstance(nodes[p], DenseGeneral) for p in projections)
    moe = {p for p in paths if type(nodes[p]).__name__ == 'MoE'}
    assert moe and moe <= experts  # (a dense MLP there has no matmul of its own)
    assert not any('embed' in p or 'lm_head' in p or 'router' in p or 'norm' in p
                   for p in projections | experts)
  rules = quantization_rules('int8', maxnnx.get_preset('tiny-moe', **{'moe.dispatch': 'capacity'}))
  assert rules[1].op_names == ('einsum',) and rules[0].op_names == ('dot_general',)
  assert quantization_rules('fp8', maxnnx.get_preset('tiny'))[0].bwd_qtype == jnp.float8_e5m2


def test_quantized_model_keeps_state_and_sharding_metadata():
  model = Transformer(maxnnx.get_preset('tiny', num_layers=1), rngs=nnx.Rngs(0))
  quantized = quantize(model, 'int8')
  before, after = nnx.state(model), nnx.state(quantized)
  assert jax.tree.structure(before) == jax.tree.structure(after)
  for (path, a), (_, b) in zip(nnx.to_flat_state(before), nnx.to_flat_state(after)):
    assert type(a) is type(b) and a.get_metadata() == b.get_metadata(), path
    np.testing.assert_array_equal(a[...], b[...])
  ids = np.random.default_rng(0).integers(0, 512, (2, 16))
  forward = jax.jit(lambda m, ids: m(ids))
  assert np.abs(np.asarray(forward(quantized, ids) - forward(model, ids))).max() > 1e-3


def _trainer(quantization, steps=10, mesh=None, scan=False, **train):
  """A small model on a learnable stream (a repeating 0..15 ramp)."""
  mesh = mesh or MeshConfig(data=1)
  cfg = maxnnx.get_preset('tiny', vocab_size=64, num_layers=2, d_model=64, mlp_dim=128,
                          **{'runtime.scan_layers': scan})
  config = TrainConfig(steps=steps, global_batch_size=8, seq_len=32, learning_rate=1e-2,
                       log_every=steps, quantization=quantization, mesh=mesh, **train)
  data = TokenWindows(np.tile(np.arange(16), 300), 32, 8, seed=0)
  return Trainer(cfg, config, data=data)


def _losses(trainer):
  return np.array([r['loss'] for r in trainer.fit(log=lambda _: None)])


def test_int8_training_learns_like_fp32():
  fp32, int8 = _losses(_trainer('none', steps=8)), _losses(_trainer('int8', steps=8))
  assert int8[-1] < 0.7 * int8[0]
  np.testing.assert_allclose(int8, fp32, atol=0.08)  # 0.056 apart at most from today's init
  assert np.abs(int8 - fp32).max() > 1e-4  # not silently float


@pytest.mark.slow
def test_fp8_trains_on_cpu():
  """fp8 runs on CPU too (XLA computes the e4m3 matmuls in float)."""
  fp8 = _losses(_trainer('fp8', steps=8))
  assert fp8[-1] < 0.7 * fp8[0]
  assert np.abs(fp8 - _losses(_trainer('none', steps=8))).max() > 1e-4


@pytest.mark.slow  # ~25 s
def test_scanned_int8_on_a_mesh_matches_one_device():
  one, mesh = (_losses(_trainer('int8', steps=2, mesh=m, scan=True))
               for m in (MeshConfig(data=1), MeshConfig(data=2, fsdp=2, tensor=2)))
  np.testing.assert_allclose(mesh, one, rtol=2e-5)


def test_checkpoint_round_trip_under_quantization(tmp_path):
  first = _trainer('int8', steps=2, checkpoint_dir=str(tmp_path))
  first.fit(log=lambda _: None)
  first.close()
  resumed = _trainer('int8', steps=2, checkpoint_dir=str(tmp_path))
  assert resumed.restore_checkpoint() == 2 and is_quantized(resumed.model)
  for a, b in zip(jax.tree.leaves(nnx.state(first.model)),
                  jax.tree.leaves(nnx.state(resumed.model))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  batch = np.random.default_rng(0).integers(0, 64, (8, 33))
  np.testing.assert_allclose(resumed.step(batch)['loss'], first.step(batch)['loss'], rtol=1e-6)


def test_refusals_name_the_field_and_the_fix():
  with pytest.raises(ValueError, match=r"quantization='int8'.*mesh.stage=2.*mesh.stage=1"):
    _trainer('int8', mesh=MeshConfig(stage=2, data=4), scan=True)
  moe = maxnnx.get_preset('tiny-moe', **{'runtime.ragged_dot_impl': 'dense'})
  with pytest.raises(ValueError, match=r"ragged_dot_impl='dense'.*ragged_dot_impl='lax'"):
    Trainer(moe, TrainConfig(quantization='fp8', mesh=MeshConfig(data=1)))
  model = Transformer(maxnnx.get_preset('tiny', num_layers=1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='matches no module'):
    quantize(model, [rule('int8', 'decoder/.*')])
  custom = quantize(model, [rule('int8', r'layers/\d+/mlp/.*_proj')])
  with pytest.raises(ValueError, match="already quantized; set quantization='none'"):
    Trainer(custom, TrainConfig(quantization='int8', mesh=MeshConfig(data=1)))
  assert Trainer(custom, TrainConfig(mesh=MeshConfig(data=1))).quantization == 'custom'


@pytest.mark.slow
def test_cli_trains_int8(tmp_path, capsys):
  args = ['train', 'model=tiny', 'data=synthetic', 'quantization=int8', 'steps=2', 'log_every=1',
          'global_batch_size=4', 'seq_len=16', 'mesh.data=1', 'sample_tokens=0',
          f'output_dir={tmp_path}']
  assert cli.main(args) == 0, capsys.readouterr().err
  assert 'int8 quantized training' in capsys.readouterr().out

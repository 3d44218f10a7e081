"""Quantized inference (int8 / int4 / fp8 weights, w8a8): the rule against NumPy, the model
in generate and in the serving engine, and the memory it saves."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import qwix
from conftest import FIXTURES
from flax import nnx
from numpy_moe_reference import moe as moe_reference

import maxnnx
from maxnnx.inference.quantize import (
  MODES,
  check_mode,
  kernel_bytes,
  param_bytes,
  quantize_for_inference,
)
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.moe import MoE
from maxnnx.serving import Engine, SamplingParams

VOCAB = 64
MODEL = dict(vocab_size=VOCAB, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
             mlp_dim=128, max_position_embeddings=128, initializer_range=1.0,
             **{'runtime.dtype': 'float32'})


def _absmax_round(values, axis, bound, qtype=None):
  """qwix's symmetric absmax rule in float32: scale = amax * (1 / bound) (as XLA computes a
  division by a constant), values times the scale's reciprocal, rounded (or cast to
  ``qtype``) and clipped; returned dequantized, in float64."""
  values = values.astype(np.float32)
  scale = np.abs(values).max(axis=axis, keepdims=True) * np.float32(1 / bound)
  scaled = values * (np.float32(1) / scale)
  if qtype is None:
    q = np.clip(np.round(scaled), -np.ceil(bound), np.floor(bound))
  else:
    q = scaled.astype(qtype).astype(np.float32)
  return q.astype(np.float64) * scale.astype(np.float64)


def _expected_weight(w, mode):
  """The dequantized ``[in, heads, dim]`` kernel by each mode's rule (one scale per output
  channel; int4 also per group of 32 inputs): the largest magnitude maps to 127.5 (int8),
  7.5 (int4) or 448 (fp8)."""
  if mode == 'int4':
    groups = w.reshape(w.shape[0] // 32, 32, *w.shape[1:])
    return _absmax_round(groups, 1, 7.5).reshape(w.shape)
  if mode == 'fp8':
    return _absmax_round(w, 0, 448.0, ml_dtypes.float8_e4m3fn)
  return _absmax_round(w, 0, 127.5)


@pytest.mark.parametrize('mode', ['int8', 'int4', 'fp8', 'w8a8'])
def test_a_quantized_layer_computes_the_modes_rule(mode):
  """y = x . dequantize(quantize(w)) (and, under w8a8, x rounded to int8 per token), against
  float64 NumPy; the quantization error itself is far larger than the tolerance."""
  rng = np.random.default_rng()
  layer = DenseGeneral((96,), (4, 16), axes=('embed', 'heads', 'kv'), rngs=nnx.Rngs(0))
  w = rng.normal(size=(96, 4, 16)).astype(np.float32)
  layer.kernel.set_value(jnp.asarray(w))
  x = rng.normal(size=(2, 5, 96)).astype(np.float32)
  exact = np.einsum('btd,dhk->bthk', x.astype(np.float64), w.astype(np.float64))
  holder = nnx.Dict(layer=layer)
  quantize_for_inference(holder, mode)
  got = np.asarray(layer(jnp.asarray(x)), np.float64)
  x_ref = x.astype(np.float64)
  if mode == 'w8a8':
    x_ref = _absmax_round(x, -1, 127.5)
  want = np.einsum('btd,dhk->bthk', x_ref, _expected_weight(w, mode))
  tolerance = 2e-5 * np.abs(want).max()
  assert np.abs(got - want).max() < tolerance
  assert np.abs(exact - want).max() > 20 * tolerance  # quantization moved the result


def _model():
  return maxnnx.Transformer(maxnnx.ModelConfig.from_dict(MODEL), rngs=nnx.Rngs(5))


@pytest.mark.parametrize('mode,most', [('int8', 0.27), ('int4', 0.17), ('fp8', 0.27)])
def test_weights_take_the_bytes_the_mode_says(mode, most):
  """The quantized kernels take ~1/4 (8-bit) or ~1/6 (4-bit, a float32 scale per 32 values) of
  their float32 bytes, scales included, and param_bytes counts the saving."""
  model = _model()
  before, total_before = kernel_bytes(model), param_bytes(model)
  quantize_for_inference(model, mode)
  after = kernel_bytes(model)
  assert after < most * before, (mode, after / before)
  assert param_bytes(model) == total_before - before + after


@pytest.mark.parametrize('mode', ['int8', 'w8a8'])
def test_the_engine_serves_a_quantized_model_as_generate_does(mode):
  """Continuous batching over paged attention gives the quantized model's own greedy tokens."""
  model = quantize_for_inference(_model(), mode)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 9, 17)]
  want = maxnnx.generate(model, prompts, max_new_tokens=6, eos_ids=None)
  engine = Engine(model, page_size=4, max_batch=4, token_budget=32, max_model_len=64)
  got = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
  for i, done in enumerate(got):
    assert list(done.token_ids) == want.tokens[i].tolist(), i


def test_unknown_mode_and_quantizing_twice_are_refused():
  model = _model()
  with pytest.raises(ValueError, match="quantization='int3': expected one of int8, int4"):
    quantize_for_inference(model, 'int3')
  with pytest.raises(ValueError, match="quantization='int3': expected one of int8, int4"):
    check_mode('int3')
  check_mode('none')
  quantize_for_inference(model, 'int8')
  with pytest.raises(ValueError, match='already quantized'):
    quantize_for_inference(model, 'int8')


MOE = dict(vocab_size=64, d_model=64, num_layers=1, num_heads=2, num_kv_heads=2, mlp_dim=40,
           **{'moe.num_experts': 4, 'moe.num_experts_per_tok': 2, 'moe.mlp_dim': 64})


def _expected_experts(w, mode):
  """The dequantized ``[experts, in, out]`` weight by the mode's rule: one scale per expert and
  output channel (int4: also per 32 inputs)."""
  if mode == 'int4':
    groups = w.reshape(w.shape[0], w.shape[1] // 32, 32, w.shape[2])
    return _absmax_round(groups, 2, 7.5).reshape(w.shape)
  if mode == 'fp8':
    return _absmax_round(w, 1, 448.0, ml_dtypes.float8_e4m3fn)
  return _absmax_round(w, 1, 127.5)


@pytest.mark.parametrize('mode,dispatch', [('int8', 'dropless'), ('fp8', 'dropless'),
                                           ('int4', 'dropless'), ('int8', 'capacity')])
def test_quantized_experts_compute_the_modes_rule(mode, dispatch):
  """The routed experts' weights are QArrays (one scale per expert and output channel) and the
  MoE block computes the float64 NumPy reference on their dequantized values, through the
  grouped matmul (dropless) and the per-expert buffers (capacity, with room for every token);
  the router stays float, so every token reaches the experts it reached before quantizing."""
  cfg = maxnnx.ModelConfig.from_dict({**MOE, 'moe.dispatch': dispatch, 'moe.capacity_factor': 2.0})
  moe = MoE.from_config(cfg, rngs=nnx.Rngs(3))
  x = jax.random.normal(jax.random.key(4), (2, 6, cfg.d_model), jnp.float32)
  params = nnx.to_pure_dict(nnx.state(moe, nnx.Param))
  exact = moe_reference(np.asarray(x).reshape(-1, cfg.d_model), params, cfg)[0]
  for name in ('gate_proj', 'up_proj', 'down_proj'):
    params['experts'][name] = _expected_experts(np.asarray(params['experts'][name]), mode)
  want = moe_reference(np.asarray(x).reshape(-1, cfg.d_model), params, cfg)[0]
  router_before = np.asarray(moe.router.kernel[...])
  quantize_for_inference(nnx.Dict(moe=moe), mode)
  for name in ('gate_proj', 'up_proj', 'down_proj'):
    weight = getattr(moe.experts, name)[...]
    assert isinstance(weight, qwix.QArray) and weight.qvalue.dtype == MODES[mode][0]
  np.testing.assert_array_equal(np.asarray(moe.router.kernel[...]), router_before)
  got = np.asarray(moe(x), np.float64).reshape(-1, cfg.d_model)
  tolerance = 2e-5 * np.abs(want).max()
  assert np.abs(got - want).max() < tolerance
  assert np.abs(exact - want).max() > 20 * tolerance  # quantization moved the result


def test_quantized_experts_take_their_share_of_the_bytes():
  """An MoE model: quantize_for_inference covers the experts, so the weights it quantizes
  (experts included) take under 0.27x their float32 bytes in int8."""
  model = maxnnx.Transformer(maxnnx.ModelConfig.from_dict(
      {**MOE, 'runtime.dtype': 'float32'}), rngs=nnx.Rngs(0))
  experts = sum(getattr(layer.mlp.experts, n)[...].size * 4 for layer in model.layers
                for n in ('gate_proj', 'up_proj', 'down_proj'))
  before = kernel_bytes(model)
  assert experts > before / 2  # most of what is quantized is experts
  quantize_for_inference(model, 'int8')
  assert kernel_bytes(model) < 0.27 * before
  ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (1, 5)))
  assert np.isfinite(np.asarray(model(ids))).all()


def test_a_kept_quantized_release_is_served_as_generate_serves_it():
  """A qwen3 fp8-block release loaded with keep_quantized=True: the engine runs its stored fp8
  kernels as loaded (no float copy is made; the kernels are QArrays) and gives generate's
  greedy tokens; quantizing it again, or quantization='checkpoint' after loading, is refused."""
  model = maxnnx.from_pretrained(os.path.join(FIXTURES, 'quantized', 'qwen3_fp8'),
                                 dtype='float32', keep_quantized=True)
  kernel = model.layers[0].mlp.down_proj.kernel[...]
  assert isinstance(kernel, qwix.QArray) and kernel.qvalue.dtype == jnp.float8_e4m3fn
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (4, 11)]
  want = maxnnx.generate(model, prompts, max_new_tokens=5, eos_ids=None)
  engine = Engine(model, page_size=4, max_batch=2, token_budget=16, max_model_len=32)
  got = engine.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
  for i, done in enumerate(got):
    assert list(done.token_ids) == want.tokens[i].tolist(), i
  check_mode('checkpoint')
  with pytest.raises(ValueError, match="quantization='checkpoint' keeps .* keep_quantized=True"):
    quantize_for_inference(model, 'checkpoint')


def test_a_scanned_stack_gets_one_scale_per_layer_and_output_channel():
  """Under scan_layers the kernels carry a leading layer axis, which is not an input axis: int8
  scales are ``[layers, 1, out]``, each layer's its own kernel's absmax over the inputs."""
  cfg = maxnnx.ModelConfig.from_dict({**MODEL, 'runtime.scan_layers': True})
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(5))
  weight = np.asarray(model.layers.mlp.up_proj.kernel[...])
  kernel = quantize_for_inference(model, 'int8').layers.mlp.up_proj.kernel[...]
  assert kernel.scale.shape == (cfg.num_layers, 1, cfg.mlp_dim)
  np.testing.assert_allclose(np.asarray(kernel.scale),
                             np.abs(weight).max(axis=1, keepdims=True) / 127.5, rtol=1e-6)


@pytest.mark.parametrize('mode', ['int8', 'int4'])
def test_a_quantized_model_shards_over_fsdp_as_a_float_one(mode):
  """On ``fsdp=8`` the quantized values split over their input axis as the float kernel would,
  while each scale, too short along that axis to split, is placed by its own shape; the
  logits equal one device's."""
  from maxnnx.config import MeshConfig
  from maxnnx.sharding import logical_rules, make_mesh, state_shardings, use_mesh
  cfg = maxnnx.ModelConfig.from_dict(MODEL)
  model = quantize_for_inference(maxnnx.Transformer(cfg, rngs=nnx.Rngs(2)), mode)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 16)), jnp.int32)
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
  single = np.asarray(forward(state, ids))
  mesh_config = MeshConfig(data=1, fsdp=8)
  mesh, rules = make_mesh(mesh_config), logical_rules(mesh_config)
  placed = jax.device_put(state, state_shardings(state, mesh, rules))
  kernel = placed['layers'][0]['mlp']['up_proj']['kernel'][...]
  assert kernel.qvalue.sharding.spec[0] == 'fsdp'  # [embed, mlp]: split over its inputs
  # One scale row (int8), or one per 32 inputs (int4: 2): too few to split eight ways.
  assert kernel.scale.shape[0] == {'int8': 1, 'int4': 2}[mode]
  assert kernel.scale.sharding.spec[0] is None
  with use_mesh(mesh, rules):
    np.testing.assert_allclose(np.asarray(forward(placed, ids)), single, rtol=1e-5, atol=1e-5)

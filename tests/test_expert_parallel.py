"""Expert parallelism by all-to-all (``mesh.expert_parallel_strategy=all_to_all``) on 8
simulated CPU devices.

The MoE block's outputs, parameter gradients and auxiliary statistics equal the ``gspmd``
strategy's (the reference) on the same mesh, for dropless and (where nothing drops) capacity
dispatch; the compiled layer exchanges tokens with all-to-alls and neither all-gathers nor
all-reduces them (the ``gspmd`` layer does).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from maxnnx.checkpoint.run_lock import LOCK_NAME
from maxnnx.config import ConfigError, MeshConfig, ModelConfig
from maxnnx.layers.moe import MoE, RouterBias
from maxnnx.sharding import logical_rules, make_mesh, spec_for, state_shardings, use_mesh

BATCH, LENGTH = 8, 7  # every count of tokens or assignments is a multiple of 7
BASE = dict(vocab_size=64, d_model=16, num_layers=1, num_heads=2, num_kv_heads=2, mlp_dim=24,
            **{'moe.num_experts': 8, 'moe.num_experts_per_tok': 2, 'moe.mlp_dim': 8})
VARIANTS = {
    # Sigmoid scores with the balancing bias choosing experts, groups, two shared experts.
    'deepseek_v3': {'moe.router_score': 'sigmoid', 'moe.router_score_bias': True,
                    'moe.router_groups': 4,
                        'moe.router_topk_groups': 2, 'moe.router_group_score': 'top2_sum',
                        'moe.router_scaling_factor': 2.5, 'moe.num_shared_experts': 2},
    # Projection bias on the router, expert biases, clamped SwiGLU, four experts a token.
    'gpt_oss': {'moe.router_bias': True, 'moe.expert_bias': True, 'moe.swiglu_limit': 1.5,
                'moe.num_experts_per_tok': 4},
    # Routing weights scale the experts' inputs; a shared expert.
    'llama4': {'moe.router_score': 'sigmoid', 'moe.router_norm_topk': False,
               'moe.num_shared_experts': 1,
               'moe.router_weights_on_input': True},
}
MESHES = {'data2_expert4': MeshConfig(data=2, expert=4), 'expert8': MeshConfig(data=1, expert=8)}


def _module(cfg):
  """The block with random biases (router, balancing, expert), so every one of them counts."""
  moe = MoE.from_config(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  for path, node in nnx.iter_graph(moe):
    if isinstance(node, nnx.Param) and (isinstance(node, RouterBias) or 'bias' in str(path[-1])):
      node[...] = jnp.asarray(rng.normal(size=node.shape) * 0.3, node.dtype)
  return moe


def _run(cfg, mesh_config, strategy):
  """Output, parameter gradients, aux statistics and compiled HLO of the block under
  ``mesh_config`` with the experts crossing ``expert`` by ``strategy``."""
  moe = _module(cfg)
  mesh, rules = make_mesh(mesh_config), logical_rules(mesh_config)
  graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
  params = jax.device_put(params, state_shardings(params, mesh, rules))
  x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, cfg.d_model), jnp.float32)
  tokens = spec_for(('activation_batch', 'activation_length', 'activation_embed'), rules, mesh,
                    x.shape)
  x = jax.device_put(x, NamedSharding(mesh, tokens))
  cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)

  def loss(params, rest, x):
    block = nnx.merge(graphdef, params, rest, copy=True)
    y = block(x)
    aux = (block.tokens_per_expert[...], block.load_balance_loss[...],
           block.router_z_loss[...])
    return jnp.sum(y * cotangent) + aux[1] + aux[2], (y, aux)

  with use_mesh(mesh, rules, expert_parallel_strategy=strategy):
    step = jax.jit(jax.grad(loss, has_aux=True))
    compiled = step.lower(params, rest, x).compile()
    grads, (y, aux) = compiled(params, rest, x)
  return y, nnx.to_pure_dict(grads), aux, compiled.as_text()


def _assert_same(got, want):
  (y, grads, aux, _), (y_ref, grads_ref, aux_ref, _) = got, want
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
  # Gradients sum over tokens in another order (atol: entries near zero).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                                       atol=1e-5), grads, grads_ref)
  np.testing.assert_array_equal(np.asarray(aux[0]), np.asarray(aux_ref[0]))
  for a, b in zip(aux[1:], aux_ref[1:]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def _cfg(variant, **changes):
  return ModelConfig.from_dict({**BASE, **VARIANTS[variant], **changes})


# The default run keeps one case of each test (a few seconds each alone; they compile twice).
SLOW = pytest.mark.slow


@pytest.mark.parametrize('variant,mesh', [
    pytest.param(v, m, marks=[] if (v, m) == ('deepseek_v3', 'data2_expert4') else [SLOW])
    for v in sorted(VARIANTS) for m in sorted(MESHES)])
def test_dropless_all_to_all_equals_gspmd(variant, mesh):
  cfg = _cfg(variant)
  _assert_same(_run(cfg, MESHES[mesh], 'all_to_all'), _run(cfg, MESHES[mesh], 'gspmd'))


@SLOW
def test_dense_ragged_dot_kernel_on_each_shard():
  """The grouped matmul on each shard is the block's ``ragged_dot_impl`` (here ``dense``,
  which multiplies the padding rows too)."""
  cfg = _cfg('deepseek_v3', **{'runtime.ragged_dot_impl': 'dense'})
  mesh = MESHES['data2_expert4']
  _assert_same(_run(cfg, mesh, 'all_to_all'), _run(cfg, mesh, 'gspmd'))


@pytest.mark.parametrize('mesh', ['data2_expert4', pytest.param('expert8', marks=SLOW)])
def test_capacity_all_to_all_equals_capacity_dispatch_when_nothing_drops(mesh):
  """Slots for every local assignment (capacity_factor = experts / k): nothing drops on any
  shard, so the result is the GSPMD capacity dispatch's, and the dropless block's."""
  cfg = _cfg('deepseek_v3', **{'moe.dispatch': 'capacity', 'moe.capacity_factor': 4.0})
  got = _run(cfg, MESHES[mesh], 'all_to_all')
  _assert_same(got, _run(cfg, MESHES[mesh], 'gspmd'))
  _assert_same(got, _run(_cfg('deepseek_v3'), MESHES[mesh], 'gspmd'))


def _quantized_forward(cfg, mesh_config, strategy, mode):
  """The block's output with its experts (and shared experts) quantized for inference, and
  the compiled HLO, on ``mesh_config`` (``None``: one device, no mesh)."""
  from maxnnx.inference.quantize import quantize_for_inference
  graphdef, state = nnx.split(quantize_for_inference(_module(cfg), mode))
  x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, cfg.d_model), jnp.float32)
  forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
  if mesh_config is None:
    return np.asarray(forward(state, x)), ''
  mesh, rules = make_mesh(mesh_config), logical_rules(mesh_config)
  state = jax.device_put(state, state_shardings(state, mesh, rules))
  with use_mesh(mesh, rules, expert_parallel_strategy=strategy):
    # Run through the jit's own dispatch: an ahead-of-time compiled call refuses int4 arrays
    # placed by device_put (their sub-byte layout differs from the one it compiled for).
    return (np.asarray(forward(state, x)),
            forward.lower(state, x).compile().as_text())


@pytest.mark.parametrize('mode,dispatch', [
    ('int8', {}), ('fp8', {'moe.dispatch': 'capacity', 'moe.capacity_factor': 4.0}),
    pytest.param('int4', {}, marks=SLOW)])
def test_quantized_experts_exchange_tokens_by_all_to_all(mode, dispatch):
  """Experts quantized for inference (their values split over ``expert``, their scales placed
  by their own shape) give the one-device output under both strategies, and the all_to_all
  layer exchanges tokens with all-to-alls."""
  cfg = _cfg('deepseek_v3', **dispatch)
  single, _ = _quantized_forward(cfg, None, None, mode)
  got, hlo = _quantized_forward(cfg, MESHES['data2_expert4'], 'all_to_all', mode)
  reference, _ = _quantized_forward(cfg, MESHES['data2_expert4'], 'gspmd', mode)
  np.testing.assert_allclose(got, single, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(reference, single, rtol=1e-5, atol=1e-5)
  assert 'all-to-all' in hlo


def _token_collectives(hlo: str) -> list[str]:
  """Shapes of ``[.., d_model]`` float arrays with a dimension that counts tokens (a multiple
  of ``LENGTH``, which no weight dimension is) in all-gathers or all-reduces: tokens, or their
  expert results, assembled from other devices (GSPMD does it with masked all-reduces)."""
  shapes = [shape for line in hlo.splitlines()
            for op in (' all-gather(', ' all-reduce(') if op in line
            for shape in re.findall(r'f32\[([\d,]*),16\]', line.split(op)[0])]
  return [s for s in shapes if any(int(n) % LENGTH == 0 for n in s.split(',') if n)]


@pytest.mark.parametrize('dispatch', ['dropless', pytest.param('capacity', marks=SLOW)])
def test_compiled_layer_exchanges_tokens_with_all_to_all(dispatch):
  cfg = _cfg('llama4', **{'moe.dispatch': dispatch, 'moe.capacity_factor': 4.0})
  hlo = _run(cfg, MESHES['data2_expert4'], 'all_to_all')[3]
  assert hlo.count(' all-to-all(') >= 4  # forward out and back, and their transposes
  assert not _token_collectives(hlo), _token_collectives(hlo)


def test_gspmd_moves_tokens_by_collectives_all_to_all_does_not_use():
  """The check above can fail: the reference strategy's compiled layer assembles tokens
  across devices."""
  hlo = _run(_cfg('llama4'), MESHES['data2_expert4'], 'gspmd')[3]
  assert _token_collectives(hlo)


def test_cli_refuses_experts_that_do_not_split_before_writing(tmp_path, capsys):
  from maxnnx import cli  # noqa: PLC0415
  out = tmp_path / 'run'
  out.mkdir()
  (out / 'notes.txt').write_text('kept')
  code = cli.main(['train', 'model=tiny-moe', 'model.moe.num_experts=6', 'data=synthetic',
                   'steps=1', 'mesh.data=2', 'mesh.expert=4',
                   'mesh.expert_parallel_strategy=all_to_all', f'output_dir={out}'])
  err = capsys.readouterr().err.strip()
  assert code == 2
  assert err.splitlines() == [err] and 'moe.num_experts=6 over 4 expert shards' in err
  assert sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME) == ['notes.txt']
  assert (out / 'notes.txt').read_text() == 'kept'


def test_experts_that_do_not_split_over_the_mesh_are_refused():
  cfg = _cfg('llama4', **{'moe.num_experts': 6})
  with pytest.raises(ConfigError, match=r'moe.num_experts=6 over 4 expert shards.*'
                                        r'expert_parallel_strategy=gspmd'):
    _run(cfg, MESHES['data2_expert4'], 'all_to_all')


def _layer_temporaries(strategy: str) -> int:
  """Temporary bytes per device of the compiled gradient of a dropless block (64 tokens a
  device, 8 experts over ``expert=8``) whose tokens cross ``expert`` by ``strategy``."""
  cfg = ModelConfig.from_dict({**BASE, 'd_model': 64, 'moe.mlp_dim': 16})
  graphdef, params, rest = nnx.split(MoE.from_config(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  mesh_config = MESHES['expert8']
  mesh, rules = make_mesh(mesh_config), logical_rules(mesh_config)
  params = jax.device_put(params, state_shardings(params, mesh, rules))
  x = jax.random.normal(jax.random.key(1), (8, 64, cfg.d_model), jnp.float32)
  x = jax.device_put(x, NamedSharding(mesh, spec_for(
      ('activation_batch', 'activation_length', 'activation_embed'), rules, mesh, x.shape)))

  def loss(params, rest, x):
    return jnp.sum(nnx.merge(graphdef, params, rest, copy=True)(x))

  with use_mesh(mesh, rules, expert_parallel_strategy=strategy):
    compiled = jax.jit(jax.grad(loss)).lower(params, rest, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


# jax 0.12's CPU compile gives both layers about the same temporaries here (0.97x), with or
# without the zeroed buffer; the saving shows in jax 0.10's CPU compile and in jax 0.12's TPU
# compile (the v5p figures in benchmarks/RESULTS.md).
@pytest.mark.xfail(tuple(int(p) for p in jax.__version__.split('.')[:2]) >= (0, 12),
                   strict=True, reason="jax 0.12's CPU temporaries do not show the zeroed buffer")
def test_dropless_exchange_unsorts_without_a_zeroed_copy_of_its_buffer():
  """The experts' results go back to arrival order by a gather in the exchange's dtype; a
  scatter into a zeroed float32 buffer (``expert`` x the local assignments, the layer's
  largest) needed 0.98x the ``gspmd`` layer's temporaries here (0.67x now). Compiled for v5p-256,
  the deepseek-v3 preset at fsdp 16 x expert 8 went from 87.33 to 80.15 GiB."""
  assert _layer_temporaries('all_to_all') < 0.8 * _layer_temporaries('gspmd')

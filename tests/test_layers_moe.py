"""MoE block against a float64 NumPy reference: routing variants, both dispatch modes,
auxiliary outputs, the balancing-bias rule, and gradients of the auxiliary losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from numpy_moe_reference import moe as moe_reference
from numpy_reference import assert_close

from maxnnx.config import ConfigError, ModelConfig
from maxnnx.layers.moe import (
                               MoE,
                               MoeAux,
                               RouterBias,
                               capacity,
                               moe_aux_losses,
                               moe_stats,
                               router_bias_update,
                               update_router_bias,
)
from maxnnx.models.counting import num_active_params, num_params
from maxnnx.models.transformer import Transformer

BASE = dict(vocab_size=64, d_model=24, num_layers=2, num_heads=2, num_kv_heads=2, mlp_dim=40,
            **{'moe.num_experts': 8, 'moe.num_experts_per_tok': 2, 'moe.mlp_dim': 16})

VARIANTS = {
    'mixtral': dict(),
    'qwen3_moe_unnormalised': {'moe.router_norm_topk': False, 'moe.num_experts_per_tok': 3},
    'deepseek_v3': {'moe.router_score': 'sigmoid', 'moe.router_score_bias': True,
                    'moe.router_groups': 4, 'moe.router_topk_groups': 2,
                    'moe.router_group_score': 'top2_sum', 'moe.router_scaling_factor': 2.5,
                    'moe.num_shared_experts': 2},
    'deepseek_v2': {'moe.router_groups': 4, 'moe.router_topk_groups': 2,
                    'moe.router_group_score': 'max', 'moe.router_norm_topk': False,
                    'moe.router_scaling_factor': 1.5, 'moe.num_shared_experts': 1},
    'gpt_oss': {'moe.router_bias': True, 'moe.expert_bias': True, 'moe.swiglu_limit': 1.5,
                'moe.swiglu_alpha': 1.702, 'moe.num_experts_per_tok': 4},
    'gelu_experts': dict(mlp_activation='gelu_tanh'),
    'llama4': {'moe.router_score': 'sigmoid', 'moe.router_norm_topk': False,
               'moe.num_shared_experts': 1, 'moe.router_weights_on_input': True},
}


def _cfg(**overrides):
  return ModelConfig.from_dict({**BASE, **overrides})


def _module(cfg, seed=0):
  moe = MoE.from_config(cfg, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  for path, node in nnx.iter_graph(moe):
    if isinstance(node, nnx.Param) and (isinstance(node, RouterBias) or 'bias' in str(path[-1])
                                        or path[-1] == 'scale'):
      node[...] = jnp.asarray(rng.normal(size=node.shape) * 0.3, node.dtype)
  return moe


def _params(moe):
  return nnx.to_pure_dict(nnx.state(moe, nnx.Param))


def _x(cfg, n=24, seed=1):
  return jax.random.normal(jax.random.key(seed), (2, n // 2, cfg.d_model), jnp.float32)


@pytest.mark.parametrize('variant', sorted(VARIANTS))
@pytest.mark.parametrize('ragged_dot_impl', ['lax', 'dense'])
def test_dropless_matches_numpy_reference(variant, ragged_dot_impl):
  cfg = _cfg(**VARIANTS[variant], **{'runtime.ragged_dot_impl': ragged_dot_impl})
  moe = _module(cfg)
  x = _x(cfg)
  out = moe(x)
  ref, counts, balance, z_loss = moe_reference(np.asarray(x).reshape(-1, cfg.d_model),
                                               _params(moe), cfg)
  assert_close(out.reshape(-1, cfg.d_model), ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(moe.tokens_per_expert[...], counts)
  assert_close(moe.load_balance_loss[...], balance, rtol=1e-5)
  assert_close(moe.router_z_loss[...], z_loss, rtol=1e-5)


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_capacity_dispatch_equals_dropless_when_nothing_drops(variant):
  """capacity_factor = E / k gives every expert room for every token."""
  cfg = _cfg(**VARIANTS[variant])
  big = cfg.replace(**{'moe.dispatch': 'capacity'},
                    **{'moe.capacity_factor': cfg.moe.num_experts / cfg.moe.num_experts_per_tok})
  x = _x(cfg)
  assert capacity(24, big.moe) == 24
  dropless = _module(cfg)(x)
  capped = nnx.merge(nnx.graphdef(_module(big)), nnx.state(_module(cfg)))(x)
  assert_close(capped, np.asarray(dropless, np.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('variant', ['mixtral', 'deepseek_v3'])
@pytest.mark.parametrize('group', ['sequence', 'batch'])
def test_capacity_dispatch_drops_overflow_like_the_reference(variant, group):
  """``sequence``: each of the 2 rows of 16 tokens has ceil(0.5 * 16 * 2 / 8) = 2 slots per
  expert and drops on its own; ``batch``: the 32 tokens share 4 slots per expert."""
  cfg = _cfg(**VARIANTS[variant], **{'moe.dispatch': 'capacity', 'moe.capacity_factor': 0.5,
                                     'moe.capacity_group': group})
  moe = _module(cfg)
  x = _x(cfg, n=32)
  x_ND = np.asarray(x).reshape(-1, cfg.d_model)
  group_size = x.shape[1] if group == 'sequence' else 32
  slots = capacity(group_size, cfg.moe)
  assert slots == {'sequence': 2, 'batch': 4}[group]
  ref, counts, _, _ = moe_reference(x_ND, _params(moe), cfg, capacity=slots,
                                    group_size=group_size)
  full, _, _, _ = moe_reference(x_ND, _params(moe), cfg)
  other = (moe_reference(x_ND, _params(moe), cfg, capacity=4) if group == 'sequence' else
           moe_reference(x_ND, _params(moe), cfg, capacity=2, group_size=16))[0]
  assert counts.max() > 2 * slots, 'the test needs an overloaded expert'
  assert np.abs(ref - full).max() > 1e-3 and np.abs(ref - other).max() > 1e-3
  assert_close(moe(x).reshape(-1, cfg.d_model), ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_stays_close():
  cfg = _cfg(**VARIANTS['deepseek_v3'])
  moe = _module(cfg)
  x = _x(cfg)
  ref = moe_reference(np.asarray(x).reshape(-1, cfg.d_model), _params(moe), cfg)[0]
  bf16_cfg = cfg.replace(**{'runtime.dtype': 'bfloat16'})
  bf16 = nnx.merge(nnx.graphdef(MoE.from_config(bf16_cfg, rngs=nnx.Rngs(0))),
                   nnx.state(moe))
  out = bf16(x.astype(jnp.bfloat16))
  assert out.dtype == jnp.bfloat16
  assert_close(out.reshape(-1, cfg.d_model), ref, rtol=5e-2, atol=5e-2)


def test_router_bias_update_rule():
  bias = jnp.array([0.0, 0.1, -0.2, 0.0])
  load = jnp.array([10.0, 2.0, 2.0, 2.0])     # mean 4: expert 0 over-loaded
  np.testing.assert_allclose(router_bias_update(bias, load, 0.01), [-0.01, 0.11, -0.19, 0.01])
  cfg = _cfg(**VARIANTS['deepseek_v3'], **{'runtime.scan_layers': True})
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  nnx.jit(lambda m, x: m(x))(model, jnp.zeros((1, 8), jnp.int32))  # one token: skewed load
  load = model.layers.mlp.tokens_per_expert[...]
  before = np.asarray(model.layers.mlp.router.e_score_correction_bias[...])
  update_router_bias(model, 0.5)
  after = np.asarray(model.layers.mlp.router.e_score_correction_bias[...])
  expected = before + 0.5 * np.sign(np.asarray(load).mean(-1, keepdims=True) - load)
  np.testing.assert_allclose(after, expected)
  assert (after[np.asarray(load) > 2] < before[np.asarray(load) > 2]).all()


@pytest.mark.parametrize('scan_layers', [pytest.param(False, marks=pytest.mark.slow), True])
def test_aux_outputs_are_collected_and_differentiable(scan_layers):
  cfg = _cfg(num_layers=3, **{'moe.first_k_dense_layers': 1, 'runtime.scan_layers': scan_layers})
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size)

  def loss_fn(model):
    model(ids)
    losses = moe_aux_losses(model)
    return losses['load_balance_loss'] + losses['router_z_loss'], losses

  (_, losses), grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(model)
  stats = moe_stats(model)
  assert stats.shape == (2, cfg.moe.num_experts)
  np.testing.assert_array_equal(stats.sum(axis=1), 32 * cfg.moe.num_experts_per_tok)
  assert float(losses['load_balance_loss']) > 0 and float(losses['router_z_loss']) > 0
  router_grads = [g for p, g in nnx.to_flat_state(grads) if 'router' in p and p[-1] == 'kernel']
  assert router_grads and all(float(jnp.abs(g[...]).max()) > 0 for g in router_grads)
  assert not any(isinstance(v, MoeAux) for _, v in nnx.to_flat_state(grads))


def test_moe_layer_layout_and_counts():
  cfg = _cfg(num_layers=5, **{'moe.first_k_dense_layers': 1, 'moe.layer_step': 2,
                              'moe.num_shared_experts': 1},
             **{'moe.router_score_bias': True})
  assert cfg.moe_layers == (False, True, False, True, False)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count == num_params(cfg)
  d, f, e = cfg.d_model, cfg.resolved_moe_mlp_dim, cfg.moe.num_experts
  assert num_params(cfg) - num_active_params(cfg) == 2 * (e - 2) * 3 * d * f
  assert model.layers[1].mlp.experts.gate_proj.get_metadata()['out_sharding'] == (
      'expert', 'embed', 'mlp')


@pytest.mark.parametrize('bad,match', [
    ({'moe.num_experts_per_tok': 9}, 'num_experts_per_tok'),
    ({'moe.router_groups': 3}, 'router_groups'),
    ({'moe.router_groups': 4, 'moe.router_topk_groups': 5}, 'router_topk_groups'),
    ({'moe.first_k_dense_layers': 2}, 'first_k_dense_layers'),
    ({'moe.layer_step': 2, 'runtime.scan_layers': True}, 'scan_layers'),
    ({'moe.capacity_factor': 0.0}, 'capacity_factor'),
    ({'moe.dispatch': 'sorted'}, r'ModelConfig\.moe\.dispatch'),
    ({'moe.capacity_group': 'row'}, r'ModelConfig\.moe\.capacity_group'),
])
def test_bad_moe_config_is_a_clear_error(bad, match):
  with pytest.raises(ConfigError, match=match):
    _cfg(**bad)

"""Mixture-of-Experts presets: total and active parameter counts vs published figures,
abstract model sizes, and a tiny-moe forward pass in both stack layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxnnx.models import Transformer, num_active_params, num_params, num_vision_params
from maxnnx.presets import get_preset

# (total, active) parameters in billions, from the model cards / papers.
PUBLISHED_BILLIONS = {
    'mixtral-8x7b': (46.7, 12.9),
    'mixtral-8x22b': (141.0, 39.0),
    'qwen3-30b-a3b': (30.5, 3.3),
    'qwen3-235b-a22b': (235.0, 22.0),
    'qwen3-480b-a35b': (480.0, 35.0),  # Qwen3-Coder-480B-A35B
    'deepseek-v2': (236.0, 21.0),
    'deepseek-v3': (671.0, 37.0),
    'kimi-k2': (1026.0, 32.0),  # "1T" on the card; 1.026T in the Hub's safetensors metadata
    'gpt-oss-20b': (20.9, 3.6),
    'gpt-oss-120b': (116.8, 5.1),
    # Llama 4's cards say 109B / 400B total and 17B active (of the text model); the presets
    # are the whole models (Scout 107.77B + 0.88B tower = 108.65B).
    'llama4-17b-16e': (109.0, 17.0),
    'llama4-17b-128e': (400.0, 17.0),
    'gemma4-26b-a4b': (25.2, 3.8),  # the text model
}

# Cards that count active parameters without the input embedding table.
ACTIVE_WITHOUT_INPUT_EMBEDDING = {'kimi-k2', 'gpt-oss-20b', 'gpt-oss-120b'}


# Counted layer by layer (~40 s each here): gemma4's layers differ in shape, Maverick's
# alternate dense and MoE; Scout (every layer MoE) keeps Llama 4 in the default run.
SLOW_COUNTS = {'gemma4-26b-a4b', 'llama4-17b-128e'}


@pytest.mark.parametrize('name,billions', [
    pytest.param(n, b, marks=pytest.mark.slow) if n in SLOW_COUNTS else (n, b)
    for n, b in sorted(PUBLISHED_BILLIONS.items())])
def test_total_and_active_params_match_published(name, billions):
  cfg = get_preset(name).replace(**{'mtp.num_layers': 0})  # published counts exclude MTP modules
  total, active = billions
  assert num_params(cfg) == pytest.approx(total * 1e9, rel=5e-3)
  embedding = cfg.vocab_size * cfg.d_model if name in ACTIVE_WITHOUT_INPUT_EMBEDDING else 0
  vision = num_vision_params(cfg)  # published active counts are the text model's
  assert num_active_params(cfg) - vision - embedding == pytest.approx(active * 1e9, rel=2e-2)


def test_deepseek_v3_with_mtp_matches_hub_size():
  """The Hub's 685B = 671B main model + the MTP layer, which also stores copies of the
  embedding and output head (the model shares those, so num_params counts them once)."""
  cfg = get_preset('deepseek-v3')
  assert cfg.mtp.num_layers == 1
  copies = 2 * cfg.vocab_size * cfg.d_model
  assert num_params(cfg) + copies == pytest.approx(685e9, rel=5e-3)
  assert num_params(cfg) - num_params(cfg.replace(**{'mtp.num_layers': 0})) == pytest.approx(
      11.7e9, rel=1e-2)


def test_deepseek_v2_lite_size():
  """15.7B total; the card's 2.4B active excludes the input embedding table."""
  cfg = get_preset('deepseek-v2-lite')
  assert num_params(cfg) == pytest.approx(15.7e9, rel=5e-3)
  embedding = cfg.vocab_size * cfg.d_model
  assert num_active_params(cfg) - embedding == pytest.approx(2.4e9, rel=3e-2)


@pytest.mark.parametrize('name', ['tiny-moe', 'qwen3-30b-a3b', 'mixtral-8x7b', 'deepseek-v2-lite',
                                  'deepseek-v3', 'gpt-oss-20b'])
def test_num_params_equals_abstract_model_size(name):
  cfg = get_preset(name, **{'runtime.scan_layers': True, 'runtime.param_dtype': 'bfloat16'})
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  count = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count == num_params(cfg)


def test_tiny_moe_forward_scanned_equals_unscanned():
  cfg = get_preset('tiny-moe')
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.moe.num_experts,
          cfg.moe.num_experts_per_tok) == (512, 128, 4, 8, 2)
  unscanned = Transformer(cfg, rngs=nnx.Rngs(0))
  scanned = nnx.eval_shape(lambda: Transformer(cfg.replace(**{'runtime.scan_layers': True}),
                                               rngs=nnx.Rngs(0)))
  # Stack the unscanned layers' parameters into the scanned model.
  layers = [nnx.state(block) for block in unscanned.layers]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  graphdef, state = nnx.split(scanned)
  state['layers'] = stacked
  for key in ('embed', 'final_norm', 'lm_head'):
    state[key] = nnx.state(getattr(unscanned, key))
  scanned = nnx.merge(graphdef, state)
  ids = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  a = nnx.jit(lambda m, x: m(x))(unscanned, ids)
  b = nnx.jit(lambda m, x: m(x))(scanned, ids)
  assert a.shape == (2, 16, 512) and np.isfinite(np.asarray(a)).all()
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_deepseek_v3_2_is_v3_plus_one_indexer_per_layer():
  """671B like V3 (the card's figure, which leaves the indexers out): exactly 61 indexers
  (wq_b, wk, k_norm, weights_proj) more than V3, MTP modules aside."""
  v3 = get_preset('deepseek-v3').replace(**{'mtp.num_layers': 0})
  v32 = get_preset('deepseek-v3.2').replace(**{'mtp.num_layers': 0})
  mla = v32.mla
  indexer = (mla.q_lora_rank * mla.index_num_heads * mla.index_head_dim
             + v32.d_model * mla.index_head_dim + 2 * mla.index_head_dim
             + v32.d_model * mla.index_num_heads)
  assert num_params(v32) - num_params(v3) == v32.num_layers * indexer
  assert num_params(v32) == pytest.approx(671e9, rel=5e-3)

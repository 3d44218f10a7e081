"""A DeepSeek-shaped train step needs less memory per device as more devices split a fixed
global batch, and the MoE block gives the one-device numbers however the batch is split.

The dropless dispatch sorts the ``tokens * k`` assignments by expert. Left to GSPMD, that
sort and all it orders (the sorted inputs, the grouped matmuls' rows and their gradients)
were replicated: every device held the whole global batch's assignments, so doubling the
devices at a fixed batch left the step's temporaries nearly where they were (0.95x on the
step below). The dispatch now runs on each batch shard (``dispatch_per_batch_shard``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import maxnnx
from maxnnx.config import MeshConfig, ModelConfig
from maxnnx.data import TokenWindows
from maxnnx.layers.moe import MoE, RouterBias
from maxnnx.sharding import logical_rules, make_mesh, spec_for, state_shardings, use_mesh
from maxnnx.train import TrainConfig, Trainer

# The deepseek-v3 preset's layer kinds and routing (MLA, a dense first layer, sigmoid
# group-limited routing with the balancing bias, a shared expert) at tiny widths.
TINY_DEEPSEEK = dict(d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, mlp_dim=64,
                     vocab_size=128, mtp={'num_layers': 0},
                     mla={'q_lora_rank': 16, 'kv_lora_rank': 16, 'qk_nope_head_dim': 16,
                          'qk_rope_head_dim': 8, 'v_head_dim': 16},
                     moe={'num_experts': 16, 'mlp_dim': 32, 'first_k_dense_layers': 1,
                          'router_groups': 4, 'router_topk_groups': 2,
                          'num_experts_per_tok': 4})


def _temporaries(fsdp: int) -> int:
  config = TrainConfig(global_batch_size=16, seq_len=64, mesh=MeshConfig(data=1, fsdp=fsdp))
  model = maxnnx.get_preset('deepseek-v3', **TINY_DEEPSEEK)
  return Trainer(model, config).compile(verbose=False)['temp_bytes']


def test_train_step_temporaries_shrink_as_fsdp_doubles_at_a_fixed_batch():
  """Compile only: 4 then 8 FSDP devices, the same 16 x 64 batch. Token work per device
  halves, so the temporaries must fall well below the 4-device figure (about 0.5x once the
  dispatch is per shard; 0.95x when it was replicated)."""
  four, eight = _temporaries(4), _temporaries(8)
  assert eight <= 0.7 * four, f'fsdp=8 needs {eight} B of temporaries, fsdp=4 {four} B'


BLOCK = dict(vocab_size=64, d_model=16, num_layers=1, num_heads=2, num_kv_heads=2, mlp_dim=24,
             **{'moe.num_experts': 8, 'moe.num_experts_per_tok': 2, 'moe.mlp_dim': 8,
                'moe.router_score': 'sigmoid'},
             **{'moe.router_score_bias': True, 'moe.router_groups': 4, 'moe.router_topk_groups': 2},
             **{'moe.router_group_score': 'top2_sum', 'moe.router_scaling_factor': 2.5,
                'moe.num_shared_experts': 1})


def biased_moe(cfg: ModelConfig):
  """A MoE block of ``cfg`` whose routing-balance biases are random (so the loads are
  uneven), split into graphdef, parameters and the rest."""
  moe = MoE.from_config(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  for _, node in nnx.iter_graph(moe):
    if isinstance(node, RouterBias):
      node[...] = jnp.asarray(rng.normal(size=node.shape) * 0.3, node.dtype)
  return nnx.split(moe, nnx.Param, ...)


def _block_outputs(mesh_config: MeshConfig | None):
  """Output, parameter gradients and loads of a DeepSeek-routed MoE block, on one device
  (``None``) or sharded over ``mesh_config``."""
  cfg = ModelConfig.from_dict(BLOCK)
  graphdef, params, rest = biased_moe(cfg)
  x = jax.random.normal(jax.random.key(1), (8, 6, cfg.d_model), jnp.float32)
  cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)

  def loss(params, rest, x):
    block = nnx.merge(graphdef, params, rest, copy=True)
    y = block(x)
    return jnp.sum(y * cotangent), (y, block.tokens_per_expert[...])

  step = jax.jit(jax.grad(loss, has_aux=True))
  if mesh_config is None:
    grads, (y, loads) = step(params, rest, x)
  else:
    mesh, rules = make_mesh(mesh_config), logical_rules(mesh_config)
    params = jax.device_put(params, state_shardings(params, mesh, rules))
    tokens = spec_for(('activation_batch', 'activation_length', 'activation_embed'), rules,
                      mesh, x.shape)
    x = jax.device_put(x, NamedSharding(mesh, tokens))
    with use_mesh(mesh, rules):
      grads, (y, loads) = step(params, rest, x)
  return np.asarray(y), jax.tree.map(np.asarray, nnx.to_pure_dict(grads)), np.asarray(loads)


MESHES = {
    'data_fsdp_tensor': MeshConfig(data=2, fsdp=2, tensor=2),
    'data_context': MeshConfig(data=2, context=4),  # each shard's rows split over context
    'fsdp_expert': MeshConfig(data=1, fsdp=2, expert=4),  # expert stays with GSPMD
}


@pytest.mark.parametrize('mesh', sorted(MESHES))
def test_per_shard_dispatch_equals_one_device(mesh):
  """Each device sorts its own tokens; the expert weights' FSDP shards are gathered on entry
  and their gradients summed over the shards: output, gradients and loads are one device's."""
  y_ref, grads_ref, loads_ref = _block_outputs(None)
  y, grads, loads = _block_outputs(MESHES[mesh])
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
               grads, grads_ref)
  np.testing.assert_array_equal(loads, loads_ref)


def test_fsdp_splits_every_deepseek_weight_matrix():
  """Under FSDP every parameter of two or more dimensions is split, MLA's up-projections
  (``[q_lora, heads, head_dim]``, ``[kv_lora, heads, head_dim]``: no ``embed`` axis) included.
  Left whole they were replicated on every device: for the full DeepSeek-V3, 3.3 B parameters
  with their Adam moments on each chip (20 GB of the 52 GB of state per v5p chip at FSDP 128)."""
  mesh_config = MeshConfig(data=1, fsdp=8)
  model = nnx.eval_shape(lambda: maxnnx.Transformer(
      maxnnx.get_preset('deepseek-v3', **TINY_DEEPSEEK), rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  shardings = state_shardings(params, make_mesh(mesh_config), logical_rules(mesh_config))
  whole = [jax.tree_util.keystr(path) for (path, value), sharding in zip(
               jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(params)),
               jax.tree.leaves(nnx.to_pure_dict(shardings)), strict=True)
           if value.ndim >= 2 and sharding.is_fully_replicated]
  assert not whole, whole


def _train_losses(mesh: MeshConfig) -> np.ndarray:
  config = TrainConfig(steps=3, global_batch_size=8, seq_len=16, learning_rate=1e-2,
                       warmup_steps=0, log_every=3, mesh=mesh)
  data = TokenWindows(np.tile(np.arange(48), 100), 16, 8, seed=1)
  trainer = Trainer(maxnnx.get_preset('deepseek-v3', **TINY_DEEPSEEK), config, data=data)
  return np.array([m['loss'] for m in trainer.fit(log=lambda line: None)])


@pytest.mark.slow  # 50 s: two compiled train steps; the placement itself is checked above
def test_deepseek_trains_under_fsdp_like_one_device():
  """The MLA latents split over fsdp change where the weights live, not the numbers."""
  np.testing.assert_allclose(_train_losses(MeshConfig(data=1, fsdp=8)),
                             _train_losses(MeshConfig(data=1)), rtol=1e-4)


def _capped_config(factor, steps=None) -> tuple[TrainConfig, ModelConfig]:
  """DeepSeek-shaped train step over ``expert=8`` by all_to_all (128 tokens x 4 experts a
  device), its dropless receive buffers capped at ``factor`` (``None``: the worst case)."""
  mesh = MeshConfig(data=1, expert=8, expert_parallel_strategy='all_to_all')
  config = TrainConfig(global_batch_size=16, seq_len=64, mesh=mesh,
                       **({} if steps is None else dict(steps=steps, log_every=steps)))
  moe = {**TINY_DEEPSEEK['moe'], 'ragged_buffer_factor': factor}
  return config, maxnnx.get_preset('deepseek-v3', **{**TINY_DEEPSEEK, 'moe': moe})


def test_receive_cap_shrinks_the_all_to_all_train_step_temporaries():
  """Compile only. Uncapped, each device's dropless receive buffer is ``expert`` x its own
  assignments (8 x 512 rows here) and so is everything the experts compute on it; capped at 2x
  the balanced share it is 8 x 128 (10.10 -> 3.59 MB of temporaries measured)."""
  uncapped = Trainer(*_capped_config(None)[::-1]).compile(verbose=False)['temp_bytes']
  capped = Trainer(*_capped_config(2.0)[::-1]).compile(verbose=False)['temp_bytes']
  assert capped <= 0.5 * uncapped, f'capped {capped} B, uncapped {uncapped} B'


def test_train_step_logs_the_share_of_assignments_the_cap_drops():
  """``moe_dropped_fraction``: the dropped assignments (counted by the layer, which
  ``tests/test_expert_parallel.py`` checks against a float64 reference) over all of the
  step's; some drop at the balanced share (1x), and an uncapped model logs no such
  metric."""
  data = TokenWindows(np.tile(np.arange(48), 100), 64, 16, seed=1)

  def metrics(factor):
    config, model = _capped_config(factor, steps=1)
    return Trainer(model, config, data=data).fit(log=lambda line: None)[-1]

  assert 0 < float(metrics(1.0)['moe_dropped_fraction']) < 0.5
  assert 'moe_dropped_fraction' not in metrics(None)

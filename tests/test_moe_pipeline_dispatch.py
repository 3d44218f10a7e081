"""A pipelined MoE stack (``mesh.stage`` > 1) dispatches each batch shard's tokens on its own
devices, as an unpipelined one does (8 simulated CPU devices).

The pipeline runs its stages under ``shard_map`` over ``stage``, so the MoE layer's own
``shard_map`` over the batch axes (``dispatch_per_batch_shard``, and the ``all_to_all``
exchange) nests inside it. Before, the stages ran under ``vmap(spmd_axis_name='stage')``, whose
batching rule added ``stage`` to the inner ``shard_map``'s specs without making it manual, so
the lowering refused it and pipelined stacks sorted the whole micro-batch's routing on every
device. The model's loss and gradients are one device's, and the compiled train step
all-gathers no routing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from test_moe_capacity_groups import dispatch_collectives

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.sharding import logical_rules, make_mesh, spec_for, state_shardings, use_mesh
from maxnnx.train import TrainConfig, Trainer

# Token counts are multiples of 7 (14 a row), which no weight dimension is; 3 experts a token
# make a micro-batch's assignments (8 rows x 14 x 3 = 336) a count no activation has.
BATCH, LENGTH, D_MODEL = 16, 14, 16
MOE = {'moe.num_experts': 8, 'moe.num_experts_per_tok': 3, 'moe.mlp_dim': 8}
MESHES = {'stage2_fsdp4': MeshConfig(data=1, fsdp=4, stage=2),
          'stage2_data2_fsdp2': MeshConfig(data=2, fsdp=2, stage=2),
          'stage2_fsdp2_expert2_all_to_all': MeshConfig(
              data=1, fsdp=2, expert=2, stage=2, expert_parallel_strategy='all_to_all')}
# Capacity per sequence (the default group) at factor 1: some assignments drop.
DISPATCH = {'dropless': {}, 'capacity': {'moe.dispatch': 'capacity', 'moe.capacity_factor': 1.0},
            # all_to_all counts slots per device's tokens, not per sequence: room for every one.
            'capacity_roomy': {'moe.dispatch': 'capacity', 'moe.capacity_factor': 4.0}}


def _cfg(**changes):
  """A Qwen3-MoE-like tiny model (Mixtral layout) in float32, its layers one scanned stack."""
  return maxnnx.get_preset('tiny-moe', vocab_size=64, num_layers=2, d_model=D_MODEL,
                           mlp_dim=32, num_heads=2, num_kv_heads=2, head_dim=8,
                           **{**MOE, 'runtime.dtype': 'float32', 'runtime.scan_layers': True,
                              **changes})


def _loss_and_grads(cfg, mesh_config: MeshConfig | None):
  """Next-token loss of ``cfg``'s model on a fixed batch and its parameter gradients, on one
  device (``None``) or on ``mesh_config`` (pipelined when its ``stage`` > 1)."""
  graphdef, params, rest = nnx.split(maxnnx.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  ids = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (BATCH, LENGTH + 1)),
                    jnp.int32)

  def loss(params, rest, ids):
    logits = nnx.merge(graphdef, params, rest, copy=True)(ids[:, :-1]).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(log_probs, ids[:, 1:, None], axis=-1).mean()

  step = jax.jit(jax.value_and_grad(loss))
  if mesh_config is None:
    value, grads = step(params, rest, ids)
  else:
    mesh, rules = make_mesh(mesh_config), logical_rules(mesh_config)
    params = jax.device_put(params, state_shardings(params, mesh, rules))
    rows = spec_for(('activation_batch', None), rules, mesh, ids.shape)
    ids = jax.device_put(ids, NamedSharding(mesh, rows))
    with use_mesh(mesh, rules, expert_parallel_strategy=mesh_config.expert_parallel_strategy):
      value, grads = step(params, rest, ids)
  return float(value), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


# Slow (20-45 s each on 2 cores), their paths covered by the default cases: data x fsdp goes
# the way of fsdp alone (one shard_map over both axes), capacity by all_to_all nests as dropless.
SLOW = pytest.mark.slow
CASES = [('stage2_fsdp4', 'dropless'), ('stage2_fsdp4', 'capacity'),
         pytest.param('stage2_data2_fsdp2', 'dropless', marks=SLOW),
         pytest.param('stage2_data2_fsdp2', 'capacity', marks=SLOW),
         ('stage2_fsdp2_expert2_all_to_all', 'dropless'),
         pytest.param('stage2_fsdp2_expert2_all_to_all', 'capacity_roomy', marks=SLOW)]


@pytest.mark.parametrize('mesh,dispatch', CASES)
def test_pipelined_moe_equals_one_device(mesh, dispatch):
  """Loss and every parameter gradient of the pipelined model are one device's (float32,
  relative 1e-4); with capacity dispatch some assignments drop, and the same ones."""
  cfg = _cfg(**DISPATCH[dispatch])
  loss_ref, grads_ref = _loss_and_grads(cfg, None)
  if dispatch == 'capacity':  # drops change the numbers: the capacity path is exercised
    assert abs(loss_ref - _loss_and_grads(_cfg(), None)[0]) > 1e-4
  loss, grads = _loss_and_grads(cfg, MESHES[mesh])
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               grads, grads_ref)


def routing_gathers(cfg, mesh_config: MeshConfig) -> list[str]:
  """The all-gathers of integers (routing: expert indices, sort orders) in the compiled train
  step of ``cfg`` on ``mesh_config``."""
  config = TrainConfig(global_batch_size=BATCH, seq_len=LENGTH, mesh=mesh_config)
  trainer = Trainer(cfg, config)
  trainer.compile(verbose=False)
  found = dispatch_collectives(trainer._compiled.as_text(), d_model=D_MODEL, length=LENGTH)
  return [line for line in found if line.startswith(('all-gather s32[', 'all-gather u32['))]


@pytest.mark.parametrize('dispatch', ['capacity', 'dropless'])
def test_pipelined_train_step_gathers_no_routing(dispatch):
  """Forward and backward, over stage=2 x fsdp=4: no device gathers the micro-batch's routing
  (the dropless dispatch did, left global under stages: its expert indices and sort orders,
  ``s32[336]``). The check can fail: capacity slots counted over the whole batch
  (``moe.capacity_group=batch``) gather the routing."""
  gathers = routing_gathers(_cfg(**DISPATCH[dispatch]), MESHES['stage2_fsdp4'])
  assert not gathers, gathers
  if dispatch == 'capacity':
    whole = routing_gathers(_cfg(**DISPATCH[dispatch], **{'moe.capacity_group': 'batch'}),
                            MESHES['stage2_fsdp4'])
    assert whole, 'the whole batch as one group gathers its routing'

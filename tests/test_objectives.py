"""Training objectives: the default equals a plain cross-entropy; frozen models stay frozen."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.train import Objective, PretrainObjective, TrainConfig, Trainer
from maxnnx.train.step import guard, initial_guard_state

BATCH, SEQ = 4, 16


def _model_config(**changes):
  return maxnnx.get_preset('tiny', **{'runtime.dtype': 'float32',
                                      'runtime.param_dtype': 'float32'}).replace(**changes)


def _batch(seed=0, vocab=512):
  rng = np.random.default_rng(seed)
  windows = rng.integers(0, vocab, (BATCH, SEQ + 1))
  mask = np.ones((BATCH, SEQ), np.float32)
  mask[0, :5] = 0  # a prompt that does not count
  return {'inputs': windows[:, :-1], 'targets': windows[:, 1:], 'loss_mask': mask}


def _plain_cross_entropy(model, batch) -> float:
  """Masked mean next-token cross-entropy of ``model(ids)`` logits, in float32 NumPy."""
  logits = np.asarray(model(jnp.asarray(batch['inputs'])), np.float64)
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  target = np.take_along_axis(logits, batch['targets'][..., None], -1)[..., 0]
  mask = batch['loss_mask']
  return float(((lse - target) * mask).sum() / mask.sum())


@pytest.mark.parametrize('objective', [None, PretrainObjective()], ids=['default', 'explicit'])
def test_default_objective_is_the_masked_cross_entropy(objective):
  model = maxnnx.Transformer(_model_config(), rngs=nnx.Rngs(0))
  batch = _batch()
  expected = _plain_cross_entropy(model, batch)
  config = TrainConfig(global_batch_size=BATCH, seq_len=SEQ, learning_rate=0.0,
                       mesh=MeshConfig(data=1))
  trainer = Trainer(model, config, objective)
  assert isinstance(trainer.objective, PretrainObjective)
  assert trainer.objective.config is config  # bound to the trainer's weights
  metrics = trainer.step(batch)
  assert metrics['loss'] == pytest.approx(expected, rel=1e-5)
  assert metrics['moe_aux_loss'] == 0.0 and 'mtp_loss' not in metrics


def test_pretrain_objective_weights_come_from_the_train_config():
  """A bound config's weights are kept; the trainer's apply only to an unbound objective."""
  own = PretrainObjective(TrainConfig(mtp_loss_scaling_factor=0.5))
  assert own.bind(TrainConfig()).config.mtp_loss_scaling_factor == 0.5
  assert PretrainObjective().bind(TrainConfig(router_aux_loss_coef=0.2)).config \
      .router_aux_loss_coef == 0.2


def test_guard_skips_non_finite_steps_and_records_the_first():
  extra = initial_guard_state()
  ok, extra = guard(extra, jnp.int32(3), jnp.float32(2.0), jnp.float32(jnp.nan), None)
  assert not ok and int(extra['first_bad_step']) == 4 and int(extra['bad_metric']) == 2
  ok, later = guard(extra, jnp.int32(4), jnp.float32(jnp.inf), jnp.float32(1.0), None)
  assert not ok and int(later['first_bad_step']) == 4  # the first one stays


class _Distill(Objective):
  """KL(teacher || student) over the counted tokens; the teacher is frozen."""

  def __init__(self, teacher):
    self.frozen_models = {'teacher': teacher}

  def loss(self, model, batch, *, frozen, norm):
    kwargs = dict(segment_ids=batch['segment_ids'], positions=batch['positions'])
    student = jax.nn.log_softmax(model(batch['inputs'], **kwargs).astype(jnp.float32))
    teacher = jax.nn.log_softmax(frozen['teacher'](batch['inputs'], **kwargs).astype(jnp.float32))
    kl_BT = (jnp.exp(teacher) * (teacher - student)).sum(-1)
    loss = (kl_BT * batch['loss_mask']).sum() / norm['tokens']
    return loss, {'loss': loss}


def _params(model):
  return jax.tree.map(np.array, nnx.state(model, nnx.Param))


@pytest.mark.slow  # test_distillation's sharded case checks the same placement by default
def test_a_frozen_teacher_is_sharded_like_the_student_and_never_trained():
  """2x2x2 mesh: the teacher follows the logical rules, is not in the optimizer, stays put."""
  mesh = MeshConfig(data=2, fsdp=2, tensor=2)
  model_config = _model_config()
  teacher = maxnnx.Transformer(model_config, rngs=nnx.Rngs(1))
  teacher_before = _params(teacher)
  config = TrainConfig(steps=3, global_batch_size=BATCH, seq_len=SEQ, learning_rate=1e-2,
                       warmup_steps=0, log_every=1, grad_accum_steps=2, mesh=mesh)
  data = iter([_batch(seed) for seed in range(3)])
  trainer = Trainer(model_config, config, _Distill(teacher), data=data)

  placed = trainer.frozen_models['teacher']
  student_q = trainer.model.layers[0].attn.q_proj.kernel[...]
  teacher_q = placed.layers[0].attn.q_proj.kernel[...]
  assert teacher_q.sharding.spec == student_q.sharding.spec
  assert teacher_q.sharding.spec == jax.sharding.PartitionSpec('fsdp', 'tensor', None)
  assert teacher_q.sharding.mesh.shape == student_q.sharding.mesh.shape

  plain = Trainer(model_config, TrainConfig(global_batch_size=BATCH, seq_len=SEQ, mesh=mesh))
  shapes = [x.shape for x in jax.tree.leaves(nnx.state(trainer.optimizer))]
  assert shapes == [x.shape for x in jax.tree.leaves(nnx.state(plain.optimizer))]

  student_before = _params(trainer.model)
  history = trainer.fit(log=lambda line: None)
  assert history[-1]['loss'] < history[0]['loss']
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), student_before,
                         _params(trainer.model))
  assert all(jax.tree.leaves(changed))
  for after in (_params(trainer.frozen_models['teacher']), _params(teacher)):
    same = jax.tree.map(np.array_equal, teacher_before, after)
    assert all(jax.tree.leaves(same))


def test_frozen_models_must_be_modules():
  objective = _Distill(teacher=_model_config())
  with pytest.raises(TypeError, match='nnx.Module'):
    Trainer(_model_config(), TrainConfig(global_batch_size=BATCH, seq_len=SEQ,
                                         mesh=MeshConfig(data=1)), objective)

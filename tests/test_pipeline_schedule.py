"""GPipe and circular pipeline schedules: the numbers of the whole stack, in order.

The stack is a chain of affine layers (``x * w_l + b_l + kind_l + row``), which do not commute,
so a chunk run out of order, on the wrong micro-batch or with the wrong per-layer input changes
the output. The reference runs the layers one after another in float64 NumPy.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxnnx import sharding
from maxnnx.config import MeshConfig
from maxnnx.layers.params import ForwardStat
from maxnnx.parallel.pipeline import describe_schedule, pipeline_bubble, pipeline_stack
from maxnnx.train import TrainConfig, Trainer

LAYERS, BATCH, LENGTH, WIDTH = 8, 8, 4, 3


class AffineStack(nnx.Module):
  """``LAYERS`` affine layers with their variables stacked on a leading ``layers`` axis."""

  def __init__(self, w_LD, b_LD):
    self.w = nnx.Param(jnp.asarray(w_LD, jnp.float32))
    self.b = nnx.Param(jnp.asarray(b_LD, jnp.float32))


def _run_chunk(chunk, kinds_l, x_bTD, rows_b):
  for i in range(chunk.w.shape[0]):
    x_bTD = x_bTD * chunk.w[i] + chunk.b[i] + kinds_l[i] + rows_b[:, None, None]
  return x_bTD


def _reference(w_LD, b_LD, kinds_L, x_BTD, rows_B):
  x = x_BTD.astype(np.float64)
  for layer in range(LAYERS):
    x = x * w_LD[layer] + b_LD[layer] + kinds_L[layer] + rows_B[:, None, None]
  return x


@pytest.mark.parametrize('stages,repeats,micro', [(2, 1, 2), (4, 1, 2), (2, 2, 2), (2, 2, 4),
                                                  (2, 4, 4), (4, 2, 4)])
def test_pipeline_equals_the_stack_in_order(stages, repeats, micro):
  rng = np.random.default_rng(stages * 100 + repeats * 10 + micro)
  w_LD = rng.uniform(0.5, 1.5, (LAYERS, WIDTH))
  b_LD = rng.normal(size=(LAYERS, WIDTH))
  kinds_L = rng.normal(size=LAYERS)
  x_BTD = rng.normal(size=(BATCH, LENGTH, WIDTH))
  rows_B = rng.normal(size=BATCH)
  stack = AffineStack(w_LD, b_LD)
  mesh = sharding.make_mesh(MeshConfig(data=8 // stages, stage=stages))

  def run(stack, kinds_L, x_BTD, rows_B):
    return pipeline_stack(stack, x_BTD, kinds_L, rows_B, _run_chunk, stages=stages,
                          microbatches=micro, repeats=repeats)

  args = (stack, jnp.asarray(kinds_L, jnp.float32), jnp.asarray(x_BTD, jnp.float32),
          jnp.asarray(rows_B, jnp.float32))
  with sharding.use_mesh(mesh):
    out = nnx.jit(run)(*args)
    jaxpr = jax.make_jaxpr(lambda *a: run(stack, *a))(*args[1:])
  np.testing.assert_allclose(out, _reference(w_LD, b_LD, kinds_L, x_BTD, rows_B), rtol=1e-5,
                             atol=1e-5)
  # The schedule is the one asked for: R M + S - 1 iterations.
  lengths = [e.params['length'] for e in jaxpr.jaxpr.eqns if e.primitive.name == 'scan']
  assert lengths == [repeats * micro + stages - 1]


class StatStack(AffineStack):
  """The affine stack with per-layer statistics written as it runs, one of each combine."""

  def __init__(self, w_LD, b_LD):
    super().__init__(w_LD, b_LD)
    zeros = jnp.zeros((LAYERS, WIDTH), jnp.float32)
    self.total = ForwardStat(zeros, combine='sum')
    self.peak = ForwardStat(zeros, combine='max')
    self.mean = ForwardStat(zeros)


def _run_chunk_with_stats(chunk, kinds_l, x_bTD, rows_b):
  totals, peaks, means = [], [], []
  for i in range(chunk.w.shape[0]):
    x_bTD = x_bTD * chunk.w[i] + chunk.b[i] + kinds_l[i] + rows_b[:, None, None]
    totals.append(x_bTD.sum(axis=(0, 1)))
    peaks.append(x_bTD.max(axis=(0, 1)))
    means.append(x_bTD.mean(axis=(0, 1)))
  chunk.total[...], chunk.peak[...], chunk.mean[...] = (
      jnp.stack(totals), jnp.stack(peaks), jnp.stack(means))
  return x_bTD


@pytest.mark.parametrize('stages,repeats,micro', [(2, 1, 2), (2, 2, 4), (4, 2, 4)])
def test_the_layers_statistics_come_out_for_the_whole_batch(stages, repeats, micro):
  """Each layer's statistics after the pipeline equal those of the stack run on the whole
  batch: sums and maxima exactly, means of equal micro-batches too (float64 NumPy)."""
  rng = np.random.default_rng(7 + stages + repeats + micro)
  w_LD, b_LD = rng.uniform(0.5, 1.5, (LAYERS, WIDTH)), rng.normal(size=(LAYERS, WIDTH))
  kinds_L, rows_B = rng.normal(size=LAYERS), rng.normal(size=BATCH)
  x_BTD = rng.normal(size=(BATCH, LENGTH, WIDTH))
  stack = StatStack(w_LD, b_LD)
  mesh = sharding.make_mesh(MeshConfig(data=8 // stages, stage=stages))

  def run(stack, kinds_L, x_BTD, rows_B):
    return pipeline_stack(stack, x_BTD, kinds_L, rows_B, _run_chunk_with_stats, stages=stages,
                          microbatches=micro, repeats=repeats)

  with sharding.use_mesh(mesh):
    nnx.jit(run)(stack, *(jnp.asarray(a, jnp.float32) for a in (kinds_L, x_BTD, rows_B)))
  x = x_BTD.astype(np.float64)
  for layer in range(LAYERS):
    x = x * w_LD[layer] + b_LD[layer] + kinds_L[layer] + rows_B[:, None, None]
    np.testing.assert_allclose(stack.total[layer], x.sum(axis=(0, 1)), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(stack.peak[layer], x.max(axis=(0, 1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stack.mean[layer], x.mean(axis=(0, 1)), rtol=1e-5, atol=1e-5)


def test_a_pipelined_model_reports_the_whole_batchs_loads_and_max_logits():
  """A two-layer MoE over two stages: its expert loads and per-head max logits after a forward
  pass are those of the unpipelined model on the same batch (the step's balancing and QK-clip
  read them)."""
  import maxnnx
  from maxnnx.layers.moe import moe_stats
  from maxnnx.layers.qk_clip import attention_max_logits
  cfg = maxnnx.get_preset('tiny-moe', vocab_size=64, num_layers=2, d_model=32, mlp_dim=32,
                          **{'runtime.scan_layers': True, 'runtime.record_max_logits': True,
                             'runtime.dtype': 'float32'})
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))
  ids = jnp.asarray(np.random.default_rng(3).integers(0, 64, (8, 16)), jnp.int32)
  model(ids)
  loads, logits = moe_stats(model), np.asarray(attention_max_logits(model))
  pipelined = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))
  with sharding.use_mesh(sharding.make_mesh(MeshConfig(data=4, stage=2))):
    nnx.jit(lambda m, x: m(x))(pipelined, ids)
  np.testing.assert_array_equal(moe_stats(pipelined), loads)
  assert loads.sum() == 2 * 8 * 16 * cfg.moe.num_experts_per_tok
  np.testing.assert_allclose(np.asarray(attention_max_logits(pipelined)), logits, rtol=1e-5)


def test_bubble_shrinks_with_repeats():
  assert pipeline_bubble(4, 4) == pytest.approx(3 / 7)
  assert pipeline_bubble(4, 4, repeats=4) == pytest.approx(3 / 19)
  line = describe_schedule(4, 4, 4)
  assert '4 repeat(s)' in line and '16%' in line and 'GPipe with these micro-batches: 43%' in line


def _trainer(mesh):
  config = TrainConfig(steps=1, global_batch_size=8, seq_len=16, mesh=mesh)
  return Trainer('tiny', config, data=iter(()))


def test_trainer_logs_the_schedule(caplog):
  with caplog.at_level(logging.INFO, logger='maxnnx.train.trainer'):
    _trainer(MeshConfig(data=4, stage=2, pipeline_repeats=2))
  assert 'Pipeline: 2 stages x 2 repeat(s), 2 micro-batches' in caplog.text


@pytest.mark.parametrize('mesh,match', [
    (MeshConfig(data=2, stage=4, pipeline_repeats=2),
     r'num_layers=4 must be divisible by stage x pipeline_repeats = 4 x 2'),
    (MeshConfig(data=4, stage=2, pipeline_repeats=2, pipeline_microbatches=1),
     r'needs pipeline_microbatches >= stage \(2\), got 1'),
])
def test_a_schedule_the_stack_cannot_follow_is_refused(mesh, match):
  with pytest.raises(ValueError, match=match):
    _trainer(mesh)


def test_pipeline_repeats_must_be_positive():
  with pytest.raises(ValueError, match='pipeline_repeats=0'):
    MeshConfig(pipeline_repeats=0)

"""Residual dropout (``model.dropout_rate``): on in the train step only, one mask per layer and
place whatever the layout, and a run that trains with it."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx import cli
from maxnnx.layers.dropout import dropout, dropout_key

MODEL = dict(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=64,
             max_position_embeddings=64, **{'runtime.dtype': 'float32'})


def test_dropout_zeroes_at_the_rate_and_rescales_the_rest():
  """Outside the context nothing changes; inside, about ``rate`` of the values are zero and the
  others are divided by 1 - rate; a key and seed give one mask, another seed another."""
  x = jnp.asarray(np.random.default_rng().normal(size=(64, 1024)).astype(np.float32)) + 3.0
  assert dropout(x, 0.25, 7) is x
  with dropout_key(jax.random.key(0)):
    y, again, other = dropout(x, 0.25, 7), dropout(x, 0.25, 7), dropout(x, 0.25, 8)
  dropped = np.asarray(y) == 0
  assert abs(dropped.mean() - 0.25) < 0.01  # 65,536 draws: 5 standard deviations is 0.0085
  np.testing.assert_allclose(np.asarray(y)[~dropped], np.asarray(x)[~dropped] / 0.75, rtol=1e-6)
  np.testing.assert_array_equal(y, again)
  assert (np.asarray(other) == 0).mean() > 0.2 and not np.array_equal(y, other)


def _model(scan, rate):
  cfg = maxnnx.ModelConfig.from_dict({**MODEL, 'dropout_rate': rate,
                                      'runtime': {'scan_layers': scan}})
  return maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))


def test_masks_follow_the_layer_not_the_layout_and_stay_out_of_inference():
  """Scanned and looped models draw the same masks (same logits under one key); without the
  train step's key a model with dropout computes exactly what one without it does."""
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 16)), jnp.int32)
  plain = _model(False, 0.0)(ids)
  looped, scanned = _model(False, 0.3), _model(True, 0.3)
  np.testing.assert_array_equal(looped(ids), plain)
  with dropout_key(jax.random.key(3)):
    a, b = looped(ids), scanned(ids)
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(a - plain).max()) > 0.05


@pytest.mark.parametrize('scan', [False, True])
def test_a_loaded_model_keeps_a_seed_per_layer(scan, tmp_path):
  """from_pretrained gives layer i the seed i (not zeros), scanned or not."""
  maxnnx.save_pretrained(_model(False, 0.0), str(tmp_path))
  model = maxnnx.from_pretrained(str(tmp_path), scan_layers=scan, dropout_rate=0.1)
  seeds = (np.asarray(model.layers.dropout_seed[...]) if scan else
           [int(block.dropout_seed[...]) for block in model.layers])
  assert list(seeds) == [0, 1, 2]


def test_training_with_dropout_changes_the_first_loss(tmp_path):
  """maxnnx train model.dropout_rate=0.2 runs, and its first step's loss (same weights, same
  batch as a run without dropout) differs: the train step drops."""
  args = ['model=tiny', 'model.num_layers=2', 'seq_len=32', 'global_batch_size=4', 'steps=2',
          'sample_tokens=0', 'eval_every=0', 'log_every=1', 'mesh.data=1',
          'checkpoint_every=0', 'data=synthetic', 'dtype=float32']
  losses = {}
  for rate in (0.0, 0.2):
    out = tmp_path / str(rate)
    assert cli.main(['train', f'output_dir={out}', *args, f'model.dropout_rate={rate}']) == 0
    losses[rate] = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
  first = [m['loss'] for m in losses[0.0] if 'loss' in m][0]
  assert [m['loss'] for m in losses[0.2] if 'loss' in m][0] != pytest.approx(first, rel=1e-4)

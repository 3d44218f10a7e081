"""Multi-token prediction (DeepSeek V3): logits and loss against a float64 NumPy
reference, switching it off, training with it, and Hub-layout checkpoints."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, rel_error
from flax import nnx
from numpy_deepseek_reference import deepseek as deepseek_reference
from numpy_deepseek_reference import mtp_cross_entropy
from numpy_reference import randomize_params

import maxnnx
from maxnnx.checkpoint.safetensors import read_safetensors
from maxnnx.config import ConfigError, MeshConfig
from maxnnx.layers.moe import RouterBias
from maxnnx.models.counting import num_params
from maxnnx.models.pretrained import PretrainedError
from maxnnx.train import TrainConfig, Trainer

REL_TOL = 1e-4
FIXTURE = os.path.join(FIXTURES, 'deepseek_v3')



def _config(**overrides):
  """The tiny DeepSeek V3 fixture's architecture (MLA with YaRN, a dense first
  layer, then group-routed sigmoid experts) with MTP modules."""
  return maxnnx.config_from_pretrained(FIXTURE, **{'mtp.num_layers': 2, **overrides})


def _model(seed=0, **overrides):
  model = maxnnx.Transformer(_config(**overrides), rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed + 100)
  randomize_params(model, rng)
  for _, node in nnx.iter_graph(model):
    if isinstance(node, RouterBias):  # unequal balancing biases exercise the routing
      node[...] = jnp.asarray(rng.normal(size=node.shape) * 0.3, node.dtype)
  return model


@pytest.fixture(scope='module')
def deepseek():
  """One DeepSeek-style model with two MTP depths, shared by the tests that only read it."""
  return _model()


def _fresh_copy(model):
  """A copy with its own buffers (a Trainer donates the buffers of the model it is given)."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.tree.map(jnp.array, state))


def _params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _packed_batch(rng, vocab, batch=2, length=12):
  """Two documents in row 0 (the second cut short by padding), one in row 1, and a
  loss mask with holes."""
  ids = rng.integers(0, vocab, (batch, length + 1))
  segment_ids = np.ones((batch, length), np.int32)
  positions = np.tile(np.arange(length), (batch, 1))
  segment_ids[0, 5:] = 2
  segment_ids[0, 10:] = 0
  positions[0, 5:] = np.arange(length - 5)
  positions[0, 10:] = 0
  loss_mask = (segment_ids != 0).astype(np.float32)
  loss_mask[1, 3] = 0.0
  return {'inputs': ids[:, :-1], 'targets': ids[:, 1:], 'segment_ids': segment_ids,
          'positions': positions, 'loss_mask': loss_mask}


def test_numpy_reference_matches_transformers():
  """The float64 reference itself reproduces transformers' (float32) DeepSeek V3 logits."""
  model = maxnnx.from_pretrained(FIXTURE)
  ref = np.load(os.path.join(FIXTURE, 'reference.npz'))
  logits, _ = deepseek_reference(ref['input_ids'], _params(model), model.config)
  assert rel_error(logits, ref['logits']) < 1e-5


@pytest.mark.parametrize('packed', [False, True], ids=['plain', 'packed'])
def test_mtp_logits_match_numpy_reference(packed, deepseek):
  model = deepseek
  rng = np.random.default_rng(7)
  batch = _packed_batch(rng, model.config.vocab_size)
  kwargs = ({'segment_ids': batch['segment_ids'], 'positions': batch['positions']}
            if packed else {})
  logits, mtp_logits = model(batch['inputs'], mtp=True, **kwargs)
  ref_logits, ref_mtp = deepseek_reference(batch['inputs'], _params(model), model.config,
                                           **kwargs)
  assert len(mtp_logits) == len(ref_mtp) == 2
  real = batch['segment_ids'] != 0 if packed else np.ones(batch['inputs'].shape, bool)
  assert rel_error(np.asarray(logits)[real], ref_logits[real]) < REL_TOL
  for ours, ref in zip(mtp_logits, ref_mtp):
    assert rel_error(np.asarray(ours)[real], ref[real]) < REL_TOL


def test_mtp_off_gives_the_same_logits(deepseek):
  """The main logits do not depend on MTP: with mtp=True, without it, and from a model
  built without MTP modules from the same weights."""
  model = deepseek
  ids = np.random.default_rng(3).integers(0, model.config.vocab_size, (2, 10))
  plain = model(ids)
  with_mtp, _ = model(ids, mtp=True)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(with_mtp))
  without = maxnnx.Transformer(model.config.replace(**{'mtp.num_layers': 0}), rngs=nnx.Rngs(0))
  state = {k: v for k, v in _params(model).items() if k != 'mtp'}
  nnx.update(without, state)
  assert without.mtp is None
  np.testing.assert_array_equal(np.asarray(without(ids)), np.asarray(plain))
  with pytest.raises(ValueError, match=r'mtp\.num_layers'):
    without(ids, mtp=True)


def test_config_validation():
  cfg = _config(**{'mtp.num_layers': 1})
  with pytest.raises(ConfigError, match=r'ModelConfig\.mtp\.num_layers must be >= 0'):
    cfg.replace(**{'mtp.num_layers': -1})
  with pytest.raises(ConfigError, match='TrainConfig.mtp_loss_scaling_factor'):
    cfg.replace(mtp_loss_scaling_factor=0.1)
  with pytest.raises(ConfigError, match='TrainConfig.mtp_loss_scaling_factor must be >= 0'):
    TrainConfig(mtp_loss_scaling_factor=-0.1)
  model = nnx.eval_shape(lambda: maxnnx.Transformer(cfg, rngs=nnx.Rngs(0)))
  assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == num_params(cfg)


def _train_config(steps=1, lr=0.0, batch=2, seq_len=12, mesh=None, **kw):
  return TrainConfig(steps=steps, learning_rate=lr, global_batch_size=batch, seq_len=seq_len,
                     mesh=mesh or MeshConfig(data=1), warmup_steps=0, clip_norm=None, **kw)


@pytest.mark.parametrize('grad_accum_steps', [1, pytest.param(2, marks=pytest.mark.slow)])
def test_mtp_loss_matches_numpy_cross_entropy(grad_accum_steps, deepseek):
  """The logged mtp_loss is the mean over depths of each depth's masked cross-entropy
  against targets shifted by k (packed-document boundaries, padding and masked
  targets excluded); the main loss is unchanged."""
  model = deepseek
  batch = _packed_batch(np.random.default_rng(11), model.config.vocab_size)
  ref_logits, ref_mtp = deepseek_reference(batch['inputs'], _params(model), model.config,
                                           segment_ids=batch['segment_ids'],
                                           positions=batch['positions'])
  per_depth = mtp_cross_entropy(ref_mtp, batch['targets'], batch['loss_mask'],
                                batch['segment_ids'], batch['positions'])
  assert [c for _, c in per_depth] == [18.0, 15.0]  # shifted targets still in their document
  real = batch['loss_mask'] > 0
  lse = np.log(np.exp(ref_logits - ref_logits.max(-1, keepdims=True)).sum(-1)) + \
      ref_logits.max(-1)
  target_logit = np.take_along_axis(ref_logits, batch['targets'][..., None], -1)[..., 0]
  main = (lse - target_logit)[real].mean()
  trainer = Trainer(_fresh_copy(model), _train_config(grad_accum_steps=grad_accum_steps))
  metrics = trainer.step(batch)
  assert metrics['loss'] == pytest.approx(main, rel=1e-5)
  assert metrics['mtp_loss'] == pytest.approx(
      np.mean([total / count for total, count in per_depth]), rel=1e-5)


def _dense(**overrides):
  """A small Llama-style model with MTP: the modules are not DeepSeek-specific."""
  cfg = maxnnx.get_preset('tiny', **{**dict(vocab_size=32, num_layers=2, d_model=32, mlp_dim=64,
                                            num_heads=2, num_kv_heads=2, **{'mtp.num_layers': 2}),
                                     **overrides})
  return maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))


def _host_params(model):
  return jax.tree.map(np.array, _params(model))


@pytest.mark.parametrize('factor', [0.0, 0.3])
def test_mtp_loss_trains_the_mtp_modules_only_when_scaled(factor):
  """mtp_loss_scaling_factor weights the MTP loss in the objective: at 0 the MTP
  modules get no gradient (weight decay off), otherwise they move."""
  model = _dense()
  before = _host_params(model)
  batch = next(_counting_batches(32, 2, 12))
  trainer = Trainer(model, _train_config(lr=1e-2, weight_decay=0.0,
                                         mtp_loss_scaling_factor=factor))
  trainer.step(batch)
  after = _host_params(trainer.model)
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), before, after)
  assert any(jax.tree.leaves(changed['mtp'])) == (factor > 0)
  assert all(jax.tree.leaves(changed['layers']))


def _counting_batches(vocab, batch, seq_len, seed=0):
  """Rows counting up from a random start: every token ahead is predictable."""
  rng = np.random.default_rng(seed)
  while True:
    yield (rng.integers(0, vocab, (batch, 1)) + np.arange(seq_len + 1)) % vocab


@pytest.mark.parametrize('kind', ['dense', pytest.param('deepseek', marks=pytest.mark.slow)])
def test_trainer_learns_with_mtp(kind):
  """Main and MTP losses both fall on a learnable stream."""
  model = _dense() if kind == 'dense' else _model(vocab_size=32)
  trainer = Trainer(model, _train_config(steps=20, lr=2e-2, batch=4, seq_len=16),
                    data=_counting_batches(32, 4, 16))
  history = trainer.fit(log=lambda line: None)
  first, last = history[0], history[-1]
  assert last['loss'] < 0.3 * first['loss']
  assert last['mtp_loss'] < 0.3 * first['mtp_loss']


@pytest.mark.parametrize('kind', ['dense', pytest.param('deepseek', marks=pytest.mark.slow)])
def test_mtp_under_scan_layers_and_a_data_mesh(kind):
  """Scanned layers on a 2-device data mesh give the single-device unscanned step's losses."""
  model = _dense() if kind == 'dense' else _model()
  values = _host_params(model)
  batch = _packed_batch(np.random.default_rng(5), model.config.vocab_size, batch=4)
  one = Trainer(model, _train_config(batch=4)).step(batch)
  scanned = maxnnx.Transformer(model.config.replace(**{'runtime.scan_layers': True}),
                               rngs=nnx.Rngs(1))
  _copy_into_scanned(values, model.config, scanned)
  two = Trainer(scanned, _train_config(batch=4, mesh=MeshConfig(data=2))).step(batch)
  for key in ('loss', 'mtp_loss', 'moe_aux_loss'):
    assert two[key] == pytest.approx(one[key], rel=1e-5), key


def _copy_into_scanned(values, cfg, scanned):
  for path, var in nnx.to_flat_state(nnx.state(scanned, nnx.Param)):
    if path[0] in ('layers', 'dense_layers'):
      first = cfg.moe.first_k_dense_layers if path[0] == 'layers' and cfg.moe.num_experts else 0
      arrays = []
      for i in range(var.shape[0]):
        node = values['layers'][first + i]
        for p in path[1:]:
          node = node[p]
        arrays.append(node)
      var[...] = jnp.stack(arrays).astype(var.dtype)
    else:
      node = values
      for p in path:
        node = node[p]
      var[...] = jnp.asarray(node, var.dtype)


def test_context_load_balancing_is_refused():
  with pytest.raises(ValueError, match='context_load_balance'):
    Trainer(_config(), _train_config(mesh=MeshConfig(data=1, context=2)))


# -- Hugging Face layout -----------------------------------------------------------------------


def _hub_names(directory):
  return read_safetensors(os.path.join(directory, 'model.safetensors'))


def test_save_writes_the_hub_layout_and_round_trips(tmp_path, deepseek):
  """MTP module k is Hub layer num_layers + k - 1 with enorm/hnorm/eh_proj/shared_head and
  copies of the embedding and head; load -> save is byte-equal and logits agree."""
  model = deepseek
  first, second = str(tmp_path / 'a'), str(tmp_path / 'b')
  maxnnx.save_pretrained(model, first)
  tensors = _hub_names(first)
  n, experts = model.config.num_layers, model.config.moe.num_experts
  assert not any(k.startswith(f'model.layers.{n + 2}.') for k in tensors)
  mtp = {k for k in tensors if k.startswith(f'model.layers.{n + 1}.')}
  n += 1  # the second MTP depth; the first is laid out the same way
  expected = {f'model.layers.{n}.{name}.weight' for name in (
      'enorm', 'hnorm', 'eh_proj', 'embed_tokens', 'shared_head.norm', 'shared_head.head',
      'input_layernorm', 'post_attention_layernorm', 'self_attn.q_a_proj',
      'self_attn.q_a_layernorm', 'self_attn.q_b_proj', 'self_attn.kv_a_proj_with_mqa',
      'self_attn.kv_a_layernorm', 'self_attn.kv_b_proj', 'self_attn.o_proj', 'mlp.gate',
      'mlp.shared_experts.gate_proj', 'mlp.shared_experts.up_proj',
      'mlp.shared_experts.down_proj')}
  expected |= {f'model.layers.{n}.mlp.experts.{e}.{p}.weight' for e in range(experts)
               for p in ('gate_proj', 'up_proj', 'down_proj')}
  expected.add(f'model.layers.{n}.mlp.gate.e_score_correction_bias')
  assert mtp == expected
  d = model.config.d_model
  assert tensors[f'model.layers.{n}.eh_proj.weight'].shape == (d, 2 * d)
  np.testing.assert_array_equal(tensors[f'model.layers.{n}.shared_head.head.weight'],
                                tensors['lm_head.weight'])

  again = maxnnx.from_pretrained(first, scan_layers=True)
  assert again.config == model.config.replace(**{'runtime.scan_layers': True})
  maxnnx.save_pretrained(again, second)
  rewritten = _hub_names(second)
  assert rewritten.keys() == tensors.keys()
  for name, array in tensors.items():
    assert rewritten[name].tobytes() == array.tobytes(), name
  ids = np.random.default_rng(2).integers(0, model.config.vocab_size, (2, 9))
  for ours, theirs in zip(jax.tree.leaves(model(ids, mtp=True)),
                          jax.tree.leaves(again(ids, mtp=True))):
    np.testing.assert_allclose(np.asarray(theirs), np.asarray(ours), rtol=1e-5, atol=1e-5)


def test_loading_with_fewer_mtp_layers_skips_those_tensors(tmp_path, caplog, deepseek):
  model = deepseek
  maxnnx.save_pretrained(model, str(tmp_path))
  with caplog.at_level(logging.INFO, logger='maxnnx.models'):
    plain = maxnnx.from_pretrained(str(tmp_path), **{'mtp.num_layers': 0})
    one = maxnnx.from_pretrained(str(tmp_path), **{'mtp.num_layers': 1})
  assert plain.mtp is None and len(one.mtp) == 1
  assert [r.getMessage().count('skipping') for r in caplog.records] == [1, 1]
  assert 'skipping 2' in caplog.records[0].getMessage()
  ids = np.random.default_rng(4).integers(0, model.config.vocab_size, (1, 8))
  np.testing.assert_array_equal(np.asarray(plain(ids)), np.asarray(model(ids)))
  ours, theirs = one(ids, mtp=True)[1][0], model(ids, mtp=True)[1][0]
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
  with pytest.raises(PretrainedError, match=r'mtp\.num_layers=3'):
    maxnnx.from_pretrained(str(tmp_path), **{'mtp.num_layers': 3})


def test_transformers_checkpoint_without_mtp_tensors_loads_without_mtp(caplog):
  """transformers drops MTP tensors but keeps num_nextn_predict_layers in config.json."""
  assert maxnnx.config_from_pretrained(FIXTURE).mtp.num_layers == 1
  with caplog.at_level(logging.INFO, logger='maxnnx.models'):
    model = maxnnx.from_pretrained(FIXTURE)
  assert model.config.mtp.num_layers == 0 and model.mtp is None
  assert any('holds tensors for 0' in r.getMessage() for r in caplog.records)
  with pytest.raises(PretrainedError, match='holds multi-token-prediction tensors for 0'):
    maxnnx.from_pretrained(FIXTURE, **{'mtp.num_layers': 1})


def test_families_without_mtp_refuse_to_save_it(tmp_path):
  cfg = maxnnx.get_preset('tiny', vocab_size=32, num_layers=1, d_model=16, mlp_dim=32,
                          num_heads=2, num_kv_heads=2, **{'mtp.num_layers': 1})
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))
  ids = np.zeros((1, 4), np.int32)
  assert len(model(ids, mtp=True)[1]) == 1  # the modules themselves are family-agnostic
  with pytest.raises(PretrainedError, match=r'mtp\.num_layers=0'):
    maxnnx.save_pretrained(model, str(tmp_path))


def test_flops_count_the_mtp_modules():
  """Each MTP depth costs one more block plus eh_proj (2d x d) and the output head."""
  from maxnnx.train.flops import forward_flops_per_token
  cfg = maxnnx.get_preset('tiny', num_layers=2)
  base = forward_flops_per_token(cfg, 64)
  one_more_block = forward_flops_per_token(cfg.replace(num_layers=3), 64) - base
  extra = 2 * 2 * cfg.d_model**2 + 2 * cfg.d_model * cfg.vocab_size
  assert forward_flops_per_token(cfg.replace(**{'mtp.num_layers': 2}), 64) == pytest.approx(
      base + 2 * (one_more_block + extra))

"""Optimizers, schedules, metric files and the CLI's config keys."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import maxnnx
from maxnnx import cli
from maxnnx.config import ConfigError, MeshConfig
from maxnnx.data import TokenWindows
from maxnnx.train import TrainConfig, Trainer, make_schedule
from maxnnx.train.flops import forward_flops_per_token, mean_keys_per_query
from maxnnx.train.metrics import TensorBoardWriter, crc32c, read_tensorboard_scalars
from maxnnx.train.optimizers import make_optimizer
from maxnnx.train.run_dir import config_diff, run_config
from maxnnx.train.trainer import masked_cross_entropy


def _run(steps=25, **train):
  cfg = maxnnx.get_preset('tiny', vocab_size=64, num_layers=2, d_model=64, mlp_dim=128)
  config = TrainConfig(steps=steps, global_batch_size=8, seq_len=32, log_every=steps,
                       mesh=MeshConfig(data=1), **train)
  data = TokenWindows(np.tile(np.arange(16), 300), 32, 8, seed=0)
  return Trainer(cfg, config, data=data)


@pytest.mark.parametrize('optimizer, lr', [('adamw', 1e-2), ('sgd', 0.3), ('adafactor', 1e-2),
                                           ('muon', 2e-2)])
def test_every_optimizer_learns(optimizer, lr):
  history = _run(optimizer=optimizer, learning_rate=lr).fit(log=lambda line: None)
  assert history[-1]['loss'] < 0.6 * history[0]['loss'], optimizer


def test_schedules_follow_their_shapes():
  peak = 1.0
  cosine = make_schedule(TrainConfig(steps=100, learning_rate=peak, warmup_steps=10))
  assert float(cosine(0)) == 0 and float(cosine(10)) == pytest.approx(peak)
  assert float(cosine(100)) == pytest.approx(0.1 * peak)
  wsd = make_schedule(TrainConfig(steps=100, learning_rate=peak, warmup_steps=10,
                                  schedule='wsd', decay_fraction=0.2))
  assert [float(wsd(s)) for s in (10, 50, 79)] == pytest.approx([peak] * 3)
  assert float(wsd(90)) == pytest.approx(0.55 * peak) and float(wsd(100)) == pytest.approx(0.1)
  constant = make_schedule(TrainConfig(steps=100, learning_rate=peak, warmup_steps=0,
                                       schedule='constant'))
  assert float(constant(77)) == peak


def test_custom_optax_transformation_and_metric_files(tmp_path):
  base = _run(steps=6, metrics_jsonl=str(tmp_path / 'm.jsonl'),
              tensorboard_dir=str(tmp_path / 'tb'))
  trainer = Trainer(base.model_config, base.config, data=base.data, optimizer=optax.sgd(0.1))
  history = trainer.fit(log=lambda line: None)
  trainer.close()
  rows = [json.loads(line) for line in open(tmp_path / 'm.jsonl')]
  assert [r['step'] for r in rows] == list(range(1, 7))
  for key in ('loss', 'lr', 'grad_norm', 'tokens_per_s', 'tflops_per_device', 'mfu'):
    assert all(np.isfinite(r[key]) for r in rows), key
  (event_file,) = (tmp_path / 'tb').iterdir()
  events = read_tensorboard_scalars(str(event_file))
  assert [step for step, _ in events] == list(range(1, 7))
  assert events[-1][1]['loss'] == pytest.approx(history[-1]['loss'], rel=1e-6)


def test_tensorboard_framing_uses_crc32c(tmp_path):
  assert crc32c(b'123456789') == 0xE3069283  # the standard check value
  writer = TensorBoardWriter(str(tmp_path))
  writer.scalars(3, {'loss': 1.5, 'skip': float('nan')})
  writer.close()
  assert read_tensorboard_scalars(writer.path) == [(3, {'loss': 1.5})]


def test_flops_count_halves_causal_attention_and_caps_windows():
  assert mean_keys_per_query(4, None) == 2.5
  assert mean_keys_per_query(8, 2) == (1 + 2 * 7) / 8
  assert mean_keys_per_query(8, None, 3) == (1 + 2 + 3 + 1 + 2 + 3 + 1 + 2) / 8
  cfg = maxnnx.get_preset('tiny')
  windowed = cfg.replace(**{'attention.sliding_window': 16})
  assert forward_flops_per_token(windowed, 1024) < forward_flops_per_token(cfg, 1024)


def test_a_loss_spike_is_skipped_and_leaves_the_state_alone():
  with pytest.raises(ConfigError, match='skip_spike_factor'):
    TrainConfig(skip_spike_factor=0.5)
  with pytest.raises(ConfigError, match='grad_accum_steps'):
    TrainConfig(global_batch_size=6, grad_accum_steps=4)
  trainer = _run(steps=30, skip_spike_factor=1.5, learning_rate=1e-2, warmup_steps=0)
  history = trainer.fit(20, log=lambda x: None)
  assert not any(m['skipped'] for m in history)  # the periodic stream trains smoothly
  last_loss = history[-1]['loss']
  params = [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))]
  step = int(trainer.optimizer.step[...])
  noise = np.random.default_rng(0).integers(0, 64, (8, 33))  # unlearnable: a spike
  record = trainer.step(noise)
  assert record['skipped'] and record['loss'] > 1.5 * last_loss
  after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))]
  assert all(np.array_equal(a, b) for a, b in zip(params, after))
  assert int(trainer.optimizer.step[...]) == step
  assert not trainer.step()['skipped']  # the next ordinary batch trains again


def test_masked_cross_entropy_matches_float64_numpy():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 5, 7)) * 3
  targets = rng.integers(0, 7, (2, 5))
  mask = (rng.random((2, 5)) > 0.3).astype(np.float32)
  ce, z = masked_cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(targets),
                               jnp.asarray(mask))
  lse = np.log(np.exp(logits).sum(-1))
  picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(ce), ((lse - picked) * mask).sum(), rtol=1e-5)
  np.testing.assert_allclose(float(z), (lse**2 * mask).sum(), rtol=1e-5)


def test_cli_keys_cover_the_contract(tmp_path, capsys):
  assert cli.main(['train', '--help']) == 0
  text = capsys.readouterr().out
  for key in ('model', 'steps', 'global_batch_size', 'seq_len', 'learning_rate', 'seed', 'dtype',
              'data', 'output_dir', 'checkpoint_every', 'metrics_jsonl', 'mesh.data', 'mesh.fsdp',
              'mesh.tensor', 'mesh.expert', 'mesh.context', 'mesh.stage'):
    assert f'  {key} ' in text, key
  assert cli.main(['train', 'mesh.fsdb=2']) == 2
  assert "Did you mean 'mesh.fsdp'" in capsys.readouterr().err


def test_cli_yaml_mesh_and_synthetic_data(tmp_path, capsys):
  config = tmp_path / 'run.yml'
  config.write_text('steps: 4\nglobal_batch_size: 8\nseq_len: 16\nlog_every: 2\n'
                    'mesh:\n  fsdp: 2\n  tensor: 2\n')
  jsonl = tmp_path / 'm.jsonl'
  args = ['train', str(config), 'data=synthetic', 'mesh.data=2', f'output_dir={tmp_path}/run',
          f'metrics_jsonl={jsonl}', 'scan_layers=true', 'sample_tokens=0']
  assert cli.main(args) == 0, capsys.readouterr().err
  rows = [json.loads(line) for line in open(jsonl)]
  assert len(rows) == 4 and {'step', 'loss', 'lr', 'grad_norm', 'tokens_per_s',
                             'tflops_per_device', 'mfu'} <= set(rows[0])
  assert "'data': 2, 'fsdp': 2, 'tensor': 2" in capsys.readouterr().out


def test_cli_compile_fails_fast_when_too_big(capsys):
  args = ['compile', 'model=tiny', 'memory_limit_gib=0.00001', 'global_batch_size=8',
          'seq_len=16', 'mesh.data=1']
  assert cli.main(args) == 2
  assert 'over by' in capsys.readouterr().err


def test_cli_trains_on_jsonl_through_the_pipeline(tmp_path, capsys):
  """data=<jsonl> with tokenizer= goes through the packing pipeline (without tokenizer=, one
  is trained on the documents: tests/test_cli_keys.py)."""
  from maxnnx.data import DEFAULT_CORPUS, train_sentencepiece
  docs = tmp_path / 'docs.jsonl'
  docs.write_text(''.join(json.dumps({'text': f'Sir {i}, the quick brown fox is here. ' * 3})
                          + '\n' for i in range(200)))
  out = tmp_path / 'run'
  base = ['train', f'data={docs}', f'output_dir={out}', 'steps=3', 'log_every=3',
          'global_batch_size=4', 'seq_len=32', 'mesh.data=1', 'sample_tokens=0']
  tok = train_sentencepiece(DEFAULT_CORPUS, str(tmp_path / 'sp'), 512)
  assert cli.main(base + [f'tokenizer={tok}']) == 0, capsys.readouterr().err
  rows = [json.loads(line) for line in open(out / 'metrics.jsonl')]
  assert len(rows) == 3 and all(np.isfinite(r['loss']) for r in rows)


# -- optimizer details: mu_dtype, adam_eps_root, schedule length, weight-decay exclusion --------


def _abstract_tiny():
  cfg = maxnnx.get_preset('tiny', vocab_size=64, num_layers=1, d_model=32, mlp_dim=64)
  return nnx.eval_shape(lambda: maxnnx.Transformer(cfg, rngs=nnx.Rngs(0)))


def _params(model, value=1.0) -> dict:
  """Every parameter of ``model`` filled with ``value``, as a plain nested dict."""
  shapes = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return jax.tree.map(lambda s: jnp.full(s.shape, value, s.dtype), shapes)


def _paths(tree) -> dict[str, np.ndarray]:
  return {'/'.join(str(getattr(k, 'key', k)) for k in path): np.asarray(x)
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize('optimizer', ['adamw', 'muon'])
def test_mu_dtype_sets_the_first_moments_dtype(optimizer):
  model = _abstract_tiny()
  params = _params(model)
  for mu_dtype, expected in ((None, jnp.float32), ('bfloat16', jnp.bfloat16)):
    tx = make_optimizer(TrainConfig(optimizer=optimizer, mu_dtype=mu_dtype), model)
    state = tx.init(params)
    mus = jax.tree.leaves([x for _, x in optax.tree.get_all_with_path(state, 'mu')])
    nus = jax.tree.leaves([x for _, x in optax.tree.get_all_with_path(state, 'nu')])
    assert mus and {x.dtype for x in mus} == {jnp.dtype(expected)}, (optimizer, mu_dtype)
    assert {x.dtype for x in nus} == {jnp.dtype(jnp.float32)}  # the second moment stays


def test_adam_eps_root_enters_the_update_like_float64_numpy():
  """Two AdamW steps with eps_root: ``-lr * m_hat / (sqrt(v_hat + eps_root) + eps)``."""
  b1, b2, eps, eps_root, lr = 0.9, 0.95, 1e-8, 1e-4, 0.1
  config = TrainConfig(learning_rate=lr, schedule='constant', warmup_steps=0, weight_decay=0.0,
                       clip_norm=None, b1=b1, b2=b2, eps=eps, adam_eps_root=eps_root)
  model = _abstract_tiny()
  params = _params(model)
  rng = np.random.default_rng(0)
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(0, 0.01, p.shape), p.dtype), params)
           for _ in range(2)]
  tx = make_optimizer(config, model)
  state = tx.init(params)
  for g in grads:
    updates, state = tx.update(g, state, params)
  m = v = 0.0
  for g in grads:
    g64 = _paths(g)['layers/0/attn/q_proj/kernel'].astype(np.float64)
    m, v = b1 * m + (1 - b1) * g64, b2 * v + (1 - b2) * g64**2
  m_hat, v_hat = m / (1 - b1**2), v / (1 - b2**2)
  expected = -lr * m_hat / (np.sqrt(v_hat + eps_root) + eps)
  got = _paths(updates)['layers/0/attn/q_proj/kernel']
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-8)
  without = -lr * m_hat / (np.sqrt(v_hat) + eps)
  assert np.abs(got - without).max() > 1e-2  # eps_root matters at these gradient sizes


def test_the_schedule_runs_over_learning_rate_schedule_steps():
  """A 100-step run of a 200-step cosine schedule stops half way; past its end it is flat."""
  base = dict(learning_rate=1.0, warmup_steps=10)
  cut = make_schedule(TrainConfig(steps=100, learning_rate_schedule_steps=200, **base))
  full = make_schedule(TrainConfig(steps=200, **base))
  assert float(cut(100)) == pytest.approx(float(full(100))) and float(cut(100)) > 0.5
  assert float(make_schedule(TrainConfig(steps=100, **base))(100)) == pytest.approx(0.1)
  longer = make_schedule(TrainConfig(steps=300, learning_rate_schedule_steps=200, **base))
  assert [float(longer(s)) for s in (200, 300)] == pytest.approx([0.1, 0.1])
  wsd = make_schedule(TrainConfig(steps=50, learning_rate_schedule_steps=100, schedule='wsd',
                                  decay_fraction=0.2, **base))
  assert float(wsd(50)) == pytest.approx(1.0) and float(wsd(90)) == pytest.approx(0.55)
  assert TrainConfig(steps=100, learning_rate_schedule_steps=400).resolved_warmup_steps == 20
  with pytest.raises(ConfigError, match='TrainConfig.warmup_steps must be in'):
    TrainConfig(steps=100, learning_rate_schedule_steps=50, warmup_steps=60)
  with pytest.raises(ConfigError, match='TrainConfig.learning_rate_schedule_steps must be >= 1'):
    TrainConfig(learning_rate_schedule_steps=0)


@pytest.mark.parametrize('optimizer', ['adamw', 'muon'])
@pytest.mark.parametrize('decay_all, exclude, decayed', [
    (False, (), {'kernel'}),                              # today's default: kernels only
    (False, (r'/attn/',), {'mlp'}),                       # attention kernels excluded
    (True, (r'norm/', r'^embed/'), {'kernel', 'head'}),  # all but norms and the embedding
])
def test_weight_decay_reaches_exactly_the_unexcluded_parameters(optimizer, decay_all, exclude,
                                                                decayed):
  """After one step with a zero gradient only decayed parameters move, by ``lr * wd``
  (Muon included: its Adam part no longer decays embeddings and norms by default)."""
  lr, wd = 0.5, 0.1
  config = TrainConfig(optimizer=optimizer, learning_rate=lr, schedule='constant',
                       warmup_steps=0, weight_decay=wd, decay_all=decay_all,
                       weight_decay_exclude=exclude, clip_norm=None)
  model = _abstract_tiny()
  params = _params(model)
  tx = make_optimizer(config, model)
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  expected = {  # which paths each case decays
      'kernel': lambda path: path.endswith('/kernel'),
      'mlp': lambda path: path.endswith('/kernel') and '/attn/' not in path,
      'head': lambda path: not path.startswith('embed/') and 'norm/' not in path,
  }
  for path, update in _paths(updates).items():
    wanted = any(expected[name](path) for name in decayed)
    np.testing.assert_allclose(update, -lr * wd if wanted else 0.0, rtol=1e-6, err_msg=path)


def test_a_bad_weight_decay_pattern_is_one_clear_line(capsys):
  with pytest.raises(ConfigError, match=r"TrainConfig.weight_decay_exclude: '\(' is not a "):
    TrainConfig(weight_decay_exclude=('(',))
  assert cli.main(['train', 'model=tiny', 'weight_decay_exclude=a(b', 'steps=1']) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and 'weight_decay_exclude' in err[0], err


def test_the_new_optimizer_keys_are_part_of_a_runs_config_only_when_set():
  """A run directory records them (and the MoE bias update rate) when set, so a resume with
  other values is refused, and leaves them out at their defaults (older run directories
  stay resumable)."""
  model = maxnnx.get_preset('tiny')
  assert 'router_bias_update_rate' not in run_config(model, TrainConfig())['model']['moe']
  balanced = model.replace(**{'moe.num_experts': 4, 'moe.router_score_bias': True,
                              'moe.router_bias_update_rate': 0.001})
  assert run_config(balanced, TrainConfig())['model']['moe']['router_bias_update_rate'] == 0.001
  plain = run_config(model, TrainConfig())['train']
  assert not {'mu_dtype', 'adam_eps_root', 'learning_rate_schedule_steps',
              'weight_decay_exclude'} & set(plain)
  changed = TrainConfig(mu_dtype='bfloat16', weight_decay_exclude=('norm',))
  assert config_diff(run_config(model, TrainConfig()), run_config(model, changed)) == [
      'mu_dtype: (unset) -> bfloat16', "weight_decay_exclude: (unset) -> ['norm']"]

"""Checkpoints MaxText itself wrote (``tests/maxtext_fixtures``, made by its ``make_fixtures.py``
with MaxText's own trainer and ``generate_param_only_checkpoint``): maxnnx's logits from each
equal the logits MaxText's own model computed from it."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxnnx
from maxnnx import cli
from maxnnx.checkpoint.manager import CheckpointError
from maxnnx.checkpoint.maxtext import maxtext_params, read_settings

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'maxtext_fixtures')
CASES = {  # fixture: its step directory
    'llama2_scanned': 2, 'llama2_unscanned': 2, 'llama2_scanned_linen': 2,
    'llama2_params_only_nnx': 0, 'llama2_params_only_linen': 0, 'mixtral_moe_scanned': 2,
    'deepseek_mla_moe_scanned': 2, 'gemma_scanned': 2, 'gemma2_scanned': 2,
    'llama31_rope_scanned': 2, 'gemma3_params_only_nnx': 0, 'gpt_oss_params_only_nnx': 0,
    'llama4_params_only_nnx': 0}


def _fixture(name):
  directory = os.path.join(FIXTURES, name)
  with open(os.path.join(directory, 'overrides.txt')) as f:
    settings = f.read().split()
  with open(os.path.join(directory, 'tokens.json')) as f:
    tokens = jnp.asarray(json.load(f)['tokens'])
  return (os.path.join(directory, 'checkpoints', str(CASES[name])), settings, tokens,
          np.load(os.path.join(directory, 'logits.npy')))


@pytest.mark.parametrize('name', list(CASES))
def test_logits_equal_maxtexts_own(name):
  """Trainer states (NNX and Linen, scanned and not), parameters-only checkpoints (both
  layouts, bfloat16), a Mixtral-style MoE, a DeepSeek-V3-style block (latent attention,
  shared expert, biased sigmoid routing over expert groups, yarn), the Gemma, GPT-OSS and
  Llama 4 blocks and Llama 3.1's rotary embedding: maxnnx's float32 logits equal MaxText's."""
  step_dir, settings, tokens, expected = _fixture(name)
  model = maxnnx.from_maxtext(step_dir, settings, dtype='float32')
  np.testing.assert_allclose(model(tokens), expected, rtol=1e-4, atol=1e-4)


def test_a_scanned_load_and_the_record():
  step_dir, settings, tokens, expected = _fixture('llama2_unscanned')
  model = maxnnx.from_maxtext(step_dir, settings, dtype='float32', scan_layers=True)
  np.testing.assert_allclose(model(tokens), expected, rtol=1e-4, atol=1e-4)
  _, record = maxtext_params(step_dir)
  assert record == {'step': 3, 'layout': 'params/params', 'full_state': True}
  _, record = maxtext_params(_fixture('llama2_params_only_nnx')[0])
  assert record == {'step': None, 'layout': 'nnx', 'full_state': False}


def test_cli_converts_a_maxtext_step_to_hugging_face(tmp_path, capsys):
  step_dir, settings, tokens, expected = _fixture('mixtral_moe_scanned')
  keys = ','.join(s for s in settings if s.split('=')[0] in (
      'decoder_block', 'num_experts_per_tok', 'max_target_length'))
  assert cli.main(['convert', f'src={step_dir}', f'dst={tmp_path}/hf',
                   f'maxtext_config={keys}']) == 0
  assert '(maxtext) to' in capsys.readouterr().out
  model = maxnnx.from_pretrained(str(tmp_path / 'hf'), dtype='float32')
  assert model.config.family == 'mixtral' and model.config.moe.num_experts_per_tok == 2
  np.testing.assert_allclose(model(tokens), expected, rtol=1e-4, atol=1e-4)


def test_settings_and_refusals(tmp_path, capsys):
  yaml_path = tmp_path / 'run.yml'
  yaml_path.write_text('base_config: base.yml\ndecoder_block: mistral\n'
                       'normalization_layer_epsilon: 1.0e-6\n')
  settings = read_settings(str(yaml_path))
  assert settings['decoder_block'] == 'mistral' and settings['normalization_layer_epsilon'] == 1e-6
  step_dir = _fixture('llama2_scanned')[0]
  with pytest.raises(CheckpointError, match='decoder_block=qwen3'):
    maxnnx.from_maxtext(step_dir, ['decoder_block=qwen3'])
  with pytest.raises(CheckpointError, match='rope_type=yarn: for the llama2 block'):
    maxnnx.from_maxtext(step_dir, ['rope_type=yarn'])
  with pytest.raises(CheckpointError, match='no MoeBlock_0'):
    maxnnx.from_maxtext(step_dir, ['decoder_block=mixtral'])
  with pytest.raises(CheckpointError, match='no items/ inside'):
    maxnnx.from_maxtext(str(tmp_path))
  assert cli.main(['convert', f'src={step_dir}', f'dst={tmp_path}/out',
                   'maxtext_config=decoder_block=qwen3']) == 2
  assert 'decoder_block=qwen3' in capsys.readouterr().err
  assert not (tmp_path / 'out' / 'config.json').exists()


@pytest.mark.parametrize('name,change,moved', [
    ('deepseek_mla_moe_scanned', 'rope_factor=1', 0.5),
    ('deepseek_mla_moe_scanned', 'n_routing_groups=-1', 0.1),
    ('deepseek_mla_moe_scanned', 'routed_scaling_factor=1', 0.1),
    ('gemma2_scanned', 'attn_logits_soft_cap=0', 0.1),
    ('gemma2_scanned', 'final_logits_soft_cap=0', 0.1),
    ('gemma2_scanned', 'sliding_window_size=100', 0.5),
    ('gemma3_params_only_nnx', 'rope_linear_scaling_factor=1', 0.1),
    ('gemma3_params_only_nnx', 'local_rope_max_timescale=1000000', 0.01),
    ('gpt_oss_params_only_nnx', 'mlp_activations_limit=100', 0.1),
    ('gpt_oss_params_only_nnx', 'rope_attention_scaling=false', 0.1),
    ('gpt_oss_params_only_nnx', 'sliding_window_size=100', 0.1),
    ('llama4_params_only_nnx', 'chunk_attn_window_size=0', 0.5),
    ('llama4_params_only_nnx', 'use_qk_norm=false', 0.1),
    ('llama4_params_only_nnx', 'nope_layer_interval=-1', 0.1),
    ('llama31_rope_scanned', 'rope_use_scale=false', 1e-3),
    ('llama31_rope_scanned', 'rope_type=default', 0.5)])
def test_the_settings_are_read(name, change, moved):
  """Each of these settings moves a fixture's logits by far more than the tolerance above when
  changed (so that fixture's equality proves it is read as MaxText applies it): yarn, expert
  groups and routed scale (DeepSeek), soft caps and the local window (Gemma 2), the global
  layers' linear rotary scaling and the local layers' base (Gemma 3), the expert clamp, yarn's
  cos/sin scaling and the window (GPT-OSS), chunks, q/k norms and NoPE layers (Llama 4), Llama
  3.1's frequency scaling and its interleaved rotary pairs."""
  step_dir, settings, tokens, expected = _fixture(name)
  key = change.split('=')[0]
  settings = [s for s in settings if s.split('=')[0] != key] + [change]
  model = maxnnx.from_maxtext(step_dir, settings, dtype='float32')
  assert np.abs(np.asarray(model(tokens)) - expected).max() > moved


def test_block_refusals():
  step_dir, settings, _, _ = _fixture('deepseek_mla_moe_scanned')
  for change, message in (('model_name=default', "model names starting 'deepseek3'"),
                          ('routed_score_func=softmax', 'routed_score_func=sigmoid'),
                          ('rope_type=default', 'rope_type=yarn rope_interleave=true')):
    key = change.split('=')[0]
    given = [s for s in settings if s.split('=')[0] != key] + [change]
    with pytest.raises(CheckpointError, match=message):
      maxnnx.from_maxtext(step_dir, given)
  with pytest.raises(CheckpointError, match='no moe_layers'):
    maxnnx.from_maxtext(_fixture('llama2_scanned')[0], settings)
  step_dir, settings, _, _ = _fixture('gemma3_params_only_nnx')
  with pytest.raises(CheckpointError, match='query scale of Gemma 3 from the model name'):
    maxnnx.from_maxtext(step_dir, [*settings, 'model_name=gemma3-1b'])
  step_dir, settings, _, _ = _fixture('gpt_oss_params_only_nnx')
  with pytest.raises(CheckpointError, match='read with yarn'):
    maxnnx.from_maxtext(step_dir, [*settings, 'rope_type=default'])
  # Read, not yet written: MaxText's layout is written for llama, mistral and mixtral only.
  from maxnnx.checkpoint.maxtext import hf_checkpoint, maxtext_tree
  params, _ = maxtext_params(step_dir)
  with pytest.raises(CheckpointError, match="model_type='gpt_oss': MaxText checkpoints are "
                                            'written for the llama, mistral, mixtral'):
    maxtext_tree(*hf_checkpoint(params, read_settings(settings)))


def test_a_maxtext_command_line_starts_from_load_parameters_path(tmp_path, capsys):
  """MaxText's ``load_parameters_path`` with its model keys: the run starts from the checkpoint's
  parameters (at learning rate 0, ``final/`` keeps them: its logits equal MaxText's own)."""
  step_dir, settings, tokens, expected = _fixture('llama2_scanned')
  model_keys = [s for s in settings if s.split('=')[0] in (
      'base_emb_dim', 'base_num_query_heads', 'base_num_kv_heads', 'base_mlp_dim',
      'base_num_decoder_layers', 'head_dim', 'vocab_size', 'max_target_length',
      'per_device_batch_size', 'dataset_type', 'scan_layers')]
  out = tmp_path / 'run'
  assert cli.main(['train', f'load_parameters_path={step_dir}/items', *model_keys,
                   'steps=1', 'learning_rate=0', f'base_output_directory={tmp_path}',
                   'run_name=run', 'enable_checkpointing=false', 'dtype=float32',
                   'sample_tokens=0']) == 0
  assert f'Starting from the MaxText checkpoint {step_dir} (its step 3)' in capsys.readouterr().out
  model = maxnnx.from_pretrained(str(out / 'final'), dtype='float32')
  np.testing.assert_allclose(model(tokens), expected, rtol=1e-4, atol=1e-4)
  assert cli.main(['train', 'model=tiny', 'maxtext_config=decoder_block=llama2',
                   f'output_dir={tmp_path}/third']) == 2
  assert 'model=tiny is not one (no items/ inside)' in capsys.readouterr().err


def test_load_parameters_path_reads_what_the_shapes_cannot_say_from_the_model_name():
  from maxnnx.maxtext_keys import _checkpoint_settings
  assert _checkpoint_settings({'model_name': 'mistral-7b'}) == (
      'decoder_block=mistral,normalization_layer_epsilon=1e-05,rope_max_timescale=1000000.0,'
      'sliding_window_size=0,num_experts_per_tok=2,model_name=mistral-7b')
  deepseek = dict(item.split('=') for item in _checkpoint_settings(
      {'model_name': 'deepseek3-671b'}).split(','))
  assert deepseek['decoder_block'] == 'deepseek' and deepseek['rope_type'] == 'yarn'
  assert deepseek['n_routing_groups'] == '8' and deepseek['model_name'] == 'deepseek3-671b'
  assert 'num_experts_per_tok=3' in _checkpoint_settings(
      {'model_name': 'mixtral-8x7b', 'num_experts_per_tok': 3})


def _flat(tree, prefix=''):
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f'{prefix}{key}/'))
    else:
      out[prefix + key] = np.asarray(value, np.float32)
  return out


@pytest.mark.parametrize('name,scan', [('llama2_scanned', True), ('llama2_unscanned', False),
                                       ('mixtral_moe_scanned', True)])
def test_the_maxtext_tree_written_is_the_one_maxtext_wrote(name, scan):
  """Hugging Face -> MaxText is the inverse of the reader: from a checkpoint MaxText wrote, the
  tree maxnnx writes back has MaxText's own keys, shapes and values."""
  from maxnnx.checkpoint.maxtext import hf_checkpoint, maxtext_tree
  step_dir, settings, _, _ = _fixture(name)
  params, _ = maxtext_params(step_dir)
  tree, written = maxtext_tree(*hf_checkpoint(params, read_settings(settings)), scan_layers=scan)
  expected, got = _flat(params), _flat(tree)
  assert sorted(got) == sorted(expected)
  for key in expected:
    np.testing.assert_allclose(got[key], expected[key], rtol=1e-6, atol=1e-7, err_msg=key)
  given = dict(s.split('=', 1) for s in settings)
  for key in ('base_emb_dim', 'base_num_query_heads', 'base_num_kv_heads', 'head_dim',
              'base_num_decoder_layers', 'vocab_size'):
    assert str(written[key]) == given[key], key


def test_cli_converts_hugging_face_to_a_maxtext_checkpoint(tmp_path, capsys):
  step_dir, settings, tokens, expected = _fixture('llama2_scanned')
  assert cli.main(['convert', f'src={step_dir}', f'dst={tmp_path}/hf']) == 0
  assert cli.main(['convert', f'src={tmp_path}/hf', f'dst={tmp_path}/mt', 'format=maxtext',
                   'scan_layers=true']) == 0
  printed = capsys.readouterr().out
  assert f'load_parameters_path={tmp_path}/mt/0/items decoder_block=llama2 scan_layers=true' in (
      printed)
  written, record = maxtext_params(str(tmp_path / 'mt' / '0'))
  assert record['layout'] == 'params/params' and not record['full_state']
  original, _ = maxtext_params(step_dir)
  assert sorted(_flat(written)) == sorted(_flat(original))
  mt_keys = printed.split('load_parameters_path=')[1].split()[1:]
  model = maxnnx.from_maxtext(str(tmp_path / 'mt' / '0'), mt_keys, dtype='float32')
  np.testing.assert_allclose(model(tokens), expected, rtol=1e-4, atol=1e-4)
  assert cli.main(['convert', f'src={tmp_path}/hf', f'dst={tmp_path}/mt2', 'format=maxtext',
                   'dtype=float16']) == 2
  assert 'weight_dtype is float32 or bfloat16' in capsys.readouterr().err


def _params(model):
  from flax import nnx
  state = nnx.state(model, nnx.Param).to_pure_dict()
  return {tuple(str(getattr(k, 'key', k)) for k in path): np.asarray(v)
          for path, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def _continue_maxtexts_run(name):
  """maxnnx's first step from fixture ``name``'s full training state (parameters, adamw mu/nu,
  step 3) on the batch MaxText's own next step took (``<fixture>/next_step``, made by
  ``make_fixtures.py --next-step``), with MaxText's adamw settings (base.yml: b1 0.9, b2 0.95,
  eps 1e-8, decay 0.1 of every parameter) at the rate its schedule gives that step and no
  clipping, as in MaxText's step. Returns the parameters before and after it and MaxText's
  after its step, in maxnnx's layout, the step's metrics and MaxText's record of it."""
  from maxnnx.checkpoint.maxtext import _in_model_layout, hf_checkpoint, load_optimizer_state
  from maxnnx.train import TrainConfig, Trainer
  step_dir, settings, _, _ = _fixture(name)
  directory = os.path.join(FIXTURES, name, 'next_step')
  with open(os.path.join(directory, 'next_step.json')) as f:
    info = json.load(f)
  tree = {}
  for key, value in np.load(os.path.join(directory, 'params.npz')).items():
    *parents, leaf = key.split('/')
    node = tree
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  model = maxnnx.from_maxtext(step_dir, settings, dtype='float32', scan_layers=True)
  before = _params(model)
  tokens = np.asarray(info['tokens'], np.int32)
  config = TrainConfig(optimizer='adamw', learning_rate=info['learning_rate'],
                       schedule='constant', warmup_steps=0, b1=0.9, b2=0.95, eps=1e-8,
                       weight_decay=0.1, decay_all=True, clip_norm=None,
                       global_batch_size=tokens.shape[0], seq_len=tokens.shape[1] - 1, steps=4)
  trainer = Trainer(model, config)
  assert load_optimizer_state(trainer, step_dir, settings) == 3 and trainer.step_count == 3
  trainer.step(tokens)
  metrics = trainer.flush_metrics()
  assert metrics['step'] == 4 and abs(metrics['loss'] - info['loss']) < 1e-3  # logged to 1e-3
  expected = {tuple(map(str, k)): v for k, v in _in_model_layout(
      *hf_checkpoint(tree, read_settings(settings)), trainer.model_config).items()}
  return before, _params(trainer.model), expected, info


def test_maxtexts_optimizer_state_continues_its_run():
  """From MaxText's full training state, maxnnx's first update gives MaxText's own next
  parameters (and loss). The exception is the query kernel, which HF's parametrisation holds
  times sqrt(head_dim): Adam's update does not scale with the parameter, so there maxnnx's
  Adam term is MaxText's (in MaxText's coordinates) divided by sqrt(head_dim), which the test
  checks exactly."""
  before, got, expected, info = _continue_maxtexts_run('llama2_scanned')
  assert sorted(got) == sorted(expected)
  query = ('layers', 'attn', 'q_proj', 'kernel')
  for key in got:
    if key != query:
      np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=1e-6, err_msg=str(key))
      assert np.abs(got[key] - before[key]).max() > 1e-3, key  # the step moved it
  # q_hf = c * q_mt (c = sqrt(head_dim) = 2). MaxText: q_mt' = q_mt - lr (A + wd q_mt); maxnnx
  # with the moments converted by the chain rule: q_hf' = q_hf - lr (A + wd q_hf).
  decay = info['learning_rate'] * 0.1 * before[query]
  maxtext_adam = expected[query] - before[query] + decay  # -lr * c * A
  maxnnx_adam = got[query] - before[query] + decay  # -lr * A
  np.testing.assert_allclose(maxtext_adam, 2.0 * maxnnx_adam, rtol=0, atol=1e-6)
  assert np.abs(maxnnx_adam).max() > 1e-3


def test_maxtexts_deepseek_optimizer_state_continues_its_run():
  """DeepSeek's conversion only transposes (MLA scales its query at run time), so there every
  trained parameter after maxnnx's first update equals MaxText's after its own next step. The
  routing bias is not trained by either (no gradient reaches it; the balancing rule that moves
  it is off in this step), but MaxText's adamw decays it with every other parameter; maxnnx
  leaves it alone."""
  before, got, expected, info = _continue_maxtexts_run('deepseek_mla_moe_scanned')
  assert sorted(got) == sorted(expected)
  bias = ('layers', 'mlp', 'router', 'e_score_correction_bias')
  for key in got:
    if key != bias:
      np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=1e-6, err_msg=str(key))
      assert np.abs(got[key] - before[key]).max() > 1e-3, key
  np.testing.assert_array_equal(got[bias], before[bias])
  decayed = before[bias] * (1 - info['learning_rate'] * 0.1)
  np.testing.assert_allclose(expected[bias], decayed, rtol=1e-6)
  assert np.abs(before[bias]).min() > 0.01


def test_a_maxtext_command_line_continues_load_full_state_path(tmp_path, capsys):
  """``load_full_state_path=``: the run starts at MaxText's step 3 with its optimizer state
  and takes the one step left of steps=4; a parameters-only checkpoint is refused in a line."""
  step_dir, settings, _, _ = _fixture('llama2_scanned')
  model_keys = [s for s in settings if s.split('=')[0] in (
      'base_emb_dim', 'base_num_query_heads', 'base_num_kv_heads', 'base_mlp_dim',
      'base_num_decoder_layers', 'head_dim', 'vocab_size', 'max_target_length',
      'per_device_batch_size', 'dataset_type', 'scan_layers', 'learning_rate')]
  assert cli.main(['train', f'load_full_state_path={step_dir}/items', *model_keys, 'steps=4',
                   f'base_output_directory={tmp_path}', 'run_name=run',
                   'enable_checkpointing=false', 'dtype=float32', 'sample_tokens=0']) == 0
  out = capsys.readouterr().out
  assert "Continuing MaxText's training state at step 3" in out
  with open(tmp_path / 'run' / 'metrics.jsonl') as f:
    steps = [json.loads(line)['step'] for line in f if '"loss"' in line]
  assert steps == [4]
  params_only = _fixture('llama2_params_only_linen')[0]
  assert cli.main(['train', f'load_full_state_path={params_only}/items', *model_keys,
                   'steps=2', f'base_output_directory={tmp_path}', 'run_name=second',
                   'scan_layers=false', 'enable_checkpointing=false', 'sample_tokens=0']) == 2
  err = capsys.readouterr().err
  assert 'no optimizer state in it' in err and 'load_parameters_path=' in err

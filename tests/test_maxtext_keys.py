"""MaxText's keys, YAML files and model names on maxnnx's command line (maxnnx.maxtext_keys)."""

import json
import os
import re

import jax
import pytest

from maxnnx import cli, maxtext_key_table, maxtext_keys
from maxnnx.config import ConfigError
from maxnnx.models.registry import PRESETS
from maxnnx.presets import MAXTEXT_ALIASES, MAXTEXT_REFUSED, get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse(*args):
  return cli.parse_overrides(list(args), cli.train_keys())


def _configs(*args):
  """``(run, TrainConfig, ModelConfig)`` a command line builds (no model made)."""
  run, train, changes, _ = cli._split_options(_parse(*args))
  return run, train, cli._model_config(run, changes)[0]


def test_maxnnx_command_lines_are_read_as_before():
  """Without MaxText's keys the table is not consulted: maxnnx's defaults stay."""
  assert maxtext_keys.parse(['steps=3'], cli.train_keys(), cli.ALIASES) is None
  options = _parse('steps=3', 'mesh.fsdp=2')
  assert (options['model'], options['learning_rate'], options['mesh.data']) == ('tiny', 3e-3, -1)


def test_keys_map_with_their_values_converted():
  run, train, model = _configs(
      'per_device_batch_size=2', 'max_target_length=64', 'steps=40', 'learning_rate=1e-3',
      'model_name=llama3.1-8b-Instruct', 'base_num_decoder_layers=2', 'base_emb_dim=256',
      'ici_fsdp_parallelism=1', 'dcn_data_parallelism=1', 'ici_tensor_parallelism=1',
      'adam_b2=0.99', 'gradient_clipping_threshold=0', 'run_name=r1',
      'base_output_directory=out', 'remat_policy=save_qkv_proj', 'attention=dot_product',
      'mlp_activations=gelu', 'num_experts=1', 'use_qk_norm=true', 'weight_dtype=bfloat16',
      'enable_checkpointing=false', 'eval_interval=-1', 'warmup_steps_fraction=0.25')
  assert train.global_batch_size == 2 * jax.device_count()
  assert (train.seq_len, train.steps, train.learning_rate, train.b2) == (64, 40, 1e-3, 0.99)
  assert train.clip_norm is None and train.warmup_steps == 10 and train.eval_every == 0
  assert train.checkpoint_every == 0 and train.checkpoint_dir is None
  assert (train.mesh.fsdp, train.mesh.data, train.mesh.dcn_data) == (1, 1, 1)
  assert run['output_dir'] == os.path.join('out', 'r1') and run['model'] == 'llama3.1-8b'
  assert (model.num_layers, model.d_model, model.num_heads) == (
      2, 256, get_preset('llama3.1-8b').num_heads)
  assert (model.mlp_activation, model.mlp_gated, model.moe.num_experts) == ('gelu_tanh', False, 0)
  assert model.attention.qk_norm == 'head' and model.runtime.param_dtype == 'bfloat16'
  assert model.runtime.remat_policy == 'save_qkv_proj'
  assert model.runtime.attention_impl == 'xla_flash'


def test_context_parallel_keys_reach_the_mesh():
  _, train, _ = _configs('per_device_batch_size=1', 'ici_context_parallelism=4',
                         'context_parallel_strategy=ring', 'context_parallel_load_balance=false')
  assert train.mesh.context == 4 and train.mesh.context_parallel_strategy == 'ring'
  assert not train.mesh.context_load_balance
  assert _configs('per_device_batch_size=1')[1].mesh.context_parallel_strategy == 'all_gather'


def test_ragged_buffer_factor_caps_the_moe_exchange():
  """MaxText's factor (-1 and other values <= 0: the worst case) is the MoE setting."""
  moe = ('per_device_batch_size=1', 'num_experts=8', 'num_experts_per_tok=2')
  assert _configs(*moe, 'ragged_buffer_factor=2')[2].moe.ragged_buffer_factor == 2.0
  assert _configs(*moe, 'ragged_buffer_factor=-1')[2].moe.ragged_buffer_factor is None


def test_maxtext_defaults_are_honoured():
  """Its optimizer, schedule, mesh, scan and remat, checkpoint period and default model."""
  run, train, model = _configs('per_device_batch_size=1', 'steps=50')
  assert (train.optimizer, train.learning_rate, train.schedule) == ('adamw', 3e-5, 'cosine')
  assert (train.b1, train.b2, train.eps, train.weight_decay) == (0.9, 0.95, 1e-8, 0.1)
  assert train.decay_all and train.clip_norm == 1.0 and train.final_lr_fraction == 0.1
  assert train.warmup_steps == 5  # warmup_steps_fraction 0.1 of 50 steps
  assert (train.mesh.data, train.mesh.fsdp, train.mesh.dcn_data) == (1, -1, -1)
  assert train.checkpoint_every == 10_000
  assert model.runtime.scan_layers and model.runtime.remat_policy == 'full'
  assert run['model'] == 'llama2-7b'
  assert (model.d_model, model.num_layers, model.num_heads, model.head_dim, model.mlp_dim,
          model.vocab_size) == (2048, 16, 16, 128, 7168, 32_000)
  # maxnnx's own run length, batch and sequence are kept (MaxText's are a pod's).
  _, train, _ = _configs('model_name=llama2-7b')
  assert (train.steps, train.seq_len, train.global_batch_size) == (600, 128, 16)


def test_refusals_and_notes(capsys):
  cases = {
      'ici_fsdp_transpose_parallelism=2': 'no second FSDP axis',
      'decoder_block=gemma2': 'model_name=',
      'dataset_type=tfds': 'no TFDS reader',
      'remat_policy=minimal_offloaded': "'minimal'",
      'opt_type=adam_pax': 'no equivalent',
      'model_name=deepseek3-671b-batchsplit': 'batch-split schedule',
      'model_name=qwen3-vl-4b': 'Qwen3-VL',
      'model_name=llama3.2-1b': 'Did you mean',
      'context_parallel_strategy=ulysses': "takes 'all_gather', 'ring'",
      'use_ring_of_experts=true': 'expert_parallel_strategy=all_to_all',
  }
  for arg, message in cases.items():
    assert cli.main(['train', 'per_device_batch_size=1', arg]) == 2, arg
    err = capsys.readouterr().err
    assert err.startswith('error: ') and message in err and err.count('\n') == 1, (arg, err)
  # load_full_state_path names the step directory and asks for its optimizer state too.
  options = _parse('load_full_state_path=gs://b/ckpt/100/items', 'model_name=mistral-7b')
  assert options['model'] == 'gs://b/ckpt/100' and options['maxtext_full_state']
  assert 'decoder_block=mistral' in options['maxtext_config']
  # At MaxText's default a refused key changes nothing; a no-op knob is noted in one line.
  options = _parse('ici_fsdp_transpose_parallelism=1', 'hardware=gpu', 'megablox=false',
                   'load_parameters_path=')
  assert options['mesh.fsdp'] == -1
  out = capsys.readouterr().out.splitlines()
  assert out == ["Note: MaxText's hardware has no effect here: maxnnx uses the devices JAX finds.",
                 "Note: MaxText's megablox has no effect here: MaxText's MoE kernel choice; "
                 'maxnnx: model.runtime.ragged_dot_impl.']


def test_batch_per_device_needs_the_devices_known():
  """Before a multi-process run joins, the devices are unknown: the global batch is asked
  for (counting devices then would start JAX's backend before the processes join)."""
  with pytest.raises(cli.UsageError, match='give global_batch_size='):
    _parse('per_device_batch_size=2', 'coordinator=localhost:1234', 'num_processes=2',
           'process_id=0')
  with pytest.raises(cli.UsageError, match='whole number'):
    _parse(f'per_device_batch_size={0.5 / jax.device_count()}')


def test_keep_every_checkpoint(tmp_path):
  yml = tmp_path / 'run.yml'
  yml.write_text('base_config: "base.yml"\nmax_num_checkpoints_to_keep: None\n')
  assert _parse(f'config={yml}')['keep_checkpoints'] == maxtext_key_table.KEEP_ALL
  assert _parse(f'config={yml}', 'max_num_checkpoints_to_keep=2')['keep_checkpoints'] == 2


def test_unknown_keys_name_the_nearest_of_both_vocabularies():
  with pytest.raises(cli.UsageError, match="Did you mean 'per_device_batch_size'"):
    _parse('per_device_batch_size=1', 'per_device_batchsize=2')
  with pytest.raises(cli.UsageError, match="Did you mean 'global_batch_size'"):
    _parse('per_device_batch_size=1', 'global_batch_sise=2')
  with pytest.raises(cli.UsageError, match="Did you mean 'steps'"):  # no MaxText key: as ever
    _parse('stesp=3')


def test_two_names_for_one_setting_must_agree(tmp_path):
  devices = jax.device_count()
  for args in (['per_device_batch_size=1', f'global_batch_size={devices + 1}'],
               ['max_target_length=64', 'seq_len=32'],
               ['ici_fsdp_parallelism=2', 'mesh.fsdp=1'],
               ['run_name=a', 'output_dir=b'],
               ['model_name=gemma2-2b', 'model=tiny']):
    with pytest.raises(cli.UsageError, match='give one of them'):
      _parse(*args)
  # Agreeing values are fine, and the same key on the command line overrides the YAML's.
  options = _parse('per_device_batch_size=1', f'global_batch_size={devices}',
                   'max_target_length=32', 'seq_len=32')
  assert (options['global_batch_size'], options['seq_len']) == (devices, 32)
  yml = tmp_path / 'run.yml'
  yml.write_text('base_config: "base.yml"\nmax_target_length: 64\nsteps: 10\n')
  options = _parse(f'config={yml}', 'max_target_length=16')
  assert (options['seq_len'], options['steps']) == (16, 10)


def test_a_base_config_chain_is_read_in_order(tmp_path):
  (tmp_path / 'mine.yml').write_text('base_config: "base.yml"\nsteps: 7\nlearning_rate: 0.01\n')
  (tmp_path / 'run.yml').write_text('base_config: "mine.yml"\nsteps: 9\n')
  options = _parse(f'config={tmp_path / "run.yml"}')
  assert (options['steps'], options['learning_rate'], options['model']) == (9, 0.01, 'llama2-7b')


TINY_YAML = """\
base_config: "base.yml"
run_name: "tiny-maxtext"
model_name: "default"
base_emb_dim: 64
base_num_query_heads: 4
base_num_kv_heads: 2
base_mlp_dim: 128
base_num_decoder_layers: 2
head_dim: 16
vocab_size: 256
max_target_length: 32
per_device_batch_size: 2
steps: 6
learning_rate: 1.e-3
warmup_steps_fraction: 0.5
dataset_type: "synthetic"
enable_checkpointing: true
checkpoint_period: 3
log_period: 3
dtype: "float32"
weight_dtype: "float32"
scan_layers: true
remat_policy: "full"
attention: "dot_product"
ici_fsdp_parallelism: -1
dcn_data_parallelism: -1
hardware: "cpu"
"""


def test_a_maxtext_yaml_trains_end_to_end(tmp_path, capsys):
  """A tiny MaxText-style YAML trains through ``maxnnx train``: its run directory, steps,
  checkpoints and model sizes are the YAML's."""
  yml = tmp_path / 'tiny.yml'
  yml.write_text(TINY_YAML)
  out = tmp_path / 'runs'
  assert cli.main(['train', f'config={yml}', f'base_output_directory={out}',
                   'sample_tokens=0']) == 0
  run = out / 'tiny-maxtext'
  lines = [json.loads(line) for line in open(run / 'metrics.jsonl')]
  assert [m['step'] for m in lines] == [1, 2, 3, 4, 5, 6]
  assert sorted(os.listdir(run / 'checkpoints'))[:2] == ['3', '6']
  config = json.loads((run / 'final' / 'config.json').read_text())
  assert (config['hidden_size'], config['num_hidden_layers'], config['num_key_value_heads'],
          config['head_dim'], config['vocab_size']) == (64, 2, 2, 16, 256)
  assert "Note: MaxText's hardware has no effect here" in capsys.readouterr().out


def test_every_maxtext_model_name_resolves_or_is_refused():
  """All of MaxText's model names: a preset of the same architecture, or a reason."""
  assert len(set(maxtext_keys.MAXTEXT_MODEL_NAMES)) == len(maxtext_keys.MAXTEXT_MODEL_NAMES)
  assert len(maxtext_keys.MAXTEXT_MODEL_NAMES) == 81
  resolved = 0
  for name in maxtext_keys.MAXTEXT_MODEL_NAMES:
    if name in MAXTEXT_REFUSED:
      with pytest.raises(ConfigError, match=re.escape('not built here: ' + MAXTEXT_REFUSED[name])):
        get_preset(name)
      with pytest.raises(cli.UsageError, match=re.escape(f'model_name={name}: ')):
        maxtext_keys.model_preset(name)
    else:
      assert maxtext_keys.model_preset(name) in PRESETS, name
      resolved += 1
  assert resolved == 81 - len(MAXTEXT_REFUSED)
  assert set(MAXTEXT_REFUSED) <= set(maxtext_keys.MAXTEXT_MODEL_NAMES)
  assert not set(MAXTEXT_REFUSED) & set(MAXTEXT_ALIASES)
  # The sharding / schedule variants of V3 never fall back silently to plain deepseek-v3.
  for variant in ('deepseek3-671b-2dfsdp', 'deepseek3-671b-batchsplit'):
    assert variant in MAXTEXT_REFUSED and variant not in MAXTEXT_ALIASES


def test_listing_and_doc_hold_the_table(capsys):
  assert cli.main(['maxtext-keys']) == 0
  printed = capsys.readouterr().out
  for name in maxtext_keys.MAXTEXT_KEYS:
    assert f'\n  {name} ' in printed, name
  assert 'deepseek3-671b-2dfsdp        refused:' in printed
  assert cli.main(['train', '--help']) == 0
  assert 'maxnnx maxtext-keys' in capsys.readouterr().out
  with open(os.path.join(ROOT, 'docs', 'from_maxtext.md')) as f:
    doc = f.read()
  assert maxtext_keys.table_markdown() in doc, 'regenerate the key table of from_maxtext.md'
  assert maxtext_keys.models_markdown() in doc, 'regenerate the model table of from_maxtext.md'

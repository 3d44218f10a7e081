"""Command-line keys: every config field as a dotted key, YAML trees, --help and errors."""

import dataclasses
import json
import os
import typing

import numpy as np
import pytest
from conftest import cli_losses

import maxnnx
from maxnnx import cli
from maxnnx.config import MeshConfig, ModelConfig, ValidatedConfig
from maxnnx.config.commands import ProcessConfig, RunConfig
from maxnnx.data import DataConfig
from maxnnx.train.config import TrainConfig

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures', 'hf')


def _configs(args):
  """``(run, TrainConfig, ModelConfig, data fields)`` a command line builds (no model made)."""
  run, train_config, changes, data = cli._split_options(cli.parse_overrides(args,
                                                                            cli.train_keys()))
  model_config, _ = cli._model_config(run, changes)
  return run, train_config, model_config, data


def test_dotted_keys_reach_their_configs():
  run, train, model, data = _configs(
      ['model=llama3.1-8b', 'model.num_layers=2', 'model.rope.theta=5e5', 'data=x.jsonl',
       'data.column=content', 'data.weights=2', 'mesh.fsdp=4', 'train.mesh.tensor=2',
       'train.learning_rate=1e-3', 'model.eos_token_id=1,2', 'model.local_rope=none',
       'mesh.rules=[[embed, fsdp], [mlp, [fsdp, tensor]]]'])
  assert (model.num_layers, model.rope.theta, model.eos_token_id) == (2, 5e5, (1, 2))
  assert model.rope.scaling == 'llama3' and model.rope.factor == 8.0  # the preset's rope kept
  assert model.d_model == maxnnx.get_preset('llama3.1-8b').d_model
  assert (train.learning_rate, train.mesh.fsdp, train.mesh.tensor) == (1e-3, 4, 2)
  assert train.mesh.rules == (('embed', 'fsdp'), ('mlp', ('fsdp', 'tensor')))
  assert run['data'] == 'x.jsonl'
  config = DataConfig.from_string(run['data'], **data)
  assert (config.sources, config.column, config.weights) == (('x.jsonl',), 'content', (2.0,))


def test_nested_config_fields_can_be_set_and_cleared():
  _, _, model, _ = _configs(['model=gemma3-1b', 'model.local_rope.theta=2e4'])
  assert model.local_rope.theta == 2e4 and model.rope == maxnnx.get_preset('gemma3-1b').rope
  _, _, model, _ = _configs(['model=gemma3-1b', 'model.local_rope=null'])
  assert model.local_rope is None


def test_model_keys_apply_on_top_of_a_checkpoint_config():
  from maxnnx.models.pretrained import config_from_pretrained
  directory = os.path.join(FIXTURES, 'llama')
  run, _, model, _ = _configs([f'model={directory}', 'model.rope.theta=123.0',
                               'model.attention_impl=xla'])
  base = config_from_pretrained(directory)
  assert model.rope.theta == 123.0 and model.runtime.attention_impl == 'xla'
  assert model.replace(rope=base.rope, runtime=base.runtime) == base
  _, overrides = cli._model_config(run, {'rope': {'theta': 123.0}})
  assert overrides['rope'] == model.rope and 'num_layers' not in overrides


def test_flat_keys_keep_working():
  run, train, model, data = _configs(
      ['steps=5', 'learning_rate=0.01', 'seq_len=32', 'global_batch_size=4', 'dtype=float32',
       'scan_layers=true', 'remat_policy=full', 'attention_impl=xla', 'mesh.data=1'])
  assert (train.steps, train.learning_rate, train.seq_len, train.global_batch_size) == (
      5, 0.01, 32, 4)
  runtime = model.runtime
  assert (runtime.dtype, runtime.scan_layers, runtime.remat_policy, runtime.attention_impl) == (
      'float32', True, 'full', 'xla')
  assert train.mesh.data == 1 and run['model'] == 'tiny' and data == {}
  _, train, model, _ = _configs([])  # the default run's defaults
  assert (train.steps, train.learning_rate, model.runtime.dtype, model.num_layers) == (
      600, 3e-3, 'auto', 4)


def test_grouped_model_keys():
  _, train, model, _ = _configs(['model=tiny-moe', 'model.moe.num_experts=4',
                                 'model.moe.num_experts_per_tok=1',
                                 'model.runtime.scan_layers=true', 'router_aux_loss_coef=0.02'])
  assert (model.moe.num_experts, model.moe.num_experts_per_tok) == (4, 1)
  assert model.runtime.scan_layers and train.router_aux_loss_coef == 0.02
  assert model.moe.mlp_dim == maxnnx.get_preset('tiny-moe').moe.mlp_dim  # rest of the group kept
  with pytest.raises(cli.UsageError, match="Did you mean 'model.moe.num_experts'"):
    _configs(['model=tiny-moe', 'model.moe.num_expert=4'])


def test_model_keys_beat_the_flat_ones():
  _, _, model, _ = _configs(['dtype=float32', 'model.runtime.dtype=bfloat16'])
  assert model.runtime.dtype == 'bfloat16'


def test_yaml_tree_and_command_line_precedence(tmp_path):
  config = tmp_path / 'run.yml'
  config.write_text('model: tiny\n'
                    'model.d_model: 64\n'
                    'steps: 9\n'
                    'train:\n  learning_rate: 2e-3\n  seq_len: 16\n'
                    'mesh: {fsdp: 2}\n'
                    'data: {column: body}\n')
  nested = tmp_path / 'nested.yml'
  nested.write_text('model:\n  num_layers: 3\n  rope: {theta: 1000}\n')
  run, train, model, data = _configs(['steps=4', f'config={config}', 'mesh.fsdp=1',
                                      f'config={nested}', 'model.num_layers=1'])
  assert (train.steps, train.learning_rate, train.seq_len, train.mesh.fsdp) == (4, 2e-3, 16, 1)
  assert (model.d_model, model.num_layers, model.rope.theta) == (64, 1, 1000.0)
  assert data == {'column': 'body'} and run['model'] == 'tiny'
  _, train, _, _ = _configs([str(config)])  # the file given first, as before
  assert train.steps == 9


def test_attention_group_keys_reach_the_model_config():
  """``model.attention.*`` keys come from AttentionConfig's fields and merge into the preset's
  group; a renamed field's old name is an unknown key."""
  _, _, model, _ = _configs(['model=gemma2-2b', 'model.attention.sliding_window=64',
                             'model.attention.logit_softcap=20.0'])
  preset = maxnnx.get_preset('gemma2-2b').attention
  assert model.attention == preset.replace(sliding_window=64, logit_softcap=20.0)
  with pytest.raises(cli.UsageError, match="unknown key 'model.attn_logit_softcap'"):
    _configs(['model=gemma2-2b', 'model.attn_logit_softcap=20.0'])


def test_stages_switch_scan_layers_on(capsys):
  run, train, model, _ = _configs(['mesh.stage=2', 'mesh.data=1'])
  assert train.mesh.stage == 2 and run['scan_layers'] and model.runtime.scan_layers
  assert capsys.readouterr().out.count('scan_layers') == 1


ERRORS = [
    (['model.num_layer=2'], "unknown key 'model.num_layer'. Did you mean 'model.num_layers'?"),
    (['model.rope.thta=1'], "Did you mean 'model.rope.theta'?"),
    (['data.colum=x'], "Did you mean 'data.column'?"),
    (['column=content'], "Did you mean 'data.column'?"),
    (['mesh.fsdb=2'], "Did you mean 'mesh.fsdp'?"),
    (['train.stesp=3'], "Did you mean 'steps'?"),
    (['stesp=3'], "Did you mean 'steps'?"),
    (['model.norm_type=rsm'], "expected rms|layer. Did you mean 'rms'?"),
    (['steps=three'], "steps='three': expected int."),
    (['model.rope.theta=abc'], 'expected float'),
    (['learning_rate=nan'], 'nan'),
    (['learning_rate=inf'], 'learning_rate must be finite'),
    (['mesh.fsdp=0'], 'positive or -1'),
    (['model.num_layers=0'], 'num_layers must be > 0'),
    (['model.rope.scaling=llama3'], 'needs original_max_position_embeddings'),
    (['data.packing=firstfit', 'data=synthetic'], "Did you mean 'first_fit'?"),
    (['model.eos_token_id=x'], 'expected int|tuple[int,...]|None'),
    (['steps'], 'expected key=value'),
]


@pytest.mark.parametrize('args, message', ERRORS, ids=[a[0] for a, _ in ERRORS])
@pytest.mark.parametrize('command', ['train', 'compile'])
def test_errors_are_one_line(command, args, message, tmp_path, capsys):
  assert cli.main([command, *args, f'output_dir={tmp_path}']) == 2
  err = capsys.readouterr().err
  assert err.startswith('error: ') and err.count('\n') == 1 and message in err, err


@pytest.mark.parametrize('text, where', [
    ('model: {num_layers: 2\nsteps: 3\n', ':2:6:'),
    ('steps: 3\n\tseq_len: 4\n', ':2:'),
    ('steps: [1, 2\n', ':2:'),
    ('- steps\n- 3\n', 'expected a mapping'),
])
def test_malformed_yaml_is_one_line(text, where, tmp_path, capsys):
  config = tmp_path / 'bad.yml'
  config.write_text(text)
  assert cli.main(['train', f'config={config}', f'output_dir={tmp_path}']) == 2
  err = capsys.readouterr().err
  assert err.startswith(f'error: {config}') and err.count('\n') == 1 and where in err, err
  assert cli.main(['train', f'config={tmp_path}/missing.yml']) == 2
  assert 'no such config file' in capsys.readouterr().err


def _leaves(cls, prefix, skip=()):
  """``{dotted key: default}`` of every field of config ``cls``, nested configs expanded."""
  out = {}
  for field in dataclasses.fields(cls):
    if field.name in skip:
      continue
    default = (field.default if field.default is not dataclasses.MISSING
               else field.default_factory())
    nested = [a for a in (typing.get_type_hints(cls)[field.name],
                          *typing.get_args(typing.get_type_hints(cls)[field.name]))
              if isinstance(a, type) and issubclass(a, ValidatedConfig)]
    if nested:
      out.update(_leaves(nested[0], f'{prefix}{field.name}.'))
    if not nested or default is None:
      out[prefix + field.name] = default
  return out


@pytest.mark.parametrize('command', ['train', 'compile'])
def test_help_lists_every_field_with_type_and_default(command, capsys):
  assert cli.main([command, '--help']) == 0
  lines = capsys.readouterr().out.splitlines()
  expected = {**_leaves(TrainConfig, '', skip=('mesh',)), **_leaves(MeshConfig, 'mesh.'),
              **_leaves(ModelConfig, 'model.'), **_leaves(DataConfig, 'data.')}
  expected.update({**_leaves(RunConfig, ''), **_leaves(ProcessConfig, '')})
  expected.update(cli.TRAIN_OVERRIDES)
  assert len(expected) > 150
  for key, default in expected.items():
    row = [line for line in lines if line.startswith(f'  {key} ')]
    assert len(row) == 1, key
    shown = 'none' if default is None else repr(default)
    name, kind, equals, value, *doc = row[0].split(maxsplit=4)
    assert equals == '=' and value == shown.split()[0] and kind, row[0]
    assert doc and doc[0].strip(), f'{key} has no documentation'
  for heading in ('TrainConfig (KEY or train.KEY)', 'MeshConfig (mesh.KEY)', 'ModelConfig',
                  'DataConfig'):
    assert any(line.startswith(heading) for line in lines), heading


@pytest.mark.slow  # ~30 s: test_train covers the CLI run
def test_train_end_to_end_with_dotted_keys(tmp_path, capsys):
  # The issue's command: no tokenizer is given, so one is trained on the documents' column.
  docs = tmp_path / 'docs.jsonl'
  docs.write_text(''.join(json.dumps({'content': f'Sir {i}, the quick brown fox is here. ' * 3})
                          + '\n' for i in range(100)))
  out = tmp_path / 'run'
  args = ['train', 'model=tiny', 'model.num_layers=2', f'data={docs}', 'data.column=content',
          'steps=3', f'output_dir={out}', 'log_every=3', 'global_batch_size=4', 'seq_len=32',
          'mesh.data=1', 'sample_tokens=12']
  assert cli.main(args) == 0, capsys.readouterr().err
  rows = [json.loads(line) for line in open(out / 'metrics.jsonl')]
  assert len(rows) == 3
  config = json.load(open(out / 'final' / 'config.json'))
  assert config['num_hidden_layers'] == 2
  from maxnnx.data import SentencePieceTokenizer
  tokenizer = SentencePieceTokenizer(str(out / 'tokenizer.model'))
  assert config['vocab_size'] == tokenizer.vocab_size  # small corpus: the model matches it
  assert 'Sir' in tokenizer.decode(tokenizer.encode('Sir 7, the quick brown fox'))
  capsys.readouterr()
  assert cli.main(args[:4] + args[5:] + ['output_dir=' + str(tmp_path / 'other')]) == 2
  assert "no column 'text'" in capsys.readouterr().err  # the default column is not in the file


@dataclasses.dataclass(frozen=True)
class _Experts(ValidatedConfig):
  """Attributes:
    num_experts: routed experts.
    router: softmax or sigmoid.
  """

  num_experts: int = 0
  router: typing.Literal['softmax', 'sigmoid'] = 'softmax'


@dataclasses.dataclass(frozen=True)
class _Model(ValidatedConfig):
  """Attributes:
    width: residual width.
    moe: the experts.
  """

  width: int = 8
  moe: _Experts = dataclasses.field(default_factory=_Experts)


def test_nested_groups_are_walked_generically():
  """A config grouped into nested configs gets dotted keys, old flat names and merges."""
  from maxnnx import cli_keys
  keys = cli_keys.config_keys(_Model, 'model.', 'model', fill=False)
  assert set(keys) == {'model.width', 'model.moe.num_experts', 'model.moe.router'}
  values = cli_keys.parse(['model.moe.num_experts=4', 'model.router=sigmoid'], keys)
  assert values == {'model.moe.num_experts': 4, 'model.moe.router': 'sigmoid'}
  base = _Model(width=16, moe=_Experts(num_experts=2))
  merged = cli_keys.merge(base, cli_keys.subtree({'model.moe.num_experts': 4}, 'model.'))
  assert merged == _Model(width=16, moe=_Experts(num_experts=4))
  with pytest.raises(cli_keys.UsageError, match="Did you mean 'model.moe.router'"):
    cli_keys.parse(['model.moe.ruter=x'], keys)
  assert any('model.moe.num_experts' in line for line in cli_keys.usage_lines(keys))


@pytest.mark.slow
def test_pipeline_stages_from_the_command_line_match_one_device(tmp_path, capsys):
  # mesh.stage=2 with mesh.fsdp=4 (8 simulated devices): scan_layers is switched on by itself
  # and every step's loss equals a one-device run of the same model (a seed draws the same weights
  # in every layout: test_train checks the loop, the scan and 2 stages against each other).
  common = ['train', 'model=tiny', 'model.num_layers=2', 'data=synthetic', 'steps=3',
            'log_every=1', 'global_batch_size=8', 'seq_len=16', 'sample_tokens=0',
            'eval_every=0', 'checkpoint_every=0', 'dtype=float32']
  losses = cli_losses(tmp_path, capsys, common, {
      'one': ['mesh.data=1', 'scan_layers=true'], 'pp': ['mesh.stage=2', 'mesh.fsdp=4']})
  assert 'scan_layers is set to true' in capsys.readouterr().out
  assert len(losses['pp']) == 3
  np.testing.assert_allclose(losses['pp'], losses['one'], rtol=1e-5)

"""Emergency checkpoints in one process: which step a resume takes (local or persistent), copies
that are incomplete or gone, and local copies restored onto another mesh. The two-process
scenarios (a lost local disk, a restart on fewer processes) are in
test_emergency_multiprocess.py."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.checkpoint.emergency import LocalCheckpoints, choose_source, peer_of
from maxnnx.checkpoint.manager import CheckpointError
from maxnnx.config import ConfigError, MeshConfig
from maxnnx.data import TokenWindows
from maxnnx.train import TrainConfig, Trainer

VOCAB, BATCH, SEQ = 64, 4, 16


def _trainer(tmp_path, mesh=None, batch=BATCH, **kw):
  model = maxnnx.get_preset('tiny', vocab_size=VOCAB, num_layers=2, d_model=32, mlp_dim=64,
                            num_heads=2, num_kv_heads=1, head_dim=16)
  config = TrainConfig(steps=8, learning_rate=3e-3, global_batch_size=batch, seq_len=SEQ,
                       warmup_steps=2, log_every=1, checkpoint_dir=str(tmp_path / 'persistent'),
                       enable_emergency_checkpoint=True,
                       local_checkpoint_directory=str(tmp_path / 'local'),
                       local_checkpoint_period=1, mesh=mesh or MeshConfig(data=1), **kw)
  tokens = np.random.default_rng(0).integers(0, VOCAB, 4000)
  return Trainer(model, config, data=TokenWindows(tokens, SEQ, batch, seed=3))


def _values(trainer):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model))]


def test_choose_source_takes_the_newest_step_and_local_on_a_tie():
  assert choose_source([3, 5], [4]) == ('local', 5)
  assert choose_source([3], [4, 2]) == ('persistent', 4)
  assert choose_source([4], [4]) == ('local', 4)
  assert choose_source([], [2]) == ('persistent', 2)
  assert choose_source([1], []) == ('local', 1)
  assert choose_source([], []) is None
  assert [peer_of(i, 3) for i in range(3)] == [1, 2, 0]


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """Local steps 1 and 3, persistent step 2, and the state after each step."""
  root = tmp_path_factory.mktemp('emergency')
  trainer = _trainer(root)
  states = {}
  for step in (1, 2, 3):
    trainer.step()
    states[step] = _values(trainer)
    if step == 2:
      trainer.save_checkpoint()
    else:
      trainer.save_local_checkpoint()
  trainer.close()
  return root, states


def _copy(saved, tmp_path):
  root, states = saved
  shutil.copytree(root, tmp_path, dirs_exist_ok=True)
  return states


def test_the_newest_complete_local_step_wins(saved, tmp_path):
  states = _copy(saved, tmp_path)
  assert LocalCheckpoints(str(tmp_path / 'local')).latest_step() == 3
  trainer = _trainer(tmp_path)
  assert trainer.restore_checkpoint() == 3
  for a, b in zip(_values(trainer), states[3]):
    np.testing.assert_array_equal(a, b)
  assert trainer.data.get_state() is not None and trainer.step_count == 3
  trainer.close()


def test_an_incomplete_local_copy_is_skipped_for_the_newer_persistent_step(saved, tmp_path):
  states = _copy(saved, tmp_path)
  index = tmp_path / 'local' / 'process-0' / '3' / 'shards-0.json'
  record = json.loads(index.read_text())
  record['bytes'] += 1  # the archive it names is not all there
  index.write_text(json.dumps(record))
  assert sorted(LocalCheckpoints(str(tmp_path / 'local')).complete_steps()) == [1]
  trainer = _trainer(tmp_path)
  assert trainer.restore_checkpoint() == 2  # persistent 2 beats the complete local 1
  for a, b in zip(_values(trainer), states[2]):
    np.testing.assert_array_equal(a, b)
  assert not (tmp_path / 'local' / 'process-0' / '3').exists()  # the resumed run saves it anew
  trainer.close()


def test_a_missing_local_directory_falls_back_to_the_persistent_step(saved, tmp_path):
  states = _copy(saved, tmp_path)
  shutil.rmtree(tmp_path / 'local')
  trainer = _trainer(tmp_path)
  assert trainer.restore_checkpoint() == 2
  for a, b in zip(_values(trainer), states[2]):
    np.testing.assert_array_equal(a, b)
  trainer.close()


def test_a_garbled_local_copy_falls_back_to_the_persistent_step(saved, tmp_path, caplog):
  _copy(saved, tmp_path)
  index = tmp_path / 'local' / 'process-0' / '3' / 'shards-0.json'
  record = json.loads(index.read_text())
  record['pieces'][0]['checksum'] += 1
  index.write_text(json.dumps(record))
  trainer = _trainer(tmp_path)
  assert trainer.restore_checkpoint() == 2
  assert 'Local checkpoint step 3 cannot be restored' in caplog.text
  assert 'fails its checksum' in caplog.text
  trainer.close()


def test_nothing_to_resume_from_is_one_line_when_required(tmp_path):
  trainer = _trainer(tmp_path)
  assert trainer.restore_checkpoint() is None
  with pytest.raises(CheckpointError, match=r'^Nothing to resume from: no complete checkpoint '
                     r'in checkpoint_dir=\S+ nor local_checkpoint_directory=\S+; point') as info:
    trainer.restore_checkpoint(required=True)
  assert '\n' not in str(info.value)
  trainer.close()


@pytest.mark.slow  # ~20-30 s: two meshes compile
def test_local_copies_restore_onto_another_mesh(tmp_path):
  """Saved from data x fsdp x tensor = 2 x 2 x 2 (each array in up to 8 parts, replicated
  parts written once), restored on fsdp = 8: every value equal, laid out on the new mesh, and
  the next step's loss that of the first run."""
  first = _trainer(tmp_path, MeshConfig(data=2, fsdp=2, tensor=2), batch=8)
  first.step()
  first.step()
  first.save_local_checkpoint()
  second = _trainer(tmp_path, MeshConfig(data=1, fsdp=8), batch=8)
  assert second.restore_checkpoint() == 2
  for a, b in zip(_values(first), _values(second)):
    np.testing.assert_array_equal(a, b)
  kernel = second.model.layers[0].attn.q_proj.kernel[...]
  assert dict(kernel.sharding.mesh.shape)['fsdp'] == 8 and 'fsdp' in kernel.sharding.spec
  batch = np.random.default_rng(1).integers(0, VOCAB, (8, SEQ + 1))
  np.testing.assert_allclose(second.step(batch)['loss'], first.step(batch)['loss'], rtol=1e-5)
  first.close()
  second.close()


def test_local_checkpoints_keep_the_newest_steps_and_read_back_exactly(tmp_path):
  import jax.numpy as jnp  # noqa: PLC0415
  local = LocalCheckpoints(str(tmp_path))
  tree = {'w': jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4), 'flag': jnp.asarray(True),
          'count': jnp.asarray(7, jnp.int32)}
  for step in range(1, 5):
    local.save(step, tree, {'loss': jnp.float32(step)}, {'step_meta': step})
  assert sorted(os.listdir(tmp_path / 'process-0')) == ['3', '4']
  assert sorted(os.listdir(tmp_path / 'process-0' / '4')) == ['shards-0.json', 'shards-0.npz']
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  state, extra, meta = local.restore(4, abstract, {'loss': jax.ShapeDtypeStruct((), jnp.float32)})
  for name, value in tree.items():
    assert state[name].dtype == value.dtype
    np.testing.assert_array_equal(np.asarray(state[name]), np.asarray(value))
  assert float(extra['loss']) == 4.0 and meta == {'step_meta': 4}
  with pytest.raises(CheckpointError, match='step 2 has no complete local copy'):
    local.restore(2, abstract, {})


@pytest.mark.parametrize('change,message', [
    ({'local_checkpoint_directory': None}, 'needs local_checkpoint_directory'),
    ({'local_checkpoint_period': 0}, 'needs local_checkpoint_period >= 1'),
    ({'checkpoint_dir': None}, 'needs checkpoint_dir too'),
    ({'local_checkpoint_directory': 'gs://bucket/x'}, 'must be a local path'),
])
def test_emergency_settings_are_checked(change, message):
  settings = dict(enable_emergency_checkpoint=True, local_checkpoint_directory='local',
                  local_checkpoint_period=1, checkpoint_dir='persistent')
  with pytest.raises(ConfigError, match=message):
    TrainConfig(**{**settings, **change})


@pytest.mark.slow  # ~50 s: two CLI runs
def test_cli_keys_save_local_checkpoints_and_a_restart_resumes_from_them(tmp_path, capsys):
  """``maxnnx train`` with MaxText's keys: local steps 2 and 3 beside persistent step 2 (and the
  final 3); with the persistent 3 gone, the longer restart resumes from local step 3."""
  from maxnnx import cli  # noqa: PLC0415
  out, local = tmp_path / 'run', tmp_path / 'local'
  args = ['train', f'output_dir={out}', 'model=tiny', 'model.num_layers=1', 'seq_len=32',
          'global_batch_size=4', 'sample_tokens=0', 'eval_every=0', 'checkpoint_every=2',
          'log_every=1', 'mesh.data=1', 'enable_emergency_checkpoint=true',
          f'local_checkpoint_directory={local}', 'local_checkpoint_period=1']
  assert cli.main([*args, 'steps=3']) == 0
  assert sorted(os.listdir(local / 'process-0')) == ['2', '3']
  shutil.rmtree(out / 'checkpoints' / '3')
  capsys.readouterr()
  assert cli.main([*args, 'steps=4']) == 0
  assert f'Resuming from the checkpoint of step 3 in {local}.' in capsys.readouterr().out
  steps = [json.loads(line)['step'] for line in open(out / 'metrics.jsonl')]
  assert steps == [1, 2, 3, 4]

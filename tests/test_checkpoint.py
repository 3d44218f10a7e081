"""Training checkpoints: exact resume (also after a real SIGKILL), corrupt-latest fallback,
data positions, params-only loading and ``maxnnx convert``."""

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx import cli
from maxnnx.checkpoint import read_safetensors_dir
from maxnnx.checkpoint.manager import CheckpointError, CheckpointManager
from maxnnx.config import MeshConfig
from maxnnx.data import TokenWindows, make_pipeline
from maxnnx.models.checkpoints import checkpoint_config, load_params
from maxnnx.train import TrainConfig, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, BATCH, SEQ = 64, 4, 16


def _model_config(**kw):
  return maxnnx.get_preset('tiny', vocab_size=VOCAB, num_layers=2, d_model=32, mlp_dim=64,
                           num_heads=2, num_kv_heads=1, head_dim=16, **kw)


def _tokens(seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, 4000)


def _trainer(steps, directory=None, every=0, data_seed=3, **kw):
  config = TrainConfig(steps=steps, learning_rate=3e-3, global_batch_size=BATCH, seq_len=SEQ,
                       warmup_steps=2, log_every=1, checkpoint_dir=directory,
                       checkpoint_every=every, mesh=MeshConfig(data=1), **kw)
  return Trainer(_model_config(), config, data=TokenWindows(_tokens(), SEQ, BATCH, seed=data_seed))


def _losses(history):
  return {m['step']: m['loss'] for m in history}


@pytest.fixture(scope='module')
def reference():
  """Losses of an uninterrupted 8-step run."""
  trainer = _trainer(8)
  return _losses(trainer.fit(log=lambda line: None))


def test_resume_in_a_fresh_trainer_matches_an_uninterrupted_run(tmp_path, reference,
                                                               two_checkpoints):
  """Stop after a checkpoint at step 4; a fresh Trainer resumes and reproduces steps 5-8."""
  shutil.copytree(two_checkpoints[0], tmp_path, dirs_exist_ok=True)
  assert CheckpointManager(str(tmp_path)).all_steps() == [2, 4]
  second = _trainer(8, str(tmp_path), every=2)
  history = second.fit(log=lambda line: None)
  second.close()
  assert [m['step'] for m in history] == [5, 6, 7, 8]
  for step, loss in _losses(history).items():
    assert loss == pytest.approx(reference[step], rel=1e-6), step
  assert CheckpointManager(str(tmp_path)).all_steps() == [4, 6, 8]  # keep_checkpoints=3
  done = _trainer(8, str(tmp_path))
  assert done.fit(log=lambda line: None) == []  # nothing left to train
  assert done.restore_checkpoint(6) == 6 and done.step_count == 6


_CHILD = textwrap.dedent('''
  import json, sys, time
  sys.path.insert(0, sys.argv[1])
  import numpy as np
  from tests.test_checkpoint import _trainer
  trainer = _trainer(int(sys.argv[3]), sys.argv[2], every=2)
  trainer.callbacks.append(lambda t, m: time.sleep(0.15))  # slow enough to be killed midway
  history = trainer.fit(log=lambda line: None)
  trainer.close()
  with open(sys.argv[4], 'w') as f:
    json.dump({m['step']: m['loss'] for m in history}, f)
''')


@pytest.mark.slow
def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path, reference):
  """A training process killed with SIGKILL after its first checkpoint resumes exactly."""
  script, ckpt, out = tmp_path / 'child.py', tmp_path / 'ckpt', tmp_path / 'losses.json'
  script.write_text(_CHILD)
  env = {**os.environ, 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu'}
  command = [sys.executable, str(script), ROOT, str(ckpt), '8', str(out)]
  child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.time() + 120
  while time.time() < deadline and child.poll() is None:
    if os.path.isdir(ckpt) and any(n.isdigit() for n in os.listdir(ckpt)):
      break
    time.sleep(0.05)
  assert child.poll() is None, 'the child ended before it could be killed'
  child.send_signal(signal.SIGKILL)
  child.wait()
  assert child.returncode == -signal.SIGKILL and not out.exists()
  saved = CheckpointManager(str(ckpt)).all_steps()
  assert saved and saved[-1] < 8
  rerun = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         timeout=300)
  assert rerun.returncode == 0, rerun.stderr.decode()[-2000:]
  losses = {int(k): v for k, v in json.loads(out.read_text()).items()}
  assert sorted(losses) == list(range(saved[-1] + 1, 9))
  for step, loss in losses.items():
    assert loss == pytest.approx(reference[step], rel=1e-6), step


def _corrupt(step_dir, how):
  if how == 'garbled_array':
    for path in glob.glob(os.path.join(step_dir, 'state', '**', 'd', '*'), recursive=True):
      data = bytearray(open(path, 'rb').read())
      data[len(data) // 2] ^= 0xFF
      open(path, 'wb').write(bytes(data))
  elif how == 'deleted_array':
    for path in glob.glob(os.path.join(step_dir, 'state', '**', 'd', '*'), recursive=True):
      os.remove(path)
  elif how == 'missing_metadata':
    os.remove(os.path.join(step_dir, 'state', '_METADATA'))
  elif how == 'missing_meta':
    os.remove(os.path.join(step_dir, 'meta', 'metadata'))
  elif how == 'wrong_checksum':
    path = os.path.join(step_dir, 'meta', 'metadata')
    meta = json.load(open(path))
    key = sorted(meta['checksums']['state'])[0]
    meta['checksums']['state'][key] += 1
    json.dump(meta, open(path, 'w'))


@pytest.fixture(scope='module')
def two_checkpoints(tmp_path_factory):
  """A directory with checkpoints of steps 2 and 4 of an 8-step run stopped after step 4
  (the same schedule as the reference: config.steps is the total), and the step-2 parameters."""
  directory = str(tmp_path_factory.mktemp('two'))
  trainer = _trainer(8, directory, every=2)
  params = {}
  trainer.callbacks.append(lambda t, m: params.setdefault(
      m['step'], jax.device_get(nnx.to_pure_dict(nnx.state(t.model, nnx.Param)))))
  trainer.fit(4, log=lambda line: None)
  trainer.close()
  return directory, params[2]


@pytest.mark.parametrize('how', ['garbled_array', 'deleted_array', 'missing_metadata',
                                 'missing_meta', 'wrong_checksum'])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path, two_checkpoints, how,
                                                              caplog):
  """A damaged newest step is reported (step and problem) and the one before is used."""
  source, params_at_2 = two_checkpoints
  directory = str(tmp_path / 'ckpt')
  shutil.copytree(source, directory)
  _corrupt(os.path.join(directory, '4'), how)
  trainer = _trainer(4, directory)
  with caplog.at_level(logging.WARNING, logger='maxnnx.checkpoint.manager'):
    assert trainer.restore_checkpoint() == 2
  warning = ' '.join(r.getMessage() for r in caplog.records)
  assert 'Checkpoint step 4' in warning and 'unusable' in warning
  assert trainer.step_count == 2
  restored = jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
  jax.tree.map(np.testing.assert_array_equal, restored, params_at_2)
  steps = sorted(name for name in os.listdir(directory) if name != 'high_water.json')
  assert steps == ['2', 'corrupt-4']  # moved aside, never reused
  trainer.close()


def test_explicit_bad_step_raises(tmp_path, two_checkpoints):
  """Asking for one particular damaged (or absent) step is an error, not a fallback."""
  directory = str(tmp_path / 'ckpt')
  shutil.copytree(two_checkpoints[0], directory)
  _corrupt(os.path.join(directory, '4'), 'deleted_array')
  trainer = _trainer(4, directory)
  with pytest.raises(CheckpointError, match='4'):
    trainer.restore_checkpoint(4)
  with pytest.raises(CheckpointError, match='no complete checkpoint of step 3'):
    trainer.restore_checkpoint(3)


def test_half_written_step_is_never_listed(tmp_path, two_checkpoints):
  """orbax's temporary directory of an unfinished save is not a checkpoint."""
  directory = str(tmp_path / 'ckpt')
  shutil.copytree(two_checkpoints[0], directory)
  os.rename(os.path.join(directory, '4'), os.path.join(directory, '6.orbax-checkpoint-tmp'))
  manager = CheckpointManager(directory)
  assert manager.latest_step() == 2
  manager.close()


def test_token_windows_position_is_restored_exactly():
  """TokenWindows continues with exactly the batches after get_state()."""
  seed = int(np.random.default_rng().integers(1000))
  data = TokenWindows(_tokens(seed), SEQ, BATCH, seed=seed)
  for _ in range(3):
    data.next()
  state = json.loads(json.dumps(data.get_state()))
  expected = [data.next() for _ in range(2)]
  fresh = TokenWindows(_tokens(seed), SEQ, BATCH, seed=seed)
  fresh.set_state(state)
  for batch in expected:
    np.testing.assert_array_equal(fresh.next(), batch)


@pytest.mark.slow
def test_grain_pipeline_position_is_restored_through_a_checkpoint(tmp_path):
  """A Trainer fed by a grain Pipeline resumes it at the batch after the checkpoint."""
  seed = int(np.random.default_rng().integers(1000))

  def pipeline():
    return make_pipeline('synthetic', batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB, seed=seed)

  config = TrainConfig(steps=3, global_batch_size=BATCH, seq_len=SEQ, log_every=1,
                       checkpoint_dir=str(tmp_path), mesh=MeshConfig(data=1))
  first_data = pipeline()
  first = Trainer(_model_config(), config, data=first_data)
  first.fit(log=lambda line: None)
  first.close()
  expected = [next(first_data) for _ in range(2)]
  resumed_data = pipeline()
  resumed = Trainer(_model_config(), config, data=resumed_data)
  assert resumed.restore_checkpoint() == 3
  for batch in expected:
    got = next(resumed_data)
    for key in batch:
      np.testing.assert_array_equal(got[key], batch[key])
  resumed.close()


# -- parameters only: fine-tuning and maxnnx convert --------------------------------------------


def test_load_params_from_a_training_checkpoint_in_either_layout(two_checkpoints):
  """load_params reads a training checkpoint's parameters into a scanned or unscanned model."""
  directory, params_at_2 = two_checkpoints
  for scan in (False, True):
    model = maxnnx.Transformer(_model_config(**{'runtime.scan_layers': scan}), rngs=nnx.Rngs(7))
    load_params(model, directory, step=2)
    loaded = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    if scan:  # unstack the layers to compare with the per-layer original
      stacked = loaded.pop('layers')
      loaded['layers'] = {i: jax.tree.map(lambda a, i=i: a[i], stacked)
                          for i in range(model.config.num_layers)}
    jax.tree.map(np.testing.assert_array_equal, loaded, params_at_2)


@pytest.mark.slow
def test_convert_hf_orbax_hf_round_trip_and_layouts(tmp_path, capsys):
  """HF -> orbax (scanned) -> HF gives identical tensors; the scanned orbax checkpoint
  and a per-layer one give the logits of the Hugging Face model."""
  source = os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'llama')
  scanned, flat, back = (str(tmp_path / n) for n in ('scanned', 'flat', 'back'))
  assert cli.main(['convert', f'src={source}', f'dst={scanned}', 'scan_layers=true']) == 0
  assert cli.main(['convert', f'src={scanned}', f'dst={flat}', 'format=orbax']) == 0
  assert cli.main(['convert', f'src={flat}', f'dst={back}']) == 0
  assert 'Converted' in capsys.readouterr().out
  original, written = read_safetensors_dir(source), read_safetensors_dir(back)
  assert sorted(original) == sorted(written)
  for name, (_, array) in original.items():
    np.testing.assert_array_equal(np.asarray(written[name][1]), np.asarray(array), err_msg=name)
  assert (checkpoint_config(scanned).runtime.scan_layers
          and not checkpoint_config(flat).runtime.scan_layers)

  reference = maxnnx.from_pretrained(source)
  tokens = np.random.default_rng().integers(0, reference.config.vocab_size, (2, 12))
  expected = np.asarray(reference(tokens))
  for directory, scan in ((scanned, False), (flat, True)):  # each into the other layout
    model = maxnnx.Transformer(reference.config.replace(**{'runtime.scan_layers': scan}),
                               rngs=nnx.Rngs(1))
    load_params(model, directory)
    np.testing.assert_allclose(np.asarray(model(tokens)), expected, rtol=1e-5, atol=1e-5)
  assert cli.main(['convert', f'src={source}', f'dst={scanned}']) == 2  # never overwrites
  assert 'already has a checkpoint' in capsys.readouterr().err


@pytest.mark.parametrize('case,scan', [('llama', False), ('qwen3_moe', True)])
def test_convert_hf_to_orbax_streams_tensor_by_tensor(case, scan, tmp_path, capsys,
                                                      monkeypatch):
  """``maxnnx convert`` HF -> orbax writes the parameters in small groups (orbax's partial
  save) without building the model: the checkpoint loads (checksums verified) to exactly the
  parameters from_pretrained gives, per layer or scanned (a dense prefix stack too). A
  conversion stopped half-way leaves no step; the next one completes."""
  from orbax.checkpoint.experimental.v1 import partial  # noqa: PLC0415

  from maxnnx.models import checkpoints  # noqa: PLC0415
  source = os.path.join(ROOT, 'tests', 'fixtures', 'hf', case)
  out = str(tmp_path / 'orbax')
  groups = []
  real_save = checkpoints.save_params_streaming

  def failing_once(cfg, params, directory, **kwargs):
    def stop_half_way():
      for i, item in enumerate(params):
        if i == 5:
          raise OSError('disk full')
        yield item
    monkeypatch.setattr(checkpoints, 'save_params_streaming', counting)
    return real_save(cfg, stop_half_way(), directory, group_bytes=1, **kwargs)

  def counting(cfg, params, directory, **kwargs):
    def counted():
      for item in params:
        groups.append(item[0])
        yield item
    return real_save(cfg, counted(), directory, group_bytes=1, **kwargs)

  monkeypatch.setattr(checkpoints, 'save_params_streaming', failing_once)
  saves = []
  real_partial_save = partial.save

  def counted_save(*args, **kwargs):
    saves.append(1)
    return real_partial_save(*args, **kwargs)

  monkeypatch.setattr(partial, 'save', counted_save)
  assert cli.main(['convert', f'src={source}', f'dst={out}', f'scan_layers={scan}']) == 1
  assert 'disk full' in capsys.readouterr().err
  assert os.listdir(out) == []  # no step 0, and the scratch directory is gone
  assert cli.main(['convert', f'src={source}', f'dst={out}', f'scan_layers={scan}']) == 0
  assert sorted(os.listdir(out)) == ['0']
  reference = maxnnx.from_pretrained(source, scan_layers=scan)
  assert checkpoint_config(out) == reference.config
  model = load_params(maxnnx.Transformer(reference.config, rngs=nnx.Rngs(1)), out)
  expected = dict(nnx.to_flat_state(nnx.state(reference, nnx.Param)))
  assert sorted(groups) == sorted(expected)
  assert len(saves) == 5 + len(expected)  # one orbax call per parameter (group_bytes=1)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(expected[path][...]))


def test_a_checkpoint_restores_onto_another_mesh(tmp_path):
  """Saved from data x fsdp x tensor = 2 x 2 x 2, restored by a run on fsdp = 8: every value
  equal, laid out on the new mesh, and the next step's loss that of the first run."""
  config = maxnnx.get_preset('tiny', num_layers=2, **{'runtime.scan_layers': True})

  def run(mesh, steps):
    train = TrainConfig(steps=steps, global_batch_size=8, seq_len=32, learning_rate=1e-2,
                        warmup_steps=0, log_every=1, checkpoint_dir=str(tmp_path),
                        checkpoint_every=2, mesh=mesh)
    return Trainer(config, train, data=TokenWindows(np.tile(np.arange(48), 100), 32, 8, seed=1))

  first = run(MeshConfig(data=2, fsdp=2, tensor=2), 2)
  first.fit(log=lambda _: None)
  first.close()
  second = run(MeshConfig(data=1, fsdp=8), 3)
  assert second.restore_checkpoint() == 2
  for a, b in zip(*(jax.tree.leaves(nnx.state(t.model)) for t in (first, second))):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
  kernel = second.model.layers.attn.q_proj.kernel[...]
  assert dict(kernel.sharding.mesh.shape)['fsdp'] == 8 and 'fsdp' in kernel.sharding.spec
  batch = np.random.default_rng().integers(0, 256, (8, 33))
  np.testing.assert_allclose(second.step(batch)['loss'], first.step(batch)['loss'], rtol=1e-5)
  second.close()


def test_convert_and_save_pretrained_write_the_dtype_asked_for(tmp_path, capsys):
  """dtype=bfloat16 writes every float tensor (and config.json's dtype) in bfloat16: the
  float32 values rounded once; a bad dtype names the choices."""
  import ml_dtypes  # noqa: PLC0415
  source = os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'llama')
  dst = str(tmp_path / 'bf16')
  assert cli.main(['convert', f'src={source}', f'dst={dst}', 'format=hf', 'dtype=bfloat16']) == 0
  original, written = read_safetensors_dir(source), read_safetensors_dir(dst)
  assert sorted(original) == sorted(written)
  for name, (_, array) in original.items():
    ours = np.asarray(written[name][1])
    assert ours.dtype == ml_dtypes.bfloat16, name
    np.testing.assert_array_equal(ours, np.asarray(array).astype(ml_dtypes.bfloat16))
  assert json.load(open(os.path.join(dst, 'config.json')))['dtype'] == 'bfloat16'
  with pytest.raises(ValueError, match="dtype='int8'.*bfloat16, float16, float32"):
    maxnnx.save_pretrained(maxnnx.from_pretrained(source), str(tmp_path / 'x'), dtype='int8')
  assert cli.main(['convert', f'src={source}', f'dst={tmp_path / "o"}', 'format=orbax',
                   'dtype=bfloat16']) == 2
  assert 'dtype=bfloat16 sets the dtype of a Hugging Face output' in capsys.readouterr().err


def _file_bytes(directory: str) -> dict[str, bytes]:
  found = {}
  for root, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(root, name)
      found[os.path.relpath(path, directory)] = open(path, 'rb').read()
  return found


def test_convert_takes_relative_paths_and_never_overwrites_a_checkpoint(tmp_path, monkeypatch,
                                                                        capsys):
  """HF -> orbax -> HF with relative paths (orbax takes absolute ones only); converting again
  into either output is refused with one line, and its files stay byte for byte."""
  monkeypatch.chdir(tmp_path)
  source = os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'llama')
  assert cli.main(['convert', f'src={source}', 'dst=orbax']) == 0
  assert cli.main(['convert', 'src=orbax', 'dst=hf']) == 0
  capsys.readouterr()
  for src, dst, held in ((source, 'hf', 'config.json'), ('orbax', 'hf', 'config.json'),
                         (source, 'orbax', '0'), ('orbax', 'hf', 'model.safetensors')):
    if held == 'model.safetensors':  # the weights alone are a checkpoint too
      os.remove(os.path.join(dst, 'config.json'))
    before = _file_bytes(dst)
    assert cli.main(['convert', f'src={src}', f'dst={dst}']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f'dst={dst} already has a checkpoint ({held}' in err
    assert _file_bytes(dst) == before


def test_generate_reads_the_checkpoint_of_a_run_given_by_a_relative_path(tmp_path, monkeypatch,
                                                                        capsys):
  """``maxnnx generate output_dir=run`` on a run without final/ loads its newest orbax
  checkpoint from a relative path."""
  from maxnnx.data import DEFAULT_CORPUS, train_sentencepiece
  from maxnnx.models.checkpoints import save_params
  monkeypatch.chdir(tmp_path)
  os.makedirs('run')
  train_sentencepiece(DEFAULT_CORPUS, os.path.join('run', 'tokenizer'), 400)
  model = maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=400, num_layers=1),
                             rngs=nnx.Rngs(0))
  save_params(model, os.path.join('run', 'checkpoints'), step=3)
  assert cli.main(['generate', 'output_dir=run', 'prompt=KING:', 'max_new_tokens=3']) == 0
  assert capsys.readouterr().out.startswith('KING:')


@pytest.mark.slow
def test_cli_train_resumes_and_generate_falls_back_to_the_checkpoint(tmp_path, capsys):
  """maxnnx train checkpoint_every=N resumes when rerun (same losses as the first run),
  and generate uses the newest checkpoint when final/ is missing."""
  out = str(tmp_path / 'run')
  args = ['train', f'output_dir={out}', 'steps=4', 'global_batch_size=4', 'seq_len=32',
          'log_every=1', 'sample_tokens=0', 'checkpoint_every=2']
  assert cli.main(args) == 0
  capsys.readouterr()
  first = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]
  assert CheckpointManager(os.path.join(out, 'checkpoints')).all_steps() == [2, 4]
  shutil.rmtree(os.path.join(out, 'checkpoints', '4'))  # as if killed before step 4's save
  shutil.rmtree(os.path.join(out, 'final'))
  assert cli.main(['generate', f'output_dir={out}', 'prompt=KING:', 'max_new_tokens=4']) == 0
  assert capsys.readouterr().out.startswith('KING:')
  assert cli.main(args) == 0
  assert 'Resuming from the checkpoint of step 2' in capsys.readouterr().out
  lines = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]
  assert [m['step'] for m in lines] == [1, 2, 3, 4]  # trimmed to the restored step
  for again, before in zip(lines[2:], first[2:]):
    assert again['loss'] == pytest.approx(before['loss'], rel=1e-6)

"""Trainer, data windows and the train/generate CLI on the shipped corpus."""

import json
import os

import jax
import numpy as np
import pytest
from conftest import cli_losses
from flax import nnx

import maxnnx
from maxnnx import cli
from maxnnx.config import MeshConfig
from maxnnx.data import TokenWindows
from maxnnx.data.text import read_text
from maxnnx.train import TrainConfig, Trainer, TrainingError
from maxnnx.train.optimizers import decay_mask, param_metadata
from maxnnx.train.trainer import EMPTY_BATCHES_BEFORE_STOP, row_range


def _tiny(vocab=64):
  cfg = maxnnx.get_preset('tiny', vocab_size=vocab, num_layers=2, d_model=64, mlp_dim=128)
  return maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))


def _config(steps, lr, batch=8, seq_len=32, **kw):
  return TrainConfig(steps=steps, learning_rate=lr, global_batch_size=batch, seq_len=seq_len,
                     mesh=MeshConfig(data=1), **kw)


def test_loss_falls_on_a_learnable_stream():
  """A periodic token stream is learned: loss drops far below its starting value."""
  tokens = np.tile(np.arange(16), 400)
  data = TokenWindows(tokens, seq_len=32, batch_size=8, seed=0)
  trainer = Trainer(_tiny(), _config(60, 1e-2, log_every=7), data=data)
  history = trainer.fit(log=lambda line: None)
  assert history[-1]['loss'] < 0.3 * history[0]['loss']
  assert trainer.evaluate() < 0.3 * history[0]['loss']
  assert [m['step'] for m in history] == list(range(1, 61))
  assert {'lr', 'grad_norm', 'tokens_per_s', 'tflops_per_device', 'mfu'} <= set(history[-1])


def test_step_by_hand_updates_the_model_in_place():
  """trainer.step changes trainer.model's parameters (the notebook workflow), and edits
  made to trainer.model between steps are trained on."""
  tokens = np.random.default_rng(0).integers(0, 64, 5000)
  trainer = Trainer(_tiny(), _config(10, 1e-3, batch=4, seq_len=16),
                    data=TokenWindows(tokens, 16, 4))
  model = trainer.model
  before = np.asarray(model.embed.embedding[...]).copy()
  trainer.step()  # the warmup starts at learning rate 0
  metrics = trainer.step()
  assert set(metrics) >= {'step', 'loss', 'grad_norm', 'tokens_per_s'}
  after = np.asarray(model.embed.embedding[...])  # the same object sees the new values
  assert not np.array_equal(before, after)
  model.final_norm.scale[...] = model.final_norm.scale[...] * 0  # logits become 0
  assert abs(trainer.step()['loss'] - np.log(64)) < 1e-4


def test_local_rows_are_the_devices_rows_in_one_range():
  """A process's batch rows are those its devices hold; a gap between them is refused."""
  whole = slice(None), slice(None)
  assert row_range([(slice(4, 6), slice(None)), (slice(2, 4), slice(None))], 8) == slice(2, 6)
  assert row_range([whole, whole], 8) == slice(0, 8)  # replicated rows
  with pytest.raises(ValueError, match=r'not one contiguous range'):
    row_range([(slice(0, 2), slice(None)), (slice(4, 6), slice(None))], 8)
  trainer = Trainer(_tiny(), _config(1, 1e-3, batch=4, seq_len=16))
  assert trainer.local_rows() == slice(0, 4)  # one process holds every row


def test_weight_decay_only_on_kernels():
  """Decay mask: kernels yes; norms, biases and embeddings no."""
  model = _tiny()
  table = param_metadata(model)
  mask = decay_mask(table)(nnx.state(model, nnx.Param))
  leaves = jax.tree.leaves_with_path(mask)
  assert sum(leaves_decayed for _, leaves_decayed in leaves) == 2 * 7 + 1  # 7 per layer + head
  for path, decayed in leaves:
    assert decayed == any(getattr(k, 'key', None) == 'kernel' for k in path), path


def test_nan_loss_aborts_with_the_step():
  """A non-finite loss stops training, names the step and metric, and skips that update."""
  tokens = np.random.default_rng(0).integers(0, 64, 5000)
  trainer = Trainer(_tiny(), _config(10, 1e-3, batch=4, seq_len=16),
                    data=TokenWindows(tokens, 16, 4))
  trainer.step()
  emb = trainer.model.embed.embedding
  emb[...] = emb[...].at[0].set(np.nan)
  kernel = np.asarray(trainer.model.final_norm.scale[...]).copy()
  batch = np.zeros((4, 17), np.int32)
  with pytest.raises(TrainingError, match='Non-finite loss at step 2'):
    trainer.step(batch)
  np.testing.assert_array_equal(kernel, np.asarray(trainer.model.final_norm.scale[...]))


def test_batches_with_nothing_to_train_on_stop_the_run():
  """Batches whose loss_mask is 0 everywhere (loss 0, gradient 0): one alone is trained past,
  EMPTY_BATCHES_BEFORE_STOP in a row end fit with one line naming their steps, before the last
  of them runs."""
  tokens = np.random.default_rng(0).integers(0, 64, (4, 17)).astype(np.int32)
  full = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
          'loss_mask': np.ones((4, 16), np.float32)}
  empty = {**full, 'loss_mask': np.zeros((4, 16), np.float32)}
  data = iter([full, empty, full] + [empty] * EMPTY_BATCHES_BEFORE_STOP + [full])
  trainer = Trainer(_tiny(), _config(8, 1e-3, batch=4, seq_len=16, warmup_steps=0), data=data)
  with pytest.raises(TrainingError, match='The batches of steps 4-6 hold no token to train on'):
    trainer.fit(log=lambda line: None)
  assert trainer.step_count == 5


def test_windows_are_seeded_and_held_out():
  """Same seed, same batches; eval batches come from the held-out tail only."""
  tokens = np.arange(10_000)
  a, b = TokenWindows(tokens, 8, 4, seed=3), TokenWindows(tokens, 8, 4, seed=3)
  np.testing.assert_array_equal(a.next(), b.next())
  assert a.eval_batches(2)[0].min() >= 9_500
  with pytest.raises(ValueError, match='too few'):
    TokenWindows(np.arange(20), 64, 2)


@pytest.mark.parametrize('content, message', [
    (b'', 'empty'), (b'hello \xff world', 'not UTF-8'),
])
def test_bad_text_files(tmp_path, content, message):
  """Empty and non-UTF-8 corpora are refused with the file named."""
  path = tmp_path / 'corpus.txt'
  path.write_bytes(content)
  with pytest.raises(ValueError, match=message):
    read_text(str(path))
  with pytest.raises(FileNotFoundError):
    read_text(str(tmp_path / 'missing.txt'))


def test_cli_rejects_unknown_keys_with_a_suggestion(capsys):
  """An unknown key is an error naming the nearest valid one."""
  assert cli.main(['train', 'stesp=3']) == 2
  assert "Did you mean 'steps'" in capsys.readouterr().err
  assert cli.main(['train', 'steps=three']) == 2
  assert cli.main(['train', '--help']) == 0
  assert 'global_batch_size' in capsys.readouterr().out


def test_cli_train_then_generate(tmp_path, capsys):
  """The default run, shortened: trains on the shipped corpus, writes its outputs,
  and the written model generates text."""
  out = str(tmp_path / 'run')
  args = ['train', f'output_dir={out}', 'steps=40', 'global_batch_size=4', 'seq_len=32',
          'eval_every=20', 'log_every=20', 'sample_tokens=10']
  assert cli.main(args) == 0
  for name in ('tokenizer.model', 'metrics.jsonl', 'loss.png', 'final/config.json',
               'final/model.safetensors'):
    assert os.path.exists(os.path.join(out, name)), name
  lines = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]
  assert len(lines) == 40 and lines[-1]['loss'] < lines[0]['loss'] - 1.0
  printed = capsys.readouterr().out
  assert 'Sample:' in printed
  # dtype=auto, the default: the choice and why, and the ceiling MFU divides by.
  from maxnnx.hardware import auto_compute_dtype
  dtype, why = auto_compute_dtype()
  assert f'Compute dtype {dtype} (dtype=auto: {why}); MFU against ' in printed
  assert cli.main(['generate', f'output_dir={out}', 'prompt=KING:', 'max_new_tokens=8']) == 0
  assert capsys.readouterr().out.startswith('KING:')


def test_a_seed_trains_the_same_model_looped_scanned_or_pipelined(tmp_path, capsys):
  """`maxnnx train model=tiny seed=0` gives the same float32 losses with the layers in a
  loop, scanned, and pipelined over 2 stages (simulated devices): the layout changes how
  the stack runs, never the weights a seed draws."""
  common = ['train', 'model=tiny', 'seed=0', 'data=synthetic', 'steps=4', 'log_every=1',
            'global_batch_size=8', 'seq_len=16', 'sample_tokens=0', 'eval_every=0',
            'checkpoint_every=0', 'dtype=float32']
  losses = cli_losses(tmp_path, capsys, common, {
      'loop': [], 'scan': ['model.runtime.scan_layers=true'], 'pipeline': ['mesh.stage=2']})
  assert "mesh {'stage': 2" in capsys.readouterr().out
  # Step 1's lr is 0 (warmup): the losses of steps 3 and 4 follow the updates of steps 2-3.
  assert len(losses['loop']) == 4
  np.testing.assert_allclose(losses['scan'], losses['loop'], rtol=1e-4)
  np.testing.assert_allclose(losses['pipeline'], losses['loop'], rtol=1e-4)


def test_cli_reports_bad_inputs_without_a_traceback(tmp_path, capsys):
  """Unknown presets, empty corpora and checkpoint dirs end in one 'error:' line."""
  empty = tmp_path / 'empty.txt'
  empty.write_text('')
  cases = [(['train', 'model=llama3-9b'], "Did you mean 'llama3-8b'"),
           (['train', f'data={empty}', f'output_dir={tmp_path}'], 'empty'),
           (['train', f'model={tmp_path}', f'output_dir={tmp_path}'], 'config.json'),
           (['generate', f'output_dir={tmp_path}/none'], 'is missing')]
  for args, message in cases:
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith('error:') and message in err, (args, err)


def test_tokenizer_round_trips_text_exactly(tmp_path):
  """The trained tokenizer keeps line breaks and spacing, and covers unseen bytes."""
  from maxnnx.data import DEFAULT_CORPUS, SentencePieceTokenizer, train_sentencepiece
  tok = SentencePieceTokenizer(train_sentencepiece(DEFAULT_CORPUS, str(tmp_path / 'sp'), 512))
  text = 'ROMEO:\nWhat,  ho!\n\nJULIET:\n\tAy me. ☃'
  assert tok.decode(tok.encode(text)) == text
  assert max(tok.encode(text)) < tok.vocab_size

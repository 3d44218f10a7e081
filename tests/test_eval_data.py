"""Held-out evaluation on any data: ``eval_data=``, ``eval_every``, ``target_eval_loss``."""

import json
import shutil
import uuid

import fsspec
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import maxnnx
from maxnnx import cli
from maxnnx.data import DEFAULT_CORPUS, load_tokenizer
from maxnnx.data.text import read_text

BATCH, SEQ, EVAL_BATCHES = 2, 32, 2


def _jsonl(path, docs):
  path.write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
  return str(path)


@pytest.fixture
def corpus(tmp_path):
  """``(train.jsonl, eval.jsonl, eval documents)``: Shakespeare lines, the held-out ones short
  enough for one row each, as many as the evaluation's rows (each read once)."""
  lines = [ln.strip() for ln in read_text(DEFAULT_CORPUS)[:40_000].split('\n') if ln.strip()]
  held_out = [ln for ln in lines[-200:] if 10 < len(ln) < 20][:EVAL_BATCHES * BATCH]
  assert len(held_out) == EVAL_BATCHES * BATCH
  return (_jsonl(tmp_path / 'train.jsonl', lines[:-200]),
          _jsonl(tmp_path / 'eval.jsonl', held_out), held_out)


def _args(out, **more):
  keys = {'model': 'tiny', 'model.vocab_size': 384, 'model.num_layers': 1, 'steps': 4,
          'global_batch_size': BATCH, 'seq_len': SEQ, 'log_every': 1, 'eval_every': 2,
          'eval_batches': EVAL_BATCHES, 'checkpoint_every': 0, 'sample_tokens': 0,
          'dtype': 'float32', 'mesh.data': 1, 'data.packing': 'none', 'output_dir': out,
          **more}
  return [f'{k}={v}' for k, v in keys.items()]


def _metrics(out):
  return [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]


def _mean_loss(model, tokenizer, documents) -> float:
  """The mean next-token cross-entropy per token of ``documents`` (BOS + text + EOS each),
  from the model's plain forward pass over one row per document (padded at the end, which a
  causal model's earlier positions never see)."""
  rows = [[tokenizer.bos_id, *tokenizer.encode(doc), tokenizer.eos_id] for doc in documents]
  width = max(map(len, rows))
  ids = np.array([row + [0] * (width - len(row)) for row in rows])
  mask = np.array([[1.0] * (len(row) - 1) + [0.0] * (width - len(row)) for row in rows])
  logits = model(jnp.asarray(ids[:, :-1])).astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(ids[:, 1:]))
  return float((losses * mask).sum() / mask.sum())


def test_eval_data_writes_the_held_out_loss_the_model_has_on_it(tmp_path, corpus, capsys):
  train, held_out, documents = corpus
  out = tmp_path / 'run'
  assert cli.main(['train', *_args(out), f'data={train}', f'eval_data={held_out}']) == 0, \
      capsys.readouterr().err
  records = _metrics(out)
  evals = [r for r in records if 'eval_loss' in r]
  assert [r['step'] for r in evals] == [2, 4]
  for r in evals:
    assert r['eval_perplexity'] == pytest.approx(np.exp(r['eval_loss']), rel=1e-6)
  final = str(out / 'final')
  expected = _mean_loss(maxnnx.from_pretrained(final, dtype='float32'), load_tokenizer(final),
                        documents)
  assert evals[-1]['eval_loss'] == pytest.approx(expected, rel=1e-4)
  assert evals[0]['eval_loss'] != pytest.approx(expected, rel=1e-4)  # the weights moved
  assert (out / 'loss.png').stat().st_size > 0


def test_target_eval_loss_stops_the_run_early(tmp_path, corpus, capsys):
  train, held_out, _ = corpus
  out = tmp_path / 'run'
  args = _args(out, steps=6, eval_every=1, target_eval_loss=50)
  assert cli.main(['train', *args, f'data={train}', f'eval_data={held_out}']) == 0
  printed = capsys.readouterr().out
  records = _metrics(out)
  assert [r['step'] for r in records] == [1]
  assert (f"Stopped at step 1 of 6: the held-out loss {records[0]['eval_loss']:.4f} reached "
          'target_eval_loss=50.') in printed
  assert (out / 'final' / 'config.json').exists()


def test_eval_data_and_target_eval_loss_errors_are_one_line(tmp_path, corpus, capsys):
  train, held_out, _ = corpus
  assert cli.main(['train', *_args(tmp_path / 'a', eval_every=0), f'data={train}',
                   f'eval_data={held_out}']) == 2
  assert capsys.readouterr().err.strip() == (
      f'error: eval_data={held_out} is evaluated every eval_every steps: set eval_every (it is 0).')
  assert cli.main(['train', *_args(tmp_path / 'c', target_eval_loss=2), f'data={train}']) == 2
  assert capsys.readouterr().err.strip() == (
      f'error: target_eval_loss=2 needs held-out data: give eval_data= (data={train} has no '
      'held-out split).')
  missing = tmp_path / 'none.jsonl'
  assert cli.main(['train', *_args(tmp_path / 'b'), f'data={train}',
                   f'eval_data={missing}']) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: ') and str(missing) in err and '\n' not in err


CHATS = [{'messages': [{'role': 'user', 'content': f'Who speaks line {i}?'},
                       {'role': 'assistant', 'content': name}]}
         for i, name in enumerate(['ROMEO', 'JULIET', 'MERCUTIO', 'TYBALT'] * 2)]
PREFS = [{'prompt': [{'role': 'user', 'content': f'Greet number {i}.'}],
          'chosen': 'Good morrow, my lord.', 'rejected': 'Away!'} for i in range(4)]


@pytest.fixture
def base(chat_checkpoint, tmp_path):
  """A small random chat model in Hugging Face format, with its tokenizer and template."""
  from flax import nnx
  base = tmp_path / 'base'
  model = maxnnx.Transformer(maxnnx.get_preset('tiny', vocab_size=512, num_layers=1),
                             rngs=nnx.Rngs(0))
  maxnnx.save_pretrained(model, str(base))
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(f'{chat_checkpoint}/{name}', base)
  return base


@pytest.mark.parametrize('recipe,records', [('sft', CHATS), ('dpo', PREFS)])
def test_fine_tuning_recipes_evaluate_eval_data_at_a_url(recipe, records, base, tmp_path,
                                                        capsys):
  """``maxnnx sft|dpo eval_data=memory://…``: the recipe's own records pipeline reads the
  held-out records from the bucket, and their loss is in metrics.jsonl."""
  lines = ''.join(json.dumps(r) + '\n' for r in records).encode()
  bucket = f'/held-out-{uuid.uuid4().hex[:8]}'
  fsspec.filesystem('memory').pipe(f'{bucket}/records.jsonl', lines)
  (tmp_path / 'train.jsonl').write_bytes(lines)
  out = tmp_path / 'run'
  try:
    code = cli.main([recipe, f'model={base}', f"data={tmp_path / 'train.jsonl'}",
                     f'eval_data=memory://{bucket}/*.jsonl', 'steps=2', 'eval_every=1',
                     'eval_batches=1', 'global_batch_size=2', 'seq_len=32', 'log_every=1',
                     'mesh.data=1', 'dtype=float32', f'output_dir={out}'])
  finally:
    fsspec.filesystem('memory').rm(bucket, recursive=True)
  assert code == 0, capsys.readouterr().err
  evals = [r for r in _metrics(out) if 'eval_loss' in r]
  assert [r['step'] for r in evals] == [1, 2]
  assert all(np.isfinite(r['eval_loss']) and r['eval_perplexity'] > 1 for r in evals)


def test_grpo_refuses_eval_data_in_one_line(base, tmp_path, capsys):
  prompts = _jsonl(tmp_path / 'p.jsonl', ['x'])
  assert cli.main(['grpo', f'model={base}', f'prompts={prompts}', 'reward=len',
                   f'eval_data={prompts}', f"output_dir={tmp_path / 'run'}"]) == 2
  assert capsys.readouterr().err.strip() == (
      f'error: eval_data={prompts}: grpo has no held-out loss (its loss is on fresh rollouts); '
      'score the policy with reward= on held-out prompts instead, or drop eval_data.')


def test_the_loss_plot_draws_held_out_loss_with_its_perplexity_scale(tmp_path, monkeypatch):
  import matplotlib.pyplot as plt

  from maxnnx.train.export import plot_loss
  drawn = []
  monkeypatch.setattr(plt, 'close', drawn.append)
  history = [{'step': s, 'loss': 4.0 - s / 4} for s in range(1, 9)]
  history[3].update(eval_loss=3.2, eval_perplexity=np.exp(3.2))
  history[7].update(eval_loss=2.5, eval_perplexity=np.exp(2.5))
  plot_loss(history, str(tmp_path / 'loss.png'))
  loss_axes, scale = drawn[0].axes
  assert [line.get_label() for line in loss_axes.lines] == ['train', 'held-out']
  assert list(loss_axes.lines[1].get_ydata()) == [3.2, 2.5]
  assert scale.get_ylabel() == 'held-out perplexity' and scale.get_yscale() == 'log'
  assert np.allclose(np.log(scale.get_ylim()), loss_axes.get_ylim())
  assert (tmp_path / 'loss.png').stat().st_size > 0


@pytest.mark.slow
def test_distill_evaluates_eval_data(base, tmp_path, corpus, capsys):
  """``maxnnx distill eval_data=…``: the student's held-out loss on JSONL documents."""
  train, held_out, _ = corpus
  out = tmp_path / 'student'
  assert cli.main(['distill', f'teacher={base}', 'model=tiny', 'model.num_layers=1',
                   f'data={train}', f'eval_data={held_out}', 'steps=2', 'eval_every=1',
                   'eval_batches=1', 'global_batch_size=2', 'seq_len=32', 'log_every=1',
                   'mesh.data=1', f'output_dir={out}']) == 0, capsys.readouterr().err
  evals = [r for r in _metrics(out) if 'eval_loss' in r]
  assert [r['step'] for r in evals] == [1, 2]
  assert all(np.isfinite(r['eval_loss']) for r in evals)

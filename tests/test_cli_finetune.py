"""The fine-tuning commands end to end: ``maxnnx sft``, ``dpo`` and ``distill``."""

import json
import math
import os
import shutil
import time

import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx import cli
from maxnnx.data import load_chat_template, load_tokenizer

CHATS = [
    {'messages': [{'role': 'user', 'content': f'Who speaks line {i}?'},
                  {'role': 'assistant', 'content': name}]}
    for i, name in enumerate(['ROMEO', 'JULIET', 'MERCUTIO', 'TYBALT'] * 4)]
PREFS = [{'prompt': [{'role': 'user', 'content': f'Greet number {i}.'}],
          'chosen': 'Good morrow, my lord.', 'rejected': 'Away!'} for i in range(8)]
SMALL = ['global_batch_size=4', 'seq_len=32', 'log_every=1', 'mesh.data=1']


def _jsonl(path, records):
  path.write_text(''.join(json.dumps(r) + '\n' for r in records), encoding='utf-8')
  return str(path)


def _metrics(out):
  with open(os.path.join(out, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope='module')
def base(chat_checkpoint, tmp_path_factory):
  """A small random chat model in Hugging Face format, with its tokenizer and template."""
  directory = str(tmp_path_factory.mktemp('base'))
  cfg = maxnnx.get_preset('tiny', vocab_size=512, num_layers=2)
  maxnnx.save_pretrained(maxnnx.Transformer(cfg, rngs=nnx.Rngs(0)), directory)
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(os.path.join(chat_checkpoint, name), directory)
  return directory


@pytest.fixture(scope='module')
def sft_run(base, tmp_path_factory):
  tmp = tmp_path_factory.mktemp('sft')
  out = str(tmp / 'run')
  args = ['sft', f'model={base}', f"data={_jsonl(tmp / 'chat.jsonl', CHATS)}", 'steps=6',
          'learning_rate=3e-3', 'warmup_steps=0', f'output_dir={out}', *SMALL]
  assert cli.main(args) == 0
  return out, args


def test_sft_trains_on_assistant_tokens_and_exports_a_chat_model(sft_run, base):
  out, _ = sft_run
  losses = [m['loss'] for m in _metrics(out)]
  assert len(losses) == 6 and losses[-1] < losses[0]
  final = os.path.join(out, 'final')
  assert {'config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json',
          'chat_template.jinja'} <= set(os.listdir(final))
  assert load_chat_template(final).source == load_chat_template(base).source
  assert load_tokenizer(final).vocab_size == load_tokenizer(base).vocab_size
  stored = json.load(open(os.path.join(out, 'run_config.json')))
  assert stored['objective'] == {'template': ''}


def test_generate_samples_an_sft_run_with_its_checkpoints_tokenizer(sft_run, capsys):
  """The run's tokenizer is the checkpoint's, kept in final/ (no tokenizer.model beside it)."""
  out, _ = sft_run
  capsys.readouterr()
  assert cli.main(['generate', f'output_dir={out}', 'prompt=Hi', 'max_new_tokens=3',
                   'temperature=0']) == 0
  assert capsys.readouterr().out.startswith('Hi')


def test_sft_refuses_a_changed_template_on_resume(sft_run, capsys):
  out, args = sft_run
  assert cli.main([*args, 'template=llama3']) == 2
  assert 'template' in capsys.readouterr().err


def test_sft_without_a_tokenizer_is_refused(tmp_path, capsys):
  data = _jsonl(tmp_path / 'chat.jsonl', CHATS)
  assert cli.main(['sft', 'model=tiny', f'data={data}', f'output_dir={tmp_path}/o']) == 2
  assert 'tokenizer=<path>' in capsys.readouterr().err


def test_dpo_starts_at_ln2_and_moves_towards_chosen(sft_run, tmp_path):
  policy = os.path.join(sft_run[0], 'final')
  out = str(tmp_path / 'dpo')
  args = ['dpo', f'model={policy}', f"data={_jsonl(tmp_path / 'prefs.jsonl', PREFS)}",
          'steps=4', 'beta=0.5', 'learning_rate=1e-3', 'warmup_steps=0', f'output_dir={out}',
          *SMALL]
  assert cli.main(args) == 0
  metrics = _metrics(out)
  assert metrics[0]['loss'] == pytest.approx(math.log(2), abs=1e-5)
  assert metrics[0]['rewards/margins'] == pytest.approx(0.0, abs=1e-5)
  for name in ('rewards/chosen', 'rewards/rejected', 'rewards/accuracies', 'logps/chosen',
               'logps/rejected'):
    assert all(np.isfinite(m[name]) for m in metrics)
  assert metrics[-1]['loss'] < metrics[0]['loss']
  assert metrics[-1]['rewards/margins'] > 0


def test_distill_uses_the_teachers_tokenizer_and_vocabulary(sft_run, tmp_path, capsys):
  teacher = sft_run[0]  # a run directory: its final/ and tokenizer are found
  text = tmp_path / 'text.txt'
  text.write_text(open(maxnnx.data.DEFAULT_CORPUS, encoding='utf-8').read()[:20_000])
  out = str(tmp_path / 'student')
  args = ['distill', f'teacher={teacher}', 'model=tiny', 'model.num_layers=1', f'data={text}',
          'steps=3', 'temperature=2.0', 'hard_label_weight=0.5', f'output_dir={out}',
          'eval_every=0', *SMALL]
  assert cli.main(args) == 0
  metrics = _metrics(out)
  assert all(np.isfinite([m['loss'], m['distill_loss'], m['ce_loss']]).all() for m in metrics)
  for m in metrics:
    assert m['loss'] == pytest.approx(0.5 * m['distill_loss'] + 0.5 * m['ce_loss'], rel=1e-5)
  student = maxnnx.from_pretrained(os.path.join(out, 'final'))
  assert student.config.vocab_size == 512
  assert os.path.exists(os.path.join(out, 'final', 'tokenizer.json'))
  capsys.readouterr()
  bad = [*args, f'output_dir={tmp_path}/bad', 'model.vocab_size=600']
  assert cli.main(bad) == 2
  assert 'same tokenizer' in capsys.readouterr().err


def test_distill_needs_a_teacher(tmp_path, capsys):
  assert cli.main(['distill', f'output_dir={tmp_path}/o']) == 2
  assert 'distill needs teacher=' in capsys.readouterr().err


def test_help_lists_the_recipe_keys(capsys):
  assert cli.main(['dpo', '--help']) == 0
  text = capsys.readouterr().out
  assert 'beta' in text and 'loss_type' in text and 'learning_rate' in text


def test_train_continues_a_checkpoint_with_its_own_tokenizer(base, tmp_path):
  text = tmp_path / 'text.txt'
  text.write_text(open(maxnnx.data.DEFAULT_CORPUS, encoding='utf-8').read()[:20_000])
  out = str(tmp_path / 'run')
  assert cli.main(['train', f'model={base}', f'data={text}', 'steps=2', 'eval_every=0',
                   f'output_dir={out}', *SMALL]) == 0
  stored = json.load(open(os.path.join(out, 'run_config.json')))
  assert stored['tokenizer']['source'] == os.path.join(base, 'tokenizer.json')
  assert not os.path.exists(os.path.join(out, 'tokenizer.model'))  # none trained
  assert load_tokenizer(os.path.join(out, 'final')).vocab_size == load_tokenizer(base).vocab_size


def test_sft_on_chats_without_any_template_names_the_key(base, tmp_path, capsys):
  bare = tmp_path / 'bare'
  bare.mkdir()
  for name in ('config.json', 'model.safetensors', 'tokenizer.json'):
    shutil.copy(os.path.join(base, name), bare)
  args = ['sft', f'model={bare}', f"data={_jsonl(tmp_path / 'chat.jsonl', CHATS)}", 'steps=1',
          f'output_dir={tmp_path}/out', *SMALL]
  assert cli.main(args) == 2  # a llama checkpoint has no built-in template to fall back on
  assert 'pass template=' in capsys.readouterr().err
  assert cli.main([*args, 'template=chatml', f'output_dir={tmp_path}/out2']) == 0
  assert load_chat_template(f'{tmp_path}/out2/final').origin.endswith('chat_template.jinja')


def test_sft_and_dpo_with_lora_write_a_peft_adapter_and_a_merged_model(base, tmp_path):
  from safetensors.numpy import load_file

  from maxnnx.train.lora import load_adapter
  data = _jsonl(tmp_path / 'chat.jsonl', CHATS)
  out = str(tmp_path / 'sft')
  assert cli.main(['sft', f'model={base}', f'data={data}', 'steps=4', 'learning_rate=1e-2',
                   'lora.rank=4', 'lora.alpha=8', 'lora.targets=q_proj,v_proj',
                   f'output_dir={out}', *SMALL]) == 0
  config = json.load(open(os.path.join(out, 'adapter', 'adapter_config.json')))
  assert config['r'] == 4 and config['lora_alpha'] == 8
  assert sorted(config['target_modules']) == ['q_proj', 'v_proj']
  tensors = load_file(os.path.join(out, 'adapter', 'adapter_model.safetensors'))
  assert 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' in tensors
  # final/ is the merged model: base + adapter gives the same logits
  ids = np.arange(1, 17)[None]
  merged = maxnnx.from_pretrained(os.path.join(out, 'final'))
  adapted = load_adapter(maxnnx.from_pretrained(base), os.path.join(out, 'adapter'))
  np.testing.assert_allclose(merged(ids), adapted(ids), rtol=1e-4, atol=1e-4)
  assert not np.allclose(merged(ids), maxnnx.from_pretrained(base)(ids), atol=1e-4)
  dpo_out = str(tmp_path / 'dpo')
  assert cli.main(['dpo', f'model={out}/final', f"data={_jsonl(tmp_path / 'p.jsonl', PREFS)}",
                   'steps=3', 'learning_rate=1e-2', 'lora.rank=4', f'output_dir={dpo_out}',
                   *SMALL]) == 0
  metrics = _metrics(dpo_out)
  assert metrics[0]['loss'] == pytest.approx(math.log(2), abs=1e-5)  # adapters off = policy
  assert metrics[-1]['rewards/margins'] != 0
  assert os.path.exists(os.path.join(dpo_out, 'adapter', 'adapter_model.safetensors'))


def test_grpo_trains_on_rollouts_and_writes_them(base, tmp_path, capsys):
  reward_file = tmp_path / 'rewards.py'
  reward_file.write_text('def brief(prompts, completions, **kwargs):\n'
                         '  return [1.0 / (1 + len(c)) for c in completions]\n')
  out = str(tmp_path / 'grpo')
  args = ['grpo', f'model={base}', f"prompts={_jsonl(tmp_path / 'p.jsonl', CHATS)}",
          f'reward={reward_file}:brief,maxnnx.rl.rewards:exact_match', 'reward_weights=1,2',
          'num_generations=2', 'max_new_tokens=4', 'steps=3', 'checkpoint_every=2',
          'learning_rate=1e-3', 'beta=0.05', f'output_dir={out}', *SMALL]
  assert cli.main(args) == 0
  records = _metrics(out)
  assert [m['step'] for m in records] == [1, 2, 3]
  assert {'reward', 'rewards/brief/mean', 'rewards/exact_match/mean', 'kl',
          'completions/mean_length'} <= set(records[-1])
  rollouts = [json.loads(line) for line in open(os.path.join(out, 'rollouts.jsonl'))]
  assert len(rollouts) == 3 * 4 and rollouts[0]['prompt'][0]['role'] == 'user'
  first = rollouts[0]
  assert first['reward'] == pytest.approx(first['rewards']['brief']
                                          + 2 * first['rewards']['exact_match'])
  assert os.path.isfile(os.path.join(out, 'final', 'config.json'))
  assert 'reward' in capsys.readouterr().out
  # A rerun finds the run finished; a missing reward names the key.
  assert cli.main(args) == 0
  assert 'Nothing to train' in capsys.readouterr().out
  assert cli.main([a for a in args if not a.startswith('reward')] + [
      f'output_dir={tmp_path}/other']) == 2
  assert 'grpo needs reward=' in capsys.readouterr().err


LONG_PROMPT = {'messages': [{'role': 'user', 'content': 'Who speaks this line? ' * 20},
                            {'role': 'assistant', 'content': 'ROMEO'}]}


@pytest.mark.parametrize('records, message', [
    ([{'messages': c['messages'][:1]} for c in CHATS],
     'no record has a token to train on (no "assistant" message'),
    ([LONG_PROMPT] * 8,
     'no record has a trainable (assistant) token within seq_len=32: data.overlong=truncate'),
    ([CHATS[0], {'messages': [{'role': 'user', 'content': 'Hi'},
                              {'role': 'assistant', 'content': 5}]}],
     'chat.jsonl line 2: "messages"[1].content is an int (5); expected a string'),
])
def test_sft_refuses_data_that_trains_on_nothing_before_compiling(base, tmp_path, capsys, records,
                                                                  message):
  out = str(tmp_path / 'run')
  args = ['sft', f'model={base}', f"data={_jsonl(tmp_path / 'chat.jsonl', records)}", 'steps=2',
          f'output_dir={out}', *SMALL]
  assert cli.main(args) == 2
  captured = capsys.readouterr()
  assert message in captured.err and len(captured.err.strip().splitlines()) == 1
  assert 'compiled train step' not in captured.out
  assert not os.path.exists(os.path.join(out, 'final'))


def test_sft_names_the_line_of_a_template_syntax_error_before_compiling(base, tmp_path, capsys):
  template = tmp_path / 'bad.jinja'
  template.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
  args = ['sft', f'model={base}', f"data={_jsonl(tmp_path / 'chat.jsonl', CHATS)}", 'steps=2',
          f'template={template}', f"output_dir={tmp_path / 'run'}", *SMALL]
  assert cli.main(args) == 2
  captured = capsys.readouterr()
  assert f"error: {template} line 2: syntax error in the chat template: unexpected '}}'" in \
      captured.err
  assert 'compiled train step' not in captured.out


def test_dpo_refuses_chosen_equal_to_rejected_before_compiling(base, tmp_path, capsys):
  same = [{**p, 'rejected': p['chosen']} for p in PREFS]
  args = ['dpo', f'model={base}', f"data={_jsonl(tmp_path / 'prefs.jsonl', same)}", 'steps=2',
          f"output_dir={tmp_path / 'run'}", *SMALL]
  assert cli.main(args) == 2
  captured = capsys.readouterr()
  assert '"chosen" equals "rejected" in every record (8)' in captured.err
  assert 'compiled train step' not in captured.out


def test_grpo_sigterm_during_a_stuck_reward_stops_at_once_and_resumes(base, tmp_path, capsys):
  """SIGTERM while a reward function hangs (its timeout far away) stops the run within seconds,
  before the step whose rollout was cut short; the step before is checkpointed and the run
  resumes from it. Before, the stop waited out reward_timeout_s."""
  reward_file, calls = tmp_path / 'rewards.py', tmp_path / 'calls'
  reward_file.write_text(
      'import os, signal, time\n'
      'def judge(prompts, completions, **kwargs):\n'
      f'  path = {str(calls)!r}\n'
      '  n = int(open(path).read()) + 1 if os.path.exists(path) else 1\n'
      '  open(path, "w").write(str(n))\n'
      '  if n == 2:  # the second rollout: a preemption comes while the reward hangs\n'
      f'    open({str(tmp_path / "killed")!r}, "w").write(repr(time.time()))\n'
      '    os.kill(os.getpid(), signal.SIGTERM)\n'
      '    time.sleep(600)\n'
      '  return [float(len(c)) for c in completions]\n')
  out = tmp_path / 'grpo'
  args = ['grpo', f'model={base}', f"prompts={_jsonl(tmp_path / 'p.jsonl', CHATS)}",
          f'reward={reward_file}:judge', 'reward_timeout_s=600', 'num_generations=2',
          'max_new_tokens=4', 'steps=3', 'checkpoint_every=100', f'output_dir={out}', *SMALL]
  assert cli.main(args) == 0
  waited = time.time() - float((tmp_path / 'killed').read_text())
  assert waited < 60  # the reward sleeps 600 s: the stop does not wait for it
  assert 'Stopped by SIGTERM after step 1' in capsys.readouterr().out
  assert [m['step'] for m in _metrics(out)] == [1]
  assert cli.main(args) == 0
  assert 'Resuming from the checkpoint of step 1' in capsys.readouterr().out
  assert [m['step'] for m in _metrics(out)] == [1, 2, 3]
  assert int(calls.read_text()) == 4  # the cut-short rollout was sampled again


@pytest.mark.parametrize('body, message', [
    ('raise ValueError("no score\\nsecond line")', "Reward function 'judge' raised ValueError: "
     'no score'),
    ('return [float("nan")] * len(completions)', "Reward function 'judge' returned nan for "
     'completion 0; rewards must be finite.'),
    ('return [1.0]', "Reward function 'judge' returned 1 values for 4 completions"),
    ('return [None] * len(completions)', "Reward function 'judge' returned None for all 4 "
     'completions of rollout 0, so there is nothing to learn from'),
])
def test_grpo_reward_failures_stop_with_one_line(base, tmp_path, capsys, body, message):
  reward_file = tmp_path / 'rewards.py'
  reward_file.write_text(f'def judge(prompts, completions, **kwargs):\n  {body}\n')
  out = tmp_path / 'grpo'
  assert cli.main(['grpo', f'model={base}', f"prompts={_jsonl(tmp_path / 'p.jsonl', CHATS)}",
                   f'reward={reward_file}:judge', 'num_generations=2', 'max_new_tokens=4',
                   'steps=2', f'output_dir={out}', *SMALL]) == 2
  err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
  assert len(err) == 1 and err[0].startswith(f'error: {message}'), err
  assert not (out / 'final').exists() and not _metrics(out)  # no step was taken


def test_grpo_reward_that_never_returns_stops_at_its_timeout(base, tmp_path, capsys):
  reward_file = tmp_path / 'rewards.py'
  started = tmp_path / 'started'
  reward_file.write_text('import time\n'
                         'def stuck(prompts, completions, **kwargs):\n'
                         f'  open({str(started)!r}, "w").write(repr(time.time()))\n'
                         '  time.sleep(600)\n')
  assert cli.main(['grpo', f'model={base}', f"prompts={_jsonl(tmp_path / 'p.jsonl', CHATS)}",
                   f'reward={reward_file}:stuck', 'reward_timeout_s=1', 'num_generations=2',
                   'max_new_tokens=4', 'steps=2', f'output_dir={tmp_path}/grpo', *SMALL]) == 2
  waited = time.time() - float(started.read_text())
  err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
  assert err == ["error: Reward function 'stuck' did not return within 1 s (reward_timeout_s); "
                 'make it faster or raise reward_timeout_s.']
  assert 1 <= waited < 60  # the reward sleeps 600 s: the timeout cut it

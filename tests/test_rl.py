"""GRPO end to end on a tiny policy: rollouts, rewards, the sampler's log-probs against the
training forward pass, meshes, LoRA with a KL to the base, resume, dynamic sampling."""

import json

import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.data import Checkpointable, DataSource, ReportsMetrics, load_tokenizer
from maxnnx.rl import (
  GRPO,
  GRPOConfig,
  GRPOObjective,
  Prompts,
  RewardError,
  Rewards,
  Rollouts,
  exact_match,
  load_reward,
)
from maxnnx.rl.objective import policy_token_logps
from maxnnx.train import TrainConfig, Trainer
from maxnnx.train.lora import LoraConfig
from maxnnx.train.policy import PolicyView

RECORDS = [{'prompt': f'{a} and {b} make', 'answer': str(a + b)} for a in range(6)
           for b in range(6)]


@pytest.fixture(scope='module')
def tokenizer(chat_checkpoint):
  return load_tokenizer(str(chat_checkpoint / 'tokenizer.json'))


def _policy(seed=0):
  cfg = maxnnx.get_preset('tiny').replace(num_layers=2, d_model=64, mlp_dim=128, head_dim=16,
                                          vocab_size=512)
  return maxnnx.Transformer(cfg, rngs=nnx.Rngs(seed))


def vowels(prompts, completions, **kwargs):
  """The share of vowels among a completion's characters: a reward a random policy finds."""
  return [sum(ch in 'aeiou' for ch in c) / max(len(c), 1) for c in completions]


def _grpo(tokenizer, *, config=None, rewards=(vowels,), **train):
  train = {'steps': 4, 'global_batch_size': 8, 'seq_len': 24, 'learning_rate': 1e-3,
           'warmup_steps': 0, 'log_every': 1, 'mesh': MeshConfig(data=1), **train}
  return GRPO(_policy(), RECORDS, list(rewards), tokenizer=tokenizer,
              config=config or GRPOConfig(num_generations=4, max_new_tokens=8),
              train_config=TrainConfig(**train))


def test_sampling_logprobs_equal_the_training_forward_pass(tokenizer):
  grpo = _grpo(tokenizer, config=GRPOConfig(num_generations=4, max_new_tokens=8,
                                            temperature=0.7))
  metrics = grpo.step()
  assert metrics['sampling/sampling_logp_difference/max'] < 1e-5
  # Independently: the sampler's log-probs at the completion targets, against a forward pass.
  batch, _ = grpo.rollouts.collect()
  logps_BT, _ = policy_token_logps(grpo.model, {k: np.asarray(v) for k, v in batch.items()},
                                   temperature=0.7)
  last = grpo.rollouts.last
  for i, completion in enumerate(last['completion_ids']):
    p = len(last['prompt_ids'][i])
    positions = np.arange(p - 1, p - 1 + len(completion))
    np.testing.assert_array_equal(batch['targets'][i, positions], completion)
    np.testing.assert_array_equal(batch['inputs'][i, :p], last['prompt_ids'][i])
    np.testing.assert_array_equal(np.flatnonzero(batch['loss_mask'][i]), positions)
    np.testing.assert_allclose(np.asarray(logps_BT)[i, positions],
                               last['logprobs'][i, :len(completion)], atol=2e-5)


def test_reward_rises_and_metrics_have_trl_names(tokenizer, tmp_path):
  rollouts = tmp_path / 'rollouts.jsonl'
  grpo = _grpo(tokenizer, steps=12, learning_rate=3e-2, global_batch_size=16,
               config=GRPOConfig(num_generations=4, max_new_tokens=8, beta=0.02,
                                 rollouts_jsonl=str(rollouts)))
  history = grpo.fit(log=lambda line: None)
  rewards = [m['reward'] for m in history]
  assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards
  for name in ('loss', 'kl', 'entropy', 'clip_ratio/region_mean', 'reward', 'reward_std',
               'rewards/vowels/mean', 'rewards/vowels/std', 'completions/mean_length',
               'completions/clipped_ratio', 'sampling/sampling_logp_difference/mean'):
    assert np.isfinite(history[-1][name]), name
  assert history[0]['kl'] == 0.0 and history[-1]['kl'] > 0.0
  lines = [json.loads(line) for line in rollouts.read_text().splitlines()]
  assert len(lines) == 12 * 16 and set(lines[0]) >= {'prompt', 'completion', 'rewards',
                                                     'advantage'}
  assert lines[0]['rewards']['vowels'] == vowels(None, [lines[0]['completion']])[0]


@pytest.mark.slow  # ~26 s
def test_a_mesh_and_gradient_accumulation_match_one_device_on_a_fixed_rollout(tokenizer):
  grpo = _grpo(tokenizer, config=GRPOConfig(num_generations=4, max_new_tokens=8, beta=0.1,
                                            loss_type='dapo'))
  batch, _ = grpo.rollouts.collect()
  batch = {**batch, 'old_logps': batch['old_logps'] - 0.05}  # ratios away from 1

  def run(mesh, accum=1):
    config = TrainConfig(steps=2, global_batch_size=8, seq_len=24, learning_rate=1e-2,
                         warmup_steps=0, mesh=mesh, grad_accum_steps=accum)
    trainer = Trainer(_policy(), config, GRPOObjective('dapo', beta=0.1, epsilon_high=0.28,
                                                       max_completion_length=8))
    return [trainer.step(batch) for _ in range(2)]

  one = run(MeshConfig(data=1))
  for mesh, accum in ((MeshConfig(data=2, fsdp=2, tensor=2), 1), (MeshConfig(data=1), 2)):
    other = run(mesh, accum)
    for a, b in zip(one, other):
      for key in ('loss', 'kl', 'entropy', 'grad_norm', 'clip_ratio/region_mean'):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize('sampler', ['generate', pytest.param('engine', marks=pytest.mark.slow)])
def test_lora_policy_keeps_its_base_as_the_reference(tokenizer, sampler):
  grpo = _grpo(tokenizer, steps=3, learning_rate=1e-2, lora=LoraConfig(rank=4),
               config=GRPOConfig(num_generations=4, max_new_tokens=8, beta=0.1,
                                 sampler=sampler))
  assert grpo.trainer.frozen_models == {}  # no copy of the policy is held
  history = [grpo.step() for _ in range(3)]
  assert history[0]['kl'] == 0.0 and history[-1]['kl'] > 0.0
  assert max(m['sampling/sampling_logp_difference/max'] for m in history) < 1e-5


def test_resume_samples_what_the_uninterrupted_run_samples(tokenizer, tmp_path):
  def run(directory, steps):
    with _grpo(tokenizer, steps=4, checkpoint_dir=str(directory), checkpoint_every=2) as grpo:
      return grpo.fit(steps, log=lambda line: None)

  full = run(tmp_path / 'full', None)
  run(tmp_path / 'cut', 2)
  resumed = run(tmp_path / 'cut', None)
  assert [m['step'] for m in resumed][-2:] == [3, 4]
  for a, b in zip(full[2:], resumed[-2:]):
    for key in ('reward', 'loss', 'completions/mean_length'):
      np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_dynamic_sampling_replaces_groups_with_equal_rewards(tokenizer):
  def only_some_prompts(prompts, completions, answer, **kwargs):
    # Prompts whose answer is even always get 0: their groups carry no signal.
    return [0.0 if int(a) % 2 == 0 else float(len(c) % 2) for c, a in zip(completions, answer)]

  grpo = _grpo(tokenizer, rewards=[only_some_prompts],
               config=GRPOConfig(num_generations=4, max_new_tokens=8, loss_type='dapo'))
  metrics = grpo.step()
  assert metrics['rollout/samples'] > 1 and metrics['frac_reward_zero_std'] == 0.0
  answer_of = {r['prompt']: r['answer'] for r in RECORDS}
  answers = {answer_of[v] for v in grpo.rollouts.last['values']}
  assert all(int(a) % 2 == 1 for a in answers), answers


# --- rewards and prompts -------------------------------------------------------------------

def test_bad_reward_functions_stop_with_their_name(tmp_path):
  def raises(prompts, completions, **kwargs):
    raise KeyError('answer')

  def too_few(prompts, completions, **kwargs):
    return [1.0]

  def words(prompts, completions, **kwargs):
    return ['good'] * len(completions)

  for fn, message in ((raises, "'raises' raised KeyError"), (too_few, "'too_few' returned 1 "
                                                             'values for 2'),
                      (words, "'words' returned 'good'")):
    with pytest.raises(RewardError, match=message):
      Rewards([fn])(['a', 'b'], ['x', 'y'])
  with pytest.raises(ValueError, match='one weight per function'):
    Rewards([exact_match], [1.0, 2.0])


def test_rewards_weights_columns_and_none():
  def half(prompts, completions, answer, **kwargs):
    return [None if a == 'skip' else 0.5 for a in answer]

  rewards = Rewards([exact_match, half], [2.0, 1.0])
  per_function = rewards(['p', 'q'], ['4 ', 'x'], {'answer': ['4', 'skip']})
  np.testing.assert_array_equal(per_function[0], [1.0, 0.0])
  assert np.isnan(per_function[1, 1])
  np.testing.assert_array_equal(rewards.total(per_function), [2.5, 0.0])


def test_load_reward_from_a_file_or_a_module(tmp_path):
  path = tmp_path / 'my_reward.py'
  path.write_text('def longer(prompts, completions, **kw):\n'
                  '  return [float(len(c)) for c in completions]\n')
  assert load_reward(f'{path}:longer')(['p'], ['abc']) == [3.0]
  assert load_reward('maxnnx.rl.rewards:exact_match') is exact_match
  with pytest.raises(FileNotFoundError, match='no such file'):
    load_reward(f'{tmp_path}/missing.py:fn')
  with pytest.raises(ValueError, match="has no function 'nope'"):
    load_reward(f'{path}:nope')


def test_prompts_read_chats_as_prompt_and_answer_and_restore_their_order(tokenizer):
  from maxnnx.data.chat import ChatTemplate, builtin_template
  records = [{'messages': [{'role': 'user', 'content': f'q{i}'},
                           {'role': 'assistant', 'content': f'a{i}'}]} for i in range(5)]
  with pytest.raises(ValueError, match='no chat template'):
    Prompts(records, tokenizer)
  prompts = Prompts(records, tokenizer, ChatTemplate(builtin_template('chatml')), seed=3)
  first = prompts.take(3)
  assert first[0].columns['answer'] == 'a' + first[0].value[0]['content'][1:]
  state = prompts.get_state()
  later = [p.value for p in prompts.take(4)]  # crosses into the next epoch
  prompts.set_state(state)
  assert [p.value for p in prompts.take(4)] == later
  with pytest.raises(ValueError, match='needs a "prompt"'):
    Prompts([{'text': 'x'}], tokenizer)


def test_config_errors_name_the_field(tokenizer):
  with pytest.raises(ValueError, match='multiple of num_generations=3'):
    _grpo(tokenizer, config=GRPOConfig(num_generations=3, max_new_tokens=4))
  with pytest.raises(ValueError, match='seq_len=8 must exceed max_new_tokens=8'):
    _grpo(tokenizer, seq_len=8)
  with pytest.raises(ValueError, match='loss_type must be one of'):
    GRPOConfig(loss_type='ppo')


def test_rollouts_see_a_policy_view_not_the_trainer(tokenizer):
  """attach takes the trainer's narrow policy view (a Trainer given is asked for it); the
  rollouts keep no reference to the Trainer itself."""
  config = TrainConfig(steps=1, global_batch_size=8, seq_len=24, mesh=MeshConfig(data=1))
  trainer = Trainer(_policy(), config, GRPOObjective(temperature=0.5))
  rollouts = Rollouts(Prompts(RECORDS, tokenizer), vowels, tokenizer, num_generations=4,
                      max_new_tokens=4)
  view = trainer.policy_view()
  assert rollouts.attach(view) is rollouts and rollouts.policy is view
  assert not any(isinstance(v, Trainer) for v in vars(rollouts).values())
  assert isinstance(rollouts, DataSource) and isinstance(rollouts, Checkpointable)
  assert isinstance(rollouts, ReportsMetrics)
  assert (view.global_batch_size, view.seq_len, rollouts.temperature) == (8, 24, 0.5)
  assert view.model is trainer.model and view.local_rows() == slice(0, 8)
  assert isinstance(Rollouts(Prompts(RECORDS, tokenizer), vowels, tokenizer, num_generations=4,
                             max_new_tokens=4).attach(trainer).policy, PolicyView)
  with pytest.raises(TypeError, match=r'takes trainer.policy_view\(\) \(a PolicyView\), got a '
                                      'dict'):
    rollouts.attach({})


def test_the_serving_engine_samples_rollouts_with_the_same_log_probs(tokenizer):
  """sampler='engine': the engine, holding the live parameters, samples completions whose
  log-probs (at the sampling temperature) equal the training forward pass, and the run trains;
  after each update the engine serves the new weights."""
  grpo = _grpo(tokenizer, steps=2,
               config=GRPOConfig(num_generations=4, max_new_tokens=8, temperature=0.7,
                                 sampler='engine'))
  first = grpo.step()
  assert first['sampling/sampling_logp_difference/max'] < 1e-5
  engine = grpo.rollouts._engine
  assert engine is not None and engine.compile_count >= 1
  second = grpo.step()
  assert second['sampling/sampling_logp_difference/max'] < 1e-5  # the updated weights
  assert grpo.rollouts._engine is engine  # reused, weights swapped
  lengths = [len(c) for c in grpo.rollouts.last['completion_ids']]
  assert max(lengths) <= 8 and min(lengths) >= 1
  with pytest.raises(ValueError, match="sampler must be one of"):
    GRPOConfig(sampler='vllm')

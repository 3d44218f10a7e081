"""``GRPO``: a policy, prompts and reward functions in one object a notebook can step.

::

  from maxnnx.rl import GRPO, GRPOConfig, exact_match

  grpo = GRPO(policy, 'prompts.jsonl', [exact_match], tokenizer=tokenizer,
              config=GRPOConfig(num_generations=8, max_new_tokens=16),
              train_config=TrainConfig(steps=40, global_batch_size=32, seq_len=96,
                                       learning_rate=1e-5))
  grpo.step()          # one rollout and one optimiser step; returns the step's metrics
  grpo.rollouts.last   # the prompts, completions, rewards and advantages it trained on
  grpo.fit()           # the remaining steps, with checkpoints and resume like any Trainer

Underneath is an ordinary :class:`~maxnnx.train.Trainer` (``grpo.trainer``) whose
objective is :class:`~maxnnx.rl.GRPOObjective` and whose data are
:class:`~maxnnx.rl.Rollouts` sampled from its own live model, so meshes,
LoRA, quantized bases, checkpoints, metric writers and callbacks work as they do
for pre-training. ``steps`` counts optimiser steps; each rollout feeds
``num_iterations`` of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from flax import nnx

from maxnnx.config.base import ValidatedConfig
from maxnnx.rl.losses import DEFAULT_BETA, DEFAULT_EPSILON, LOSS_TYPES
from maxnnx.rl.objective import GRPOObjective
from maxnnx.rl.prompts import Prompts
from maxnnx.rl.rewards import Rewards
from maxnnx.rl.rollouts import (
  DEFAULT_MAX_NEW_TOKENS,
  DEFAULT_NUM_GENERATIONS,
  SAMPLERS,
  Rollouts,
)
from maxnnx.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class GRPOConfig(ValidatedConfig):
  """The RL settings of a GRPO run (the optimiser, batch and mesh are the TrainConfig's).

  Attributes:
    loss_type: ``grpo``, ``dr_grpo``, ``dapo`` or ``gspo`` (:mod:`maxnnx.rl.losses`).
    num_generations: completions per prompt; ``global_batch_size`` must be a multiple.
    max_new_tokens: the completion budget; ``seq_len`` holds prompt and completion.
    temperature: sampling temperature (the loss uses the same distribution).
    top_k: sample among the ``top_k`` most likely tokens (0: all).
    top_p: nucleus sampling mass (1.0: off).
    beta: weight of the KL penalty to the reference policy (0: no reference is held).
    epsilon: lower clip range of the importance ratio.
    epsilon_high: upper clip range; 0 means ``epsilon`` (``dapo``: 0.28).
    num_iterations: optimiser steps per rollout batch.
    dynamic_sampling: replace groups with equal rewards (``auto``: on for ``dapo``).
    max_refills: extra rollouts at most to fill a batch under dynamic sampling.
    rollouts_jsonl: append every completion with its rewards to this file.
    sampler: ``generate`` or ``engine`` (the serving engine's continuous batching;
      see :class:`~maxnnx.rl.rollouts.Rollouts`).
    reward_timeout_s: seconds each reward function has to return before the run stops
      with an error naming it.
  """

  loss_type: str = 'grpo'
  num_generations: int = DEFAULT_NUM_GENERATIONS
  max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  beta: float = DEFAULT_BETA
  epsilon: float = DEFAULT_EPSILON
  epsilon_high: float = 0.0
  num_iterations: int = 1
  dynamic_sampling: str = 'auto'
  max_refills: int = 4
  rollouts_jsonl: str = ''
  sampler: str = 'generate'
  reward_timeout_s: float = 60.0

  def _validate(self):
    if not self.reward_timeout_s > 0:
      raise ValueError(f'reward_timeout_s must be > 0 (seconds), got {self.reward_timeout_s}.')
    if self.sampler not in SAMPLERS:
      raise ValueError(f'sampler must be one of {SAMPLERS}, got {self.sampler!r}.')
    if self.loss_type not in LOSS_TYPES:
      raise ValueError(f'loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}.')
    if self.dynamic_sampling not in ('auto', 'on', 'off'):
      raise ValueError(f"dynamic_sampling must be 'auto', 'on' or 'off', got "
                       f'{self.dynamic_sampling!r}.')
    if not 0 < self.top_p <= 1 or self.top_k < 0:
      raise ValueError(f'Need 0 < top_p <= 1 and top_k >= 0, got {self.top_p}, {self.top_k}.')

  @property
  def upper_clip(self) -> float:
    """The upper clip range in use."""
    if self.epsilon_high:
      return self.epsilon_high
    return 0.28 if self.loss_type == 'dapo' else self.epsilon


def grpo_objective(config: GRPOConfig, reference: nnx.Module | None = None) -> GRPOObjective:
  """The objective ``config`` describes (``reference``: see :func:`reference_policy`)."""
  return GRPOObjective(config.loss_type, beta=config.beta, epsilon=config.epsilon,
                       epsilon_high=config.upper_clip, temperature=config.temperature,
                       max_completion_length=config.max_new_tokens, reference=reference)


def reference_policy(model: nnx.Module, config: GRPOConfig,
                     train_config: TrainConfig) -> nnx.Module | None:
  """The frozen reference the KL needs: a copy of the starting ``model`` when ``beta > 0``;
  ``None`` without a KL, or under LoRA (the base with its adapters off is the reference)."""
  if config.beta and not train_config.lora.enabled:
    return nnx.clone(model)
  return None


def make_rollouts(config: GRPOConfig, prompts: Prompts, rewards: Rewards, tokenizer, *,
                  seed: int = 0) -> Rollouts:
  """The :class:`Rollouts` ``config`` describes (attach it to the trainer before use)."""
  dynamic = {'auto': None, 'on': True, 'off': False}[config.dynamic_sampling]
  return Rollouts(prompts, rewards, tokenizer, num_generations=config.num_generations,
                  max_new_tokens=config.max_new_tokens, top_k=config.top_k or None,
                  top_p=config.top_p if config.top_p < 1 else None,
                  num_iterations=config.num_iterations, dynamic_sampling=dynamic,
                  max_refills=config.max_refills, seed=seed,
                  rollouts_jsonl=config.rollouts_jsonl or None, sampler=config.sampler,
                  reward_timeout_s=config.reward_timeout_s)


class GRPO:
  """A GRPO run: the Trainer, its objective and its rollouts (see the module docstring).

  Args:
    model: the policy to train (an ``nnx.Module``, e.g. from ``from_pretrained``).
    prompts: a :class:`~maxnnx.rl.Prompts`, or records / a records file.
    rewards: reward functions (callables or ``file.py:name`` specs), or a
      :class:`~maxnnx.rl.Rewards`.
    tokenizer: the policy's tokenizer.
    config: the :class:`GRPOConfig`.
    train_config: optimiser, steps, ``global_batch_size`` (prompts x
      ``num_generations``), ``seq_len`` (prompt + completion), mesh, LoRA,
      checkpoints.
    template: chat template for chat prompts (default: none, text prompts only).
    reward_weights: one weight per reward function.
    callbacks, mesh: passed to the Trainer.

  With ``beta > 0`` the reference is a frozen copy of ``model`` as it starts, or,
  when ``train_config.lora`` adds adapters, the same weights with the adapters off.
  """

  def __init__(self, model: nnx.Module, prompts, rewards, *, tokenizer, config: GRPOConfig
               | None = None, train_config: TrainConfig | None = None, template=None,
               reward_weights: Sequence[float] | None = None, mesh=None,
               callbacks: Iterable[Callable] = ()):
    from maxnnx.train import Trainer  # noqa: PLC0415
    self.config = config = config or GRPOConfig()
    train_config = train_config or TrainConfig()
    if train_config.eval_every:
      train_config = dataclasses.replace(train_config, eval_every=0)
    if not isinstance(prompts, Prompts):
      prompts = Prompts(prompts, tokenizer, template, seed=train_config.seed)
    if not isinstance(rewards, Rewards):
      rewards = Rewards(rewards, reward_weights)
    self.objective = grpo_objective(config, reference_policy(model, config, train_config))
    self.rollouts = make_rollouts(config, prompts, rewards, tokenizer, seed=train_config.seed)
    self.trainer = Trainer(model, train_config, self.objective, data=self.rollouts, mesh=mesh,
                           callbacks=callbacks)
    self.rollouts.attach(self.trainer.policy_view())

  @property
  def model(self) -> nnx.Module:
    """The policy as it is now."""
    return self.trainer.model

  @property
  def history(self) -> list[dict]:
    """One metrics dict per optimiser step (the objective's and the rollout's)."""
    return self.trainer.history

  def step(self) -> dict:
    """One optimiser step (after a rollout when the last one is used up); its metrics."""
    return self.trainer.step()

  def fit(self, steps: int | None = None, **kwargs) -> list[dict]:
    """``Trainer.fit``: train ``steps`` (default ``train_config.steps``) steps."""
    return self.trainer.fit(steps, **kwargs)

  def close(self) -> None:
    """Finish pending checkpoint saves and close the metric writers (``Trainer.close``)."""
    self.trainer.close()

  def __enter__(self) -> GRPO:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


__all__ = ['GRPO', 'GRPOConfig', 'grpo_objective', 'make_rollouts', 'reference_policy']

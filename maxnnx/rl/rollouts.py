"""``Rollouts``: the training data of an RL run, sampled from the policy being trained.

A ``Rollouts`` is the ``data`` of a :class:`~maxnnx.train.Trainer` whose
objective is a :class:`~maxnnx.rl.GRPOObjective`. Each rollout:

1. takes ``global_batch_size / num_generations`` prompts (:class:`~maxnnx.rl.Prompts`);
2. samples ``num_generations`` completions of each from the trainer's live model
   (:func:`~maxnnx.generate`, with per-token log-probs), on the trainer's mesh, seen through
   its :class:`~maxnnx.train.policy.PolicyView` (the rollouts never hold the Trainer):
   the policy that trains is the policy that samples, with no copy. With
   ``sampler='engine'`` the serving :class:`~maxnnx.serving.Engine` samples instead
   (continuous batching: a finished completion frees its row at once, and the
   ``num_generations`` rows of a prompt share its cached pages), its parameters
   swapped for the live ones (``load_weights``) before every rollout;
3. scores them with the reward functions (:class:`~maxnnx.rl.Rewards`) and
   normalises the rewards within each group (:func:`~maxnnx.rl.losses.group_advantages`);
   with dynamic sampling (DAPO) groups whose rewards are all equal are replaced by
   fresh ones;
4. recomputes the policy's log-probs of the completions (``old_logps``) and the
   reference's (``ref_logps``, when ``beta > 0``) with a forward pass on the mesh,
   and records how far the sampler's log-probs are from them;
5. returns the batch ``num_iterations`` times, one optimiser step each.

Rows are ``prompt + completion`` (left-truncated prompts when they are longer than
``seq_len + 1 - max_new_tokens``), right-padded, with ``loss_mask`` on the
completion's tokens (the end-of-sequence token included). The step's record gets
the rollout's metrics (:meth:`pop_metrics`), and with ``rollouts_jsonl`` every
completion is written there with its rewards.

Checkpoints save the prompt position and the rollout count, which seeds the
sampling: a resumed run samples what the uninterrupted one would have. (A run
stopped between the ``num_iterations`` passes of one rollout resumes with the next
rollout.)

In a multi-process run every process samples the same rollout (one SPMD program over
the model's shards, the same seeds), process 0 alone calls the reward functions and
sends their values to the others, and each process then hands the Trainer its own
rows of the batch (``global_batch_size / process_count``, the rows its devices hold:
``PolicyView.local_rows``); only process 0 writes ``rollouts_jsonl``.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxnnx import paths
from maxnnx.inference.generate import generate
from maxnnx.inference.stops import eos_token_ids
from maxnnx.processes import broadcast_bytes, host_value, is_primary
from maxnnx.rl import losses
from maxnnx.rl.objective import ROLLOUT_FIELDS, policy_token_logps
from maxnnx.rl.prompts import Prompts
from maxnnx.rl.rewards import RewardError, Rewards
from maxnnx.train.policy import PolicyView
from maxnnx.train.preemption import StopRequested
from maxnnx.train.trainer import Trainer

logger = logging.getLogger(__name__)

#: How rollouts sample (see :class:`Rollouts`).
SAMPLERS = ('generate', 'engine')
# Rollout defaults, declared once (GRPOConfig reads them).
DEFAULT_NUM_GENERATIONS = 8
DEFAULT_MAX_NEW_TOKENS = 64


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _score(graphdef, reference_graphdef, adapters_off, temperature, chunk_length, state,
           reference_state, batch):
  """``(policy logps, reference logps)`` ``[B, T]`` of a rollout batch's targets."""
  model = nnx.merge(graphdef, state)
  logps_BT, _ = policy_token_logps(model, batch, temperature=temperature,
                                   chunk_length=chunk_length)
  if adapters_off:
    from maxnnx.train.lora import without_adapters  # noqa: PLC0415
    reference = without_adapters(model)
  elif reference_graphdef is not None:
    reference = nnx.merge(reference_graphdef, reference_state)
  else:
    return logps_BT, jnp.zeros_like(logps_BT)
  ref_BT, _ = policy_token_logps(reference, batch, temperature=temperature,
                                 chunk_length=chunk_length)
  return logps_BT, ref_BT


class Rollouts:
  """Rollout batches sampled from a trainer's live policy (see the module docstring).

  Args:
    prompts: the :class:`~maxnnx.rl.Prompts`.
    rewards: the :class:`~maxnnx.rl.Rewards` (or one function / a list of them).
    tokenizer: decodes completions for the reward functions.
    num_generations: completions per prompt (the group size, at least 2).
    max_new_tokens: the completion budget.
    top_k, top_p: sampling restrictions (the temperature is the objective's).
    num_iterations: optimiser steps on each rollout batch (each a pass over it).
    eos_ids: ids that end a completion (default the tokenizer's end-of-turn and
      end-of-document ids).
    dynamic_sampling: replace groups whose rewards are all equal (DAPO); default
      on for ``loss_type='dapo'``.
    max_refills: extra rollouts at most to fill a batch under dynamic sampling;
      after them, equal-reward groups fill what is left.
    seed: seed of the sampling (each rollout's key derives from it and its count).
    rollouts_jsonl: a file (local or bucket URL) to append every completion to.
    sampler: ``generate`` (one static batch per rollout) or ``engine`` (the serving
      engine's continuous batching and prefix cache; the same distribution and
      log-probs, other random draws).
    reward_timeout_s: seconds each reward function has to return (``None``: no limit);
      one that takes longer stops the run with a :class:`~maxnnx.rl.RewardError`, as does
      a batch where every function returns ``None`` for every completion.

  Call :meth:`attach` with the Trainer's :meth:`~maxnnx.train.Trainer.policy_view` before
  the first batch (the :class:`~maxnnx.rl.GRPO` class does it).
  """

  def __init__(self, prompts: Prompts, rewards, tokenizer, *,
               num_generations: int = DEFAULT_NUM_GENERATIONS,
               max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, top_k: int | None = None,
               top_p: float | None = None,
               num_iterations: int = 1, eos_ids: Sequence[int] | None = None,
               dynamic_sampling: bool | None = None, max_refills: int = 4, seed: int = 0,
               rollouts_jsonl: str | None = None, sampler: str = 'generate',
               reward_timeout_s: float | None = 60.0):
    if num_generations < 2:
      raise ValueError(f'num_generations must be >= 2 (advantages compare completions of the '
                       f'same prompt), got {num_generations}.')
    if max_new_tokens < 1 or num_iterations < 1:
      raise ValueError(f'Need max_new_tokens >= 1 and num_iterations >= 1, got '
                       f'{max_new_tokens} and {num_iterations}.')
    if sampler not in SAMPLERS:
      raise ValueError(f'sampler must be one of {SAMPLERS}, got {sampler!r}.')
    if reward_timeout_s is not None and not reward_timeout_s > 0:
      raise ValueError(f'reward_timeout_s must be > 0 (seconds), got {reward_timeout_s}.')
    self.reward_timeout_s = reward_timeout_s
    self.sampler, self._engine = sampler, None
    self.prompts = prompts
    self.rewards = rewards if isinstance(rewards, Rewards) else Rewards(rewards)
    self.tokenizer = tokenizer
    self.num_generations, self.max_new_tokens = num_generations, max_new_tokens
    self.top_k, self.top_p, self.num_iterations = top_k, top_p, num_iterations
    if eos_ids is None:
      eos_ids = eos_token_ids(tokenizer=tokenizer, end_of_turn=True)
    self.eos_ids = sorted(set(int(i) for i in eos_ids))
    self.pad_id = getattr(tokenizer, 'pad_id', None) or 0
    self.dynamic_sampling, self.max_refills = dynamic_sampling, max_refills
    self.seed, self.rollouts_jsonl = seed, rollouts_jsonl
    self.count = 0  # rollouts taken
    self._batch, self._passes_left, self._metrics = None, 0, {}
    self.policy: PolicyView | None = None  # what the rollouts see of the trainer
    self.last = None  # the last rollout, for inspection: prompts, completions, rewards

  # -- wiring -------------------------------------------------------------------------

  def attach(self, policy: PolicyView) -> Rollouts:
    """Sample from ``policy``'s model and build batches of its shape; returns ``self``.

    Args:
      policy: the trainer's :meth:`~maxnnx.train.Trainer.policy_view` (a Trainer given
        here is asked for it).

    Raises:
      TypeError: ``policy`` is neither a view nor a Trainer.
      ValueError: the trainer's objective or batch shape cannot take rollouts.
    """
    if isinstance(policy, Trainer):
      policy = policy.policy_view()
    if not isinstance(policy, PolicyView):
      raise TypeError(f'Rollouts.attach takes trainer.policy_view() (a PolicyView), got a '
                      f'{type(policy).__name__}.')
    objective = policy.objective
    missing = set(ROLLOUT_FIELDS) - set(getattr(objective, 'batch_fields', {}))
    if missing:
      raise ValueError('Rollouts feed an RL objective (GRPOObjective); the trainer\'s '
                       f'{type(objective).__name__} does not take {sorted(missing)}.')
    if policy.global_batch_size % self.num_generations:
      raise ValueError(f'global_batch_size={policy.global_batch_size} must be a multiple of '
                       f'num_generations={self.num_generations} (whole groups per batch).')
    if policy.seq_len <= self.max_new_tokens:
      raise ValueError(f'seq_len={policy.seq_len} must exceed max_new_tokens='
                       f'{self.max_new_tokens}: rows hold the prompt and the completion.')
    if self.dynamic_sampling is None:
      self.dynamic_sampling = objective.loss_type == 'dapo'
    self.policy = policy
    return self

  @property
  def temperature(self) -> float:
    """The sampling temperature: the objective's, so both see the same distribution."""
    return self.policy.objective.temperature

  # -- the data-source protocol of the Trainer ----------------------------------------

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self.policy is None:
      raise RuntimeError('Rollouts.attach(trainer.policy_view()) first: rollouts sample from '
                         'its policy.')
    if self._passes_left == 0:
      before = self.get_state()
      try:
        self._batch, self._metrics = self.collect()
      except StopRequested:  # the rollout is sampled again on resume: its prompts are not used
        self.set_state(before)
        raise
      self._passes_left = self.num_iterations
    self._passes_left -= 1
    return self._local_rows(self._batch)

  def _local_rows(self, batch: dict) -> dict:
    """This process's rows of a global batch (all of it in a single process): the rows its
    devices hold (``PolicyView.local_rows``), so the placed batch keeps the rollout's order."""
    if jax.process_count() == 1:
      return batch
    rows = self.policy.local_rows()
    return {k: v[rows] for k, v in batch.items()}

  def pop_metrics(self) -> dict[str, float]:
    """The current rollout's metrics, for the step that trains on it."""
    return dict(self._metrics)

  def get_state(self) -> dict:
    """Prompt position and rollout count (what a resumed run needs to sample the same)."""
    return {'prompts': self.prompts.get_state(), 'count': self.count}

  def set_state(self, state: dict) -> None:
    """Continue from a :meth:`get_state`: the next batch is a fresh rollout."""
    self.prompts.set_state(state['prompts'])
    self.count = int(state['count'])
    self._batch, self._passes_left = None, 0

  # -- one rollout --------------------------------------------------------------------

  def _sample(self, attempt: int) -> dict:
    """Prompts, completions and rewards of ``global_batch_size / G`` fresh groups."""
    group, policy = self.num_generations, self.policy
    prompts = self.prompts.take(policy.global_batch_size // group)
    budget = policy.seq_len + 1 - self.max_new_tokens
    prompt_ids = [p.ids[-budget:] for p in prompts for _ in range(group)]
    truncated = sum(len(p.ids) > budget for p in prompts)
    seed = int(np.random.SeedSequence([self.seed, self.count, attempt]).generate_state(1)[0])
    if self.sampler == 'engine':
      completion_ids, logprobs = self._engine_sample(prompt_ids, seed)
    else:
      with self.policy.mesh_context():
        out = generate(self.policy.model, prompt_ids, self.max_new_tokens,
                       temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                       eos_ids=self.eos_ids, pad_id=self.pad_id, seed=seed & 0x7FFFFFFF)
      completion_ids = [row[:n].tolist() for row, n in zip(out.tokens, out.lengths)]
      logprobs = out.logprobs
    stops = set(self.eos_ids)
    texts = [self.tokenizer.decode([i for i in ids if i not in stops]) for ids in completion_ids]
    values = [p.value for p in prompts for _ in range(group)]
    columns = {k: [p.columns.get(k) for p in prompts for _ in range(group)]
               for k in sorted({k for p in prompts for k in p.columns})}
    per_function = self._rewards(values, texts, columns)
    return {'prompt_ids': prompt_ids, 'completion_ids': completion_ids, 'texts': texts,
            'values': values, 'per_function': per_function,
            'total': self.rewards.total(per_function), 'logprobs': logprobs,
            'ended': [bool(set(ids) & stops) for ids in completion_ids],
            'truncated_prompts': truncated}

  def _rewards(self, values, texts, columns) -> np.ndarray:
    """The reward functions' ``[functions, rows]`` values, computed by process 0 alone (a
    reward may be costly, or not deterministic) and sent to the others."""
    import io  # noqa: PLC0415
    if jax.process_count() == 1:
      return self.rewards(values, texts, columns, timeout_s=self.reward_timeout_s)
    failure, buffer = None, io.BytesIO()
    if is_primary():
      try:
        np.save(buffer, np.asarray(self.rewards(values, texts, columns,
                                                timeout_s=self.reward_timeout_s), np.float64),
                allow_pickle=False)
      except Exception as e:  # the others must hear of it, not wait for the values
        failure = e
    message = broadcast_bytes(b'E' + str(failure).encode() if failure is not None
                              else b'V' + buffer.getvalue())
    if failure is not None:
      raise failure
    if message[:1] == b'E':
      raise RewardError(f'The reward functions failed on process 0: {message[1:].decode()}')
    return np.load(io.BytesIO(message[1:]))

  def _engine_sample(self, prompt_ids: list[list[int]], seed: int
                     ) -> tuple[list[list[int]], np.ndarray]:
    """Completions and their log-probs ``[rows, max_new_tokens]`` (0 after the end) from the
    serving engine, holding the live parameters."""
    from maxnnx.serving import Engine, SamplingParams  # noqa: PLC0415
    rows, policy = len(prompt_ids), self.policy
    with self.policy.mesh_context():
      if self._engine is None or self._engine.max_batch < rows:
        self._engine = Engine(self.policy.model, max_batch=rows, page_size=16,
                              token_budget=max(rows, min(rows * (policy.seq_len + 1), 4096)),
                              max_model_len=policy.seq_len + 1, max_logprobs=0)
      else:
        self._engine.load_weights(self.policy.model)
      params = [SamplingParams(max_tokens=self.max_new_tokens, temperature=self.temperature,
                               top_k=self.top_k, top_p=self.top_p,
                               seed=int(np.random.SeedSequence([seed, i]).generate_state(1)[0])
                               & 0x7FFFFFFF, stop_token_ids=tuple(self.eos_ids),
                               ignore_eos=True, logprobs=0, scaled_logprobs=True)
                for i in range(rows)]
      completions = self._engine.generate(prompt_ids, params)
    logprobs = np.zeros((rows, self.max_new_tokens), np.float32)
    for i, completion in enumerate(completions):
      logprobs[i, :len(completion.logprobs)] = [t.logprob for t in completion.logprobs]
    return [list(c.token_ids) for c in completions], logprobs

  def _select(self, samples: list[dict], rows: int) -> tuple[dict, int]:
    """The rows of a batch: groups with a reward spread first (dynamic sampling)."""
    group = self.num_generations
    keyed = []  # (has signal, sample index, group index)
    for s, sample in enumerate(samples):
      flat = losses.zero_variance_groups(sample['total'], group)
      keyed += [(not flat[g], s, g) for g in range(len(flat))]
    wanted = rows // group
    informative = [k for k in keyed if k[0]]
    chosen = (informative + [k for k in keyed if not k[0]])[:wanted]
    chosen.sort(key=lambda k: (k[1], k[2]))
    picked = {key: [] for key in ('prompt_ids', 'completion_ids', 'texts', 'values', 'ended')}
    per_function, total, logprobs = [], [], []
    for _, s, g in chosen:
      sl = slice(g * group, (g + 1) * group)
      for key in picked:
        picked[key] += samples[s][key][sl]
      per_function.append(samples[s]['per_function'][:, sl])
      total.append(samples[s]['total'][sl])
      logprobs.append(samples[s]['logprobs'][sl])
    picked.update(per_function=np.concatenate(per_function, 1), total=np.concatenate(total),
                  logprobs=np.concatenate(logprobs))
    dropped = sum(1 for k in keyed if not k[0]) - sum(1 for k in chosen if not k[0])
    return picked, dropped

  def collect(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Take one rollout: ``(batch, metrics)`` (see the module docstring)."""
    start = time.perf_counter()
    policy, group = self.policy, self.num_generations
    samples = [self._sample(0)]
    if self.dynamic_sampling:
      for attempt in range(1, self.max_refills + 1):
        signal = sum(~losses.zero_variance_groups(s['total'], group) for s in samples).sum()
        if signal * group >= policy.global_batch_size:
          break
        samples.append(self._sample(attempt))
    rollout, dropped = self._select(samples, policy.global_batch_size)
    self._check_some_reward(rollout['per_function'])
    scale = self.policy.objective.loss_type != 'dr_grpo'
    advantages = losses.group_advantages(rollout['total'], group, scale_by_std=scale)
    batch, sampler_logps = self._rows(rollout, advantages)
    old_BT, ref_BT = self._score(batch)
    batch['old_logps'], batch['ref_logps'] = old_BT, ref_BT
    mask = batch['loss_mask'] > 0
    difference = np.abs(sampler_logps - old_BT)[mask]
    lengths = np.array([len(c) for c in rollout['completion_ids']])
    grouped = rollout['total'].reshape(-1, group)
    metrics = {
        'reward': float(rollout['total'].mean()),
        'reward_std': float(grouped.std(axis=1, ddof=1).mean()),
        'frac_reward_zero_std': float(losses.zero_variance_groups(rollout['total'],
                                                                  group).mean()),
        'completions/mean_length': float(lengths.mean()),
        'completions/min_length': float(lengths.min()),
        'completions/max_length': float(lengths.max()),
        'completions/clipped_ratio': float(1.0 - np.mean(rollout['ended'])),
        'sampling/sampling_logp_difference/mean': float(difference.mean()) if difference.size
        else 0.0,
        'sampling/sampling_logp_difference/max': float(difference.max()) if difference.size
        else 0.0,
        'rollout/truncated_prompts': float(sum(s['truncated_prompts'] for s in samples)),
        'rollout/seconds': time.perf_counter() - start,
    }
    if self.dynamic_sampling:
      metrics['rollout/groups_dropped'] = float(dropped)
      metrics['rollout/samples'] = float(len(samples))
    for name, values in zip(self.rewards.names, rollout['per_function']):
      finite = values[np.isfinite(values)]
      metrics[f'rewards/{name}/mean'] = float(finite.mean()) if finite.size else float('nan')
      metrics[f'rewards/{name}/std'] = float(finite.std()) if finite.size else float('nan')
    self.last = {**rollout, 'advantages': advantages}
    if self.rollouts_jsonl and is_primary():
      self._write(rollout, advantages)
    self.count += 1
    return batch, metrics

  def _check_some_reward(self, per_function: np.ndarray) -> None:
    """Refuse a batch no reward function scored (all ``None``): it would train on nothing."""
    if np.isnan(per_function).all():
      names = ', '.join(repr(n) for n in self.rewards.names)
      raise RewardError(f'Reward function{"s" if len(self.rewards.names) > 1 else ""} {names} '
                        f'returned None for all {per_function.shape[1]} completions of rollout '
                        f'{self.count}, so there is nothing to learn from; make '
                        f'{"them" if len(self.rewards.names) > 1 else "it"} return a number '
                        'where it applies.')

  def _rows(self, rollout: dict, advantages: np.ndarray) -> tuple[dict, np.ndarray]:
    """The batch dict and the sampler's log-probs at its target positions ``[B, T]``."""
    length = self.policy.seq_len
    rows = len(rollout['prompt_ids'])
    tokens = np.full((rows, length + 1), self.pad_id, np.int32)
    loss_mask = np.zeros((rows, length), np.float32)
    sampler = np.zeros((rows, length), np.float32)
    segment_ids = np.zeros((rows, length), np.int32)
    for i, (prompt, completion) in enumerate(zip(rollout['prompt_ids'],
                                                 rollout['completion_ids'])):
      p, n = len(prompt), len(completion)
      tokens[i, :p] = prompt
      tokens[i, p:p + n] = completion
      segment_ids[i, :p + n - 1] = 1
      loss_mask[i, p - 1:p + n - 1] = 1.0  # targets p .. p+n-1 are the completion
      sampler[i, p - 1:p + n - 1] = rollout['logprobs'][i, :n]
    batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'segment_ids': segment_ids,
             'positions': np.broadcast_to(np.arange(length, dtype=np.int32),
                                          (rows, length)).copy(),
             'loss_mask': loss_mask,
             'advantages': np.repeat(advantages[:, None], length, 1).astype(np.float32)}
    return batch, sampler

  def _score(self, batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """Policy and reference log-probs of the batch's targets, on the trainer's mesh."""
    policy, objective = self.policy, self.policy.objective
    placeholder = {k: np.zeros_like(batch['loss_mask']) for k in ('old_logps', 'ref_logps')}
    placed = policy.place_batch(self._local_rows({**batch, **placeholder}))
    graphdef, state = nnx.split(policy.model)
    reference_graphdef = reference_state = None
    adapters_off = False
    if objective.beta:
      frozen = policy.frozen_models
      if 'reference' in frozen:
        reference_graphdef, reference_state = nnx.split(frozen['reference'])
      else:
        from maxnnx.train.lora import has_adapters  # noqa: PLC0415
        if not has_adapters(policy.model):
          raise ValueError('beta > 0 needs a reference policy: give GRPOObjective(reference=...) '
                           'or train LoRA adapters (the reference is then the base model).')
        adapters_off = True
    with policy.mesh_context():
      old_BT, ref_BT = _score(graphdef, reference_graphdef, adapters_off, objective.temperature,
                              objective.chunk_length, state, reference_state, placed)
    old_BT, ref_BT = host_value(old_BT), host_value(ref_BT)  # every process's rows
    mask = batch['loss_mask']
    return np.asarray(old_BT) * mask, np.asarray(ref_BT) * mask

  def _write(self, rollout: dict, advantages: np.ndarray) -> None:
    step = self.policy.step_count + 1
    lines = []
    for i, text in enumerate(rollout['texts']):
      rewards = {name: (None if np.isnan(v) else float(v))
                 for name, v in zip(self.rewards.names, rollout['per_function'][:, i])}
      lines.append(json.dumps({'rollout': self.count, 'step': step,
                               'prompt': rollout['values'][i], 'completion': text,
                               'rewards': rewards, 'reward': float(rollout['total'][i]),
                               'advantage': float(advantages[i])}, ensure_ascii=False))
    paths.makedirs(paths.parent(self.rollouts_jsonl))
    paths.append_bytes(self.rollouts_jsonl, ('\n'.join(lines) + '\n').encode())


__all__ = ['Rollouts']

"""GRPO rollout speed: ``sampler=generate`` (one static batch) against ``sampler=engine`` (the
serving engine's continuous batching and prefix cache), on the same policy and prompts.

::

  python -m benchmarks.rollouts --config cpu-tiny
  python -m benchmarks.rollouts --config cpu-tiny --prompts 8 --group 4 --max-new-tokens 64

A rollout samples ``--group`` completions of each of ``--prompts`` prompts (random tokens,
lengths uniform in ``--prompt-len``) from ``--config``'s shapes, randomly initialised, at
temperature 1. A random policy rarely emits one given end id, so the ids below
``--eos-fraction`` of the vocabulary all end a completion: lengths then spread as an RL
policy's do (geometric, cut at ``--max-new-tokens``), which is where continuous batching
saves work. Each sampler first takes ``--warmup`` untimed rollouts (they compile), then
``--rollouts`` timed ones (``Rollouts.collect``: sampling plus the scoring forward pass that
every GRPO rollout does). Reported per sampler: rollout seconds (median), completion tokens
per second, and TFLOP/s and MFU against a float32 matmul measured in this process
(``2 x parameters`` FLOPs per sampled or scored token, attention left out: a decode-bound
workload is far from the matmul ceiling, which the MFU shows).

``generate`` compiles once per ``(rows, longest prompt)`` shape, so a rollout whose longest
prompt is new compiles again, inside the timing, as it would in a run; the engine buckets its
step shapes (``engine_compiles`` counts its compiles over all rollouts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from flax import nnx

from benchmarks import measure, results
from benchmarks.configs import BENCH_CONFIGS, get_config
from benchmarks.model import model_config
from maxnnx.config import MeshConfig
from maxnnx.models.counting import num_params
from maxnnx.models.transformer import Transformer


class _IdTokenizer:
  """Text is space-separated token ids: enough for prompts and rewards on a random policy."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size
    self.bos_id, self.eos_id, self.pad_id = None, None, 0

  def encode(self, text: str) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids) -> str:
    return ' '.join(str(int(i)) for i in ids)


def _length_reward(prompts, completions, **kwargs):
  """Longer completions score higher (any spread of rewards will do here)."""
  return [float(len(c.split())) for c in completions]


def run(cfg: dict, *, name: str, num_prompts: int, group: int, max_new_tokens: int,
        prompt_len: tuple[int, int], eos_fraction: float, rollouts: int, warmup: int,
        json_path: str | None = None, log=print) -> list[dict]:
  """Time both samplers; returns one record per sampler."""
  from maxnnx.rl import GRPO, GRPOConfig  # noqa: PLC0415
  from maxnnx.train import TrainConfig  # noqa: PLC0415
  model_cfg = model_config(cfg)
  vocab = model_cfg.vocab_size
  rng = np.random.default_rng(0)
  records = [{'prompt': ' '.join(map(str, rng.integers(vocab // 2, vocab,
                                                        rng.integers(*prompt_len))))}
             for _ in range(max(num_prompts * (warmup + rollouts), 1))]
  eos_ids = list(range(1, max(2, int(vocab * eos_fraction))))
  seq_len = prompt_len[1] + max_new_tokens
  ceiling = measure.matmul_ceiling_tflops('float32')
  flops_per_token = 2 * num_params(model_cfg)
  device, rows = measure.device_description(), []
  for sampler in ('generate', 'engine'):
    grpo = GRPO(Transformer(model_cfg, rngs=nnx.Rngs(0)), records, [_length_reward],
                tokenizer=_IdTokenizer(vocab),
                config=GRPOConfig(num_generations=group, max_new_tokens=max_new_tokens,
                                  sampler=sampler),
                train_config=TrainConfig(global_batch_size=num_prompts * group, seq_len=seq_len,
                                         steps=1, mesh=MeshConfig(data=1)))
    grpo.rollouts.eos_ids = eos_ids
    times, generated, scored = [], [], []
    for i in range(warmup + rollouts):
      start = time.perf_counter()
      batch, _ = grpo.rollouts.collect()
      elapsed = time.perf_counter() - start
      if i >= warmup:
        times.append(elapsed)
        generated.append(sum(len(c) for c in grpo.rollouts.last['completion_ids']))
        scored.append(int(np.asarray(batch['loss_mask']).sum() +
                          sum(len(p) for p in grpo.rollouts.last['prompt_ids'])))
    seconds = statistics.median(times)
    tokens = statistics.median(generated)
    tflops = flops_per_token * (tokens + statistics.median(scored)) / seconds / 1e12
    rows.append({
        'kind': 'rollouts', 'framework': 'maxnnx', 'sampler': sampler, 'config': name,
        'device': device, 'prompts': num_prompts, 'group': group,
        'max_new_tokens': max_new_tokens, 'eos_fraction': eos_fraction,
        'rollout_s': seconds, 'completion_tokens': tokens,
        'completion_tokens_per_s': tokens / seconds, 'tflops': tflops,
        'ceiling_tflops': ceiling, 'mfu': tflops / ceiling,
        'engine_compiles': (grpo.rollouts._engine.compile_count
                            if grpo.rollouts._engine is not None else None),
        'cpu': results.cpu_description(), 'date': results.make_date(),
        'versions': measure.versions(), 'command': results.current_command()})
  log(format_table(rows))
  if json_path:
    results.append_lines(json_path, rows)
    log(f'appended to {json_path}')
  return rows


def format_table(rows: list[dict]) -> str:
  """The human-readable report."""
  lines = [f"  {rows[0]['config']}, {rows[0]['prompts']} prompts x {rows[0]['group']}, up to "
           f"{rows[0]['max_new_tokens']} new tokens; matmul ceiling "
           f"{rows[0]['ceiling_tflops']:.3f} TFLOP/s on {rows[0]['device']}",
           f"  {'sampler':>9} {'rollout s':>9} {'tokens':>7} {'tokens/s':>9} {'TFLOP/s':>8} "
           f"{'MFU':>6}"]
  for r in rows:
    lines.append(f"  {r['sampler']:>9} {r['rollout_s']:>9.2f} {r['completion_tokens']:>7.0f} "
                 f"{r['completion_tokens_per_s']:>9.1f} {r['tflops']:>8.4f} {r['mfu']:>6.1%}")
  if len(rows) == 2:
    lines.append(f"  engine / generate: {rows[0]['rollout_s'] / rows[1]['rollout_s']:.2f}x "
                 'the speed')
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
  """Command line entry point."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='cpu-tiny', choices=sorted(BENCH_CONFIGS))
  parser.add_argument('--prompts', type=int, default=8)
  parser.add_argument('--group', type=int, default=4)
  parser.add_argument('--max-new-tokens', type=int, default=64)
  parser.add_argument('--prompt-len', type=int, nargs=2, default=[16, 64])
  parser.add_argument('--eos-fraction', type=float, default=0.02)
  parser.add_argument('--rollouts', type=int, default=3)
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument('--json', default=None, help='append one JSON line per sampler here')
  args = parser.parse_args(argv)
  run(get_config(args.config), name=args.config, num_prompts=args.prompts, group=args.group,
      max_new_tokens=args.max_new_tokens, prompt_len=tuple(args.prompt_len),
      eos_fraction=args.eos_fraction, rollouts=args.rollouts, warmup=args.warmup,
      json_path=args.json)
  return 0


if __name__ == '__main__':
  sys.exit(main())

"""Quantized inference against the float model: memory, held-out perplexity, greedy agreement
and decode speed.

::

  python -m maxnnx train output_dir=runs/tiny-shakespeare          # the default run, once
  python -m benchmarks.quantized_inference --run runs/tiny-shakespeare

The model is the run's ``final/`` in ``--dtype`` (bfloat16 by default, the baseline). Each
mode of :func:`maxnnx.inference.quantize.quantize_for_inference` is compared with it on:

* parameter bytes (all parameters, and the quantized linear kernels alone);
* perplexity over the held-out 5% of the shipped corpus (the split ``maxnnx train`` holds
  out), in windows of ``--seq`` tokens;
* top-1 agreement: the fraction of held-out positions whose most likely next token is the
  baseline's (teacher-forced, so one early difference does not decide the rest);
* greedy agreement: the fraction of ``--new-tokens`` greedy tokens equal to the baseline's,
  position by position, over ``--prompts`` held-out prompts (a first difference changes
  everything after it, so this falls fast);
* decode tokens/s at batch 1 (median of ``--repeats`` after a compiling call), beside the
  memory-bandwidth bound of reading the parameters once per token, with the bandwidth
  measured in this process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import maxnnx
from benchmarks import measure
from maxnnx.data import SentencePieceTokenizer
from maxnnx.inference.quantize import MODES, kernel_bytes, param_bytes, quantize_for_inference

CORPUS = os.path.join(os.path.dirname(maxnnx.__file__), 'data', 'corpus', 'tinyshakespeare.txt')


def held_out_tokens(tokenizer) -> np.ndarray:
  """The last 5% of the shipped corpus's tokens (what ``maxnnx train`` holds out)."""
  with open(CORPUS) as f:
    tokens = np.asarray(tokenizer.encode(f.read()), np.int32)
  return tokens[int(len(tokens) * 0.95):]


def held_out_scores(model, tokens: np.ndarray, seq: int) -> tuple[float, np.ndarray]:
  """(perplexity, top-1 predictions) over consecutive ``seq + 1``-token windows, 8 at a time:
  exp(mean next-token NLL) and each position's argmax."""
  count = (len(tokens) - 1) // seq
  windows = np.stack([tokens[i * seq:i * seq + seq + 1] for i in range(count)])

  @jax.jit
  def score(ids):
    logits = model(ids[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()
    return nll, logits.argmax(-1)

  losses, top1 = [], []
  for i in range(0, count - 7, 8):
    nll, best = score(jnp.asarray(windows[i:i + 8]))
    losses.append(float(nll))
    top1.append(np.asarray(best))
  return float(np.exp(np.mean(losses))), np.concatenate(top1)


def greedy(model, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
  """Greedy continuations ``[prompts, new_tokens]``."""
  return np.asarray(maxnnx.generate(model, prompts, max_new_tokens=new_tokens,
                                    eos_ids=None).tokens)


def decode_tokens_per_s(model, prompt: np.ndarray, new_tokens: int, repeats: int) -> float:
  """Batch-1 decode tokens/s: (time of new_tokens + 1 tokens - time of 1) / new_tokens."""
  def timed(n):
    greedy(model, prompt, n)  # compiles
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      greedy(model, prompt, n)
      times.append(time.perf_counter() - start)
    return statistics.median(times)
  return new_tokens / max(timed(new_tokens + 1) - timed(1), 1e-9)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--run', default='runs/tiny-shakespeare')
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--modes', default=','.join(MODES))
  parser.add_argument('--seq', type=int, default=128)
  parser.add_argument('--prompts', type=int, default=16)
  parser.add_argument('--prompt-len', type=int, default=16)
  parser.add_argument('--new-tokens', type=int, default=32)
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args(argv)
  final = os.path.join(args.run, 'final')
  tokenizer = SentencePieceTokenizer(os.path.join(args.run, 'tokenizer.model'))
  held = held_out_tokens(tokenizer)
  starts = np.linspace(0, len(held) - args.prompt_len - 1, args.prompts).astype(int)
  prompts = np.stack([held[s:s + args.prompt_len] for s in starts])
  bandwidth = measure.memory_bandwidth_gbs()
  print(f'device: {measure.device_description()}; bandwidth read {bandwidth["read"]:.1f} GB/s, '
        f'copy {bandwidth["copy"]:.1f} GB/s; model {final} in {args.dtype}')
  rows, baseline, baseline_top1 = [], None, None
  for mode in ['none', *args.modes.split(',')]:
    model = maxnnx.from_pretrained(final, dtype=args.dtype, param_dtype=args.dtype)
    if mode != 'none':
      quantize_for_inference(model, mode)
    tokens = greedy(model, prompts, args.new_tokens)  # the new tokens only
    baseline = tokens if baseline is None else baseline
    ppl, top1 = held_out_scores(model, held, args.seq)
    baseline_top1 = top1 if baseline_top1 is None else baseline_top1
    speed = decode_tokens_per_s(model, prompts[:1], args.new_tokens, args.repeats)
    bound = max(bandwidth.values()) * 1e9 / param_bytes(model)
    rows.append({'mode': mode, 'params': param_bytes(model), 'kernels': kernel_bytes(model),
                 'ppl': ppl, 'top1': float((top1 == baseline_top1).mean()),
                 'agree': float((tokens == baseline).mean()), 'tok_s': speed,
                 'bound': bound})
  first = rows[0]
  print(f"{'mode':6} {'params':>10} {'x':>6} {'kernels':>10} {'x':>6} {'held-out ppl':>13} "
        f"{'top-1 agree':>12} {'greedy agree':>13} {'decode tok/s':>13} {'of bound':>9}")
  for r in rows:
    print(f"{r['mode']:6} {r['params']:>10,} {r['params'] / first['params']:>6.2f} "
          f"{r['kernels']:>10,} {r['kernels'] / first['kernels']:>6.2f} {r['ppl']:>13.3f} "
          f"{r['top1']:>12.3f} {r['agree']:>13.3f} {r['tok_s']:>13.1f} "
          f"{r['tok_s'] / r['bound']:>9.1%}")
  print('command: python -m benchmarks.quantized_inference ' + ' '.join(sys.argv[1:]))
  return 0


if __name__ == '__main__':
  sys.exit(main())

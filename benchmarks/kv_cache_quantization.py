"""A quantized KV cache against the float one: page bytes, held-out perplexity read through the
cache, greedy agreement, and decode speed.

::

  python -m maxnnx train output_dir=runs/tiny-shakespeare          # the default run, once
  python -m benchmarks.kv_cache_quantization --run runs/tiny-shakespeare

The model is the run's ``final/`` in ``--dtype`` (bfloat16 by default); each ``kv_cache_dtype``
(``auto``: the model's dtype, the baseline; ``int8``; ``fp8``) is compared with the baseline on:

* bytes of one page of the serving engine's pools (every layer's keys, values and scales);
* perplexity over the held-out 5% of the shipped corpus in windows of ``--seq`` tokens, each
  window written into the cache and every position attending over the cache's (quantized)
  keys and values, as decoding reads them;
* top-1 agreement: the fraction of held-out positions whose most likely next token is the
  baseline's (teacher-forced);
* greedy agreement: ``generate``'s ``--new-tokens`` greedy tokens equal to the baseline's,
  position by position, over ``--prompts`` held-out prompts, and the serving engine's tokens
  equal to ``generate``'s with the same cache dtype;
* decode tokens/s of ``generate`` at batch 1 (median of ``--repeats`` after a compiling call).
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
from flax import nnx

import maxnnx
from benchmarks import measure
from benchmarks.quantized_inference import held_out_tokens
from maxnnx.data import SentencePieceTokenizer
from maxnnx.kernels.kv_quant import KV_CACHE_DTYPES
from maxnnx.serving import Engine, SamplingParams

PAGE_SIZE = 16


def page_bytes(model, kv_cache_dtype: str) -> int:
  """Bytes of one page of the engine's pools, over every layer (keys, values, scales)."""
  engine = Engine(model, page_size=PAGE_SIZE, max_batch=1, max_model_len=4 * PAGE_SIZE,
                  kv_cache_dtype=kv_cache_dtype)
  pages = engine.max_pages + 1  # the scratch page included
  return sum(x.nbytes for x in jax.tree.leaves(engine.runner.cache)) // pages


def cached_scores(model, tokens: np.ndarray, seq: int, kv_cache_dtype: str):
  """(perplexity, top-1 predictions) over consecutive ``seq + 1``-token windows, 8 at a time,
  each written into a fresh ``kv_cache_dtype`` cache and attending over it."""
  count = (len(tokens) - 1) // seq
  windows = np.stack([tokens[i * seq:i * seq + seq + 1] for i in range(count)])
  work = nnx.merge(*nnx.split(model))
  work.init_cache(8, seq, kv_cache_dtype=kv_cache_dtype)
  graphdef, params, cache = nnx.split(work, nnx.Param, ...)

  @jax.jit
  def score(params, cache, ids):
    m = nnx.merge(graphdef, params, cache)
    positions = jnp.broadcast_to(jnp.arange(seq), (ids.shape[0], seq))
    logits = m(ids[:, :-1], segment_ids=jnp.ones_like(positions), positions=positions,
               decode=True).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()
    return nll, logits.argmax(-1)

  losses, top1 = [], []
  for i in range(0, count - 7, 8):
    nll, best = score(params, cache, jnp.asarray(windows[i:i + 8]))
    losses.append(float(nll))
    top1.append(np.asarray(best))
  return float(np.exp(np.mean(losses))), np.concatenate(top1)


def greedy(model, prompts: np.ndarray, new_tokens: int, kv_cache_dtype: str) -> np.ndarray:
  """``generate``'s greedy continuations ``[prompts, new_tokens]``."""
  return np.asarray(maxnnx.generate(model, prompts, max_new_tokens=new_tokens, eos_ids=None,
                                    kv_cache_dtype=kv_cache_dtype).tokens)


def engine_greedy(model, prompts: np.ndarray, new_tokens: int, kv_cache_dtype: str):
  """The serving engine's greedy continuations ``[prompts, new_tokens]``."""
  length = prompts.shape[1] + new_tokens
  engine = Engine(model, page_size=PAGE_SIZE, max_batch=len(prompts),
                  token_budget=len(prompts) * prompts.shape[1], max_model_len=length,
                  page_buckets=-(-length // PAGE_SIZE), kv_cache_dtype=kv_cache_dtype)
  done = engine.generate(prompts.tolist(), SamplingParams(max_tokens=new_tokens,
                                                          ignore_eos=True))
  return np.asarray([list(c.token_ids) for c in done])


def decode_tokens_per_s(model, prompt: np.ndarray, new_tokens: int, repeats: int,
                        kv_cache_dtype: str) -> float:
  """Batch-1 decode tokens/s: (time of new_tokens + 1 tokens - time of 1) / new_tokens."""
  def timed(n):
    greedy(model, prompt, n, kv_cache_dtype)  # compiles
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      greedy(model, prompt, n, kv_cache_dtype)
      times.append(time.perf_counter() - start)
    return statistics.median(times)
  return new_tokens / max(timed(new_tokens + 1) - timed(1), 1e-9)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--run', default='runs/tiny-shakespeare')
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--seq', type=int, default=128)
  parser.add_argument('--prompts', type=int, default=16)
  parser.add_argument('--prompt-len', type=int, default=16)
  parser.add_argument('--new-tokens', type=int, default=64)
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args(argv)
  final = os.path.join(args.run, 'final')
  tokenizer = SentencePieceTokenizer(os.path.join(args.run, 'tokenizer.model'))
  held = held_out_tokens(tokenizer)
  starts = np.linspace(0, len(held) - args.prompt_len - 1, args.prompts).astype(int)
  prompts = np.stack([held[s:s + args.prompt_len] for s in starts])
  model = maxnnx.from_pretrained(final, dtype=args.dtype, param_dtype=args.dtype)
  cfg = model.config
  print(f'device: {measure.device_description()}; model {final} in {args.dtype} '
        f'({cfg.num_layers} layers, {cfg.num_kv_heads} kv heads of {cfg.resolved_head_dim})')
  rows, base = [], None
  for kv in KV_CACHE_DTYPES:
    tokens = greedy(model, prompts, args.new_tokens, kv)
    served = engine_greedy(model, prompts, args.new_tokens, kv)
    ppl, top1 = cached_scores(model, held, args.seq, kv)
    base = base or {'tokens': tokens, 'top1': top1}
    rows.append({'kv': kv, 'page': page_bytes(model, kv), 'ppl': ppl,
                 'top1': float((top1 == base['top1']).mean()),
                 'agree': float((tokens == base['tokens']).mean()),
                 'engine': float((served == tokens).mean()),
                 'tok_s': decode_tokens_per_s(model, prompts[:1], args.new_tokens,
                                              args.repeats, kv)})
  first = rows[0]
  print(f"{'kv':5} {'page bytes':>10} {'x':>6} {'held-out ppl':>13} {'top-1 agree':>12} "
        f"{'greedy agree':>13} {'engine = generate':>18} {'decode tok/s':>13}")
  for r in rows:
    print(f"{r['kv']:5} {r['page']:>10,} {r['page'] / first['page']:>6.3f} {r['ppl']:>13.3f} "
          f"{r['top1']:>12.3f} {r['agree']:>13.3f} {r['engine']:>18.3f} {r['tok_s']:>13.1f}")
  print('command: python -m benchmarks.kv_cache_quantization ' + ' '.join(sys.argv[1:]))
  return 0


if __name__ == '__main__':
  sys.exit(main())

"""Bursts of concurrent requests against the same requests one at a time, through a live server.

::

  python -m benchmarks.serving_bursts                      # 10 bursts of 12, the default model
  python -m benchmarks.serving_bursts --model-dir runs/tiny-shakespeare/final --bursts 5

The server is ``maxnnx.serving.make_app`` under uvicorn on 127.0.0.1 (in this process), as
``maxnnx serve`` builds it; the clients are the real ``openai`` package. Without
``--model-dir`` the default run's model is made first (``maxnnx train steps=1``: the shipped
corpus's tokenizer and the default model, untrained; speed does not depend on the weights).

The benchmark waits for ``/health`` to answer 200 (the engine's warm-up), then for each burst
draws ``--concurrency`` requests (token-id prompts of 1 to ``--max-prompt`` tokens, 8 to
``--max-tokens`` new tokens, greedy, ``ignore_eos`` so every request gets its length) and
sends them all at once, then the same requests one after another. Per burst it prints the
output tokens per second of each way, their ratio, and the compiles the server counted after
it reported ready (``maxnnx_compiles_after_ready_total`` in ``/metrics``: 0 when every request
met a warm program). ``--json PATH`` appends one ``"kind": "serving_bursts"`` line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import tempfile
import time

import httpx
import numpy as np
import openai

from benchmarks import measure, results
from maxnnx.serving.server import make_app, serve_in_thread

NAME = 'bench'


def _wait_until_ready(url: str, timeout: float = 1800.0) -> float:
  """Seconds until ``/health`` answers 200 (the warm-up)."""
  start = time.monotonic()
  while time.monotonic() - start < timeout:
    with contextlib.suppress(httpx.TransportError):
      if httpx.get(f'{url}/health', timeout=10).status_code == 200:
        return time.monotonic() - start
    time.sleep(0.2)
  raise TimeoutError(f'{url}/health did not answer 200 within {timeout:g} s.')


def _metric(url: str, name: str) -> float:
  text = httpx.get(f'{url}/metrics', timeout=10).text
  found = re.search(rf'^maxnnx_{name} (\S+)$', text, re.MULTILINE)
  return float(found.group(1)) if found else float('nan')


def _requests(rng, count: int, vocab: int, max_prompt: int, max_tokens: int) -> list[dict]:
  return [{'prompt': rng.integers(1, vocab, int(rng.integers(1, max_prompt + 1))).tolist(),
           'max_tokens': int(rng.integers(8, max_tokens + 1))} for _ in range(count)]


async def _concurrently(url: str, requests: list[dict]) -> tuple[int, float]:
  async with openai.AsyncOpenAI(base_url=f'{url}/v1', api_key='unused', max_retries=0) as client:
    start = time.perf_counter()
    answers = await asyncio.gather(*[
        client.completions.create(model=NAME, temperature=0.0, extra_body={'ignore_eos': True},
                                  **request) for request in requests])
    seconds = time.perf_counter() - start
  return sum(a.usage.completion_tokens for a in answers), seconds


def _one_at_a_time(url: str, requests: list[dict]) -> tuple[int, float]:
  client = openai.OpenAI(base_url=f'{url}/v1', api_key='unused', max_retries=0)
  start, tokens = time.perf_counter(), 0
  for request in requests:
    answer = client.completions.create(model=NAME, temperature=0.0,
                                       extra_body={'ignore_eos': True}, **request)
    tokens += answer.usage.completion_tokens
  return tokens, time.perf_counter() - start


def _default_model_dir(directory: str) -> str:
  from maxnnx import cli  # noqa: PLC0415
  if cli.main(['train', f'output_dir={directory}', 'steps=1', 'sample_tokens=0',
               'eval_every=0', 'checkpoint_every=0']) != 0:
    raise SystemExit('could not make the default model (maxnnx train steps=1)')
  return f'{directory}/final'


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model-dir', help='a served directory (default: the default run model)')
  parser.add_argument('--bursts', type=int, default=10)
  parser.add_argument('--concurrency', type=int, default=12)
  parser.add_argument('--max-prompt', type=int, default=64)
  parser.add_argument('--max-tokens', type=int, default=32)
  parser.add_argument('--max-model-len', type=int, default=256)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--json', help='append the result line to this JSONL file')
  args = parser.parse_args(argv)

  with tempfile.TemporaryDirectory() as scratch:
    model_dir = args.model_dir or _default_model_dir(scratch)
    app = make_app(model_dir, model_name=NAME, max_batch=args.concurrency,
                   max_queue=args.concurrency, max_model_len=args.max_model_len)
    vocab = app.state.engine_loop.engine.model_config.vocab_size
    with serve_in_thread(app) as (url, _):
      warm_s = _wait_until_ready(url)
      programs = _metric(url, 'compiles_total') + _metric(url, 'compile_cache_hits_total')
      print(f'ready after {warm_s:.1f} s of warm-up ({programs:.0f} programs)', flush=True)
      rng = np.random.default_rng(args.seed)
      rows = []
      for burst in range(1, args.bursts + 1):
        requests = _requests(rng, args.concurrency, vocab, args.max_prompt, args.max_tokens)
        together, together_s = asyncio.run(_concurrently(url, requests))
        alone, alone_s = _one_at_a_time(url, requests)
        row = {'burst': burst, 'tokens': together,
               'burst_tokens_per_s': together / together_s,
               'sequential_tokens_per_s': alone / alone_s,
               'compiles_after_ready': _metric(url, 'compiles_after_ready_total')}
        row['ratio'] = row['burst_tokens_per_s'] / row['sequential_tokens_per_s']
        rows.append(row)
        print(f"burst {burst:2d}: {row['burst_tokens_per_s']:8,.0f} tok/s together, "
              f"{row['sequential_tokens_per_s']:7,.0f} one at a time: {row['ratio']:.2f}x; "
              f"compiles after ready {row['compiles_after_ready']:.0f}", flush=True)
  ratios = [r['ratio'] for r in rows]
  summary = {
      'kind': 'serving_bursts', 'date': results.make_date(), 'command': results.current_command(),
      'device': measure.device_description(), 'cpu': results.cpu_description(),
      'cpu_flags': results.cpu_flags(),
      'warmup_s': warm_s, 'programs': programs, 'bursts': rows,
      'ratio_min': min(ratios), 'ratio_median': statistics.median(ratios),
      'compiles_after_ready': rows[-1]['compiles_after_ready']}
  print(f"ratio min {summary['ratio_min']:.2f}x, median {summary['ratio_median']:.2f}x over "
        f"{len(rows)} bursts of {args.concurrency}; compiles after ready "
        f"{summary['compiles_after_ready']:.0f}; {summary['cpu']}, flags "
        f"{summary['cpu_flags']}")
  if args.json:
    with open(args.json, 'a') as f:
      f.write(json.dumps(summary) + '\n')
  return summary


if __name__ == '__main__':
  main()

"""The load of the serving benchmark: requests, their arrivals, the serving loops and the
statistics (plain Python: no jax, no torch).

``benchmarks.serving`` drives maxnnx with these, and the Hugging Face runner
(``benchmarks/peers/_transformers_serving.py``, in its own virtual environment) imports this
file too, so every system sees the same requests, the same arrival process and the same clock
rules.

Arrivals are either **open loop** (Poisson, ``rate`` requests per second; ``inf``: all at once)
or **closed loop** (``concurrency`` clients, each sending its next request the moment its
previous one completes). Requests arrive in index order in both.

Per request the loops record its arrival, when its first output token was ready and when its
last one was. From those: time to first token (TTFT, first - arrival), time per output token
(TPOT, (last - first) / (tokens - 1)), latency (last - arrival), and output tokens per second
over the whole run (all output tokens / (last completion - first arrival)).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import time
from collections.abc import Callable, Sequence


@dataclasses.dataclass
class Workload:
  """``prompts[i]`` (token ids) is to be continued by exactly ``output_lens[i]`` tokens."""

  prompts: list[list[int]]
  output_lens: list[int]

  def __len__(self) -> int:
    return len(self.prompts)


def make_workload(num_requests: int, vocab_size: int, prompt_lens: tuple[int, int],
                  output_lens: tuple[int, int], seed: int = 0) -> Workload:
  """Random prompts with lengths uniform in ``prompt_lens`` (inclusive), ids in
  ``[1, vocab_size)``, and output lengths uniform in ``output_lens`` (inclusive)."""
  if num_requests < 1 or min(*prompt_lens, *output_lens) < 1:
    raise ValueError('need num_requests >= 1 and lengths >= 1')
  if prompt_lens[0] > prompt_lens[1] or output_lens[0] > output_lens[1]:
    raise ValueError(f'empty length range: prompt {prompt_lens}, output {output_lens}')
  rng = random.Random(seed)
  lengths = [rng.randint(*prompt_lens) for _ in range(num_requests)]
  outs = [rng.randint(*output_lens) for _ in range(num_requests)]
  prompts = [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]
  return Workload(prompts, outs)


def same_lengths(workload: Workload, vocab_size: int, seed: int) -> Workload:
  """Other prompt tokens with the same lengths: the warm-up load (same shapes, so the same
  compiles, but nothing a prefix cache could reuse in the timed run)."""
  rng = random.Random(seed)
  prompts = [[rng.randrange(1, vocab_size) for _ in p] for p in workload.prompts]
  return Workload(prompts, list(workload.output_lens))


class Arrivals:
  """When each request arrives: open loop (``rate``) or closed loop (``concurrency``).

  Args:
    num_requests: requests in all.
    rate: Poisson arrivals, requests per second (``math.inf``: all at the start).
    concurrency: closed loop with this many clients.
    seed: seed of the Poisson gaps.
  """

  def __init__(self, num_requests: int, *, rate: float | None = None,
               concurrency: int | None = None, seed: int = 0):
    if (rate is None) == (concurrency is None):
      raise ValueError('give exactly one of rate (open loop) and concurrency (closed loop)')
    if (rate is not None and rate <= 0) or (concurrency is not None and concurrency < 1):
      raise ValueError(f'need rate > 0 and concurrency >= 1, got {rate}, {concurrency}')
    self.num_requests = num_requests
    self.rate = rate
    self.concurrency = concurrency
    self.seed = seed
    self.times: dict[int, float] = {}
    self._heap: list[tuple[float, int]] = []
    self._issued = 0

  def start(self, t0: float) -> None:
    """Begin at ``t0``: schedule the first arrivals (every one, for an open loop)."""
    self.times, self._heap, self._issued = {}, [], 0
    if self.rate is not None:
      rng = random.Random(self.seed)
      t = t0
      for i in range(self.num_requests):
        self._schedule(i, t)
        if not math.isinf(self.rate):
          t += rng.expovariate(self.rate)
      self._issued = self.num_requests
    else:
      for i in range(min(self.concurrency, self.num_requests)):
        self._schedule(i, t0)
      self._issued = min(self.concurrency, self.num_requests)

  def _schedule(self, index: int, t: float) -> None:
    self.times[index] = t
    heapq.heappush(self._heap, (t, index))

  def pop_arrived(self, now: float) -> list[int]:
    """The requests that arrived by ``now`` and were not popped yet, in index order."""
    out = []
    while self._heap and self._heap[0][0] <= now:
      out.append(heapq.heappop(self._heap)[1])
    return out

  def next_time(self) -> float | None:
    """When the next request arrives; ``None`` if none is scheduled now (open loop: all have
    arrived; closed loop: every client waits for an answer, or no request is left)."""
    return self._heap[0][0] if self._heap else None

  def finished(self, index: int, t: float) -> None:
    """Request ``index`` completed at ``t``; a closed-loop client sends its next one."""
    del index
    if self.concurrency is not None and self._issued < self.num_requests:
      self._schedule(self._issued, t)
      self._issued += 1

  def describe(self) -> str:
    """``'closed loop, 16 concurrent'`` or ``'Poisson, 4 req/s'``."""
    if self.concurrency is not None:
      return f'closed loop, {self.concurrency} concurrent'
    return 'all at once' if math.isinf(self.rate) else f'Poisson, {self.rate:g} req/s'


@dataclasses.dataclass
class Record:
  """One request's times (seconds on the loop's clock) and its output tokens."""

  arrival: float = math.nan
  first: float = math.nan
  last: float = math.nan
  tokens: list[int] = dataclasses.field(default_factory=list)


def serve_in_batches(workload: Workload, arrivals: Arrivals, batch_size: int,
                     run_batch: Callable[[list[int]], tuple[float, list[list[int]]]],
                     clock: Callable[[], float] = time.perf_counter,
                     sleep: Callable[[float], None] = time.sleep) -> list[Record]:
  """Serve ``workload`` with a batch-at-a-time server (``batch_size`` 1: one at a time).

  The server takes the first ``batch_size`` waiting requests once that many wait, or fewer
  when no other request can arrive first, and runs them to completion with
  ``run_batch(indices) -> (first_token_time, output_tokens_per_request)``. Every request of the
  batch gets its first token at ``first_token_time`` and completes when ``run_batch`` returns.
  """
  records = [Record() for _ in range(len(workload))]
  queue: list[int] = []
  done = 0
  arrivals.start(clock())
  while done < len(workload):
    queue += arrivals.pop_arrived(clock())
    if queue and (len(queue) >= batch_size or arrivals.next_time() is None):
      group, queue = queue[:batch_size], queue[batch_size:]
      first, outputs = run_batch(group)
      end = clock()
      for index, tokens in zip(group, outputs):
        record = records[index]
        record.arrival, record.first, record.last = arrivals.times[index], first, end
        record.tokens = list(tokens)
        arrivals.finished(index, end)
      done += len(group)
    else:
      upcoming = arrivals.next_time()
      if upcoming is None:
        raise RuntimeError('no request can arrive and none waits: the arrivals are stuck')
      sleep(max(0.0, upcoming - clock()))
  return records


def percentile(values: Sequence[float], q: float) -> float:
  """The ``q``-th percentile (0-100) with linear interpolation (numpy's default)."""
  data = sorted(values)
  if not data:
    return math.nan
  k = (len(data) - 1) * q / 100
  lo, hi = math.floor(k), math.ceil(k)
  return data[lo] + (data[hi] - data[lo]) * (k - lo)


def summarize(records: list[Record]) -> dict:
  """Throughput and the p50 / p99 of TTFT, TPOT and latency over ``records``."""
  output_tokens = sum(len(r.tokens) for r in records)
  start = min(r.arrival for r in records)
  duration = max(r.last for r in records) - start
  ttft = [r.first - r.arrival for r in records]
  tpot = [(r.last - r.first) / (len(r.tokens) - 1) for r in records if len(r.tokens) > 1]
  latency = [r.last - r.arrival for r in records]
  out = {'num_requests': len(records), 'output_tokens': output_tokens, 'duration_s': duration,
         'output_tokens_per_s': output_tokens / duration,
         'requests_per_s': len(records) / duration}
  for name, values in (('ttft', ttft), ('tpot', tpot), ('latency', latency)):
    out[f'{name}_p50_s'] = percentile(values, 50)
    out[f'{name}_p99_s'] = percentile(values, 99)
  return out

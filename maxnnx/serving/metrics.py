"""The server's counters and histograms, rendered in Prometheus' text format for ``/metrics``.

Updated from the HTTP handlers and read by scrapes, under one lock. The gauges that
describe the engine (running requests, pages in use, steps) come from the snapshot
the engine thread publishes after each step (:attr:`EngineLoop.stats
<maxnnx.serving.server.EngineLoop.stats>`).
"""

from __future__ import annotations

import collections
import threading

PREFIX = 'maxnnx_'
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
  """Cumulative buckets, a sum and a count, as Prometheus histograms keep them."""

  def __init__(self, buckets=LATENCY_BUCKETS):
    self.buckets = tuple(buckets)
    self.counts = [0] * len(self.buckets)
    self.sum = 0.0
    self.count = 0

  def observe(self, value: float) -> None:
    """Record one value."""
    for i, bound in enumerate(self.buckets):
      if value <= bound:
        self.counts[i] += 1
    self.sum += value
    self.count += 1

  def lines(self, name: str) -> list[str]:
    """The ``_bucket``, ``_sum`` and ``_count`` samples."""
    out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
    return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f'{name}_sum {self.sum:.6f}',
                  f'{name}_count {self.count}']


class ServerMetrics:
  """What ``/metrics`` reports. Thread-safe."""

  def __init__(self):
    self._lock = threading.Lock()
    self.http = collections.Counter()        # (endpoint, status) -> HTTP requests answered
    self.finished = collections.Counter()    # finish reason -> engine requests (choices)
    self.prompt_tokens = 0
    self.generation_tokens = 0
    self.cached_tokens = 0
    self.time_to_first_token = Histogram()
    self.request_latency = Histogram()

  def answered(self, endpoint: str, status: int) -> None:
    """Count one HTTP response of an API endpoint."""
    with self._lock:
      self.http[endpoint, status] += 1

  def first_token(self, seconds: float) -> None:
    """A choice produced its first token ``seconds`` after its request arrived."""
    with self._lock:
      self.time_to_first_token.observe(seconds)

  def choice_done(self, reason: str, prompt_tokens: int, output_tokens: int, cached_tokens: int,
                  seconds: float) -> None:
    """A choice ended (``reason``: ``stop``, ``length`` or ``cancelled``)."""
    with self._lock:
      self.finished[reason] += 1
      self.prompt_tokens += prompt_tokens
      self.generation_tokens += output_tokens
      self.cached_tokens += cached_tokens
      self.request_latency.observe(seconds)

  def render(self, in_flight: int, stats: dict) -> str:
    """The text exposition: counters, histograms, and gauges from ``in_flight`` (requests the
    server holds, queued or running) and the engine's ``stats``."""
    running = stats.get('running', 0)
    gauges = {
        'requests_running': ('Requests the engine is computing.', running),
        'queue_depth': ('Requests accepted and waiting for a batch slot.',
                        max(in_flight - running, 0)),
        'requests_in_flight': ('Requests the server holds, queued or running.', in_flight),
        'kv_pages_used': ('KV-cache pages held by requests.',
                          stats.get('pages_used', 0)),
        'kv_pages_total': ('KV-cache pages in the pool.', stats.get('pages_total', 0)),
        'kv_sliding_pages_used': ("Pages of the sliding layers' own pool held by requests "
                                  '(models mixing sliding and full layers; else 0).',
                                  stats.get('sliding_pages_used', 0)),
        'kv_sliding_pages_total': ("Pages in the sliding layers' own pool (0: none).",
                                   stats.get('sliding_pages_total', 0)),
        'spec_decode_draft_acceptance_rate': (
            'Draft tokens accepted over draft tokens verified (0 before any draft).',
            stats.get('spec_accepted_tokens', 0) / max(stats.get('spec_draft_tokens', 0), 1)),
    }
    with self._lock:
      counters = {
          'prompt_tokens_total': ('Prompt tokens of finished requests.', self.prompt_tokens),
          'generation_tokens_total': ('Tokens generated.', self.generation_tokens),
          'prefix_cache_hit_tokens_total': ('Prompt tokens served from the prefix cache.',
                                            self.cached_tokens),
          'engine_steps_total': ('Engine steps run.', stats.get('steps', 0)),
          'preemptions_total': ('Requests preempted for lack of pages.',
                                stats.get('preemptions', 0)),
          'compiles_total': ('Programs the engine compiled (warm-up included; not those read '
                             'back from compile_cache).', stats.get('compiles', 0)),
          'compile_cache_hits_total': ('Programs the engine read back from compile_cache.',
                                       stats.get('compile_cache_hits', 0)),
          'compiles_after_ready_total': ('Programs the engine compiled or read back after '
                                         'warm-up, while serving (0: every step was warm).',
                                         stats.get('compiles_after_ready', 0)),
          'spec_decode_num_drafts_total': ('Speculative verifications: requests that '
                                           'verified drafts in a step.',
                                           stats.get('spec_drafts', 0)),
          'spec_decode_num_draft_tokens_total': ('Draft tokens verified.',
                                                 stats.get('spec_draft_tokens', 0)),
          'spec_decode_num_accepted_tokens_total': ('Draft tokens the model accepted.',
                                                    stats.get('spec_accepted_tokens', 0)),
      }
      lines = _family('http_requests_total', 'counter',
                      'HTTP responses of the API endpoints, by endpoint and status.',
                      [f'{{endpoint="{e}",status="{s}"}} {n}'
                       for (e, s), n in sorted(self.http.items())])
      lines += _family('requests_finished_total', 'counter',
                       'Requests (choices) ended, by finish reason.',
                       [f'{{finish_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())])
      for name, (doc, value) in counters.items():
        lines += _family(name, 'counter', doc, [f' {value}'])
      lines += _family('spec_decode_num_accepted_tokens_per_pos_total', 'counter',
                       'Draft tokens accepted, by position in the draft (0: the first).',
                       [f'{{position="{i}"}} {n}' for i, n in
                        enumerate(stats.get('spec_accepted_per_position', ()))])
      lines += [f'# HELP {PREFIX}time_to_first_token_seconds Seconds from a request\'s arrival '
                'to its first token.', f'# TYPE {PREFIX}time_to_first_token_seconds histogram',
                *self.time_to_first_token.lines(f'{PREFIX}time_to_first_token_seconds')]
      lines += [f'# HELP {PREFIX}request_duration_seconds Seconds from a request\'s arrival to '
                'its end.', f'# TYPE {PREFIX}request_duration_seconds histogram',
                *self.request_latency.lines(f'{PREFIX}request_duration_seconds')]
    for name, (doc, value) in gauges.items():
      lines += _family(name, 'gauge', doc, [f' {value}'])
    return '\n'.join(lines) + '\n'


def _family(name: str, kind: str, doc: str, samples: list[str]) -> list[str]:
  full = PREFIX + name
  return [f'# HELP {full} {doc}', f'# TYPE {full} {kind}', *(full + s for s in samples)]

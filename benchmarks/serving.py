"""Serving throughput and latency: the maxnnx ``Engine`` against batch-at-a-time ``generate``
and Hugging Face transformers, under the same requests and arrivals.

::

  python -m benchmarks.serving --concurrency 16                 # closed loop, 16 clients
  python -m benchmarks.serving --rate 2 --num-requests 64       # Poisson, 2 requests/s
  python -m benchmarks.serving --systems engine,single --num-requests 16 --output-len 8 32

One checkpoint for every system: ``--config``'s shapes (``benchmarks/configs.py``, Llama-style),
randomly initialised and written with ``save_pretrained`` (to ``--checkpoint DIR`` if given,
reused when it already holds one). maxnnx loads it with ``from_pretrained``, transformers with
``AutoModelForCausalLM.from_pretrained``; both compute in float32.

The load (``benchmarks/serving_load.py``): ``--num-requests`` prompts of random tokens, prompt
and output lengths uniform in ``--prompt-len`` and ``--output-len``, arriving as a closed loop of
``--concurrency`` clients or as a Poisson process of ``--rate`` requests/s. Decoding is greedy
and never stops early: every request gets exactly its output length. The systems:

- ``engine``: ``maxnnx.serving.Engine`` (continuous batching over a paged KV cache, at most
  ``--max-batch`` requests and ``--token-budget`` tokens a step), driven with ``add_request`` /
  ``step`` as a server would: arrived requests are added before each step.
- ``static``: ``maxnnx.generate`` on batches of ``--batch-size`` requests, left-padded to the
  longest prompt and run for the longest output. A batch starts once that many requests wait
  (fewer when no other can arrive first).
- ``single``: ``maxnnx.generate`` on one request at a time.
- ``hf-single`` / ``hf-static``: transformers ``generate`` (torch, eager, greedy) one at a time /
  on the same batches as ``static``, in its own virtual environment as a subprocess
  (``benchmarks/peers/_transformers_serving.py``).

Every system first serves a warm-up load (other prompt tokens, same lengths, same arrivals),
untimed, so the timed run finds its programs compiled; ``compiles`` counts the XLA compiles
during the warm-up and during the timed run (the engine's model step buckets its shapes;
``generate`` compiles once per batch shape, so the warm-up compiles every shape it meets).

Per request: time to first token (TTFT, from its arrival to its first output token),
time per output token (TPOT, the rest of its tokens over their number) and latency; for the
run, output tokens per second (useful tokens only: a static batch's padding rows do not
count) from the first arrival to the last completion. The engine's first token is its
``step()`` output; ``generate``'s is when its prefill's logits are ready (the token is picked
from them as its decode loop starts; ``generate`` returns every token at the end, so its TPOT
is the rest of the call spread over the tokens); transformers' is when ``generate`` streams
it. ``same tokens`` compares each system's tokens with ``single``'s.

The engine's line also splits its step time by compiled bucket (``engine_steps_by_shape``:
tokens, widest row, wide rows, pages a row; steps, seconds), costliest first, and the log
prints the three costliest: where to look first when the engine's steps are slow.

``--json PATH`` appends one ``"kind": "serving"`` line per system.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
from flax import nnx
from jax import monitoring

from benchmarks import measure, results, serving_load
from benchmarks.configs import BENCH_CONFIGS, get_config
from benchmarks.model import model_config
from benchmarks.peers import _common
from maxnnx.inference import generate
from maxnnx.models.pretrained import from_pretrained, save_pretrained
from maxnnx.models.transformer import Transformer
from maxnnx.serving import Engine, SamplingParams

SYSTEMS = ('engine', 'static', 'single', 'hf-single', 'hf-static')
HF_INNER = Path(__file__).resolve().parent / 'peers' / '_transformers_serving.py'
_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'


# -- the checkpoint -------------------------------------------------------------------------------


def ensure_checkpoint(cfg: dict, directory: str, max_length: int, seed: int = 0) -> str:
  """A Hugging Face directory with ``cfg``'s shapes (random float32 weights) in ``directory``,
  written once; an existing ``config.json`` there is reused as it is."""
  if not os.path.exists(os.path.join(directory, 'config.json')):
    mcfg = model_config(cfg, dtype='float32', max_length=max_length)
    save_pretrained(Transformer(mcfg, rngs=nnx.Rngs(seed)), directory)
  return directory


# -- measuring ------------------------------------------------------------------------------------


class CompileCounter:
  """Counts XLA backend compiles while active (``with counter: ...``; ``counter.count``)."""

  def __init__(self):
    self.count = 0

  def _listener(self, event, duration, **kwargs):
    del duration, kwargs
    if event == _COMPILE_EVENT:
      self.count += 1

  def __enter__(self):
    monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc):
    monitoring.unregister_event_duration_listener(self._listener)


@contextlib.contextmanager
def first_token_clock(stamps: list[float]):
  """While active, every ``maxnnx.generate`` call appends to ``stamps`` the time its prefill's
  logits are ready (the first token is sampled from them as the decode loop starts)."""
  module = importlib.import_module('maxnnx.inference.generate')
  original = module._prefill

  def timed(*args, **kwargs):
    out = original(*args, **kwargs)
    jax.block_until_ready(out[0])
    stamps.append(time.perf_counter())
    return out

  module._prefill = timed
  try:
    yield
  finally:
    module._prefill = original


def generate_runner(model, workload: serving_load.Workload):
  """``run_batch`` for ``serving_load.serve_in_batches``: one ``maxnnx.generate`` call."""

  def run(indices):
    rows = [workload.prompts[i] for i in indices]
    new = max(workload.output_lens[i] for i in indices)
    stamps = []
    with first_token_clock(stamps):
      out = generate(model, rows, new, eos_ids=None)
    return stamps[0], [out.tokens[r, :workload.output_lens[i]].tolist()
                       for r, i in enumerate(indices)]

  return run


def serve_engine(engine: Engine, workload: serving_load.Workload,
                 arrivals: serving_load.Arrivals, clock=time.perf_counter,
                 sleep=time.sleep, stats: dict | None = None) -> list[serving_load.Record]:
  """Serve ``workload`` with ``engine``: before each ``step()`` every request that has arrived
  is added; a token counts as delivered when ``step()`` returns it. ``stats`` (if given)
  gets ``steps`` and ``step_s``, the number of steps and the seconds spent in them, and
  ``by_shape``: ``{bucket: [steps, seconds]}`` (``Engine.last_step_shape``)."""
  stats = {} if stats is None else stats
  stats.update(steps=0, step_s=0.0, by_shape={})
  records = [serving_load.Record() for _ in range(len(workload))]
  index_of: dict[int, int] = {}
  done = 0
  arrivals.start(clock())
  while done < len(workload):
    for i in arrivals.pop_arrived(clock()):
      params = SamplingParams(max_tokens=workload.output_lens[i], temperature=0.0,
                              ignore_eos=True)
      index_of[engine.add_request(workload.prompts[i], params)] = i
      records[i].arrival = arrivals.times[i]
    if engine.has_unfinished():
      before = clock()
      outputs = engine.step()
      now = clock()
      stats['steps'] += 1
      stats['step_s'] += now - before
      if engine.last_step_shape is not None:
        bucket = stats['by_shape'].setdefault(engine.last_step_shape, [0, 0.0])
        bucket[0] += 1
        bucket[1] += now - before
      for out in outputs:
        i = index_of[out.request_id]
        record = records[i]
        if math.isnan(record.first):
          record.first = now
        if out.finished:
          record.last, record.tokens = now, list(out.token_ids)
          arrivals.finished(i, now)
          done += 1
    else:
      upcoming = arrivals.next_time()
      if upcoming is None:
        raise RuntimeError('no request can arrive and none runs: the arrivals are stuck')
      sleep(max(0.0, upcoming - clock()))
  return records


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
  """How many requests got exactly the reference's tokens, and the mean fraction of their
  leading tokens that agree."""
  same, prefix = 0, 0.0
  for ours, theirs in zip(tokens, reference):
    same += ours == theirs
    n = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours),
                                                                              len(theirs)))
    prefix += n / max(len(theirs), 1)
  return {'same_tokens': same, 'same_prefix_fraction': prefix / max(len(reference), 1)}


# -- the systems ----------------------------------------------------------------------------------


def run_maxnnx(system: str, model, timed: serving_load.Workload, warm: serving_load.Workload,
               arrival_kwargs: dict, *, batch_size: int, engine_kwargs: dict, log=print) -> dict:
  """Warm up, then time one maxnnx system; returns its records and counters."""
  extra = {}
  if system == 'engine':
    engine = Engine(model, **engine_kwargs)
    extra['engine'] = dict(engine_kwargs)
    stats = {}

    def serve(workload, arrivals):
      return serve_engine(engine, workload, arrivals, stats=stats)
  else:
    size = batch_size if system == 'static' else 1

    def serve(workload, arrivals):
      return serving_load.serve_in_batches(workload, arrivals, size,
                                           generate_runner(model, workload))
  start = time.perf_counter()
  with CompileCounter() as warm_compiles:
    serve(warm, serving_load.Arrivals(len(warm), **arrival_kwargs))
  warmup_s = time.perf_counter() - start
  with CompileCounter() as timed_compiles:
    records = serve(timed, serving_load.Arrivals(len(timed), **arrival_kwargs))
  if system == 'engine':
    extra['engine_step_compiles'] = engine.compile_count
    extra['engine_step_shapes'] = len(engine.step_shapes)
    extra['engine_max_compiles'] = engine.max_compiles()
    extra['preemptions'] = engine.scheduler.num_preemptions
    extra['engine_steps'] = stats['steps']
    extra['engine_step_ms'] = 1e3 * stats['step_s'] / max(stats['steps'], 1)
    extra['engine_steps_by_shape'] = [  # where the step time goes, the costliest bucket first
        {'tokens': s[0], 'max_q': s[1], 'pages': s[2], 'wide_rows': s[3],
         'images': 'images' in s, 'steps': n, 'seconds': t, 'mean_ms': 1e3 * t / n}
        for s, (n, t) in sorted(stats['by_shape'].items(), key=lambda kv: -kv[1][1])]
  log(f'  {system}: warm-up {warmup_s:.1f} s, {warm_compiles.count} compiles; timed run '
      f'{timed_compiles.count} compiles' + (f", {extra['engine_steps']} steps of "
                                           f"{extra['engine_step_ms']:.1f} ms on average"
                                           if system == 'engine' else ''))
  for b in extra.get('engine_steps_by_shape', [])[:3]:
    log(f"    {b['steps']} steps of {b['tokens']} tokens, rows up to {b['max_q']} wide "
        f"({b['wide_rows'] or 'all'} of them), {b['pages']} pages a row: {b['seconds']:.2f} s, "
        f"{b['mean_ms']:.1f} ms each")
  return dict(records=records, warmup_s=warmup_s, compiles_warmup=warm_compiles.count,
              compiles_timed=timed_compiles.count, **extra)


def run_transformers(systems: list[str], checkpoint: str, timed: serving_load.Workload,
                     warm: serving_load.Workload, arrival_kwargs: dict, *, batch_size: int,
                     python: str, threads: int, timeout: float, log=print) -> dict:
  """Run the ``hf-*`` systems in one subprocess; ``{system: result or {'error': why}}``."""
  specs = [{'name': s, 'batch_size': batch_size if s == 'hf-static' else 1} for s in systems]
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / 'out.json'
    spec = Path(tmp) / 'spec.json'
    spec.write_text(json.dumps(dict(
        checkpoint=os.path.abspath(checkpoint), prompts=timed.prompts,
        output_lens=timed.output_lens, warmup_prompts=warm.prompts, arrivals=arrival_kwargs,
        systems=specs, threads=threads, out=str(out))))
    try:
      proc = subprocess.run([python, str(HF_INNER), str(spec)], capture_output=True, text=True,
                            timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
      return {s: {'error': f'{type(e).__name__}: {e}'} for s in systems}
    if proc.returncode != 0 or not out.exists():
      tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ['no output']
      return {s: {'error': f'exit {proc.returncode}: {tail[0]}'} for s in systems}
    raw = json.loads(out.read_text())
  found = {}
  for name, data in raw['systems'].items():
    records = [serving_load.Record(**r) for r in data['records']]
    log(f'  {name}: warm-up {data["warmup_s"]:.1f} s (eager: nothing to compile)')
    found[name] = dict(records=records, warmup_s=data['warmup_s'], compiles_warmup=None,
                       compiles_timed=None, versions=raw['versions'], threads=raw['threads'],
                       attn_implementation=raw['attn_implementation'])
  return found


# -- the run --------------------------------------------------------------------------------------


def run(cfg: dict, *, name: str, systems=SYSTEMS, num_requests: int = 64,
        concurrency: int | None = 16, rate: float | None = None,
        prompt_lens=(16, 256), output_lens=(16, 128), batch_size: int = 16,
        max_batch: int = 16, token_budget: int = 256, page_size: int = 16, seed: int = 0,
        checkpoint: str | None = None, hf_python_path: str | None = None, hf_threads: int = 0,
        hf_timeout: float = 3600.0, json_path: str | None = None, log=print) -> list[dict]:
  """Benchmark ``systems`` on config ``cfg``; returns one dict per system."""
  unknown = set(systems) - set(SYSTEMS)
  if unknown or not systems:
    raise ValueError(f'unknown systems {sorted(unknown)}; known: {", ".join(SYSTEMS)}')
  max_len = prompt_lens[1] + output_lens[1]
  timed = serving_load.make_workload(num_requests, cfg['vocab_size'], prompt_lens, output_lens,
                                     seed)
  warm = serving_load.same_lengths(timed, cfg['vocab_size'], seed + 1)
  arrival_kwargs = dict(rate=rate, concurrency=None if rate is not None else concurrency,
                        seed=seed)
  arrivals_text = serving_load.Arrivals(num_requests, **arrival_kwargs).describe()
  device = measure.device_description()
  with contextlib.ExitStack() as stack:
    if checkpoint is None:
      checkpoint = stack.enter_context(tempfile.TemporaryDirectory())
    ensure_checkpoint(cfg, checkpoint, max_len, seed)
    model = from_pretrained(checkpoint)
    engine_kwargs = dict(max_batch=max_batch, token_budget=token_budget, page_size=page_size,
                         max_model_len=max_len)
    log(f'{name}: {num_requests} requests ({arrivals_text}), prompts {prompt_lens[0]}-'
        f'{prompt_lens[1]}, outputs {output_lens[0]}-{output_lens[1]} tokens '
        f'({sum(timed.output_lens):,} in all), float32, greedy; {device}')
    found = {}
    for system in systems:
      if not system.startswith('hf-'):
        found[system] = run_maxnnx(system, model, timed, warm, arrival_kwargs,
                                   batch_size=batch_size, engine_kwargs=engine_kwargs, log=log)
    hf = [s for s in systems if s.startswith('hf-')]
    if hf:
      threads = hf_threads or _common.usable_cores()
      try:
        python = _common.transformers_python(hf_python_path, log=log)
      except (OSError, subprocess.CalledProcessError) as e:
        found.update({s: {'error': f'no transformers environment: {e}'} for s in hf})
      else:
        found.update(run_transformers(hf, checkpoint, timed, warm, arrival_kwargs,
                                      batch_size=batch_size, python=python, threads=threads,
                                      timeout=hf_timeout, log=log))

  reference = found.get('single', {}).get('records')
  base = dict(kind='serving', config=name, device=device, dtype='float32',
              num_requests=num_requests, arrivals=arrivals_text, concurrency=arrival_kwargs[
                  'concurrency'], rate=rate, prompt_lens=list(prompt_lens),
              output_lens=list(output_lens), batch_size=batch_size, seed=seed)
  rows = []
  for system in systems:
    data = found[system]
    row = dict(base, system=system,
               framework='transformers' if system.startswith('hf-') else 'maxnnx',
               batching=_batching(system, batch_size, max_batch))
    if 'error' in data:
      row['error'] = data['error']
    else:
      records = data.pop('records')
      row.update(serving_load.summarize(records))
      row.update(data)
      if reference is not None:
        row.update(agreement([r.tokens for r in records], [r.tokens for r in reference]))
    row.setdefault('versions', measure.versions())
    row.update(date=results.make_date(), command=results.current_command())
    rows.append(row)
  single = next((r for r in rows if r['system'] == 'single' and 'error' not in r), None)
  for row in rows:
    if single is not None and 'error' not in row:
      row['vs_single'] = row['output_tokens_per_s'] / single['output_tokens_per_s']
  log(format_table(rows))
  for line in verdict(rows, concurrency=arrival_kwargs['concurrency']):
    log(line)
  if json_path:
    results.append_lines(json_path, rows)
    log(f'appended to {json_path}')
  return rows


def _batching(system: str, batch_size: int, max_batch: int) -> str:
  return {'engine': f'continuous, up to {max_batch}', 'static': f'static {batch_size}',
          'single': 'one at a time', 'hf-single': 'one at a time',
          'hf-static': f'static {batch_size}'}[system]


def format_table(rows: list[dict]) -> str:
  """The human-readable report: one line per system."""
  header = (f"  {'system':<10} {'batching':<19} {'out tok/s':>9} {'x single':>8} "
            f"{'TTFT p50':>8} {'p99':>7} {'TPOT ms p50':>11} {'p99':>6} {'lat p50':>7} "
            f"{'p99':>6} {'compiles':>9} {'same':>5}")
  lines = [header]
  for r in rows:
    if 'error' in r:
      lines.append(f"  {r['system']:<10} {r['batching']:<19} no result: {r['error']}")
      continue
    ratio = f"{r['vs_single']:.2f}x" if 'vs_single' in r else ''
    compiles = ('-' if r['compiles_timed'] is None
                else f"{r['compiles_warmup']}/{r['compiles_timed']}")
    same = f"{r['same_tokens']}/{r['num_requests']}" if 'same_tokens' in r else ''
    lines.append(
        f"  {r['system']:<10} {r['batching']:<19} {r['output_tokens_per_s']:>9,.1f} "
        f"{ratio:>8} {r['ttft_p50_s']:>7.2f}s {r['ttft_p99_s']:>6.2f}s "
        f"{r['tpot_p50_s'] * 1e3:>11.1f} {r['tpot_p99_s'] * 1e3:>6.1f} "
        f"{r['latency_p50_s']:>6.1f}s {r['latency_p99_s']:>5.1f}s {compiles:>9} {same:>5}")
  lines.append('  compiles: XLA compiles in the warm-up / in the timed run; same: requests whose '
               'tokens equal single\'s')
  return '\n'.join(lines)


def verdict(rows: list[dict], concurrency: int | None) -> list[str]:
  """The issue's target: the engine at >= 4x ``single`` and ahead of every transformers row."""
  by = {r['system']: r for r in rows if 'error' not in r}
  engine = by.get('engine')
  if engine is None:
    return []
  lines = []
  if 'single' in by:
    ratio = engine['vs_single']
    lines.append(f'  target engine >= 4x single ({concurrency or "open-loop"} concurrent): '
                 f'{ratio:.2f}x, {"met" if ratio >= 4 else "missed"}')
  hf = [r for r in rows if r['system'].startswith('hf-') and 'error' not in r]
  if hf:
    best = max(hf, key=lambda r: r['output_tokens_per_s'])
    ratio = engine['output_tokens_per_s'] / best['output_tokens_per_s']
    lines.append(f"  target engine ahead of transformers (best: {best['system']}): {ratio:.2f}x, "
                 f'{"met" if ratio > 1 else "missed"}')
  return lines


def main(argv: list[str] | None = None) -> int:
  """Command line entry point."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='cpu-tiny', choices=sorted(BENCH_CONFIGS))
  parser.add_argument('--systems', default=','.join(SYSTEMS),
                      help=f'comma-separated, of {",".join(SYSTEMS)} (default: all)')
  parser.add_argument('--num-requests', type=int, default=64)
  load = parser.add_mutually_exclusive_group()
  load.add_argument('--concurrency', type=int, default=16,
                    help='closed loop with this many clients (default 16)')
  load.add_argument('--rate', type=float, default=None,
                    help='open loop instead: Poisson arrivals, requests/s (inf: all at once)')
  parser.add_argument('--prompt-len', type=int, nargs=2, default=[16, 256], metavar=('LO', 'HI'))
  parser.add_argument('--output-len', type=int, nargs=2, default=[16, 128], metavar=('LO', 'HI'))
  parser.add_argument('--batch-size', type=int, default=16, help='static batches (default 16)')
  parser.add_argument('--max-batch', type=int, default=16, help='engine rows per step')
  parser.add_argument('--token-budget', type=int, default=256, help='engine tokens per step')
  parser.add_argument('--page-size', type=int, default=16)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--checkpoint', default=None,
                      help='Hugging Face directory to write the model to, or reuse (default: a '
                           'temporary one)')
  parser.add_argument('--hf-python', default=None,
                      help='python with torch and transformers (default: a venv made once in '
                           'benchmarks/.peer-envs/transformers)')
  parser.add_argument('--hf-threads', type=int, default=0, help='torch threads (0: every core)')
  parser.add_argument('--json', default=None, help='append one JSON line per system here')
  args = parser.parse_args(argv)
  run(get_config(args.config), name=args.config,
      systems=[s for s in args.systems.split(',') if s], num_requests=args.num_requests,
      concurrency=args.concurrency, rate=args.rate, prompt_lens=tuple(args.prompt_len),
      output_lens=tuple(args.output_len), batch_size=args.batch_size, max_batch=args.max_batch,
      token_budget=args.token_budget, page_size=args.page_size, seed=args.seed,
      checkpoint=args.checkpoint, hf_python_path=args.hf_python, hf_threads=args.hf_threads,
      json_path=args.json)
  return 0


if __name__ == '__main__':
  sys.exit(main())

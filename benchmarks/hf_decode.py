"""Decoding speed of ``maxnnx.generate`` against Hugging Face ``transformers`` on one checkpoint.

::

  python -m benchmarks.hf_decode --config cpu-tiny                    # batch 1 and 16, CPU
  python -m benchmarks.hf_decode --config gpu-1b --python python3     # a GPU image's torch

The torch side (``peers/_hf_generate.py``, in its own environment
``benchmarks/.peer-envs/transformers``, shared with ``benchmarks.serving``, or the interpreter
given by ``--python``) builds a random Llama of the
config's shapes, saves it as safetensors and times ``LlamaForCausalLM.generate``. maxnnx then
loads that very checkpoint with ``from_pretrained`` (parameters stored in the compute dtype, as
transformers holds them) and times ``maxnnx.generate`` on the same prompts. Both are greedy with
no early stop, and both are timed the way ``benchmarks.decode`` times: ``decode + 1`` new tokens
against 1 new token, the difference over ``decode`` is one decode step, each the median of
``--repeats`` calls after a warm-up. The table gives decode tokens/s of each, the ratio, and how
many of the first row's greedy tokens agree (all of them in float32: the check that both ran the
same model).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import measure, results
from benchmarks.configs import BENCH_CONFIGS, get_config
from benchmarks.decode import median_seconds
from benchmarks.peers import _common

INNER = Path(__file__).resolve().parent / 'peers' / '_hf_generate.py'


def step_times(batch: int, short_s: float, full_s: float, decode: int) -> dict:
  """Decode step and prefill seconds from the 1-token and ``decode + 1``-token timings."""
  step_s = max(full_s - short_s, 1e-12) / decode
  return {'decode_step_s': step_s, 'decode_tokens_per_s': batch / step_s,
          'prefill_s': max(short_s - step_s, 1e-12)}


def agreement(a: list[int], b: list[int]) -> int:
  """How many leading tokens of ``a`` and ``b`` agree."""
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def run_hf(cfg: dict, spec: dict, python: str) -> dict:
  """Run the torch side; returns its raw measurements."""
  out = Path(spec['out'])
  subprocess.run([python, str(INNER), json.dumps({**spec, 'cfg': cfg})], check=True)
  return json.loads(out.read_text())


def run(name: str, *, batches=(1, 16), prefill: int = 128, decode: int = 64,
        dtype: str | None = None, repeats: int = 3, python: str | None = None,
        threads: int = 0, json_path: str | None = None,
        log=print) -> list[dict]:
  """Benchmark both on config ``name``; returns one row per (framework, batch)."""
  cfg = get_config(name)
  if cfg['num_experts']:
    raise ValueError(f'{name} is an MoE config; hf_decode compares dense Llama configs only')
  if prefill < 1 or decode < 1 or repeats < 1:
    raise ValueError('--prefill, --decode and --repeats must be >= 1')
  from maxnnx import from_pretrained
  from maxnnx.inference import generate

  dtype = dtype or ('float32' if measure.on_cpu() else 'bfloat16')
  python = _common.transformers_python(python, log=log)
  rng = np.random.default_rng(0)
  prompts = {b: rng.integers(0, cfg['vocab_size'], (b, prefill)).tolist() for b in batches}
  with tempfile.TemporaryDirectory() as tmp:
    (Path(tmp) / 'prompts.json').write_text(json.dumps({str(b): p for b, p in prompts.items()}))
    spec = dict(checkpoint=str(Path(tmp) / 'ckpt'), prompts=str(Path(tmp) / 'prompts.json'),
                out=str(Path(tmp) / 'raw.json'), batches=list(batches), decode=decode,
                repeats=repeats, dtype=dtype, threads=threads,
                device='cuda' if not measure.on_cpu() else 'cpu',
                max_positions=prefill + decode + 1)
    log(f'{name}: transformers generate ({python}) ...')
    raw = run_hf(cfg, spec, python)
    model = from_pretrained(spec['checkpoint'], dtype=dtype, param_dtype=dtype)

  device = measure.device_description()
  log(f'{name}: batch {list(batches)}, prefill {prefill}, decode {decode}, {dtype}; {device}; '
      f'torch {raw["versions"]["torch"]} on {raw["device_name"]} ({raw["threads"]} threads)')
  rows, first_tokens = [], None
  for hf_row in raw['rows']:
    batch = hf_row['batch']
    ids = np.asarray(prompts[batch], np.int32)
    short = median_seconds(lambda ids=ids: generate(model, ids, 1, eos_ids=None), repeats)
    full = median_seconds(lambda ids=ids: generate(model, ids, decode + 1, eos_ids=None), repeats)
    if first_tokens is None:
      first_tokens = generate(model, ids, decode + 1, eos_ids=None).tokens[0].tolist()
    common = dict(kind='decode', config=name, dtype=dtype, batch=batch, prefill=prefill,
                  decode=decode, date=results.make_date(), command=results.current_command())
    rows.append({**common, 'framework': 'maxnnx', 'device': device,
                 **step_times(batch, short, full, decode), 'versions': measure.versions()})
    rows.append({**common, 'framework': 'transformers', 'device': device,
                 **step_times(batch, hf_row['short_s'], hf_row['full_s'], decode),
                 'versions': raw['versions']})
  same = agreement(first_tokens, raw['first_row_tokens'])
  for row in rows:
    row['greedy_tokens_agreeing'] = f'{same}/{decode + 1}'
  log(format_table(rows))
  log(f'  greedy tokens of the first row that agree: {same} of {decode + 1}')
  if json_path:
    for row in rows:
      _common.append_json_line(json_path, row)
    log(f'appended to {json_path}')
  return rows


def format_table(rows: list[dict]) -> str:
  """maxnnx next to transformers, one line per batch size."""
  by_batch: dict[int, dict[str, dict]] = {}
  for row in rows:
    by_batch.setdefault(row['batch'], {})[row['framework']] = row
  lines = [f"  {'batch':>5} {'maxnnx tok/s':>12} {'hf tok/s':>10} {'maxnnx/hf':>9} "
           f"{'maxnnx ms/step':>14} {'hf ms/step':>10} {'maxnnx prefill s':>16} "
           f"{'hf prefill s':>12}"]
  for batch, pair in sorted(by_batch.items()):
    m, h = pair['maxnnx'], pair['transformers']
    lines.append(
        f"  {batch:>5} {m['decode_tokens_per_s']:>12,.1f} {h['decode_tokens_per_s']:>10,.1f} "
        f"{m['decode_tokens_per_s'] / h['decode_tokens_per_s']:>8.2f}x "
        f"{m['decode_step_s'] * 1e3:>14.2f} {h['decode_step_s'] * 1e3:>10.2f} "
        f"{m['prefill_s']:>16.3f} {h['prefill_s']:>12.3f}")
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
  """Command line entry point."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', required=True, choices=sorted(BENCH_CONFIGS))
  parser.add_argument('--batch', type=int, nargs='+', default=[1, 16])
  parser.add_argument('--prefill', type=int, default=128, help='prompt tokens (default 128)')
  parser.add_argument('--decode', type=int, default=64, help='decode steps timed (default 64)')
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default=None,
                      help='compute, weight and KV-cache dtype (default float32 on CPU, bf16 GPU)')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--python', default=None,
                      help='an interpreter with torch and transformers; skips the peer venv')
  parser.add_argument('--threads', type=int, default=0, help='torch threads; 0 = its default')
  parser.add_argument('--json', default=None, help='append one JSON line per row here')
  args = parser.parse_args(argv)
  run(args.config, batches=args.batch, prefill=args.prefill, decode=args.decode,
      dtype=args.dtype, repeats=args.repeats, python=args.python,
      threads=args.threads, json_path=args.json)
  return 0


if __name__ == '__main__':
  sys.exit(main())

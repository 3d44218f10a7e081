"""Hugging Face transformers ``generate`` under the serving benchmark's load (runs in its own venv).

Started by ``benchmarks.serving`` as ``python _transformers_serving.py SPEC.json``. The spec holds
the checkpoint directory, the timed and warm-up requests, the arrivals and the systems to run
(``{"name": ..., "batch_size": ...}``); the measurements go to the spec's ``out`` path. Imports
torch, transformers and, from the project, only the plain-Python ``benchmarks.serving_load``
(the same requests, arrivals, serving loop and clock rules as the maxnnx systems).

Each batch is left-padded to its longest prompt (with an attention mask, so every row's
positions start at 0) and decoded greedily for its longest output; end-of-sequence ids are
switched off, so every request gets exactly its number of tokens. The first token's time is
when ``generate`` hands it to a streamer.
"""

import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import serving_load  # noqa: E402


class FirstTokenClock(BaseStreamer):
  """Records when ``generate`` streams its first new tokens (its first ``put`` is the prompt)."""

  def __init__(self):
    self.puts = 0
    self.first = None

  def put(self, value):
    self.puts += 1
    if self.puts == 2:
      self.first = time.perf_counter()

  def end(self):
    pass


def batch_runner(model, workload: serving_load.Workload):
  """``run_batch`` for ``serving_load.serve_in_batches``: one ``generate`` call per batch."""

  def run(indices):
    rows = [workload.prompts[i] for i in indices]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
      ids[r, width - len(row):] = torch.tensor(row)
      mask[r, width - len(row):] = 1
    new = max(workload.output_lens[i] for i in indices)
    clock = FirstTokenClock()
    with torch.inference_mode():
      out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           do_sample=False, pad_token_id=0, streamer=clock)
    generated = out[:, width:]
    if generated.shape[1] != new:
      raise RuntimeError(f'generate made {generated.shape[1]} tokens, {new} asked')
    return clock.first, [generated[r, :workload.output_lens[i]].tolist()
                         for r, i in enumerate(indices)]

  return run


def main(spec_path: str) -> None:
  """Run every system of the spec; write the records and versions to ``spec['out']``."""
  spec = json.loads(Path(spec_path).read_text())
  torch.set_num_threads(spec['threads'])
  model = AutoModelForCausalLM.from_pretrained(spec['checkpoint'], dtype=torch.float32)
  model.eval()
  model.generation_config.eos_token_id = None  # every request gets exactly its tokens
  model.generation_config.do_sample = False
  timed = serving_load.Workload(spec['prompts'], spec['output_lens'])
  warm = serving_load.Workload(spec['warmup_prompts'], spec['output_lens'])
  results = {}
  for system in spec['systems']:
    start = time.perf_counter()
    for workload in (warm, timed):
      arrivals = serving_load.Arrivals(len(workload), **spec['arrivals'])
      records = serving_load.serve_in_batches(workload, arrivals, system['batch_size'],
                                              batch_runner(model, workload))
      if workload is warm:
        warmup_s = time.perf_counter() - start
    results[system['name']] = {
        'warmup_s': warmup_s,
        'records': [dict(arrival=r.arrival, first=r.first, last=r.last, tokens=r.tokens)
                    for r in records]}
  versions = {'python': platform.python_version(), 'torch': torch.__version__,
              'transformers': transformers.__version__}
  Path(spec['out']).write_text(json.dumps({'versions': versions, 'threads': spec['threads'],
                                           'attn_implementation': model.config._attn_implementation,
                                           'systems': results}))


if __name__ == '__main__':
  main(sys.argv[1])

"""Batch-1 decoding speed of ``maxnnx.generate`` with speculative decoding.

::

  python -m benchmarks.speculative_decode --config cpu-tiny
  python -m benchmarks.speculative_decode --config cpu-medium --draft 2 4 8 --decode 64
  python -m benchmarks.speculative_decode --config cpu-tiny --engine --draft 2 4
  python -m benchmarks.speculative_decode --config cpu-medium --engine --draft-model cpu-tiny
  python -m benchmarks.speculative_decode --mtp --draft 1 2 3

The prompt is text with repetition: the first ``--prompt-chars`` characters of the shipped
Shakespeare corpus, as byte ids, ``--repeat`` times over. For plain decoding and for prompt
lookup with each ``--draft`` count it times ``generate`` (greedy, no early stop) with
``--decode`` new tokens and with 1 (the prefill), each the median of ``--repeats`` calls after
a warm-up call (which compiles); decode tokens/s is ``decode / (full - prefill)``. The model
is randomly initialised, so what it repeats (and so the acceptance rate) is its own; the
speculative rows check that their tokens equal plain decoding's.

With ``--engine`` it times the serving :class:`~maxnnx.serving.Engine` instead, one request at
a time (batch 1): an engine without speculation and one with ``speculative_method='ngram'``
per ``--draft`` count, each warmed up (every bucket compiled) first, prefix caching off so
that every call computes its prompt; decode tokens/s is
``(decode - 1) / (full - prefill)`` with ``max_tokens`` ``--decode`` and 1, medians of
``--repeats`` calls in which the settings take turns (a shared machine slows them alike).
``--draft-model`` adds an engine with ``speculative_method='draft_model'`` per ``--draft``
count, the draft model a config of :data:`~benchmarks.configs.BENCH_CONFIGS` (randomly
initialised, with the target's vocabulary: its drafts are mostly rejected, so the row shows
what drafting costs) or ``self`` (the target drafting for itself: every draft kept, the most
a draft model of the target's cost can give).

With ``--mtp`` (no ``--config``) the model is a tiny DeepSeek V3 (:data:`MTP_MODEL`: MLA, a
dense layer then routed experts, one multi-token-prediction module) trained first, with the
MTP loss, for ``--train-steps`` steps on random windows of the corpus (byte ids); then plain
decoding, prompt lookup and :class:`~maxnnx.inference.MTPDraft` with each ``--draft`` count
are timed as above, on the same prompt. A trained model, so the MTP module's acceptance rate
is that of a model that has learnt something about the text.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from flax import nnx

import maxnnx
from benchmarks import measure, results
from benchmarks.configs import BENCH_CONFIGS, get_config
from benchmarks.decode import median_seconds
from benchmarks.model import model_config
from maxnnx.config import MeshConfig
from maxnnx.inference import MTPDraft, PromptLookup, generate
from maxnnx.models.counting import num_params
from maxnnx.models.transformer import Transformer
from maxnnx.serving import Engine, SamplingParams
from maxnnx.train import TrainConfig, Trainer

CORPUS = Path(maxnnx.__file__).parent / 'data' / 'corpus' / 'tinyshakespeare.txt'


def repeated_prompt(chars: int, repeat: int) -> list[int]:
  """Byte ids of the corpus' first ``chars`` characters, ``repeat`` times over."""
  text = CORPUS.read_bytes()[:chars]
  return list(text) * repeat


# The --mtp model: DeepSeek V3's layout, small enough to train on a CPU in a few minutes.
MTP_MODEL = dict(preset='deepseek3-tiny', vocab_size=256, num_layers=3, d_model=96,
                 mlp_dim=256, mtp={'num_layers': 1},
                 moe={'first_k_dense_layers': 1, 'num_experts': 4, 'num_experts_per_tok': 2,
                      'mlp_dim': 128},
                 mla={'q_lora_rank': 48, 'kv_lora_rank': 32, 'qk_nope_head_dim': 32,
                      'qk_rope_head_dim': 16, 'v_head_dim': 32})
MTP_TRAIN = dict(global_batch_size=8, seq_len=128, learning_rate=3e-3, warmup_steps=20,
                 mtp_loss_scaling_factor=0.3)


def corpus_windows(batch: int, seq_len: int, seed: int = 0):
  """Endless ``[batch, seq_len + 1]`` byte-id windows of the corpus at random offsets."""
  data = np.frombuffer(CORPUS.read_bytes(), np.uint8).astype(np.int32)
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - seq_len - 1, batch)
    yield np.stack([data[s:s + seq_len + 1] for s in starts])


def trained_mtp_model(steps: int, max_length: int, dtype: str, log=print):
  """The :data:`MTP_MODEL` trained ``steps`` steps with the MTP loss (:data:`MTP_TRAIN`);
  returns the model and the last logged metrics."""
  spec = dict(MTP_MODEL)
  mcfg = maxnnx.get_preset(spec.pop('preset'), **spec,
                           max_position_embeddings=max(max_length, 1024))
  mcfg = mcfg.replace(runtime=mcfg.runtime.replace(dtype=dtype))
  train = {**MTP_TRAIN, 'warmup_steps': min(MTP_TRAIN['warmup_steps'], steps)}
  tcfg = TrainConfig(steps=steps, mesh=MeshConfig(data=1), log_every=max(steps // 5, 1),
                     **train)
  trainer = Trainer(Transformer(mcfg, rngs=nnx.Rngs(0)), tcfg,
                    data=corpus_windows(tcfg.global_batch_size, tcfg.seq_len))
  start = time.perf_counter()
  history = trainer.fit(log=log)
  log(f'trained {steps} steps in {time.perf_counter() - start:.0f} s')
  return trainer.model, history[-1]


def run(cfg: dict | None, *, name: str, drafts=(4,), prompt_chars: int = 200, repeat: int = 2,
        decode: int = 64, max_ngram: int = 3, dtype: str | None = None, repeats: int = 3,
        json_path: str | None = None, log=print, mtp_steps: int = 0) -> list[dict]:
  """Benchmark plain and prompt-lookup ``generate`` at batch 1 (and MTP drafts, with
  ``mtp_steps``: ``cfg`` is then ignored); one dict per setting."""
  if decode < 1 or repeats < 1 or repeat < 1 or prompt_chars < 1 or min(drafts) < 1:
    raise ValueError('--decode, --repeats, --repeat, --prompt-chars and --draft must be >= 1')
  if not mtp_steps and cfg['vocab_size'] < 256:
    raise ValueError(f"config {name} has vocab_size {cfg['vocab_size']}; byte ids need 256")
  dtype = dtype or ('float32' if measure.on_cpu() else 'bfloat16')
  prompt = repeated_prompt(prompt_chars, repeat)
  max_length = len(prompt) + decode + max(drafts) + 1
  extra = {}
  if mtp_steps:
    model, last = trained_mtp_model(mtp_steps, max_length, dtype, log)
    mcfg = model.config
    extra = {'train_steps': mtp_steps, 'train': MTP_TRAIN, 'model': MTP_MODEL,
             'final_loss': last.get('loss'), 'final_mtp_loss': last.get('mtp_loss')}
  else:
    mcfg = model_config(cfg, dtype=dtype, max_length=max_length)
    model = Transformer(mcfg, rngs=nnx.Rngs(0))
  device = measure.device_description()
  log(f'{name}: {num_params(mcfg):,} parameters, {dtype}, prompt {len(prompt)} tokens '
      f'({prompt_chars} characters x {repeat}), decode {decode}, batch 1; {device}')

  def timed(speculative):
    call = lambda n: generate(model, [prompt], n, eos_ids=None, speculative=speculative)  # noqa: E731
    prefill = median_seconds(lambda: call(1), repeats)
    full = median_seconds(lambda: call(decode), repeats)
    return call(decode), max(full - prefill, 1e-12)

  plain, plain_s = timed(None)
  settings = [('none', None, plain, plain_s)]
  for k in drafts:
    settings.append(('prompt_lookup', k,
                     *timed(PromptLookup(num_draft_tokens=k, max_ngram=max_ngram))))
  for k in drafts if mtp_steps else ():
    settings.append(('mtp', k, *timed(MTPDraft(num_draft_tokens=k))))
  rows = []
  for drafter, k, out, seconds in settings:
    rows.append({
        'kind': 'speculative_decode', 'framework': 'maxnnx', 'config': name, 'device': device,
        'dtype': dtype, 'batch': 1, 'prefill': len(prompt), 'decode': decode,
        'drafter': drafter, 'num_draft_tokens': k or 0,
        'max_ngram': max_ngram if drafter == 'prompt_lookup' else None, **extra,
        'decode_s': seconds, 'decode_tokens_per_s': (decode - 1) / seconds,
        'speedup': plain_s / seconds, 'acceptance_rate': out.acceptance_rate,
        'accepted_draft_tokens': out.accepted_draft_tokens,
        'proposed_draft_tokens': out.proposed_draft_tokens,
        'same_tokens': bool(np.array_equal(out.tokens, plain.tokens)),
        'date': results.make_date(), 'versions': measure.versions(),
        'command': results.current_command()})
  log(format_table(rows))
  if json_path:
    results.append_lines(json_path, rows)
    log(f'appended to {json_path}')
  return rows


def run_engine(cfg: dict, *, name: str, drafts=(4,), prompt_chars: int = 200, repeat: int = 2,
               decode: int = 64, max_ngram: int = 3, dtype: str | None = None,
               repeats: int = 3, page_size: int = 16, json_path: str | None = None,
               draft_model: str | None = None, log=print) -> list[dict]:
  """Benchmark the serving engine at batch 1 without and with n-gram speculation (and a
  draft model's, with ``draft_model``); one dict per setting (see the module docstring)."""
  if decode < 2 or repeats < 1 or repeat < 1 or prompt_chars < 1 or min(drafts) < 1:
    raise ValueError('--decode must be >= 2; --repeats, --repeat, --prompt-chars and --draft '
                     '>= 1')
  if cfg['vocab_size'] < 256:
    raise ValueError(f"config {name} has vocab_size {cfg['vocab_size']}; byte ids need 256")
  dtype = dtype or ('float32' if measure.on_cpu() else 'bfloat16')
  prompt = repeated_prompt(prompt_chars, repeat)
  max_len = len(prompt) + decode + max(drafts) + 1
  mcfg = model_config(cfg, dtype=dtype, max_length=max_len)
  model = Transformer(mcfg, rngs=nnx.Rngs(0))
  device = measure.device_description()
  log(f'{name}: {num_params(mcfg):,} parameters, {dtype}, prompt {len(prompt)} tokens '
      f'({prompt_chars} characters x {repeat}), decode {decode}, engine at batch 1; {device}')
  budget = 8
  while budget < len(prompt):
    budget *= 2
  pages = -(-max_len // page_size)
  settings = dict(max_batch=1, token_budget=budget, page_size=page_size, max_model_len=max_len,
                  prefix_caching=False, token_buckets=(8, budget), page_buckets=(pages,))

  draft = None
  if draft_model is not None:
    draft = model if draft_model == 'self' else Transformer(model_config(
        {**get_config(draft_model), 'vocab_size': cfg['vocab_size']}, dtype=dtype,
        max_length=max_len), rngs=nnx.Rngs(1))
  engines, warm_s = {}, {}
  for k in [None, *(('ngram', k) for k in drafts),
            *((('draft_model', k) for k in drafts) if draft is not None else ())]:
    spec = {} if k is None else dict(speculative_method=k[0], num_speculative_tokens=k[1],
                                      prompt_lookup_max=max_ngram)
    engines[k] = Engine(model, **settings, **spec,
                        draft_model=draft if k and k[0] == 'draft_model' else None)
    warm_s[k] = engines[k].warmup()

  def call(k, n):
    start = time.perf_counter()
    out = engines[k].generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    return out[0].token_ids, time.perf_counter() - start

  # Calls of every setting take turns, so that a machine shared with other work slows them
  # alike; each setting's first calls (untimed) settle it.
  for k in engines:
    call(k, 1)
    call(k, decode)
  prefill_s, full_s = ({k: [] for k in engines} for _ in range(2))
  for _ in range(repeats):
    for k in engines:
      prefill_s[k].append(call(k, 1)[1])
      full_s[k].append(call(k, decode)[1])
  runs = []
  for k, engine in engines.items():
    before = (engine.spec.draft_tokens, engine.spec.accepted_tokens)
    tokens = call(k, decode)[0]
    if engine.compiles.after_warmup:
      raise RuntimeError('the warm engine compiled while it was timed')
    seconds = max(statistics.median(full_s[k]) - statistics.median(prefill_s[k]), 1e-12)
    runs.append((k, tokens, seconds, engine.spec.draft_tokens - before[0],
                 engine.spec.accepted_tokens - before[1], warm_s[k]))
  plain = runs[0][1:3]
  rows = []
  for k, tokens, seconds, drafted, accepted, warm in runs:
    rows.append({
        'kind': 'speculative_decode_engine', 'framework': 'maxnnx', 'config': name,
        'device': device, 'dtype': dtype, 'batch': 1, 'prefill': len(prompt), 'decode': decode,
        'drafter': ('none' if k is None else 'prompt_lookup' if k[0] == 'ngram' else
                    f'draft:{draft_model}'), 'num_draft_tokens': k[1] if k else 0,
        'max_ngram': max_ngram if k and k[0] == 'ngram' else None, 'warmup_s': warm,
        'decode_s': seconds, 'decode_tokens_per_s': (decode - 1) / seconds,
        'speedup': plain[1] / seconds,
        'acceptance_rate': accepted / drafted if k and drafted else None,
        'accepted_draft_tokens': accepted, 'proposed_draft_tokens': drafted,
        'same_tokens': tokens == plain[0],
        'date': results.make_date(), 'versions': measure.versions(),
        'command': results.current_command()})
  log(format_table(rows))
  if json_path:
    results.append_lines(json_path, rows)
    log(f'appended to {json_path}')
  return rows


def format_table(rows: list[dict]) -> str:
  """The human-readable report."""
  lines = [f"  {'drafter':>14} {'k':>3} {'decode tok/s':>12} {'speedup':>7} {'accepted':>8} "
           f"{'same tokens':>11}"]
  for r in rows:
    rate = '-' if r['acceptance_rate'] is None else f"{r['acceptance_rate']:.1%}"
    lines.append(f"  {r['drafter']:>14} {r['num_draft_tokens']:>3} "
                 f"{r['decode_tokens_per_s']:>12,.1f} {r['speedup']:>6.2f}x {rate:>8} "
                 f"{str(r['same_tokens']):>11}")
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
  """Command line entry point."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', choices=sorted(BENCH_CONFIGS),
                      help='the model (required unless --mtp)')
  parser.add_argument('--draft', type=int, nargs='+', default=[4],
                      help='draft tokens per step to try (default 4)')
  parser.add_argument('--prompt-chars', type=int, default=200)
  parser.add_argument('--repeat', type=int, default=2, help='times the text repeats (default 2)')
  parser.add_argument('--decode', type=int, default=64, help='new tokens (default 64)')
  parser.add_argument('--max-ngram', type=int, default=3)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default=None)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--json', default=None, help='append one JSON line per setting here')
  parser.add_argument('--engine', action='store_true',
                      help='time the serving engine (batch 1) instead of generate')
  parser.add_argument('--draft-model', default=None,
                      help="with --engine: a config name (or 'self') drafting in the engine too")
  parser.add_argument('--mtp', action='store_true',
                      help='train the tiny DeepSeek V3 (MTP_MODEL) and time MTP drafts too')
  parser.add_argument('--train-steps', type=int, default=500,
                      help='training steps of the --mtp model (default 500)')
  args = parser.parse_args(argv)
  if args.mtp == bool(args.config) or (args.mtp and args.engine):
    parser.error('give --config, or --mtp (without --engine)')
  if args.draft_model is not None and (not args.engine or args.draft_model not in (
      'self', *BENCH_CONFIGS)):
    parser.error('--draft-model needs --engine, and a config name or self')
  common = dict(drafts=args.draft, prompt_chars=args.prompt_chars, repeat=args.repeat,
                decode=args.decode, max_ngram=args.max_ngram, dtype=args.dtype,
                repeats=args.repeats, json_path=args.json)
  if args.mtp:
    run(None, name='deepseek-mtp-tiny', mtp_steps=args.train_steps, **common)
  else:
    engine = dict(draft_model=args.draft_model) if args.engine else {}
    (run_engine if args.engine else run)(get_config(args.config), name=args.config, **common,
                                         **engine)
  return 0


if __name__ == '__main__':
  sys.exit(main())

"""Command line: ``maxnnx train [key=value ...]`` and ``maxnnx generate [key=value ...]``.

With no arguments ``maxnnx train`` trains the ``tiny`` preset on the shipped
Shakespeare corpus: it trains a sentencepiece tokenizer on the corpus (cached
in the output directory), runs the optimizer while printing loss and tokens/s,
writes ``metrics.jsonl``, ``loss.png`` and the trained model in Hugging Face
format (``final/``), and ends by printing a generated sample.
"""

import difflib
import json
import os
import sys

import numpy as np

TRAIN_KEYS = {
    'model': ('tiny', 'preset name to train from scratch (see maxnnx.list_presets())'),
    'data': ('', 'UTF-8 text file to train on (default: the shipped Shakespeare corpus)'),
    'output_dir': ('runs/tiny-shakespeare', 'where tokenizer, metrics, plot and model go'),
    'steps': (600, 'optimizer steps'),
    'global_batch_size': (16, 'sequences per step'),
    'seq_len': (128, 'tokens per sequence'),
    'learning_rate': (3e-3, 'peak learning rate (linear warmup, cosine decay)'),
    'warmup_steps': (-1, 'warmup steps (-1: 5% of steps)'),
    'weight_decay': (0.1, 'AdamW decoupled weight decay on matmul kernels'),
    'seed': (0, 'seed of init and data order'),
    'dtype': ('float32', 'compute dtype: float32 or bfloat16'),
    'eval_every': (100, 'evaluate held-out loss every N steps (0: only at the end)'),
    'log_every': (25, 'print a progress line every N steps'),
    'sample_tokens': (120, 'tokens of the sample printed at the end (0: none)'),
}
GENERATE_KEYS = {
    'output_dir': ('runs/tiny-shakespeare', 'a directory written by maxnnx train'),
    'prompt': ('ROMEO:', 'text to continue'),
    'max_new_tokens': (120, 'tokens to generate'),
    'temperature': (0.8, 'sampling temperature (0: greedy)'),
    'top_p': (0.95, 'nucleus sampling mass'),
    'seed': (0, 'sampling seed'),
}
COMMANDS = {'train': TRAIN_KEYS, 'generate': GENERATE_KEYS}


class UsageError(ValueError):
  """A bad command line: unknown command or key, or a value of the wrong type."""


def parse_overrides(args: list[str], keys: dict) -> dict:
  """``key=value`` strings -> typed values, defaults filled in."""
  values = {k: default for k, (default, _) in keys.items()}
  for arg in args:
    if '=' not in arg:
      raise UsageError(f"Expected key=value, got '{arg}'. Run with --help for the keys.")
    key, raw = arg.split('=', 1)
    if key not in keys:
      near = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.5)
      hint = f" Did you mean '{near[0]}'?" if near else ''
      raise UsageError(f"Unknown key '{key}'.{hint} Run with --help for the keys.")
    kind = type(keys[key][0])
    try:
      values[key] = kind(float(raw)) if kind is int and '.' not in raw else kind(raw)
    except ValueError:
      raise UsageError(f"{key}={raw!r}: expected {kind.__name__}.") from None
  return values


def _usage(command: str) -> str:
  lines = [f'usage: maxnnx {command} [key=value ...]', '']
  for key, (default, doc) in COMMANDS[command].items():
    lines.append(f'  {key:<18} {doc} (default: {default!r})')
  return '\n'.join(lines)


def _plot_loss(history: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot([m['step'] for m in history], [m['loss'] for m in history], label='train')
  evals = [m for m in history if 'eval_loss' in m]
  if evals:
    ax.plot([m['step'] for m in evals], [m['eval_loss'] for m in evals], 'o-', label='held-out')
  ax.set_xlabel('step')
  ax.set_ylabel('cross-entropy (nats/token)')
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def train(options: dict) -> dict:
  """Run ``maxnnx train`` with parsed ``options``; returns a summary dict."""
  from flax import nnx

  import maxnnx
  from maxnnx.data import DEFAULT_CORPUS, SentencePieceTokenizer, TokenWindows, train_sentencepiece
  from maxnnx.data.text import read_text
  from maxnnx.train import Trainer, default_optimizer

  out = options['output_dir']
  os.makedirs(out, exist_ok=True)
  corpus = options['data'] or DEFAULT_CORPUS
  text = read_text(corpus)
  if os.path.isdir(options['model']):
    # A pretrained checkpoint needs its own tokenizer; reading Hugging Face tokenizer
    # files is not supported yet, and a tokenizer trained here would scramble its ids.
    raise UsageError(f"model={options['model']} is a directory: fine-tuning a Hugging Face "
                     'checkpoint from the CLI needs its tokenizer, which is not supported yet. '
                     'Use a preset name, or maxnnx.from_pretrained + Trainer from Python.')
  cfg = maxnnx.get_preset(options['model'], dtype=options['dtype'])
  # Retrained on every run (under a second): a cached tokenizer could belong to another corpus.
  print(f'Training a {cfg.vocab_size}-token sentencepiece BPE tokenizer on {corpus} ...')
  tok_path = train_sentencepiece(corpus, os.path.join(out, 'tokenizer'), cfg.vocab_size)
  tokenizer = SentencePieceTokenizer(tok_path)
  if tokenizer.vocab_size > cfg.vocab_size:
    raise UsageError(f'The tokenizer has {tokenizer.vocab_size} tokens but model '
                     f"{options['model']} only {cfg.vocab_size}.")
  tokens = np.asarray(tokenizer.encode(text), np.int32)
  cfg = cfg.replace(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(options['seed']))
  data = TokenWindows(tokens, options['seq_len'], options['global_batch_size'],
                      seed=options['seed'])
  warmup = None if options['warmup_steps'] < 0 else options['warmup_steps']
  optimizer = default_optimizer(options['learning_rate'], options['steps'], warmup_steps=warmup,
                                weight_decay=options['weight_decay'])
  trainer = Trainer(model, optimizer, data)
  print(f"Training {options['model']} ({cfg.num_params():,} parameters) on {len(tokens):,} "
        f"tokens for {options['steps']} steps of {options['global_batch_size']} x "
        f"{options['seq_len']} tokens.")
  history = trainer.fit(options['steps'], eval_every=options['eval_every'] or options['steps'],
                        log_every=options['log_every'])
  with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:
    for metrics in history:
      f.write(json.dumps(metrics) + '\n')
  _plot_loss(history, os.path.join(out, 'loss.png'))
  maxnnx.save_pretrained(trainer.model, os.path.join(out, 'final'))
  with open(os.path.join(out, 'train_options.json'), 'w') as f:
    json.dump(options, f, indent=2)
  print(f"Wrote {out}/: tokenizer.model, metrics.jsonl, loss.png, final/ (Hugging Face format).")
  if options['sample_tokens']:
    print('\nSample:\n' + _sample(trainer.model, tokenizer, 'ROMEO:', options['sample_tokens'],
                                  0.8, 0.95, options['seed']))
  return {'first_loss': history[0]['loss'], 'last_loss': history[-1]['loss'],
          'eval_loss': history[-1].get('eval_loss')}


def _sample(model, tokenizer, prompt, max_new_tokens, temperature, top_p, seed) -> str:
  import maxnnx
  ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
  result = maxnnx.generate(model, [ids], max_new_tokens, temperature=temperature, top_p=top_p,
                           eos_ids=[tokenizer.eos_id], seed=seed)
  return prompt + tokenizer.decode(result.as_lists()[0])


def generate(options: dict) -> str:
  """Run ``maxnnx generate``: continue ``prompt`` with the model in ``output_dir``."""
  import maxnnx
  from maxnnx.data import SentencePieceTokenizer
  out = options['output_dir']
  model_dir, tok_path = os.path.join(out, 'final'), os.path.join(out, 'tokenizer.model')
  for path in (model_dir, tok_path):
    if not os.path.exists(path):
      raise UsageError(f'{path} is missing: is {out} a directory written by maxnnx train?')
  text = _sample(maxnnx.from_pretrained(model_dir), SentencePieceTokenizer(tok_path),
                 options['prompt'], options['max_new_tokens'], options['temperature'],
                 options['top_p'], options['seed'])
  print(text)
  return text


def main(argv: list[str] | None = None) -> int:
  """Entry point of ``maxnnx`` / ``python -m maxnnx``."""
  argv = sys.argv[1:] if argv is None else argv
  command = argv[0] if argv and not argv[0].startswith('-') else 'train'
  rest = argv[1:] if argv and argv[0] == command else argv
  if command not in COMMANDS:
    print(f"Unknown command '{command}'; use one of: {', '.join(COMMANDS)}.", file=sys.stderr)
    return 2
  if any(a in ('-h', '--help') for a in rest):
    print(_usage(command))
    return 0
  try:
    options = parse_overrides(rest, COMMANDS[command])
    {'train': train, 'generate': generate}[command](options)
  except (ValueError, FileNotFoundError) as e:  # UsageError, ConfigError, bad data files
    print(f'error: {e}', file=sys.stderr)
    return 2
  return 0



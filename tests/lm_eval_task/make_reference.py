"""Writes ``reference.json``: lm-evaluation-harness's own Hugging Face backend on ``tiny_mc``.

Run once by a maintainer, from the repository root, in an environment with torch,
transformers and ``lm_eval==0.4.13`` (not maxnnx's)::

  python tests/lm_eval_task/make_reference.py

``python tests/lm_eval_task/make_reference.py tokenizer`` (needs only ``tokenizers``) rewrites
``tokenizer/`` first, as it was made: a byte-level BPE of 256 tokens, ``<|endoftext|>`` first,
trained on the first 200,000 characters of the shipped corpus.

The checkpoint is the Llama parity fixture (``tests/fixtures/hf/llama``: 2 layers, 256
tokens, 64 positions) with the byte-level BPE tokenizer of ``tokenizer/`` (256 tokens trained on
the shipped corpus). The model runs in float32. The file holds, for each question, the
log-likelihood of every choice and the accuracies, and the rolling log-likelihoods of
``ROLLING_TEXTS`` (longer than the 64-token window, so several windows are scored).
"""

import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, '..', 'fixtures', 'hf', 'llama')
ROLLING_TEXTS = [
    'First Citizen: Before we proceed any further, hear me speak.',
    'We are accounted poor citizens, the patricians good. What authority surfeits on would '
    'relieve us: if they would yield us but the superfluity, while it were wholesome, we '
    'might guess they relieved us humanely; but they think we are too dear.',
    'O',
]


def model_dir(directory: str) -> str:
  """The fixture's weights and config with the task's tokenizer, in ``directory``."""
  for name in ('config.json', 'model.safetensors'):
    shutil.copy(os.path.join(FIXTURE, name), directory)
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(os.path.join(HERE, 'tokenizer', name), directory)
  return directory


def write_tokenizer() -> None:
  """``tokenizer/``: the BPE and a ``tokenizer_config.json`` naming its end-of-text token."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  corpus = os.path.join(HERE, '..', '..', 'maxnnx', 'data', 'corpus', 'tinyshakespeare.txt')
  with open(corpus, encoding='utf-8') as f:
    text = f.read()[:200_000]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=256,
                                                      special_tokens=['<|endoftext|>']))
  directory = os.path.join(HERE, 'tokenizer')
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'bos_token': '<|endoftext|>',
               'eos_token': '<|endoftext|>'}, f, indent=2)


def main() -> None:
  import lm_eval
  from lm_eval.api.instance import Instance
  from lm_eval.models.huggingface import HFLM
  from lm_eval.tasks import TaskManager
  with tempfile.TemporaryDirectory() as scratch:
    lm = HFLM(pretrained=model_dir(scratch), dtype='float32', batch_size=3, device='cpu')
    results = lm_eval.simple_evaluate(
        model=lm, tasks=['tiny_mc'], task_manager=TaskManager(include_path=HERE),
        log_samples=True)
    samples = []
    for sample in results['samples']['tiny_mc']:
      samples.append({'doc_id': sample['doc_id'],
                      'loglikelihoods': [float(r[0]) for r in sample['filtered_resps']],
                      'is_greedy': [bool(r[1]) for r in sample['filtered_resps']],
                      'acc': sample['acc'], 'acc_norm': sample['acc_norm']})
    rolling = lm.loglikelihood_rolling(
        [Instance('loglikelihood_rolling', {}, (text,), i) for i, text in enumerate(ROLLING_TEXTS)])
  metrics = results['results']['tiny_mc']
  out = {'lm_eval': lm_eval.__version__, 'max_length': lm.max_length,
         'acc': metrics['acc,none'], 'acc_norm': metrics['acc_norm,none'],
         'samples': sorted(samples, key=lambda s: s['doc_id']),
         'rolling': [{'text': text, 'loglikelihood': float(value)}
                     for text, value in zip(ROLLING_TEXTS, rolling)]}
  with open(os.path.join(HERE, 'reference.json'), 'w') as f:
    json.dump(out, f, indent=1)
  print(json.dumps({k: out[k] for k in ('acc', 'acc_norm', 'max_length')}))


if __name__ == '__main__':
  if sys.argv[1:] == ['tokenizer']:
    write_tokenizer()
  main()

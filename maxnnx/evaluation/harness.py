"""lm-evaluation-harness backend: a maxnnx model scored and sampled as the harness asks.

:class:`MaxnnxLM` is registered with the harness as ``maxnnx`` (importing this module
registers it), so ``lm_eval.simple_evaluate(model='maxnnx', model_args='pretrained=DIR')`` and
``maxnnx eval`` run any of its tasks on a Hugging Face checkpoint directory, or on a model
and tokenizer already in memory (``MaxnnxLM(model=..., tokenizer=...)``).

The numbers are those of the harness's own Hugging Face backend: the same tokenization
(context and continuation encoded as one string and split at the context's length, the
tokenizer's special tokens added as ``transformers`` adds them), the same truncation to the
last ``max_length + 1`` tokens, the same rolling windows for perplexity
(``lm_eval.utils.get_rolling_token_windows``) and the same stop-string handling for
generation. Log-probabilities are a float32 log-softmax of the model's logits, computed in
the checkpoint's dtype (or ``dtype=``). Requests are scored ``batch_size`` rows at a time,
longest first, right-padded to a multiple of 32 tokens so that few programs compile.
``batch_size=auto`` picks the largest power of two, up to the harness's ``max_batch_size``,
whose scoring pass at ``max_length`` tokens fits the device's memory as the compiler plans it
(:func:`auto_batch_size`): no trial runs, so nothing runs out of memory on the way.
"""

from __future__ import annotations

import functools
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
  handle_stop_sequences,
  has_bos_prefix,
  normalize_gen_kwargs,
  postprocess_generated_text,
)

from maxnnx.inference.generate import generate

logger = logging.getLogger(__name__)

LENGTH_BUCKET = 32  # scored rows are right-padded to a multiple of this many tokens
IGNORED_ARGS = ('device',)  # the harness passes it to every backend; JAX places the model
DEFAULT_MAX_BATCH_SIZE = 64  # the harness's own default for batch_size=auto
AUTO_MEMORY_FRACTION = 0.9  # of the device's memory an auto batch may plan to use


def _padded_width(length: int, limit: int) -> int:
  return min(-(-length // LENGTH_BUCKET) * LENGTH_BUCKET, limit)


@functools.partial(jax.jit, static_argnums=0)
def _token_scores(graphdef, state, ids_BT, targets_BT):
  """``(log p(target), target is the argmax)`` at every position, ``[B, T]`` each."""
  logits_BTV = nnx.merge(graphdef, state)(ids_BT).astype(jnp.float32)
  logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  chosen_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  return chosen_BT, jnp.argmax(logits_BTV, axis=-1) == targets_BT


def scoring_bytes(graphdef, state, batch: int, width: int) -> int:
  """Bytes one device needs to score ``batch`` rows of ``width`` tokens, as XLA plans it
  (arguments, outputs and temporaries of the compiled scoring pass; nothing runs)."""
  rows = jax.ShapeDtypeStruct((batch, width), jnp.int32)
  stats = _token_scores.lower(graphdef, state, rows, rows).compile().memory_analysis()
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def auto_batch_size(graphdef, state, width: int, max_batch_size: int,
                    memory_bytes: int | None = None) -> int:
  """The largest power of two up to ``max_batch_size`` (and ``max_batch_size`` itself) whose
  scoring pass at ``width`` tokens plans at most :data:`AUTO_MEMORY_FRACTION` of
  ``memory_bytes`` (default: the first device's memory); 1 when none does."""
  if memory_bytes is None:
    from maxnnx.train.memory import device_memory_limit  # noqa: PLC0415
    memory_bytes, _ = device_memory_limit(jax.devices()[0])
  if not memory_bytes:
    return max_batch_size
  candidates = [max_batch_size] + [2**k for k in range(max_batch_size.bit_length(), -1, -1)
                                   if 2**k < max_batch_size]
  for batch in candidates:
    if scoring_bytes(graphdef, state, batch, width) <= AUTO_MEMORY_FRACTION * memory_bytes:
      return batch
  return 1


def _batch_size_arg(value) -> int | str:
  """``batch_size`` as the harness passes it: a positive int, or ``auto`` (``auto:N``, the
  harness' periodic re-check, is taken as ``auto``: the widest row is sized once)."""
  if isinstance(value, str) and value.strip().lower().split(':')[0] == 'auto':
    return 'auto'
  return _positive_int('batch_size', value)


def _positive_int(name: str, value) -> int:
  try:
    number = int(value)
  except (TypeError, ValueError):
    number = 0
  if number < 1 or str(number) != str(value).strip():
    raise ValueError(f'{name}={value!r}: expected a positive integer.')
  return number


@register_model('maxnnx')
class MaxnnxLM(TemplateLM):
  """A maxnnx :class:`~maxnnx.Transformer` as an lm-evaluation-harness model.

  Args:
    pretrained: a Hugging Face checkpoint directory (or URL) with its tokenizer; not needed
      when ``model`` and ``tokenizer`` are given.
    model: a loaded :class:`~maxnnx.Transformer` (instead of ``pretrained``).
    tokenizer: its tokenizer (:func:`maxnnx.data.load_tokenizer`), with ``model``.
    dtype: compute dtype of a model loaded from ``pretrained`` (default: the checkpoint's).
    batch_size: rows scored (or prompts generated) in one forward pass, or ``auto``: the
      most that fit the device at ``max_length`` tokens (:func:`auto_batch_size`).
    max_batch_size: the most ``auto`` may pick (default 64, as the harness's).
    max_length: the longest sequence scored, in tokens (default: the model's
      ``max_position_embeddings``, as the Hugging Face backend reads it).
    max_gen_toks: tokens generated when a task gives no ``max_gen_toks``.
    add_bos_token: add the tokenizer's special tokens to every context (``None``: as the
      tokenizer does by default, like ``transformers``).
    tensor_parallel: devices a model loaded from ``pretrained`` is sharded over (its heads
      and MLP width, :func:`maxnnx.sharding.tensor_parallel_mesh`; 1: the default device).
    **kwargs: ``device``, which the harness passes to every backend, is ignored (JAX places
      the model); any other key is an error.

  Raises:
    ValueError: a bad ``batch_size`` / ``max_length``, an unknown argument, neither
      ``pretrained`` nor ``model``, or a tokenizer with neither a BOS nor an EOS token.
  """

  def __init__(self, pretrained: str = '', *, model=None, tokenizer=None,
               dtype: str | None = None, batch_size: int | str = 8,
               max_batch_size: int | str | None = None,
               max_length: int | str | None = None, max_gen_toks: int | str = 256,
               add_bos_token: bool | None = None, tensor_parallel: int | str = 1, **kwargs):
    super().__init__()
    unknown = sorted(set(kwargs) - set(IGNORED_ARGS))
    if unknown:
      raise ValueError(f'model_args {unknown[0]}=: not an argument of the maxnnx backend; it '
                       'takes pretrained, dtype, batch_size, max_batch_size, max_length, '
                       'max_gen_toks, add_bos_token, tensor_parallel.')
    batch_size = _batch_size_arg(batch_size)
    max_batch_size = _positive_int('max_batch_size', max_batch_size or DEFAULT_MAX_BATCH_SIZE)
    self._max_length = _positive_int('max_length', max_length) if max_length else None
    self.max_gen_toks = _positive_int('max_gen_toks', max_gen_toks)
    self.add_bos_token = add_bos_token
    tensor_parallel = _positive_int('tensor_parallel', tensor_parallel)
    if model is None:
      if not pretrained:
        raise ValueError('pretrained=: the maxnnx backend needs a Hugging Face checkpoint '
                         'directory with its tokenizer (or model= and tokenizer= objects).')
      from maxnnx.data import load_tokenizer  # noqa: PLC0415
      from maxnnx.models.pretrained import from_pretrained  # noqa: PLC0415
      from maxnnx.paths import local_model_dir  # noqa: PLC0415
      from maxnnx.sharding import tensor_parallel_mesh  # noqa: PLC0415
      mesh = tensor_parallel_mesh(tensor_parallel)
      directory = local_model_dir(pretrained)
      model = from_pretrained(directory, dtype=dtype or None, mesh=mesh)
      tokenizer = tokenizer if tokenizer is not None else load_tokenizer(directory)
    elif tokenizer is None:
      raise ValueError('tokenizer=: a model given as an object needs its tokenizer too.')
    self.model, self.tokenizer = model, tokenizer
    self._max_length = self._max_length or model.config.max_position_embeddings
    if tokenizer.eos_id is None and tokenizer.bos_id is None:
      raise ValueError('tokenizer: the harness needs an end-of-text (or BOS) token; give the '
                       "checkpoint's tokenizer_config.json an eos_token.")
    self._graphdef, self._state = nnx.split(model)
    if batch_size == 'auto':
      batch_size = auto_batch_size(self._graphdef, self._state, self.max_length, max_batch_size)
      logger.info('batch_size=auto: %d rows of %d tokens fit the device.', batch_size,
                  self.max_length)
    self.batch_size = batch_size

  @property
  def eot_token_id(self) -> int:
    """The end-of-text id (EOS; BOS when the tokenizer has no EOS)."""
    eos = self.tokenizer.eos_id
    return eos if eos is not None else self.tokenizer.bos_id

  @property
  def prefix_token_id(self) -> int:
    """What an empty context (and a rolling window's first token) is conditioned on: BOS,
    else EOS."""
    bos = self.tokenizer.bos_id
    return bos if bos is not None else self.tokenizer.eos_id

  @property
  def max_length(self) -> int:
    """The longest sequence scored, in tokens."""
    return self._max_length

  @property
  def tokenizer_name(self) -> str:
    """A name of the tokenizer, for the harness's cache keys."""
    return str(getattr(self.tokenizer, 'path', type(self.tokenizer).__name__))

  def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                 left_truncate_len: int | None = None, **kwargs) -> list[int]:
    """``string`` as ids, with the tokenizer's special tokens as ``transformers`` adds them
    (``add_special_tokens``; ``None``: by ``add_bos_token``, else the tokenizer's default,
    and never before a string that starts with the prefix token's text)."""
    special = add_special_tokens
    if special is None:
      special = True if self.add_bos_token is None else self.add_bos_token
      if has_bos_prefix(string, self.tok_decode([self.prefix_token_id])):
        special = False
    backend = getattr(self.tokenizer, 'backend', None)  # a tokenizer.json's post-processor
    if backend is not None and hasattr(backend, 'post_processor'):
      ids = backend.encode(string, add_special_tokens=special).ids
    else:
      ids = self.tokenizer.encode(string)
      if special and self.tokenizer.bos_id is not None:
        ids = [self.tokenizer.bos_id, *ids]
    return ids[-left_truncate_len:] if left_truncate_len else ids

  def tok_decode(self, tokens, skip_special_tokens: bool = False) -> str:
    """``tokens`` as text (``skip_special_tokens`` drops the end-of-text and BOS ids)."""
    ids = [int(t) for t in np.atleast_1d(tokens)]
    if skip_special_tokens:
      ids = [t for t in ids if t not in (self.tokenizer.eos_id, self.tokenizer.bos_id)]
    return self.tokenizer.decode(ids)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                            override_bs: int | None = None) -> list[tuple[float, bool]]:
    """``(sum of the continuation's log-probabilities, greedy decoding gives it)`` for each
    ``(request, context ids, continuation ids)``, in order."""
    del disable_tqdm, override_bs
    order = sorted(range(len(requests)),
                   key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    limit = self.max_length
    for start in range(0, len(order), self.batch_size):
      chunk = order[start:start + self.batch_size]
      rows = []
      for i in chunk:
        _, context, continuation = requests[i]
        if not context or not continuation:
          raise ValueError('loglikelihood: a request has an empty context or continuation '
                           'after tokenization.')
        rows.append((list(context) + list(continuation))[-(limit + 1):])
      width = _padded_width(max(len(r) - 1 for r in rows), limit)
      ids = np.zeros((self.batch_size, width), np.int32)
      targets = np.zeros((self.batch_size, width), np.int32)
      for r, row in enumerate(rows):
        ids[r, :len(row) - 1], targets[r, :len(row) - 1] = row[:-1], row[1:]
      chosen, greedy = jax.device_get(_token_scores(self._graphdef, self._state,
                                                    jnp.asarray(ids), jnp.asarray(targets)))
      for r, i in enumerate(chunk):
        request, _, continuation = requests[i]
        end = len(rows[r]) - 1
        span = slice(end - len(continuation), end)
        answer = (float(np.sum(chosen[r, span], dtype=np.float64)), bool(greedy[r, span].all()))
        results[i] = answer
        if request is not None:
          self.cache_hook.add_partial('loglikelihood', request, answer)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """The log-likelihood of each whole text, scored in disjoint windows of ``max_length``
    tokens, each window conditioned on the tokens before it (the first on the prefix
    token), as the Hugging Face backend scores perplexity."""
    windows, counts = [], []
    for (text,) in (request.args for request in requests):
      pairs = [lm_utils.make_disjoint_window(pair) for pair in lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1)]
      windows += [(None, context, target) for context, target in pairs]
      counts.append(len(pairs))
    scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
    totals, start = [], 0
    for request, count in zip(requests, counts):
      totals.append(sum(score for score, _ in scores[start:start + count]))
      start += count
      self.cache_hook.add_partial('loglikelihood_rolling', request.args, totals[-1])
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each context continued (greedily unless the task samples) by up to ``max_gen_toks``
    tokens, cut before the first of its ``until`` strings or the end-of-text token."""
    del disable_tqdm
    groups: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
      groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
    outputs: list[str | None] = [None] * len(requests)
    eot_text = self.tok_decode([self.eot_token_id])
    for indices in groups.values():
      kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
      until = handle_stop_sequences(kwargs.pop('until', None), eos=eot_text)
      max_gen_toks = kwargs.pop('max_gen_toks')
      context_limit = self.max_length - max_gen_toks
      if context_limit < 1:
        raise ValueError(f'max_gen_toks={max_gen_toks} leaves no room for a context in '
                         f'max_length={self.max_length} tokens; lower max_gen_toks.')
      temperature = float(kwargs.get('temperature') or 0.0) if kwargs.get('do_sample') else 0.0
      for start in range(0, len(indices), self.batch_size):
        chunk = indices[start:start + self.batch_size]
        prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=context_limit)
                   for i in chunk]
        result = generate(self.model, prompts, max_gen_toks, temperature=temperature,
                          top_k=kwargs.get('top_k'), top_p=kwargs.get('top_p'),
                          eos_ids=[self.eot_token_id], seed=int(kwargs.get('seed', 0) or 0))
        for i, tokens in zip(chunk, result.as_lists()):
          text = self.tok_decode(tokens, skip_special_tokens=True)
          outputs[i] = postprocess_generated_text(text, until, None)
          self.cache_hook.add_partial('generate_until', requests[i].args, outputs[i])
    return outputs



def task_names(tasks: str, include_path: str = '') -> tuple[list[str], object]:
  """``(the names in tasks, a TaskManager that knows them)``.

  Raises:
    ValueError: no task named, or a name neither the harness nor ``include_path`` defines
      (with the nearest names).
  """
  import difflib  # noqa: PLC0415

  from lm_eval.tasks import TaskManager  # noqa: PLC0415
  names = [name.strip() for name in tasks.split(',') if name.strip()]
  if not names:
    raise ValueError('tasks=: name at least one lm-evaluation-harness task, e.g. '
                     'tasks=hellaswag,arc_easy.')
  manager = TaskManager(include_path=include_path or None)
  known = set(manager.all_tasks)
  for name in names:
    if name not in known:
      near = difflib.get_close_matches(name, sorted(known), n=3)
      hint = f" (nearest: {', '.join(near)})" if near else ''
      where = f' nor in include_path={include_path}' if include_path else \
          '; give include_path=<directory of task YAMLs> for your own'
      raise ValueError(f"tasks={name}: no such task in lm-evaluation-harness{where}{hint}.")
  return names, manager


def evaluate_tasks(model_dir: str, tasks: str, *, include_path: str = '', output: str = '',
                   batch_size: int | str = 8, limit: float | None = None,
                   dtype: str | None = None,
                   num_fewshot: int | None = None, max_length: int | None = None,
                   seed: int = 0, tensor_parallel: int = 1) -> dict:
  """Run lm-evaluation-harness ``tasks`` on the checkpoint in ``model_dir`` with this backend.

  Args:
    model_dir: a Hugging Face checkpoint directory (or URL) with its tokenizer.
    tasks: task names, comma-separated.
    include_path: a directory of the caller's own task YAML files.
    output: where the results JSON and per-sample logs go, as the harness's
      ``EvaluationTracker`` writes them (``<output>/<model>/results_<time>.json`` and
      ``samples_<task>_<time>.jsonl``); empty: nothing is written.
    batch_size: rows in one forward pass, or ``auto`` (:func:`auto_batch_size`).
    limit: documents per task at most (a fraction below 1); ``None``: all.
    dtype: compute dtype (``None``: the checkpoint's).
    num_fewshot: examples in each prompt (``None``: the task's own).
    max_length: the longest sequence scored (``None``: the model's positions).
    seed: the harness's seeds (Python, NumPy, few-shot sampling).
    tensor_parallel: devices the model is sharded over.

  Returns:
    The harness's results (``results``, ``configs``, ``samples``...), for
    ``lm_eval.utils.make_table``.
  """
  import lm_eval  # noqa: PLC0415
  from lm_eval.loggers import EvaluationTracker  # noqa: PLC0415
  names, manager = task_names(tasks, include_path)
  args = {'pretrained': model_dir, 'tensor_parallel': tensor_parallel}
  if dtype:
    args['dtype'] = dtype
  if max_length:
    args['max_length'] = max_length
  tracker = EvaluationTracker(output_path=output) if output else None
  results = lm_eval.simple_evaluate(
      model='maxnnx', model_args=args, tasks=names, num_fewshot=num_fewshot,
      batch_size=batch_size, limit=limit, task_manager=manager, log_samples=True,
      evaluation_tracker=tracker, random_seed=seed, numpy_random_seed=seed,
      fewshot_random_seed=seed)
  if tracker is not None:
    samples = results['samples']
    rest = {key: value for key, value in results.items() if key != 'samples'}
    tracker.save_results_aggregated(results=rest, samples=samples)
    for name in results['configs']:
      tracker.save_results_samples(task_name=name, samples=samples[name])
  return results


def text_loss(lm: MaxnnxLM, texts: list[str]) -> tuple[float, int]:
  """``(mean negative log-likelihood per token, tokens scored)`` of ``texts``, each scored
  whole in rolling windows (:meth:`MaxnnxLM.loglikelihood_rolling`)."""
  from lm_eval.api.instance import Instance  # noqa: PLC0415
  texts = [text for text in texts if text]
  if not texts:
    raise ValueError('data=: no text to score (empty file, or no non-empty text fields).')
  scores = lm.loglikelihood_rolling([Instance('loglikelihood_rolling', {}, (text,), i)
                                     for i, text in enumerate(texts)])
  tokens = sum(len(lm.tok_encode(text)) for text in texts)
  return -float(np.sum(scores)) / tokens, tokens


__all__ = ['MaxnnxLM', 'evaluate_tasks', 'task_names', 'text_loss']

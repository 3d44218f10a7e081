"""The lm-evaluation-harness backend (``maxnnx.evaluation.harness``) and ``maxnnx eval`` give
the harness's own Hugging Face backend's numbers.

``tests/lm_eval_task/reference.json`` holds lm-eval 0.4.13's HF backend on the Llama parity
fixture with the task's tokenizer, in float32 (``tests/lm_eval_task/make_reference.py``).
"""

import contextlib
import functools
import io
import json
import os
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip('lm_eval')

from lm_eval.api.instance import Instance  # noqa: E402

import maxnnx  # noqa: E402
from maxnnx import cli  # noqa: E402
from maxnnx.evaluation.harness import MaxnnxLM  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_DIR = os.path.join(ROOT, 'tests', 'lm_eval_task')
FIXTURE = os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'llama')


def reference() -> dict:
  """The harness's HF backend's numbers on ``tiny_mc`` and the rolling texts."""
  with open(os.path.join(TASK_DIR, 'reference.json')) as f:
    return json.load(f)


@pytest.fixture(scope='session')
def lm_eval_model_dir(tmp_path_factory):
  """The Llama parity fixture with the task's 256-token tokenizer."""
  directory = tmp_path_factory.mktemp('lm_eval_model')
  for name in ('config.json', 'model.safetensors'):
    shutil.copy(os.path.join(FIXTURE, name), directory / name)
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(os.path.join(TASK_DIR, 'tokenizer', name), directory / name)
  return str(directory)


@pytest.fixture(scope='module')
def lm(lm_eval_model_dir):
  return MaxnnxLM(lm_eval_model_dir, dtype='float32', batch_size=3)


def _requests(kind, args):
  return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _eval(*args):
  """``maxnnx eval`` in this process: ``(exit status, stdout, stderr)``."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    status = cli.main(['eval', *args])
  return status, out.getvalue(), err.getvalue()


def test_maxnnx_eval_gives_the_hf_backends_loglikelihoods_and_accuracies(
    lm_eval_model_dir, tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)  # the task's data_files are relative to the repository root
  want = reference()
  status, out, err = _eval(f'model={lm_eval_model_dir}', 'tasks=tiny_mc',
                           f'include_path={TASK_DIR}', f'output={tmp_path}', 'batch_size=3',
                           'dtype=float32')
  assert status == 0, err
  assert re.search(r'\|tiny_mc\s*\|.*\|acc\s*\|.*\|\s*0\.25\d*\|', out), out
  (results,) = tmp_path.glob('*/results_*.json')
  (samples_file,) = tmp_path.glob('*/samples_tiny_mc_*.jsonl')
  with open(results) as f:
    assert json.load(f)['results']['tiny_mc']['acc_norm,none'] == want['acc_norm']
  with open(samples_file) as f:
    got = sorted((json.loads(line) for line in f), key=lambda s: s['doc_id'])
  assert [s['doc_id'] for s in got] == [s['doc_id'] for s in want['samples']]
  for sample, expected in zip(got, want['samples']):
    np.testing.assert_allclose([float(r[0]) for r in sample['filtered_resps']],
                               expected['loglikelihoods'], rtol=1e-4)
    assert [r[1] in (True, 'True') for r in sample['filtered_resps']] == expected['is_greedy']
    assert (sample['acc'], sample['acc_norm']) == (expected['acc'], expected['acc_norm'])


def test_maxnnx_eval_data_prints_the_loss_per_token(lm_eval_model_dir, lm, tmp_path):
  want = reference()['rolling']
  data = tmp_path / 'texts.jsonl'
  data.write_text(''.join(json.dumps({'text': w['text']}) + '\n' for w in want))
  tokens = sum(len(lm.tok_encode(w['text'])) for w in want)
  loss = -sum(w['loglikelihood'] for w in want) / tokens
  status, out, err = _eval(f'model={lm_eval_model_dir}', f'data={data}', 'dtype=float32')
  assert status == 0, err
  printed = re.search(r'(\d+) tokens, loss ([\d.]+), perplexity ([\d.]+)', out)
  assert int(printed[1]) == tokens
  np.testing.assert_allclose(float(printed[2]), loss, rtol=1e-3)
  np.testing.assert_allclose(float(printed[3]), np.exp(loss), rtol=1e-3)


@pytest.mark.parametrize('args, message', [
    (['tasks=tiny_mcq', f'include_path={TASK_DIR}'], 'tasks=tiny_mcq: no such task'),
    ([], 'eval needs tasks='),
    (['tasks=tiny_mc', 'data=x.txt'], 'not both'),
    (['tasks=tiny_mc', 'batch_size=two'], 'batch_size'),
    (['tasks=tiny_mc', 'include_path=/no/such/dir'], 'include_path=/no/such/dir'),
    (['tasks=tiny_mc', 'taks=x'], "unknown key 'taks'"),
])
def test_bad_eval_commands_are_one_line(lm_eval_model_dir, args, message):
  status, _, err = _eval(f'model={lm_eval_model_dir}', *args)
  assert status == 2 and message in err and err.count('\n') == 1, err


def test_without_lm_eval_eval_names_the_extra(lm_eval_model_dir, monkeypatch):
  monkeypatch.setitem(sys.modules, 'lm_eval', None)
  status, _, err = _eval(f'model={lm_eval_model_dir}', 'tasks=tiny_mc')
  assert status == 2 and "pip install 'maxnnx[eval]'" in err, err


def test_rolling_loglikelihood_scores_windows_as_the_hf_backend(lm):
  want = reference()['rolling']
  assert lm.max_length == 64
  long_text = want[1]['text']
  assert len(lm.tok_encode(long_text)) > lm.max_length  # two windows at least
  got = lm.loglikelihood_rolling(_requests('loglikelihood_rolling',
                                           [(w['text'],) for w in want]))
  np.testing.assert_allclose(got, [w['loglikelihood'] for w in want], rtol=1e-4)


@functools.partial(jax.jit, static_argnums=0)
def _next_tokens(graphdef, state, ids_BT):
  return jnp.argmax(nnx.merge(graphdef, state)(ids_BT).astype(jnp.float32), axis=-1)


def test_a_model_sharded_over_two_devices_scores_the_same(lm_eval_model_dir):
  sharded = MaxnnxLM(lm_eval_model_dir, dtype='float32', tensor_parallel=2)
  kernel = sharded.model.layers[0].attn.q_proj.kernel[...]
  assert len(kernel.sharding.device_set) == 2
  want = reference()['rolling']
  got = sharded.loglikelihood_rolling(_requests('loglikelihood_rolling',
                                                [(w['text'],) for w in want]))
  np.testing.assert_allclose(got, [w['loglikelihood'] for w in want], rtol=1e-4)


def _greedy_by_forward_passes(model, ids, steps, eos):
  """Greedy continuation of ``ids``: one full forward pass (no cache) per token over a
  right-padded row of ``max_position_embeddings`` tokens, read at the last real token."""
  graphdef, state = nnx.split(model)
  width = model.config.max_position_embeddings
  ids, out = list(ids), []
  for _ in range(steps):
    row = np.zeros((1, width), np.int32)
    row[0, :len(ids)] = ids
    token = int(_next_tokens(graphdef, state, row)[0, len(ids) - 1])
    if token == eos:
      break
    out.append(token)
    ids.append(token)
  return out


def test_generate_until_is_the_greedy_continuation_cut_at_the_stop_string(lm):
  contexts = ['Question: Where do the fish live?\nAnswer:', 'ROMEO: O', 'To be']
  greedy = [_greedy_by_forward_passes(lm.model, lm.tok_encode(c), 10, lm.eot_token_id)
            for c in contexts]
  texts = [lm.tokenizer.decode(ids) for ids in greedy]
  stop = texts[0][len(texts[0]) // 2:][:2]  # a stop string inside the first continuation
  got = lm.generate_until(_requests('generate_until', [
      (c, {'until': [stop], 'max_gen_toks': 10, 'do_sample': False}) for c in contexts]))
  assert got == [t.split(stop)[0] for t in texts]
  assert got[0] != texts[0]


def test_the_greedy_flag_is_true_only_for_the_greedy_continuation(lm):
  context = lm.tok_encode('ROMEO: What light')
  greedy = _greedy_by_forward_passes(lm.model, context, 6, lm.eot_token_id)
  other = greedy[:-1] + [(greedy[-1] + 1) % lm.model.config.vocab_size]
  (score, is_greedy), (other_score, other_greedy) = lm._loglikelihood_tokens(
      [(None, context, greedy), (None, context, other)])
  assert is_greedy and not other_greedy
  assert score > other_score


@pytest.mark.parametrize('args, field', [
    ({'batch_size': 'most'}, 'batch_size'),
    ({'batch_size': 0}, 'batch_size'),
    ({'batch_size': 'auto', 'max_batch_size': 'x'}, 'max_batch_size'),
    ({'max_length': 'long'}, 'max_length'),
    ({'temperature': 1}, 'temperature'),
])
def test_bad_model_args_name_the_field(lm_eval_model_dir, args, field):
  with pytest.raises(ValueError, match=field):
    MaxnnxLM(lm_eval_model_dir, **args)


def test_auto_batch_size_is_the_largest_that_the_compiler_plans_to_fit(lm):
  """``auto_batch_size`` against the planned bytes of each batch: the largest power of two
  (or the cap itself) under 90% of the memory, 1 when nothing fits."""
  from maxnnx.evaluation.harness import auto_batch_size, scoring_bytes
  graphdef, state, width = lm._graphdef, lm._state, lm.max_length
  need = {b: scoring_bytes(graphdef, state, b, width) for b in (1, 4, 8)}
  assert need[1] < need[4] < need[8]
  between = (need[4] + need[8]) / 2 / 0.9
  assert auto_batch_size(graphdef, state, width, 64, memory_bytes=between) == 4
  assert auto_batch_size(graphdef, state, width, 6, memory_bytes=10 * need[8]) == 6
  assert auto_batch_size(graphdef, state, width, 64, memory_bytes=need[1] / 2) == 1


def test_batch_size_auto_scores_as_a_fixed_batch(lm_eval_model_dir, lm):
  """``batch_size=auto`` (and the harness' ``auto:N``) up to ``max_batch_size``: on this
  host every batch fits, so it takes the cap, and the scores equal batch 3's."""
  auto = MaxnnxLM(lm_eval_model_dir, dtype='float32', batch_size='auto:4', max_batch_size=5)
  assert auto.batch_size == 5
  pairs = [(context, continuation) for doc in _tiny_mc_requests()[:2]
           for context, continuation in doc]
  requests = _requests('loglikelihood', pairs)
  np.testing.assert_allclose([s for s, _ in auto.loglikelihood(requests)],
                             [s for s, _ in lm.loglikelihood(requests)], rtol=1e-6)
  from maxnnx.config.commands import EvalConfig
  assert EvalConfig(batch_size='auto').batch_size == 'auto'
  with pytest.raises(Exception, match='batch_size'):
    EvalConfig(batch_size='big')


def test_a_model_object_needs_its_tokenizer(lm):
  with pytest.raises(ValueError, match='tokenizer='):
    MaxnnxLM(model=lm.model)
  assert isinstance(MaxnnxLM(model=lm.model, tokenizer=lm.tokenizer).model, maxnnx.Transformer)


# -- through the server ----------------------------------------------------------------------

SERVED = 'tiny-llama'


@pytest.fixture(scope='module')
def served(lm_eval_model_dir):
  """``maxnnx serve``'s app over the checkpoint, run by the server tests' uvicorn helper."""
  from maxnnx.serving.server import make_app
  from tests.test_serving_server import SERVER_ENGINE, _running, _wait_until_ready
  engine = {**SERVER_ENGINE, 'max_model_len': 64, 'page_buckets': (8,)}
  with _running(make_app(lm_eval_model_dir, model_name=SERVED, **engine)) as (url, _):
    _wait_until_ready(url)
    yield url


def _tiny_mc_requests():
  """``(context, continuation)`` of every choice of every question, as the task builds them
  (the harness puts its target delimiter, a space, before each choice)."""
  with open(os.path.join(TASK_DIR, 'tiny_mc.jsonl')) as f:
    docs = [json.loads(line) for line in f]
  return [[(f"Question: {doc['question']}\nAnswer:", ' ' + choice) for choice in doc['choices']]
          for doc in docs]


def test_local_completions_requests_to_the_server_give_the_hf_backends_loglikelihoods(
    served, lm):
  """lm-eval's ``local-completions`` model scores through ``/v1/completions``: the harness's
  own payload (token-id prompts, ``echo``, ``logprobs=1``, ``max_tokens=1``) and its own
  parsing give the reference log-likelihoods. (Its client needs ``tenacity``; the request and
  the parsing are lm-eval's code, sent here with httpx.)"""
  import types

  import httpx
  from lm_eval.models.openai_completions import LocalCompletionsAPI
  want = reference()['samples']
  harness = types.SimpleNamespace(model=SERVED)
  for doc, expected in zip(_tiny_mc_requests(), want):
    pairs = [lm._encode_pair(context, continuation) for context, continuation in doc]
    payload = LocalCompletionsAPI._create_payload(harness, [c + x for c, x in pairs])
    assert payload['echo'] is True and payload['max_tokens'] == 1 and payload['logprobs'] == 1
    response = httpx.post(f'{served}/v1/completions', json=payload, timeout=120)
    assert response.status_code == 200, response.text
    got = LocalCompletionsAPI.parse_logprobs(response.json(), ctxlens=[len(c) for c, _ in pairs])
    np.testing.assert_allclose([score for score, _ in got], expected['loglikelihoods'],
                               rtol=1e-4)
    assert [greedy for _, greedy in got] == expected['is_greedy']


def test_lm_eval_local_completions_against_the_server_gives_the_hf_backends_numbers(
    served, monkeypatch):
  """The whole harness, client included: ``lm_eval`` with ``--model local-completions``,
  ``tokenizer_backend=remote`` (the server's ``/tokenize``, ``/detokenize`` and
  ``/tokenizer_info``; no transformers on the client's side) and ``batch_size=4``, on
  ``tiny_mc``: every sample's log-likelihoods and greedy flags, and both accuracies, equal
  the HF backend's."""
  import lm_eval
  from lm_eval.tasks import TaskManager
  monkeypatch.chdir(ROOT)  # the task's data_files are relative to the repository root
  want = reference()
  out = lm_eval.simple_evaluate(
      model='local-completions',
      model_args={'base_url': f'{served}/v1/completions', 'model': SERVED,
                  'tokenizer_backend': 'remote', 'max_length': want['max_length'],
                  'num_concurrent': 1, 'max_retries': 1},
      tasks=['tiny_mc'], task_manager=TaskManager(include_path=TASK_DIR), batch_size=4,
      log_samples=True)
  assert out['results']['tiny_mc']['acc,none'] == want['acc']
  assert out['results']['tiny_mc']['acc_norm,none'] == want['acc_norm']
  got = sorted(out['samples']['tiny_mc'], key=lambda s: s['doc_id'])
  assert [s['doc_id'] for s in got] == [s['doc_id'] for s in want['samples']]
  for sample, expected in zip(got, want['samples']):
    np.testing.assert_allclose([float(r[0]) for r in sample['filtered_resps']],
                               expected['loglikelihoods'], rtol=1e-4)
    assert [bool(r[1]) for r in sample['filtered_resps']] == expected['is_greedy']


def test_only_eval_imports_lm_eval():
  import subprocess
  code = ('import sys, maxnnx, maxnnx.cli, maxnnx.evaluation; '
          "assert 'lm_eval' not in sys.modules, 'imported lm_eval'")
  result = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, 'PYTHONPATH': ROOT})
  assert result.returncode == 0, result.stderr

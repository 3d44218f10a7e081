"""Qwen3-Next (and Qwen3.5, its sibling) beyond the parity fixtures: packed and padded rows,
export, sizes, errors (serving: ``test_serving_engine.py``).

``tests/fixtures/hf/qwen3_next`` (``make_moe_fixtures.py qwen3_next``) pins logits, greedy
generation (through the recurrent state cache) and the round trip against transformers in
``test_hf_parity.py``; the gated delta rule itself is checked in
``test_kernels_gated_delta.py``.
"""


import numpy as np
import pytest
from conftest import export_and_compare
from flax import nnx

import maxnnx
from maxnnx.models.counting import num_active_params, num_params


def _tiny(**changes):
  cfg = maxnnx.get_preset('tiny-qwen3-next', initializer_range=0.5, **changes)
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(11))
  rng = np.random.default_rng(0)
  for _, var in nnx.iter_graph(model):  # move norms and decay parameters off their init
    if isinstance(var, nnx.Param) and var.ndim == 1:
      var[...] = var[...] + 0.3 * rng.normal(size=var.shape)
  return model


def test_packed_documents_equal_each_document_alone():
  """Segment ids restart the linear layers' state and convolution: a row packing two
  documents gives each document's logits alone (and the second differs when they leak)."""
  model = _tiny()
  forward = nnx.jit(lambda model, ids, segments, positions: model(
      ids, segment_ids=segments, positions=positions))
  rng = np.random.default_rng(1)
  docs = rng.integers(0, 512, (2, 9))
  positions = np.array([[*range(9), *range(9)]])
  logits = np.asarray(forward(model, docs.reshape(1, 18), np.array([[1] * 9 + [2] * 9]),
                              positions))[0]
  alone = np.asarray(forward(model, docs, np.ones((2, 9), int), positions[:, :9].repeat(2, 0)))
  # float32 logits of order 1; a packed row sums in another order than a row alone (up to
  # 2.3e-5 apart on an AMX CPU with jax 0.10.2), a leak moves them by far more (below).
  np.testing.assert_allclose(logits[:9], alone[0], atol=1e-4)
  np.testing.assert_allclose(logits[9:], alone[1], atol=1e-4)
  leaked = np.asarray(forward(model, docs.reshape(1, 18), np.ones((1, 18), int), positions))[0]
  assert np.abs(leaked[9:] - alone[1]).max() > 1e-2


@pytest.mark.slow  # 25 s of compiles; greedy parity with transformers runs by default
def test_ragged_prompts_generate_like_each_prompt_alone():
  """Left padding is zeroed and cut off by a reset, so batching prompts of several lengths
  gives each one's greedy continuation (the state cache decodes one token at a time)."""
  model = _tiny()
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, 512, n).tolist() for n in (3, 11)]
  batched = maxnnx.generate(model, prompts, max_new_tokens=6, eos_ids=None).tokens
  for prompt, row in zip(prompts, batched):
    alone = maxnnx.generate(model, [prompt], max_new_tokens=6, eos_ids=None).tokens[0]
    np.testing.assert_array_equal(row, alone)


@pytest.mark.parametrize('case', ['qwen3_next', 'qwen3_5'])
def test_export_writes_the_transformers_tensors(case, tmp_path):
  export_and_compare(case, tmp_path)


@pytest.mark.slow  # 13 s: the unscanned 48-layer abstract model
def test_80b_preset_size():
  """80B in total (the card); its "A3B" rounds the 3.25B active parameters outside the two
  embedding tables (top-10 of 512 experts + the shared one)."""
  cfg = maxnnx.get_preset('qwen3-next-80b-a3b')
  assert num_params(cfg) == pytest.approx(80e9, rel=5e-3)
  embeddings = 2 * cfg.vocab_size * cfg.d_model
  assert num_active_params(cfg) - embeddings == pytest.approx(3.25e9, rel=1e-2)
  assert cfg.resolved_layer_types.count('linear') == 36


@pytest.mark.slow  # the unscanned 40- and 60-layer abstract models
@pytest.mark.parametrize('name,total,active', [
    # Text models; the cards' totals add the 0.4B vision tower (35.07B and 396.76B in all).
    ('qwen3.5-35b-a3b', 34.66e9, 2.946e9), ('qwen3.5-397b-a17b', 396.35e9, 16.33e9)])
def test_qwen3_5_preset_sizes(name, total, active):
  """Totals within 0.5% of the cards' 35B / 397B once the vision tower is added; active
  parameters without the input embedding: the cards' A3B / A17B (35B: 2.448B outside the
  routed experts + 8 / 256 of their 32.212B - the 0.509B embedding = 2.946B)."""
  cfg = maxnnx.get_preset(name)
  assert num_params(cfg) == pytest.approx(total, rel=1e-3)
  assert num_params(cfg) + 0.41e9 == pytest.approx(float(name.split('-')[1][:-1]) * 1e9,
                                                   rel=5e-3)
  assert num_active_params(cfg) - cfg.vocab_size * cfg.d_model == pytest.approx(active,
                                                                                 rel=1e-3)


def test_what_the_hybrid_stack_cannot_do_is_a_clear_error():
  with pytest.raises(maxnnx.ConfigError, match='scan_layers'):
    maxnnx.get_preset('tiny-qwen3-next', **{'runtime.scan_layers': True})
  with pytest.raises(ValueError, match='num_slots'):
    _tiny().init_paged_cache(8, 4)  # the serving engine gives one state slot per request

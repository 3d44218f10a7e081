"""The full Transformer: NumPy parity, scan layouts, dtypes, packing, KV-cache decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from flax import nnx

from maxnnx.config import ModelConfig
from maxnnx.models.counting import num_params
from maxnnx.models.pretrained import _unscanned_param_values
from maxnnx.models.transformer import Transformer

BASE = dict(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
            mlp_dim=64, max_position_embeddings=64)
# Mixed sliding/full layers with their own local rope, post-norms and soft-caps.
MIXED = dict(BASE, layer_types=('sliding', 'full', 'sliding'), local_rope={'theta': 100.0},
             rope={'theta': 10_000.0}, post_norm=True, final_logit_softcap=3.0,
             **{'attention.sliding_window': 3, 'attention.logit_softcap': 5.0})

REFERENCE_CASES = {
    'llama': dict(BASE),
    'gemma': dict(MIXED, tie_word_embeddings=True, scale_embeddings=True, norm_scale_offset=1.0,
                  mlp_activation='gelu_tanh',
                  **{'attention.qk_norm': 'head', 'attention.query_scale': 0.2}),
    'olmo2': dict(BASE, pre_norm=False, post_norm=True, num_kv_heads=4,
                  attention={'qk_norm': 'projection'}),
    'phi': dict(BASE, norm_type='layer', attention={'qkv_bias': True, 'out_bias': True},
                mlp_gated=False, mlp_activation='gelu', mlp_bias=True, num_kv_heads=1,
                rope={'partial_rotary_factor': 0.5, 'scaling': 'linear', 'factor': 2.0}),
    # GPT-3 (MaxText's gpt3 block): learned positions, LayerNorm with biases, biased
    # projections, plain tanh-GELU MLP, tied output.
    'gpt3': dict(BASE, position_embedding='learned', norm_type='layer', norm_eps=1e-5,
                 attention={'qkv_bias': True, 'out_bias': True}, mlp_gated=False,
                 mlp_activation='gelu_tanh', mlp_bias=True, num_kv_heads=4,
                 tie_word_embeddings=True),
    # OLMo 3: OLMo 2's post-norms and projection q/k norms, sliding layers with their own
    # unscaled rope, YaRN on the full layer.
    'olmo3': dict(BASE, pre_norm=False, post_norm=True,
                  attention={'qk_norm': 'projection', 'sliding_window': 3},
                  layer_types=('sliding', 'sliding', 'full'), local_rope={'theta': 500.0},
                  rope={'theta': 500.0, 'scaling': 'yarn', 'factor': 4.0,
                        'original_max_position_embeddings': 16}),
}

PACKED_SEGMENTS = np.array([[1, 1, 1, 2, 2, 3, 3, 3]])
PACKED_POSITIONS = np.array([[0, 1, 2, 0, 1, 0, 1, 2]])
DOCS = (slice(0, 3), slice(3, 5), slice(5, 8))


def _model(cfg_dict, seed=0, **overrides):
  """A model with random norm scales and biases (scanned ones via _scanned_copy)."""
  cfg = ModelConfig.from_dict({**cfg_dict, **overrides})
  if cfg.runtime.scan_layers:
    return _scanned_copy(_model(cfg_dict, seed, **{**overrides, 'runtime.scan_layers': False}))
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  ref.randomize_params(model, np.random.default_rng(seed + 1000))
  return model


def _ids(seed, shape, vocab=64):
  return np.random.default_rng(seed).integers(0, vocab, size=shape)


@nnx.jit
def _forward(model, ids, segment_ids, positions):
  return model(ids, segment_ids=segment_ids, positions=positions)


def _logits(model, ids, segment_ids=None, positions=None):
  """Jitted logits; explicit default segments/positions keep one trace per shape."""
  batch, length = np.shape(ids)
  if segment_ids is None:
    segment_ids = np.ones((batch, length))
  if positions is None:
    positions = np.broadcast_to(np.arange(length), (batch, length))
  as_int = lambda a: jnp.asarray(a, jnp.int32)
  return _forward(model, as_int(ids), as_int(segment_ids), as_int(positions))


def _scanned_copy(model):
  """A scan_layers=True model holding exactly the weights of an unscanned one.

  Built abstractly (eval_shape) and filled in: eager vmapped init is slow on CPU.
  """
  cfg = model.config.replace(**{'runtime.scan_layers': True})
  scanned = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  per_layer = [pure['layers'][i] for i in range(model.config.num_layers)]
  pure['layers'] = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
  state = nnx.state(scanned, nnx.Param)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(scanned, state)
  return scanned


# -- parity with NumPy -------------------------------------------------------------


@pytest.mark.parametrize('case', list(REFERENCE_CASES))
def test_logits_match_numpy_reference(case):
  """Embed, blocks (pre/post norms, attention, MLP), final norm and head match NumPy."""
  model = _model(REFERENCE_CASES[case])
  ids = _ids(1, (2, 12))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  expected = ref.transformer(ids, params, model.config)
  ref.assert_close(_logits(model, ids), expected, rtol=1e-5, atol=1e-5)


def test_packed_logits_match_numpy_reference():
  """Packed input (segments, restarting positions) matches the reference too."""
  model = _model(MIXED)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  ids = _ids(2, (1, 8))
  expected = ref.transformer(ids, params, model.config, segment_ids=PACKED_SEGMENTS,
                             positions=PACKED_POSITIONS)
  got = _logits(model, ids, PACKED_SEGMENTS, PACKED_POSITIONS)
  ref.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_learned_positions_restart_per_document_and_skip_rope():
  """Learned positions: packed documents each read the table from row 0; the scanned
  stack computes the same; no rotary tables are built."""
  model = _model(REFERENCE_CASES['gpt3'])
  assert model.rotary is None and model.pos_embed.embedding.shape == (64, 32)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  ids = _ids(2, (1, 8))
  expected = ref.transformer(ids, params, model.config, segment_ids=PACKED_SEGMENTS,
                             positions=PACKED_POSITIONS)
  ref.assert_close(_logits(model, ids, PACKED_SEGMENTS, PACKED_POSITIONS), expected,
                   rtol=1e-5, atol=1e-5)
  ref.assert_close(_logits(_scanned_copy(model), ids, PACKED_SEGMENTS, PACKED_POSITIONS),
                   expected, rtol=1e-5, atol=1e-5)


def test_learned_positions_change_the_logits():
  """The position table is used: reversing its rows changes the logits."""
  model = _model(REFERENCE_CASES['gpt3'])
  ids = _ids(3, (1, 8))
  before = np.asarray(_logits(model, ids))
  table = model.pos_embed.embedding[...]
  model.pos_embed.embedding[...] = table[::-1]
  assert np.abs(np.asarray(_logits(model, ids)) - before).max() > 1e-3


# -- scan layouts ----------------------------------------------------------------------


@pytest.mark.parametrize('cfg_dict', [MIXED, dict(BASE, **{'attention.sliding_window': 3})],
                         ids=['mixed_layers', 'all_sliding'])
def test_scan_and_loop_give_identical_logits(cfg_dict):
  """scan_layers=True and False compute the same function of the same weights."""
  model = _model(cfg_dict)
  scanned = _scanned_copy(model)
  ids = _ids(3, (2, 12))
  ref.assert_close(_logits(scanned, ids), _logits(model, ids), rtol=1e-5, atol=1e-6)


# An MoE model with a dense first layer (two scanned stacks) and an MTP module after them.
MOE_TWO_STACKS = dict(BASE, moe={'num_experts': 4, 'num_experts_per_tok': 2, 'mlp_dim': 16,
                                 'first_k_dense_layers': 1}, mtp={'num_layers': 1})


@pytest.mark.parametrize('cfg_dict', [BASE, MIXED, MOE_TWO_STACKS],
                         ids=['dense', 'mixed_layers', 'moe_two_stacks_mtp'])
def test_a_seed_draws_the_same_weights_scanned_or_not(cfg_dict):
  """Scanning changes how the stack runs, never its weights: every parameter of the
  scanned model (layers listed per global index, as a Hugging Face export lists them)
  is bit-equal to the unscanned model's, the norm, head and MTP built after the stack
  included."""
  by_layout = []
  for scan in (False, True):
    cfg = ModelConfig.from_dict(dict(cfg_dict, **{'runtime.scan_layers': scan}))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    by_layout.append(_unscanned_param_values(nnx.state(model, nnx.Param), cfg))
  looped, scanned = by_layout
  assert sorted(map(str, scanned)) == sorted(map(str, looped))
  for path, value in looped.items():
    np.testing.assert_array_equal(scanned[path], value, err_msg=str(path))
  # Layers differ from each other (each folds in its own index), so equality is not trivial.
  kernels = [looped[('layers', i, 'attn', 'q_proj', 'kernel')] for i in range(3)]
  assert not np.array_equal(kernels[0], kernels[1])
  assert not np.array_equal(kernels[1], kernels[2])


def test_scanned_params_have_leading_layers_axis():
  """Scanned init stacks per-layer params on a leading axis named 'layers'."""
  cfg = ModelConfig.from_dict(dict(MIXED, **{'runtime.scan_layers': True}))
  # eval_shape traces the real constructor (a vmapped build) without slow eager init.
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
  assert tuple(specs['layers']['attn']['q_proj']['kernel']) == ('layers', 'embed', 'heads',
                                                                'head_dim')
  assert tuple(specs['layers']['mlp']['down_proj']['kernel']) == ('layers', 'mlp', 'embed')
  assert tuple(specs['layers']['attn_post_norm']['scale']) == ('layers', 'norm')
  assert tuple(specs['embed']['embedding']) == ('vocab', 'embed')
  assert model.layers.attn.q_proj.kernel.shape == (3, 32, 4, 8)
  assert model.layers.attn_post_norm.scale.shape == (3, 32)


def test_unscanned_params_are_per_layer():
  """The loop layout holds one block per layer with unprefixed axis names."""
  model = _model(MIXED)
  assert len(model.layers) == 3
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
  assert tuple(specs['layers'][0]['attn']['q_proj']['kernel']) == ('embed', 'heads', 'head_dim')


# -- dtypes ------------------------------------------------------------------------------


def _dot_operand_dtypes(fn, *args):
  """The operand dtypes of every dot_general in fn's jaxpr, nested ones included."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == 'dot_general':
        found.append(tuple(v.aval.dtype for v in eqn.invars))
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          inner = getattr(sub, 'jaxpr', sub)
          if hasattr(inner, 'eqns'):
            walk(inner)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize('scan', [False, True])
def test_bf16_compute_with_f32_params(scan):
  """dtype=bfloat16 computes every matmul in bf16 while params stay float32."""
  model = _model(MIXED, runtime={'dtype': 'bfloat16', 'param_dtype': 'float32',
                                 'logits_dtype': 'float32', 'scan_layers': scan})
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert params and all(p.dtype == jnp.float32 for p in params)
  ids = jnp.asarray(_ids(4, (2, 12)), jnp.int32)
  assert model.embed(ids).dtype == jnp.bfloat16
  graphdef, state = nnx.split(model)
  dots = _dot_operand_dtypes(lambda s, i: nnx.merge(graphdef, s)(i), state, ids)
  assert len(dots) >= 7  # q, k, v, scores, probs·v, o, mlp ... per layer, plus the head
  assert all(d == (jnp.bfloat16, jnp.bfloat16) for d in dots), dots
  out = jax.eval_shape(lambda s, i: nnx.merge(graphdef, s)(i), state, ids)
  assert out.dtype == jnp.float32


def test_bf16_logits_close_to_f32():
  """The bf16-compute model approximates the f32 model with the same weights."""
  f32 = _model(MIXED)
  bf16 = _model(MIXED, **{'runtime.dtype': 'bfloat16'})
  nnx.update(bf16, nnx.state(f32, nnx.Param))
  ids = _ids(5, (2, 12))
  want, got = np.asarray(_logits(f32, ids)), np.asarray(_logits(bf16, ids))
  assert got.dtype == np.float32
  assert np.max(np.abs(got - want)) < 0.05 * np.max(np.abs(want))


@pytest.mark.parametrize('scan', [False, True])
def test_param_dtype_independent_of_compute_dtype(scan):
  """param_dtype=bfloat16 with dtype=float32 stores every param in bf16."""
  cfg = ModelConfig.from_dict(dict(MIXED, runtime={'param_dtype': 'bfloat16', 'dtype': 'float32',
                                                   'scan_layers': scan}))
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  params = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  assert params and all(p.dtype == jnp.bfloat16 for p in params)


def test_logits_dtype():
  """logits_dtype sets the dtype of the returned logits."""
  model = _model(MIXED, **{'runtime.logits_dtype': 'bfloat16'})
  assert _logits(model, _ids(6, (2, 12))).dtype == jnp.bfloat16


# -- packing and padding --------------------------------------------------------------


@pytest.mark.parametrize('scan', [False, True])
def test_packed_documents_do_not_interact(scan):
  """Each packed document's logits equal running the model on that document alone."""
  model = _model(MIXED, **{'runtime.scan_layers': scan})
  ids = _ids(7, (1, 8))
  packed = np.asarray(_logits(model, ids, PACKED_SEGMENTS, PACKED_POSITIONS))
  for doc in DOCS if not scan else DOCS[1:2]:  # the loop layout checks every document
    alone = _logits(model, ids[:, doc])
    ref.assert_close(packed[:, doc], alone, rtol=1e-5, atol=1e-6, err_msg=str(doc))


def test_changing_other_documents_leaves_document_unchanged():
  """Replacing documents 1 and 3 does not change document 2's logits."""
  model = _model(MIXED)
  ids = _ids(8, (1, 8))
  other = ids.copy()
  other[:, DOCS[0]] = (ids[:, DOCS[0]] + 7) % 64
  other[:, DOCS[2]] = (ids[:, DOCS[2]] + 11) % 64
  a = _logits(model, ids, PACKED_SEGMENTS, PACKED_POSITIONS)[:, DOCS[1]]
  b = _logits(model, other, PACKED_SEGMENTS, PACKED_POSITIONS)[:, DOCS[1]]
  ref.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_padding_tokens_do_not_leak():
  """Right padding (segment 0) with any token ids leaves real tokens' logits unchanged."""
  model = _model(MIXED)
  ids = _ids(9, (2, 12))
  segments = np.array([[1] * 12, [1] * 8 + [0] * 4])
  noisy = ids.copy()
  noisy[1, 8:] = (ids[1, 8:] + 5) % 64
  a = np.asarray(_logits(model, ids, segments))
  b = np.asarray(_logits(model, noisy, segments))
  ref.assert_close(b[1, :8], a[1, :8], rtol=1e-6, atol=1e-7)
  ref.assert_close(a[1, :8], _logits(model, ids[1:, :8])[0], rtol=1e-5, atol=1e-6)


# -- KV-cache decoding ----------------------------------------------------------------------


@nnx.jit
def _decode_step(model, ids, positions):
  return model(ids, positions=positions, decode=True)


def _decode_incrementally(model, ids, prefix, max_length):
  batch, length = ids.shape
  model.init_cache(batch, max_length)
  ids = jnp.asarray(ids, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  steps = [_decode_step(model, ids[:, :prefix], positions[:, :prefix])]
  for t in range(prefix, length):
    steps.append(_decode_step(model, ids[:, t:t + 1], positions[:, t:t + 1]))
  return np.asarray(jnp.concatenate(steps, axis=1))


@pytest.mark.parametrize('scan', [False, True])
def test_kv_cache_decoding_equals_full_forward(scan):
  """Prefill then token-by-token decoding reproduces the full pass (window 3 < 12)."""
  model = _model(MIXED, **{'runtime.scan_layers': scan})
  ids = _ids(10, (2, 12))
  full = np.asarray(_logits(model, ids))
  ref.assert_close(_decode_incrementally(model, ids, prefix=5, max_length=12), full,
                   rtol=1e-5, atol=1e-5)
  assert int(model.cache_index[...]) == 12


@pytest.mark.parametrize('case', ['gpt3', 'olmo3'])
def test_kv_cache_decoding_equals_full_forward_per_family(case):
  """Learned positions (looked up per decoded token) and OLMo 3's mixed layers decode like
  the full pass."""
  model = _model(REFERENCE_CASES[case])
  ids = _ids(13, (2, 12))
  full = np.asarray(_logits(model, ids))
  ref.assert_close(_decode_incrementally(model, ids, prefix=5, max_length=12), full,
                   rtol=1e-5, atol=1e-5)


def test_kv_cache_decoding_from_empty_cache():
  """Token-by-token decoding from the very first token, with spare cache slots."""
  model = _model(MIXED)
  ids = _ids(11, (2, 12))
  full = np.asarray(_logits(model, ids))
  ref.assert_close(_decode_incrementally(model, ids, prefix=1, max_length=16), full,
                   rtol=1e-5, atol=1e-5)


def test_kv_cache_layout():
  """init_cache allocates [batch, max_length, kv_heads, head_dim] per layer."""
  loop = _model(MIXED)
  loop.init_cache(2, 16)
  assert loop.layers[0].attn.cache_k.shape == (2, 16, 2, 8)
  scanned = _model(MIXED, **{'runtime.scan_layers': True})
  scanned.init_cache(2, 16, jnp.bfloat16)
  assert scanned.layers.attn.cache_v.shape == (3, 2, 16, 2, 8)
  assert scanned.layers.attn.cache_v.dtype == jnp.bfloat16


def test_decode_without_cache_raises():
  """decode=True before init_cache is a ValueError pointing at init_cache."""
  model = _model(BASE)
  with pytest.raises(ValueError, match='init_cache'):
    model(jnp.zeros((1, 2), jnp.int32), decode=True)


# -- input validation -----------------------------------------------------------------------


@pytest.mark.parametrize('bad_id', [64, 1000, -1])
def test_out_of_range_ids_raise(bad_id):
  """Token ids outside [0, vocab_size) are a ValueError mentioning vocab_size."""
  model = _model(BASE)
  ids = jnp.asarray([[1, 2, bad_id, 3]], jnp.int32)
  with pytest.raises(ValueError, match='vocab_size'):
    model(ids)


def test_one_dimensional_input_raises():
  """A 1-D input is rejected with a message asking for [batch, length]."""
  model = _model(BASE)
  with pytest.raises(ValueError, match=r'\[batch, length\]'):
    model(jnp.asarray([1, 2, 3], jnp.int32))


def test_float_input_raises():
  """Non-integer ids are rejected."""
  model = _model(BASE)
  with pytest.raises(ValueError, match='integers'):
    model(jnp.ones((1, 3), jnp.float32))


# -- parameter count ------------------------------------------------------------------------


@pytest.mark.parametrize('case', list(REFERENCE_CASES))
def test_num_params_matches_model(case):
  """num_params(ModelConfig) equals the number of parameters actually built."""
  model = Transformer(ModelConfig.from_dict(REFERENCE_CASES[case]), rngs=nnx.Rngs(0))
  built = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert num_params(model.config) == built


@nnx.jit
def _decode_step_default_positions(model, ids):
  return model(ids, decode=True)


def test_decode_without_positions_continues_from_cache():
  """decode=True without positions either continues from the cache or refuses clearly."""
  model = _model(MIXED)
  ids = _ids(12, (2, 12))
  full = np.asarray(_logits(model, ids))
  model.init_cache(2, 12)
  try:
    steps = []
    for t in range(12):
      steps.append(_decode_step_default_positions(model, jnp.asarray(ids[:, t:t + 1], jnp.int32)))
  except ValueError as error:
    assert 'positions' in str(error)
    return
  ref.assert_close(np.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


def test_decoding_past_cache_length_raises():
  """Eager decoding beyond the cache's max_length is refused instead of clobbering a slot."""
  model = _model(MIXED)
  model.init_cache(1, 4)
  model.cache_index[...] = jnp.int32(4)  # as after a 4-token prefill: the cache is full
  with pytest.raises(ValueError, match='max_length'):
    model(jnp.asarray([[5]], jnp.int32), positions=jnp.asarray([[4]], jnp.int32), decode=True)

"""Tests for maxnnx.presets: names, validity, parameter counts, overrides, tiny forward."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxnnx.config import ConfigError, ModelConfig
from maxnnx.models import FAMILIES, Transformer, num_params
from maxnnx.models.hf import HFConfig
from maxnnx.presets import PRESETS, get_preset, list_presets

EXPECTED_NAMES = {
    'tiny', 'llama2-7b', 'llama2-13b', 'llama2-70b', 'llama3-8b', 'llama3-70b', 'llama3.1-8b',
    'llama3.1-70b', 'llama3.1-405b', 'llama3.3-70b', 'mistral-7b', 'gemma-2b', 'gemma-7b',
    'gemma2-2b', 'gemma2-9b', 'gemma2-27b', 'gemma3-1b', 'gemma3-4b', 'gemma3-12b', 'gemma3-27b',
    'qwen2.5-0.5b', 'qwen2.5-1.5b', 'qwen2.5-3b', 'qwen2.5-7b', 'qwen2.5-14b', 'qwen2.5-32b',
    'qwen2.5-72b', 'qwen3-0.6b', 'qwen3-1.7b', 'qwen3-4b', 'qwen3-4b-thinking-2507', 'qwen3-8b',
    'qwen3-14b', 'qwen3-32b',
    'phi3-mini', 'olmo2-7b', 'olmo3-7b', 'olmo3-32b', 'gpt3-52k', 'gpt3-6b', 'gpt3-22b',
    'gpt3-175b'}
EXPECTED_NAMES |= {'tiny-moe', 'mixtral-8x7b', 'mixtral-8x22b', 'qwen3-30b-a3b',
                   'qwen3-235b-a22b', 'qwen3-480b-a35b', 'deepseek-v2-lite', 'deepseek-v2',
                   'deepseek-v3', 'kimi-k2', 'gpt-oss-20b', 'gpt-oss-120b',
                   'llama4-17b-16e', 'llama4-17b-128e',
                   'tiny-llama4', 'qwen3-next-80b-a3b',
                   'tiny-qwen3-next', 'qwen3.5-35b-a3b',
                   'qwen3.5-397b-a17b',
                   'deepseek-v3.2',  # test_presets_moe.py, test_qwen3_next.py: sizes
                   'deepseek3-test', 'deepseek3-tiny',  # MaxText's test configs
                   'gemma4-31b', 'gemma4-26b-a4b', 'gemma4-e2b', 'gemma4-e4b', 'tiny-gemma4',
                   'tiny-gemma3-vision', 'tiny-llama4-vision'}

# Total parameter counts published by the model authors (model cards, papers and
# the Hub's safetensors metadata), in billions: an independent check of the
# presets' shapes and of num_params(ModelConfig).
PUBLISHED_BILLIONS = {
    'llama2-7b': 6.74,
    'llama2-13b': 13.0,
    'llama3-8b': 8.03,
    'llama3-70b': 70.55,
    'llama3.1-405b': 405.9,
    'mistral-7b': 7.24,
    'gemma-2b': 2.51,
    'gemma-7b': 8.54,
    'gemma2-2b': 2.61,
    'gemma2-9b': 9.24,
    'gemma2-27b': 27.2,
    'gemma3-4b': 4.30,  # with the vision tower, as the Hub checkpoints hold them
    'gemma3-12b': 12.19,
    'gemma3-27b': 27.43,
    'gemma4-31b': 30.7,  # the text model
    'qwen2.5-7b': 7.62,
    'qwen2.5-72b': 72.7,
    'qwen3-4b-thinking-2507': 4.02,
    'qwen3-8b': 8.19,
    'qwen3-32b': 32.8,
    'phi3-mini': 3.82,
    'olmo2-7b': 7.30,
    'olmo3-7b': 7.30,
    'olmo3-32b': 32.2,
    'gpt3-175b': 175.0,  # the paper's count (50,257 tokens, 2,048 positions); see below
}


def _abstract(cfg: ModelConfig):
  return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def _param_count(model) -> int:
  return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_list_presets_has_every_name():
  assert set(list_presets()) == EXPECTED_NAMES
  assert list_presets() == sorted(PRESETS)


@pytest.mark.parametrize('name', sorted(EXPECTED_NAMES))
def test_preset_builds_and_validates(name):
  cfg = get_preset(name)
  assert isinstance(cfg, ModelConfig)
  assert cfg.family in FAMILIES
  assert ModelConfig.from_dict(cfg.to_dict()) == cfg
  assert PRESETS[name].__doc__, f'{name} has no docstring'


@pytest.mark.parametrize('name', sorted(EXPECTED_NAMES))
def test_preset_survives_hugging_face_config_round_trip(name):
  cfg = get_preset(name)
  family = FAMILIES[cfg.family]
  back = family.config_from_hf(HFConfig(family.config_to_hf(cfg), name, family.defaults))
  # head_dim may be spelt out or implied (d_model // num_heads) on either side.
  assert back.replace(head_dim=back.resolved_head_dim) == cfg.replace(
      head_dim=cfg.resolved_head_dim)


# Stacks the scanned layout cannot hold are counted layer by layer (~1 s per layer on a CPU).
SLOW_COUNTS = {'gemma4-31b'}


@pytest.mark.parametrize('name,billions', [
    pytest.param(n, b, marks=pytest.mark.slow) if n in SLOW_COUNTS else (n, b)
    for n, b in sorted(PUBLISHED_BILLIONS.items())])
def test_num_params_matches_published_total(name, billions):
  count = num_params(get_preset(name))
  assert count == pytest.approx(billions * 1e9, rel=5e-3)


def _gpt3_closed_form(v, d, layers, m, positions):
  """GPT-2/3 parameters from the architecture: token and position tables, per layer
  q/k/v/o with biases, two-layer MLP with biases and two LayerNorms, a final LayerNorm."""
  per_layer = (4 * d * d + 4 * d) + (2 * d * m + m + d) + 2 * (2 * d)
  return v * d + positions * d + layers * per_layer + 2 * d


def _olmo3_closed_form(v, d, layers, heads, kv_heads, head_dim, m):
  """OLMo 3 parameters: untied embedding and head, per layer q/k/v/o without biases,
  projection-wide q/k RMSNorms, a SwiGLU MLP and two post-norms, a final RMSNorm."""
  q, kv = heads * head_dim, kv_heads * head_dim
  per_layer = 2 * d * q + 2 * d * kv + (q + kv) + 3 * d * m + 2 * d
  return 2 * v * d + layers * per_layer + d


# Sizes MaxText's gpt3-*.yml and the OLMo 3 config.json files give, counted by the formula
# above independently of the model: MaxText's gpt3-6b/22b have no published total, and
# the OLMo 3 totals above are rounded.
CLOSED_FORM = {
    'gpt3-52k': _gpt3_closed_form(1024, 16, 1, 64, 2048),  # 52,464: the "52k"
    'gpt3-6b': _gpt3_closed_form(32_768, 3072, 48, 12_288, 16_384),
    'gpt3-22b': _gpt3_closed_form(32_768, 6144, 48, 24_576, 16_384),
    'gpt3-175b': _gpt3_closed_form(50_304, 12_288, 96, 49_152, 16_384),
    'olmo3-7b': _olmo3_closed_form(100_278, 4096, 32, 32, 32, 128, 11_008),
    'olmo3-32b': _olmo3_closed_form(100_278, 5120, 64, 40, 8, 128, 27_648),
}


@pytest.mark.parametrize('name', sorted(CLOSED_FORM))
def test_num_params_matches_closed_form(name):
  assert num_params(get_preset(name)) == CLOSED_FORM[name]
  assert CLOSED_FORM['gpt3-52k'] == 52_464


def test_architecture_details():
  assert get_preset('llama3.1-8b').rope.scaling == 'llama3'
  assert get_preset('llama3-8b').rope.scaling == 'none'
  assert get_preset('gemma2-9b').layer_types[:2] == ('sliding', 'full')
  gemma3 = get_preset('gemma3-27b')
  assert [i for i, t in enumerate(gemma3.layer_types) if t == 'full'][:2] == [5, 11]
  assert gemma3.rope.factor == 8.0 and gemma3.local_rope.theta == 10_000.0
  assert get_preset('gemma3-1b').rope.scaling == 'none'
  olmo3 = get_preset('olmo3-32b')
  assert olmo3.layer_types[:4] == ('sliding', 'sliding', 'sliding', 'full')
  assert (olmo3.rope.scaling, olmo3.rope.factor, olmo3.local_rope.scaling) == ('yarn', 8.0, 'none')
  gpt3 = get_preset('gpt3-175b')
  assert (gpt3.position_embedding, gpt3.norm_type, gpt3.mlp_gated) == ('learned', 'layer', False)
  assert gpt3.resolved_head_dim == 128 and gpt3.max_position_embeddings == 16_384
  tied = {n for n in EXPECTED_NAMES if get_preset(n).tie_word_embeddings}
  assert {'qwen2.5-0.5b', 'qwen2.5-1.5b', 'qwen2.5-3b', 'qwen3-0.6b', 'qwen3-1.7b',
          'qwen3-4b', 'gpt3-6b', 'gpt3-175b'} <= tied
  assert not tied & {'qwen2.5-7b', 'qwen3-8b', 'llama3-8b', 'tiny'}


# One preset per architectural feature counted by num_params(): GQA + untied
# (tiny), sandwich norms (gemma2), per-head q/k norms (gemma3, qwen3), q/k/v
# biases + tied embeddings (qwen2.5), post-norms + projection q/k norms (olmo2), learned
# positions + LayerNorm biases + plain MLP (gpt3).
@pytest.mark.parametrize('name', ['tiny', 'gemma2-2b', 'gemma3-1b', 'qwen2.5-0.5b', 'qwen3-0.6b',
                                  'olmo2-7b', 'gpt3-52k'])
def test_num_params_equals_abstract_model_size(name):
  cfg = get_preset(name, **{'runtime.scan_layers': True})
  assert _param_count(_abstract(cfg)) == num_params(cfg)


def test_scanned_and_unscanned_models_have_the_same_parameters():
  unscanned = _abstract(get_preset('gemma3-1b', **{'runtime.scan_layers': False}))
  scanned = _abstract(get_preset('gemma3-1b', **{'runtime.scan_layers': True}))
  assert _param_count(unscanned) == _param_count(scanned) == num_params(get_preset('gemma3-1b'))
  assert len(unscanned.layers) == 26
  assert scanned.layers.attn.q_proj.kernel.shape[0] == 26


def test_70b_abstract_model_allocates_nothing():
  """No array is created on a device (a 70 B model would not fit here); every leaf is a shape."""
  cfg = get_preset('llama3-70b', **{'runtime.scan_layers': True, 'runtime.param_dtype': 'bfloat16'})
  before = {id(a) for a in jax.live_arrays()}
  model = _abstract(cfg)
  assert not [a for a in jax.live_arrays() if id(a) not in before and a.nbytes > 1 << 20]
  leaves = jax.tree.leaves(nnx.state(model))
  assert leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
  assert _param_count(model) == num_params(cfg)


def test_unknown_preset_names_nearest():
  with pytest.raises(ConfigError, match="'llama3.1-8b'"):
    get_preset('llama-3.1-8b')
  with pytest.raises(ConfigError, match="'gemma2-9b'"):
    get_preset('gemma2_9b')


def test_maxtext_names_resolve_to_the_same_architecture():
  """MaxText's model names load the preset of the same architecture (published totals are
  checked on the targets above); every target exists and no alias shadows a preset."""
  from maxnnx.presets import MAXTEXT_ALIASES  # noqa: PLC0415
  assert not set(MAXTEXT_ALIASES) & set(PRESETS)
  for alias, target in MAXTEXT_ALIASES.items():
    assert target in PRESETS, alias
    assert get_preset(alias) == get_preset(target)
  assert get_preset('deepseek3-671b', num_layers=4) == get_preset('deepseek-v3', num_layers=4)
  assert set(list_presets(aliases=True)) == set(PRESETS) | set(MAXTEXT_ALIASES)
  with pytest.raises(ConfigError, match="'deepseek3-671b'"):
    get_preset('deepseek3-672b')


def test_overrides():
  cfg = get_preset('tiny', **{'runtime.dtype': 'bfloat16', 'runtime.scan_layers': True})
  assert cfg.runtime.dtype == 'bfloat16' and cfg.runtime.scan_layers
  assert cfg.replace(**{'runtime.dtype': 'float32',
                        'runtime.scan_layers': False}) == get_preset('tiny')
  with pytest.raises(ConfigError, match=r"'dtpye'\. Did you mean 'runtime\.dtype'\?"):
    get_preset('tiny', dtpye='bfloat16')
  with pytest.raises(ConfigError, match='num_kv_heads'):
    get_preset('tiny', num_kv_heads=3)


def test_tiny_forward_pass():
  cfg = get_preset('tiny')
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.resolved_head_dim) == (512, 128, 4, 32)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  logits = nnx.jit(lambda m, x: m(x))(model, ids)
  assert logits.shape == (2, 16, 512)
  assert logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()

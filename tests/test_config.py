"""ModelConfig / RopeConfig: typo and type errors, cross-field checks, round trips."""

import dataclasses
import json

import jax.numpy as jnp
import pytest

from maxnnx.config import (
    ATTENTION_KEYS,
    FLAT_GROUP_KEYS,
    AttentionConfig,
    ConfigError,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    RopeConfig,
    RuntimeConfig,
    resolve_dtype,
)
from maxnnx.presets import get_preset
from maxnnx.train.config import TrainConfig

TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64,
            max_position_embeddings=128)


def _tiny(**overrides):
  return ModelConfig.from_dict({**TINY, **overrides})


# -- unknown fields --------------------------------------------------------------


def test_unknown_field_suggests_nearest():
  """A typo'd key is rejected, naming the key and the nearest valid field."""
  with pytest.raises(ConfigError) as info:
    ModelConfig.from_dict({**TINY, 'num_head': 4})
  assert "'num_head'" in str(info.value) and "'num_heads'" in str(info.value)


def test_unknown_field_without_close_match():
  """A key with no close match is still rejected by name."""
  with pytest.raises(ConfigError, match="'zzzz'"):
    ModelConfig.from_dict({'zzzz': 1})


def test_unknown_nested_rope_field():
  """Typos inside the nested rope dict are caught too, with a suggestion."""
  with pytest.raises(ConfigError) as info:
    ModelConfig.from_dict({**TINY, 'rope': {'thetta': 1e4}})
  assert "'thetta'" in str(info.value) and "'theta'" in str(info.value)


def test_config_error_is_value_error():
  """ConfigError subclasses ValueError so generic handlers catch it."""
  assert issubclass(ConfigError, ValueError)


# -- types -----------------------------------------------------------------------


@pytest.mark.parametrize('field,value', [
    ('d_model', '64'),
    ('scan_layers', 1),
    ('num_layers', 2.0),
    ('num_heads', True),
    ('norm_type', 'batch'),
    ('dtype', 'float8'),
    ('layer_types', ('full', 'global')),
])
def test_wrong_type_names_field(field, value):
  """A value of the wrong type (bools are not ints, ints not bools) names the field."""
  with pytest.raises(ConfigError, match=field):
    ModelConfig.from_dict({**TINY, field: value})


def test_int_accepted_for_float_field():
  """An int where a float is expected (theta=10000) is fine."""
  assert RopeConfig(theta=10_000).theta == 10_000


def test_optional_fields_accept_none():
  """Optional fields take None."""
  cfg = _tiny(head_dim=None, **{'attention.query_scale': None, 'attention.sliding_window': None})
  assert cfg.resolved_head_dim == 8


def test_non_dict_rejected():
  """from_dict of a non-dict is a ConfigError."""
  with pytest.raises(ConfigError, match='dict'):
    ModelConfig.from_dict([1, 2])


# -- cross-field checks -------------------------------------------------------------


def test_heads_must_divide_by_kv_heads():
  """num_heads % num_kv_heads != 0 is rejected naming both."""
  with pytest.raises(ConfigError, match='num_kv_heads'):
    _tiny(num_heads=4, num_kv_heads=3)


def test_layer_types_length_must_match():
  """layer_types needs one entry per layer."""
  with pytest.raises(ConfigError, match='layer_types'):
    _tiny(layer_types=('full',), num_layers=2)


def test_sliding_layers_need_window():
  """'sliding' layer_types without attention.sliding_window is rejected, naming the key."""
  with pytest.raises(ConfigError, match=r'set attention\.sliding_window'):
    _tiny(layer_types=('sliding', 'full'))
  with pytest.raises(ConfigError, match=r'set attention\.chunk_size'):
    _tiny(layer_types=('chunked', 'full'))


def test_nonpositive_window_rejected():
  """attention.sliding_window must be positive: the group refuses it, by its dotted path."""
  for build in (lambda: _tiny(**{'attention.sliding_window': 0}),
                lambda: _tiny(attention={'sliding_window': -2}),
                lambda: AttentionConfig(sliding_window=0)):
    with pytest.raises(ConfigError, match=r'ModelConfig\.attention\.sliding_window must be > 0'):
      build()


@pytest.mark.parametrize('fields,message', [
    ({'chunk_size': 0}, r'attention\.chunk_size must be > 0'),
    ({'temperature_floor': 0.0}, r'attention\.temperature_floor must be > 0'),
    ({'nope_layers': (1, 1)}, r'attention\.nope_layers must list distinct'),
    ({'nope_layers': (-1,)}, r'attention\.nope_layers must list distinct layer indices >= 0'),
    ({'type': 'mla', 'sinks': True}, r"attention\.sinks needs ModelConfig\.attention\.type='mha'"),
    ({'type': 'mla', 'nope_layers': (0,)}, r'attention\.nope_layers needs'),
    ({'type': 'mla', 'global_layers': {'head_dim': 8}}, r'attention\.global_layers needs'),
    ({'global_layers': {'num_kv_heads': 0}}, r'attention\.global_layers\.num_kv_heads must be'),
    ({'qk_norm': 'rms'}, r"ModelConfig\.attention\.qk_norm = 'rms' is invalid"),
])
def test_attention_group_validates_on_its_own(fields, message):
  """The group's own checks run when the group is built, alone or inside a ModelConfig."""
  with pytest.raises(ConfigError, match=message):
    AttentionConfig.from_dict(fields)
  with pytest.raises(ConfigError, match=message):
    _tiny(attention=fields)


def test_attention_checks_that_need_the_model_stay_in_model_config():
  """Layer indices past num_layers and chunked layers under MLA name the dotted key."""
  assert AttentionConfig(nope_layers=(5,)).nope_layers == (5,)  # fine alone
  with pytest.raises(ConfigError, match=r'attention\.nope_layers must list layer indices in '
                                        r'\[0, num_layers=2\)'):
    _tiny(attention={'nope_layers': (5,)})
  with pytest.raises(ConfigError, match=r"chunked layers need attention\.type='mha'"):
    _tiny(layer_types=('chunked', 'full'), attention={'chunk_size': 4, 'type': 'mla'},
          head_dim=None)


def test_attention_group_holds_the_attention_fields():
  """The attention settings are one frozen group; a dict or dotted keys update part of it."""
  cfg = _tiny(attention={'sliding_window': 4, 'qk_norm': 'head'})
  assert isinstance(cfg.attention, AttentionConfig)
  assert (cfg.attention.sliding_window, cfg.attention.qk_norm) == (4, 'head')
  assert cfg.resolved_layer_types == ('sliding', 'sliding')
  new = cfg.replace(**{'attention.logit_softcap': 30.0})
  assert new.attention == cfg.attention.replace(logit_softcap=30.0)
  assert cfg.replace(attention={'type': 'mla'}, head_dim=None).rope_head_dim == 64
  global_layers = _tiny(attention={'global_layers': {'head_dim': 16, 'num_kv_heads': 1}})
  assert global_layers.attention_shape('full') == (16, 1, False)
  assert global_layers.attention_shape('sliding') == (8, 2, False)
  assert ModelConfig.from_dict(cfg.to_dict()) == cfg
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.attention.sliding_window = 8


def test_nonpositive_sizes_rejected():
  """Sizes such as d_model must be > 0."""
  with pytest.raises(ConfigError, match='d_model'):
    _tiny(d_model=0)


def test_head_dim_must_divide_unless_explicit():
  """d_model % num_heads != 0 needs an explicit head_dim."""
  with pytest.raises(ConfigError, match='head_dim'):
    _tiny(d_model=30)
  assert _tiny(d_model=30, head_dim=8).resolved_head_dim == 8


def test_rotated_dims_must_be_even():
  """The rotated part of head_dim must be even."""
  with pytest.raises(ConfigError, match='even'):
    _tiny(head_dim=6, rope={'partial_rotary_factor': 0.5})


def test_learned_positions_refuse_what_they_cannot_use():
  """position_embedding='learned' refuses latent attention and an unused local_rope;
  unknown kinds are refused by the annotation."""
  assert _tiny(position_embedding='learned').position_embedding == 'learned'
  with pytest.raises(ConfigError, match="attention.type='mha'"):
    _tiny(position_embedding='learned', **{'attention.type': 'mla'})
  with pytest.raises(ConfigError, match='local_rope'):
    _tiny(position_embedding='learned', local_rope={'theta': 100.0})
  with pytest.raises(ConfigError, match='position_embedding'):
    _tiny(position_embedding='absolute')


def test_longrope_needs_factors():
  """scaling='longrope' without short/long factors is rejected."""
  with pytest.raises(ConfigError, match='short_factor'):
    RopeConfig(scaling='longrope', original_max_position_embeddings=32)
  with pytest.raises(ConfigError, match='long_factor'):
    RopeConfig(scaling='longrope', original_max_position_embeddings=32, short_factor=(1.0,))


@pytest.mark.parametrize('scaling', ['llama3', 'longrope'])
def test_scaling_needs_original_context(scaling):
  """llama3 and longrope need original_max_position_embeddings."""
  with pytest.raises(ConfigError, match='original_max_position_embeddings'):
    RopeConfig(scaling=scaling, factor=8.0, short_factor=(1.0,), long_factor=(1.0,))


@pytest.mark.parametrize('scaling', ['linear', 'llama3'])
def test_scaling_needs_factor(scaling):
  """linear and llama3 need an explicit factor."""
  with pytest.raises(ConfigError, match='factor'):
    RopeConfig(scaling=scaling, original_max_position_embeddings=1024)


@pytest.mark.parametrize('bad', [{'theta': 0.0}, {'partial_rotary_factor': 0.0},
                                 {'partial_rotary_factor': 1.5}])
def test_rope_value_ranges(bad):
  """theta must be positive and partial_rotary_factor in (0, 1]."""
  with pytest.raises(ConfigError, match=next(iter(bad))):
    RopeConfig(**bad)


# -- replace / round trips ---------------------------------------------------------


def test_replace_changes_one_field():
  """replace returns a modified copy and leaves the original alone."""
  cfg = _tiny()
  new = cfg.replace(num_layers=3, **{'runtime.scan_layers': True})
  assert (new.num_layers, new.runtime.scan_layers) == (3, True)
  assert (cfg.num_layers, cfg.runtime.scan_layers) == (2, False)
  assert new.d_model == cfg.d_model


def test_replace_validates():
  """replace runs type and cross-field checks and catches typos."""
  cfg = _tiny()
  with pytest.raises(ConfigError, match='num_kv_heads'):
    cfg.replace(num_kv_heads=3)
  with pytest.raises(ConfigError, match='d_model'):
    cfg.replace(d_model='32')
  with pytest.raises(ConfigError, match="'num_layers'"):
    cfg.replace(num_layer=3)


def test_replace_accepts_nested_dict():
  """replace(rope={...}) builds a RopeConfig from the dict."""
  cfg = _tiny().replace(rope={'theta': 500_000.0})
  assert isinstance(cfg.rope, RopeConfig) and cfg.rope.theta == 500_000.0


def _rich():
  return _tiny(**{'attention.sliding_window': 4}, layer_types=['sliding', 'full'], post_norm=True,
               rope={'scaling': 'longrope', 'original_max_position_embeddings': 64,
                     'short_factor': [1.0, 1.5, 2.0, 2.5], 'long_factor': [3.0, 4.0, 5.0, 6.0]},
               local_rope={'theta': 10_000.0}, **{'attention.logit_softcap': 50.0})


def test_lists_become_tuples():
  """Lists (from YAML/JSON) become tuples, also in nested configs."""
  cfg = _rich()
  assert cfg.layer_types == ('sliding', 'full')
  assert cfg.rope.short_factor == (1.0, 1.5, 2.0, 2.5)
  assert isinstance(cfg.rope.long_factor, tuple)
  hash(cfg)  # frozen and hashable


def test_to_dict_from_dict_round_trip():
  """from_dict(to_dict(cfg)) == cfg, nested RopeConfigs included."""
  cfg = _rich()
  data = cfg.to_dict()
  assert isinstance(data['rope'], dict) and isinstance(data['local_rope'], dict)
  assert data['rope']['scaling'] == 'longrope'
  assert ModelConfig.from_dict(data) == cfg


def test_json_round_trip():
  """A config survives JSON (tuples become lists and come back as tuples)."""
  cfg = _rich()
  assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_from_dict_passes_config_instances_through():
  """from_dict accepts an instance (and nested instances) unchanged."""
  cfg = _tiny()
  assert ModelConfig.from_dict(cfg) is cfg
  assert _tiny(rope=RopeConfig(theta=5.0)).rope.theta == 5.0


def test_configs_are_frozen():
  """Fields cannot be assigned after construction."""
  cfg = _tiny()
  with pytest.raises(AttributeError):
    cfg.d_model = 64


# -- derived values -------------------------------------------------------------------


def test_resolved_defaults():
  """head_dim, layer types and query scale have documented defaults."""
  cfg = _tiny()
  assert cfg.resolved_head_dim == 8
  assert cfg.resolved_layer_types == ('full', 'full')
  assert cfg.resolved_query_scale == pytest.approx(8**-0.5)
  assert _tiny(**{'attention.sliding_window': 4}).resolved_layer_types == ('sliding', 'sliding')
  assert _tiny(**{'attention.query_scale': 0.25}).resolved_query_scale == 0.25


def test_dtypes():
  """dtype names resolve to jnp dtypes; unknown names suggest the nearest."""
  cfg = _tiny(**{'runtime.dtype': 'bfloat16'})
  assert cfg.jnp_dtype() == jnp.bfloat16 and cfg.jnp_dtype('param_dtype') == jnp.float32
  assert resolve_dtype('float16') == jnp.float16
  with pytest.raises(ConfigError, match="'bfloat16'"):
    resolve_dtype('bfloat61')


# -- nested groups and legacy keys ---------------------------------------------------


def test_groups_are_nested_configs():
  """MoE, MLA, MTP and runtime settings live in their own frozen groups."""
  cfg = _tiny()
  assert isinstance(cfg.moe, MoEConfig) and isinstance(cfg.mla, MLAConfig)
  assert isinstance(cfg.mtp, MTPConfig) and isinstance(cfg.runtime, RuntimeConfig)
  assert (cfg.moe.num_experts, cfg.mtp.num_layers, cfg.runtime.dtype) == (0, 0, 'float32')
  with pytest.raises(AttributeError):
    cfg.moe.num_experts = 4


@pytest.mark.parametrize('old,path', sorted({**ATTENTION_KEYS, **FLAT_GROUP_KEYS}.items()))
def test_every_former_flat_key_is_refused_naming_its_dotted_path(old, path):
  """The flat names of earlier versions are unknown keys now; the error names the dotted key
  to set instead, which is a real field of a group."""
  group, field = path.split('.')
  assert field in {f.name for f in dataclasses.fields(getattr(_tiny(), group))}
  for build in (lambda: _tiny(**{old: None}), lambda: _tiny().replace(**{old: None}),
                lambda: get_preset('tiny', **{old: None})):
    with pytest.raises(ConfigError) as info:
      build()
    assert str(info.value) == (f"Unknown ModelConfig field '{old}'. It moved: set {path} "
                               'instead.')


def test_a_near_miss_of_a_moved_name_suggests_its_dotted_path():
  """A typo of a former flat name points at where that setting lives now."""
  with pytest.raises(ConfigError, match=r"'slidingwindow'\. Did you mean "
                                        r"'attention\.sliding_window'\?"):
    _tiny(slidingwindow=4)
  with pytest.raises(ConfigError, match=r"Did you mean 'num_heads'\?"):
    _tiny(num_head=4)


def test_flat_keys_are_not_attributes_any_more():
  """ModelConfig has no flat attention, MoE or runtime fields left."""
  names = {f.name for f in dataclasses.fields(ModelConfig)}
  assert not names & ({*ATTENTION_KEYS, *FLAT_GROUP_KEYS})
  with pytest.raises(TypeError):
    ModelConfig(**TINY, sliding_window=4)


def test_dotted_keys():
  """'group.field' keys set one field of a group."""
  cfg = _tiny(**{'moe.num_experts': 4, 'runtime.remat_policy': 'full'})
  assert cfg.moe.num_experts == 4 and cfg.runtime.remat_policy == 'full'
  assert cfg.replace(**{'moe.num_experts_per_tok': 3}).moe == cfg.moe.replace(
      num_experts_per_tok=3)
  assert _tiny(**{'rope.theta': 5.0}).rope.theta == 5.0
  with pytest.raises(ConfigError, match="'num_expert'.*Did you mean 'num_experts'"):
    _tiny(**{'moe.num_expert': 4})
  with pytest.raises(ConfigError, match='has no field'):
    _tiny(**{'d_model.x': 4})


def test_nested_dict_merges_into_the_group():
  """A dict for a group updates only the fields it names."""
  cfg = _tiny(moe={'num_experts': 4, 'num_experts_per_tok': 1})
  assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok) == (4, 1)
  new = cfg.replace(moe={'num_experts': 8})
  assert (new.moe.num_experts, new.moe.num_experts_per_tok) == (8, 1)
  assert ModelConfig(**TINY, moe={'num_experts': 2, 'num_experts_per_tok': 1}).moe.num_experts == 2
  assert ModelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize('key', ['router_aux_loss_coef', 'router_z_loss_coef',
                                 'mtp_loss_scaling_factor'])
def test_loss_weights_are_refused_naming_train_config(key):
  """Loss weights are training settings: ModelConfig names their new home."""
  with pytest.raises(ConfigError, match=f'TrainConfig.{key}'):
    _tiny(**{key: 0.1})
  with pytest.raises(ConfigError, match=f'TrainConfig.{key}'):
    _tiny().replace(**{key: 0.1})
  assert getattr(TrainConfig(), key) == {'mtp_loss_scaling_factor': 0.1}.get(key, 0.0)
  assert getattr(TrainConfig(**{key: 0.5}), key) == 0.5


def test_stored_configs_drop_loss_weights(caplog):
  """A stored config that still holds the loss weights loads without them; flat group keys
  are refused there too."""
  stored = {**TINY, 'moe': {'num_experts': 4}, 'router_aux_loss_coef': 0.01,
            'runtime': {'dtype': 'bfloat16'}, 'mtp_loss_scaling_factor': 0.3}
  with caplog.at_level('INFO'):
    cfg = ModelConfig.from_stored_dict(stored)
  assert cfg.moe.num_experts == 4 and cfg.runtime.dtype == 'bfloat16'
  assert 'router_aux_loss_coef' in caplog.text
  with pytest.raises(ConfigError, match='set attention.sliding_window instead'):
    ModelConfig.from_stored_dict({**TINY, 'sliding_window': 4})


@pytest.mark.parametrize('changes,message', [
    ({'moe.num_experts': 4, 'moe.num_experts_per_tok': 5},
     r'ModelConfig\.moe\.num_experts_per_tok must be in \[1, num_experts=4\]'),
    ({'moe.num_experts': -1}, r'ModelConfig\.moe\.num_experts must be >= 0'),
    ({'moe.num_experts': 4, 'moe.router_groups': 3}, r'ModelConfig\.moe\.num_experts \(4\)'),
    ({'moe.num_experts': 4, 'moe.capacity_factor': 0.0}, r'ModelConfig\.moe\.capacity_factor'),
    ({'moe.num_experts': 4, 'moe.layer_step': 0}, r'ModelConfig\.moe\.layer_step must be >= 1'),
    ({'mla.kv_lora_rank': 0}, r'ModelConfig\.mla\.kv_lora_rank must be > 0'),
    ({'mla.qk_rope_head_dim': 3}, r'ModelConfig\.mla\.qk_rope_head_dim \(3\) must be even'),
    ({'mtp.num_layers': -1}, r'ModelConfig\.mtp\.num_layers must be >= 0'),
    ({'runtime.remat_policy': 'most'}, r"ModelConfig\.runtime\.remat_policy = 'most' is invalid"),
    ({'moe.dispatch': 'sparse'}, r"ModelConfig\.moe\.dispatch = 'sparse' is invalid"),
])
def test_group_validation_names_the_dotted_field(changes, message):
  """Group checks run in the group and name the field by its dotted path."""
  with pytest.raises(ConfigError, match=message):
    _tiny(**changes)


@pytest.mark.parametrize('changes,message', [
    ({'moe.num_experts': 4, 'moe.first_k_dense_layers': 2},
     r'ModelConfig\.moe\.first_k_dense_layers \(2\) leaves no MoE layer of num_layers=2'),
    ({'moe.num_experts': 4, 'mlp_gated': False}, r'ModelConfig\.moe\.num_experts > 0 needs '
     'mlp_gated=True'),
    ({'moe.num_experts': 4, 'moe.layer_step': 2, 'runtime.scan_layers': True},
     r'ModelConfig\.runtime\.scan_layers=True needs ModelConfig\.moe\.layer_step=1'),
])
def test_cross_group_validation(changes, message):
  """Checks that need the rest of the model stay in ModelConfig."""
  with pytest.raises(ConfigError, match=message):
    _tiny(**changes)


def test_group_docstrings_document_every_field():
  """Every group field has a line in its class's Attributes section (the CLI's --help)."""
  import dataclasses  # noqa: PLC0415
  for cls in (MoEConfig, MLAConfig, MTPConfig, RuntimeConfig, ModelConfig, TrainConfig):
    lines = cls.__doc__.split('Attributes:')[1].splitlines()
    documented = {name.strip() for line in lines
                  if line.startswith('    ') and not line.startswith('     ') and ':' in line
                  for name in line.split(':')[0].split(',')}
    for field in dataclasses.fields(cls):
      assert field.name in documented, (cls.__name__, field.name)

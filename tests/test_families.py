"""The family registry: every family module is found, its spec is consistent with its
presets, and docs/families.md is the text generated from the specs."""

import ast
import json
import os
import sys
import textwrap

import pytest

from maxnnx.config import ModelConfig
from maxnnx.models import registry
from maxnnx.models.families_doc import REGENERATE, families_markdown
from maxnnx.models.hf import HFConfig
from maxnnx.models.pretrained import config_from_pretrained
from maxnnx.models.registry import FAMILIES, PRESETS, FamilySpec, discover, specs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, 'maxnnx', 'models')
_MISSING = object()


def _defines_spec(path: str) -> bool:
  tree = ast.parse(open(path).read(), path)
  return any(isinstance(node, ast.Assign) and any(
      isinstance(t, ast.Name) and t.id == 'SPEC' for t in node.targets) for node in tree.body)


def _value(obj, dotted: str):
  for part in dotted.split('.'):
    obj = getattr(obj, part, _MISSING) if obj is not None else _MISSING
  return obj


def test_committed_families_md_is_generated():
  with open(os.path.join(ROOT, 'docs', 'families.md')) as f:
    committed = f.read()
  assert committed == families_markdown(), (
      f'docs/families.md is out of date with the family specs; regenerate it: {REGENERATE}')


def test_every_family_module_on_disk_is_registered():
  on_disk = {name[:-3] for name in os.listdir(MODELS)
             if name.endswith('.py') and _defines_spec(os.path.join(MODELS, name))}
  assert on_disk == set(specs()) == set(FAMILIES)
  assert len(on_disk) >= 14


@pytest.mark.parametrize('name', sorted(specs()))
def test_family_has_presets_that_build_on_its_differences(name):
  spec = specs()[name]
  assert spec.presets, f'family {name} declares no preset'
  assert spec.hf.name == name and spec.description
  defaults = ModelConfig()
  for key, value in spec.flat_differences().items():
    assert _value(defaults, key) != value, f'{name}: {key}={value!r} is the default already'
  for preset, build in spec.presets.items():
    cfg = build()
    assert cfg.family == name and PRESETS[preset] is build
    for key, value in spec.flat_differences().items():
      assert _value(cfg, key) == value, f'preset {preset} overrides {key} of its family'


def test_presets_belong_to_the_expected_families():
  assert registry.FAMILY_OF_PRESET['tiny'] == 'llama'
  assert registry.FAMILY_OF_PRESET['tiny-moe'] == 'mixtral'
  assert registry.FAMILY_OF_PRESET['kimi-k2'] == 'deepseek_v3'
  assert sum(len(s.presets) for s in specs().values()) == len(PRESETS)


def test_config_merges_nested_groups_into_the_differences():
  spec = specs()['gpt_oss']
  cfg = spec.config(num_layers=2, layer_types=('sliding', 'full'), moe={'num_experts': 4})
  assert cfg.family == 'gpt_oss' and cfg.moe.num_experts == 4
  assert cfg.moe.num_experts_per_tok == 4 and cfg.moe.swiglu_limit == 7.0
  assert cfg.rope.scaling == 'yarn'


def _write_package(tmp_path, name: str, modules: dict[str, str]) -> str:
  package = tmp_path / name
  package.mkdir()
  (package / '__init__.py').write_text('')
  for module, text in modules.items():
    (package / f'{module}.py').write_text(textwrap.dedent(text))
  return name


NEW_FAMILY = '''
  """A family only this test knows: Llama with q/k norms."""
  from maxnnx.models import llama
  from maxnnx.models.hf import Family
  from maxnnx.models.registry import FamilySpec

  def newfam_tiny():
    """A tiny newfam model."""
    return SPEC.config(num_layers=2)

  SPEC = FamilySpec('newfam', 'Llama with q/k norms.', Family(
      'newfam', ('newfam',), 'NewfamForCausalLM', llama.config_from_hf, llama.config_to_hf),
      differences={'attention': {'qk_norm': 'head'}}, presets={'newfam-tiny': newfam_tiny})
'''


def test_a_new_module_with_a_spec_is_discovered(tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(tmp_path))
  package = _write_package(tmp_path, 'fake_models_new', {
      'newfam': NEW_FAMILY, 'helpers': 'X = 1\n'})
  try:
    found = discover(package)
  finally:
    for module in [m for m in sys.modules if m.startswith(package)]:
      del sys.modules[module]
  assert list(found) == ['newfam'] and isinstance(found['newfam'], FamilySpec)
  cfg = found['newfam'].presets['newfam-tiny']()
  assert (cfg.family, cfg.attention.qk_norm, cfg.num_layers) == ('newfam', 'head', 2)


def test_discovery_refuses_a_preset_declared_twice(tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(tmp_path))
  twin = NEW_FAMILY.replace("'newfam'", "'twin'").replace("('newfam',)", "('twin',)")
  package = _write_package(tmp_path, 'fake_models_twice', {'newfam': NEW_FAMILY, 'twin': twin})
  try:
    with pytest.raises(ValueError, match="preset 'newfam-tiny' is already declared"):
      discover(package)
  finally:
    for module in [m for m in sys.modules if m.startswith(package)]:
      del sys.modules[module]


# The attention keys of each fixture's config.json (written by transformers) that its
# family maps into ModelConfig.attention, and the fields they become.
ATTENTION_ROUND_TRIPS = {
    'gemma2': (('sliding_window', 'attn_logit_softcapping', 'query_pre_attn_scalar',
                'attention_bias', 'layer_types'),
               {'sliding_window': 8, 'logit_softcap': 5.0, 'query_scale': 24**-0.5}),
    'gemma3': (('sliding_window', 'query_pre_attn_scalar', 'attention_bias', 'layer_types'),
               {'sliding_window': 8, 'qk_norm': 'head', 'query_scale': 48**-0.5}),
    'gpt_oss': (('sliding_window', 'attention_bias', 'layer_types'),
                {'sliding_window': 8, 'sinks': True, 'qkv_bias': True, 'out_bias': True}),
    'olmo3': (('sliding_window', 'attention_bias', 'layer_types'),
              {'sliding_window': 8, 'qk_norm': 'projection'}),
    'llama4': (('attention_chunk_size', 'attn_temperature_tuning', 'floor_scale', 'attn_scale',
                'no_rope_layers', 'use_qk_norm', 'attention_bias'),
               {'chunk_size': 8, 'temperature_tuning': True, 'temperature_floor': 4.0,
                'nope_layers': (3,), 'qk_norm': 'l2'}),
}


@pytest.mark.parametrize('name', sorted(ATTENTION_ROUND_TRIPS))
def test_attention_settings_survive_hf_config_round_trip(name):
  """config.json -> ModelConfig.attention -> config.json keeps the attention keys the
  fixture's transformers config wrote, and reading the export back gives the same config."""
  directory = os.path.join(ROOT, 'tests', 'fixtures', 'hf', name)
  with open(os.path.join(directory, 'config.json')) as f:
    hf = json.load(f)
  hf = hf.get('text_config', hf)
  keys, fields = ATTENTION_ROUND_TRIPS[name]
  cfg = config_from_pretrained(directory)
  for field, value in fields.items():
    assert getattr(cfg.attention, field) == pytest.approx(value), field
  family = FAMILIES[cfg.family]
  exported = family.config_to_hf(cfg)
  for key in keys:
    assert exported[key] == hf[key], key
  assert family.config_from_hf(HFConfig(exported, 'config.json', family.defaults)) == cfg

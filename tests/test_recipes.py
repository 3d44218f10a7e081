"""The recipes of ``maxnnx train``: one module per method, all behind one protocol."""

import dataclasses
import importlib
import inspect
import pathlib
import pkgutil
import re

import pytest

from maxnnx import cli, recipes
from maxnnx.recipes.base import Recipe
from maxnnx.rl import GRPOConfig
from maxnnx.train.distillation import DistillationObjective
from maxnnx.train.preference import DPOObjective

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(m.name for m in pkgutil.iter_modules(recipes.__path__) if m.name != 'base')
PROTOCOL = ('prepare', 'adjust_model', 'template', 'data', 'objective', 'attach', 'record')


def _signature(function) -> list[str]:
  return list(inspect.signature(function).parameters)


@pytest.mark.parametrize('module', MODULES)
def test_each_recipe_module_holds_one_recipe_of_the_protocol(module):
  recipe = importlib.import_module(f'maxnnx.recipes.{module}').RECIPE
  assert isinstance(recipe, Recipe)
  assert recipes.RECIPES[recipe.name] is recipe and recipe.name in cli.COMMANDS
  for name in PROTOCOL:
    assert _signature(getattr(recipe, name)) == _signature(getattr(Recipe(), name)), name
  for key, (default, doc) in recipe.keys.items():
    assert default is not None and doc.strip(), key
  assert set(recipe.unrecorded) <= set(recipe.keys)
  assert isinstance(recipe.label, str)


def test_every_training_command_has_a_recipe_module():
  assert set(recipes.RECIPES) == {'train', 'sft', 'dpo', 'distill', 'grpo'}
  assert len(MODULES) == len(recipes.RECIPES)


def test_recipe_keys_take_their_defaults_from_the_library():
  grpo = recipes.GRPO.keys
  for field in dataclasses.fields(GRPOConfig):
    if field.name != 'rollouts_jsonl':
      assert grpo[field.name][0] == field.default, field.name
  for recipe, objective in ((recipes.DPO, DPOObjective), (recipes.DISTILL, DistillationObjective)):
    parameters = inspect.signature(objective).parameters
    own = {k for k in recipe.keys
           if k in parameters and parameters[k].default is not inspect.Parameter.empty}
    assert len(own) >= 3
    for key in own:
      assert recipe.keys[key][0] == parameters[key].default, key


def test_a_recipe_records_what_it_trains_not_how_it_is_watched():
  options = {k: default for k, (default, _) in recipes.GRPO.keys.items()}
  record = recipes.GRPO.record(options)
  assert 'reward_timeout_s' not in record and record['loss_type'] == 'grpo'
  assert record['num_generations'] == GRPOConfig().num_generations
  assert recipes.PRETRAIN.record(options) == {}


@pytest.mark.parametrize('name', ['train', 'sft', 'dpo', 'distill', 'grpo'])
def test_help_lists_each_recipe_key_with_its_default(name, capsys):
  recipe = recipes.RECIPES[name]
  assert cli.main([name, '--help']) == 0
  lines = capsys.readouterr().out.splitlines()

  def shown(key):
    row = [line for line in lines if line.startswith(f'  {key} ')]
    assert len(row) == 1, key
    return row[0].split(maxsplit=4)[3]

  if recipe.keys:
    assert f'{name}:' in lines
  for key, (default, _) in recipe.keys.items():
    assert shown(key) == repr(default), key
  for key, default in {**recipe.run_defaults, **recipe.train_defaults}.items():
    assert shown(key) == repr(default), key


def test_no_branch_on_a_recipe_name_remains():
  branch = re.compile(r'(recipe|self)\.name\s*(==|!=|in\b)|(?<!for )\bname in \(')
  for path in [ROOT / 'maxnnx' / 'cli.py', *(ROOT / 'maxnnx' / 'recipes').glob('*.py')]:
    for number, line in enumerate(path.read_text().splitlines(), 1):
      assert not branch.search(line), f'{path.name}:{number}: {line.strip()}'

"""The design's import rules (``[tool.importlinter]`` in pyproject.toml) hold."""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _lint_imports(cwd: pathlib.Path, extra_path: str = '') -> subprocess.CompletedProcess:
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(p for p in (extra_path, str(ROOT)) if p)
  code = 'from importlinter.cli import lint_imports_command; lint_imports_command()'
  return subprocess.run([sys.executable, '-c', code], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=300)


def test_every_contract_is_kept():
  result = _lint_imports(ROOT)
  assert result.returncode == 0, result.stdout + result.stderr
  assert 'broken' in result.stdout and ' 0 broken' in result.stdout


def _fake_package(tmp_path: pathlib.Path) -> pathlib.Path:
  files = {
      'fakepkg/__init__.py': '',
      'fakepkg/config.py': 'class _Base: pass\nclass Public: pass\n',
      'fakepkg/layers/__init__.py': '',
      'fakepkg/layers/dense.py': 'from fakepkg.config import Public\n',
      'fakepkg/models/__init__.py': '',
      'fakepkg/models/llama.py': 'from fakepkg import layers\n',
  }
  for name, text in files.items():
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  (tmp_path / 'pyproject.toml').write_text(textwrap.dedent('''
      [tool.importlinter]
      root_package = "fakepkg"
      contract_types = ["private_names: tests.import_contracts.NoPrivateImportsContract"]

      [[tool.importlinter.contracts]]
      name = "layers never import models"
      type = "forbidden"
      source_modules = ["fakepkg.layers"]
      forbidden_modules = ["fakepkg.models"]

      [[tool.importlinter.contracts]]
      name = "no private names"
      type = "private_names"
      root = "fakepkg"
      '''))
  return tmp_path


@pytest.mark.parametrize('violation, broken', [
    (None, ()),
    (('fakepkg/layers/dense.py', 'from fakepkg.models import llama\n'),
     ('layers never import models BROKEN',)),
    (('fakepkg/models/llama.py', 'from fakepkg.config import _Base\n'),
     ('no private names BROKEN', 'imports the private name _Base from fakepkg.config')),
    (('fakepkg/config.py', 'from fakepkg.config import _Base\n'), ()),  # own package: fine
])
def test_contracts_catch_violations(tmp_path, violation, broken):
  root = _fake_package(tmp_path)
  if violation:
    path, line = violation
    with open(root / path, 'a') as f:
      f.write(line)
  result = _lint_imports(root, extra_path=str(root))
  for text in broken:
    assert text in result.stdout, result.stdout + result.stderr
  assert (result.returncode != 0) == bool(broken), result.stdout + result.stderr


def test_training_names_at_top_level_without_eager_import():
  code = textwrap.dedent('''
      import sys
      import maxnnx
      assert 'maxnnx.train' not in sys.modules, 'import maxnnx must not import training'
      from maxnnx import DataConfig, MeshConfig, TrainConfig, Trainer
      import maxnnx.data, maxnnx.train
      assert Trainer is maxnnx.train.Trainer and TrainConfig is maxnnx.train.TrainConfig
      assert DataConfig is maxnnx.data.DataConfig and MeshConfig is maxnnx.config.MeshConfig
      assert all(hasattr(maxnnx, name) for name in maxnnx.__all__)
      ''')
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  result = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr


CLI_MODULES = ('maxnnx.cli', 'maxnnx.cli_keys', 'maxnnx.recipes', 'maxnnx.maxtext_keys')
RUN_INTERNALS = ('maxnnx.train.runner', 'maxnnx.train.run_settings', 'maxnnx.train.run_tokenizer',
                 'maxnnx.train.export')


def _names_imported_from(path: pathlib.Path, module: str) -> set[str]:
  tree = ast.parse(path.read_text(), str(path))
  return {alias.name for node in ast.walk(tree)
          if isinstance(node, ast.ImportFrom) and node.module == module and not node.level
          for alias in node.names}


def test_the_cli_runs_training_through_the_librarys_public_api():
  """``maxnnx.train`` never reaches the command line (directly or through another module),
  and the CLI reaches the run (:func:`maxnnx.train.run`, the run directory, tokenizer and
  export code) only through the names ``maxnnx.train`` exports."""
  import grimp  # noqa: PLC0415

  import maxnnx.train  # noqa: PLC0415
  graph = grimp.build_graph('maxnnx')
  for cli_module in CLI_MODULES:
    assert not graph.chain_exists(importer='maxnnx.train', imported=cli_module,
                                  as_packages=True), cli_module
  modules = [m for m in graph.modules
             if any(m == c or m.startswith(c + '.') for c in CLI_MODULES)]  # recipes' modules
  for cli_module in modules:
    reached = graph.find_modules_directly_imported_by(cli_module) & set(RUN_INTERNALS)
    assert not reached, f'{cli_module} imports {reached}: use maxnnx.train instead'
    path = ROOT / cli_module.replace('.', '/')
    path = path / '__init__.py' if path.is_dir() else path.with_suffix('.py')
    names = _names_imported_from(path, 'maxnnx.train')
    modules = {n for n in names if f'maxnnx.train.{n}' in graph.modules}  # from . import x
    assert not modules & {m.rsplit('.', 1)[1] for m in RUN_INTERNALS}, cli_module
    private = names - modules - set(maxnnx.train.__all__)
    assert not private, f'{cli_module} imports {private} from maxnnx.train (not in __all__)'


def _compared_strings(tree: ast.AST) -> set[str]:
  """Every string constant a comparison in ``tree`` tests against (``x == 'a'``,
  ``x in ('a', 'b')``)."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Compare):
      for side in (node.left, *node.comparators):
        for leaf in ast.walk(side):
          if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
            found.add(leaf.value)
  return found


def test_data_never_branches_on_a_model_family():
  """The data layer decides nothing by family name: chat templates and image prompts are
  the families' own (``FamilySpec.chat_template`` / ``image_inputs``)."""
  from maxnnx.models.registry import specs
  families = set(specs())
  branching = {}
  for path in sorted((ROOT / 'maxnnx' / 'data').rglob('*.py')):
    named = _compared_strings(ast.parse(path.read_text())) & families
    if named:
      branching[path.name] = sorted(named)
  assert not branching, branching
  assert _compared_strings(ast.parse("if family in ('gemma3', 'x'): pass")) == {'gemma3', 'x'}


def test_data_sources_need_no_training_code():
  """The data layer never reaches ``maxnnx.train``, directly or through another module: what
  the Trainer asks of its data is the protocol in ``maxnnx.data.protocol``."""
  import grimp  # noqa: PLC0415

  graph = grimp.build_graph('maxnnx')
  assert 'maxnnx.data.protocol' in graph.modules
  assert not graph.chain_exists(importer='maxnnx.data', imported='maxnnx.train',
                                as_packages=True)

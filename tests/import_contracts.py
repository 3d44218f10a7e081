"""A custom import-linter contract: no private names imported across packages.

``lint-imports``, run from the repository root, loads this module (the ``contract_types``
entry in ``pyproject.toml``; import-linter puts the working directory on ``sys.path``).
A name with a leading underscore is private to the package that defines it:
``from maxnnx.config import _base_helper`` inside ``maxnnx.data`` breaks the contract, the
same import inside ``maxnnx.config`` does not. A "package" is the first component below the
root (``maxnnx.models``, ``maxnnx.train``, ``maxnnx.config``).
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib

from importlinter import Contract, ContractCheck, fields, output


def _package_of(module: str, root: str) -> str:
  parts = module.split('.')
  return '.'.join(parts[:2]) if parts[0] == root and len(parts) > 1 else parts[0]


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
  if not node.level:
    return node.module or ''
  base = module.split('.')
  base = base if is_package else base[:-1]
  base = base[:len(base) - node.level + 1]
  return '.'.join(base + ([node.module] if node.module else []))


def private_imports(root: str) -> list[tuple[str, int, str, str]]:
  """``(module, line, imported module, name)`` for every cross-package private import."""
  spec = importlib.util.find_spec(root)
  top = pathlib.Path(next(iter(spec.submodule_search_locations)))
  found = []
  for path in sorted(top.rglob('*.py')):
    relative = path.relative_to(top.parent).with_suffix('')
    is_package = relative.name == '__init__'
    module = '.'.join(relative.parts[:-1] if is_package else relative.parts)
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
      if not isinstance(node, ast.ImportFrom):
        continue
      source = _resolve(node, module, is_package)
      if not source.startswith(root):
        continue
      crossing = _package_of(source, root) != _package_of(module, root)
      for alias in node.names:
        if crossing and alias.name.startswith('_') and not alias.name.startswith('__'):
          found.append((module, node.lineno, source, alias.name))
  return found


class NoPrivateImportsContract(Contract):
  """No module imports an underscore name from another package of ``root``."""

  root = fields.StringField()

  def check(self, graph, verbose: bool) -> ContractCheck:
    found = private_imports(str(self.root))
    return ContractCheck(kept=not found, metadata={'found': found})

  def render_broken_contract(self, check: ContractCheck) -> None:
    for module, line, source, name in check.metadata['found']:
      output.print_error(f'{module}:{line} imports the private name {name} from {source}')
      output.new_line()

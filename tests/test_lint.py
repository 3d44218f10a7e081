"""The code passes ``ruff check`` with the project's settings (``[tool.ruff]`` in
pyproject.toml), so a style slip fails the suite rather than the next reader."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
  result = subprocess.run([sys.executable, '-m', 'ruff', 'check', '--no-cache', 'maxnnx',
                           'tests', 'benchmarks'], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr

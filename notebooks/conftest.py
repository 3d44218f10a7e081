"""The tutorial notebooks run as tests (nbmake). The three that train for minutes on a CPU are
marked slow (``pytest -m slow`` runs them); the commands they walk through are tested by
default in ``tests/test_cli_finetune.py``, ``tests/test_rl.py`` and ``tests/test_vision_sft.py``."""

import pytest

SLOW_NOTEBOOKS = ('06_finetune.ipynb', '07_grpo.ipynb', '08_vision.ipynb')


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.path.name in SLOW_NOTEBOOKS:
      item.add_marker(pytest.mark.slow)

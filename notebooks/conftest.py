"""The tutorial notebooks run as tests (nbmake). Those that train or compile for most of a minute
or more on a CPU are marked slow (``pytest -m slow`` runs them) to keep the default run under 15
minutes; the APIs they walk through have tests of their own in the default run (MoE kernels in
``tests/test_kernels_ragged_dot.py``, meshes in ``tests/test_parallel.py``, custom layers in
``tests/test_custom_layers.py``, the recipes in ``tests/test_cli_finetune.py``, ``tests/test_rl.py``
and ``tests/test_vision_sft.py``)."""

import pytest

SLOW_NOTEBOOKS = ('02_moe_kernels.ipynb', '04_trainer_on_a_mesh.ipynb', '05_custom_layer.ipynb',
                  '06_finetune.ipynb', '07_grpo.ipynb', '08_vision.ipynb')


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.path.name in SLOW_NOTEBOOKS:
      item.add_marker(pytest.mark.slow)

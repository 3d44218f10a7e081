"""The training methods of the CLI as recipes of ``maxnnx train``: one module per method.

Each command (``train``, ``sft``, ``dpo``, ``distill``, ``grpo``) is ``maxnnx train`` with
other data and another objective, sharing the run directory, checkpoints, resume, metrics
and meshes. Its module holds a :class:`~maxnnx.recipes.base.Recipe`: its own keys (derived
from the objective's or the RL config's fields where they exist), the defaults it changes,
its data pipeline, its objective and what it adds once the Trainer is built. ``sft``,
``dpo`` and ``train`` take ``lora.*`` keys (:class:`~maxnnx.train.lora.LoraConfig`); the
run then writes ``adapter/`` in PEFT's format next to the merged ``final/``.

The recipes sit beside the CLI: they import the library (train, data, rl) and nothing in
the library imports them.
"""

from __future__ import annotations

from maxnnx.recipes import distill, dpo, grpo, pretrain, sft
from maxnnx.recipes.base import Recipe, RecordsRecipe

PRETRAIN: Recipe = pretrain.RECIPE
SFT: Recipe = sft.RECIPE
DPO: Recipe = dpo.RECIPE
DISTILL: Recipe = distill.RECIPE
GRPO: Recipe = grpo.RECIPE
#: Every recipe by its command.
RECIPES: dict[str, Recipe] = {r.name: r for r in (PRETRAIN, SFT, DPO, DISTILL, GRPO)}

__all__ = ['DISTILL', 'DPO', 'GRPO', 'PRETRAIN', 'RECIPES', 'SFT', 'Recipe', 'RecordsRecipe']

"""``maxnnx train``: next-token prediction on a corpus, the recipe the others change.

It keeps every default of :class:`~maxnnx.recipes.base.Recipe`: no keys of its own, the
pre-training data of ``data=`` (a tokenizer is trained on a text corpus when none is given)
and the Trainer's own objective.
"""

from __future__ import annotations

from maxnnx.recipes.base import Recipe


class Pretrain(Recipe):
  """Pre-training: the run as ``maxnnx train`` describes it."""

  name = 'train'

  @property
  def label(self) -> str:
    """Nothing: the opening line of a plain training run has no prefix."""
    return ''


RECIPE = Pretrain()

"""Evaluating a model: lm-evaluation-harness tasks (``maxnnx eval``).

:mod:`maxnnx.evaluation.harness` holds the harness's model backend (registered as
``maxnnx``); it imports ``lm_eval``, an optional dependency, so this package imports it only
when asked (:func:`require_lm_eval`).
"""

from __future__ import annotations

LM_EVAL_MISSING = ("lm-evaluation-harness is not installed: pip install 'maxnnx[eval]' (or "
                   "pip install lm_eval) to evaluate on its tasks.")


def require_lm_eval() -> None:
  """Import ``lm_eval``, or raise an ``ImportError`` naming the extra that installs it."""
  try:
    import lm_eval  # noqa: F401, PLC0415
  except ImportError:
    raise ImportError(LM_EVAL_MISSING) from None


__all__ = ['LM_EVAL_MISSING', 'require_lm_eval']

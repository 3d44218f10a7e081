"""Reward functions: plain Python callables, TRL's convention.

A reward function takes the batch's prompts and completions (lists of strings,
one per completion) and the prompt file's other columns as keyword arguments
(one value per completion), and returns one number per completion::

  def exact_match(prompts, completions, answer, **kwargs):
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]

``None`` for a completion means the function does not apply to it (counted as
0 in the weighted total, left out of the function's mean). :class:`Rewards`
calls several functions with weights; a function that raises, returns the
wrong number of values or a non-number, or does not return within a time limit,
stops the run with a one-line :class:`RewardError` naming it.
:func:`load_reward` finds a function from ``path/to/file.py:name`` or
``package.module:name``, as the CLI's ``reward=`` key gives it.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from maxnnx.train import preemption
from maxnnx.train.trainer import TrainingError

RewardFn = Callable[..., Sequence[float | None]]


class RewardError(TrainingError):
  """A reward function failed, hung or returned something unusable; the one-line message
  names it."""


def load_reward(spec: str) -> RewardFn:
  """The function ``spec`` names: ``path/to/file.py:function`` or ``module.path:function``."""
  where, sep, name = spec.rpartition(':')
  if not sep or not where or not name.isidentifier():
    raise ValueError(f'reward={spec!r}: give path/to/file.py:function or module:function.')
  if where.endswith('.py') or os.sep in where or '/' in where:
    if not os.path.isfile(where):
      raise FileNotFoundError(f'reward={spec!r}: no such file {where!r}.')
    module_name = '_maxnnx_reward_' + re.sub(r'\W', '_', os.path.abspath(where))
    module_spec = importlib.util.spec_from_file_location(module_name, where)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
  else:
    try:
      module = importlib.import_module(where)
    except ImportError as e:
      raise ValueError(f'reward={spec!r}: cannot import {where!r} ({e}).') from None
  fn = getattr(module, name, None)
  if not callable(fn):
    raise ValueError(f'reward={spec!r}: {where} has no function {name!r}.')
  return fn


def reward_name(fn: Callable) -> str:
  """The name a reward's metrics carry: its ``__name__`` (or its class's)."""
  return getattr(fn, '__name__', None) or type(fn).__name__


class Rewards:
  """Several reward functions with weights.

  Args:
    functions: the callables (or ``load_reward`` specs).
    weights: one weight per function (default all 1).

  Calling it with ``(prompts, completions, columns)`` returns a ``[num_functions,
  N]`` float64 array (NaN where a function returned ``None``); :meth:`total` is
  the weighted sum per completion.
  """

  def __init__(self, functions: RewardFn | str | Sequence[RewardFn | str],
               weights: Sequence[float] | None = None):
    if callable(functions) or isinstance(functions, str):
      functions = [functions]
    self.functions = [load_reward(f) if isinstance(f, str) else f for f in functions]
    if not self.functions:
      raise ValueError('Give at least one reward function.')
    self.weights = np.ones(len(self.functions)) if weights is None else np.asarray(weights,
                                                                                   np.float64)
    if self.weights.shape != (len(self.functions),):
      raise ValueError(f'{len(self.functions)} reward functions but {self.weights.size} '
                       'reward weights; give one weight per function.')
    names = [reward_name(f) for f in self.functions]
    self.names = [n if names.count(n) == 1 else f'{n}_{i}' for i, n in enumerate(names)]

  def __call__(self, prompts: Sequence[str], completions: Sequence[str],
               columns: dict[str, Sequence] | None = None, *,
               timeout_s: float | None = None) -> np.ndarray:
    """The ``[functions, completions]`` rewards; each function must return within
    ``timeout_s`` seconds (``None``: no limit)."""
    out = np.zeros((len(self.functions), len(completions)))
    for row, (name, fn) in enumerate(zip(self.names, self.functions)):
      values = _call_reward(name, fn, (list(prompts), list(completions)), columns or {},
                            timeout_s)
      values = list(values) if values is not None else None
      if values is None or len(values) != len(completions):
        got = 'None' if values is None else f'{len(values)} values'
        raise RewardError(f'Reward function {name!r} returned {got} for {len(completions)} '
                          'completions; it must return one number (or None) per completion.')
      for col, value in enumerate(values):
        if value is None:
          out[row, col] = math.nan
          continue
        try:
          out[row, col] = float(value)
        except (TypeError, ValueError):
          raise RewardError(f'Reward function {name!r} returned {value!r} for completion '
                            f'{col}; rewards must be numbers or None.') from None
        if not math.isfinite(out[row, col]):
          raise RewardError(f'Reward function {name!r} returned {value!r} for completion '
                            f'{col}; rewards must be finite.')
    return out

  def total(self, per_function: np.ndarray) -> np.ndarray:
    """The weighted sum over functions per completion (``None`` counting 0)."""
    return np.nansum(per_function * self.weights[:, None], axis=0)


#: Seconds between two looks at a stop request while a reward function runs.
_STOP_POLL_S = 0.1


def _call_reward(name: str, fn: RewardFn, args: tuple, kwargs: dict,
                 timeout_s: float | None) -> Sequence[float | None]:
  """``fn(*args, **kwargs)`` in a worker thread, given ``timeout_s`` seconds to return.

  Raises:
    RewardError: ``fn`` raised (its first line is kept) or did not return in time (the thread
      is left to finish on its own: Python cannot stop it, and it does not keep the process up).
    StopRequested: SIGTERM or SIGINT came while waiting (the run stops before this step
      rather than waiting out ``timeout_s``).
  """
  result: dict = {}

  def call():
    try:
      result['values'] = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 (any failure of user code stops the run, named)
      result['error'] = e

  worker = threading.Thread(target=call, name=f'reward-{name}', daemon=True)
  worker.start()
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  while worker.is_alive() and (deadline is None or time.monotonic() < deadline):
    signal_name = preemption.requested()
    if signal_name:
      raise preemption.StopRequested(f'{signal_name} while reward function {name!r} ran')
    worker.join(_STOP_POLL_S if deadline is None else
                max(0.0, min(_STOP_POLL_S, deadline - time.monotonic())))
  if worker.is_alive():
    raise RewardError(f'Reward function {name!r} did not return within {timeout_s:g} s '
                      '(reward_timeout_s); make it faster or raise reward_timeout_s.')
  if 'error' in result:
    e = result['error']
    first = (str(e).strip().splitlines() or [''])[0]
    raise RewardError(f'Reward function {name!r} raised {type(e).__name__}'
                      + (f': {first}' if first else '')) from e
  return result['values']


# --- rewards for the shipped tasks ------------------------------------------------------

def exact_match(prompts, completions, answer, **kwargs) -> list[float]:
  """1 where the completion equals the record's ``answer`` (whitespace stripped), else 0."""
  del prompts, kwargs
  return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def one_word_in_capitals(prompts, completions, **kwargs) -> list[float]:
  """1 where the completion is one word of capital letters (a speaker's name), else 0."""
  del prompts, kwargs
  return [float(bool(re.fullmatch(r'[A-Z][A-Z\-]*', c.strip()))) for c in completions]


__all__ = ['RewardError', 'Rewards', 'exact_match', 'load_reward', 'one_word_in_capitals',
           'reward_name']

"""What a training loop asks of its data: :class:`DataSource` and three optional capabilities.

A data source is an iterator of batches: ``next(source)`` returns the next one (a dict of
``[batch, seq_len]`` arrays, or ``[batch, seq_len + 1]`` token windows). A plain generator of
batch dicts is one. Beyond that a source may offer, each found with ``isinstance``:

- :class:`Checkpointable`: ``get_state()`` / ``set_state(state)``, its position in the data,
  saved with a checkpoint so a resumed run continues where it stopped;
- :class:`HasEvalBatches`: ``eval_batches(n)``, a fixed held-out split;
- :class:`ReportsMetrics`: ``pop_metrics()``, host-side metrics of the batch just taken (RL
  rollouts: rewards, completion lengths), joined to that step's record.

:class:`~maxnnx.data.Pipeline`, :class:`~maxnnx.data.TokenWindows` and the RL rollouts
implement what applies to them; :func:`check_data_source` refuses anything else with one line
naming what is missing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class DataSource(Protocol):
  """An iterator of training batches: the one thing a Trainer needs of its ``data``."""

  def __next__(self) -> Any:
    """The next batch (raises ``StopIteration`` when the data ends)."""


@runtime_checkable
class Checkpointable(Protocol):
  """A source whose position in the data can be saved and restored."""

  def get_state(self) -> Any:
    """The position in the data, JSON-serialisable."""

  def set_state(self, state: Any) -> None:
    """Continue exactly after the batch where :meth:`get_state` was taken."""


@runtime_checkable
class HasEvalBatches(Protocol):
  """A source with a held-out split."""

  def eval_batches(self, num_batches: int) -> list:
    """``num_batches`` held-out batches, the same on every call."""


@runtime_checkable
class ReportsMetrics(Protocol):
  """A source that measures something about each batch it makes."""

  def pop_metrics(self) -> dict[str, float]:
    """Host-side metrics of the batch just returned by ``next``."""


def check_data_source(data: Any, field: str = 'data') -> DataSource:
  """``data`` when it is a :class:`DataSource`, else a one-line ``TypeError`` naming the fix.

  Args:
    data: the object given as training data.
    field: the argument's name in the message (``data`` for ``Trainer(data=...)``).

  Raises:
    TypeError: ``data`` has no ``__next__`` (a list, a dataset, a source of another kind).
  """
  if isinstance(data, DataSource):
    return data
  if isinstance(data, Iterable):
    fix = f'pass {field}=iter(...) to take its items as batches'
  else:
    fix = 'give an iterator (e.g. a generator) of batch dicts'
  raise TypeError(f'{field}= must be a data source, an iterator of batches with __next__ '
                  f'(maxnnx.data.DataSource), but a {type(data).__name__} has no __next__; '
                  f'{fix}.')


__all__ = ['Checkpointable', 'DataSource', 'HasEvalBatches', 'ReportsMetrics',
           'check_data_source']

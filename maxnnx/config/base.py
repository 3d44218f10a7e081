"""The validated-config machinery every maxnnx config is built on.

:class:`ValidatedConfig` type-checks every field of a frozen dataclass from its annotation,
builds configs from plain dicts (recursing into nested configs) and rejects unknown keys with
the nearest valid name.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any, ClassVar, Literal

import jax.numpy as jnp


class ConfigError(ValueError):
  """A configuration value is missing, unknown or of the wrong type."""


_DTYPES = ('float32', 'bfloat16', 'float16', 'float64')


def _nearest(name: str, choices) -> str:
  match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
  return f" Did you mean '{match[0]}'?" if match else ''


def _check_type(value: Any, annotation: Any) -> bool:
  """True if ``value`` conforms to the (resolved) type ``annotation``."""
  origin = typing.get_origin(annotation)
  if annotation is Any:
    return True
  if origin is Literal:
    return value in typing.get_args(annotation)
  if origin in (typing.Union, types.UnionType):
    return any(_check_type(value, a) for a in typing.get_args(annotation))
  if annotation is type(None):
    return value is None
  if origin is tuple:
    args = typing.get_args(annotation)
    if not isinstance(value, tuple):
      return False
    if len(args) == 2 and args[1] is Ellipsis:
      return all(_check_type(v, args[0]) for v in value)
    return len(args) == len(value) and all(_check_type(v, a) for v, a in zip(value, args))
  if annotation is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if annotation is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if isinstance(annotation, type):
    return isinstance(value, annotation)
  return True


def _describe(annotation: Any) -> str:
  origin = typing.get_origin(annotation)
  if origin is Literal:
    return 'one of ' + ', '.join(repr(a) for a in typing.get_args(annotation))
  if origin in (typing.Union, types.UnionType):
    return ' or '.join(_describe(a) for a in typing.get_args(annotation))
  if annotation is type(None):
    return 'None'
  return getattr(annotation, '__name__', str(annotation))


class ValidatedConfig:
  """Mixin: type-check every field after construction; build from dicts.

  Subclasses may set ``_PATH`` (how error messages name the class, e.g.
  ``ModelConfig.moe``) and ``_MOVED`` (a former field name -> where that setting
  lives now, e.g. ``'sliding_window'`` -> ``'attention.sliding_window'``): such a
  key is refused like any unknown one, and the error names its new home.
  """

  _PATH: ClassVar[str | None] = None
  _MOVED: ClassVar[dict[str, str]] = {}

  def __post_init__(self):
    hints = typing.get_type_hints(type(self))
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, list):  # lists from YAML/JSON become tuples
        value = tuple(value)
        object.__setattr__(self, field.name, value)
      nested = _nested_config_type(hints[field.name])
      if nested is not None and isinstance(value, dict):
        value = nested.from_dict(value)
        object.__setattr__(self, field.name, value)
      if not _check_type(value, hints[field.name]):
        raise ConfigError(
            f'{self._name()}.{field.name} = {value!r} is invalid: '
            f'expected {_describe(hints[field.name])}.')
    self._validate()

  @classmethod
  def _name(cls) -> str:
    return cls._PATH or cls.__name__

  def _validate(self):
    """Cross-field checks; subclasses override."""

  @classmethod
  def from_dict(cls, data: dict[str, Any]):
    """Build from a plain dict, recursing into nested config fields.

    Keys may be field names or dotted paths into nested configs
    (``'moe.num_experts'``); a dict given for a nested config updates that
    config's defaults.

    Raises:
      ConfigError: on an unknown key (naming the nearest valid one) or a bad value.
    """
    if isinstance(data, cls):
      return data
    if not isinstance(data, dict):
      raise ConfigError(f'{cls.__name__} expects a dict, got {type(data).__name__}.')
    return cls._build({}, data)

  def to_dict(self) -> dict[str, Any]:
    """A plain, JSON-serialisable dict (nested configs become dicts)."""
    return dataclasses.asdict(self)

  def replace(self, **changes):
    """A copy with ``changes`` applied (validated like ``from_dict``).

    A dict given for a nested config (``moe={'num_experts': 4}``) is merged
    into the current one; dotted keys (``**{'moe.num_experts': 4}``) work as in
    :meth:`from_dict`.
    """
    current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return type(self)._build(current, changes)

  @classmethod
  def _build(cls, current: dict[str, Any], changes: dict[str, Any]):
    """``cls(**current)`` with ``changes`` (plain, dotted or nested keys) applied."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs, nested_changes = dict(current), {}
    for key, value in changes.items():
      head, _, rest = key.partition('.')
      if head not in names:
        raise ConfigError(f"Unknown {cls._name()} field '{key}'.{cls._hint(key, names)}")
      nested = _nested_config_type(hints[head])
      if rest:
        if nested is None:
          raise ConfigError(f"{cls._name()}.{head} has no field '{rest}' ('{key}').")
        nested_changes.setdefault(head, {})[rest] = value
      elif nested is not None and isinstance(value, dict):
        nested_changes.setdefault(head, {}).update(value)
      else:
        kwargs[head] = value
        nested_changes.pop(head, None)
    for head, group_changes in nested_changes.items():
      nested = _nested_config_type(hints[head])
      base = kwargs.get(head)
      kwargs[head] = (base.replace(**group_changes) if isinstance(base, nested)
                      else nested.from_dict(group_changes))
    return cls(**kwargs)

  @classmethod
  def _hint(cls, key: str, names: list[str]) -> str:
    """What an unknown-key error suggests: the new home of a moved name (``_MOVED``), else
    the nearest field (a near miss of a moved name points at its new home too)."""
    if key in cls._MOVED:
      return f' It moved: set {cls._MOVED[key]} instead.'
    match = difflib.get_close_matches(key, [*names, *cls._MOVED], n=1, cutoff=0.5)
    return f" Did you mean '{cls._MOVED.get(match[0], match[0])}'?" if match else ''


def _nested_config_type(annotation):
  for a in (annotation, *typing.get_args(annotation)):
    if isinstance(a, type) and issubclass(a, ValidatedConfig):
      return a
  return None


def attribute_docs(cls) -> dict[str, str]:
  """``{field: doc}`` from the ``Attributes:`` section of a class docstring."""
  docs, current = {}, None
  text = (cls.__doc__ or '').split('Attributes:', 1)[-1]
  for line in text.splitlines():
    match = re.match(r'\s{4}([\w, ]+):\s*(.*)', line)
    if match and not line.startswith(' ' * 6):
      names = [n.strip() for n in match.group(1).split(',')]
      current = names
      for name in names:
        docs[name] = match.group(2)
    elif current and line.strip():
      for name in current:
        docs[name] += ' ' + line.strip()
  return docs


def settings_table(cls) -> dict[str, tuple[Any, str]]:
  """``{field: (default, doc)}`` of a flat config dataclass: its fields' defaults and the
  lines of its ``Attributes:`` section."""
  docs = attribute_docs(cls)
  return {f.name: (f.default, docs.get(f.name, '')) for f in dataclasses.fields(cls)}


def resolve_dtype(name: str):
  """``jnp.dtype`` for a dtype name, with an error naming the valid ones."""
  if name not in _DTYPES:
    raise ConfigError(f"Unknown dtype '{name}'.{_nearest(name, _DTYPES)} "
                      f'Valid: {", ".join(_DTYPES)}.')
  return jnp.dtype(name)


def subtree(options: dict[str, Any], prefix: str) -> dict[str, Any]:
  """The dotted keys under ``prefix`` as a nested dict (``model.rope.x`` -> ``{'rope': {..}}``).

  Args:
    options: settings by dotted key (``{'model.rope.theta': 5e5, 'steps': 3}``).
    prefix: the group's prefix with its dot (``'model.'``).
  """
  tree: dict[str, Any] = {}
  for key, value in options.items():
    if not key.startswith(prefix):
      continue
    *parents, leaf = key[len(prefix):].split('.')
    node = tree
    for parent in parents:
      if not isinstance(node.get(parent), dict):  # `x=none` then `x.y=1`: the fields win
        node[parent] = {}
      node = node[parent]
    if not (isinstance(node.get(leaf), dict) and value is None):
      node[leaf] = value
  return tree


def dotted_fields(config: ValidatedConfig, prefix: str = '') -> dict[str, Any]:
  """Every field of ``config`` by dotted key (nested configs as ``group.field``).

  Args:
    config: the config to flatten.
    prefix: put before every key (``'mesh.'``).
  """
  flat = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if isinstance(value, ValidatedConfig):
      flat.update(dotted_fields(value, f'{prefix}{field.name}.'))
    else:
      flat[prefix + field.name] = value
  return flat

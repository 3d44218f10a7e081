"""The ``key=value`` settings of the command line, found by walking config dataclasses.

Every field of a config dataclass is a key; a field holding another config
(``ModelConfig.rope``) becomes dotted keys (``model.rope.theta``), so new
fields and new nested groups appear on the command line, in ``--help`` and in
YAML files with no change here. Values are parsed by the field's type
annotation, and every error is one line naming the nearest valid key or value.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from typing import Any, NamedTuple

from maxnnx.config import ValidatedConfig, subtree  # noqa: F401 (subtree: re-exported)
from maxnnx.config.base import attribute_docs


class UsageError(ValueError):
  """A bad command line: unknown command or key, or a value of the wrong type."""


class Key(NamedTuple):
  """One command-line key.

  Attributes:
    default: the value used when the key is not given.
    doc: what the key means (the field's docstring entry).
    kind: the type annotation values are parsed by.
    group: heading of the key in ``--help``.
    fill: the default is part of the parsed options (``False``: only a key
      given on the command line or in YAML is applied, e.g. model fields, which
      the preset or checkpoint already sets).
  """

  default: Any
  doc: str
  kind: Any
  group: str
  fill: bool = True


def nested_config_type(annotation) -> type | None:
  """The config dataclass a field annotation holds (``RopeConfig | None`` too), or None."""
  for a in (annotation, *typing.get_args(annotation)):
    if isinstance(a, type) and issubclass(a, ValidatedConfig):
      return a
  return None


def _field_default(field: dataclasses.Field, instance) -> Any:
  if instance is not None:
    return getattr(instance, field.name)
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return None


def config_keys(cls, prefix: str, group: str, *, skip=(), fill: bool = True,
                instance=None) -> dict[str, Key]:
  """``{dotted key: Key}`` for every field of config dataclass ``cls``, nested ones included.

  A field holding a config becomes its fields' keys under ``<field>.``; when
  that field may be ``None`` the field itself is a key too (``model.local_rope=none``).
  """
  hints = typing.get_type_hints(cls)
  docs = attribute_docs(cls)
  keys = {}
  for field in dataclasses.fields(cls):
    if field.name in skip:
      continue
    default = _field_default(field, instance)
    nested = nested_config_type(hints[field.name])
    name = prefix + field.name
    if nested is None or not isinstance(default, nested):
      keys[name] = Key(default, docs.get(field.name, ''), hints[field.name], group, fill)
    if nested is not None:
      inner = default if isinstance(default, nested) else None
      keys.update(config_keys(nested, name + '.', group, fill=fill, instance=inner))
  return keys


def type_name(kind: Any) -> str:
  """A short name (no spaces) of a type annotation: ``int``, ``rms|layer``, ``tuple[int,...]``."""
  origin = typing.get_origin(kind)
  if origin is typing.Literal:
    return '|'.join(str(a) for a in typing.get_args(kind))
  if origin in (typing.Union, types.UnionType):
    return '|'.join(type_name(a) for a in typing.get_args(kind))
  if kind is type(None):
    return 'None'
  if origin is tuple:
    args = typing.get_args(kind)
    if len(args) == 2 and args[1] is Ellipsis:
      return f'tuple[{type_name(args[0])},...]'
    return 'tuple[' + ','.join(type_name(a) for a in args) + ']'
  return getattr(kind, '__name__', str(kind))


def one_line(doc: str, width: int = 110) -> str:
  """The first sentence of a docstring entry, without reST markup, at most ``width`` chars."""
  text = re.sub(r':\w+:`~?([^`]+)`', r'\1', doc).replace('`', '').strip()
  match = re.match(r'(.+?(?<!e\.g)(?<!i\.e)\.)(\s|$)', text)
  text = match.group(1) if match else text
  return text if len(text) <= width else text[:width - 1].rsplit(' ', 1)[0] + ' …'


# ---------------------------------------------------------------------------------------------
# Parsing values by annotation.


def _fail(key: str, raw: Any, kind: Any) -> UsageError:
  hint = ''
  if typing.get_origin(kind) is typing.Literal and isinstance(raw, str):
    match = difflib.get_close_matches(raw, [str(a) for a in typing.get_args(kind)], n=1)
    hint = f" Did you mean '{match[0]}'?" if match else ''
  if isinstance(raw, (str, float)) and str(raw).strip().lower() == 'nan':
    hint = ' (nan is never a valid setting)'
  return UsageError(f'{key}={raw!r}: expected {type_name(kind)}.{hint}')


def _scalar(raw: str, kind: Any) -> Any:
  """``raw`` parsed as the plain type ``kind``; raises ValueError when it does not fit."""
  lowered = raw.strip().lower()
  if kind is bool:
    if lowered in ('true', '1', 'yes', 'on'):
      return True
    if lowered in ('false', '0', 'no', 'off'):
      return False
    raise ValueError(raw)
  if kind is int:
    value = float(raw)
    if not value.is_integer():
      raise ValueError(raw)
    return int(value)
  if kind is float:
    value = float(raw)
    if math.isnan(value):
      raise ValueError(raw)
    return value
  if kind is str:
    return raw
  if kind is type(None):
    if lowered in ('none', 'null', '~'):
      return None
    raise ValueError(raw)
  raise ValueError(raw)


def _split_sequence(raw: str) -> list:
  """``'a,b'``, ``'[a, b]'`` or ``'(a, b)'`` -> items (nested brackets parsed as YAML)."""
  text = raw.strip()
  if text.startswith(('[', '(')):
    import yaml  # noqa: PLC0415
    flow = '[' + text[1:-1] + ']' if text.startswith('(') else text
    try:
      value = yaml.safe_load(flow)
    except yaml.YAMLError:
      raise ValueError(raw) from None
    return list(value) if isinstance(value, list) else [value]
  return [] if not text else [s.strip() for s in text.split(',')]


def _parse(raw: Any, kind: Any) -> Any:
  """``raw`` (a string, or a YAML value) as annotation ``kind``; ValueError when it does not fit."""
  origin = typing.get_origin(kind)
  if kind is Any:
    return raw
  if origin in (typing.Union, types.UnionType):
    for option in sorted(typing.get_args(kind), key=_union_order):
      try:
        return _parse(raw, option)
      except ValueError:
        continue
    raise ValueError(raw)
  if origin is typing.Literal:
    for option in typing.get_args(kind):
      if raw == option or (isinstance(raw, str) and raw == str(option)):
        return option
    raise ValueError(raw)
  if origin is tuple:
    items = _split_sequence(raw) if isinstance(raw, str) else raw
    if not isinstance(items, (list, tuple)):
      raise ValueError(raw)
    args = typing.get_args(kind)
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_parse(item, args[0]) for item in items)
    if len(args) != len(items):
      raise ValueError(raw)
    return tuple(_parse(item, a) for item, a in zip(items, args))
  if nested_config_type(kind) is not None:
    if isinstance(raw, kind):
      return raw
    raise ValueError(raw)
  if isinstance(raw, str):
    return _scalar(raw, kind)
  return _plain(raw, kind)


def _union_order(kind: Any) -> int:
  """Try ``None`` and plain types first, then ``str`` (it takes anything), then tuples."""
  return 2 if typing.get_origin(kind) is tuple else 1 if kind is str else 0


def _plain(raw: Any, kind: Any) -> Any:
  """A non-string YAML value checked against a plain type (ints are floats too)."""
  if kind is type(None) and raw is None:
    return None
  if kind is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
    if math.isnan(raw):
      raise ValueError(raw)
    return float(raw)
  if kind is int and isinstance(raw, int) and not isinstance(raw, bool):
    return raw
  if kind is bool and isinstance(raw, bool):
    return raw
  if kind is str and isinstance(raw, (int, float)) and not isinstance(raw, bool):
    return str(raw)  # e.g. `tokenizer: 123` in YAML
  if isinstance(kind, type) and isinstance(raw, kind):
    return raw
  raise ValueError(raw)


def convert(key: str, raw: Any, kind: Any) -> Any:
  """Parse ``raw`` (a command-line string or a YAML value) as ``kind``.

  Raises:
    UsageError: one line naming the key, the value and what was expected.
  """
  try:
    return _parse(raw, kind)
  except (ValueError, TypeError):
    raise _fail(key, raw, kind) from None


# ---------------------------------------------------------------------------------------------
# Keys: resolving names, reading YAML, parsing a command line.


def nearest_hint(name: str, choices) -> str:
  """`` Did you mean 'x'?`` for the nearest of ``choices``, or ``''``."""
  match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
  return f" Did you mean '{match[0]}'?" if match else ''


def resolve(key: str, keys: dict[str, Key], aliases: dict[str, str]) -> str:
  """The canonical name of ``key``: itself, an alias (``train.steps`` -> ``steps``), or the
  unique nested field of that name (``model.num_experts`` -> ``model.moe.num_experts``).

  Raises:
    UsageError: an unknown key, naming the nearest one.
  """
  if key in keys:
    return key
  for alias, target in aliases.items():
    if key.startswith(alias) and target + key[len(alias):] in keys:
      return target + key[len(alias):]
  head, _, leaf = key.partition('.')
  if leaf and '.' not in leaf:
    matches = [k for k in keys if k.startswith(head + '.') and k.rsplit('.', 1)[-1] == leaf]
    if len(matches) == 1:
      return matches[0]
  plain = next((target + key[len(alias):] for alias, target in aliases.items()
                if key.startswith(alias)), key)  # compare 'train.stesp' as 'stesp'
  hint = nearest_hint(plain, keys)
  raise UsageError(f"unknown key '{key}'." + (hint or ' Run with --help for the keys.'))


def flatten(tree: dict, prefix: str = '') -> list[tuple[str, Any]]:
  """``{'model': {'rope': {'theta': 1}}}`` -> ``[('model.rope.theta', 1)]``."""
  pairs = []
  for key, value in tree.items():
    name = f'{prefix}{key}'
    if isinstance(value, dict):
      pairs.extend(flatten(value, name + '.'))
    else:
      pairs.append((name, value))
  return pairs


def read_yaml(path: str) -> list[tuple[str, Any]]:
  """The ``(dotted key, value)`` pairs of a YAML config file (nested mappings or dotted keys).

  Raises:
    FileNotFoundError: no such file.
    UsageError: malformed YAML or not a mapping, in one line with file and line.
  """
  import yaml  # noqa: PLC0415
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such config file.')
  try:
    with open(path, encoding='utf-8') as f:
      data = yaml.safe_load(f)
  except yaml.YAMLError as e:
    raise UsageError(_yaml_error(path, e)) from None
  except UnicodeDecodeError as e:
    raise UsageError(f'{path}: not UTF-8 (byte {e.start}).') from None
  if data is None:
    return []
  if not isinstance(data, dict):
    raise UsageError(f'{path}: expected a mapping of key: value, got {type(data).__name__}.')
  return flatten(data)


def _yaml_error(path: str, error) -> str:
  mark = getattr(error, 'problem_mark', None)
  where = f'{path}:{mark.line + 1}:{mark.column + 1}' if mark is not None else path
  problem = getattr(error, 'problem', None) or str(error).splitlines()[0]
  context = getattr(error, 'context', None)
  return f'{where}: malformed YAML: {problem}' + (f' ({context})' if context else '') + '.'


def parse(args: list[str], keys: dict[str, Key], aliases: dict[str, str] | None = None,
          *, positional_yaml: bool = True) -> dict[str, Any]:
  """``[config.yml | config=run.yml] key=value ...`` -> ``{canonical key: typed value}``.

  The YAML file's keys come first and command-line keys override them, wherever
  ``config=`` stands. Keys whose :attr:`Key.fill` is set get their defaults;
  others appear only when given.

  Raises:
    UsageError: an unknown key (naming the nearest), a malformed value or YAML file.
    FileNotFoundError: a missing YAML file.
  """
  aliases = aliases or {}
  from_yaml, from_cli = [], []
  for arg in args:
    if '=' not in arg and positional_yaml and arg.endswith(('.yml', '.yaml')):
      from_yaml.extend(read_yaml(arg))
    elif '=' not in arg:
      raise UsageError(f"expected key=value, got '{arg}'. Run with --help for the keys.")
    elif arg.split('=', 1)[0] == 'config' and 'config' not in keys:
      from_yaml.extend(read_yaml(arg.split('=', 1)[1]))
    else:
      from_cli.append(tuple(arg.split('=', 1)))
  values = {k: key.default for k, key in keys.items() if key.fill}
  for name, raw in from_yaml + from_cli:
    canonical = resolve(name, keys, aliases)
    values[canonical] = convert(canonical, raw, keys[canonical].kind)
  return values


def usage_lines(keys: dict[str, Key], headings: dict[str, str] | None = None) -> list[str]:
  """``--help`` lines: the keys grouped under their headings, each with type, default and doc."""
  headings = headings or {}
  groups: dict[str, list[str]] = {}
  for name, key in keys.items():
    default = 'none' if key.default is None else repr(key.default)
    groups.setdefault(key.group, []).append(
        f'  {name:<34} {type_name(key.kind)} = {default}  {one_line(key.doc)}'.rstrip())
  lines = []
  for group, rows in groups.items():
    lines += ['', headings.get(group, group) + ':', *rows]
  return lines


# ---------------------------------------------------------------------------------------------
# Applying parsed keys to configs.


def merge(config: ValidatedConfig, changes: dict[str, Any]) -> ValidatedConfig:
  """``config`` with nested ``changes`` applied: a nested config keeps its other fields
  (``{'rope': {'theta': 5e5}}`` changes only the preset's rope theta)."""
  merged = {}
  for name, value in changes.items():
    current = getattr(config, name, None)
    if isinstance(value, dict) and isinstance(current, ValidatedConfig):
      value = merge(current, value)
    merged[name] = value
  return config.replace(**merged)

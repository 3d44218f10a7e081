"""The family registry: each model family is declared once, in its own module.

A family module (``models/llama.py``, ``models/gemma2.py``…) ends with ``SPEC``, a
:class:`FamilySpec` holding everything about the family: how its architecture differs
from the Llama baseline (the :class:`ModelConfig` defaults), its Hugging Face mapping
and its published sizes. :func:`discover` imports the modules of ``maxnnx.models`` and
collects their ``SPEC``, so adding a family is adding a module: :data:`FAMILIES` and
:data:`PRESETS` are views of what it finds, with no list to keep up to date.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from maxnnx.config import ModelConfig
from maxnnx.models.hf import Family


@dataclasses.dataclass(frozen=True, eq=False)
class FamilySpec:
  """Everything maxnnx knows about one model family.

  Attributes:
    name: the family name (``ModelConfig.family``); also the name of its module.
    description: one line: what the family is, said in terms of Llama.
    hf: the Hugging Face mapping (``config.json`` keys, tensor names, fuse hooks).
    differences: the :class:`ModelConfig` fields every model of the family sets away
      from their defaults, nested groups as dicts (``{'attention': {'qk_norm': 'head'}, 'moe':
      {'num_experts': 8}}``); the presets build on them (:meth:`config`).
    presets: preset name -> a function returning a published model's config, whose
      docstring cites the published size.
    chat_template: the built-in chat template (:data:`maxnnx.data.chat.BUILTIN_TEMPLATES`)
      for the family's checkpoints that store none, or ``None``.
    image_inputs: for a vision-language family, ``(model_config, tokenizer, directory,
      pan_and_scan) -> (image processor, image prompt)`` (see :func:`image_inputs_for`).
  """

  name: str
  description: str
  hf: Family
  differences: dict[str, Any] = dataclasses.field(default_factory=dict)
  presets: dict[str, Callable[[], ModelConfig]] = dataclasses.field(default_factory=dict)
  chat_template: str | None = None
  image_inputs: Callable[..., tuple[Any, Any]] | None = None

  def config(self, **fields: Any) -> ModelConfig:
    """A config of this family: the defaults, then :attr:`differences`, then ``fields``.

    A dict given for a nested group (``moe={'num_experts': 32}``) is merged into the
    group's differences; any other value replaces the difference of that name.
    """
    return ModelConfig.from_dict({'family': self.name, **merge(self.differences, fields)})

  def flat_differences(self) -> dict[str, Any]:
    """:attr:`differences` with nested groups spelt as dotted keys (``moe.num_experts``)."""
    return flatten(self.differences)


def merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
  """``base`` updated by ``changes``, merging the dicts both give for one key."""
  out = dict(base)
  for key, value in changes.items():
    both_dicts = isinstance(value, dict) and isinstance(out.get(key), dict)
    out[key] = merge(out[key], value) if both_dicts else value
  return out


def flatten(fields: dict[str, Any], prefix: str = '') -> dict[str, Any]:
  """Nested dicts as one dict with dotted keys."""
  out = {}
  for key, value in fields.items():
    if isinstance(value, dict) and value:
      out.update(flatten(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def discover(package: str = 'maxnnx.models') -> dict[str, FamilySpec]:
  """The ``SPEC`` of every module of ``package`` that defines one, by family name.

  Raises:
    ValueError: a spec named unlike its module, or two specs claiming the same family,
      preset name or Hugging Face ``model_type``.
  """
  specs: dict[str, FamilySpec] = {}
  owners: dict[tuple[str, str], str] = {}  # (kind, name) -> the family that claims it
  for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__),
                     key=lambda info: info.name):
    if info.ispkg or info.name == '__main__':
      continue
    spec = getattr(importlib.import_module(f'{package}.{info.name}'), 'SPEC', None)
    if not isinstance(spec, FamilySpec):
      continue
    if spec.name != info.name or spec.hf.name != spec.name:
      raise ValueError(f"{package}.{info.name}: SPEC names the family '{spec.name}' (its "
                       f"Hugging Face mapping '{spec.hf.name}'); a family module is named "
                       'after its family.')
    claims = [('preset', p) for p in spec.presets]
    claims += [('model_type', t) for t in spec.hf.model_types]
    for claim in claims:
      if claim in owners:
        raise ValueError(f"{package}.{info.name}: {claim[0]} '{claim[1]}' is already "
                         f"declared by family '{owners[claim]}'.")
      owners[claim] = spec.name
    specs[spec.name] = spec
  return specs


def image_inputs_for(model_config: ModelConfig, tokenizer, directory: str | None = None, *,
                     pan_and_scan: bool = False):
  """``(image processor, image prompt)`` of a vision-language model, as its family says
  (``FamilySpec.image_inputs``): the checkpoint ``directory``'s ``preprocessor_config.json``
  if it has one, else the tower's own image size. ``pan_and_scan`` turns on Gemma 3's crops.

  Raises:
    ValueError: for a model without a tower, a family whose image prompt is unknown, or a
      tokenizer without the image tokens.
  """
  if not model_config.vision.num_layers:
    raise ValueError('the model has no vision tower (ModelConfig.vision.num_layers is 0).')
  spec = specs().get(model_config.family)
  if spec is None or spec.image_inputs is None:
    known = sorted(name for name, s in specs().items() if s.image_inputs is not None)
    raise ValueError(f'the image prompt of {model_config.family!r} models is not known '
                     f'({", ".join(known)}).')
  return spec.image_inputs(model_config, tokenizer, directory, pan_and_scan)


@functools.cache
def specs() -> dict[str, FamilySpec]:
  """Every family of ``maxnnx.models``, by name (discovered once, on first use)."""
  return discover('maxnnx.models')


class _View(Mapping):
  """A read-only mapping computed from :func:`specs` on first use."""

  def __init__(self, build: Callable[[dict[str, FamilySpec]], dict]):
    self._build = build

  @functools.cached_property
  def _items(self) -> dict:
    return self._build(specs())

  def __getitem__(self, key):
    return self._items[key]

  def __iter__(self) -> Iterator:
    return iter(self._items)

  def __len__(self) -> int:
    return len(self._items)

  def __repr__(self) -> str:
    return repr(self._items)


FAMILIES: Mapping[str, Family] = _View(lambda found: {n: s.hf for n, s in found.items()})
"""Family name -> its Hugging Face mapping, for every registered family."""

PRESETS: Mapping[str, Callable[[], ModelConfig]] = _View(
    lambda found: {p: fn for s in found.values() for p, fn in s.presets.items()})
"""Preset name -> the function building its config, for every registered family."""

FAMILY_OF_PRESET: Mapping[str, str] = _View(
    lambda found: {p: s.name for s in found.values() for p in s.presets})
"""Preset name -> the name of the family declaring it."""

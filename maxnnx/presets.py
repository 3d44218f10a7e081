"""Named model presets: the published sizes of every supported family.

A preset is a plain function returning a :class:`~maxnnx.config.ModelConfig`
with the architecture of a released checkpoint (``llama3.1-8b``, ``gemma2-9b``…)
or a small model for tests and tutorials (``tiny``, ``tiny-moe``). Each family
module in ``maxnnx.models`` declares its own presets in its ``SPEC``
(:mod:`maxnnx.models.registry`); this module looks them up by name. Presets leave
numerics (dtypes, ``scan_layers``, attention kernel) at their defaults; override them::

  cfg = get_preset('llama3.1-8b', param_dtype='bfloat16', scan_layers=True)
"""

import difflib
from typing import Any

from maxnnx.config import ConfigError, ModelConfig
from maxnnx.models.registry import PRESETS


def list_presets() -> list[str]:
  """Every preset name, sorted."""
  return sorted(PRESETS)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
  """The :class:`ModelConfig` of preset ``name`` with ``overrides`` applied.

  Args:
    name: a name from :func:`list_presets`, e.g. ``'llama3.1-8b'``.
    **overrides: :class:`ModelConfig` fields to replace, e.g. ``dtype='bfloat16'``.

  Raises:
    ConfigError: unknown preset (naming the nearest one), unknown field
      (naming the nearest field) or an invalid value.
  """
  if name not in PRESETS:
    match = difflib.get_close_matches(name, list(PRESETS), n=1, cutoff=0.0)
    hint = f" Did you mean '{match[0]}'?" if match else ''
    raise ConfigError(f"Unknown preset '{name}'.{hint} "
                      'See maxnnx.presets.list_presets() for all names.')
  cfg = PRESETS[name]()
  return cfg.replace(**overrides) if overrides else cfg


__all__ = ['PRESETS', 'get_preset', 'list_presets']

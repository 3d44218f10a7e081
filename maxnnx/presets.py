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

# MaxText's model names (``model_name=``) for architectures that are presets here under another
# name. Checkpoint variants with the same architecture (pre-trained ``-base`` / ``-pt`` against
# post-trained) share one preset; only ``max_position_embeddings`` may differ from the variant's.
MAXTEXT_ALIASES: dict[str, str] = {
    'deepseek2-16b': 'deepseek-v2-lite',
    'deepseek2-236b': 'deepseek-v2',
    'deepseek3-671b': 'deepseek-v3',
    'deepseek3-671b-2dfsdp': 'deepseek-v3',  # MaxText's sharding / schedule variants of V3
    'deepseek3-671b-batchsplit': 'deepseek-v3',
    'deepseek3.2-671b': 'deepseek-v3.2',
    'gemma4-26b': 'gemma4-26b-a4b',
    'kimi-k2-1t': 'kimi-k2',
    'llama3-405b': 'llama3.1-405b',  # the same shapes (Llama 3's 405B came out as 3.1)
    'olmo3-7b-pt': 'olmo3-7b',
    'qwen3-1.7b-base': 'qwen3-1.7b',
    'qwen3-4b-base': 'qwen3-4b',
    'qwen3-8b-base': 'qwen3-8b',
    'qwen3-14b-base': 'qwen3-14b',
    'qwen3-30b-a3b-base': 'qwen3-30b-a3b',
    # fp8 releases: the same architecture; their block-wise fp8 checkpoints are dequantized
    # as they load (maxnnx.checkpoint.quantized).
    'qwen3.5-35b-a3b-fp8': 'qwen3.5-35b-a3b',
    'qwen3.5-397b-a17b-fp8': 'qwen3.5-397b-a17b',
}


def list_presets(aliases: bool = False) -> list[str]:
  """Every preset name, sorted; with ``aliases``, MaxText's names for them too."""
  return sorted({*PRESETS, *MAXTEXT_ALIASES} if aliases else PRESETS)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
  """The :class:`ModelConfig` of preset ``name`` with ``overrides`` applied.

  Args:
    name: a name from :func:`list_presets`, e.g. ``'llama3.1-8b'``, or MaxText's name for
      one (:data:`MAXTEXT_ALIASES`, e.g. ``'deepseek3-671b'`` for ``'deepseek-v3'``).
    **overrides: :class:`ModelConfig` fields to replace, e.g. ``dtype='bfloat16'``.

  Raises:
    ConfigError: unknown preset (naming the nearest one), unknown field
      (naming the nearest field) or an invalid value.
  """
  name = MAXTEXT_ALIASES.get(name, name)
  if name not in PRESETS:
    match = difflib.get_close_matches(name, list_presets(aliases=True), n=1, cutoff=0.0)
    hint = f" Did you mean '{match[0]}'?" if match else ''
    raise ConfigError(f"Unknown preset '{name}'.{hint} "
                      'See maxnnx.presets.list_presets() for all names.')
  cfg = PRESETS[name]()
  return cfg.replace(**overrides) if overrides else cfg


__all__ = ['MAXTEXT_ALIASES', 'PRESETS', 'get_preset', 'list_presets']

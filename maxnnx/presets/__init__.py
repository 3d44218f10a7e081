"""Named model presets: the published sizes of every supported family.

A preset is a plain function returning a :class:`~maxnnx.config.ModelConfig`
with the architecture of a released checkpoint (``llama3.1-8b``, ``gemma2-9b``…)
or the small ``tiny`` model used by tests and tutorials. Presets leave numerics
(dtypes, ``scan_layers``, attention kernel) at their defaults; override them::

  cfg = get_preset('llama3.1-8b', param_dtype='bfloat16', scan_layers=True)
"""

import difflib
from collections.abc import Callable
from typing import Any

from maxnnx.config import ConfigError, ModelConfig
from maxnnx.presets import (
  deepseek,
  gemma,
  gemma2,
  gemma3,
  llama,
  mistral,
  moe,
  olmo2,
  phi3,
  qwen2,
  qwen3,
)

PRESETS: dict[str, Callable[[], ModelConfig]] = {
    'tiny': llama.tiny,
    'llama2-7b': llama.llama2_7b,
    'llama2-13b': llama.llama2_13b,
    'llama2-70b': llama.llama2_70b,
    'llama3-8b': llama.llama3_8b,
    'llama3-70b': llama.llama3_70b,
    'llama3.1-8b': llama.llama3_1_8b,
    'llama3.1-70b': llama.llama3_1_70b,
    'llama3.1-405b': llama.llama3_1_405b,
    'llama3.3-70b': llama.llama3_3_70b,
    'mistral-7b': mistral.mistral_7b,
    'gemma-2b': gemma.gemma_2b,
    'gemma-7b': gemma.gemma_7b,
    'gemma2-2b': gemma2.gemma2_2b,
    'gemma2-9b': gemma2.gemma2_9b,
    'gemma2-27b': gemma2.gemma2_27b,
    'gemma3-1b': gemma3.gemma3_1b,
    'gemma3-4b': gemma3.gemma3_4b,
    'gemma3-12b': gemma3.gemma3_12b,
    'gemma3-27b': gemma3.gemma3_27b,
    'qwen2.5-0.5b': qwen2.qwen2_5_0_5b,
    'qwen2.5-1.5b': qwen2.qwen2_5_1_5b,
    'qwen2.5-3b': qwen2.qwen2_5_3b,
    'qwen2.5-7b': qwen2.qwen2_5_7b,
    'qwen2.5-14b': qwen2.qwen2_5_14b,
    'qwen2.5-32b': qwen2.qwen2_5_32b,
    'qwen2.5-72b': qwen2.qwen2_5_72b,
    'qwen3-0.6b': qwen3.qwen3_0_6b,
    'qwen3-1.7b': qwen3.qwen3_1_7b,
    'qwen3-4b': qwen3.qwen3_4b,
    'qwen3-8b': qwen3.qwen3_8b,
    'qwen3-14b': qwen3.qwen3_14b,
    'qwen3-32b': qwen3.qwen3_32b,
    'phi3-mini': phi3.phi3_mini,
    'olmo2-7b': olmo2.olmo2_7b,
    'tiny-moe': moe.tiny_moe,
    'mixtral-8x7b': moe.mixtral_8x7b,
    'mixtral-8x22b': moe.mixtral_8x22b,
    'qwen3-30b-a3b': moe.qwen3_30b_a3b,
    'qwen3-235b-a22b': moe.qwen3_235b_a22b,
    'deepseek-v2-lite': deepseek.deepseek_v2_lite,
    'deepseek-v2': deepseek.deepseek_v2,
    'deepseek-v3': deepseek.deepseek_v3,
    'kimi-k2': deepseek.kimi_k2,
    'gpt-oss-20b': moe.gpt_oss_20b,
    'gpt-oss-120b': moe.gpt_oss_120b,
}


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

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
    'deepseek3.2-671b': 'deepseek-v3.2',
    'gemma4-26b': 'gemma4-26b-a4b',
    'kimi-k2-1t': 'kimi-k2',
    'llama3-405b': 'llama3.1-405b',  # the same shapes (Llama 3's 405B came out as 3.1)
    'llama3.1-8b-Instruct': 'llama3.1-8b',
    'llama3.1-70b-Instruct': 'llama3.1-70b',
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

# MaxText's model names maxnnx does not build, and why. The sharding / schedule variants of
# DeepSeek V3 are not aliases: mapping them to plain ``deepseek-v3`` would drop their point.
MAXTEXT_REFUSED: dict[str, str] = {
    'deepseek3-671b-2dfsdp': (
        'its point is 2-D FSDP (a second fsdp axis sharding heads and MLP width), which '
        "maxnnx's mesh has no axis for; use deepseek3-671b with mesh.fsdp and mesh.tensor"),
    'deepseek3-671b-batchsplit': (
        'its point is the batch-split schedule (two half-batches overlapping MoE '
        'communication, explicit sharding), which maxnnx does not run; use deepseek3-671b '
        'with mesh.fsdp and mesh.expert'),
    'deepseek4-tiny': 'DeepSeek V4 (compressed attention, hash layers, hyper-connections) '
                      'is no maxnnx family yet',
    'deepseek4-284b': 'DeepSeek V4 (compressed attention, hash layers, hyper-connections) '
                      'is no maxnnx family yet',
    'deepseek-custom': "MaxText's experimental DeepSeek variant (hyper-connections, Engram "
                       'memory layers) has no maxnnx equivalent',
    'qwen3-vl-2b': 'Qwen3-VL (its vision tower, M-RoPE, deepstack) is no maxnnx family yet',
    'qwen3-vl-4b': 'Qwen3-VL (its vision tower, M-RoPE, deepstack) is no maxnnx family yet',
    'qwen3-vl-30b-a3b': 'Qwen3-VL (its vision tower, M-RoPE, deepstack) is no maxnnx family '
                        'yet',
    'qwen3-omni-30b-a3b': 'Qwen3-Omni (audio and vision towers, M-RoPE) is no maxnnx family '
                          'yet',
    'qwen3-custom-30b-a3b': "MaxText's custom Qwen3 MoE (attention and expert widths apart "
                            'from the model width) has no maxnnx equivalent',
    'envy-test': "MaxText's envy block has no published checkpoint to check a maxnnx family "
                 'against',
    'envy-switch-base': "MaxText's envy block has no published checkpoint to check a maxnnx "
                        'family against',
    'envy-switch-large': "MaxText's envy block has no published checkpoint to check a maxnnx "
                         'family against',
    'envy-switch-xxl': "MaxText's envy block has no published checkpoint to check a maxnnx "
                       'family against',
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
    ConfigError: unknown preset (naming the nearest one), one of MaxText's names maxnnx
      does not build (:data:`MAXTEXT_REFUSED`, with the reason), unknown field
      (naming the nearest field) or an invalid value.
  """
  if name in MAXTEXT_REFUSED:
    raise ConfigError(f"MaxText's model '{name}' is not built here: {MAXTEXT_REFUSED[name]}.")
  name = MAXTEXT_ALIASES.get(name, name)
  if name not in PRESETS:
    match = difflib.get_close_matches(name, list_presets(aliases=True), n=1, cutoff=0.0)
    hint = f" Did you mean '{match[0]}'?" if match else ''
    raise ConfigError(f"Unknown preset '{name}'.{hint} "
                      'See maxnnx.presets.list_presets() for all names.')
  cfg = PRESETS[name]()
  return cfg.replace(**overrides) if overrides else cfg


__all__ = ['MAXTEXT_ALIASES', 'MAXTEXT_REFUSED', 'PRESETS', 'get_preset', 'list_presets']

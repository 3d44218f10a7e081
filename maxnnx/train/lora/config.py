"""``LoraConfig``: which projections get low-rank adapters, their size, and how the base is kept."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from maxnnx.config import ConfigError, ValidatedConfig

#: ``targets`` value for every projection of the decoder layers (attention, MLA, MLP and
#: shared-expert projections; MoE routers and routed experts stay frozen).
ALL_LINEAR = 'all-linear'
#: The base-weight storage ``base_quantization`` accepts (``none`` keeps the float weights).
BASE_QUANTIZATIONS = ('none', 'int8', 'int4')


@dataclasses.dataclass(frozen=True)
class LoraConfig(ValidatedConfig):
  """Low-rank adapters (LoRA) on a model's projections; QLoRA with a quantized base.

  Each targeted projection ``y = x W`` becomes ``y = x W + (alpha / rank) x A B``
  with ``A [in, rank]`` (He-uniform init) and ``B [rank, out]`` (zeros, so an
  adapted model starts equal to its base); only ``A`` and ``B`` are trained.

  Attributes:
    rank: adapter rank ``r``; 0 means no adapters (the whole model trains).
    alpha: the adapters' output is scaled by ``alpha / rank`` (PEFT's ``lora_alpha``).
    dropout: dropout rate on each adapter's input while training (PEFT's ``lora_dropout``).
    targets: module names that get adapters (e.g. ``q_proj,v_proj``, or all seven
      ``q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj``), or ``all-linear``:
      every projection of the decoder layers (MoE routers and routed experts excluded).
    base_quantization: ``none`` (float base weights), or ``int8`` / ``int4``: the
      frozen base weights of the targeted projections are stored quantized by qwix
      (one absmax scale per output channel), which is QLoRA.
  """

  _PATH = 'LoraConfig'

  rank: int = 0
  alpha: float = 16.0
  dropout: float = 0.0
  targets: tuple[str, ...] | str = (ALL_LINEAR,)
  base_quantization: Literal['none', 'int8', 'int4'] = 'none'

  def _validate(self):
    if isinstance(self.targets, str):  # 'q_proj,v_proj' from a command line or by hand
      object.__setattr__(self, 'targets', tuple(t.strip() for t in self.targets.split(',')))
    if self.rank < 0:
      raise ConfigError(f'LoraConfig.rank must be >= 0 (0: no adapters), got {self.rank}.')
    if not self.alpha > 0:
      raise ConfigError(f'LoraConfig.alpha must be > 0, got {self.alpha}.')
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f'LoraConfig.dropout must be in [0, 1), got {self.dropout}.')
    if not self.targets or any(not t for t in self.targets):
      raise ConfigError(f"LoraConfig.targets must name modules (e.g. 'q_proj,v_proj') or be "
                        f"'{ALL_LINEAR}', got {self.targets!r}.")
    if ALL_LINEAR in self.targets and len(self.targets) > 1:
      raise ConfigError(f"LoraConfig.targets: '{ALL_LINEAR}' already names every projection; "
                        f'give it alone, got {self.targets!r}.')
    for name in self.targets:
      if name != ALL_LINEAR and not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*', name):
        raise ConfigError(f"LoraConfig.targets: '{name}' is not a module name (like 'q_proj').")

  @property
  def enabled(self) -> bool:
    """Whether this config adds adapters (``rank > 0``)."""
    return self.rank > 0

  @property
  def scale(self) -> float:
    """``alpha / rank``, the factor on the adapters' output."""
    return self.alpha / self.rank


__all__ = ['ALL_LINEAR', 'BASE_QUANTIZATIONS', 'LoraConfig']

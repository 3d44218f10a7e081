"""One lookup for every kernel kind: the strategy a config names, with the config's policy.

Layers build their kernels only through :func:`kernel_for`, so
``kernel_on_unsupported`` reaches every call site (attention, MLA, MoE) and the
config fields are read in one place.
"""

from maxnnx.kernels.attention import ATTENTION_IMPLEMENTATIONS
from maxnnx.kernels.capabilities import lookup_kernel
from maxnnx.kernels.gated_delta import GATED_DELTA_IMPLEMENTATIONS
from maxnnx.kernels.paged_attention import PAGED_ATTENTION_IMPLEMENTATIONS
from maxnnx.kernels.ragged_dot import RAGGED_DOT_IMPLEMENTATIONS

#: Registry of each kernel kind; the config field naming a strategy is ``{kind}_impl``.
KERNEL_REGISTRIES = {'attention': ATTENTION_IMPLEMENTATIONS,
                     'paged_attention': PAGED_ATTENTION_IMPLEMENTATIONS,
                     'ragged_dot': RAGGED_DOT_IMPLEMENTATIONS,
                     'gated_delta': GATED_DELTA_IMPLEMENTATIONS}


def _check_kind(kind: str) -> None:
  if kind not in KERNEL_REGISTRIES:
    raise ValueError(f"Unknown kernel kind '{kind}'; known: {', '.join(KERNEL_REGISTRIES)}.")


def get_kernel(kind: str, name: str, *, on_unsupported: str | None = None):
  """The ``kind`` strategy registered as ``name``; ``on_unsupported`` overrides its policy.

  Raises:
    ValueError: for an unknown kind, name (listing the known ones) or policy.
  """
  _check_kind(kind)
  return lookup_kernel(KERNEL_REGISTRIES[kind], kind, name, on_unsupported)


def kernel_for(cfg, kind: str):
  """The ``kind`` strategy ``cfg`` names (``{kind}_impl``) under its ``kernel_on_unsupported``.

  ``cfg`` is a model config, or any object with those fields (a config group
  holding them is found under ``cfg.runtime`` when present).
  """
  _check_kind(kind)
  fields = getattr(cfg, 'runtime', cfg)
  return get_kernel(kind, getattr(fields, f'{kind}_impl'),
                    on_unsupported=fields.kernel_on_unsupported)

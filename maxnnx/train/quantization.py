"""Quantized training (QAT) through qwix: ``int8`` and ``fp8`` recipes by name.

``quantize(model, 'int8')`` returns a copy of ``model`` whose matmuls run
fake-quantized: in the forward pass the weight and the activation of every
selected ``lax.dot_general`` / ``einsum`` / ``ragged_dot`` are rounded to the
recipe's type with a dynamic symmetric (absmax) scale, and the backward pass is
a straight-through estimator (optionally with quantized gradients). Parameters
stay float ``nnx.Param``s with their logical sharding names, so the optimizer,
sharding, ``scan_layers`` stacks and checkpoints are exactly those of the
unquantized model (a float checkpoint fine-tunes under QAT and back).

Recipes (names as in MaxText's ``quantization`` option):

- ``int8``: int8 weights (one scale per output channel) and int8 activations
  (one scale per token); gradients in float (straight-through).
- ``fp8``: ``float8_e4m3fn`` weights and activations (same scale layout),
  gradients quantized to ``float8_e5m2``.

By default the attention and MLP projections of the decoder layers and the
routed experts are quantized; embeddings, the LM head, MoE routers and norms
stay in float. Pass your own rules to choose differently::

  rules = [rule('int8', r'layers/.*/(q|k|v|o)_proj'),   # a recipe's types, your modules
           qwix.QtRule(module_path=r'layers/.*/mlp/.*_proj', weight_qtype=jnp.int8)]
  trainer = Trainer(quantize(model, rules), TrainConfig(...))

Module paths are the attribute paths joined with ``/`` (``layers/0/attn/q_proj``,
or ``layers/attn/q_proj`` with ``scan_layers=True``); the first matching rule
wins.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

#: Recipe names ``TrainConfig.quantization`` accepts besides ``none``.
RECIPES = ('int8', 'fp8')

#: Decoder-layer projections (attention, MLA, MLP and shared experts).
PROJECTIONS_PATH = r'(dense_layers|layers)(/\d+)?/.*_proj(_with_mqa)?'
#: MoE layers, whose own matmuls are the routed experts.
EXPERTS_PATH = r'(dense_layers|layers)(/\d+)?/mlp'

# ragged-dot strategies that reach ``jax.lax.ragged_dot``, the op qwix intercepts
# (tokamax's kernels and the dense reference do not).
_QWIX_RAGGED_DOT_IMPLS = ('lax',)


def _qwix():
  import qwix  # noqa: PLC0415 (imported on first use: qwix is only needed for QAT)
  return qwix


# Symmetric absmax scales with a little headroom. qwix divides by ``absmax / 127.5``, so
# the largest value lands on the tie ±127.5, which rounds to 127 or 128 (-127 or -128)
# depending on the last bit of the float arithmetic, and that differs between
# compilations (another mesh, another fusion). 1e-4 of headroom puts it on ±127.49,
# i.e. always ±127, at a negligible cost in range.
ABSMAX_CALIBRATION = 'absmax,1.0001'


def _recipe_types(recipe: str) -> dict:
  calibration = {'weight_calibration_method': ABSMAX_CALIBRATION,
                 'act_calibration_method': ABSMAX_CALIBRATION}
  if recipe == 'int8':
    return {'weight_qtype': jnp.int8, 'act_qtype': jnp.int8, **calibration}
  if recipe == 'fp8':
    return {'weight_qtype': jnp.float8_e4m3fn, 'act_qtype': jnp.float8_e4m3fn,
            'bwd_qtype': jnp.float8_e5m2, **calibration}
  raise ValueError(f"Unknown quantization recipe '{recipe}'; use one of {RECIPES} (or 'none' "
                   'in TrainConfig.quantization), or pass a list of qwix.QtRule.')


def rule(recipe: str, module_path: str = '.*', **fields):
  """A ``qwix.QtRule`` with ``recipe``'s types and scales for the modules ``module_path`` matches.

  ``fields`` override or add any ``QtRule`` field (``op_names``, ``tile_size``,
  ``bwd_qtype``...), e.g. ``rule('int8', r'layers/.*/mlp/.*_proj', bwd_qtype=jnp.int8)``.
  """
  return _qwix().QtRule(module_path=module_path, **{**_recipe_types(recipe), **fields})


def quantization_rules(recipe: str, config=None) -> tuple:
  """The ``qwix.QtRule``s of ``recipe`` (``int8`` or ``fp8``) for a model ``config``.

  ``config`` (a :class:`~maxnnx.config.ModelConfig`) decides how MoE experts
  are reached: the ``ragged_dot`` of dropless dispatch or the ``einsum`` of
  capacity dispatch (never the routing-weight einsum beside them). Without a
  config both expert forms are quantized.
  """
  rules = [rule(recipe, PROJECTIONS_PATH, op_names=('dot_general',))]
  if config is None or config.moe.num_experts > 1:
    capacity = config is not None and config.moe.dispatch == 'capacity'
    ops = ('einsum',) if capacity else ('ragged_dot',)
    rules.append(rule(recipe, EXPERTS_PATH, op_names=ops))
  return tuple(rules)


def is_quantized(model: nnx.Module) -> bool:
  """Whether ``model`` is a qwix-quantized copy (from :func:`quantize`)."""
  return hasattr(type(model), '_unquantized_type')


def check_supported(model_config, recipe: str, *, mesh_shape: dict | None = None) -> None:
  """Raise ``ValueError`` naming the field and the fix when ``recipe`` cannot run as asked.

  Refused: pipeline parallelism (``mesh.stage > 1``), MoE dropless dispatch
  with a ragged-dot strategy qwix does not intercept (its experts would
  silently stay in float). fp8 runs everywhere (on CPU XLA computes it in float).
  """
  _recipe_types(recipe)
  if mesh_shape and mesh_shape.get('stage', 1) > 1:
    raise ValueError(f"TrainConfig.quantization='{recipe}' does not support pipeline "
                     f"parallelism (mesh.stage={mesh_shape['stage']}): qwix's interception "
                     'does not reach the stage loop. Use mesh.stage=1 (fsdp/tensor/data) or '
                     "quantization='none'.")
  if (model_config is not None and model_config.moe.num_experts > 1
      and model_config.moe.dispatch == 'dropless'
      and model_config.runtime.ragged_dot_impl not in _QWIX_RAGGED_DOT_IMPLS):
    raise ValueError(f"TrainConfig.quantization='{recipe}' quantizes MoE experts through "
                     f"jax.lax.ragged_dot, which ModelConfig.ragged_dot_impl="
                     f"'{model_config.runtime.ragged_dot_impl}' does not call; use ragged_dot_impl="
                     "'lax' or moe.dispatch='capacity'.")


def _check_rules(model: nnx.Module, rules: Sequence) -> None:
  paths = ['/'.join(map(str, path)) for path, _ in nnx.iter_modules(model)]
  for rule in rules:
    if getattr(rule, 'act_static_scale', None):
      raise ValueError(f'QtRule(module_path={rule.module_path!r}) sets act_static_scale=True: '
                       'static activation scales need a calibration pass this helper does not '
                       'run. Leave act_static_scale unset (dynamic scales) or call '
                       'qwix.quantize_model with sample inputs yourself.')
    if not any(re.fullmatch(rule.module_path, p) for p in paths):
      examples = ', '.join(p for p in paths if p)[:300]
      raise ValueError(f'QtRule(module_path={rule.module_path!r}) matches no module of this '
                       f'model, so nothing would be quantized by it. Module paths are like: '
                       f'{examples}')


def quantize(model: nnx.Module, recipe: str | Sequence = 'int8') -> nnx.Module:
  """A quantization-aware copy of ``model`` for ``recipe`` or a list of ``qwix.QtRule``.

  The copy has the same ``nnx.state`` (float parameters, sharding metadata) and
  methods; its forward pass (``__call__`` and ``hidden_states``) runs the selected
  matmuls fake-quantized. The
  original ``model`` is left unchanged. Rules whose ``module_path`` matches no
  module are refused, so a typo cannot leave the model silently unquantized.
  """
  qwix = _qwix()
  if is_quantized(model):
    raise ValueError('This model is already quantized; quantize the original model instead '
                     "(or train it as it is with TrainConfig.quantization='none').")
  if isinstance(recipe, str):
    config = getattr(model, 'config', None)
    if config is not None:
      check_supported(config, recipe)
    rules = quantization_rules(recipe, config)
  else:
    rules = tuple(recipe)
    if not rules:
      raise ValueError('quantize() got an empty list of rules; pass a recipe name or QtRules.')
  _check_rules(model, rules)
  # qwix intercepts one method. Our Transformer's ``__call__`` goes through
  # ``hidden_states`` (and the fused training loss calls it directly), so intercepting
  # ``hidden_states`` quantizes both paths; the output head stays in float either way.
  method = 'hidden_states' if hasattr(model, 'hidden_states') else '__call__'
  # Dynamic-range QAT keeps no state, so the model need not run once here.
  return qwix.quantize_model(model, qwix.QtProvider(rules), skip_nnx_init=True,
                             methods=(method,))


__all__ = ['ABSMAX_CALIBRATION', 'EXPERTS_PATH', 'PROJECTIONS_PATH', 'RECIPES', 'check_supported',
           'is_quantized', 'quantization_rules', 'quantize', 'rule']

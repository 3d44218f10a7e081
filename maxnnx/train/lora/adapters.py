"""LoRA and QLoRA adapters on a maxnnx model through qwix.

``apply_lora(model, LoraConfig(rank=8, alpha=16))`` returns a copy of ``model``
whose targeted projections compute ``x W + (alpha / rank) x A B``. The matmul
is qwix's (``qwix.LoraProvider`` with one ``qwix.LoraRule``, intercepting the
projection's ``lax.dot_general``); the adapter weights are ``nnx.LoRAParam``\\ s
named as qwix names them (``kernel_lora_a [in, r]``, ``kernel_lora_b [r, out]``,
with a leading ``layers`` axis in a scanned stack). ``nnx.LoRAParam`` subclasses
``nnx.Param``; :func:`trainable_filter` picks the adapters alone, which is what
the Trainer differentiates and hands to the optimizer for such a model.

Why the adapters are made here and not by qwix's first forward pass: qwix
creates them lazily while tracing, which cannot happen inside the
``lax.scan`` of a scanned layer stack or a rematerialised block. They are created
up front instead, with qwix's shapes, initialisers (He-uniform ``A``, zero
``B``) and sharding rule (``A`` shares the kernel's input axis name, ``B`` its
first output one), and qwix is told to skip its initialising call. With
``base_quantization`` the targeted kernels are replaced by qwix's quantized
arrays the same way (int8 or int4 values, one absmax scale per output channel):
the float kernels are gone from the adapted model, and qwix's matmul reads the
quantized ones.

The targeted ``DenseGeneral``\\ s run with ``custom_gradient=False`` (a plain
``lax.dot_general`` that JAX differentiates; their custom VJP would not see the
adapters).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxnnx.layers.linear import DenseGeneral
from maxnnx.models.transformer import layer_stacks
from maxnnx.processes import host_value, place_host_value
from maxnnx.train.chunks import model_sequence_logps
from maxnnx.train.lora.config import ALL_LINEAR, LoraConfig
from maxnnx.train.lora.dropout import add_dropout_seeds, switched_provider
from maxnnx.train.quantization import PROJECTIONS_PATH, is_quantized

#: Decoder-layer stacks: a module path below one of them may get adapters.
STACKS_PATH = r'(dense_layers|layers)(/\d+)?/.+'
#: The vision tower's projections (attention and MLP of each encoder block) and the
#: projector's linear layers (Llama 4's adapter MLP and ``linear_1``).
VISION_PROJECTIONS_PATH = (r'vision_tower/encoder_layers/\d+/(self_attn/\w+_proj|mlp/fc\d)'
                           r'|multi_modal_projector/(adapter_fc\d|linear_1)')
_QTYPES = {'int8': jnp.int8, 'int4': jnp.int4}


def _qwix():
  import qwix  # noqa: PLC0415 (imported on first use, like the QAT wrapper)
  return qwix


def _with_aux():
  # qwix's PTQ matmul recognises a pre-quantized weight by this wrapper type, which qwix
  # does not export; it is what qwix's own first forward pass would put in the module.
  from qwix._src.providers.ptq import WithAux  # noqa: PLC0415
  return WithAux


def _how_to_quantize(**fields):
  from qwix._src.core.qarray import HowToQuantize  # noqa: PLC0415 (see _with_aux)
  return HowToQuantize(**fields)


def _path_str(path) -> str:
  return '/'.join(map(str, path))


def has_adapters(model: nnx.Module) -> bool:
  """Whether ``model`` carries LoRA adapters (any ``nnx.LoRAParam``)."""
  return bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


def trainable_filter(model: nnx.Module):
  """The nnx filter of the parameters to train: ``nnx.LoRAParam`` for a model with
  adapters (its base stays frozen), else ``nnx.Param``."""
  return nnx.LoRAParam if has_adapters(model) else nnx.Param


def lora_config_of(model: nnx.Module) -> LoraConfig:
  """The :class:`LoraConfig` a model was adapted with (by :func:`apply_lora`)."""
  config = getattr(model, 'lora_config', None)
  if not isinstance(config, LoraConfig):
    raise ValueError('This model has no LoRA adapters from maxnnx (apply_lora or load_adapter '
                     'makes them).')
  return config


def candidate_modules(model: nnx.Module) -> list[tuple[tuple, DenseGeneral]]:
  """``(path, module)`` of every projection of the decoder layers, of the vision tower's
  blocks and of Llama 4's projector (``all-linear``); a target name adapts all of them
  where they share it, as PEFT does."""
  out = []
  for path, module in nnx.iter_modules(model):
    name = _path_str(path)
    if isinstance(module, DenseGeneral) and (
        (re.fullmatch(STACKS_PATH, name) and re.fullmatch(PROJECTIONS_PATH, name))
        or re.fullmatch(VISION_PROJECTIONS_PATH, name)):
      out.append((tuple(path), module))
  return out


def target_modules(model: nnx.Module, targets) -> list[tuple[tuple, DenseGeneral]]:
  """The ``(path, module)`` pairs that ``targets`` (``LoraConfig.targets``) selects.

  Raises ``ValueError`` naming a target that matches no projection, with the names there are.
  """
  candidates = candidate_modules(model)
  targets = (targets,) if isinstance(targets, str) else tuple(targets)
  if ALL_LINEAR in targets:
    return candidates
  names = sorted({path[-1] for path, _ in candidates})
  unknown = [t for t in targets if t not in names]
  if unknown:
    raise ValueError(f'LoraConfig.targets: {unknown} name no projection of this model; its '
                     f"projections are {names} (or use '{ALL_LINEAR}').")
  return [(path, module) for path, module in candidates if path[-1] in targets]


def _leading_axes(module: DenseGeneral) -> int:
  """1 in a scanned stack (a leading ``layers`` axis), else 0."""
  return module.kernel.ndim - len(module.in_shape) - len(module.out_shape)


def _check_rank(path, module: DenseGeneral, rank: int) -> None:
  din, dout = math.prod(module.in_shape), math.prod(module.out_shape)
  if rank >= min(din, dout):
    raise ValueError(f'LoraConfig.rank={rank} is not below min(in, out)={min(din, dout)} of '
                     f'{_path_str(path)} ({din} -> {dout}): the update W + A B would be of full '
                     'rank. Use a smaller rank, or train the whole model.')


def _add_adapter(module: DenseGeneral, config: LoraConfig, key: jax.Array) -> None:
  """Give ``module`` qwix's ``kernel_lora_a`` / ``kernel_lora_b`` (and a quantized kernel)."""
  kernel = module.kernel
  lead = _leading_axes(module)
  n_in = len(module.in_shape)
  metadata = kernel.get_metadata()
  names = tuple(metadata.get('out_sharding') or (None,) * kernel.ndim)
  lead_shape = tuple(kernel.shape[:lead])
  din, dout = math.prod(module.in_shape), math.prod(module.out_shape)
  init_a = jax.nn.initializers.he_uniform(batch_axis=tuple(range(lead)))
  a = init_a(key, (*lead_shape, din, config.rank), kernel.dtype)
  b = jnp.zeros((*lead_shape, config.rank, dout), kernel.dtype)
  common = {'eager_sharding': False, 'contract_ndim': 1}
  module.kernel_lora_a = nnx.LoRAParam(a, out_sharding=(*names[:lead], names[lead], None),
                                       **common)
  module.kernel_lora_b = nnx.LoRAParam(b, out_sharding=(*names[:lead], None, names[lead + n_in]),
                                       **common)
  module.custom_gradient = False
  if config.base_quantization != 'none':
    module.kernel = _quantized(kernel, lead, n_in, config.base_quantization)


def _quantized(kernel: nnx.Param, lead: int, n_in: int, recipe: str):
  """qwix's pre-quantized weight for ``kernel``: symmetric absmax, one scale per output
  channel (and per layer of a stack), values and scales kept as ``nnx.Param``\\ s with the
  kernel's metadata (scales unsharded along their size-1 axes)."""
  qwix = _qwix()
  out_axes = tuple(range(lead + n_in, kernel.ndim))
  qarray = qwix.quantize(kernel[...], _QTYPES[recipe],
                         channelwise_axes=(*range(lead), *out_axes))
  if qarray.qvalue.dtype == jnp.int4 and jax.default_backend() == 'cpu':
    # XLA's CPU backend keeps int4 arrays one byte per value anyway, and an ahead-of-time
    # compiled step (the Trainer's) refuses int4 arguments (their layout never matches),
    # so the int4 values live in int8 there; qwix computes the same (``qtype`` stays int4).
    qarray = dataclasses.replace(qarray, qvalue=qarray.qvalue.astype(jnp.int8))
  metadata = kernel.get_metadata()
  names = metadata.get('out_sharding')

  def box(value):
    meta = dict(metadata)
    if names is not None:
      meta['out_sharding'] = tuple(None if d == 1 else n for n, d in zip(names, value.shape))
    return nnx.Param(value, **meta)

  boxed = jax.tree.map(box, qarray)
  # How qwix's matmul itself would quantize one layer's kernel (used by qwix's
  # ``quantize_params`` only; the forward pass reads the arrays above).
  how = _how_to_quantize(qtype=_QTYPES[recipe],
                         channelwise_axes=list(range(n_in, kernel.ndim - lead)))
  return _with_aux()(boxed, how)


def apply_lora(model: nnx.Module, config: LoraConfig, *, seed: int = 0) -> nnx.Module:
  """A copy of ``model`` with LoRA adapters on the projections ``config.targets`` names.

  The copy starts equal to ``model`` (zero ``B``), except that with
  ``config.base_quantization`` its targeted kernels are quantized (QLoRA). The
  original is left unchanged but shares its arrays with the copy: drop it to
  free a quantized base's float weights, and do not use it after a Trainer
  trained the copy (the step donates the buffers it is given; use
  ``merge_adapters(without_adapters(trained))`` for the base then). With
  ``config.dropout`` the adapters' input is dropped in the Trainer's train step
  only (see :mod:`maxnnx.train.lora.dropout`); evaluation, generation and
  serving see every input.

  Raises:
    ValueError: ``config.rank`` is 0, a target names no projection, the rank is
      not below a projection's smaller side, or the model already has adapters
      or is QAT-quantized.
  """
  if not config.enabled:
    raise ValueError('LoraConfig.rank is 0 (no adapters); set rank >= 1, e.g. rank=8.')
  if has_adapters(model):
    raise ValueError('This model already has LoRA adapters; apply_lora takes the base model.')
  if is_quantized(model):
    raise ValueError("apply_lora takes a float model, not a QAT-quantized one; for a quantized "
                     "base use LoraConfig.base_quantization='int8' or 'int4'.")
  qwix = _qwix()
  model = nnx.clone(model)
  selected = target_modules(model, config.targets)
  key = jax.random.key(seed)
  for i, (path, module) in enumerate(selected):
    _check_rank(path, module, config.rank)
    _add_adapter(module, config, jax.random.fold_in(key, i))
  # The rule matches exactly the modules holding adapters: a module qwix matched without
  # them would make qwix create adapters while tracing.
  module_path = '|'.join(re.escape(_path_str(path)) for path, _ in selected)
  rule = qwix.LoraRule(module_path=f'(?:{module_path})', op_names=('dot_general',),
                       rank=config.rank, alpha=config.alpha, dropout=config.dropout,
                       weight_qtype=_QTYPES.get(config.base_quantization))
  if config.dropout:
    add_dropout_seeds([module for _, module in selected],
                      [tuple(module.kernel_lora_a.shape[:-2]) for _, module in selected])
  # qwix intercepts one method: ``hidden_states`` serves ``__call__``, the fused losses
  # and generation alike (the output head is never adapted).
  method = 'hidden_states' if hasattr(model, 'hidden_states') else '__call__'
  adapted = qwix.apply_lora_to_model(model, switched_provider([rule]), skip_nnx_init=True,
                                     rngs=nnx.Rngs(seed), methods=(method,))
  adapted.lora_config = config
  return adapted


def without_adapters(model: nnx.Module) -> nnx.Module:
  """A view of ``model`` whose adapters add nothing: its base alone (no second copy).

  The view shares the base weights (quantized or not) with ``model`` and holds
  zeros of the adapters' shapes, so its outputs are exactly the base model's.
  It works inside ``jit`` (e.g. in a loss) as well as outside.
  """
  graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
  return nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, adapters), rest)


def without_adapters_logps(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
  """Per-row sequence log-probs ``[B]`` of ``model`` with its adapters off.

  The ``reference_fn`` of a DPO run on an adapted policy: the reference is the
  same base weights without the adapters, so no second model is held::

    DPOObjective(beta=0.1, reference_fn=without_adapters_logps)
  """
  return model_sequence_logps(without_adapters(model), batch)


def adapted_modules(model: nnx.Module) -> list[tuple[DenseGeneral, list[tuple]]]:
  """Every adapted projection with the unscanned paths of its layers: one path, or one per
  layer of a scanned stack (``('layers', 3, 'attn', 'q_proj')``), in stack order."""
  cfg = model.config
  stacks = ({name: (start, count) for name, start, count, _ in layer_stacks(cfg)}
            if cfg.runtime.scan_layers else {})
  out = []
  for path, module in nnx.iter_modules(model):
    if not isinstance(module, DenseGeneral) or getattr(module, 'kernel_lora_a', None) is None:
      continue
    path = tuple(path)
    if path[0] in stacks and _leading_axes(module):
      start, count = stacks[path[0]]
      out.append((module, [('layers', start + i, *path[1:]) for i in range(count)]))
    else:
      out.append((module, [path]))
  return out


def adapter_weights(model: nnx.Module) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
  """``{module path: (A [in, r], B [r, out])}`` per layer, as host arrays.

  Paths are the unscanned ones (``('layers', 3, 'attn', 'q_proj')``) whatever the
  model's layout; a scanned stack is listed layer by layer.
  """
  out = {}
  for module, paths in adapted_modules(model):
    a = host_value(module.kernel_lora_a[...])
    b = host_value(module.kernel_lora_b[...])
    stacked = _leading_axes(module) > 0
    for i, path in enumerate(paths):
      out[path] = (a[i], b[i]) if stacked else (a, b)
  return out


def base_kernel(module: DenseGeneral) -> np.ndarray:
  """``module``'s base kernel as a float64 host array (dequantized under QLoRA)."""
  kernel = module.kernel
  if isinstance(kernel, nnx.Variable):
    return np.asarray(host_value(kernel[...]), np.float64)
  qarray = kernel.array
  if getattr(qarray, 'zero_point', None) is not None:
    raise ValueError('Asymmetric (zero-point) base quantization is not supported.')
  qvalue = host_value(qarray.qvalue[...]).astype(np.float64)
  scale = np.asarray(host_value(qarray.scale[...]), np.float64)
  return qvalue * scale


def _merge(w: np.ndarray, lora_a, lora_b, scale: float) -> np.ndarray:
  """``w + scale A B`` in float64, in ``w``'s shape (``A``, ``B`` gathered to the host)."""
  a = np.asarray(host_value(lora_a), np.float64)
  b = np.asarray(host_value(lora_b), np.float64)
  return w + scale * np.matmul(a, b).reshape(w.shape)


def merged_kernel(module: DenseGeneral, scale: float) -> np.ndarray:
  """``W + scale A B`` of an adapted module in float64, in the kernel's shape."""
  return _merge(base_kernel(module), module.kernel_lora_a[...], module.kernel_lora_b[...],
                scale)


def _merged_host(module: DenseGeneral, scale: float, dtype) -> np.ndarray:
  """:func:`merged_kernel` rounded to ``dtype``; a scanned stack's layers are merged one at a
  time, so float64 is only ever one layer's kernel."""
  kernel = module.kernel
  if not isinstance(kernel, nnx.Variable) or _leading_axes(module) == 0:
    return merged_kernel(module, scale).astype(dtype)
  out = np.empty(kernel.shape, dtype)
  for i in range(kernel.shape[0]):
    out[i] = _merge(np.asarray(host_value(kernel[...][i]), np.float64),
                    module.kernel_lora_a[...][i], module.kernel_lora_b[...][i], scale)
  return out


def merge_adapters(model: nnx.Module) -> nnx.Module:
  """The plain model (no qwix, no adapters) with every adapter folded into its kernel.

  Each adapted kernel becomes ``W + (alpha / rank) A B``, computed in float64 on the
  host one kernel (one layer of a scanned stack) at a time and rounded once to the
  parameter dtype. A kernel sharded over several processes is gathered alone, merged,
  and each process places its own shards back: every process calls this, and a host
  holds one kernel (stack) beside its share of the model. Under QLoRA ``W`` is the
  dequantized base, so the merged model is a float model. The result is the model's own
  class (``save_pretrained`` writes it; ``generate`` runs it); ``model`` is left
  unchanged.
  """
  config = lora_config_of(model)
  plain_type = getattr(type(model), '_unquantized_type', type(model))
  merged = nnx.clone(model)
  for _, module in nnx.iter_modules(merged):
    if not isinstance(module, DenseGeneral) or getattr(module, 'kernel_lora_a', None) is None:
      continue
    template = module.kernel
    if not isinstance(template, nnx.Variable):  # quantized: its values carry the metadata
      template = template.array.qvalue
    host = _merged_host(module, config.scale, module.kernel_lora_a.dtype)
    sharding = getattr(template[...], 'sharding', None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
      sharding = None  # on the default device, as it was
    # A fresh nnx.Param with the kernel's metadata; each process places its own shards.
    module.kernel = template.replace(place_host_value(host, sharding))
    del module.kernel_lora_a, module.kernel_lora_b
    if 'lora_dropout_seed' in vars(module):
      del module.lora_dropout_seed
    module.custom_gradient = True
  for _, module in nnx.iter_modules(merged):
    for name in ('qwix_path', 'qwix_rngs', 'disable_quant_stats_update'):
      if name in vars(module):
        delattr(module, name)
  if 'lora_config' in vars(merged):
    del merged.lora_config
  merged.__class__ = plain_type
  return merged


__all__ = ['STACKS_PATH', 'adapted_modules', 'adapter_weights', 'apply_lora', 'base_kernel',
           'candidate_modules', 'has_adapters', 'lora_config_of', 'merge_adapters',
           'merged_kernel', 'target_modules', 'trainable_filter', 'without_adapters',
           'without_adapters_logps']

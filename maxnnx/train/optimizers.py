"""Optimizers and learning-rate schedules built from a :class:`TrainConfig`.

Everything here is plain optax; the Trainer wraps the result in
``nnx.Optimizer``. Masks and Muon's matrix shapes are read from each
parameter's metadata (its logical axis names and, for dense kernels,
``contract_ndim``), so they follow the model rather than name patterns; only
``TrainConfig.weight_decay_exclude`` adds patterns on parameter paths.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from maxnnx.layers.moe import RouterBias
from maxnnx.train.config import TrainConfig

# Leading kernel axes that index independent matrices rather than being part of one.
_BATCH_AXES = ('layers', 'expert', 'stage')


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _key(path) -> tuple:
  """A tree path as a tuple of names, ignoring the Variable's own attribute."""
  out = []
  for entry in path:
    if isinstance(entry, jax.tree_util.DictKey):
      out.append(str(entry.key))
    elif isinstance(entry, jax.tree_util.SequenceKey):
      out.append(str(entry.idx))
    elif isinstance(entry, jax.tree_util.GetAttrKey) and entry.name not in ('value', 'raw_value'):
      out.append(entry.name)
  return tuple(out)


def param_metadata(model: nnx.Module) -> dict[tuple, dict]:
  """``{path: metadata}`` of every ``nnx.Param`` of ``model`` (works on abstract models)."""
  params = nnx.state(model, nnx.Param)
  table = {}
  for path, var in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]:
    key = _key(path)
    table[key] = {**var.get_metadata(), 'ndim': len(var.shape), 'path': '/'.join(key),
                  'balancing_bias': isinstance(var, RouterBias)}
  return table


def is_matmul_kernel(metadata: dict) -> bool:
  """True for dense and expert kernels, the weights decay applies to by default.

  Dense kernels carry ``contract_ndim`` metadata; expert weights carry an
  ``expert`` axis. Norm scales, biases and embedding tables are not kernels.
  """
  if metadata.get('contract_ndim') is not None:
    return True
  names = tuple(metadata.get('out_sharding') or ())
  return 'expert' in names and len(names) >= 3


def _map_params(fn, table: dict, tree):
  """``fn(metadata)`` at every parameter of ``tree`` (Variables or plain arrays)."""
  def one(path, _):
    key = _key(path)
    if key not in table:
      raise KeyError(f'No parameter metadata for {"/".join(key)}.')
    return fn(table[key])
  return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_var)


def decay_mask(table: dict, decay_all: bool = False, exclude: tuple[str, ...] = ()):
  """A mask function (``True`` = decayed) for optax, from :func:`param_metadata`: matmul
  kernels (every parameter with ``decay_all``), less those whose path (names joined by
  ``/``) an ``exclude`` regular expression matches. MoE balancing biases
  (:class:`~maxnnx.layers.moe.RouterBias`) are never decayed: only the balancing rule moves
  them."""
  patterns = [re.compile(p) for p in exclude]

  def decayed(meta):
    if meta.get('balancing_bias') or any(p.search(meta.get('path', '')) for p in patterns):
      return False
    return decay_all or is_matmul_kernel(meta)

  return lambda tree: _map_params(decayed, table, tree)


def decoupled_weight_decay(learning_rate: optax.Schedule, rate: float, mask
                           ) -> optax.GradientTransformation:
  """Adds ``-learning_rate(step) * rate * param`` to the updates of the parameters ``mask``
  selects: AdamW's decoupled decay, for an optimizer whose own decay cannot be masked."""
  decay = optax.chain(optax.add_decayed_weights(rate, mask),
                      optax.scale_by_learning_rate(learning_rate))

  def update(updates, state, params=None):
    decayed, state = decay.update(jax.tree.map(jnp.zeros_like, updates), state, params)
    return jax.tree.map(jnp.add, updates, decayed), state

  return optax.GradientTransformation(decay.init, update)


def muon_dimension_numbers(table: dict):
  """Muon's matrix view of each kernel (``None``: optimise it with Adam instead).

  Leading ``layers``/``expert`` axes are batch axes; the next ``contract_ndim``
  axes are the input of the matmul and the rest its output. Embeddings, the
  output head, norms and biases go to Adam, as Muon prescribes.
  """
  def one(meta):
    contract = meta.get('contract_ndim')
    names = tuple(meta.get('out_sharding') or ())
    if contract is None or 'vocab' in names or len(names) != meta['ndim']:
      return None
    lead = 0
    while lead < len(names) and names[lead] in _BATCH_AXES:
      lead += 1
    reduction = tuple(range(lead, lead + contract))
    output = tuple(range(lead + contract, meta['ndim']))
    if not output:
      return None
    return optax.contrib.MuonDimensionNumbers(reduction_axis=reduction, output_axis=output)

  return lambda tree: _map_params(one, table, tree)


def make_schedule(cfg: TrainConfig) -> optax.Schedule:
  """The learning rate at each step: warmup, then cosine, WSD or constant, over
  ``learning_rate_schedule_steps`` (default ``steps``) and flat after them."""
  peak, steps, warmup = cfg.learning_rate, cfg.resolved_schedule_steps, cfg.resolved_warmup_steps
  end = peak * cfg.final_lr_fraction
  warm = optax.linear_schedule(0.0, peak, warmup) if warmup else optax.constant_schedule(peak)
  if cfg.schedule == 'constant':
    return optax.join_schedules([warm, optax.constant_schedule(peak)], [warmup])
  if cfg.schedule == 'cosine':
    rest = max(steps - warmup, 1)
    return optax.join_schedules([warm, optax.cosine_decay_schedule(peak, rest, end / peak if peak
                                                                    else 0.0)], [warmup])
  decay = max(int(round(steps * cfg.decay_fraction)), 1)
  stable = max(steps - warmup - decay, 0)
  if cfg.decay_shape == 'linear':
    tail = optax.linear_schedule(peak, end, decay)
  else:
    tail = optax.cosine_decay_schedule(peak, decay, end / peak if peak else 0.0)
  return optax.join_schedules([warm, optax.constant_schedule(peak), tail],
                              [warmup, warmup + stable])


def schedule_change(cfg: TrainConfig, made_for: int, step: int) -> str | None:
  """One line saying what resuming at ``step`` a run whose learning-rate schedule was
  ``made_for`` steps long does to it now that ``cfg``'s schedule has another length (``None``
  when it has not)."""
  length = cfg.resolved_schedule_steps
  if made_for == length:
    return None
  before = float(make_schedule(dataclasses.replace(cfg, learning_rate_schedule_steps=made_for))(
      step))
  after = float(make_schedule(cfg)(step))
  rate = (f'the learning rate jumps from {before:.3g} to {after:.3g}' if before != after else
          f'the learning rate is {after:.3g} at this step either way but differs after it')
  return (f'resuming at step {step} of a run whose learning-rate schedule was {made_for} steps '
          f'long: it is {"stretched" if length > made_for else "shrunk"} to {length} steps, so '
          f'{rate}; set learning_rate_schedule_steps={made_for} to keep it.')


def make_optimizer(cfg: TrainConfig, model: nnx.Module) -> optax.GradientTransformation:
  """The optax transformation ``cfg`` asks for, with clipping in front.

  ``model`` (concrete or abstract) provides each parameter's metadata for the
  weight-decay mask and Muon's matrix shapes.
  """
  lr = make_schedule(cfg)
  table = param_metadata(model)
  mask = decay_mask(table, cfg.decay_all, cfg.weight_decay_exclude)
  mu_dtype = None if cfg.mu_dtype is None else jnp.dtype(cfg.mu_dtype)
  if cfg.optimizer == 'adamw':
    tx = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, eps_root=cfg.adam_eps_root,
                     mu_dtype=mu_dtype, weight_decay=cfg.weight_decay, mask=mask)
  elif cfg.optimizer == 'sgd':
    tx = optax.chain(optax.add_decayed_weights(cfg.weight_decay, mask),
                     optax.sgd(lr, momentum=cfg.momentum or None, accumulator_dtype=mu_dtype))
  elif cfg.optimizer == 'adafactor':
    tx = optax.adafactor(lr, weight_decay_rate=cfg.weight_decay or None,
                         weight_decay_mask=mask, multiply_by_parameter_scale=False)
  else:  # muon; its Adam part's own decay has no mask, so one decay covers both parts
    tx = optax.chain(
        optax.contrib.muon(lr, adam_b1=cfg.b1, adam_b2=cfg.b2, eps=cfg.eps,
                           adam_eps_root=cfg.adam_eps_root, mu_dtype=mu_dtype,
                           muon_weight_dimension_numbers=muon_dimension_numbers(table)),
        decoupled_weight_decay(lr, cfg.weight_decay, mask))
  if cfg.clip_norm is not None:
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
  return tx

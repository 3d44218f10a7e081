"""Mixture-of-Experts feed-forward block: a router, routed SwiGLU experts, shared experts.

One module covers Mixtral, Qwen3-MoE, DeepSeek V2/V3, GPT-OSS and Llama 4; they
differ only in :class:`~maxnnx.config.MoEConfig` fields (``router_*``, ``expert_bias``,
``swiglu_limit``, ``num_shared_experts``…).

Routing (:func:`route`): scores are a softmax or a sigmoid of the router
logits (float32); an optional per-expert bias (aux-loss-free balancing) shifts
the scores used for *choosing* experts but not the weights; group-limited
routing first keeps the best ``router_topk_groups`` of ``router_groups`` expert
groups; the top-k weights are optionally renormalised, then scaled.

Dispatch, chosen by ``dispatch``:

* ``dropless``: the ``tokens * k`` assignments are sorted by expert and run as
  grouped matmuls (``runtime.ragged_dot_impl`` kernel), then unsorted. No token is dropped.
* ``capacity``: the tokens are split into capacity groups (``capacity_group``: each
  sequence, as MaxText's dropping path, or the whole batch); in every group each expert gets
  ``ceil(capacity_factor * group_tokens * k / num_experts)`` slots, filled first choices
  first; assignments that overflow are dropped (their weight is lost). Static shapes, plain
  batched matmuls. Per-sequence groups run on each batch shard like the dropless sort, so
  no routing crosses devices and each device's buffers hold only its own rows' slots.

The dropless sort runs on each batch shard (the devices that split the batch other than over
``expert`` each sort their own tokens:
:func:`~maxnnx.layers.expert_parallel.dispatch_per_batch_shard`); a global sort left to GSPMD
would be replicated on every device. Across the ``expert`` mesh axis, either dispatch runs as
GSPMD partitions it or, with ``mesh.expert_parallel_strategy=all_to_all``, per device with
tokens exchanged by ``all_to_all`` (:mod:`maxnnx.layers.expert_parallel`).

Auxiliary outputs: every forward pass overwrites four :class:`MoeAux`
variables on the module (``tokens_per_expert [E]``, ``load_balance_loss``,
``router_z_loss``, ``dropped_assignments``: what the ``all_to_all`` exchange's receive cap,
``ragged_buffer_factor``, dropped); in a scanned stack they carry a leading ``layers`` axis.
Read them after the forward pass inside the loss function with
:func:`moe_aux_losses` (differentiable), :func:`expert_loads` or :func:`moe_stats`. The
train step moves the aux-loss-free bias after the optimizer step with
:func:`balance_router_biases` (rate ``MoEConfig.router_bias_update_rate``) from the
step's loads; :func:`update_router_bias` does the same by hand with a rate of your own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxnnx.config import ModelConfig, MoEConfig, RuntimeConfig
from maxnnx.kernels.lookup import kernel_for
from maxnnx.kernels.options import RaggedDotOptions
from maxnnx.layers.expert_parallel import (
  count_per_batch_shard,
  dispatch_all_to_all,
  dispatch_per_batch_shard,
)
from maxnnx.layers.layer_call import LayerCall
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.mlp import ACTIVATIONS, MLP
from maxnnx.layers.moe_dispatch import CapacityPlan, capacity, sorted_inputs
from maxnnx.layers.params import ForwardStat, logical_param
from maxnnx.sharding import constrain, expert_parallel_strategy, mesh_axis_size

EXPERT_AXES = ('activation_expert', None, 'activation_embed')
EXPERT_HIDDEN_AXES = ('activation_expert', None, 'activation_mlp')
GROUP_AXES = ('activation_batch', None, None, 'activation_embed')  # [groups, E, slots, D]


class MoeAux(ForwardStat):
  """Routing statistics and auxiliary losses of the last forward pass.

  Not parameters (optimizers built with ``wrt=nnx.Param`` skip them) and not
  saved by ``save_pretrained``; overwritten on every call.
  """


class RouterBias(nnx.Param):
  """The aux-loss-free balancing bias (``e_score_correction_bias``).

  A ``Param`` subclass so checkpoints load and save it, but its gradient is zero
  (it only decides which experts are chosen) and weight decay never applies to it,
  so the optimizer leaves it where it is; the train step moves it with
  :func:`balance_router_biases` after the update.
  """


class Router(DenseGeneral):
  """``[d_model] -> [num_experts]`` logits in float32, plus the optional balancing bias.

  Attributes:
    kernel: ``[d_model, num_experts]``.
    bias: ``[num_experts]`` projection bias (GPT-OSS) or ``None``.
    e_score_correction_bias: :class:`RouterBias` ``[num_experts]`` or ``None``.
    input_scale: ``[d_model]`` scale of the normalised router input
      (``router_input_norm``) or ``None``.
    expert_scale: ``[num_experts]`` multiplier of the routing weights
      (``per_expert_scale``) or ``None``.
  """

  def __init__(self, cfg: MoEConfig, d_model: int, *, param_dtype, rngs: nnx.Rngs,
               norm_eps: float = 1e-6):
    super().__init__((d_model,), (cfg.num_experts,), axes=('embed', None),
                     use_bias=cfg.router_bias, dtype=jnp.float32,
                     param_dtype=param_dtype, rngs=rngs)
    self.e_score_correction_bias = (
        RouterBias(jnp.zeros((cfg.num_experts,), jnp.float32), out_sharding=(None,),
                   eager_sharding=False) if cfg.router_score_bias else None)
    ones = nnx.initializers.ones
    self.input_scale = (logical_param(ones, rngs.params(), (d_model,), param_dtype, ('embed',))
                        if cfg.router_input_norm else None)
    self.expert_scale = (logical_param(ones, rngs.params(), (cfg.num_experts,), param_dtype,
                                       (None,))
                         if cfg.per_expert_scale else None)
    self.norm_eps = norm_eps

  def __call__(self, x_ND: jax.Array) -> jax.Array:
    """Router logits ``[N, num_experts]`` (float32)."""
    if self.input_scale is not None:  # Gemma 4: unit RMS, learned scale, 1/sqrt(d_model)
      x32 = x_ND.astype(jnp.float32)
      x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
                                + self.norm_eps)
      x_ND = (x32 * self.input_scale[...].astype(jnp.float32)
              * x_ND.shape[-1] ** -0.5).astype(x_ND.dtype)
    return super().__call__(x_ND)


class Experts(nnx.Module):
  """``num_experts`` gated MLPs with stacked weights (logical axis ``expert`` first).

  Attributes:
    gate_proj, up_proj: ``[experts, d_model, expert_dim]`` (qwix ``QArray`` values once
      :func:`~maxnnx.inference.quantize.quantize_for_inference` quantized them: the grouped
      matmuls then run through ``qwix.ragged_dot`` / ``qwix.einsum``).
    down_proj: ``[experts, expert_dim, d_model]``.
    gate_bias, up_bias: ``[experts, expert_dim]`` (``expert_bias`` only).
    down_bias: ``[experts, d_model]`` (``expert_bias`` only).
  """

  def __init__(self, cfg: MoEConfig, d_model: int, expert_dim: int, *, param_dtype,
               rngs: nnx.Rngs):
    e, d, f = cfg.num_experts, d_model, expert_dim
    dtype = param_dtype

    def param(shape, axes, fan_in):
      init = nnx.initializers.normal(fan_in**-0.5) if fan_in else nnx.initializers.zeros
      return logical_param(init, rngs.params(), shape, dtype, axes)

    self.gate_proj = param((e, d, f), ('expert', 'embed', 'mlp'), d)
    self.up_proj = param((e, d, f), ('expert', 'embed', 'mlp'), d)
    self.down_proj = param((e, f, d), ('expert', 'mlp', 'embed'), f)
    if cfg.expert_bias:
      self.gate_bias = param((e, f), ('expert', 'mlp'), 0)
      self.up_bias = param((e, f), ('expert', 'mlp'), 0)
      self.down_bias = param((e, d), ('expert', 'embed'), 0)
    else:
      self.gate_bias = self.up_bias = self.down_bias = None


def route(logits_NE: jax.Array, cfg: MoEConfig, score_bias_E: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Choose ``num_experts_per_tok`` experts per token.

  Returns:
    ``(weights_NK, experts_NK, scores_NE)``: float32 weights of the chosen
    experts, their int32 ids, and every expert's score (for the balancing loss).
  """
  logits_NE = logits_NE.astype(jnp.float32)
  num_tokens, num_experts = logits_NE.shape
  if cfg.router_score == 'softmax':
    scores_NE = jax.nn.softmax(logits_NE, axis=-1)
  else:
    scores_NE = jax.nn.sigmoid(logits_NE)
  choice_NE = scores_NE if score_bias_E is None else scores_NE + score_bias_E.astype(jnp.float32)
  if cfg.router_groups > 1:
    groups = cfg.router_groups
    grouped_NGX = choice_NE.reshape(num_tokens, groups, num_experts // groups)
    if cfg.router_group_score == 'max':
      group_scores_NG = grouped_NGX.max(axis=-1)
    else:
      group_scores_NG = jax.lax.top_k(grouped_NGX, 2)[0].sum(axis=-1)
    _, best_groups_NT = jax.lax.top_k(group_scores_NG, cfg.router_topk_groups)
    keep_NG = jnp.any(best_groups_NT[..., None] == jnp.arange(groups), axis=-2)
    keep_NE = jnp.repeat(keep_NG, num_experts // groups, axis=-1)
    choice_NE = jnp.where(keep_NE, choice_NE, -jnp.inf)
  _, experts_NK = jax.lax.top_k(choice_NE, cfg.num_experts_per_tok)
  weights_NK = jnp.take_along_axis(scores_NE, experts_NK, axis=-1)
  if cfg.router_norm_topk:
    weights_NK = weights_NK / (weights_NK.sum(axis=-1, keepdims=True) + 1e-20)
  return weights_NK * cfg.router_scaling_factor, experts_NK.astype(jnp.int32), scores_NE


class MoE(nnx.Module):
  """Routed experts (top-k of ``num_experts``) plus optional shared experts.

  Attributes:
    router: :class:`Router`.
    experts: :class:`Experts` (stacked expert weights).
    shared_experts: an :class:`~maxnnx.layers.mlp.MLP` of width
      ``shared_mlp_dim`` (default ``num_shared_experts * expert_dim``) applied to every
      token, or ``None``.
    shared_expert_gate: ``[d_model] -> [1]``, whose sigmoid scales the shared
      experts' output per token (``shared_expert_gate``), or ``None``.
    ragged_dot: the grouped-matmul kernel (``runtime.ragged_dot_impl``), shown in treescope.
    tokens_per_expert, load_balance_loss, router_z_loss: :class:`MoeAux` of the
      last call (assignments per expert ``[E]``; the two scalar losses).
    dropped_assignments: :class:`MoeAux`, the assignments of the last call that the
      dropless ``all_to_all`` exchange's receive cap (``ragged_buffer_factor``) dropped, over
      all devices (0 without the cap, and for every other dispatch).
  """

  def __init__(self, cfg: MoEConfig, *, d_model: int, expert_dim: int, rngs: nnx.Rngs,
               activation: str = 'silu', runtime: RuntimeConfig | None = None,
               norm_eps: float = 1e-6):
    """Args:
      cfg: the MoE settings.
      d_model: width of the residual stream.
      expert_dim: hidden width of each expert (``ModelConfig.resolved_moe_mlp_dim``).
      rngs: parameter init.
      activation: the gate activation of the experts (``ModelConfig.mlp_activation``).
      runtime: dtypes and the ragged-dot kernel (``ModelConfig.runtime``).
      norm_eps: epsilon of the router's input norm (``router_input_norm``).
    """
    runtime = runtime or RuntimeConfig()
    self.cfg = cfg
    self.activation = activation
    self.dtype = runtime.jnp_dtype()
    param_dtype = runtime.jnp_dtype('param_dtype')
    self.router = Router(cfg, d_model, param_dtype=param_dtype, rngs=rngs, norm_eps=norm_eps)
    self.experts = Experts(cfg, d_model, expert_dim, param_dtype=param_dtype, rngs=rngs)
    shared_dim = (cfg.shared_mlp_dim if cfg.shared_mlp_dim is not None
                  else cfg.num_shared_experts * expert_dim)
    self.shared_experts = (MLP(d_model, shared_dim, activation=activation, runtime=runtime,
                               rngs=rngs) if shared_dim else None)
    self.shared_expert_gate = (
        DenseGeneral((d_model,), (1,), axes=('embed', None), dtype=self.dtype,
                     param_dtype=param_dtype, rngs=rngs)
        if shared_dim and cfg.shared_expert_gate else None)
    self.ragged_dot = kernel_for(runtime, 'ragged_dot')
    self.tokens_per_expert = MoeAux(jnp.zeros((cfg.num_experts,), jnp.float32), combine='sum')
    self.load_balance_loss = MoeAux(jnp.zeros((), jnp.float32))
    self.router_z_loss = MoeAux(jnp.zeros((), jnp.float32))
    self.dropped_assignments = MoeAux(jnp.zeros((), jnp.float32), combine='sum')

  @classmethod
  def from_config(cls, cfg: ModelConfig, *, rngs: nnx.Rngs) -> MoE:
    """The MoE block of a model: ``cfg.moe`` with the model's width, activation
    and runtime settings."""
    return cls(cfg.moe, d_model=cfg.d_model, expert_dim=cfg.resolved_moe_mlp_dim,
               activation=cfg.mlp_activation, runtime=cfg.runtime, rngs=rngs,
               norm_eps=cfg.norm_eps)

  def _glu(self, gate, up):
    cfg = self.cfg
    if cfg.swiglu_limit is None:
      return ACTIVATIONS[self.activation](gate) * up
    limit = cfg.swiglu_limit
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(cfg.swiglu_alpha * gate)

  def expert_weights(self) -> dict[str, jax.Array | None]:
    """The experts' stacked weights as arrays (``None`` for absent biases), expert axis
    first: what the feed-forward helpers and the all-to-all dispatch take."""
    ex = self.experts

    def value(param):
      return None if param is None else param[...]

    return {'gate': value(ex.gate_proj), 'up': value(ex.up_proj), 'down': value(ex.down_proj),
            'gate_bias': value(ex.gate_bias), 'up_bias': value(ex.up_bias),
            'down_bias': value(ex.down_bias)}

  def grouped_ffn(self, x_MD, experts_M, group_sizes_G, weights):
    """Expert feed-forward of rows sorted by expert (grouped matmuls, float32 out).

    ``experts_M`` is each row's index into ``weights`` (rows past the groups are padding:
    their results are never read); ``group_sizes_G`` the rows per expert.
    """
    dtype = self.dtype

    def grouped(lhs, rhs):
      if not isinstance(rhs, jax.Array):  # quantized for inference: a qwix QArray
        import qwix  # noqa: PLC0415  (a slow import, for quantized models only)
        return qwix.ragged_dot(lhs, rhs, group_sizes_G, preferred_element_type=jnp.float32)
      return self.ragged_dot(lhs, rhs.astype(dtype), group_sizes_G,
                             RaggedDotOptions(preferred_element_type=jnp.float32))

    gate_MF, up_MF = grouped(x_MD, weights['gate']), grouped(x_MD, weights['up'])
    if weights['gate_bias'] is not None:
      gate_MF = gate_MF + weights['gate_bias'][experts_M].astype(jnp.float32)
      up_MF = up_MF + weights['up_bias'][experts_M].astype(jnp.float32)
    h_MF = checkpoint_name(self._glu(gate_MF, up_MF).astype(dtype), 'mlp_hidden')
    y_MD = grouped(h_MF, weights['down'])
    if weights['down_bias'] is not None:
      y_MD = y_MD + weights['down_bias'][experts_M].astype(jnp.float32)
    return y_MD

  def batched_ffn(self, buffer_ECD, weights):
    """Expert feed-forward of per-expert buffers ``[experts, slots, d_model]`` (float32 out)."""
    dtype = self.dtype

    def batched(lhs, rhs):
      if not isinstance(rhs, jax.Array):  # quantized for inference: a qwix QArray
        import qwix  # noqa: PLC0415
        return qwix.einsum('ecd,edf->ecf', lhs, rhs, preferred_element_type=jnp.float32)
      return jnp.einsum('ecd,edf->ecf', lhs, rhs.astype(dtype),
                        preferred_element_type=jnp.float32)

    gate_ECF, up_ECF = batched(buffer_ECD, weights['gate']), batched(buffer_ECD, weights['up'])
    if weights['gate_bias'] is not None:
      gate_ECF = gate_ECF + weights['gate_bias'][:, None].astype(jnp.float32)
      up_ECF = up_ECF + weights['up_bias'][:, None].astype(jnp.float32)
    h_ECF = checkpoint_name(constrain(self._glu(gate_ECF, up_ECF).astype(dtype),
                                      EXPERT_HIDDEN_AXES), 'mlp_hidden')
    y_ECD = batched(h_ECF, weights['down'])
    if weights['down_bias'] is not None:
      y_ECD = y_ECD + weights['down_bias'][:, None].astype(jnp.float32)
    return y_ECD

  def _dropless(self, x_ND, weights_NK, experts_NK, input_weights_NK, expert_weights):
    """Sort assignments by expert, grouped matmuls, unsort, weighted sum."""
    num_tokens, k = experts_NK.shape
    experts_M = experts_NK.reshape(-1)
    order_M = jnp.argsort(experts_M, stable=True)
    x_MD = sorted_inputs(x_ND, order_M, k, input_weights_NK).astype(self.dtype)
    group_sizes_E = jnp.bincount(experts_M, length=self.cfg.num_experts).astype(jnp.int32)
    y_MD = self.grouped_ffn(x_MD, experts_M[order_M], group_sizes_E, expert_weights)
    y_NKD = y_MD[jnp.argsort(order_M)].reshape(num_tokens, k, -1)
    return jnp.einsum('nkd,nk->nd', y_NKD, weights_NK)

  def _capacity(self, x_ND, weights_NK, experts_NK, input_weights_NK, expert_weights,
                group_size: int):
    """Fixed per-expert buffers per group of ``group_size`` consecutive tokens.

    Group ``g`` is tokens ``[g * group_size, (g + 1) * group_size)``. In each group every
    expert has ``capacity(group_size)`` slots, filled in choice-major order (all the group's
    first choices in token order, then its second choices, ...); an assignment that finds
    its expert's slots full is dropped. The groups' slots of one expert run as one batched
    matmul (``[experts, groups * slots, d_model]``).
    """
    num_tokens, d = x_ND.shape
    groups, num_experts = num_tokens // group_size, self.cfg.num_experts
    slots = capacity(group_size, self.cfg)

    def grouped(a):
      return None if a is None else a.reshape(groups, group_size, *a.shape[1:])

    plans = jax.vmap(lambda e: CapacityPlan.of(e, slots))(grouped(experts_NK))
    buffer_GECD = jax.vmap(lambda plan, x, w: plan.pack(x, w, num_experts, self.dtype))(
        plans, grouped(x_ND), grouped(input_weights_NK))
    # Several groups: each packed where its tokens are (split over ``expert`` too when that
    # splits the batch), then moved to the experts' devices (an all-to-all) and back.
    by_group = constrain if groups > 1 else lambda a, _: a
    buffer_GECD = by_group(buffer_GECD, GROUP_AXES)
    buffer_ECD = buffer_GECD.transpose(1, 0, 2, 3).reshape(num_experts, groups * slots, d)
    y_ECD = self.batched_ffn(constrain(buffer_ECD, EXPERT_AXES), expert_weights)
    y_GECD = by_group(y_ECD.reshape(num_experts, groups, slots, d).transpose(1, 0, 2, 3),
                      GROUP_AXES)
    y_GSD = jax.vmap(lambda plan, y, w: plan.combine(y, w))(plans, y_GECD, grouped(weights_NK))
    return y_GSD.reshape(num_tokens, d)

  def __call__(self, x_BTD: jax.Array, call: LayerCall | None = None,
               router_input_BTD: jax.Array | None = None) -> jax.Array:
    """MoE output ``[B, T, d_model]``; also records this call's :class:`MoeAux`.

    ``call`` (the block's :class:`~maxnnx.layers.layer_call.LayerCall`) is not read.

    ``router_input_BTD`` (default ``x_BTD``) is what the router reads: Gemma 4
    routes on the residual stream while its experts read a normalised copy.
    """
    del call
    cfg = self.cfg
    batch, length, d = x_BTD.shape
    x_ND = x_BTD.reshape(-1, d)
    logits_NE = self.router(x_ND if router_input_BTD is None
                            else router_input_BTD.reshape(-1, d))
    bias = self.router.e_score_correction_bias
    weights_NK, experts_NK, scores_NE = route(logits_NE, cfg, None if bias is None else bias[...])
    if self.router.expert_scale is not None:
      weights_NK = weights_NK * self.router.expert_scale[...].astype(jnp.float32)[experts_NK]
    input_weights_NK = None
    if cfg.router_weights_on_input:  # Llama 4: experts see weighted inputs, outputs are summed
      input_weights_NK, weights_NK = weights_NK, jnp.ones_like(weights_NK)
    dropped = 0  # by the all_to_all exchange's receive cap (ragged_buffer_factor)
    if expert_parallel_strategy() == 'all_to_all' and mesh_axis_size('expert') > 1:
      y_ND, dropped = dispatch_all_to_all(self, x_BTD, weights_NK, experts_NK,
                                          input_weights_NK)
    elif cfg.dispatch == 'dropless':  # sorted per batch shard: nothing global to replicate
      y_ND = dispatch_per_batch_shard(self._dropless, batch, x_ND, weights_NK, experts_NK,
                                      input_weights_NK, self.expert_weights())
    elif cfg.capacity_group == 'sequence':  # groups never span a batch shard: run per shard
      y_ND = dispatch_per_batch_shard(functools.partial(self._capacity, group_size=length),
                                      batch, x_ND, weights_NK, experts_NK, input_weights_NK,
                                      self.expert_weights())
    else:  # one group of the global batch
      y_ND = self._capacity(x_ND, weights_NK, experts_NK, input_weights_NK,
                            self.expert_weights(), group_size=x_ND.shape[0])
    counts_E = count_per_batch_shard(experts_NK, cfg.num_experts, batch)
    y_BTD = checkpoint_name(y_ND.astype(self.dtype).reshape(batch, length, d), 'mlp_out')
    if self.shared_experts is not None:
      shared_BTD = self.shared_experts(x_BTD)
      if self.shared_expert_gate is not None:
        shared_BTD = shared_BTD * jax.nn.sigmoid(self.shared_expert_gate(x_BTD))
      y_BTD = y_BTD + shared_BTD

    counts_E = counts_E.astype(jnp.float32)
    num_tokens = x_ND.shape[0]
    # Switch/Mixtral balancing loss: E * sum_e (assignments_e / tokens) * mean score_e.
    # Sigmoid scores are normalised per token first, so both sum to 1 over experts.
    probs_NE = scores_NE / scores_NE.sum(axis=-1, keepdims=True)
    fraction_E = jax.lax.stop_gradient(counts_E) / num_tokens
    self.load_balance_loss[...] = cfg.num_experts * jnp.sum(fraction_E * probs_NE.mean(axis=0))
    z_N = jax.nn.logsumexp(logits_NE.astype(jnp.float32), axis=-1)
    self.router_z_loss[...] = jnp.mean(jnp.square(z_N))
    self.tokens_per_expert[...] = jax.lax.stop_gradient(counts_E)
    self.dropped_assignments[...] = jnp.asarray(dropped, jnp.float32)
    return y_BTD


# -- training-side helpers -------------------------------------------------------------------


def _moe_modules(model) -> list[MoE]:
  return [node for _, node in nnx.iter_graph(model) if isinstance(node, MoE)]


def moe_aux_losses(model) -> dict[str, jax.Array]:
  """The mean over MoE layers of each auxiliary loss of the last forward pass.

  Call it inside the loss function, after the forward pass, so the losses are
  differentiable; a model without MoE layers gives zeros. Add
  ``router_aux_loss_coef * load_balance_loss + router_z_loss_coef *
  router_z_loss`` to the training loss (see :func:`moe_loss`; the weights are
  :class:`~maxnnx.train.config.TrainConfig` settings).
  """
  lb, z = [], []
  for moe in _moe_modules(model):
    lb.append(moe.load_balance_loss[...].reshape(-1))
    z.append(moe.router_z_loss[...].reshape(-1))
  if not lb:
    zero = jnp.zeros((), jnp.float32)
    return {'load_balance_loss': zero, 'router_z_loss': zero}
  return {'load_balance_loss': jnp.concatenate(lb).mean(),
          'router_z_loss': jnp.concatenate(z).mean()}


def moe_loss(model, router_aux_loss_coef: float, router_z_loss_coef: float) -> jax.Array:
  """``router_aux_loss_coef * load_balance_loss + router_z_loss_coef * router_z_loss``."""
  losses = moe_aux_losses(model)
  return (router_aux_loss_coef * losses['load_balance_loss']
          + router_z_loss_coef * losses['router_z_loss'])


def moe_stats(model) -> np.ndarray:
  """Assignments per expert of the last forward pass, ``[moe_layers, experts]`` (host array)."""
  rows = [np.asarray(moe.tokens_per_expert[...]).reshape(-1, moe.cfg.num_experts)
          for moe in _moe_modules(model)]
  return np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)


def router_bias_update(bias_E: jax.Array, tokens_per_expert_E: jax.Array,
                       rate: float) -> jax.Array:
  """Aux-loss-free balancing step (DeepSeek V3): raise the bias of under-loaded
  experts and lower it for over-loaded ones by ``rate``:
  ``bias + rate * sign(mean load - load)`` (per layer, over the last axis)."""
  load = tokens_per_expert_E.astype(jnp.float32)
  return bias_E + rate * jnp.sign(load.mean(axis=-1, keepdims=True) - load)


def expert_loads(model) -> list[jax.Array]:
  """Assignments per expert of the last forward pass, one array per MoE module of ``model``
  (``[E]``, or ``[layers, E]`` for a scanned stack), in graph order; traceable, unlike
  :func:`moe_stats`. Empty for a model without MoE layers."""
  return [moe.tokens_per_expert[...] for moe in _moe_modules(model)]


def dropped_assignments(model) -> list[jax.Array]:
  """Assignments of the last forward pass that the ``all_to_all`` exchange's receive cap
  (``MoEConfig.ragged_buffer_factor``) dropped, one scalar (``[layers]`` for a scanned stack)
  per MoE module of ``model`` whose config sets the cap, in graph order; traceable."""
  return [moe.dropped_assignments[...] for moe in _moe_modules(model)
          if moe.cfg.ragged_buffer_factor is not None]


def dropped_fraction(loads: list[jax.Array], dropped: list[jax.Array]) -> dict[str, jax.Array]:
  """``moe_dropped_fraction``: the share of the MoE layers' assignments that the receive cap
  dropped (``dropped``: :func:`dropped_assignments`; ``loads``: :func:`expert_loads`, of a
  model whose MoE layers share one config). Empty when the model sets no cap."""
  if not dropped:
    return {}
  total = sum(load.astype(jnp.float32).sum() for load in loads)
  return {'moe_dropped_fraction': sum(d.sum() for d in dropped) / jnp.maximum(total, 1.0)}


def balance_router_biases(model, loads: list[jax.Array]) -> None:
  """The aux-loss-free balancing step of every MoE module of ``model`` in place: each
  module's ``router_score_bias`` moves by its ``router_bias_update_rate`` with
  :func:`router_bias_update` against ``loads`` (:func:`expert_loads` of the same model,
  e.g. summed over a step's micro-batches). Modules with no bias or a rate of 0 keep theirs."""
  for moe, load in zip(_moe_modules(model), loads, strict=True):
    bias, rate = moe.router.e_score_correction_bias, moe.cfg.router_bias_update_rate
    if bias is not None and rate:
      bias[...] = router_bias_update(bias[...], load, rate).astype(bias.dtype)


def load_spread(loads: list[jax.Array]) -> dict[str, jax.Array]:
  """How unevenly tokens went to experts, averaged over MoE layers: ``moe_load_cv`` (the
  standard deviation of the load over experts divided by its mean) and
  ``moe_max_violation`` (``(max load - mean load) / mean load``). Empty without MoE layers."""
  if not loads:
    return {}
  rows = jnp.concatenate([load.reshape(-1, load.shape[-1]).astype(jnp.float32)
                          for load in loads])
  mean = jnp.maximum(rows.mean(axis=-1), 1e-9)
  return {'moe_load_cv': (rows.std(axis=-1) / mean).mean(),
          'moe_max_violation': ((rows.max(axis=-1) - mean) / mean).mean()}


def update_router_bias(model, rate: float) -> None:
  """Apply :func:`router_bias_update` to every MoE layer of ``model`` in place,
  using the loads recorded by its last forward pass (by hand: the Trainer's step does
  this itself with :func:`balance_router_biases` when ``router_bias_update_rate`` is set)."""
  for moe in _moe_modules(model):
    bias = moe.router.e_score_correction_bias
    if bias is not None:
      bias[...] = router_bias_update(bias[...], moe.tokens_per_expert[...], rate).astype(
          bias.dtype)

"""NumPy float64 reference of a Mixture-of-Experts block, token by token.

Written from the published routing rules (Switch/Mixtral top-k, DeepSeek
group-limited sigmoid routing with a balancing bias, GPT-OSS clamped SwiGLU)
with plain loops, independently of ``maxnnx.layers.moe``.
"""

import math

import numpy as np
from numpy_reference import ACTIVATIONS, f64, mlp


def _softmax(v):
  e = np.exp(v - v.max())
  return e / e.sum()


def _route_one(logits_E, cfg, score_bias):
  """(chosen experts in order of preference, their weights) for one token."""
  if cfg.moe.router_score == 'softmax':
    scores = _softmax(logits_E)
  else:
    scores = 1 / (1 + np.exp(-logits_E))
  choice = scores + (0 if score_bias is None else score_bias)
  num_experts = len(scores)
  if cfg.moe.router_groups > 1:
    size = num_experts // cfg.moe.router_groups
    group_scores = []
    for g in range(cfg.moe.router_groups):
      members = sorted(choice[g * size:(g + 1) * size], reverse=True)
      group_scores.append(members[0] if cfg.moe.router_group_score == 'max'
                          else members[0] + members[1])
    best = sorted(range(cfg.moe.router_groups), key=lambda g: -group_scores[g])
    eligible = best[:cfg.moe.router_topk_groups]
    choice = np.array([c if e // size in eligible else -np.inf for e, c in enumerate(choice)])
  chosen = sorted(range(num_experts), key=lambda e: -choice[e])[:cfg.moe.num_experts_per_tok]
  weights = np.array([scores[e] for e in chosen])
  if cfg.moe.router_norm_topk:
    weights = weights / weights.sum()
  return chosen, weights * cfg.moe.router_scaling_factor, scores


def _expert(x_D, p, e, cfg):
  gate = x_D @ f64(p['gate_proj'])[e]
  up = x_D @ f64(p['up_proj'])[e]
  if 'gate_bias' in p:
    gate, up = gate + f64(p['gate_bias'])[e], up + f64(p['up_bias'])[e]
  if cfg.moe.swiglu_limit is None:
    h = ACTIVATIONS[cfg.mlp_activation](gate) * up
  else:
    gate = np.minimum(gate, cfg.moe.swiglu_limit)
    up = np.clip(up, -cfg.moe.swiglu_limit, cfg.moe.swiglu_limit)
    h = (up + 1) * gate / (1 + np.exp(-cfg.moe.swiglu_alpha * gate))
  y = h @ f64(p['down_proj'])[e]
  return y + f64(p['down_bias'])[e] if 'down_bias' in p else y


def moe(x_ND, p, cfg, capacity=None, group_size=None):
  """Output ``[N, D]``, assignments per expert and the balancing / z losses.

  ``p`` holds ``router`` (``kernel``, optional ``bias`` and
  ``e_score_correction_bias``), ``experts`` and optional ``shared_experts``.
  With ``capacity``, an expert takes at most that many assignments, first
  choices of all tokens before second choices, each in token order. With
  ``group_size`` too, that holds in each run of ``group_size`` consecutive tokens
  separately: every group has its own ``capacity`` slots per expert.
  """
  x_ND = f64(x_ND)
  n, _ = x_ND.shape
  router = p['router']
  logits = x_ND @ f64(router['kernel'])
  if 'bias' in router:
    logits = logits + f64(router['bias'])
  score_bias = f64(router['e_score_correction_bias']) if 'e_score_correction_bias' in router \
      else None
  routes = [_route_one(logits[i], cfg, score_bias) for i in range(n)]
  num_experts = cfg.moe.num_experts
  counts = np.zeros(num_experts)
  kept = np.ones((n, cfg.moe.num_experts_per_tok), bool)
  group_size = group_size or n
  for start in range(0, n, group_size):
    fill = np.zeros(num_experts, int)
    for k in range(cfg.moe.num_experts_per_tok):
      for i in range(start, start + group_size):
        e = routes[i][0][k]
        counts[e] += 1
        if capacity is not None:
          kept[i, k] = fill[e] < capacity
          fill[e] += 1
  out = np.zeros_like(x_ND)
  for i in range(n):
    chosen, weights, _ = routes[i]
    for k, (e, w) in enumerate(zip(chosen, weights)):
      if kept[i, k] and cfg.moe.router_weights_on_input:  # Llama 4: the expert sees w * x
        out[i] += _expert(w * x_ND[i], p['experts'], e, cfg)
      elif kept[i, k]:
        out[i] += w * _expert(x_ND[i], p['experts'], e, cfg)
  if 'shared_experts' in p:
    out += mlp(x_ND, p['shared_experts'], cfg.mlp_activation, True)
  mean_prob = np.mean([r[2] / r[2].sum() for r in routes], axis=0)
  balance = num_experts * float(np.sum(counts / n * mean_prob))
  z_loss = float(np.mean([math.log(np.exp(row).sum()) ** 2 for row in logits]))
  return out, counts, balance, z_loss

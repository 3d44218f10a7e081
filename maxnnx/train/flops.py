"""FLOPs per training token and per-device peak throughput, for TFLOP/s and MFU.

The count follows the convention MaxText reports with: matmul FLOPs only (2 per
multiply-add), training = 3 x forward (forward + two backward matmuls),
attention scores and values counted over the keys each query actually sees
(so causal attention is halved, sliding windows are capped and chunked layers count
only their chunk), and for MoE
only the experts a token is routed to (plus shared experts).
"""

from __future__ import annotations

import jax
import numpy as np

from maxnnx.config import ModelConfig
from maxnnx.hardware import measured_matmul_flops

# Dense bf16 peak FLOP/s per device, by a substring of ``device.device_kind``.
PEAK_FLOPS_BY_KIND = (
    ('H100', 989e12), ('H200', 989e12), ('H800', 989e12), ('H20', 148e12),
    ('B200', 2250e12), ('B100', 1750e12), ('GB200', 2500e12),
    ('A100', 312e12), ('A800', 312e12), ('L40S', 362e12), ('L4', 121e12), ('A10', 125e12),
    ('TPU v6 lite', 918e12), ('TPU v6', 918e12), ('TPU v5p', 459e12),
    ('TPU v5 lite', 197e12), ('TPU v5e', 197e12), ('TPU v5', 459e12),  # v5p says 'TPU v5'
    ('TPU v4', 275e12), ('TPU v3', 123e12),
)


def mean_keys_per_query(seq_len: int, window: int | None, chunk: int | None = None) -> float:
  """Average number of keys a causal query attends to (capped by ``window``; with ``chunk``,
  only those of its own chunk of ``chunk`` positions)."""
  if chunk is not None:  # query p sees (p mod chunk) + 1 keys, capped by the window
    seen = np.arange(seq_len) % chunk + 1
    return float(np.minimum(seen, window or seq_len).mean())
  if window is None or window >= seq_len:
    return (seq_len + 1) / 2
  # Queries 0..window-1 see 1..window keys; the rest see ``window``.
  head = window * (window + 1) / 2
  return (head + (seq_len - window) * window) / seq_len


def _mlp_flops(cfg: ModelConfig, width: int) -> int:
  return 2 * cfg.d_model * width * (3 if cfg.mlp_gated else 2)


def _layer_is_moe(cfg: ModelConfig, layer: int) -> bool:
  return cfg.moe.num_experts > 1 and cfg.moe_layers[layer]


def _block_flops(cfg: ModelConfig, kind: str, is_moe: bool, seq_len: int) -> float:
  d, h = cfg.d_model, cfg.num_heads
  hd, kv, values_from_keys = cfg.attention_shape(kind)
  kv_projections = 1 if values_from_keys else 2
  total = 2 * d * hd * (h + kv_projections * kv) + 2 * h * hd * d  # q, k, v, o projections
  window = cfg.attention.sliding_window if kind == 'sliding' else None
  chunk = cfg.attention.chunk_size if kind == 'chunked' else None
  total += 4 * h * hd * mean_keys_per_query(seq_len, window, chunk)  # q.k and p.v
  if is_moe:
    width = cfg.moe.mlp_dim or cfg.mlp_dim
    total += 2 * d * cfg.moe.num_experts  # router
    total += cfg.moe.num_experts_per_tok * _mlp_flops(cfg, width)
    total += _mlp_flops(cfg, cfg.resolved_shared_mlp_dim)  # 0 without shared experts
    if cfg.moe.dense_branch:  # Gemma 4: the dense MLP runs beside the experts
      total += _mlp_flops(cfg, cfg.mlp_dim)
  else:
    total += _mlp_flops(cfg, cfg.mlp_dim)
  return total


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Forward-pass matmul FLOPs per token of a ``seq_len``-token causal sequence
  (multi-token-prediction modules included: block, ``eh_proj`` and output head each)."""
  d = cfg.d_model
  total = 2 * d * cfg.vocab_size  # output projection (the embedding lookup is free)
  for layer, kind in enumerate(cfg.resolved_layer_types):
    total += _block_flops(cfg, kind, _layer_is_moe(cfg, layer), seq_len)
  mtp_block = _block_flops(cfg, cfg.resolved_layer_types[-1], cfg.moe.num_experts > 1, seq_len)
  total += cfg.mtp.num_layers * (mtp_block + 2 * 2 * d * d + 2 * d * cfg.vocab_size)
  return float(total)


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Forward + backward FLOPs per trained token (3 x forward)."""
  return 3.0 * forward_flops_per_token(cfg, seq_len)


def peak_flops_per_device(device=None, dtype_name: str | None = None) -> tuple[float, str]:
  """``(peak FLOP/s, where it came from)`` for ``device`` (default: the first one).

  Accelerators use their published dense bf16 peak. CPUs (and unknown kinds) use a
  matmul measured now: in ``dtype_name`` when given, else in float32 and bfloat16 and
  the faster of the two (MFU against the fastest dtype the device offers, whatever
  dtype the model computes in).
  """
  device = device or jax.devices()[0]
  kind = getattr(device, 'device_kind', '') or ''
  for key, flops in PEAK_FLOPS_BY_KIND:
    if key.lower() in kind.lower():
      return flops, f'{kind} dense bf16 peak'
  names = (dtype_name,) if dtype_name else ('float32', 'bfloat16')
  rates = {name: measured_matmul_flops(name) for name in names}
  best = max(rates, key=rates.get)
  source = f'measured {best} matmul on {kind or "cpu"}'
  if len(rates) > 1:
    source += ' (faster than ' + ', '.join(n for n in rates if n != best) + ')'
  return rates[best], source

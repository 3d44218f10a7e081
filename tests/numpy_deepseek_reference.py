"""NumPy float64 reference of a DeepSeek V3 model with multi-token prediction.

Written from the DeepSeek V2/V3 papers and their published inference code:
multi-head latent attention (low-rank queries and a shared key/value latent,
rotary embedding on a separate part of each head, interleaved rotary pairs, the
YaRN ``mscale`` in the softmax scale), dense-then-MoE blocks, and the MTP
modules (``eh_proj([enorm(emb(t_{i+k})); hnorm(h^{k-1}_i)])``, one block, the
shared head). Plain loops and explicit shifts; independent of ``maxnnx``.
"""

import math

import numpy as np
from numpy_moe_reference import moe
from numpy_reference import apply_rope, attention, f64, mlp, rms_norm, rope_tables, visible

LORA_EPS = 1e-6  # DeepSeek's q_a / kv_a norms


def _lin(x, p):
  """``x`` times a kernel ``[in..., out...]`` (one input dim here)."""
  k = f64(p['kernel'])
  return np.tensordot(x, k, axes=([x.ndim - 1], [0]))


def _rotate(x_BTNR, positions, inv_freq, factor):
  """Interleaved pairs ``(x0, x1), (x2, x3)…`` rotated as complex numbers; the result
  is laid out as ``[real parts, imaginary parts]`` (the same for queries and keys,
  so their dot products are those of the interleaved layout)."""
  halves = np.concatenate([x_BTNR[..., 0::2], x_BTNR[..., 1::2]], axis=-1)
  return apply_rope(halves, positions, inv_freq, factor)


def mla(x_BTD, p, cfg, positions, segment_ids):
  """Multi-head latent attention output ``[B, T, D]``."""
  nope, rope, heads = cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim, cfg.num_heads
  if cfg.mla.q_lora_rank is None:
    q = _lin(x_BTD, p['q_proj'])
  else:
    q = _lin(rms_norm(_lin(x_BTD, p['q_a_proj']), p['q_a_layernorm']['scale'], LORA_EPS),
             p['q_b_proj'])
  kv_a = _lin(x_BTD, p['kv_a_proj_with_mqa'])
  latent = rms_norm(kv_a[..., :cfg.mla.kv_lora_rank], p['kv_a_layernorm']['scale'], LORA_EPS)
  k_rope = kv_a[..., None, cfg.mla.kv_lora_rank:]
  kv = _lin(latent, p['kv_b_proj'])
  k_nope, v = kv[..., :nope], kv[..., nope:]
  inv_freq, factor = rope_tables(cfg.rope, rope, cfg.max_position_embeddings, positions)
  q_rot = _rotate(q[..., nope:], positions, inv_freq, factor)
  k_rot = np.repeat(_rotate(k_rope, positions, inv_freq, factor), heads, axis=2)
  q = np.concatenate([q[..., :nope], q_rot], axis=-1)
  k = np.concatenate([k_nope, k_rot], axis=-1)
  scale = (nope + rope) ** -0.5
  r = cfg.rope
  if r.scaling == 'yarn' and r.mscale_all_dim:
    yarn_factor = r.factor or cfg.max_position_embeddings / r.original_max_position_embeddings
    if yarn_factor > 1:
      scale *= (0.1 * r.mscale_all_dim * math.log(yarn_factor) + 1.0) ** 2
  allowed = visible(segment_ids, positions, segment_ids, positions)
  out = attention(q, k, v, allowed, scale)
  out = np.where(allowed.any(-1)[..., None, None], out, 0.0)  # padding: no keys, no output
  return np.einsum('btnv,nvd->btd', out, f64(p['o_proj']['kernel']))


def block(x_BTD, p, cfg, positions, segment_ids, use_moe):
  """``x + attn(norm(x))``, then ``x + ffn(norm(x))`` (MoE or dense SwiGLU)."""
  x = f64(x_BTD)
  x = x + mla(rms_norm(x, p['attn_pre_norm']['scale'], cfg.norm_eps), p['attn'], cfg,
              positions, segment_ids)
  h = rms_norm(x, p['mlp_pre_norm']['scale'], cfg.norm_eps)
  if use_moe:
    b, t, d = h.shape
    y = moe(h.reshape(-1, d), p['mlp'], cfg)[0].reshape(b, t, d)
  else:
    y = mlp(h, p['mlp'], cfg.mlp_activation, True)
  return x + y


def _head(x, p, cfg):
  return x @ f64(p['lm_head']['kernel']) if not cfg.tie_word_embeddings else \
      x @ f64(p['embed']['embedding']).T


def deepseek(ids_BT, p, cfg, segment_ids=None, positions=None):
  """``(logits, [mtp logits of depth 1, 2, …])`` of a maxnnx DeepSeek V3 config.

  ``p`` is the model's (unscanned) pure parameter dict. MTP depth ``k`` at
  position ``i`` reads token ``ids[i + k]``; positions past the row's end read
  token 0 (their predictions are never scored).
  """
  ids = np.asarray(ids_BT)
  b, t = ids.shape
  segment_ids = np.ones((b, t), int) if segment_ids is None else np.asarray(segment_ids)
  positions = np.broadcast_to(np.arange(t), (b, t)) if positions is None else np.asarray(positions)
  table = f64(p['embed']['embedding'])
  x = table[ids]
  for i in range(cfg.num_layers):
    x = block(x, p['layers'][i], cfg, positions, segment_ids, cfg.moe_layers[i])
  logits = _head(rms_norm(x, p['final_norm']['scale'], cfg.norm_eps), p, cfg)
  mtp_logits, h = [], x
  for k in range(1, cfg.mtp.num_layers + 1):
    q = p['mtp'][k - 1]
    ahead = np.zeros_like(ids)
    for i in range(t - k):
      ahead[:, i] = ids[:, i + k]
    e = rms_norm(table[ahead], q['embed_norm']['scale'], cfg.norm_eps)
    merged = np.concatenate([e, rms_norm(h, q['hidden_norm']['scale'], cfg.norm_eps)], axis=-1)
    h = block(merged @ f64(q['proj']['kernel']), q['block'], cfg, positions, segment_ids,
              cfg.moe.num_experts > 0)
    mtp_logits.append(_head(rms_norm(h, q['final_norm']['scale'], cfg.norm_eps), p, cfg))
  return logits, mtp_logits


def mtp_cross_entropy(mtp_logits, targets, loss_mask, segment_ids, positions):
  """Per depth, ``(sum of -log p(target) over counted positions, count)``.

  Depth ``k`` at position ``i`` is scored against ``targets[i + k]`` when
  ``i + k`` is in the row, in the same document, ``k`` positions on, and its
  ``loss_mask`` is set.
  """
  out = []
  b, t = np.asarray(targets).shape
  for k, logits in enumerate(mtp_logits, start=1):
    total, count = 0.0, 0.0
    for r in range(b):
      for i in range(t - k):
        j = i + k
        if (segment_ids[r, i] == 0 or segment_ids[r, j] != segment_ids[r, i]
            or positions[r, j] != positions[r, i] + k or not loss_mask[r, j]):
          continue
        row = f64(logits[r, i])
        lse = row.max() + math.log(np.exp(row - row.max()).sum())
        total += loss_mask[r, j] * (lse - row[targets[r, j]])
        count += loss_mask[r, j]
    out.append((total, count))
  return out

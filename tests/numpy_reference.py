"""Independent NumPy float64 reference implementations for the maxnnx tests.

Everything here is written from the published formulas (the papers and the
Hugging Face reference code), deliberately in a different style from maxnnx
(loops, complex numbers, explicit masks), so a shared mistake is unlikely.
"""

import math

import numpy as np

# -- helpers -------------------------------------------------------------------


def f64(x) -> np.ndarray:
  """``x`` as a float64 NumPy array."""
  return np.asarray(x, dtype=np.float64)


def assert_close(actual, expected, rtol=1e-5, atol=1e-6, err_msg=''):
  """``actual`` (any float dtype) matches the float64 ``expected``."""
  np.testing.assert_allclose(f64(actual), f64(expected), rtol=rtol, atol=atol, err_msg=err_msg)


def randomize_params(module, rng: np.random.Generator, std: float = 0.3) -> None:
  """Give every norm scale and every bias random values, so no formula hides.

  Kernels and embeddings keep their (already random) initial values.
  """
  from flax import nnx  # local import: the pure references stay framework-free

  for path, node in list(nnx.iter_graph(module)):
    if isinstance(node, nnx.Param) and path[-1] in ('scale', 'bias'):
      node[...] = (rng.normal(size=node.shape) * std + (1.0 if path[-1] == 'scale' else 0.0)
                   ).astype(node.dtype)


# -- norms -----------------------------------------------------------------------


def rms_norm(x, scale, eps, offset=0.0, ndims=1):
  """``x / sqrt(mean(x²) + eps) * (offset + scale)`` over the last ``ndims`` dims."""
  x = f64(x)
  axes = tuple(range(x.ndim - ndims, x.ndim))
  mean_square = np.mean(x * x, axis=axes, keepdims=True)
  return x / np.sqrt(mean_square + eps) * (offset + f64(scale))


def layer_norm(x, scale, bias, eps, offset=0.0):
  """Mean-centred, variance-normalised ``x`` times ``offset + scale`` plus ``bias``."""
  x = f64(x)
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean)**2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * (offset + f64(scale)) + f64(bias)


# -- rotary frequencies ------------------------------------------------------------


def default_inv_freq(theta, dim):
  """``theta ** (-2i / dim)`` for ``i = 0 .. dim/2 - 1`` (RoFormer)."""
  return np.array([float(theta)**(-(2.0 * i) / dim) for i in range(dim // 2)])


def linear_inv_freq(theta, dim, factor):
  """Position interpolation: every frequency divided by ``factor``."""
  return default_inv_freq(theta, dim) / factor


def llama3_inv_freq(theta, dim, factor, low_freq_factor, high_freq_factor, original):
  """Llama 3.1 band scaling, written as Meta's per-frequency loop."""
  low_freq_wavelen = original / low_freq_factor
  high_freq_wavelen = original / high_freq_factor
  out = []
  for freq in default_inv_freq(theta, dim):
    wavelen = 2 * math.pi / freq
    if wavelen < high_freq_wavelen:
      out.append(freq)
    elif wavelen > low_freq_wavelen:
      out.append(freq / factor)
    else:
      smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out)


def yarn_inv_freq(theta, dim, factor, original, beta_fast=32.0, beta_slow=1.0, truncate=True):
  """YaRN: interpolated and extrapolated frequencies blended over a linear ramp."""

  def correction_dim(num_rotations):
    return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  out = []
  for i, freq in enumerate(default_inv_freq(theta, dim)):
    ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: extrapolate, 1: interpolate
    out.append(ramp * freq / factor + (1 - ramp) * freq)
  return np.array(out)


def yarn_get_mscale(scale, mscale=1.0):
  """YaRN magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when scale <= 1)."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(factor, mscale=None, mscale_all_dim=None):
  """``0.1 ln(factor) + 1``, or DeepSeek's ratio of two mscales when both are set."""
  if mscale and mscale_all_dim:
    return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
  return yarn_get_mscale(factor)


def longrope_inv_freq(theta, dim, short_factor, long_factor):
  """(short, long) LongRoPE frequencies: ``1 / (ext_factor * theta ** (2i / dim))``."""
  base = np.array([float(theta)**((2.0 * i) / dim) for i in range(dim // 2)])
  return 1.0 / (f64(short_factor) * base), 1.0 / (f64(long_factor) * base)


def longrope_attention_factor(max_position_embeddings, original):
  """``sqrt(1 + ln(s) / ln(original))`` with ``s = max / original`` (1 when s <= 1)."""
  scale = max_position_embeddings / original
  return 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))


def rope_tables(rope_cfg, head_dim, max_position_embeddings, positions):
  """Reference ``(inv_freq, attention_factor)`` of a RopeConfig for these positions."""
  dim = int(head_dim * rope_cfg.partial_rotary_factor)
  theta, original = rope_cfg.theta, rope_cfg.original_max_position_embeddings
  factor = rope_cfg.factor
  if rope_cfg.scaling == 'none':
    return default_inv_freq(theta, dim), 1.0
  if rope_cfg.scaling == 'linear':
    return linear_inv_freq(theta, dim, factor), 1.0
  if rope_cfg.scaling == 'llama3':
    return llama3_inv_freq(theta, dim, factor, rope_cfg.low_freq_factor,
                           rope_cfg.high_freq_factor, original), 1.0
  if rope_cfg.scaling == 'yarn':
    factor = factor if factor is not None else max_position_embeddings / original
    inv = yarn_inv_freq(theta, dim, factor, original, rope_cfg.beta_fast, rope_cfg.beta_slow,
                        rope_cfg.truncate)
    att = rope_cfg.attention_factor
    if att is None:
      att = yarn_attention_factor(factor, rope_cfg.mscale, rope_cfg.mscale_all_dim)
    return inv, att
  if rope_cfg.scaling == 'longrope':
    short, long = longrope_inv_freq(theta, dim, rope_cfg.short_factor, rope_cfg.long_factor)
    inv = long if np.max(positions) + 1 > original else short
    return inv, longrope_attention_factor(max_position_embeddings, original)
  raise ValueError(rope_cfg.scaling)


def apply_rope(x_BTNH, positions_BT, inv_freq, attention_factor=1.0):
  """Rotate pairs ``(i, i + R)`` of the first ``2R`` dims as complex numbers.

  ``(x_i + j x_{i+R}) * exp(j * pos * inv_freq_i) * attention_factor``; the
  dims past ``2R`` pass through untouched.
  """
  x = f64(x_BTNH)
  r = len(inv_freq)
  z = x[..., :r] + 1j * x[..., r:2 * r]
  angles = f64(positions_BT)[:, :, None, None] * f64(inv_freq)
  z = z * np.exp(1j * angles) * attention_factor
  return np.concatenate([z.real, z.imag, x[..., 2 * r:]], axis=-1)


# -- attention ------------------------------------------------------------------


def visible(q_seg, q_pos, kv_seg, kv_pos, window=None, chunk=None):
  """Boolean ``[B, T, S]``: same non-zero segment, ``0 <= q_pos - k_pos (< window)``
  (and, with ``chunk``, both positions in the same chunk of ``chunk`` positions)."""
  q_seg, q_pos, kv_seg, kv_pos = map(np.asarray, (q_seg, q_pos, kv_seg, kv_pos))
  b_, t_, s_ = q_seg.shape[0], q_seg.shape[1], kv_seg.shape[1]
  out = np.zeros((b_, t_, s_), bool)
  for b in range(b_):
    for t in range(t_):
      for s in range(s_):
        delta = q_pos[b, t] - kv_pos[b, s]
        ok = kv_seg[b, s] != 0 and q_seg[b, t] == kv_seg[b, s] and delta >= 0
        if window is not None:
          ok = ok and delta < window
        if chunk is not None:
          ok = ok and q_pos[b, t] // chunk == kv_pos[b, s] // chunk
        out[b, t, s] = ok
  return out


def attention(q_BTNH, k_BSKH, v_BSKH, allowed_BTS, scale, softcap=None, sinks_N=None):
  """Softmax attention, one query head at a time; head ``h`` reads kv head ``h // G``.

  With ``sinks_N``, head ``h``'s softmax runs over ``[scores, sinks_N[h]]`` and the
  sink column is dropped afterwards. Rows with no visible key come out as NaN
  (callers compare only real rows).
  """
  q, k, v = f64(q_BTNH), f64(k_BSKH), f64(v_BSKH)
  num_heads, num_kv_heads = q.shape[2], k.shape[2]
  group = num_heads // num_kv_heads
  out = np.zeros(q.shape[:3] + (v.shape[-1],))
  for h in range(num_heads):
    kv = h // group
    scores = np.einsum('bth,bsh->bts', q[:, :, h], k[:, :, kv]) * scale
    if softcap is not None:
      scores = softcap * np.tanh(scores / softcap)
    scores = np.where(allowed_BTS, scores, -np.inf)
    if sinks_N is not None:
      sink = np.full(scores.shape[:-1] + (1,), f64(sinks_N)[h])
      scores = np.concatenate([scores, sink], axis=-1)
    with np.errstate(invalid='ignore'):
      weights = np.exp(scores - scores.max(-1, keepdims=True))
      weights = weights / weights.sum(-1, keepdims=True)
    if sinks_N is not None:
      weights = weights[..., :-1]
    out[:, :, h] = np.einsum('bts,bsh->bth', weights, v[:, :, kv])
  return out


def attention_module(x_BTD, p, *, positions, segment_ids, inv_freq, attention_factor, scale,
                     softcap=None, window=None, qk_norm='none', norm_eps=1e-6,
                     norm_offset=0.0):
  """The whole Attention module: project, q/k norm, rotate, attend, project back.

  ``p`` holds NumPy arrays named like the module: ``q_proj/kernel`` etc.
  """
  x = f64(x_BTD)

  def proj(name, h):
    y = np.einsum('btd,dnh->btnh', h, f64(p[name]['kernel']))
    if 'bias' in p[name]:
      y = y + f64(p[name]['bias'])
    return y

  q, k, v = proj('q_proj', x), proj('k_proj', x), proj('v_proj', x)
  if qk_norm != 'none':
    ndims = 1 if qk_norm == 'head' else 2
    q = rms_norm(q, p['q_norm']['scale'], norm_eps, norm_offset, ndims)
    k = rms_norm(k, p['k_norm']['scale'], norm_eps, norm_offset, ndims)
  q = apply_rope(q, positions, inv_freq, attention_factor)
  k = apply_rope(k, positions, inv_freq, attention_factor)
  allowed = visible(segment_ids, positions, segment_ids, positions, window)
  out = attention(q, k, v, allowed, scale, softcap, p.get('sinks'))
  y = np.einsum('btnh,nhd->btd', out, f64(p['o_proj']['kernel']))
  if 'bias' in p['o_proj']:
    y = y + f64(p['o_proj']['bias'])
  return y


# -- MLP ---------------------------------------------------------------------------


def silu(x):
  return x / (1 + np.exp(-x))


def gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gelu_exact(x):
  return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def relu(x):
  return np.maximum(x, 0)


ACTIVATIONS = {'silu': silu, 'gelu_tanh': gelu_tanh, 'gelu': gelu_exact, 'relu': relu}


def mlp(x, p, activation, gated):
  """``down(act(gate(x)) * up(x))`` (gated) or ``down(act(up(x)))``."""
  x = f64(x)

  def dense(name, h):
    y = h @ f64(p[name]['kernel'])
    return y + f64(p[name]['bias']) if 'bias' in p[name] else y

  act = ACTIVATIONS[activation]
  h = act(dense('gate_proj', x)) * dense('up_proj', x) if gated else act(dense('up_proj', x))
  return dense('down_proj', h)


# -- whole model -----------------------------------------------------------------


def transformer(ids_BT, p, cfg, *, segment_ids=None, positions=None):
  """Logits of a maxnnx ModelConfig model from its (unscanned) pure param dict."""
  ids = np.asarray(ids_BT)
  b, t = ids.shape
  segment_ids = np.ones((b, t), int) if segment_ids is None else np.asarray(segment_ids)
  positions = np.broadcast_to(np.arange(t), (b, t)) if positions is None else np.asarray(positions)
  head_dim = cfg.resolved_head_dim

  def norm(h, q):
    if cfg.norm_type == 'layer':
      return layer_norm(h, q['scale'], q['bias'], cfg.norm_eps, cfg.norm_scale_offset)
    return rms_norm(h, q['scale'], cfg.norm_eps, cfg.norm_scale_offset)

  x = f64(p['embed']['embedding'])[ids]
  if cfg.scale_embeddings:
    x = x * math.sqrt(cfg.d_model)
  learned = cfg.position_embedding == 'learned'
  if learned:  # GPT-2/3: a row of the position table added per token, no rotation
    table = f64(p['pos_embed']['embedding'])
    x = x + np.stack([np.stack([table[pos] for pos in row]) for row in positions])
  window = cfg.attention.sliding_window
  layer_types = cfg.layer_types or (('sliding' if window else 'full'),) * cfg.num_layers
  for i, layer_type in enumerate(layer_types):
    lp = p['layers'][i]
    sliding = layer_type == 'sliding'
    rope_cfg = cfg.local_rope if (sliding and cfg.local_rope is not None) else cfg.rope
    if learned:  # no frequencies: the rotation is the identity
      inv_freq, att = np.zeros(0), 1.0
    else:
      inv_freq, att = rope_tables(rope_cfg, head_dim, cfg.max_position_embeddings, positions)
    h = norm(x, lp['attn_pre_norm']) if cfg.pre_norm else x
    h = attention_module(h, lp['attn'], positions=positions, segment_ids=segment_ids,
                         inv_freq=inv_freq, attention_factor=att, scale=cfg.resolved_query_scale,
                         softcap=cfg.attention.logit_softcap,
                         window=cfg.attention.sliding_window if sliding else None,
                         qk_norm=cfg.attention.qk_norm,
                         norm_eps=cfg.norm_eps, norm_offset=cfg.norm_scale_offset)
    x = x + (norm(h, lp['attn_post_norm']) if cfg.post_norm else h)
    h = norm(x, lp['mlp_pre_norm']) if cfg.pre_norm else x
    h = mlp(h, lp['mlp'], cfg.mlp_activation, cfg.mlp_gated)
    x = x + (norm(h, lp['mlp_post_norm']) if cfg.post_norm else h)
  x = norm(x, p['final_norm'])
  if cfg.tie_word_embeddings:
    logits = x @ f64(p['embed']['embedding']).T
  else:
    logits = x @ f64(p['lm_head']['kernel'])
  if cfg.final_logit_softcap is not None:
    logits = cfg.final_logit_softcap * np.tanh(logits / cfg.final_logit_softcap)
  return logits

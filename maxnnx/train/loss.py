"""Next-token cross-entropy: on full logits, or fused with the output head in chunks.

:func:`masked_cross_entropy` takes ``[B, T, vocab]`` logits. The fused form,
:func:`chunked_head_cross_entropy`, takes the final hidden states and the head's
weight instead and never holds the whole ``[B, T, vocab]`` logits (which for a
128k vocabulary are gigabytes): it walks the sequence in slices, and for each
slice forms the logits, the loss terms and, when differentiated, the gradients
with respect to the hidden states and the head weight straight away. The
backward pass then only scales what the forward pass kept, so no logits are
recomputed. On a CPU this is also about a third faster than the unfused head
(the big transposes of the logits' gradient disappear); the numbers are the same
to float32 rounding (``tests/test_train_loss.py``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def masked_cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:
  """``(sum of cross-entropy over masked tokens, sum of logsumexp^2 over them)`` in f32."""
  logits = logits_BTV.astype(jnp.float32)
  lse_BT = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
  return jnp.sum((lse_BT - target_logit) * mask_BT), jnp.sum(lse_BT**2 * mask_BT)


def cross_entropy_loss(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy, computed in float32."""
  total, _ = masked_cross_entropy(logits_BTV, targets_BT, jnp.ones(targets_BT.shape))
  return total / targets_BT.size


def default_chunk_length(batch: int, seq_len: int, vocab_size: int, budget_bytes: int) -> int:
  """The longest divisor of ``seq_len`` whose float32 logits slice
  ``[batch, chunk, vocab]`` fits in ``budget_bytes`` (at least 1)."""
  best = 1
  for chunk in range(1, seq_len + 1):
    if seq_len % chunk == 0 and batch * chunk * vocab_size * 4 <= budget_bytes:
      best = chunk
  return best


def chunked_head_cross_entropy(
    x_BTD: jax.Array, head_weight: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array, *,
    vocab_major: bool, chunk_length: int, z_loss: float = 0.0, softcap: float | None = None,
    dtype=jnp.float32) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Cross-entropy of the output head applied to ``x_BTD``, one sequence slice at a time.

  Args:
    x_BTD: final hidden states (after the final norm).
    head_weight: ``[d_model, vocab]`` (an untied ``lm_head`` kernel) or, with
      ``vocab_major=True``, ``[vocab, d_model]`` (tied input embeddings).
    targets_BT: int target ids; ``mask_BT``: 1 where a token counts, else 0.
    chunk_length: sequence positions per slice; must divide ``T``.
    z_loss: weight of ``logsumexp^2`` in the differentiated total.
    softcap: ``cap * tanh(logits / cap)`` on the logits first (Gemma 2).
    dtype: the matmul input dtype (accumulation is always float32).

  Returns:
    ``(total, ce_sum, z_sum)``: ``total = ce_sum + z_loss * z_sum`` is the
    differentiable one; ``ce_sum`` (summed masked cross-entropy) and ``z_sum``
    (summed masked ``logsumexp^2``) are statistics with no gradient.
  """
  batch, length, _ = x_BTD.shape
  if length % chunk_length:
    raise ValueError(f'chunk_length={chunk_length} must divide the sequence length {length}.')
  total, stats = _fused_loss(x_BTD, head_weight, targets_BT, mask_BT.astype(jnp.float32),
                             vocab_major, chunk_length, float(z_loss), softcap, jnp.dtype(dtype))
  ce_sum, z_sum = jax.lax.stop_gradient(stats)
  return total, ce_sum, z_sum


def _slices(a, chunk_length):
  """``[B, T, ...] -> [T / chunk, B, chunk, ...]`` (the batch axis keeps its sharding)."""
  batch, length = a.shape[:2]
  a = a.reshape(batch, length // chunk_length, chunk_length, *a.shape[2:])
  return jnp.moveaxis(a, 1, 0)


def _unslice(a):
  """Inverse of :func:`_slices`."""
  a = jnp.moveaxis(a, 0, 1)
  return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


def _slice_terms(x_BCD, w, targets_BC, mask_BC, vocab_major, z_loss, softcap, dtype):
  """Logits of one slice and its loss terms; also what the gradient needs."""
  spec = 'bcd,vd->bcv' if vocab_major else 'bcd,dv->bcv'
  raw_BCV = jnp.einsum(spec, x_BCD.astype(dtype), w.astype(dtype),
                       preferred_element_type=jnp.float32)
  logits_BCV = raw_BCV if softcap is None else softcap * jnp.tanh(raw_BCV / softcap)
  peak_BC = jax.lax.stop_gradient(jnp.max(logits_BCV, axis=-1))
  exp_BCV = jnp.exp(logits_BCV - peak_BC[..., None])
  sum_BC = jnp.sum(exp_BCV, axis=-1)
  lse_BC = jnp.log(sum_BC) + peak_BC
  hit_BCV = jnp.arange(logits_BCV.shape[-1]) == targets_BC[..., None]
  target_BC = jnp.sum(jnp.where(hit_BCV, logits_BCV, 0.0), axis=-1)
  ce_BC, z_BC = (lse_BC - target_BC) * mask_BC, lse_BC**2 * mask_BC
  terms = (jnp.sum(ce_BC + z_loss * z_BC), jnp.sum(ce_BC), jnp.sum(z_BC))
  return terms, (logits_BCV, exp_BCV / sum_BC[..., None], hit_BCV, lse_BC)


def _weight_grad(x_BCD, d_BCV):
  """``x^T d`` over the slice's tokens: ``[d_model, vocab]`` in float32.

  Written as ``[d_model, tokens] x [tokens, vocab]`` with the small ``x``
  transposed in memory first (the barrier keeps XLA from folding the
  transpose back into the matmul): on CPU this runs about 1.7x faster than
  contracting the leading token axis of both operands.
  """
  x_TD = x_BCD.reshape(-1, x_BCD.shape[-1])
  x_DT = jax.lax.optimization_barrier(x_TD.T)
  return jnp.dot(x_DT, d_BCV.reshape(x_TD.shape[0], -1), preferred_element_type=jnp.float32)


def _forward(x_BTD, w, targets_BT, mask_BT, vocab_major, chunk_length, z_loss, softcap, dtype,
             with_grads):
  """Scan over slices summing the loss terms and, if asked, the gradients."""
  xs = (_slices(x_BTD, chunk_length), _slices(targets_BT, chunk_length),
        _slices(mask_BT, chunk_length))
  w_compute = w.astype(dtype)  # once, not once per slice

  def body(dw, inputs):
    x_BCD, targets_BC, mask_BC = inputs
    terms, (logits_BCV, probs_BCV, hit_BCV, lse_BC) = _slice_terms(
        x_BCD, w_compute, targets_BC, mask_BC, vocab_major, z_loss, softcap, dtype)
    if not with_grads:
      return dw, (terms, None)
    # d total / d logits = mask * (softmax - onehot + 2 z lse softmax), through the cap.
    dlogits_BCV = (probs_BCV * (1.0 + 2.0 * z_loss * lse_BC[..., None]) - hit_BCV) * \
        mask_BC[..., None]
    if softcap is not None:
      dlogits_BCV = dlogits_BCV * (1.0 - (logits_BCV / softcap)**2)
    d = dlogits_BCV.astype(dtype)
    spec = 'bcv,vd->bcd' if vocab_major else 'bcv,dv->bcd'
    dx_BCD = jnp.einsum(spec, d, w_compute, preferred_element_type=jnp.float32)
    dw = dw + _weight_grad(x_BCD.astype(dtype), d)
    return dw, (terms, dx_BCD)

  # The weight gradient accumulates as [d_model, vocab] (the fast layout, see _weight_grad).
  dw_shape = w.shape[::-1] if vocab_major else w.shape
  dw0 = jnp.zeros(dw_shape, jnp.float32) if with_grads else None
  dw, (terms, dx) = jax.lax.scan(body, dw0, xs)
  total, ce_sum, z_sum = (jnp.sum(t) for t in terms)
  if with_grads and vocab_major:
    dw = dw.T
  grads = None if not with_grads else (_unslice(dx).astype(x_BTD.dtype), dw.astype(w.dtype))
  return (total, (ce_sum, z_sum)), grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _fused_loss(x_BTD, w, targets_BT, mask_BT, vocab_major, chunk_length, z_loss, softcap, dtype):
  out, _ = _forward(x_BTD, w, targets_BT, mask_BT, vocab_major, chunk_length, z_loss, softcap,
                    dtype, with_grads=False)
  return out


def _fused_loss_fwd(x_BTD, w, targets_BT, mask_BT, vocab_major, chunk_length, z_loss, softcap,
                    dtype):
  out, grads = _forward(x_BTD, w, targets_BT, mask_BT, vocab_major, chunk_length, z_loss,
                        softcap, dtype, with_grads=True)
  return out, (grads, targets_BT, mask_BT)


def _fused_loss_bwd(vocab_major, chunk_length, z_loss, softcap, dtype, residuals, cotangents):
  del vocab_major, chunk_length, z_loss, softcap, dtype
  (dx_BTD, dw), targets_BT, mask_BT = residuals
  g_total = cotangents[0]  # the statistics are stop_gradient'ed by the only caller
  return ((g_total * dx_BTD).astype(dx_BTD.dtype), (g_total * dw).astype(dw.dtype),
          np.zeros(targets_BT.shape, jax.dtypes.float0), jnp.zeros_like(mask_BT))


_fused_loss.defvjp(_fused_loss_fwd, _fused_loss_bwd)

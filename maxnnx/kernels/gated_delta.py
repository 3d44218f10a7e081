"""The gated delta rule (Gated DeltaNet linear attention): a recurrent reference and a chunked form.

Per head, a state ``S [K, V]`` (keys x values) is carried along the sequence. At token
``t``, with decay ``g_t <= 0`` (log space), write strength ``beta_t`` in ``(0, 1)``,
key ``k_t``, value ``v_t`` and (already scaled) query ``q_t``::

    S  = exp(g_t) * S                       # forget
    S += k_t (beta_t (v_t - S^T k_t))^T     # delta rule: write the correction
    o_t = S^T q_t

``reset_BT`` marks the tokens that start a new document (packed rows, or the first
real token after left padding): the state is zeroed before them, so nothing leaks
between documents.

Strategies (``ModelConfig.runtime.gated_delta_impl``), stateless frozen dataclasses
called as ``kernel(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, reset_BT, state_BHKV)``
and returning ``(out_BTHV, final_state_BHKV)`` in float32:

* ``recurrent``: the definition above, one token per ``lax.scan`` step (the
  reference, and the cheapest for one decoding token);
* ``chunked``: the same function in chunks of ``chunk_size`` tokens. Within a chunk
  the writes are condensed into matmuls by the UT transform (a unit lower-triangular
  solve, as in the DeltaNet papers), and only the chunks are scanned; the default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from maxnnx.kernels.capabilities import check_policy


@dataclasses.dataclass(frozen=True)
class GatedDeltaKernel:
  """Base class of gated-delta-rule strategies (see the module docstring).

  Attributes:
    name: the registered name.
    on_unsupported: ``fallback`` or ``error``; both built-in strategies run everywhere.
  """

  name: str = 'base'
  on_unsupported: str = 'fallback'

  def __post_init__(self):
    check_policy(self.on_unsupported)

  def __call__(self, q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, reset_BT=None, state_BHKV=None):
    """``(out [B, T, H, V], final state [B, H, K, V])``, both float32."""
    batch, _, heads, key_dim = k_BTHK.shape
    if state_BHKV is None:
      state_BHKV = jnp.zeros((batch, heads, key_dim, v_BTHV.shape[-1]), jnp.float32)
    if reset_BT is None:
      reset_BT = jnp.zeros(k_BTHK.shape[:2], bool)
    f32 = lambda x: x.astype(jnp.float32)
    return self.compute(f32(q_BTHK), f32(k_BTHK), f32(v_BTHV), f32(g_BTH), f32(beta_BTH),
                        reset_BT.astype(bool), f32(state_BHKV))

  def compute(self, q, k, v, g, beta, reset, state):
    """The strategy's computation on float32 inputs with explicit resets and state."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class RecurrentGatedDelta(GatedDeltaKernel):
  """One token per step: the definition, and the reference for the chunked form."""

  name: str = 'recurrent'

  def compute(self, q, k, v, g, beta, reset, state):
    def step(s_HKV, xs):
      q_HK, k_HK, v_HV, g_H, beta_H, reset_ = xs
      s_HKV = jnp.where(reset_, 0.0, s_HKV) * jnp.exp(g_H)[:, None, None]
      predicted_HV = jnp.einsum('hkv,hk->hv', s_HKV, k_HK)
      delta_HV = beta_H[:, None] * (v_HV - predicted_HV)
      s_HKV = s_HKV + k_HK[:, :, None] * delta_HV[:, None, :]
      return s_HKV, jnp.einsum('hkv,hk->hv', s_HKV, q_HK)

    def row(q_THK, k_THK, v_THV, g_TH, beta_TH, reset_T, s_HKV):
      return jax.lax.scan(step, s_HKV, (q_THK, k_THK, v_THV, g_TH, beta_TH, reset_T))

    final_BHKV, out_BTHV = jax.vmap(row)(q, k, v, g, beta, reset, state)
    return out_BTHV, final_BHKV


@dataclasses.dataclass(frozen=True)
class ChunkedGatedDelta(GatedDeltaKernel):
  """Chunks of ``chunk_size`` tokens: matmuls within a chunk, a scan over chunks.

  Resets split a chunk into pieces: pairs of tokens interact only inside one piece,
  only the first piece reads the incoming state, and only the last one writes the
  outgoing state.
  """

  name: str = 'chunked'
  chunk_size: int = 64

  def compute(self, q, k, v, g, beta, reset, state):
    batch, length, heads, _ = k.shape
    c = min(self.chunk_size, length)
    pad = (-length) % c
    if pad:  # zero keys, no decay, no writes: the state passes through unchanged
      widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
      q, k, v, g, beta, reset = (jnp.pad(x, widths(x)) for x in (q, k, v, g, beta, reset))
    n = (length + pad) // c
    # [B, T, H, ...] -> [B, H, N, C, ...]
    chunks = lambda x: jnp.moveaxis(x.reshape((batch, n, c) + x.shape[2:]), 3, 1)
    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    piece_NC = jnp.cumsum(reset.reshape(batch, n, c), axis=-1)  # [B, N, C] piece index
    same_NCC = piece_NC[..., :, None] == piece_NC[..., None, :]
    first_NC = piece_NC == 0                        # reads the incoming state
    last_NC = piece_NC == piece_NC[..., -1:]        # writes the outgoing state
    causal_CC = jnp.tril(jnp.ones((c, c), bool))
    strictly_lower_CC = jnp.tril(jnp.ones((c, c), bool), -1)

    cum = jnp.cumsum(g, axis=-1)                    # [B, H, N, C] log decay since chunk start
    pair_decay = jnp.where(causal_CC & same_NCC[:, None],
                           jnp.exp(jnp.minimum(cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    # Unit lower-triangular system T = I + strictly_lower(beta_i k_i.k_j decay_ij) of the UT
    # transform: T^-1 condenses the chunk's sequential writes into matmuls.
    gram = jnp.einsum('bhnik,bhnjk->bhnij', k_beta, k) * pair_decay
    system = jnp.where(strictly_lower_CC, gram, 0.0) + jnp.eye(c)
    solve = lambda rhs: jax.scipy.linalg.solve_triangular(system, rhs, lower=True,
                                                          unit_diagonal=True)
    first = first_NC[:, None, :, :, None]
    new_values = solve(v_beta)                      # what each token writes, before the state
    state_reads = solve(k_beta * jnp.exp(cum)[..., None] * first)
    intra = jnp.einsum('bhnik,bhnjk->bhnij', q, k) * pair_decay
    q_decayed = q * jnp.exp(cum)[..., None] * first
    k_decayed = (k * jnp.exp(cum[..., -1:] - cum)[..., None]
                 * last_NC[:, None, :, :, None])
    carry_N = jnp.exp(cum[..., -1]) * first_NC[:, None, :, -1]  # [B, H, N]

    def chunk_step(s_BHKV, xs):
      new_v, reads, q_dec, k_dec, intra_, carry = xs
      v_new = new_v - jnp.einsum('bhck,bhkv->bhcv', reads, s_BHKV)
      out = (jnp.einsum('bhck,bhkv->bhcv', q_dec, s_BHKV)
             + jnp.einsum('bhij,bhjv->bhiv', intra_, v_new))
      s_BHKV = (s_BHKV * carry[..., None, None]
                + jnp.einsum('bhck,bhcv->bhkv', k_dec, v_new))
      return s_BHKV, out

    over_chunks = lambda x: jnp.moveaxis(x, 2, 0)
    final, out = jax.lax.scan(chunk_step, state, tuple(
        over_chunks(x) for x in (new_values, state_reads, q_decayed, k_decayed, intra, carry_N)))
    out = jnp.moveaxis(out, 0, 2)                   # [B, H, N, C, V]
    out = jnp.moveaxis(out, 1, 3).reshape(batch, n * c, heads, -1)
    return out[:, :length], final


GATED_DELTA_IMPLEMENTATIONS: dict[str, Callable[[], GatedDeltaKernel]] = {
    'chunked': ChunkedGatedDelta, 'recurrent': RecurrentGatedDelta}


def register_gated_delta_kernel(name: str, factory: Callable[[], GatedDeltaKernel]) -> None:
  """Make ``factory`` available as ``ModelConfig.runtime.gated_delta_impl = name``."""
  GATED_DELTA_IMPLEMENTATIONS[name] = factory

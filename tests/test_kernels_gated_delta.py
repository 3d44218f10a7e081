"""The gated delta rule: the chunked form equals the recurrent one (forward and gradients), and
both equal a float64 NumPy loop, with document resets, a carried-in state and ragged lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxnnx.kernels import ChunkedGatedDelta, RecurrentGatedDelta, get_kernel


def numpy_gated_delta(q, k, v, g, beta, reset, state):
  """The definition, token by token, in float64: ``S = exp(g) S`` (zeroed at a reset),
  ``S += k (beta (v - S^T k))^T``, ``o = S^T q``."""
  q, k, v, g, beta, state = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
  batch, length, heads, _ = k.shape
  out = np.zeros((batch, length, heads, v.shape[-1]))
  s = state.copy()
  for b in range(batch):
    for t in range(length):
      if reset[b, t]:
        s[b] = 0.0
      for h in range(heads):
        s[b, h] *= np.exp(g[b, t, h])
        delta = beta[b, t, h] * (v[b, t, h] - s[b, h].T @ k[b, t, h])
        s[b, h] += np.outer(k[b, t, h], delta)
        out[b, t, h] = s[b, h].T @ q[b, t, h]
  return out, s


def _inputs(seed, batch=2, length=13, heads=3, key_dim=4, value_dim=5):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(batch, length, heads, key_dim))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)          # the layer L2-normalises keys
  q = rng.normal(size=(batch, length, heads, key_dim)) * key_dim**-0.5
  v = rng.normal(size=(batch, length, heads, value_dim))
  g = -rng.uniform(0.01, 0.7, size=(batch, length, heads))
  beta = rng.uniform(0.1, 0.95, size=(batch, length, heads))
  reset = np.zeros((batch, length), bool)
  reset[0, [5, 6, length - 2]] = True                      # packed documents, one of length 1
  reset[1, 8] = True
  state = rng.normal(size=(batch, heads, key_dim, value_dim)) * 0.3
  return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)] + [jnp.asarray(reset),
                                                                       jnp.asarray(state,
                                                                                   jnp.float32)]


@pytest.mark.parametrize('kernel', [RecurrentGatedDelta(), ChunkedGatedDelta(chunk_size=4),
                                    ChunkedGatedDelta(chunk_size=5),
                                    ChunkedGatedDelta(chunk_size=64)],
                         ids=['recurrent', 'chunk4', 'chunk5_ragged', 'one_chunk'])
def test_kernel_equals_the_float64_definition(kernel):
  args = _inputs(0)
  out, final = jax.jit(kernel)(*args)
  want_out, want_final = numpy_gated_delta(*args)
  np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(final), want_final, rtol=1e-4, atol=1e-5)
  # A reset really cuts: the first document's tokens do not reach the last one's output.
  no_reset = numpy_gated_delta(*args[:5], np.zeros_like(args[5]), args[6])[0]
  assert np.abs(no_reset[0, -1] - want_out[0, -1]).max() > 1e-3


def test_chunked_gradients_equal_the_recurrent_ones():
  args = _inputs(1, length=11)
  weights = jax.random.normal(jax.random.key(2), (2, 11, 3, 5))

  def loss(kernel):
    def f(q, k, v, g, beta, state):
      out, final = kernel(q, k, v, g, beta, args[5], state)
      return jnp.sum(out * weights) + jnp.sum(final ** 2)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4, 5)))(*args[:5], args[6])

  for got, want in zip(loss(ChunkedGatedDelta(chunk_size=4)), loss(RecurrentGatedDelta())):
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4 * scale)


def test_state_carries_between_calls_like_one_call():
  """Prefill then token-by-token decoding from the returned state = one pass."""
  q, k, v, g, beta, _, state = _inputs(3, length=9)
  reset = jnp.zeros((2, 9), bool)
  chunked, recurrent = jax.jit(ChunkedGatedDelta(chunk_size=4)), jax.jit(RecurrentGatedDelta())
  whole, final = chunked(q, k, v, g, beta, reset, state)
  part, s = chunked(q[:, :6], k[:, :6], v[:, :6], g[:, :6], beta[:, :6], reset[:, :6], state)
  outs = [part]
  for t in range(6, 9):
    o, s = recurrent(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                     beta[:, t:t + 1], reset[:, t:t + 1], s)
    outs.append(o)
  np.testing.assert_allclose(np.concatenate(outs, axis=1), whole, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(s, final, rtol=1e-5, atol=1e-6)


def test_strategies_are_chosen_by_name():
  assert isinstance(get_kernel('gated_delta', 'chunked'), ChunkedGatedDelta)
  assert isinstance(get_kernel('gated_delta', 'recurrent'), RecurrentGatedDelta)
  with pytest.raises(ValueError, match="gated_delta_impl 'nope'.*chunked, recurrent"):
    get_kernel('gated_delta', 'nope')

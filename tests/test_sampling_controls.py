"""Sampling controls (logit bias, min_tokens, penalties) against float64 NumPy references of
their definitions, on random logits and random token histories."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxnnx.inference.sampling import Controls, add_logit_bias, apply_controls, penalize

B, V = 4, 50


def numpy_penalties(logits, prompts, outputs, presence, frequency, repetition):
  """vLLM's order: HF repetition over prompt + output, then OpenAI's frequency and presence
  over the output; float64, one row at a time, straight from the definitions."""
  out = np.array(logits, np.float64)
  for b in range(len(out)):
    for token in set(prompts[b]) | set(outputs[b]):
      x = out[b, token]
      out[b, token] = x / repetition[b] if x > 0 else x * repetition[b]
    for token in set(outputs[b]):
      count = outputs[b].count(token)
      out[b, token] -= count * frequency[b] + presence[b]
  return out


def penalised_greedy(model, prompts, params, steps):
  """Greedy tokens under each request's penalties, from the definitions in float64 NumPy:
  every step re-runs the model over the whole sequence (no cache) and penalises its last
  logits with the counts of the tokens generated so far (:func:`numpy_penalties`)."""
  forward = nnx.jit(lambda m, ids: m(ids))
  width = max(map(len, prompts)) + steps
  outputs = [[] for _ in prompts]
  for _ in range(steps):
    ids = np.zeros((len(prompts), width), np.int32)
    for b, (prompt, out) in enumerate(zip(prompts, outputs)):
      ids[b, :len(prompt) + len(out)] = prompt + out
    logits = np.asarray(forward(model, ids), np.float64)
    last = np.stack([logits[b, len(p) + len(o) - 1] for b, (p, o) in
                     enumerate(zip(prompts, outputs))])
    penalised = numpy_penalties(last, prompts, outputs,
                                [p.presence_penalty for p in params],
                                [p.frequency_penalty for p in params],
                                [p.repetition_penalty for p in params])
    for out, row in zip(outputs, penalised):
      out.append(int(row.argmax()))
  return outputs


def histories(rng):
  prompts = [rng.integers(0, V, rng.integers(1, 12)).tolist() for _ in range(B)]
  outputs = [rng.integers(0, V, rng.integers(0, 20)).tolist() for _ in range(B)]
  counts = np.zeros((B, V), np.int32)
  seen = np.zeros((B, V), bool)
  for b in range(B):
    np.add.at(counts[b], outputs[b], 1)
    seen[b, prompts[b]] = True
  return prompts, outputs, counts, seen


def test_penalties_match_the_numpy_definitions():
  rng = np.random.default_rng(0)
  for _ in range(5):
    logits = rng.normal(size=(B, V)) * 3
    prompts, outputs, counts, seen = histories(rng)
    presence, frequency = rng.uniform(-2, 2, B), rng.uniform(-2, 2, B)
    repetition = rng.uniform(0.5, 2, B)
    got = penalize(jnp.asarray(logits, jnp.float32), jnp.asarray(counts), jnp.asarray(seen),
                   *(jnp.asarray(a, jnp.float32) for a in (presence, frequency, repetition)))
    want = numpy_penalties(logits, prompts, outputs, presence, frequency, repetition)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_logit_bias_matches_the_numpy_definition():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(B, V))
  ids = rng.integers(0, V + 3, (B, 6))  # ids >= V are padding
  values = rng.uniform(-100, 100, (B, 6))
  want = np.array(logits, np.float64)
  for b in range(B):
    for i, v in zip(ids[b], values[b]):
      if i < V:
        want[b, i] += v
  got = add_logit_bias(jnp.asarray(logits, jnp.float32), jnp.asarray(ids, jnp.int32),
                       jnp.asarray(values, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def test_controls_bias_before_penalties_and_rows_without_controls_unchanged():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(B, V))
  prompts, outputs, counts, seen = histories(rng)
  ids = np.full((B, 2), V, np.int32)
  values = np.zeros((B, 2), np.float32)
  ids[1], values[1] = [3, 7], [5.0, -np.inf]  # -inf: the way min_tokens masks a stop id
  presence, frequency, repetition = (np.zeros(B), np.zeros(B), np.ones(B))
  presence[1], frequency[1], repetition[1] = 0.5, 0.25, 1.3
  controls = Controls(jnp.asarray(ids), jnp.asarray(values),
                      *(jnp.asarray(a, jnp.float32) for a in (presence, frequency, repetition)),
                      jnp.asarray(counts), jnp.asarray(seen))
  got = np.asarray(apply_controls(jnp.asarray(logits, jnp.float32), controls))
  biased = np.array(logits, np.float64)
  biased[1, 3] += 5.0
  want = numpy_penalties(biased, prompts, outputs, presence, frequency, repetition)
  want[1, 7] = -np.inf
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[[0, 2, 3]], np.float32(logits[[0, 2, 3]]))
  # No row penalised: the penalties' branch is skipped, the logits come back as they were.
  neutral = Controls(jnp.full((B, 1), V, jnp.int32), jnp.zeros((B, 1)), jnp.zeros(B),
                     jnp.zeros(B), jnp.ones(B), jnp.asarray(counts), jnp.asarray(seen))
  np.testing.assert_array_equal(
      np.asarray(apply_controls(jnp.asarray(logits, jnp.float32), neutral)), np.float32(logits))

"""QK-clip (MuonClip's clip, ``TrainConfig.qk_clip_threshold``): the recorded max logits, the
rescale against float64 NumPy, logits held at the threshold after the clip, and training that
equals plain Muon when nothing clips."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import ConfigError, MeshConfig
from maxnnx.kernels.masks import AttentionMask
from maxnnx.layers.attention import Attention
from maxnnx.layers.qk_clip import (
  attention_max_logits,
  clip_factors,
  clip_query_key,
  head_max_logits,
)
from maxnnx.train import TrainConfig, Trainer

MODEL = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4, mlp_dim=64,
             max_position_embeddings=64, **{'runtime.dtype': 'float32', 'attention.qkv_bias': True})
MLA_MODEL = dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=4, mlp_dim=64, vocab_size=64,
                 mtp={'num_layers': 0}, moe={'num_experts': 0},
                 mla={'q_lora_rank': 16, 'kv_lora_rank': 16, 'qk_nope_head_dim': 16,
                      'qk_rope_head_dim': 8, 'v_head_dim': 16})


def _model(scan=False, **changes):
  cfg = maxnnx.ModelConfig.from_dict({**MODEL, **changes,
                                      'runtime': {'scan_layers': scan, 'record_max_logits': True}})
  return maxnnx.Transformer(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))


def _numpy_max_logits(q, k, allowed, scale):
  """float64: ``max over allowed (b, t, s) of scale * q . k`` per query head."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  group = q.shape[2] // k.shape[2]
  k = np.repeat(k, group, axis=2)
  scores = np.einsum('btnh,bsnh->bnts', q, k) * scale
  scores = np.where(np.asarray(allowed)[:, None], scores, -np.inf)
  return scores.max(axis=(0, 2, 3))


def test_head_max_logits_equals_numpy_over_the_visible_keys():
  """Grouped heads, two packed documents and a sliding window: only visible keys count."""
  rng = np.random.default_rng()
  q = rng.normal(size=(2, 12, 6, 8)).astype(np.float32) * 3
  k = rng.normal(size=(2, 12, 2, 8)).astype(np.float32) * 3
  segments = np.array([[1] * 7 + [2] * 5, [1] * 12], np.int32)
  positions = np.array([list(range(7)) + list(range(5)), list(range(12))], np.int32)
  allowed = AttentionMask.causal(jnp.asarray(segments), jnp.asarray(positions)).dense(4)
  got = head_max_logits(jnp.asarray(q), jnp.asarray(k), allowed, 0.35)
  np.testing.assert_allclose(got, _numpy_max_logits(q, k, allowed, 0.35), rtol=1e-5)


def _projection_arrays(model):
  """``{path: array}`` of every q/k projection kernel and bias (float64)."""
  out = {}
  for path, module in nnx.iter_modules(model):
    if isinstance(module, Attention):
      for name in ('q_proj', 'k_proj', 'v_proj'):
        for part in ('kernel', 'bias'):
          out[(*path, name, part)] = np.asarray(getattr(getattr(module, name), part)[...],
                                                np.float64)
  return out


@pytest.mark.parametrize('scan', [False, True], ids=['loop', 'scan'])
@pytest.mark.parametrize('kv_heads', [4, 2], ids=['mha', 'gqa'])
def test_rescale_equals_numpy_and_brings_each_head_back_to_the_threshold(scan, kv_heads):
  """After a forward pass, the clip scales each over-threshold head's query (and, with its
  own key head, key) columns and biases by float64 NumPy's gamma (sqrt split for MHA, all on
  the query for GQA); values and other heads stay; the first layer's max logits on the same
  input are then min(max, threshold)."""
  model = _model(scan, num_kv_heads=kv_heads)
  ids = jnp.asarray(np.random.default_rng().integers(0, 64, size=(2, 16)))
  model(ids)
  before = attention_max_logits(model)
  logits = np.concatenate([np.asarray(m).reshape(-1, 4) for m in before])  # [layers, heads]
  threshold = float(np.median(logits[0]))  # about half the heads clip
  old = _projection_arrays(model)
  clip_query_key(model, before, threshold)
  new = _projection_arrays(model)

  assert (logits > 0).all()  # recorded in every layout
  gamma = np.where(logits > threshold, threshold / logits, 1.0)  # float64 reference
  for (*path, name, part), value in old.items():
    if scan:  # one module holds the stack: [layers, ...]
      factor = gamma
    else:
      factor = gamma[[i for i in path if isinstance(i, int)][0]][None]
    if name == 'v_proj':
      expected = value
    elif kv_heads == 4:
      expected = value * _per_head(np.sqrt(factor), value, part, scan)
    else:
      expected = value * _per_head(factor, value, part, scan) if name == 'q_proj' else value
    np.testing.assert_allclose(new[(*path, name, part)], expected.reshape(value.shape),
                               rtol=1e-6, atol=1e-7, err_msg=f'{path} {name} {part}')

  model(ids)  # the first layer sees the same input again (the later ones see what it changed)
  after = np.concatenate([np.asarray(m).reshape(-1, 4) for m in attention_max_logits(model)])
  np.testing.assert_allclose(after[0], np.minimum(logits[0], threshold), rtol=2e-5)


def _per_head(factor_LN, value, part, scan):
  """``factor [layers (or 1), heads]`` shaped to multiply ``value`` (a kernel ``[(L,) d, N, H]``
  or a bias ``[(L,) N, H]``)."""
  f = factor_LN if scan else factor_LN[0]
  if part == 'kernel':
    return f[..., None, :, None]
  return f[..., :, None]


def test_an_output_gated_query_keeps_its_gate():
  """Qwen3-Next's ``[query, gate]`` per head: the clip scales the query half only."""
  model = _model(**{'attention.output_gate': True}, num_kv_heads=2)
  model(jnp.asarray(np.random.default_rng().integers(0, 64, size=(2, 16))))
  layer = model.layers[0].attn
  kernel = np.asarray(layer.q_proj.kernel[...])
  clip_query_key(model, [jnp.full((4,), 4.0)] * 2, 1.0)  # every head by 1/4
  scaled = np.asarray(layer.q_proj.kernel[...])
  width = kernel.shape[-1] // 2
  np.testing.assert_allclose(scaled[..., :width], kernel[..., :width] / 4, rtol=1e-6)
  np.testing.assert_array_equal(scaled[..., width:], kernel[..., width:])


def test_clip_factors_leave_heads_under_the_threshold_and_heads_that_saw_nothing():
  got = clip_factors(jnp.asarray([50.0, 100.0, 400.0, -jnp.inf]), 100.0)
  np.testing.assert_allclose(got, [1.0, 1.0, 0.25, 1.0])


def _losses(threshold, steps=3):
  cfg = maxnnx.get_preset('tiny', num_layers=2, **{'runtime.dtype': 'float32'}, vocab_size=256)
  trainer = Trainer(cfg, TrainConfig(steps=steps, global_batch_size=4, seq_len=32,
                                     optimizer='muon', learning_rate=0.02, log_every=1,
                                     eval_every=0, qk_clip_threshold=threshold, seed=3,
                                     mesh=MeshConfig(data=1)))
  return trainer, trainer.fit(log=lambda line: None)


def test_muon_with_a_clip_that_never_fires_trains_like_plain_muon():
  """With a threshold no logit reaches, MuonClip's losses are plain Muon's, bit for bit; with
  a low one heads are clipped and the step's largest logit is logged."""
  _, plain = _losses(0.0)
  _, never = _losses(1e9)
  assert [h['loss'] for h in never] == [h['loss'] for h in plain]
  assert all(h['qk_clipped_heads'] == 0 for h in never)
  trainer, low = _losses(0.05)
  assert all(h['qk_clipped_heads'] > 0 for h in low)
  assert all(h['max_attention_logit'] > 0.05 for h in low)
  assert [h['loss'] for h in low][1:] != [h['loss'] for h in plain][1:]


def test_qk_clip_is_refused_where_it_cannot_work():
  with pytest.raises(ConfigError, match='qk_norm'):
    Trainer(maxnnx.get_preset('tiny', num_layers=1, **{'attention.qk_norm': 'head'}),
            TrainConfig(qk_clip_threshold=100.0, mesh=MeshConfig(data=1), seq_len=32))
  plain = maxnnx.Transformer(maxnnx.get_preset('tiny', num_layers=1), rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match='record_max_logits'):
    Trainer(plain, TrainConfig(qk_clip_threshold=100.0, mesh=MeshConfig(data=1), seq_len=32))
  with pytest.raises(ConfigError, match='qk_clip_threshold'):
    TrainConfig(qk_clip_threshold=-1.0)


def test_mla_clip_scales_nope_by_the_root_and_the_query_rope_by_gamma():
  """DeepSeek-V2-shaped MLA (low-rank query): the query's nope columns and kv_b's key nope
  columns by sqrt(gamma), the query's rope columns by gamma, values and the shared rotated key
  untouched (float64 reference); the first layer's max logits on the same input then come back
  to min(max, threshold)."""
  from conftest import FIXTURES  # noqa: PLC0415

  base = maxnnx.from_pretrained(os.path.join(FIXTURES, 'deepseek_v2')).config
  cfg = base.replace(**{'runtime.record_max_logits': True, 'runtime.dtype': 'float32'})
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))
  ids = jnp.asarray(np.random.default_rng().integers(0, cfg.vocab_size, size=(2, 12)))
  model(ids)
  attn = model.layers[0].attn
  logits = np.asarray(attn.max_logits[...], np.float64)
  assert (logits > 0).all()
  threshold = float(np.median(logits))
  query = attn.q_proj if attn.q_proj is not None else attn.q_b_proj
  q_old = np.asarray(query.kernel[...], np.float64)
  kv_old = np.asarray(attn.kv_b_proj.kernel[...], np.float64)
  kv_a_old = np.asarray(attn.kv_a_proj_with_mqa.kernel[...])
  clip_query_key(model, attention_max_logits(model), threshold)

  gamma = np.where(logits > threshold, threshold / logits, 1.0)[None, :, None]
  nope, rope = attn.nope, attn.rope
  q_expected = q_old.copy()
  q_expected[..., :nope] *= np.sqrt(gamma)
  q_expected[..., nope:nope + rope] *= gamma
  kv_expected = kv_old.copy()
  kv_expected[..., :nope] *= np.sqrt(gamma)
  np.testing.assert_allclose(query.kernel[...], q_expected, rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(attn.kv_b_proj.kernel[...], kv_expected, rtol=1e-6, atol=1e-8)
  np.testing.assert_array_equal(attn.kv_a_proj_with_mqa.kernel[...], kv_a_old)
  model(ids)
  np.testing.assert_allclose(attn.max_logits[...], np.minimum(logits, threshold), rtol=2e-5)


@pytest.mark.parametrize('preset', ['llama', 'mla'])
def test_recorded_max_logits_do_not_depend_on_the_attention_strategy(preset):
  """``xla_flash`` (what ``auto`` runs on CPU and TPU) takes the max logits from its query
  blocks (256 tokens: two blocks, the upper one skipped), ``xla`` from a dense score pass:
  every layer's equal, for grouped heads and for MLA (the kernel tests hold ``xla_flash``'s
  against float64 NumPy)."""
  ids = jnp.asarray(np.random.default_rng(7).integers(0, 64, size=(1, 256)))
  recorded = {}
  for impl in ('xla', 'xla_flash'):
    if preset == 'llama':
      cfg = maxnnx.ModelConfig.from_dict({
          **MODEL, 'num_kv_heads': 2, 'max_position_embeddings': 256,
          'runtime': {'record_max_logits': True, 'attention_impl': impl}})
    else:
      cfg = maxnnx.get_preset('deepseek-v3', runtime={'attention_impl': impl,
                                                      'record_max_logits': True,
                                                      'dtype': 'float32'}, **MLA_MODEL)
    model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(3))
    model(ids)
    recorded[impl] = [np.asarray(m) for m in attention_max_logits(model)]
  for got, expected in zip(recorded['xla_flash'], recorded['xla'], strict=True):
    np.testing.assert_allclose(got, expected, rtol=1e-6)
  assert np.isfinite(recorded['xla'][0]).all()

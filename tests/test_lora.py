"""LoRA / QLoRA through qwix: merge vs float64 NumPy, PEFT parity, training and checkpoints.

The PEFT adapters and their logits were made once by ``tests/hf_parity/make_lora_fixture.py``
(peft 0.21, on the tiny Llama, Phi-3, GPT-2, Gemma 3 and Llama 4 multimodal fixtures) and are
committed, so no test needs torch.
"""

import contextlib
import json
import math
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES
from flax import nnx

import maxnnx
from maxnnx.checkpoint.safetensors import (
  read_safetensors,
  read_safetensors_dir,
  write_safetensors,
)
from maxnnx.config import ConfigError, MeshConfig
from maxnnx.data import TokenWindows
from maxnnx.layers.linear import DenseGeneral
from maxnnx.models.hf import PretrainedError
from maxnnx.train import DPOObjective, TrainConfig, Trainer
from maxnnx.train.lora import (
  LoraConfig,
  adapter_weights,
  apply_lora,
  has_adapters,
  load_adapter,
  merge_adapters,
  save_adapter,
  target_modules,
  trainable_filter,
  without_adapters,
  without_adapters_logps,
)
from maxnnx.train.lora.peft import peft_tensors

LLAMA = os.path.join(FIXTURES, 'llama')
PEFT_DIR = os.path.join(os.path.dirname(FIXTURES), 'peft', 'llama_lora')
SEVEN = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
BATCH, SEQ = 8, 32


def _base(scan=False):
  return maxnnx.from_pretrained(LLAMA, scan_layers=scan)


def _randomise_adapters(model, seed=1, std=0.05):
  """Nonzero A and B (B starts at zero, which would hide a wrong merge)."""
  state = nnx.state(model, nnx.LoRAParam)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [x + std * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  nnx.update(model, jax.tree.unflatten(treedef, leaves))
  return model


def _ids(seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (2, 24)), jnp.int32)


def _adapted_modules(model):
  return [(p, m) for p, m in nnx.iter_modules(model)
          if isinstance(m, DenseGeneral) and hasattr(m, 'kernel_lora_a')]


# -- config ----------------------------------------------------------------------------


@pytest.mark.parametrize('fields, message', [
    ({'rank': -1}, 'LoraConfig.rank must be >= 0'),
    ({'rank': 8, 'alpha': 0}, 'LoraConfig.alpha must be > 0'),
    ({'rank': 8, 'dropout': 1.0}, r'LoraConfig.dropout must be in \[0, 1\)'),
    ({'rank': 8, 'targets': 'all-linear,q_proj'}, "LoraConfig.targets: 'all-linear' already"),
    ({'rank': 8, 'targets': 'q_proj,self_attn.v'}, "LoraConfig.targets: 'self_attn.v' is not"),
    ({'rank': 8, 'base_quantization': 'nf4'}, 'LoraConfig.base_quantization'),
    ({'rank': 'eight'}, 'LoraConfig.rank'),
])
def test_config_errors_name_the_field(fields, message):
  with pytest.raises(ConfigError, match=message):
    LoraConfig(**fields)


def test_config_reads_targets_from_a_string_and_from_dicts():
  assert LoraConfig(rank=8, targets='q_proj, v_proj').targets == ('q_proj', 'v_proj')
  config = TrainConfig.from_dict({'lora': {'rank': 8, 'alpha': 16, 'targets': 'all-linear'}})
  assert config.lora == LoraConfig(rank=8, alpha=16.0) and config.lora.scale == 2.0
  assert not TrainConfig().lora.enabled
  with pytest.raises(ConfigError, match="Unknown LoraConfig field 'rnak'"):
    TrainConfig.from_dict({'lora.rnak': 8})


# -- adapters on a model --------------------------------------------------------------------


def test_apply_selects_targets_starts_equal_and_leaves_the_original():
  base = _base()
  ids = _ids()
  adapted = apply_lora(base, LoraConfig(rank=4, alpha=8))
  assert not has_adapters(base) and has_adapters(adapted)
  assert trainable_filter(base) is nnx.Param and trainable_filter(adapted) is nnx.LoRAParam
  names = sorted(p[-1] for p, _ in _adapted_modules(adapted))
  assert names == sorted(SEVEN * 2)  # all-linear: seven projections in each of 2 layers
  np.testing.assert_array_equal(adapted(ids), base(ids))  # B starts at zero
  some = target_modules(base, ('q_proj', 'down_proj'))
  assert sorted(p[-1] for p, _ in some) == ['down_proj', 'down_proj', 'q_proj', 'q_proj']
  with pytest.raises(ValueError, match=r"\['qkv_proj'\] name no projection.*'gate_proj'"):
    apply_lora(base, LoraConfig(rank=4, targets='qkv_proj'))
  with pytest.raises(ValueError, match='rank is 0'):
    apply_lora(base, LoraConfig())
  with pytest.raises(ValueError, match='already has LoRA adapters'):
    apply_lora(adapted, LoraConfig(rank=4))
  with pytest.raises(ValueError, match='rank=64 is not below min'):
    apply_lora(base, LoraConfig(rank=64))


def test_adapters_have_qwix_layout_and_logical_sharding():
  """Shapes, dtypes and sharding names are those qwix's own lazy creation gives."""
  import qwix
  base = _base()
  ours = apply_lora(base, LoraConfig(rank=4, alpha=8, targets='q_proj,o_proj'))
  # qwix creating the adapters itself in its initialising call (possible here: unscanned)
  reference = nnx.clone(base)
  for _, module in nnx.iter_modules(reference):
    if isinstance(module, DenseGeneral):
      module.custom_gradient = False
  rule = qwix.LoraRule(module_path=r'layers/\d+/attn/(q|o)_proj', rank=4, alpha=8.0,
                       op_names=('dot_general',))
  reference = qwix.apply_lora_to_model(reference, qwix.LoraProvider([rule]), _ids(),
                                       rngs=nnx.Rngs(0), methods=('hidden_states',))
  for (path, a), (path_q, b) in zip(_adapted_modules(ours), _adapted_modules(reference)):
    assert path == path_q
    for name in ('kernel_lora_a', 'kernel_lora_b'):
      ours_var, qwix_var = getattr(a, name), getattr(b, name)
      assert type(ours_var) is type(qwix_var) is nnx.LoRAParam
      assert (ours_var.shape, ours_var.dtype) == (qwix_var.shape, qwix_var.dtype)
      assert ours_var.out_sharding == qwix_var.out_sharding
  scanned = apply_lora(_base(scan=True), LoraConfig(rank=4))
  q = scanned.layers.attn.q_proj
  assert q.kernel_lora_a.shape == (2, 64, 4) and q.kernel_lora_b.shape == (2, 4, 96)
  assert q.kernel_lora_a.out_sharding == ('layers', 'embed', None)
  assert q.kernel_lora_b.out_sharding == ('layers', None, 'heads')


SLOW = pytest.mark.slow  # the other layout or quantization of a case is checked by default


@pytest.mark.parametrize('scan, base_quantization', [
    pytest.param(False, 'none', id='list-none'), pytest.param(True, 'int8', id='scan-int8'),
    pytest.param(True, 'none', id='scan-none', marks=SLOW),
    pytest.param(False, 'int8', id='list-int8', marks=SLOW)])
def test_merge_is_w_plus_scaled_b_a_in_float64(scan, base_quantization, tmp_path):
  """Every weight ``save_pretrained`` writes for the merged model is ``W + (alpha / r) B A``
  in PEFT's layout, computed in float64 and rounded once: exactly, also over a dequantized
  QLoRA base; the other weights are the base's."""
  config = LoraConfig(rank=4, alpha=12, base_quantization=base_quantization)
  adapted = _randomise_adapters(apply_lora(_base(scan), config))
  merged = merge_adapters(adapted)
  assert type(merged) is maxnnx.Transformer and not has_adapters(merged)
  assert all(m.custom_gradient for _, m in nnx.iter_modules(merged) if isinstance(m, DenseGeneral))
  ids = _ids()
  np.testing.assert_allclose(merged(ids), adapted(ids), atol=2e-5)
  maxnnx.save_pretrained(merged, str(tmp_path))
  merged_hf = read_safetensors(str(tmp_path / 'model.safetensors'))
  base_hf = {k: v for k, (_, v) in read_safetensors_dir(LLAMA).items()}
  lora = peft_tensors(adapted)
  scale = config.alpha / config.rank
  checked = 0
  for name, weight in merged_hf.items():
    module = 'base_model.model.' + name.removesuffix('.weight')
    if module + '.lora_A.weight' not in lora:
      np.testing.assert_array_equal(weight, base_hf[name])
      continue
    a = lora[module + '.lora_A.weight'].astype(np.float64)  # [r, in]
    b = lora[module + '.lora_B.weight'].astype(np.float64)  # [out, r]
    w = base_hf[name].astype(np.float64)
    if base_quantization != 'none':
      w = _dequantized_hf(adapted, name)
    np.testing.assert_array_equal(weight, (w + scale * b @ a).astype(np.float32), err_msg=name)
    checked += 1
  assert checked == 14


def _dequantized_hf(adapted, name):
  """The dequantized base weight of HF tensor ``name`` (``[out, in]``, float64)."""
  from maxnnx.models.registry import FAMILIES
  from maxnnx.train.lora.adapters import adapted_modules, base_kernel
  from maxnnx.train.lora.peft import hf_module_name
  for module, paths in adapted_modules(adapted):
    for i, path in enumerate(paths):
      if hf_module_name(FAMILIES['llama'], adapted.config, path) + '.weight' == name:
        w = base_kernel(module)
        w = w[i] if len(paths) > 1 else w
        return w.reshape(math.prod(module.in_shape), -1).T
  raise KeyError(name)


def test_without_adapters_is_the_base_and_works_under_jit():
  base = _base()
  ids = _ids()
  adapted = _randomise_adapters(apply_lora(base, LoraConfig(rank=4)))
  assert np.abs(np.asarray(adapted(ids) - base(ids))).max() > 0.1
  np.testing.assert_array_equal(without_adapters(adapted)(ids), base(ids))
  jitted = nnx.jit(lambda m, x: without_adapters(m)(x))
  np.testing.assert_allclose(jitted(adapted, ids), base(ids), atol=1e-5)  # jit fuses apart
  assert has_adapters(adapted)  # the view changed nothing


def test_generate_with_adapters_matches_the_merged_model():
  adapted = load_adapter(_base(scan=True), PEFT_DIR)  # KV cache and scanned stack
  prompt = _ids()[:1, :6]
  ours = maxnnx.generate(adapted, prompt, max_new_tokens=8, temperature=0.0).tokens
  merged = maxnnx.generate(merge_adapters(adapted), prompt, max_new_tokens=8,
                           temperature=0.0).tokens
  np.testing.assert_array_equal(ours, merged)
  assert len(set(np.asarray(ours).ravel().tolist())) > 2


# -- adapter dropout --------------------------------------------------------------------------


class _Attn(nnx.Module):
  def __init__(self, din, dout, seed):
    self.q_proj = DenseGeneral((din,), (dout,), axes=('embed', 'q_heads'), rngs=nnx.Rngs(seed))


class _Block(nnx.Module):
  def __init__(self, din, dout, seed):
    self.attn = _Attn(din, dout, seed)


class _Projections(nnx.Module):
  """The smallest model apply_lora adapts: ``layers/i/attn/q_proj``, run by ``hidden_states``."""

  def __init__(self, num_layers, din, dout):
    self.layers = nnx.List([_Block(din, dout, i) for i in range(num_layers)])

  def hidden_states(self, x):
    return [block.attn.q_proj(x) for block in self.layers]


def test_adapter_dropout_drops_the_adapter_input_in_the_train_step_only():
  """``x W + s dropout(x) A B``: with A, B picking input features j < r onto outputs j,
  each such output's change is 0 or x_j / (1 - p), the base matmul is untouched, masks
  differ between layers and keys, and outside ``adapter_dropout`` nothing drops."""
  from maxnnx.train.lora.dropout import adapter_dropout
  rank, rate, din, dout = 4, 0.5, 16, 12
  model = apply_lora(_Projections(2, din, dout), LoraConfig(rank=rank, alpha=rank, dropout=rate))
  for _, module in _adapted_modules(model):
    module.kernel_lora_a[...] = jnp.eye(din, rank)
    module.kernel_lora_b[...] = jnp.eye(rank, dout)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32, din)) + 3.0, jnp.float32)
  base = [x @ block.attn.q_proj.kernel[...] for block in model.layers]
  off = model.hidden_states(x)
  for y, w in zip(off, base):
    np.testing.assert_allclose(y - w, np.pad(x[..., :rank], [(0, 0), (0, 0), (0, dout - rank)]),
                               atol=1e-5)  # no dropout outside the context

  graphdef, state = nnx.split(model)

  @jax.jit
  def dropped(state, key):
    with adapter_dropout(key):
      return nnx.merge(graphdef, state).hidden_states(x)

  masks = []
  for key in (0, 0, 1):
    for y, w in zip(dropped(state, jax.random.key(key)), base):
      delta = np.asarray(y - w)
      np.testing.assert_allclose(delta[..., rank:], 0, atol=1e-5)  # the base is not dropped
      kept = np.abs(delta[..., :rank]) > 1e-3
      np.testing.assert_allclose(delta[..., :rank][kept], x[..., :rank][kept] / (1 - rate),
                                 rtol=1e-5)
      np.testing.assert_allclose(delta[..., :rank][~kept], 0, atol=1e-3)
      assert 0.35 < kept.mean() < 0.65
      masks.append(kept)
  np.testing.assert_array_equal(masks[0], masks[2])  # the same key draws the same masks
  assert not np.array_equal(masks[0], masks[1])  # each layer its own
  assert not np.array_equal(masks[0], masks[4])  # each key its own
  np.testing.assert_array_equal(model.hidden_states(x)[0], off[0])  # still off afterwards


def _dropout_run(dropout, seed=0, accum=1):
  model = apply_lora(_base(scan=True), LoraConfig(rank=4, alpha=8, dropout=dropout))
  return _fit(model, _train_config(seed=seed, grad_accum_steps=accum))


@pytest.mark.slow  # ~40 s
def test_adapter_dropout_trains_reproducibly_and_only_in_training():
  """Step 1 (B = 0) is the same loss with and without dropout; later steps differ; the same
  seed repeats the run exactly; evaluation does not drop."""
  _, plain = _dropout_run(0.0)
  trainer, dropped = _dropout_run(0.3)
  _, again = _dropout_run(0.3)
  np.testing.assert_allclose(dropped[0], plain[0], rtol=1e-6)
  assert np.abs(dropped[1:] - plain[1:]).min() > 1e-5
  np.testing.assert_array_equal(dropped, again)
  ids = _ids()
  merged = merge_adapters(trainer.model)
  np.testing.assert_allclose(trainer.model(ids), merged(ids), atol=1e-4)  # no dropout in eval
  assert not hasattr(merged.layers.attn.q_proj, 'lora_dropout_seed')


@SLOW
def test_adapter_dropout_masks_follow_the_seed_and_accumulate():
  """Another seed draws other masks; grad accumulation draws one per micro-batch and trains."""
  _, dropped = _dropout_run(0.3)
  _, other_seed = _dropout_run(0.3, seed=1)
  assert np.abs(other_seed[1:] - dropped[1:]).min() > 1e-6
  _, accumulated = _dropout_run(0.3, accum=2)
  assert np.all(np.isfinite(accumulated)) and accumulated[-1] < accumulated[0]


# -- PEFT's format ----------------------------------------------------------------------------


@pytest.mark.parametrize('scan', [False, pytest.param(True, marks=SLOW)], ids=['list', 'scan'])
def test_peft_adapter_gives_peft_logits(scan):
  """An adapter made by peft loads onto the Llama fixture with peft's logits (rel < 1e-4)."""
  ref = np.load(os.path.join(PEFT_DIR, 'reference.npz'))
  model = load_adapter(_base(scan), PEFT_DIR)
  assert model.lora_config == LoraConfig(rank=4, alpha=8, targets=tuple(sorted(SEVEN)))
  for logits in (model(ref['input_ids']), merge_adapters(model)(ref['input_ids'])):
    error = np.abs(np.asarray(logits, np.float64) - ref['logits']).max()
    assert error / np.abs(ref['logits']).max() < 1e-4
  base_error = np.abs(np.asarray(_base()(ref['input_ids'])) - ref['logits']).max()
  assert base_error > 0.5  # the adapter matters


@pytest.mark.parametrize('scan', [pytest.param(False, marks=SLOW), True], ids=['list', 'scan'])
def test_export_follows_peft_layout_and_round_trips(scan, tmp_path):
  model = load_adapter(_base(scan), PEFT_DIR)
  assert save_adapter(model, str(tmp_path)) == ['adapter_config.json',
                                                'adapter_model.safetensors']
  ours = read_safetensors(str(tmp_path / 'adapter_model.safetensors'))
  peft = read_safetensors(os.path.join(PEFT_DIR, 'adapter_model.safetensors'))
  assert sorted(ours) == sorted(peft)  # PEFT's names, e.g. ...self_attn.q_proj.lora_A.weight
  for name, array in peft.items():
    assert ours[name].dtype == array.dtype and ours[name].shape == array.shape, name
    np.testing.assert_array_equal(ours[name], array)
  q = 'base_model.model.model.layers.0.self_attn.q_proj'
  assert ours[q + '.lora_A.weight'].shape == (4, 64)  # [r, in]
  assert ours[q + '.lora_B.weight'].shape == (96, 4)  # [out, r]
  config = json.loads((tmp_path / 'adapter_config.json').read_text())
  assert config['peft_type'] == 'LORA' and config['r'] == 4 and config['lora_alpha'] == 8
  assert config['target_modules'] == sorted(SEVEN) and config['task_type'] == 'CAUSAL_LM'
  again = load_adapter(_base(not scan), str(tmp_path))
  for path, (a, b) in adapter_weights(model).items():
    np.testing.assert_array_equal(adapter_weights(again)[path][0], a)
    np.testing.assert_array_equal(adapter_weights(again)[path][1], b)


def test_adapter_of_some_layers_loads_as_zeros_elsewhere(tmp_path):
  """A PEFT adapter on layer 0's q_proj only: layer 1 (in a scanned stack too) adds nothing."""
  tensors = read_safetensors(os.path.join(PEFT_DIR, 'adapter_model.safetensors'))
  keep = 'base_model.model.model.layers.0.self_attn.q_proj'
  write_safetensors(str(tmp_path / 'adapter_model.safetensors'),
                    {k: v for k, v in tensors.items() if k.startswith(keep)})
  config = json.load(open(os.path.join(PEFT_DIR, 'adapter_config.json')))
  (tmp_path / 'adapter_config.json').write_text(json.dumps({**config, 'layers_to_transform': [0],
                                                             'target_modules': ['q_proj']}))
  ids = _ids()
  lists, scanned = (load_adapter(_base(s), str(tmp_path)) for s in (False, True))
  assert [p for p, _ in _adapted_modules(lists)] == [('layers', 0, 'attn', 'q_proj'),
                                                      ('layers', 1, 'attn', 'q_proj')]
  np.testing.assert_array_equal(np.asarray(lists.layers[1].attn.q_proj.kernel_lora_b[...]), 0)
  np.testing.assert_allclose(scanned(ids), lists(ids), atol=1e-5)


def test_adapter_errors_name_the_file_and_tensor(tmp_path):
  tensors = read_safetensors(os.path.join(PEFT_DIR, 'adapter_model.safetensors'))
  config = json.load(open(os.path.join(PEFT_DIR, 'adapter_config.json')))

  def adapter(changes=None, extra=None, drop=()):
    directory = tmp_path / f'a{len(list(tmp_path.iterdir()))}'
    directory.mkdir()
    (directory / 'adapter_config.json').write_text(json.dumps({**config, **(changes or {})}))
    write_safetensors(str(directory / 'adapter_model.safetensors'),
                      {**{k: v for k, v in tensors.items() if k not in drop}, **(extra or {})})
    return str(directory)

  base = _base()
  with pytest.raises(PretrainedError, match='use_dora=True is not supported'):
    load_adapter(base, adapter({'use_dora': True}))
  with pytest.raises(PretrainedError, match="adapts 'base_model.model.model.layers.7.mlp"):
    layer7 = 'base_model.model.model.layers.7.mlp.up_proj'
    load_adapter(base, adapter(extra={layer7 + '.lora_A.weight': np.zeros((4, 64), np.float32),
                                      layer7 + '.lora_B.weight': np.zeros((128, 4), np.float32)}))
  a_name = 'base_model.model.model.layers.0.mlp.up_proj.lora_A.weight'
  with pytest.raises(PretrainedError, match='lora_A of layers.0.mlp.up_proj has shape'):
    load_adapter(base, adapter(extra={a_name: np.zeros((4, 65), np.float32)}))
  with pytest.raises(PretrainedError, match=r"has only \['lora_B'\]"):
    load_adapter(base, adapter(drop=(a_name,)))
  with pytest.raises(PretrainedError, match='carries LoRA adapters: save merge_adapters'):
    maxnnx.save_pretrained(load_adapter(base, PEFT_DIR), str(tmp_path / 'x'))
  with pytest.raises(PretrainedError, match='fan_in_fan_out=True is for GPT-2'):
    load_adapter(base, adapter({'fan_in_fan_out': True}))
  with pytest.raises(PretrainedError, match=r'q_proj has lora_A \(4, 64\) and lora_B \(96, 4\); '
                     'its rank is 8'):
    load_adapter(base, adapter({'rank_pattern': {'q_proj': 8}}))


@pytest.mark.parametrize('family, fused', [('phi3', ('qkv_proj', 'gate_up_proj')),
                                           pytest.param('gpt2', ('c_attn',),
                                                        marks=pytest.mark.slow)])  # 25 s
def test_fused_checkpoint_modules_load_peft_adapters_and_export_them_fused(family, fused,
                                                                             tmp_path):
  """Phi-3's qkv_proj / gate_up_proj and GPT-2's Conv1D c_attn: a peft-made adapter gives
  peft's logits, and ours is written fused (rank k r, block-diagonal B, rank_pattern and
  alpha_pattern keeping the scale) and reads back to the same adapters."""
  peft_dir = os.path.join(os.path.dirname(FIXTURES), 'peft', f'{family}_lora')
  ref = np.load(os.path.join(peft_dir, 'reference.npz'))
  base_dir = os.path.join(FIXTURES, family)
  loaded = load_adapter(maxnnx.from_pretrained(base_dir), peft_dir)
  error = np.abs(np.asarray(loaded(ref['input_ids']), np.float64) - ref['logits']).max()
  assert error / np.abs(ref['logits']).max() < 1e-4
  assert np.abs(np.asarray(maxnnx.from_pretrained(base_dir)(ref['input_ids'])) -
                ref['logits']).max() > 0.5  # the adapter matters

  ours = _randomise_adapters(apply_lora(maxnnx.from_pretrained(base_dir, scan_layers=True),
                                        LoraConfig(rank=2, alpha=6)))
  save_adapter(ours, str(tmp_path))
  config = json.loads((tmp_path / 'adapter_config.json').read_text())
  assert config['rank_pattern'] == {name: 2 * len(_parts(ours, name)) for name in fused}
  assert config['alpha_pattern'] == {name: 6 * len(_parts(ours, name)) for name in fused}
  assert config['fan_in_fan_out'] == (family == 'gpt2')
  tensors = read_safetensors(str(tmp_path / 'adapter_model.safetensors'))
  weights = adapter_weights(ours)
  for name in fused:
    prefix = [k for k in tensors if k.endswith(f'.0.{_hf_parent(name)}{name}.lora_A.weight')]
    a_f = tensors[prefix[0]].astype(np.float64)
    b_f = tensors[prefix[0].replace('lora_A', 'lora_B')].astype(np.float64)
    row = 0
    for part in _parts(ours, name):
      a, b = weights[('layers', 0, *part)]
      delta = b_f[row:row + b.shape[1]] @ a_f  # [out_p, in]: the fused update's rows of part
      np.testing.assert_allclose(delta, (a.astype(np.float64) @ b).T, atol=1e-12)
      row += b.shape[1]
    assert row == b_f.shape[0]
  again = load_adapter(maxnnx.from_pretrained(base_dir), str(tmp_path))
  assert again.lora_config.rank == 2 and again.lora_config.scale == 3.0
  for path, (a, b) in weights.items():
    np.testing.assert_array_equal(adapter_weights(again)[path][0], a)
    np.testing.assert_array_equal(adapter_weights(again)[path][1], b)


@pytest.mark.parametrize('case', ['gemma3_vision', 'llama4_vision'])
def test_multimodal_peft_adapters_load_with_images_and_export_as_peft_wrote_them(case,
                                                                                  tmp_path):
  """A peft-made adapter on a Gemma 3 / Llama 4 multimodal model, adapting the text layers,
  the vision tower's blocks (and Llama 4's projector MLP): peft's logits with images
  (rel < 1e-4), and save_adapter writes peft's names and tensors back."""
  peft_dir = os.path.join(os.path.dirname(FIXTURES), 'peft', f'{case}_lora')
  ref = np.load(os.path.join(peft_dir, 'reference.npz'))
  base = maxnnx.from_pretrained(os.path.join(FIXTURES, case))
  loaded = load_adapter(base, peft_dir)
  logits = np.asarray(loaded(ref['input_ids'], pixel_values=ref['pixel_values']), np.float64)
  assert np.abs(logits - ref['logits']).max() / np.abs(ref['logits']).max() < 1e-4
  plain = np.asarray(base(ref['input_ids'], pixel_values=ref['pixel_values']))
  assert np.abs(plain - ref['logits']).max() > 0.5  # the adapter matters
  save_adapter(loaded, str(tmp_path))
  ours = read_safetensors(str(tmp_path / 'adapter_model.safetensors'))
  theirs = read_safetensors(os.path.join(peft_dir, 'adapter_model.safetensors'))
  assert sorted(ours) == sorted(theirs)
  assert any('vision' in name for name in ours)
  for name, array in theirs.items():
    np.testing.assert_array_equal(ours[name], array, err_msg=name)


def test_gemma3_adapters_with_transformers4_module_names_load():
  """Adapters made with transformers 4 name Gemma 3's modules ``language_model.model.*``
  and ``vision_tower.vision_model.*``; they load as the transformers-5 names do."""
  peft_dir = os.path.join(os.path.dirname(FIXTURES), 'peft', 'gemma3_vision_lora')
  tensors = read_safetensors(os.path.join(peft_dir, 'adapter_model.safetensors'))
  old = {name.replace('model.model.language_model.', 'model.language_model.model.')
         .replace('model.model.vision_tower.', 'model.vision_tower.vision_model.'): array
         for name, array in tensors.items()}
  assert not set(old) & set(tensors)
  base = maxnnx.from_pretrained(os.path.join(FIXTURES, 'gemma3_vision'))
  new = adapter_weights(load_adapter(base, peft_dir))
  with _adapter_dir(old, peft_dir) as directory:
    legacy = adapter_weights(load_adapter(base, directory))
  assert legacy.keys() == new.keys()
  for path, (a, b) in new.items():
    np.testing.assert_array_equal(legacy[path][0], a)
    np.testing.assert_array_equal(legacy[path][1], b)


@contextlib.contextmanager
def _adapter_dir(tensors, like):
  """A temporary adapter directory with ``like``'s config and these tensors."""
  with tempfile.TemporaryDirectory() as directory:
    shutil.copy(os.path.join(like, 'adapter_config.json'), directory)
    write_safetensors(os.path.join(directory, 'adapter_model.safetensors'), tensors)
    yield directory


def _parts(model, fused):
  """Our module paths (below a layer) that a fused checkpoint module holds."""
  return {'qkv_proj': [('attn', 'q_proj'), ('attn', 'k_proj'), ('attn', 'v_proj')],
          'gate_up_proj': [('mlp', 'gate_proj'), ('mlp', 'up_proj')],
          'c_attn': [('attn', 'q_proj'), ('attn', 'k_proj'), ('attn', 'v_proj')]}[fused]


def _hf_parent(fused):
  return {'qkv_proj': 'self_attn.', 'gate_up_proj': 'mlp.', 'c_attn': 'attn.'}[fused]


def test_peft_adapter_of_mixed_ranks_and_alphas_loads_exactly(tmp_path):
  """rank_pattern / alpha_pattern: smaller ranks pad with zeros, other scales fold into B."""
  shutil.copytree(PEFT_DIR, tmp_path, dirs_exist_ok=True)
  tensors = read_safetensors(os.path.join(PEFT_DIR, 'adapter_model.safetensors'))
  config = json.loads((tmp_path / 'adapter_config.json').read_text())
  for name in list(tensors):
    if '.v_proj.' in name:  # v_proj of rank 2 (its first two components)
      tensors[name] = tensors[name][:2] if 'lora_A' in name else tensors[name][:, :2]
  write_safetensors(str(tmp_path / 'adapter_model.safetensors'), tensors)
  (tmp_path / 'adapter_config.json').write_text(json.dumps(
      {**config, 'rank_pattern': {'v_proj': 2}, 'alpha_pattern': {'o_proj': 2, 'v_proj': 3}}))
  model = load_adapter(_base(), str(tmp_path))
  assert model.lora_config.rank == 4 and model.lora_config.scale == 2.0  # 8 / 4, the largest
  merged = merge_adapters(model)
  base = _base()
  for layer in range(2):
    for name, scale in (('q_proj', 2.0), ('o_proj', 0.5), ('v_proj', 1.5)):
      module = 'self_attn.' + name
      a = tensors[f'base_model.model.model.layers.{layer}.{module}.lora_A.weight']
      b = tensors[f'base_model.model.model.layers.{layer}.{module}.lora_B.weight']
      w = np.asarray(getattr(base.layers[layer].attn, name).kernel[...], np.float64)
      want = w + scale * (b.astype(np.float64) @ a).T.reshape(w.shape)
      got = np.asarray(getattr(merged.layers[layer].attn, name).kernel[...])
      np.testing.assert_allclose(got, want, atol=1e-6)


def test_rslora_adapter_scale(tmp_path):
  """use_rslora scales by lora_alpha / sqrt(r), i.e. our alpha = lora_alpha * sqrt(r)."""
  shutil.copytree(PEFT_DIR, tmp_path, dirs_exist_ok=True)
  path = tmp_path / 'adapter_config.json'
  path.write_text(json.dumps({**json.loads(path.read_text()), 'use_rslora': True}))
  assert load_adapter(_base(), str(tmp_path)).lora_config.scale == pytest.approx(8 / 2)


# -- training ---------------------------------------------------------------------------------


def _train_config(**changes):
  base = dict(steps=3, global_batch_size=BATCH, seq_len=SEQ, learning_rate=1e-2, warmup_steps=0,
              log_every=1, mesh=MeshConfig(data=1))
  return TrainConfig(**{**base, **changes})


def _data():
  return TokenWindows(np.tile(np.arange(48), 100), SEQ, BATCH, seed=1)  # learnable


def _fit(model, config, objective=None):
  trainer = Trainer(model, config, objective, data=_data())
  history = trainer.fit(log=lambda _: None)
  return trainer, np.array([m['loss'] for m in history])


def _frozen_leaves(model):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Not(nnx.LoRAParam)))]


@pytest.mark.parametrize('base_quantization', ['none', pytest.param('int8', marks=SLOW),
                                               pytest.param('int4', marks=SLOW)])
def test_training_changes_adapters_only(base_quantization):
  """Loss falls, the optimizer holds the adapters alone, and the (quantized) base is
  bit-identical after the steps."""
  model = apply_lora(_base(scan=True), LoraConfig(rank=4, alpha=8,
                                                  base_quantization=base_quantization))
  before = _frozen_leaves(model)
  adapters_before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))]
  trainer, losses = _fit(model, _train_config())
  assert trainer.trainable is nnx.LoRAParam and trainer.quantization == 'none'
  assert losses[-1] < losses[0]
  for a, b in zip(before, _frozen_leaves(trainer.model)):
    np.testing.assert_array_equal(a, b)
  changed = [not np.array_equal(a, np.asarray(b)) for a, b in
             zip(adapters_before, jax.tree.leaves(nnx.state(trainer.model, nnx.LoRAParam)))]
  assert all(changed) and len(changed) == 14
  optimizer_numbers = sum(x.size for x in jax.tree.leaves(nnx.state(trainer.optimizer.opt_state)))
  adapter_numbers = sum(x.size for x in adapters_before)
  assert optimizer_numbers <= 2 * adapter_numbers + 10  # Adam's moments of the adapters only
  kernel = trainer.model.layers.attn.q_proj.kernel
  if base_quantization == 'none':
    assert isinstance(kernel, nnx.Param) and kernel.dtype == jnp.float32
  else:
    qarray = kernel.array
    assert qarray.qtype == {'int8': jnp.int8, 'int4': jnp.int4}[base_quantization]
    values = np.asarray(qarray.qvalue[...])
    assert values.dtype.itemsize == 1 and np.issubdtype(values.dtype, np.integer)
    if base_quantization == 'int4':
      assert values.min() >= -8 and values.max() <= 7


@pytest.mark.slow  # ~30 s: two compiles, one on 8 devices
def test_training_on_a_2x2x2_mesh_matches_one_device():
  config = LoraConfig(rank=4, alpha=8)
  single, one = _fit(apply_lora(_base(scan=True), config), _train_config())
  meshed, eight = _fit(apply_lora(_base(scan=True), config),
                       _train_config(mesh=MeshConfig(data=2, fsdp=2, tensor=2)))
  np.testing.assert_allclose(eight, one, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(nnx.state(single.model, nnx.LoRAParam)),
                  jax.tree.leaves(nnx.state(meshed.model, nnx.LoRAParam))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)  # Adam amplifies noise


def test_train_config_lora_adapts_a_given_or_built_model():
  given, losses = _fit(_base(), _train_config(steps=2, lora=LoraConfig(rank=4)))
  assert has_adapters(given.model) and given.trainable is nnx.LoRAParam
  built = Trainer(_base().config, _train_config(lora=LoraConfig(rank=4, targets='q_proj')))
  assert built.trainable is nnx.LoRAParam
  assert [p[-1] for p, _ in _adapted_modules(built.model)] == ['q_proj', 'q_proj']
  with pytest.raises(ValueError, match="does not combine with LoRA.*base_quantization"):
    Trainer(_base(), _train_config(quantization='int8', lora=LoraConfig(rank=4)))
  with pytest.raises(ValueError, match='already has LoRA adapters'):
    Trainer(given.model, _train_config(lora=LoraConfig(rank=4)))
  full = Trainer(_base(), _train_config(), trainable=nnx.Param)
  assert full.trainable is nnx.Param


@pytest.mark.parametrize('base_quantization', [pytest.param('none', marks=pytest.mark.slow),
                                               'int8'])
def test_checkpoint_resume_of_an_adapted_model(tmp_path, base_quantization):
  config = LoraConfig(rank=4, base_quantization=base_quantization)
  first, _ = _fit(apply_lora(_base(scan=True), config),
                  _train_config(steps=2, checkpoint_dir=str(tmp_path)))
  first.close()
  resumed = Trainer(apply_lora(_base(scan=True), config),
                    _train_config(steps=2, checkpoint_dir=str(tmp_path)), data=_data())
  assert resumed.restore_checkpoint() == 2
  for a, b in zip(jax.tree.leaves(nnx.state(first.model)),
                  jax.tree.leaves(nnx.state(resumed.model))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  batch = np.random.default_rng(0).integers(0, 256, (BATCH, SEQ + 1))
  np.testing.assert_allclose(resumed.step(batch)['loss'], first.step(batch)['loss'], rtol=1e-6)


def test_dpo_reference_is_the_policy_without_adapters():
  """No second model: the adapters-off policy is the reference (loss ln 2 at the start)."""
  rng = np.random.default_rng(0)
  windows = rng.integers(0, 256, (BATCH, SEQ + 1))
  windows[1::2, :6] = windows[0::2, :6]
  mask = np.zeros((BATCH, SEQ), np.float32)
  mask[:, 5:] = 1.0
  batch = {'inputs': windows[:, :-1], 'targets': windows[:, 1:], 'loss_mask': mask}
  policy = apply_lora(_base(), LoraConfig(rank=4, alpha=8))
  trainer = Trainer(policy, _train_config(), DPOObjective(beta=0.1,
                                                          reference_fn=without_adapters_logps))
  assert trainer.frozen_models == {}
  first = trainer.step(batch)
  assert first['loss'] == pytest.approx(math.log(2.0), abs=1e-6)
  second = trainer.step(batch)
  assert second['loss'] < first['loss'] and second['rewards/margins'] > 0


@pytest.mark.slow
def test_cli_train_writes_the_adapter_and_the_merged_model(tmp_path, capsys):
  from maxnnx import cli
  args = ['train', 'model=tiny', 'data=synthetic', 'steps=2', 'log_every=1', 'sample_tokens=0',
          'global_batch_size=4', 'seq_len=16', 'mesh.data=1', 'lora.rank=4', 'lora.alpha=8',
          'lora.targets=q_proj,v_proj', 'lora.base_quantization=int8', f'output_dir={tmp_path}']
  assert cli.main(args) == 0, capsys.readouterr().err
  config = json.loads((tmp_path / 'adapter' / 'adapter_config.json').read_text())
  assert (config['r'], config['lora_alpha'], config['target_modules']) == (4, 8.0,
                                                                           ['q_proj', 'v_proj'])
  final = maxnnx.from_pretrained(str(tmp_path / 'final'))
  assert not has_adapters(final)
  stored = json.loads((tmp_path / 'run_config.json').read_text())
  assert stored['train']['lora']['rank'] == 4

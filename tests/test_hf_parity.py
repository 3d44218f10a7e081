"""Logit and greedy-generation parity with Hugging Face transformers.

The references were produced once by ``tests/hf_parity/make_fixtures.py``
(transformers 5, float32) and are committed, so these tests never need torch.
Each case uses non-default settings of its family (GQA, explicit head_dim, rope
scaling, windows shorter than the 40-token input, soft-caps…).
"""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import FIXTURES, HF_CASES, legacy_checkpoint, reference, rel_error

import maxnnx

REL_TOL = 1e-4
# Fixtures whose layer pattern the scanned layout cannot hold (ModelConfig says why).
NO_SCAN = {'llama4': 'MoE layers interleaved with dense ones (moe.layer_step=2)',
           'qwen3_next': 'Gated DeltaNet layers interleaved with attention layers',
           'qwen3_5': 'Gated DeltaNet layers interleaved with attention layers',
           'gemma4': 'global layers wider than the sliding ones (attention.global_layers)',
           'gemma4_moe': 'global layers wider than the sliding ones (attention.global_layers)',
           'gemma4_small': 'per-layer inputs and keys/values shared across layers'}




def test_every_family_has_a_fixture():
  """The parity suite covers every family the issue names."""
  assert set(HF_CASES) >= {'llama', 'mistral', 'qwen2', 'qwen3', 'gemma', 'gemma2', 'gemma3',
                           'phi3', 'olmo2', 'olmo3', 'gpt2', 'gpt_oss'}


# The config layout and the layer layout are independent: by default the legacy config runs
# in the list layout only (legacy + scan is marked slow).
LAYOUTS = [pytest.param('transformers5', False, id='transformers5-list'),
           pytest.param('transformers5', True, id='transformers5-scan'),
           pytest.param('legacy', False, id='legacy-list'),
           pytest.param('legacy', True, id='legacy-scan', marks=pytest.mark.slow)]


@pytest.mark.parametrize('layout,scan_layers', LAYOUTS)
@pytest.mark.parametrize('case', HF_CASES)
def test_logits_match_transformers(case, layout, scan_layers, tmp_path):
  """float32 logits match transformers at rel error < 1e-4, from both config layouts."""
  path = os.path.join(FIXTURES, case) if layout == 'transformers5' else legacy_checkpoint(
      case, str(tmp_path))
  ref = reference(case)
  if scan_layers and case in NO_SCAN:
    with pytest.raises(maxnnx.PretrainedError, match='scan_layers'):
      maxnnx.from_pretrained(path, scan_layers=True)
    pytest.skip(f'{case}: {NO_SCAN[case]} cannot be scanned; the config refuses it.')
  model = maxnnx.from_pretrained(path, scan_layers=scan_layers)
  assert rel_error(model(ref['input_ids']), ref['logits']) < REL_TOL


@pytest.mark.parametrize('case', HF_CASES)
def test_greedy_generation_matches_transformers(case):
  """Greedy decoding with the KV cache reproduces transformers' generate()."""
  ref = reference(case)
  prompt = ref['gen_prompt']
  expected = ref['gen_output'][:, prompt.shape[1]:]
  model = maxnnx.from_pretrained(os.path.join(FIXTURES, case))
  result = maxnnx.generate(model, prompt, max_new_tokens=expected.shape[1])
  np.testing.assert_array_equal(result.tokens, expected)


@pytest.mark.parametrize('case', HF_CASES)
def test_save_load_round_trip(case, tmp_path):
  """load -> save -> load gives identical parameters, config and logits."""
  model = maxnnx.from_pretrained(os.path.join(FIXTURES, case))
  maxnnx.save_pretrained(model, str(tmp_path))
  again = maxnnx.from_pretrained(str(tmp_path))
  assert again.config == model.config
  from flax import nnx
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                               nnx.to_flat_state(nnx.state(again, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


@pytest.mark.parametrize('case', ['llama', 'phi3', 'gemma3', 'gpt_oss', 'olmo3', 'gpt2'])
def test_export_keeps_hugging_face_tensor_names(case, tmp_path):
  """save_pretrained writes exactly the tensor names and shapes of the original checkpoint."""
  from maxnnx.checkpoint.safetensors import read_safetensors
  model = maxnnx.from_pretrained(os.path.join(FIXTURES, case), scan_layers=True)
  maxnnx.save_pretrained(model, str(tmp_path))
  original = read_safetensors(os.path.join(FIXTURES, case, 'model.safetensors'))
  written = read_safetensors(str(tmp_path / 'model.safetensors'))
  assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in original.items()}
  for name in original:
    np.testing.assert_array_equal(written[name], original[name], err_msg=name)


def test_gpt2_checkpoint_of_a_bare_gpt2_model_loads(tmp_path):
  """Hub GPT-2 files come from GPT2Model: no ``transformer.`` prefix, and the old causal-mask
  buffers (``attn.bias``, ``attn.masked_bias``) beside the weights. They load to the same
  logits as the fixture."""
  from maxnnx.checkpoint.safetensors import read_safetensors, write_safetensors
  tensors = read_safetensors(os.path.join(FIXTURES, 'gpt2', 'model.safetensors'))
  bare = {name.removeprefix('transformer.'): array for name, array in tensors.items()}
  for i in range(2):
    bare[f'h.{i}.attn.bias'] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    bare[f'h.{i}.attn.masked_bias'] = np.asarray(-1e4, np.float32)
  write_safetensors(str(tmp_path / 'model.safetensors'), bare)
  shutil.copy(os.path.join(FIXTURES, 'gpt2', 'legacy', 'config.json'), tmp_path)
  ref = reference('gpt2')
  model = maxnnx.from_pretrained(str(tmp_path))
  assert model.config.family == 'gpt3' and model.config.position_embedding == 'learned'
  assert rel_error(model(ref['input_ids']), ref['logits']) < REL_TOL


def test_olmo3_layer_pattern_and_rope_per_layer_type():
  """OLMo 3's config maps to per-layer windows and ropes; without layer_types the pattern is
  three sliding layers then a full one."""
  from maxnnx.models.hf import HFConfig
  from maxnnx.models.olmo3 import SPEC
  with open(os.path.join(FIXTURES, 'olmo3', 'config.json')) as f:
    data = json.load(f)
  cfg = maxnnx.config_from_pretrained(os.path.join(FIXTURES, 'olmo3'))
  assert cfg.layer_types == ('sliding', 'full', 'sliding', 'sliding')
  assert (cfg.rope.scaling, cfg.rope.attention_factor, cfg.local_rope.scaling) == (
      'yarn', 1.2, 'none')
  data['num_hidden_layers'] = 8
  del data['layer_types']
  derived = SPEC.hf.config_from_hf(HFConfig(data, 'config.json', SPEC.hf.defaults))
  assert derived.layer_types == ('sliding',) * 3 + ('full',) + ('sliding',) * 3 + ('full',)

"""Make the PEFT LoRA adapter fixtures, and check maxnnx-exported adapters with PEFT.

A developer tool, run by hand where torch, transformers and peft are installed
(the test suite never imports them):

    python tests/hf_parity/make_lora_fixture.py [--family FAMILY]  # llama (default), phi3,
                                                   # gpt2, gemma3_vision, llama4_vision
    python tests/hf_parity/make_lora_fixture.py --family phi3 --verify-export DIR REFERENCE_NPZ

The first form rewrites ``tests/fixtures/peft/<family>_lora/``: a LoRA adapter
that peft makes on the family's tiny fixture (``tests/fixtures/hf/<family>``)
with rank 4, ``lora_alpha`` 8 and every projection of the checkpoint as a
target (Llama's seven; Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` with
``o_proj`` and ``down_proj``; GPT-2's ``Conv1D`` ``c_attn``, ``c_proj``, ``c_fc``),
``B`` set to random nonzero values (peft starts it at zero, which would hide a
loader that drops it), saved with ``save_pretrained`` (``adapter_config.json`` +
``adapter_model.safetensors``), and ``reference.npz``: the fixture's
``input_ids`` and peft's ``logits`` float32 with the adapter on. Seeded, so
reruns give identical files. The multimodal fixtures (``gemma3_vision``,
``llama4_vision``) adapt the vision tower's projections too, and their references
are logits with the fixture's images (``pixel_values``, and Gemma 3's
``token_type_ids``).

The second form loads the family's fixture with the adapter directory DIR
through ``peft.PeftModel.from_pretrained`` and compares its logits on the npz's
``input_ids`` with the npz's ``logits`` (max abs difference < 1e-4).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

ROOT = Path(__file__).resolve().parent.parent / 'fixtures'
TARGETS = {'llama': ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'],
           'phi3': ['qkv_proj', 'o_proj', 'gate_up_proj', 'down_proj'],
           'gpt2': ['c_attn', 'c_proj', 'c_fc'],
           'gemma3_vision': ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj',
                             'down_proj', 'out_proj', 'fc1', 'fc2'],
           'llama4_vision': ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj',
                             'down_proj', 'fc1', 'fc2']}
# The model's inputs in each family's reference.npz, besides input_ids.
IMAGE_INPUTS = {'gemma3_vision': ('pixel_values', 'token_type_ids'),
                'llama4_vision': ('pixel_values',)}
RANK, ALPHA, B_STD = 4, 8, 0.05
TOLERANCE = 1e-4
FAMILY = 'llama'  # set by --family


def base_dir() -> Path:
  return ROOT / 'hf' / FAMILY


def out_dir() -> Path:
  return ROOT / 'peft' / f'{FAMILY}_lora'


def base_model() -> torch.nn.Module:
  if FAMILY in IMAGE_INPUTS:
    return AutoModelForImageTextToText.from_pretrained(base_dir(), dtype=torch.float32).eval()
  return AutoModelForCausalLM.from_pretrained(base_dir(), dtype=torch.float32).eval()


def model_inputs(reference: np.lib.npyio.NpzFile) -> dict[str, np.ndarray]:
  """``input_ids`` (and the images) of a fixture's reference.npz."""
  return {key: reference[key] for key in ('input_ids', *IMAGE_INPUTS.get(FAMILY, ()))}


def logits_of(model: torch.nn.Module, inputs: dict[str, np.ndarray]) -> np.ndarray:
  tensors = {k: torch.from_numpy(v) if k == 'pixel_values' else torch.from_numpy(v).long()
             for k, v in inputs.items()}
  with torch.no_grad():
    return model(**tensors).logits.float().numpy()


def make() -> None:
  torch.manual_seed(1234)
  config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS[FAMILY],
                      lora_dropout=0.05, task_type='CAUSAL_LM')
  model = get_peft_model(base_model(), config)
  with torch.no_grad():
    for name, param in model.named_parameters():
      if 'lora_B' in name:
        param.normal_(0.0, B_STD)
  model.eval()
  directory = out_dir()
  directory.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(directory)
  tidy(directory)
  inputs = model_inputs(np.load(base_dir() / 'reference.npz'))
  logits = logits_of(model, inputs)
  base_logits = logits_of(base_model(), inputs)
  effect = float(np.abs(logits - base_logits).max())
  if effect < 0.1:
    sys.exit(f'the adapter barely changes the logits ({effect}); raise B_STD')
  np.savez(directory / 'reference.npz', **{k: v.astype(np.int32) if v.dtype.kind == 'i' else v
                                           for k, v in inputs.items()},
           logits=logits.astype(np.float32))
  reloaded = PeftModel.from_pretrained(base_model(), directory).eval()
  diff = float(np.abs(logits_of(reloaded, inputs) - logits).max())
  if diff > 1e-6:
    sys.exit(f'peft does not reload its own adapter to the same logits ({diff})')
  for path in sorted(directory.iterdir()):
    print(f'{path.name}: {path.stat().st_size:,} bytes')
  print(f'adapter effect on the logits: max {effect:.3f}')


def tidy(directory: Path) -> None:
  """Make the saved files reproducible and free of this machine: no model card, the base
  named relative to the repository, ``target_modules`` sorted (peft writes a set)."""
  (directory / 'README.md').unlink(missing_ok=True)
  path = directory / 'adapter_config.json'
  config = json.loads(path.read_text())
  config['base_model_name_or_path'] = f'tests/fixtures/hf/{FAMILY}'
  config['target_modules'] = sorted(config['target_modules'])
  path.write_text(json.dumps(config, indent=2, sort_keys=True) + '\n')
  for file in directory.iterdir():
    file.chmod(0o644)


def verify_export(directory: str, reference: str) -> float:
  """Max abs logit difference of PEFT loading ``directory`` against ``reference``'s logits."""
  data = np.load(reference)
  model = PeftModel.from_pretrained(base_model(), directory).eval()
  diff = float(np.abs(logits_of(model, model_inputs(data)) - data['logits']).max())
  print(f'{directory}: peft loads it; max abs logit difference {diff:.2e}')
  if diff > TOLERANCE:
    sys.exit(f'difference {diff} exceeds {TOLERANCE}')
  return diff


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--family', choices=sorted(TARGETS), default='llama')
  parser.add_argument('--verify-export', nargs=2, metavar=('DIR', 'REFERENCE_NPZ'))
  args = parser.parse_args()
  global FAMILY
  FAMILY = args.family
  if args.verify_export:
    verify_export(*args.verify_export)
  else:
    make()


if __name__ == '__main__':
  main()

"""Hugging Face ``transformers`` ``generate`` timed on a fresh random Llama (runs in a torch env).

Started by ``benchmarks.hf_decode`` as ``python _hf_generate.py '<spec json>'``. The spec holds
the config shapes, the checkpoint directory to write, the prompts file, the dtype, the device and
the timing settings. The script

1. builds ``LlamaForCausalLM`` with the config's shapes from a fixed seed and saves it to the
   checkpoint directory as safetensors (float32), so maxnnx loads the very same weights;
2. for each batch size, times ``generate`` (greedy, no early stop, the default dynamic KV cache)
   with 1 and with ``decode + 1`` new tokens after the prompts, each the median of ``repeats``
   calls after a warm-up call;
3. writes the raw timings, the first row's new tokens and the versions to ``spec['out']``.

It imports nothing from the project, so it runs wherever torch and transformers are installed.
"""

import json
import statistics
import sys
import time

import torch
import transformers


def _llama_config(cfg: dict, max_positions: int) -> transformers.LlamaConfig:
  config = transformers.LlamaConfig(
      vocab_size=cfg['vocab_size'], hidden_size=cfg['d_model'],
      intermediate_size=cfg['mlp_dim'], num_hidden_layers=cfg['num_layers'],
      num_attention_heads=cfg['num_heads'], num_key_value_heads=cfg['num_kv_heads'],
      head_dim=cfg['head_dim'], max_position_embeddings=max_positions, rms_norm_eps=1e-5,
      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
  theta = float(cfg.get('rope_theta', 10_000.0))
  if getattr(config, 'rope_parameters', None) is not None:  # transformers >= 5
    config.rope_parameters = {'rope_type': 'default', 'rope_theta': theta}
  config.rope_theta = theta
  return config


def _median_seconds(fn, repeats: int, sync) -> float:
  fn()  # warm-up
  sync()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    sync()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(spec: dict) -> None:
  """Save the checkpoint, time ``generate`` per batch size, write the raw results."""
  device = spec['device']
  if device == 'auto':
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
  if spec.get('threads'):
    torch.set_num_threads(spec['threads'])
  torch.manual_seed(0)
  config = _llama_config(spec['cfg'], spec['max_positions'])
  model = transformers.LlamaForCausalLM(config)
  model.save_pretrained(spec['checkpoint'], safe_serialization=True)
  dtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[spec['dtype']]
  model = model.to(device=device, dtype=dtype).eval()
  sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)
  with open(spec['prompts']) as f:
    prompts = json.load(f)  # {str(batch): [[token, ...], ...]}

  def generate(ids, new_tokens):
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          eos_token_id=None, pad_token_id=0)

  rows, first_tokens = [], None
  with torch.inference_mode():
    new_tokens, repeats = spec['decode'] + 1, spec['repeats']
    for batch in spec['batches']:
      ids = torch.tensor(prompts[str(batch)], dtype=torch.long, device=device)
      short = _median_seconds(lambda ids=ids: generate(ids, 1), repeats, sync)
      full = _median_seconds(lambda ids=ids: generate(ids, new_tokens), repeats, sync)
      rows.append({'batch': batch, 'short_s': short, 'full_s': full})
      if first_tokens is None:
        out = generate(ids, new_tokens)
        first_tokens = out[0, ids.shape[1]:].tolist()
  name = torch.cuda.get_device_name() if device == 'cuda' else 'cpu'
  raw = {'rows': rows, 'first_row_tokens': first_tokens, 'device_type': device,
         'device_name': name, 'threads': torch.get_num_threads(),
         'versions': {'torch': torch.__version__, 'transformers': transformers.__version__}}
  with open(spec['out'], 'w') as f:
    json.dump(raw, f)


if __name__ == '__main__':
  main(json.loads(sys.argv[1]))

"""Write the quantized-release fixtures under ``tests/fixtures/hf/quantized/``.

Run once with torch, transformers 5 and compressed-tensors installed:
``python tests/hf_parity/make_quantized_fixtures.py``. Each case takes a float32
fixture of ``tests/fixtures/hf/<base>/``, quantizes its weights in the layout of
a real release (sharded so that a weight and its scale land in different files,
partial blocks where the format allows them), and records the logits of
transformers' float32 model run on the weights dequantized here, in torch, by
the format's own rule. transformers' own fp8 loader is not used: on CPU it
derives the block size from the scale grid, which is wrong for partial blocks.

Cases:

- ``deepseek_v3_fp8``: block-wise fp8, ``weight_block_size`` [16, 24] (64 and 32
  wide tensors end in partial blocks), float32 ``weight_scale_inv``, every
  linear weight of the layers but the router; three shards, the scales in the last.
- ``qwen3_fp8``: the same format with [32, 40] blocks and bfloat16 scales.
- ``gpt_oss_mxfp4``: the experts as MXFP4 ``_blocks`` / ``_scales``.
- ``llama_ct_fp8_channel``: compressed-tensors ``float-quantized``, one bfloat16
  scale per output channel, ``lm_head`` ignored.
- ``mistral_ct_fp8_tensor``: compressed-tensors fp8 with one scale per tensor and
  static ``input_scale`` tensors (which the loader drops).
- ``qwen2_ct_w4a16``: compressed-tensors ``pack-quantized`` int4, groups of 32
  inputs, packed by compressed-tensors' own ``pack_to_int32``.
- ``llama_fbgemm_fp8``: ``fbgemm_fp8`` (Llama 4's FP8 release format), fp8 weights with a
  float32 ``weight_scale`` per output row.
"""

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from safetensors.numpy import load_file
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), '..', 'fixtures', 'hf')
OUT = os.path.join(ROOT, 'quantized')
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def is_layer_linear(name: str, array: np.ndarray) -> bool:
    return (name.startswith('model.layers.') and name.endswith('.weight') and array.ndim == 2
            and 'norm' not in name and not name.endswith('mlp.gate.weight'))


def fp8_blocks(w: torch.Tensor, block, scale_dtype):
    rows, cols = w.shape
    br, bc = block
    gr, gc = -(-rows // br), -(-cols // bc)
    scale = torch.empty(gr, gc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    deq = torch.empty(rows, cols)
    for i in range(gr):
        for j in range(gc):
            tile = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s = (tile.abs().max() / 448.0).to(scale_dtype).float()
            q_tile = (tile / s).to(torch.float8_e4m3fn)
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = q_tile
            deq[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = q_tile.float() * s
            scale[i, j] = s
    return q, scale.to(scale_dtype), deq


def mxfp4(w_in_out: torch.Tensor):
    """[..., in, out] (transformers' GPT-OSS layout) -> blocks, scales, dequantized."""
    rows = w_in_out.transpose(-1, -2)  # [..., out, in]
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.floor(torch.log2(amax)) - 2
    scaled = groups / torch.pow(2.0, exponent)[..., None]
    distance = (scaled.abs()[..., None] - FP4[:8]).abs()
    code = distance.argmin(-1)  # the lower code on a tie
    upper = distance.gather(-1, (code + 1).clamp(max=7)[..., None])[..., 0]
    tie = (upper == distance.min(-1).values) & (code < 7)
    code = torch.where(tie & (code % 2 == 1), code + 1, code)  # ties to the even code
    code = code + 8 * torch.signbit(scaled).to(torch.int64)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    scales = (exponent + 127).to(torch.uint8)
    values = torch.cat([FP4, -FP4])[code] * torch.pow(2.0, exponent)[..., None]
    deq = values.reshape(rows.shape).transpose(-1, -2).contiguous()
    return packed, scales, deq


def ct_fp8(w: torch.Tensor, strategy: str):
    amax = w.abs().amax(1, keepdim=True) if strategy == 'channel' else w.abs().max().reshape(1)
    scale = (amax / 448.0).to(torch.bfloat16 if strategy == 'channel' else torch.float32)
    q = (w / scale.float()).to(torch.float8_e4m3fn)
    return q, scale, q.float() * scale.float()


def ct_int4(w: torch.Tensor, group: int):
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    scale = (g.abs().amax(-1) / 7.0).to(torch.bfloat16)
    q = torch.clamp(torch.round(g / scale.float()[..., None]), -8, 7)
    deq = (q * scale.float()[..., None]).reshape(rows, cols)
    return pack_to_int32(q.reshape(rows, cols).to(torch.int8), 4), scale, deq


def ct_config(fmt: str, weights: dict, activations: dict | None) -> dict:
    group = {'targets': ['Linear'], 'weights': weights}
    if activations:
        group['input_activations'] = activations
    return {'quant_method': 'compressed-tensors', 'format': fmt,
            'quantization_status': 'compressed', 'config_groups': {'group_0': group},
            'ignore': ['lm_head']}


def quantize_case(case: str, tensors: dict):
    """(stored tensors, dequantized float tensors, quantization_config)."""
    stored, deq = dict(tensors), {k: torch.from_numpy(v.copy()) for k, v in tensors.items()}
    if case in ('deepseek_v3_fp8', 'qwen3_fp8'):
        block, sdt = (([16, 24], torch.float32) if case == 'deepseek_v3_fp8'
                      else ([32, 40], torch.bfloat16))
        for name, array in tensors.items():
            if is_layer_linear(name, array):
                q, s, d = fp8_blocks(torch.from_numpy(array.copy()), block, sdt)
                stored[name], stored[name + '_scale_inv'], deq[name] = q, s, d
        return stored, deq, {'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic',
                             'weight_block_size': block}
    if case == 'gpt_oss_mxfp4':
        for name, array in tensors.items():
            if name.endswith(('mlp.experts.gate_up_proj', 'mlp.experts.down_proj')):
                b, s, d = mxfp4(torch.from_numpy(array.copy()))
                del stored[name]
                stored[name + '_blocks'], stored[name + '_scales'], deq[name] = b, s, d
        return stored, deq, {'quant_method': 'mxfp4', 'modules_to_not_convert': [
            'model.layers.*.self_attn', 'model.layers.*.mlp.router', 'model.embed_tokens',
            'lm_head']}
    linear = {n: a for n, a in tensors.items() if is_layer_linear(n, a)}
    if case == 'llama_fbgemm_fp8':  # Llama 4's FP8 release format: a float32 scale per row
        for name, array in linear.items():
            w = torch.from_numpy(array.copy())
            scale = w.abs().amax(1, keepdim=True) / 448.0
            q = (w / scale).to(torch.float8_e4m3fn)
            stored[name], stored[name + '_scale'], deq[name] = q, scale, q.float() * scale
        return stored, deq, {'quant_method': 'fbgemm_fp8', 'activation_scale_ub': 1200.0,
                             'modules_to_not_convert': ['lm_head']}
    if case in ('llama_ct_fp8_channel', 'mistral_ct_fp8_tensor'):
        strategy = 'channel' if case == 'llama_ct_fp8_channel' else 'tensor'
        for name, array in linear.items():
            q, s, d = ct_fp8(torch.from_numpy(array.copy()), strategy)
            stored[name], stored[name[:-len('weight')] + 'weight_scale'], deq[name] = q, s, d
            if strategy == 'tensor':
                stored[name[:-len('weight')] + 'input_scale'] = torch.tensor([0.05])
        acts = ({'num_bits': 8, 'type': 'float', 'strategy': 'token', 'dynamic': True,
                 'symmetric': True} if strategy == 'channel' else
                {'num_bits': 8, 'type': 'float', 'strategy': 'tensor', 'dynamic': False,
                 'symmetric': True})
        return stored, deq, ct_config('float-quantized', {
            'num_bits': 8, 'type': 'float', 'strategy': strategy, 'symmetric': True,
            'dynamic': False}, acts)
    if case == 'qwen2_ct_w4a16':
        for name, array in linear.items():
            packed, s, d = ct_int4(torch.from_numpy(array.copy()), 32)
            base = name[:-len('weight')]
            del stored[name]
            stored[base + 'weight_packed'], stored[base + 'weight_scale'] = packed, s
            stored[base + 'weight_shape'] = torch.tensor(list(array.shape), dtype=torch.int64)
            deq[name] = d
        return stored, deq, ct_config('pack-quantized', {
            'num_bits': 4, 'type': 'int', 'strategy': 'group', 'group_size': 32,
            'symmetric': True, 'dynamic': False}, None)
    raise SystemExit(f'unknown case {case}')


def write_shards(directory: str, stored: dict) -> None:
    """Three shards: the first half of the non-scale tensors, the second half, then every
    scale, so a weight and its scale never share a file."""
    as_torch = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v.copy())
                for k, v in stored.items()}
    scales = sorted(k for k in as_torch if k.endswith(('_scale_inv', '_scale', '_scales',
                                                       'input_scale', '_shape')))
    rest = sorted(k for k in as_torch if k not in scales)
    parts = [rest[:len(rest) // 2], rest[len(rest) // 2:], scales]
    weight_map = {}
    for i, names in enumerate(parts):
        file = f'model-{i + 1:05d}-of-00003.safetensors'
        save_file({k: as_torch[k].contiguous() for k in names}, os.path.join(directory, file),
                  metadata={'format': 'pt'})
        weight_map.update({k: file for k in names})
    total = sum(t.numel() * t.element_size() for t in as_torch.values())
    with open(os.path.join(directory, 'model.safetensors.index.json'), 'w') as f:
        json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)


BASES = {'deepseek_v3_fp8': 'deepseek_v3', 'qwen3_fp8': 'qwen3', 'gpt_oss_mxfp4': 'gpt_oss',
         'llama_ct_fp8_channel': 'llama', 'mistral_ct_fp8_tensor': 'mistral',
         'qwen2_ct_w4a16': 'qwen2', 'llama_fbgemm_fp8': 'llama'}


@torch.no_grad()
def make(case: str) -> None:
    base = os.path.join(ROOT, BASES[case])
    tensors = load_file(os.path.join(base, 'model.safetensors'))
    stored, deq, quant = quantize_case(case, tensors)
    with open(os.path.join(base, 'config.json')) as f:
        config = json.load(f)
    ids = np.load(os.path.join(base, 'reference.npz'))['input_ids']
    with tempfile.TemporaryDirectory() as tmp:  # the float32 model on the dequantized weights
        shutil.copy(os.path.join(base, 'config.json'), tmp)
        save_file({k: v.contiguous() for k, v in deq.items()},
                  os.path.join(tmp, 'model.safetensors'), metadata={'format': 'pt'})
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        logits = model(torch.from_numpy(ids).long()).logits.float().numpy()
    out = os.path.join(OUT, case)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    write_shards(out, stored)
    with open(os.path.join(out, 'config.json'), 'w') as f:
        json.dump({**config, 'quantization_config': quant}, f, indent=2, sort_keys=True)
    np.savez(os.path.join(out, 'reference.npz'), input_ids=ids, logits=logits)
    float_logits = np.load(os.path.join(base, 'reference.npz'))['logits']
    print(f'{case}: quantization moves the logits by up to '
          f'{np.abs(logits - float_logits).max():.3f} (max |logit| {np.abs(logits).max():.2f})')


if __name__ == '__main__':
    torch.manual_seed(0)
    for name in sys.argv[1:] or BASES:
        make(name)

"""A plain PyTorch Llama trained on random tokens, timed step by step (runs in the peer's venv).

Started by ``benchmarks.peers.pytorch`` as ``python _pytorch_llama.py '<spec json>'``; the spec
holds the config shapes, mode, dtype, steps and the path to write the raw measurements to. This
file imports nothing from the project, so it runs with only torch installed.

Model: token embedding, ``num_layers`` pre-norm blocks (RMSNorm, rotary attention with grouped
KV heads through ``F.scaled_dot_product_attention(is_causal=True)``, SwiGLU MLP), final RMSNorm,
an untied LM head, cross-entropy in float32. Optimiser: AdamW. Weights stay float32; ``bfloat16``
runs the forward under autocast (the usual mixed precision, like MaxText's default of float32
weights with bfloat16 activations).

MoE configs (``num_experts > 0``) replace the MLP with a softmax router over the top-k expert
logits and a per-expert loop that gathers each expert's tokens and scatters back with
``index_add_``: simple and correct, but slow (one small matmul per expert, dynamic shapes that
``torch.compile`` cannot fuse), so MoE numbers are a lower bound for PyTorch.
"""

import json
import math
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
  """Root-mean-square norm with a learned scale, computed in float32."""

  def __init__(self, dim: int, eps: float = 1e-5):
    super().__init__()
    self.eps = eps
    self.weight = nn.Parameter(torch.ones(dim))

  def forward(self, x):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    return (y * self.weight).to(x.dtype)


def rope_tables(seq: int, head_dim: int, theta: float, device):
  """cos and sin tables [seq, head_dim] for rotate-half rotary embeddings."""
  inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
  angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
  angles = torch.cat([angles, angles], dim=-1)
  return angles.cos(), angles.sin()


def apply_rope(x_BHTK, cos_TK, sin_TK):
  """Rotate the first and second halves of each head's features by the position angle."""
  half = x_BHTK.shape[-1] // 2
  rotated = torch.cat([-x_BHTK[..., half:], x_BHTK[..., :half]], dim=-1)
  return (x_BHTK * cos_TK + rotated * sin_TK).to(x_BHTK.dtype)


class Attention(nn.Module):
  """Causal self-attention with rotary positions and grouped KV heads."""

  def __init__(self, cfg: dict):
    super().__init__()
    d, k = cfg['d_model'], cfg['head_dim']
    self.heads, self.kv_heads, self.head_dim = cfg['num_heads'], cfg['num_kv_heads'], k
    self.q = nn.Linear(d, self.heads * k, bias=False)
    self.k = nn.Linear(d, self.kv_heads * k, bias=False)
    self.v = nn.Linear(d, self.kv_heads * k, bias=False)
    self.o = nn.Linear(self.heads * k, d, bias=False)

  def forward(self, x_BTD, cos_TK, sin_TK):
    b, t, _ = x_BTD.shape
    q_BHTK = self.q(x_BTD).view(b, t, self.heads, self.head_dim).transpose(1, 2)
    k_BGTK = self.k(x_BTD).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
    v_BGTK = self.v(x_BTD).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
    q_BHTK, k_BGTK = apply_rope(q_BHTK, cos_TK, sin_TK), apply_rope(k_BGTK, cos_TK, sin_TK)
    if self.kv_heads != self.heads:
      groups = self.heads // self.kv_heads
      k_BGTK = k_BGTK.repeat_interleave(groups, dim=1)
      v_BGTK = v_BGTK.repeat_interleave(groups, dim=1)
    out_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, is_causal=True)
    return self.o(out_BHTK.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
  """``down(silu(gate(x)) * up(x))``."""

  def __init__(self, d: int, f: int):
    super().__init__()
    self.gate = nn.Linear(d, f, bias=False)
    self.up = nn.Linear(d, f, bias=False)
    self.down = nn.Linear(f, d, bias=False)

  def forward(self, x):
    return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
  """Top-k routed SwiGLU experts: softmax over the chosen logits, a loop over experts."""

  def __init__(self, cfg: dict):
    super().__init__()
    d, f, e = cfg['d_model'], cfg['mlp_dim'], cfg['num_experts']
    self.top_k = cfg['num_experts_per_tok']
    self.router = nn.Linear(d, e, bias=False)
    self.gate_EDF = nn.Parameter(torch.empty(e, d, f))
    self.up_EDF = nn.Parameter(torch.empty(e, d, f))
    self.down_EFD = nn.Parameter(torch.empty(e, f, d))

  def forward(self, x_BTD):
    x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
    logits_NE = self.router(x_ND)
    top_logits_NK, top_idx_NK = logits_NE.topk(self.top_k, dim=-1)
    weights_NK = top_logits_NK.float().softmax(-1).to(x_ND.dtype)
    out_ND = torch.zeros_like(x_ND)
    for e in range(self.gate_EDF.shape[0]):
      tok, slot = (top_idx_NK == e).nonzero(as_tuple=True)
      if tok.numel() == 0:
        continue
      xe = x_ND[tok]  # autocast casts these matmuls like nn.Linear's
      h = F.silu(xe @ self.gate_EDF[e]) * (xe @ self.up_EDF[e])
      y = (h @ self.down_EFD[e]) * weights_NK[tok, slot, None]
      out_ND = out_ND.index_add(0, tok, y.to(out_ND.dtype))
    return out_ND.view_as(x_BTD)


class Block(nn.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, cfg: dict):
    super().__init__()
    self.attn_norm = RMSNorm(cfg['d_model'])
    self.attn = Attention(cfg)
    self.mlp_norm = RMSNorm(cfg['d_model'])
    self.mlp = MoE(cfg) if cfg.get('num_experts') else SwiGLU(cfg['d_model'], cfg['mlp_dim'])

  def forward(self, x, cos, sin):
    x = x + self.attn(self.attn_norm(x), cos, sin)
    return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
  """Embedding, decoder blocks, final norm, untied LM head."""

  def __init__(self, cfg: dict):
    super().__init__()
    self.cfg = cfg
    self.embed = nn.Embedding(cfg['vocab_size'], cfg['d_model'])
    self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg['num_layers']))
    self.norm = RMSNorm(cfg['d_model'])
    self.lm_head = nn.Linear(cfg['d_model'], cfg['vocab_size'], bias=False)
    for p in self.parameters():
      if p.dim() >= 2:  # every matrix; the 1-d parameters are the norm scales (ones)
        nn.init.normal_(p, std=0.02)

  def forward(self, tokens_BT, cos, sin):
    x = self.embed(tokens_BT)
    for block in self.blocks:
      x = block(x, cos, sin)
    return self.lm_head(self.norm(x))


def matmul_ceiling_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
  """The best TFLOP/s of an ``n``x``n`` matmul in ``dtype`` (best of ``repeats`` timings)."""
  a = torch.randn(n, n, device=device, dtype=dtype)
  b = torch.randn(n, n, device=device, dtype=dtype)
  best = math.inf
  for i in range(repeats + 1):
    _sync(device)
    start = time.perf_counter()
    c = a @ b
    _sync(device)
    if i:  # the first one warms up
      best = min(best, time.perf_counter() - start)
  del c
  return 2 * n**3 / best / 1e12


def _sync(device: torch.device):
  if device.type == 'cuda':
    torch.cuda.synchronize(device)


def main(spec: dict) -> dict:
  """Build, (optionally) compile and time the model; return the raw measurements."""
  cfg = spec['cfg']
  threads = spec.get('threads') or (len(os.sched_getaffinity(0))
                                    if hasattr(os, 'sched_getaffinity') else os.cpu_count())
  torch.set_num_threads(threads)
  want = spec.get('device', 'auto')
  device = torch.device('cuda' if want == 'auto' and torch.cuda.is_available() else
                        ('cpu' if want == 'auto' else want))
  dtype = {'bfloat16': torch.bfloat16, 'float32': torch.float32}[spec['dtype']]
  torch.manual_seed(spec.get('seed', 0))

  model = Llama(cfg).to(device)
  opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
  cos, sin = rope_tables(cfg['seq'], cfg['head_dim'], cfg['rope_theta'], device)
  tokens = torch.randint(0, cfg['vocab_size'], (cfg['batch'], cfg['seq'] + 1), device=device)
  inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

  def loss_fn():
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
      logits = model(inputs, cos, sin)
    return F.cross_entropy(logits.float().view(-1, cfg['vocab_size']), targets.view(-1))

  def train_step():
    opt.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    opt.step()
    return loss

  if spec['mode'] == 'compile':
    loss_fn = torch.compile(loss_fn)  # forward + backward; AdamW stays eager (foreach kernels)
  if device.type == 'cuda':
    torch.cuda.reset_peak_memory_stats(device)

  times, losses = [], []
  total = spec['warmup'] + spec['steps']
  for _ in range(total):
    _sync(device)
    start = time.perf_counter()
    loss = train_step()
    losses.append(float(loss.detach()))  # .item() syncs, so the step is really finished
    _sync(device)
    times.append(time.perf_counter() - start)
    print(f'step {len(times)}/{total}: {times[-1]:.3f} s loss {losses[-1]:.4f}', flush=True)

  if device.type == 'cuda':
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    device_name = torch.cuda.get_device_name(device)
    n = 8192
  else:
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    device_name = None
    n = 2048
  ceiling = matmul_ceiling_tflops(device, dtype, n, repeats=spec.get('ceiling_repeats', 5))
  return dict(step_times_s=times, losses=losses, ceiling_tflops=ceiling,
              compile_s=times[0] if spec['mode'] == 'compile' else None,
              peak_memory_gib=peak_gib, device_name=device_name, device_type=device.type,
              threads=threads,
              versions={'torch': torch.__version__, 'python': sys.version.split()[0]})


if __name__ == '__main__':
  spec = json.loads(sys.argv[1])
  out = main(spec)
  with open(spec['out'], 'w') as f:
    json.dump(out, f)

"""Benchmark configs shared by maxnnx and every peer (plain Python: no jax, no torch).

Each config is a plain dict of shapes so a peer running in its own virtual environment (PyTorch,
MaxText) can import this file and build the identical model. ``batch`` is the global batch in
sequences; ``seq`` the tokens per sequence.
"""

BENCH_CONFIGS: dict[str, dict] = {
    # Llama-style shapes for the two CPU comparisons.
    'cpu-tiny': dict(d_model=256, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=64,
                     mlp_dim=1024, vocab_size=32_000, seq=256, batch=4, device='cpu'),
    'cpu-medium': dict(d_model=512, num_layers=8, num_heads=8, num_kv_heads=8, head_dim=64,
                       mlp_dim=2048, vocab_size=32_000, seq=512, batch=4, device='cpu'),
    # Mixtral-style MoE small enough for a CPU: 8 experts, top-2.
    'moe-small': dict(d_model=256, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=64,
                      mlp_dim=512, vocab_size=32_000, seq=256, batch=4, num_experts=8,
                      num_experts_per_tok=2, device='cpu'),
    # Llama 3 style ~1B for one GPU.
    'gpu-1b': dict(d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                   mlp_dim=8192, vocab_size=128_256, seq=2048, batch=8, rope_theta=500_000.0,
                   device='gpu'),
    # Llama 3.1 8B at seq 4096. With float32 weights and AdamW its 8.0 B parameters need 128 GB
    # before activations: FSDP over 2+ 80 GB GPUs.
    'gpu-8b': dict(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                   mlp_dim=14_336, vocab_size=128_256, seq=4096, batch=2, rope_theta=500_000.0,
                   device='gpu'),
    # A larger MoE: 16 layers, 64 experts top-8 (Qwen3-MoE-like, 5.6 B parameters). With float32
    # weights and AdamW it needs 90 GB before activations (measured on an H100: 100.7 GiB with
    # full remat), so FSDP over 2+ 80 GB GPUs; with bf16 weights and moments, full remat and
    # scanned layers it trained on one H100 in 57.3 GiB (--param-dtype bfloat16 --remat full).
    'gpu-moe': dict(d_model=2048, num_layers=16, num_heads=32, num_kv_heads=4, head_dim=64,
                    mlp_dim=768, vocab_size=151_936, seq=2048, batch=8, num_experts=64,
                    num_experts_per_tok=8, rope_theta=1_000_000.0, device='gpu'),
}


def get_config(name: str) -> dict:
  """The config ``name`` (a copy), with a clear error listing the known names."""
  if name not in BENCH_CONFIGS:
    raise KeyError(f'unknown benchmark config {name!r}; known: {", ".join(BENCH_CONFIGS)}')
  cfg = dict(BENCH_CONFIGS[name])
  cfg.setdefault('rope_theta', 10_000.0)
  cfg.setdefault('num_experts', 0)
  cfg.setdefault('num_experts_per_tok', 0)
  return cfg


def train_flops_per_token(cfg: dict) -> float:
  """Training FLOPs per token (forward + backward = 3x forward), MaxText's way: matmul weights
  (only the active experts for MoE), plus causal attention scores and values halved."""
  d, f, v, s = cfg['d_model'], cfg['mlp_dim'], cfg['vocab_size'], cfg['seq']
  q_dim = cfg['num_heads'] * cfg['head_dim']
  kv_dim = cfg['num_kv_heads'] * cfg['head_dim']
  attn_proj = d * (2 * q_dim + 2 * kv_dim)
  experts = cfg['num_experts_per_tok'] if cfg['num_experts'] else 1
  mlp = 3 * d * f * experts + (d * cfg['num_experts'] if cfg['num_experts'] else 0)
  per_layer_weights = attn_proj + mlp
  attention = 2 * s * q_dim / 2  # QK^T and PV, causal half, per token (multiply-adds)
  forward = 2 * (cfg['num_layers'] * (per_layer_weights + attention) + d * v)
  return 3.0 * forward

"""Phi-3: Llama with fused qkv and gate/up projections, LongRoPE and partial rotary."""

import numpy as np

from maxnnx.config import AttentionConfig, ModelConfig, RopeConfig
from maxnnx.models.hf import Family, HFConfig, TensorDict, common_to_hf
from maxnnx.models.registry import FamilySpec


def config_from_hf(hf: HFConfig) -> ModelConfig:
  return ModelConfig(family='phi3', **hf.common_fields(),
                     attention=AttentionConfig(sliding_window=hf.get('sliding_window')))


def config_to_hf(cfg: ModelConfig) -> dict:
  out = common_to_hf(cfg, 'phi3', 'Phi3ForCausalLM')
  out['sliding_window'] = cfg.attention.sliding_window
  if cfg.rope.original_max_position_embeddings is not None:
    out['original_max_position_embeddings'] = cfg.rope.original_max_position_embeddings
  return out


def fused_modules(cfg: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
  """``qkv_proj`` holds the rows of q, k, v; ``gate_up_proj`` those of gate, up."""
  hd = cfg.resolved_head_dim
  q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
  return {'self_attn.qkv_proj': (('self_attn.q_proj', q), ('self_attn.k_proj', kv),
                                 ('self_attn.v_proj', kv)),
          'mlp.gate_up_proj': (('mlp.gate_proj', cfg.mlp_dim), ('mlp.up_proj', cfg.mlp_dim))}


def unfuse(tensors: TensorDict, cfg: ModelConfig) -> TensorDict:
  """Split ``qkv_proj`` (rows q, k, v) and ``gate_up_proj`` (rows gate, up)."""
  out = dict(tensors)
  for i in range(cfg.num_layers):
    for fused, parts in fused_modules(cfg).items():
      name = f'model.layers.{i}.{fused}.weight'
      if name in out:
        source, array = out.pop(name)
        cuts = np.cumsum([rows for _, rows in parts])[:-1]
        for (part, _), piece in zip(parts, np.split(array, cuts, axis=0)):
          out[f'model.layers.{i}.{part}.weight'] = (source, piece)
  return out


def fuse(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Inverse of :func:`unfuse`, for export (of the layers present: a process of a
  multi-process save holds some)."""
  out = dict(tensors)
  for i in range(cfg.num_layers):
    for fused, parts in fused_modules(cfg).items():
      if f'model.layers.{i}.{parts[0][0]}.weight' not in out:
        continue
      pieces = [out.pop(f'model.layers.{i}.{part}.weight') for part, _ in parts]
      out[f'model.layers.{i}.{fused}.weight'] = np.concatenate(pieces, axis=0)
  return out


def phi3_mini() -> ModelConfig:
  """Phi-3-mini (3.8B, 3.82B parameters), the 4k-context model (Phi-3-mini-4k-instruct).

  Its ``config.json`` sets a 2047-token sliding window on every layer; the
  128k variant differs only in LongRoPE scaling and ``max_position_embeddings``.
  """
  return SPEC.config(vocab_size=32_064, d_model=3072, num_layers=32, num_heads=32,
                     num_kv_heads=32, mlp_dim=8192, max_position_embeddings=4096, norm_eps=1e-5,
                     attention={'sliding_window': 2047}, rope=RopeConfig(theta=10_000.0))


SPEC = FamilySpec(
    name='phi3',
    description='Llama whose checkpoints fuse the qkv and gate/up projections; LongRoPE and '
                'partial rotary come from its config.json.',
    hf=Family('phi3', ('phi3',), 'Phi3ForCausalLM', config_from_hf, config_to_hf,
              defaults={'rms_norm_eps': 1e-5, 'max_position_embeddings': 4096},
              unfuse=unfuse, fuse=fuse, fused_modules=fused_modules),
    differences={},
    presets={'phi3-mini': phi3_mini})

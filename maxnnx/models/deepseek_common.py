"""What DeepSeek V2 and V3 share: multi-head latent attention, its Hugging Face keys,
the routed-expert keys, and the YaRN rotary embedding of their presets.

Both store ``rope_interleave`` rotary pairs (V2's complex-number form rotates adjacent
dimensions), keep their first ``first_k_dense_replace`` layers dense and add
``n_shared_experts`` always-on experts to the routed ones.
"""

from maxnnx.config import AttentionConfig, MLAConfig, ModelConfig, MoEConfig, RopeConfig
from maxnnx.models.hf import HFConfig, PretrainedError
from maxnnx.models.moe_hf import expert_hooks

# What both versions change in Llama: latent attention with interleaved rotary pairs.
DIFFERENCES = {'attention': {'type': 'mla'}, 'rope_interleave': True}

MLA_KEYS = ('q_lora_rank', 'kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim')
MLA_DEFAULTS = {'q_lora_rank': 1536, 'kv_lora_rank': 512, 'qk_nope_head_dim': 128,
                'qk_rope_head_dim': 64, 'v_head_dim': 128}

unfuse, fuse = expert_hooks('mlp')


def mla_fields(hf: HFConfig) -> dict:
  """The multi-head latent attention fields shared by DeepSeek V2 and V3."""
  bias = bool(hf.get('attention_bias', False))
  fields = {k: hf.get(k) for k in MLA_KEYS}
  # null means full-rank queries (V2-Lite), not "use the default".
  fields['q_lora_rank'] = hf.data.get('q_lora_rank', hf.defaults.get('q_lora_rank'))
  for key in MLA_KEYS[1:]:
    if fields[key] is None:
      raise PretrainedError(f"{hf.path}: required key '{key}' is missing.")
  return dict(attention=AttentionConfig(type='mla', qkv_bias=bias, out_bias=bias),
              rope_interleave=bool(hf.get('rope_interleave', True)), mla=MLAConfig(**fields))


def mla_to_hf(cfg: ModelConfig) -> dict:
  if cfg.attention.qkv_bias != cfg.attention.out_bias:
    raise PretrainedError('DeepSeek has one attention_bias; this config sets '
                          f'attention.qkv_bias={cfg.attention.qkv_bias} and '
                          f'attention.out_bias={cfg.attention.out_bias}.')
  return {**{k: getattr(cfg.mla, k) for k in MLA_KEYS},
          'attention_bias': cfg.attention.qkv_bias,
          'rope_interleave': cfg.rope_interleave, 'head_dim': cfg.mla.qk_rope_head_dim,
          'qk_head_dim': cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim}


def common_fields(hf: HFConfig) -> dict:
  """The fields every decoder config spells the same way, less ``head_dim``: MLA widths
  come from the ``qk_*``/``v_head_dim`` keys."""
  return {**hf.common_fields(), 'head_dim': None}


def expert_fields(hf: HFConfig) -> dict:
  """The :class:`MoEConfig` fields both versions read with the same keys."""
  return dict(num_experts=hf.require('n_routed_experts'),
              num_experts_per_tok=hf.require('num_experts_per_tok'),
              mlp_dim=hf.require('moe_intermediate_size'),
              num_shared_experts=hf.get('n_shared_experts', 0),
              first_k_dense_layers=hf.get('first_k_dense_replace', 0),
              router_scaling_factor=float(hf.get('routed_scaling_factor', 1.0)))


def experts_to_hf(moe: MoEConfig, cfg: ModelConfig) -> dict:
  """Inverse of :func:`expert_fields`."""
  return {'n_routed_experts': moe.num_experts, 'num_experts_per_tok': moe.num_experts_per_tok,
          'moe_intermediate_size': cfg.resolved_moe_mlp_dim,
          'n_shared_experts': moe.num_shared_experts,
          'first_k_dense_replace': moe.first_k_dense_layers,
          'routed_scaling_factor': moe.router_scaling_factor}


def yarn(theta: float, factor: float, mscale: float) -> RopeConfig:
  """The YaRN rotary embedding of the DeepSeek releases (4k pre-training context)."""
  return RopeConfig(theta=theta, scaling='yarn', factor=factor,
                    original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                    mscale=mscale, mscale_all_dim=mscale)

"""DeepSeek V3 (and Kimi K2): multi-head latent attention, dense first layers, then
sigmoid-scored, group-limited routed experts with a balancing bias plus shared experts.

Routing: ``sigmoid`` scores; the ``e_score_correction_bias`` shifts the scores
used to pick the ``topk_group`` best of ``n_group`` expert groups (a group's
score is the sum of its best two) and the top-k experts within them; weights
are the unbiased scores, renormalised (``norm_topk_prob``) and multiplied by
``routed_scaling_factor``. Multi-token-prediction layers of Hub checkpoints
(``num_nextn_predict_layers`` of them, stored as ``model.layers.{num_hidden_layers + k}…``)
become ``mtp.num_layers`` :class:`~maxnnx.layers.mtp.MTPLayer` modules.

DeepSeek-V3 has one multi-token-prediction module (``mtp.num_layers=1``, as its
checkpoints ship). The published 671B excludes it; ``maxnnx.num_params`` counts it
(about 11.7B more: a MoE block plus ``eh_proj`` and norms); the Hub's 685B also
counts the MTP layer's stored copies of the embedding and output head (2 x 0.93B).
"""

from maxnnx.config import ModelConfig, MoEConfig, MTPConfig
from maxnnx.models import deepseek_common
from maxnnx.models.hf import Family, HFConfig, PretrainedError, common_to_hf
from maxnnx.models.registry import FamilySpec

# -- Hugging Face mapping ----------------------------------------------------------------------


def config_from_hf(hf: HFConfig) -> ModelConfig:
  moe = MoEConfig(**deepseek_common.expert_fields(hf), router_score='sigmoid',
                  router_score_bias=True,
                  router_norm_topk=bool(hf.get('norm_topk_prob')),
                  router_groups=hf.get('n_group', 1), router_topk_groups=hf.get('topk_group', 1),
                  router_group_score='top2_sum')
  return ModelConfig(family='deepseek_v3', **deepseek_common.common_fields(hf),
                     **deepseek_common.mla_fields(hf), moe=moe,
                     mtp=MTPConfig(num_layers=hf.get('num_nextn_predict_layers', 0)))


def config_to_hf(cfg: ModelConfig) -> dict:
  moe = cfg.moe
  if cfg.attention.type != 'mla' or moe.router_score != 'sigmoid' or moe.layer_step != 1:
    raise PretrainedError('deepseek_v3 export needs attention.type="mla", sigmoid routing and '
                          'moe.layer_step=1.')
  out = common_to_hf(cfg, 'deepseek_v3', 'DeepseekV3ForCausalLM')
  return {**out, **deepseek_common.mla_to_hf(cfg), **deepseek_common.experts_to_hf(moe, cfg),
          'norm_topk_prob': moe.router_norm_topk, 'n_group': moe.router_groups,
          'topk_group': moe.router_topk_groups, 'num_nextn_predict_layers': cfg.mtp.num_layers}


# -- Presets -----------------------------------------------------------------------------------


def deepseek_v3() -> ModelConfig:
  """DeepSeek-V3 / R1: 671B parameters, 37B active (256 experts, top-8, sigmoid routing),
  plus one multi-token-prediction module."""
  return SPEC.config(vocab_size=129_280, d_model=7168, num_layers=61, num_heads=128,
                     num_kv_heads=128, mlp_dim=18_432, max_position_embeddings=163_840,
                     rope=deepseek_common.yarn(10_000.0, 40.0, 1.0), mtp={'num_layers': 1},
                     mla={'q_lora_rank': 1536},
                     moe={'num_experts': 256, 'mlp_dim': 2048, 'first_k_dense_layers': 3,
                          'router_scaling_factor': 2.5, 'router_groups': 8,
                          'router_topk_groups': 4})


def kimi_k2() -> ModelConfig:
  """Kimi K2: the DeepSeek V3 architecture with 384 experts and 64 heads; 1.04T parameters,
  32B active."""
  return SPEC.config(vocab_size=163_840, d_model=7168, num_layers=61, num_heads=64,
                     num_kv_heads=64, mlp_dim=18_432, max_position_embeddings=131_072,
                     rope=deepseek_common.yarn(50_000.0, 32.0, 1.0), mla={'q_lora_rank': 1536},
                     moe={'num_experts': 384, 'mlp_dim': 2048, 'first_k_dense_layers': 1,
                          'router_scaling_factor': 2.827})


def _maxtext_test(d_model: int, num_heads: int, mlp_dim: int, expert_dim: int, experts: int,
                  q_lora_rank: int, kv_lora_rank: int) -> ModelConfig:
  """One of MaxText's DeepSeek V3 test configs: V3's 61 layers and rope, other widths."""
  return SPEC.config(vocab_size=129_280, d_model=d_model, num_layers=61, num_heads=num_heads,
                     num_kv_heads=num_heads, mlp_dim=mlp_dim, max_position_embeddings=163_840,
                     rope=deepseek_common.yarn(10_000.0, 40.0, 1.0),
                     mla={'q_lora_rank': q_lora_rank, 'kv_lora_rank': kv_lora_rank},
                     moe={'num_experts': experts, 'mlp_dim': expert_dim,
                          'first_k_dense_layers': 3, 'router_scaling_factor': 2.5})


def deepseek3_test() -> ModelConfig:
  """MaxText's ``deepseek3-test``: DeepSeek V3 with a 512-wide residual stream and 512-wide
  experts (a test config, not a published model; no multi-token prediction)."""
  return _maxtext_test(512, 128, 18_432, 512, 256, 1536, 512)


def deepseek3_tiny() -> ModelConfig:
  """MaxText's ``deepseek3-tiny``: DeepSeek V3's 61 layers at width 64, 4 heads, 16
  experts (a test config, not a published model)."""
  return _maxtext_test(64, 4, 64, 64, 16, 32, 16)


SPEC = FamilySpec(
    name='deepseek_v3',
    description='Llama with multi-head latent attention, dense first layers, then sigmoid-scored '
                'group-limited routed experts with a balancing bias plus a shared expert, and '
                'multi-token prediction.',
    hf=Family('deepseek_v3', ('deepseek_v3', 'kimi_k2'), 'DeepseekV3ForCausalLM',
              config_from_hf, config_to_hf,
              defaults={'rms_norm_eps': 1e-6, 'max_position_embeddings': 4096,
                        'n_routed_experts': 256, 'num_experts_per_tok': 8,
                        'moe_intermediate_size': 2048, 'n_shared_experts': 1,
                        'first_k_dense_replace': 3, 'norm_topk_prob': True,
                        'routed_scaling_factor': 2.5, 'n_group': 8, 'topk_group': 4,
                        **deepseek_common.MLA_DEFAULTS},
              module_names={'router': 'gate'}, unfuse=deepseek_common.unfuse,
              fuse=deepseek_common.fuse, mtp=True),
    differences={**deepseek_common.DIFFERENCES,
                 'moe': {'num_experts_per_tok': 8, 'num_shared_experts': 1,
                         'router_score': 'sigmoid', 'router_score_bias': True,
                         'router_group_score': 'top2_sum'}},
    presets={'deepseek-v3': deepseek_v3, 'kimi-k2': kimi_k2, 'deepseek3-test': deepseek3_test,
             'deepseek3-tiny': deepseek3_tiny})

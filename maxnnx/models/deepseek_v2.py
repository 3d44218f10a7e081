"""DeepSeek V2 and V2-Lite: multi-head latent attention, a dense first layer, then
softmax-scored routed experts plus two shared experts.

Routing: ``topk_method`` ``greedy`` (plain top-k) or ``group_limited_greedy`` (the
``topk_group`` best of ``n_group`` groups, a group's score being its best expert's);
the top-k weights are never renormalised (transformers ignores ``norm_topk_prob``),
only multiplied by ``routed_scaling_factor``.
"""

from maxnnx.config import ModelConfig, MoEConfig
from maxnnx.models import deepseek_common
from maxnnx.models.hf import Family, HFConfig, PretrainedError, common_to_hf
from maxnnx.models.registry import FamilySpec

# -- Hugging Face mapping ----------------------------------------------------------------------


def config_from_hf(hf: HFConfig) -> ModelConfig:
  method = hf.get('topk_method', 'greedy')
  if method not in ('greedy', 'group_limited_greedy'):
    raise PretrainedError(f"{hf.path}: topk_method '{method}' is not supported "
                          "(supported: greedy, group_limited_greedy).")
  groups = dict(router_groups=hf.require('n_group'), router_topk_groups=hf.require('topk_group'),
                router_group_score='max') if method == 'group_limited_greedy' else {}
  moe = MoEConfig(**deepseek_common.expert_fields(hf), router_norm_topk=False, **groups)
  return ModelConfig(family='deepseek_v2', **deepseek_common.common_fields(hf),
                     **{**deepseek_common.mla_fields(hf), 'rope_interleave': True}, moe=moe)


def config_to_hf(cfg: ModelConfig) -> dict:
  moe = cfg.moe
  if (cfg.attention.type != 'mla' or moe.router_score != 'softmax' or moe.router_norm_topk
      or not cfg.rope_interleave or moe.layer_step != 1):
    raise PretrainedError('deepseek_v2 export needs attention.type="mla", softmax routing '
                          'without renormalisation, rope_interleave and moe.layer_step=1.')
  grouped = moe.router_groups > 1
  out = {**common_to_hf(cfg, 'deepseek_v2', 'DeepseekV2ForCausalLM'),
         **deepseek_common.mla_to_hf(cfg)}
  out.pop('rope_interleave')
  return {**out, **deepseek_common.experts_to_hf(moe, cfg),
          'topk_method': 'group_limited_greedy' if grouped else 'greedy',
          'n_group': moe.router_groups if grouped else None,
          'topk_group': moe.router_topk_groups if grouped else None,
          'aux_loss_alpha': 0.001}  # a training setting (TrainConfig): transformers' default


# -- Presets -----------------------------------------------------------------------------------


def deepseek_v2_lite() -> ModelConfig:
  """DeepSeek-V2-Lite: 15.7B parameters, 2.4B active (64 experts, top-6, full-rank queries)."""
  return SPEC.config(vocab_size=102_400, d_model=2048, num_layers=27, num_heads=16,
                     num_kv_heads=16, mlp_dim=10_944, max_position_embeddings=163_840,
                     rope=deepseek_common.yarn(10_000.0, 40.0, 0.707),
                     moe={'num_experts': 64, 'mlp_dim': 1408})


def deepseek_v2() -> ModelConfig:
  """DeepSeek-V2: 236B parameters, 21B active (160 experts, top-6 of the best 3 of 8 groups)."""
  return SPEC.config(vocab_size=102_400, d_model=5120, num_layers=60, num_heads=128,
                     num_kv_heads=128, mlp_dim=12_288, max_position_embeddings=163_840,
                     rope=deepseek_common.yarn(10_000.0, 40.0, 0.707), mla={'q_lora_rank': 1536},
                     moe={'num_experts': 160, 'mlp_dim': 1536, 'router_scaling_factor': 16.0,
                          'router_groups': 8, 'router_topk_groups': 3})


SPEC = FamilySpec(
    name='deepseek_v2',
    description='Llama with multi-head latent attention, a dense first layer, then softmax '
                'top-6 routed experts (not renormalised) plus two shared experts.',
    hf=Family('deepseek_v2', ('deepseek_v2',), 'DeepseekV2ForCausalLM', config_from_hf,
              config_to_hf,
              defaults={'rms_norm_eps': 1e-6, 'max_position_embeddings': 2048,
                        'n_shared_experts': 2, **deepseek_common.MLA_DEFAULTS},
              module_names={'router': 'gate'}, unfuse=deepseek_common.unfuse,
              fuse=deepseek_common.fuse),
    differences={**deepseek_common.DIFFERENCES,
                 'moe': {'num_experts_per_tok': 6, 'num_shared_experts': 2,
                         'first_k_dense_layers': 1, 'router_norm_topk': False}},
    presets={'deepseek-v2-lite': deepseek_v2_lite, 'deepseek-v2': deepseek_v2})

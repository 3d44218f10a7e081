"""DeepSeek V3 (and Kimi K2): multi-head latent attention, dense first layers, then
sigmoid-scored, group-limited routed experts with a balancing bias plus shared experts.

Routing: ``sigmoid`` scores; the ``e_score_correction_bias`` shifts the scores
used to pick the ``topk_group`` best of ``n_group`` expert groups (a group's
score is the sum of its best two) and the top-k experts within them; weights
are the unbiased scores, renormalised (``norm_topk_prob``) and multiplied by
``routed_scaling_factor``. Multi-token-prediction layers of Hub checkpoints
(``num_nextn_predict_layers`` of them, stored as ``model.layers.{num_hidden_layers + k}…``)
become ``mtp.num_layers`` :class:`~maxnnx.layers.mtp.MTPLayer` modules.
"""

from maxnnx.config import MLAConfig, ModelConfig, MoEConfig, MTPConfig
from maxnnx.models.hf import Family, HFConfig, PretrainedError, common_to_hf
from maxnnx.models.moe_hf import expert_hooks

_MLA_KEYS = ('q_lora_rank', 'kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim')


def mla_fields(hf: HFConfig) -> dict:
  """The multi-head latent attention fields shared by DeepSeek V2 and V3."""
  bias = bool(hf.get('attention_bias', False))
  fields = {k: hf.get(k) for k in _MLA_KEYS}
  # null means full-rank queries (V2-Lite), not "use the default".
  fields['q_lora_rank'] = hf.data.get('q_lora_rank', hf.defaults.get('q_lora_rank'))
  for key in _MLA_KEYS[1:]:
    if fields[key] is None:
      raise PretrainedError(f"{hf.path}: required key '{key}' is missing.")
  return dict(attention_type='mla', qkv_bias=bias, out_bias=bias,
              rope_interleave=bool(hf.get('rope_interleave', True)), mla=MLAConfig(**fields))


def mla_to_hf(cfg: ModelConfig) -> dict:
  if cfg.qkv_bias != cfg.out_bias:
    raise PretrainedError('DeepSeek has one attention_bias; this config sets '
                          f'qkv_bias={cfg.qkv_bias} and out_bias={cfg.out_bias}.')
  return {**{k: getattr(cfg.mla, k) for k in _MLA_KEYS}, 'attention_bias': cfg.qkv_bias,
          'rope_interleave': cfg.rope_interleave, 'head_dim': cfg.mla.qk_rope_head_dim,
          'qk_head_dim': cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim}


def config_from_hf(hf: HFConfig) -> ModelConfig:
  common = hf.common_fields()
  common['head_dim'] = None  # MLA widths come from the qk_*/v_head_dim keys
  moe = MoEConfig(num_experts=hf.require('n_routed_experts'),
                  num_experts_per_tok=hf.require('num_experts_per_tok'),
                  mlp_dim=hf.require('moe_intermediate_size'),
                  num_shared_experts=hf.get('n_shared_experts', 0),
                  first_k_dense_layers=hf.get('first_k_dense_replace', 0),
                  router_score='sigmoid', router_score_bias=True,
                  router_norm_topk=bool(hf.get('norm_topk_prob')),
                  router_scaling_factor=float(hf.get('routed_scaling_factor', 1.0)),
                  router_groups=hf.get('n_group', 1), router_topk_groups=hf.get('topk_group', 1),
                  router_group_score='top2_sum')
  return ModelConfig(family='deepseek_v3', **common, **mla_fields(hf), moe=moe,
                     mtp=MTPConfig(num_layers=hf.get('num_nextn_predict_layers', 0)))


def config_to_hf(cfg: ModelConfig) -> dict:
  moe = cfg.moe
  if cfg.attention_type != 'mla' or moe.router_score != 'sigmoid' or moe.layer_step != 1:
    raise PretrainedError('deepseek_v3 export needs attention_type="mla", sigmoid routing and '
                          'moe.layer_step=1.')
  out = common_to_hf(cfg, 'deepseek_v3', 'DeepseekV3ForCausalLM')
  return {**out, **mla_to_hf(cfg), 'n_routed_experts': cfg.moe.num_experts,
          'num_experts_per_tok': cfg.moe.num_experts_per_tok,
          'moe_intermediate_size': cfg.resolved_moe_mlp_dim,
          'n_shared_experts': cfg.moe.num_shared_experts,
          'first_k_dense_replace': cfg.moe.first_k_dense_layers,
          'norm_topk_prob': cfg.moe.router_norm_topk,
          'routed_scaling_factor': moe.router_scaling_factor, 'n_group': moe.router_groups,
          'topk_group': moe.router_topk_groups, 'num_nextn_predict_layers': cfg.mtp.num_layers}


unfuse, fuse = expert_hooks('mlp')

FAMILY = Family('deepseek_v3', ('deepseek_v3', 'kimi_k2'), 'DeepseekV3ForCausalLM',
                config_from_hf, config_to_hf,
                defaults={'rms_norm_eps': 1e-6, 'max_position_embeddings': 4096,
                          'n_routed_experts': 256, 'num_experts_per_tok': 8,
                          'moe_intermediate_size': 2048, 'n_shared_experts': 1,
                          'first_k_dense_replace': 3, 'norm_topk_prob': True,
                          'routed_scaling_factor': 2.5, 'n_group': 8, 'topk_group': 4,
                          'q_lora_rank': 1536, 'kv_lora_rank': 512, 'qk_nope_head_dim': 128,
                          'qk_rope_head_dim': 64, 'v_head_dim': 128},
                module_names={'router': 'gate'}, unfuse=unfuse, fuse=fuse, mtp=True)


# -- DeepSeek V2 / V2-Lite ---------------------------------------------------------------------
# Softmax scores; ``topk_method`` ``greedy`` (plain top-k) or ``group_limited_greedy``
# (a group's score is its best expert's); the top-k weights are never renormalised
# (transformers ignores ``norm_topk_prob``), only multiplied by ``routed_scaling_factor``.
# The complex-number rotary form of V2 rotates adjacent pairs, i.e. ``rope_interleave``.


def v2_config_from_hf(hf: HFConfig) -> ModelConfig:
  common = hf.common_fields()
  common['head_dim'] = None
  method = hf.get('topk_method', 'greedy')
  if method not in ('greedy', 'group_limited_greedy'):
    raise PretrainedError(f"{hf.path}: topk_method '{method}' is not supported "
                          "(supported: greedy, group_limited_greedy).")
  groups = dict(router_groups=hf.require('n_group'), router_topk_groups=hf.require('topk_group'),
                router_group_score='max') if method == 'group_limited_greedy' else {}
  moe = MoEConfig(num_experts=hf.require('n_routed_experts'),
                  num_experts_per_tok=hf.require('num_experts_per_tok'),
                  mlp_dim=hf.require('moe_intermediate_size'),
                  num_shared_experts=hf.get('n_shared_experts', 0),
                  first_k_dense_layers=hf.get('first_k_dense_replace', 0),
                  router_norm_topk=False,
                  router_scaling_factor=float(hf.get('routed_scaling_factor', 1.0)), **groups)
  return ModelConfig(family='deepseek_v2', **common, **{**mla_fields(hf), 'rope_interleave': True},
                     moe=moe)


def v2_config_to_hf(cfg: ModelConfig) -> dict:
  moe = cfg.moe
  if (cfg.attention_type != 'mla' or moe.router_score != 'softmax' or moe.router_norm_topk
      or not cfg.rope_interleave or moe.layer_step != 1):
    raise PretrainedError('deepseek_v2 export needs attention_type="mla", softmax routing '
                          'without renormalisation, rope_interleave and moe.layer_step=1.')
  grouped = cfg.moe.router_groups > 1
  out = {**common_to_hf(cfg, 'deepseek_v2', 'DeepseekV2ForCausalLM'), **mla_to_hf(cfg)}
  out.pop('rope_interleave')
  return {**out, 'n_routed_experts': cfg.moe.num_experts,
          'num_experts_per_tok': cfg.moe.num_experts_per_tok,
          'moe_intermediate_size': cfg.resolved_moe_mlp_dim,
          'n_shared_experts': cfg.moe.num_shared_experts,
          'first_k_dense_replace': cfg.moe.first_k_dense_layers,
          'routed_scaling_factor': cfg.moe.router_scaling_factor,
          'topk_method': 'group_limited_greedy' if grouped else 'greedy',
          'n_group': cfg.moe.router_groups if grouped else None,
          'topk_group': cfg.moe.router_topk_groups if grouped else None,
          'aux_loss_alpha': 0.001}  # a training setting (TrainConfig): transformers' default


V2_FAMILY = Family('deepseek_v2', ('deepseek_v2',), 'DeepseekV2ForCausalLM', v2_config_from_hf,
                   v2_config_to_hf,
                   defaults={'rms_norm_eps': 1e-6, 'max_position_embeddings': 2048,
                             'n_shared_experts': 2, 'q_lora_rank': 1536, 'kv_lora_rank': 512,
                             'qk_nope_head_dim': 128, 'qk_rope_head_dim': 64,
                             'v_head_dim': 128},
                   module_names={'router': 'gate'}, unfuse=unfuse, fuse=fuse)

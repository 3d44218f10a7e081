"""DeepSeek V3.2: DeepSeek V3 with DeepSeek Sparse Attention (a lightning indexer per layer).

Everything of :mod:`maxnnx.models.deepseek_v3` (latent attention, dense first layers,
sigmoid group-limited experts with a balancing bias and a shared expert), plus, in
every layer, a :class:`~maxnnx.layers.indexer.LightningIndexer` that keeps the
``index_topk`` (2048) best keys of each query (``mla.index_topk``). Under that many
tokens, attention is dense MLA exactly.

Checkpoint layout: ``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`` beside
DeepSeek V3's tensors. transformers' ``layer_types`` (``indexed_attention``) and
``mlp_layer_types`` carry nothing beyond ``first_k_dense_replace``. Multi-token
prediction layers load as DeepSeek V3's do (``num_nextn_predict_layers``), each with
its own indexer.
"""

from maxnnx.config import ModelConfig
from maxnnx.models import deepseek_v3
from maxnnx.models.deepseek_common import fuse, unfuse
from maxnnx.models.hf import Family, HFConfig, PretrainedError
from maxnnx.models.registry import FamilySpec

INDEX_KEYS = {'index_topk': 'index_topk', 'index_n_heads': 'index_num_heads',
              'index_head_dim': 'index_head_dim'}


def config_from_hf(hf: HFConfig) -> ModelConfig:
  data = {k: v for k, v in hf.data.items() if k != 'layer_types'}
  dense = hf.get('mlp_layer_types')
  if dense is not None:  # 'dense' layers then 'sparse' ones
    if dense != sorted(dense, key=lambda kind: kind != 'dense'):
      raise PretrainedError(f'{hf.path}: mlp_layer_types must list the dense layers first.')
    data['first_k_dense_replace'] = dense.count('dense')
  cfg = deepseek_v3.config_from_hf(HFConfig(data, hf.path, hf.defaults))
  index = {ours: hf.get(theirs) for theirs, ours in INDEX_KEYS.items()}
  return cfg.replace(family='deepseek_v32', **{f'mla.{k}': v for k, v in index.items()})


def config_to_hf(cfg: ModelConfig) -> dict:
  if cfg.mla.index_topk is None:
    raise PretrainedError('A deepseek_v32 model needs mla.index_topk (the sparse attention).')
  out = deepseek_v3.config_to_hf(cfg)
  out.update(model_type='deepseek_v32', architectures=['DeepseekV32ForCausalLM'],
             **{theirs: getattr(cfg.mla, ours) for theirs, ours in INDEX_KEYS.items()})
  return out


# -- Presets -----------------------------------------------------------------------------------


def deepseek_v3_2() -> ModelConfig:
  """DeepSeek-V3.2: 671B parameters, 37B active (DeepSeek V3's shapes) and a 64-head
  lightning indexer per layer choosing 2048 keys per query; one multi-token-prediction
  module, as DeepSeek-V3."""
  return deepseek_v3.deepseek_v3().replace(family='deepseek_v32',
                                           **{'mla.index_topk': 2048})


SPEC = FamilySpec(
    name='deepseek_v32',
    description='DeepSeek V3 with sparse attention: a lightning indexer per layer keeps the '
                '2048 best keys of each query.',
    hf=Family('deepseek_v32', ('deepseek_v32',), 'DeepseekV32ForCausalLM', config_from_hf,
              config_to_hf,
              defaults={**deepseek_v3.SPEC.hf.defaults, 'index_topk': 2048,
                        'index_n_heads': 64, 'index_head_dim': 128},
              module_names={'router': 'gate'}, unfuse=unfuse, fuse=fuse, mtp=True),
    differences={**deepseek_v3.SPEC.differences,
                 'mla': {'q_lora_rank': 1536, 'index_topk': 2048}},
    presets={'deepseek-v3.2': deepseek_v3_2})

"""GPT-OSS: alternating sliding/full attention with sinks, and top-k routed clamped-SwiGLU experts.

Architecture choices, all expressed as :class:`ModelConfig` fields:

* attention has biases on every projection and one learned sink logit per head
  (``attention.sinks``); even layers use a sliding window, odd layers attend fully;
* rotary embeddings are YaRN (x32 from 4096 positions, ``truncate: false``);
* every layer is a Mixture-of-Experts with a biased router; the softmax over the
  top-k router logits equals a softmax over all experts renormalised over the top k;
* experts have biases and a clamped SwiGLU, ``(up + 1) * gate * sigmoid(1.702 gate)``
  with ``gate <= limit`` and ``|up| <= limit``.

Checkpoint layout (transformers keeps it in memory as the Hub stores it): per
layer, ``mlp.experts.gate_up_proj`` ``[experts, hidden, 2 * intermediate]`` with
gate and up *interleaved* on the last axis (gate = ``[..., ::2]``), its bias
``gate_up_proj_bias`` ``[experts, 2 * intermediate]``, ``down_proj``
``[experts, intermediate, hidden]`` (in x out, unlike a ``Linear``),
``down_proj_bias`` ``[experts, hidden]``, ``mlp.router.{weight,bias}`` and
``self_attn.sinks`` ``[heads]``. OpenAI's MXFP4 releases (``*_blocks``/``*_scales``
experts) are dequantized as they load (:mod:`maxnnx.checkpoint.quantized`).
"""

import numpy as np

from maxnnx.config import AttentionConfig, ModelConfig, MoEConfig
from maxnnx.models.hf import (
  Family,
  HFConfig,
  PretrainedError,
  TensorDict,
  common_to_hf,
  layer_types_to_hf,
)
from maxnnx.models.registry import FamilySpec

# The rotary embedding transformers assumes when a config names none.
DEFAULT_ROPE = {'rope_type': 'yarn', 'factor': 32.0, 'beta_fast': 32.0, 'beta_slow': 1.0,
                'truncate': False, 'original_max_position_embeddings': 4096}

def config_from_hf(hf: HFConfig) -> ModelConfig:
  if 'rope_parameters' not in hf.data and 'rope_scaling' not in hf.data:
    hf = HFConfig({**hf.data, 'rope_parameters': {
        **DEFAULT_ROPE, 'rope_theta': hf.get('rope_theta')}}, hf.path, hf.defaults)
  num_layers = hf.require('num_hidden_layers')
  window = hf.data.get('sliding_window', 128)  # an explicit null means no window
  layer_types = hf.layer_types() or tuple('full' if i % 2 else 'sliding'
                                          for i in range(num_layers))
  if window is None:
    layer_types = ('full',) * num_layers
  bias = bool(hf.get('attention_bias', True))
  return ModelConfig(family='gpt_oss', **hf.common_fields(), layer_types=layer_types,
                     attention=AttentionConfig(qkv_bias=bias, out_bias=bias, sinks=True,
                                               sliding_window=window),
                     moe=MoEConfig(
                         num_experts=hf.get('num_local_experts') or hf.require('num_experts'),
                         num_experts_per_tok=hf.get('num_experts_per_tok')
                         or hf.get('experts_per_token', 4),
                         router_score='softmax', router_norm_topk=True, router_bias=True,
                         expert_bias=True, swiglu_limit=float(hf.get('swiglu_limit', 7.0)),
                         swiglu_alpha=float(hf.get('swiglu_alpha', 1.702))))


def config_to_hf(cfg: ModelConfig) -> dict:
  return {**common_to_hf(cfg, 'gpt_oss', 'GptOssForCausalLM'),
          'intermediate_size': cfg.resolved_moe_mlp_dim,
          'layer_types': layer_types_to_hf(cfg), 'sliding_window': cfg.attention.sliding_window,
          'attention_bias': cfg.attention.qkv_bias, 'num_local_experts': cfg.moe.num_experts,
          'num_experts_per_tok': cfg.moe.num_experts_per_tok,
          'swiglu_limit': cfg.moe.swiglu_limit, 'swiglu_alpha': cfg.moe.swiglu_alpha,
          'router_aux_loss_coef': 0.9}  # a training setting (TrainConfig): HF's default


def _check_convertible(cfg: ModelConfig) -> None:
  """What the fused HF layout cannot express."""
  problems = [name for name, ok in (
      ('every layer a MoE layer', all(cfg.moe_layers)),
      ('expert_bias=True', cfg.moe.expert_bias), ('router_bias=True', cfg.moe.router_bias),
      ('attention.sinks=True', cfg.attention.sinks),
      ('attention.qkv_bias == attention.out_bias',
       cfg.attention.qkv_bias == cfg.attention.out_bias)) if not ok]
  if problems:
    raise PretrainedError(f'A gpt_oss model needs {", ".join(problems)}.')


def unfuse(tensors: TensorDict, cfg: ModelConfig) -> TensorDict:
  """Split each layer's interleaved ``gate_up_proj`` (and its bias) into our gate/up tensors."""
  out = dict(tensors)
  e, d, f = cfg.moe.num_experts, cfg.d_model, cfg.resolved_moe_mlp_dim
  expected = {'gate_up_proj': (e, d, 2 * f), 'gate_up_proj_bias': (e, 2 * f),
              'down_proj': (e, f, d)}
  for i in range(cfg.num_layers):
    prefix = f'model.layers.{i}.mlp.experts'
    for name, shape in expected.items():
      key = f'{prefix}.{name}'
      if key in out and out[key][1].shape != shape:
        raise PretrainedError(
            f"{out[key][0]}: tensor '{key}' has shape {out[key][1].shape}, the config implies "
            f'{shape} (transformers layout: experts, in, out). A checkpoint with experts '
            'stored out x in must be converted first.')
    for fused, (gate, up) in (('gate_up_proj', ('gate_proj', 'up_proj')),
                              ('gate_up_proj_bias', ('gate_bias', 'up_bias'))):
      if f'{prefix}.{fused}' in out:  # else the loader reports the split names as missing
        source, array = out.pop(f'{prefix}.{fused}')  # slices stay views (or lazy: MXFP4)
        out[f'{prefix}.{gate}'] = (source, array[..., ::2])
        out[f'{prefix}.{up}'] = (source, array[..., 1::2])
    if f'{prefix}.down_proj_bias' in out:
      out[f'{prefix}.down_bias'] = out.pop(f'{prefix}.down_proj_bias')
  return out


def fuse(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Inverse of :func:`unfuse`: interleave gate/up back into the Hub layout."""
  _check_convertible(cfg)
  out = dict(tensors)
  e, d, f = cfg.moe.num_experts, cfg.d_model, cfg.resolved_moe_mlp_dim
  for i in range(cfg.num_layers):
    prefix = f'model.layers.{i}.mlp.experts'
    for fused, (gate, up), shape in (('gate_up_proj', ('gate_proj', 'up_proj'), (e, d, f)),
                                     ('gate_up_proj_bias', ('gate_bias', 'up_bias'), (e, f))):
      gate_array = out.pop(f'{prefix}.{gate}').reshape(shape)  # written flat by the exporter
      up_array = out.pop(f'{prefix}.{up}').reshape(shape)
      interleaved = np.empty(shape[:-1] + (2 * f,), gate_array.dtype)
      interleaved[..., ::2], interleaved[..., 1::2] = gate_array, up_array
      out[f'{prefix}.{fused}'] = interleaved
    out[f'{prefix}.down_proj'] = out[f'{prefix}.down_proj'].reshape(e, f, d)
    out[f'{prefix}.down_proj_bias'] = out.pop(f'{prefix}.down_bias').reshape(e, d)
  return out



# -- Presets -----------------------------------------------------------------------------------


def _gpt_oss(num_layers: int, num_experts: int) -> ModelConfig:
  return SPEC.config(vocab_size=201_088, d_model=2880, num_layers=num_layers, num_heads=64,
                     num_kv_heads=8, head_dim=64, mlp_dim=2880, max_position_embeddings=131_072,
                     norm_eps=1e-5, layer_types=('sliding', 'full') * (num_layers // 2),
                     moe={'num_experts': num_experts}, eos_token_id=200_002,
                     pad_token_id=199_999)


def gpt_oss_20b() -> ModelConfig:
  """gpt-oss-20b: 20.9B parameters, 3.6B active (32 experts, top-4)."""
  return _gpt_oss(24, 32)


def gpt_oss_120b() -> ModelConfig:
  """gpt-oss-120b: 116.8B parameters, 5.1B active (128 experts, top-4)."""
  return _gpt_oss(36, 128)


SPEC = FamilySpec(
    name='gpt_oss',
    description='Llama with biased attention and sinks, sliding-window layers alternating with '
                'global ones, YaRN rotary, and top-4 routed clamped-SwiGLU experts with biases.',
    hf=Family('gpt_oss', ('gpt_oss',), 'GptOssForCausalLM', config_from_hf, config_to_hf,
              defaults={'rms_norm_eps': 1e-5, 'max_position_embeddings': 131_072,
                        'rope_theta': 150_000.0},
              unfuse=unfuse, fuse=fuse),
    differences={'attention': {'qkv_bias': True, 'out_bias': True, 'sinks': True,
                               'sliding_window': 128},
                 'rope': {'theta': 150_000.0, 'scaling': 'yarn', 'factor': 32.0,
                          'original_max_position_embeddings': 4096, 'truncate': False},
                 'moe': {'num_experts_per_tok': 4, 'router_bias': True, 'expert_bias': True,
                         'swiglu_limit': 7.0}},
    presets={'gpt-oss-20b': gpt_oss_20b, 'gpt-oss-120b': gpt_oss_120b})

"""The table of MaxText's config keys: what each becomes in maxnnx (:data:`MAXTEXT_KEYS`),
MaxText's defaults that shape a run (:data:`MAXTEXT_DEFAULTS`) and the model names it takes.
:mod:`maxnnx.maxtext_keys` reads a MaxText command line or YAML through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from maxnnx.cli_keys import UsageError


class Rule(NamedTuple):
  """What one MaxText key becomes.

  Attributes:
    action: ``map`` (to the maxnnx key ``target``), ``derive`` (read with other keys into
      the settings of :func:`_derived`), ``noop`` (no effect here) or ``refuse``.
    target: the maxnnx key (``map``), or what the derived setting is (``derive``).
    kind: the type MaxText's value is parsed as.
    default: MaxText's default; a ``refuse``\\ d key given at it is accepted.
    to: converts MaxText's value to maxnnx's (``map`` only); ``None``: the same value.
    note: why it is refused or has no effect, or how the value is converted.
  """

  action: str
  target: str
  kind: Any
  default: Any
  to: Callable[[Any], Any] | None = None
  note: str = ''


def _map(target, kind, default, to=None, note=''):
  return Rule('map', target, kind, default, to, note)


def _derive(target, kind, default, note=''):
  return Rule('derive', target, kind, default, None, note)


def _noop(kind, default, note):
  return Rule('noop', '', kind, default, None, note)


def _refuse(kind, default, note):
  return Rule('refuse', '', kind, default, None, note)


def _none_if(sentinel):
  return lambda value: None if value == sentinel else value


def _choice(table: dict, key: str):
  """A converter taking the MaxText values in ``table`` and refusing the others by name."""
  def to(value):
    if value not in table:
      raise UsageError(f'{key}={value!r}: maxnnx has no equivalent (it takes '
                       f"{', '.join(repr(k) for k in table)}).")
    return table[value]
  return to


def activation_name(value):
  """MaxText's ``mlp_activations`` (``["silu", "linear"]``: a gated SiLU MLP) as
  ``(activation, gated)``."""
  acts = [value] if isinstance(value, str) else list(value)
  names = {'silu': 'silu', 'gelu': 'gelu_tanh', 'relu': 'relu'}
  gated = len(acts) == 2 and acts[1] == 'linear'
  if not (len(acts) == 1 or gated) or acts[0] not in names:
    raise UsageError(f'mlp_activations={value!r}: maxnnx takes one of silu, gelu, relu, '
                     'alone or followed by "linear" (a gated MLP).')
  return names[acts[0]], gated


_MESH = {'data': 'data', 'fsdp': 'fsdp', 'tensor': 'tensor', 'expert': 'expert',
         'context': 'context', 'pipeline': 'stage'}
_NO_AXIS = {
    'fsdp_transpose': "maxnnx's mesh has no second FSDP axis (2-D FSDP); use fsdp and tensor",
    'sequence': "MaxText's legacy sequence axis; use ici_context_parallelism (context)",
    'tensor_sequence': 'no tensor-sequence axis; use tensor with mesh.sequence_parallel=true',
    'context_usp_ulysses': 'no Ulysses (head-exchange) context axis; see '
                           'context_parallel_strategy',
    'context_autoregressive': 'no autoregressive context axis (inference only in MaxText)',
    'autoregressive': 'no autoregressive axis (inference only in MaxText)',
    'diloco': 'no DiLoCo training',
}


def _mesh_rules() -> dict[str, Rule]:
  rules = {}
  for prefix, dcn in (('ici_', ''), ('dcn_', 'dcn_')):
    for axis, ours in _MESH.items():
      default = -1 if (prefix, axis) in (('ici_', 'fsdp'), ('dcn_', 'data')) else 1
      rules[f'{prefix}{axis}_parallelism'] = _map(f'mesh.{dcn}{ours}', int, default)
    for axis, why in _NO_AXIS.items():
      rules[f'{prefix}{axis}_parallelism'] = _refuse(int, 1, why)
  return rules


# MaxText's per-tensor remat locations (with remat_policy: custom) -> the tensors maxnnx tags.
REMAT_TENSORS = {
    'query_proj': ('query_proj',), 'key_proj': ('key_proj',), 'value_proj': ('value_proj',),
    'qkv_proj': ('query_proj', 'key_proj', 'value_proj'), 'mla_q': ('query_proj',),
    'mla_kv': ('key_proj', 'value_proj'), 'context': ('attention_out',),
    'attention_out': ('attention_out',), 'out_proj': ('out_proj',), 'mlpwo': ('mlp_out',),
    'moe_mlpwo': ('mlp_out',),
}
REMAT_LOCATIONS = ('remat', 'device', 'offload')
_NO_REMAT_TAG = ("maxnnx tags the MLP's activated hidden state, not its input projections: "
                 'give model.runtime.remat_save= or model.runtime.remat_offload=mlp_hidden')
_REMAT = {name: name for name in ('custom', 'none', 'minimal', 'save_dot_except_mlp',
                                  'save_qkv_proj',
                                  'save_out_proj', 'full')}
_ATTENTION = {'autoselected': 'auto', 'dot_product': 'xla_flash', 'flash': 'auto',
              'cudnn_flash_te': 'cudnn'}
_QUANT = {'': 'none', 'int8': 'int8', 'fp8': 'fp8'}
_TPU = 'a TPU kernel or runtime setting; no effect on this backend'

MAXTEXT_KEYS: dict[str, Rule] = {
    # The run
    'base_config': _noop(str, 'base.yml', 'names the YAML whose defaults this one overrides '
                         '(base.yml: MaxText defaults, see MAXTEXT_DEFAULTS)'),
    'run_name': _derive('output_dir', str, '', 'output_dir = base_output_directory/run_name'),
    'base_output_directory': _derive('output_dir', str, '', 'see run_name; without run_name '
                                     'it is the run directory'),
    'model_name': _derive('model', str, 'default', "a preset (MaxText's names resolve, "
                          "docs/from_maxtext.md); default: MaxText's default model"),
    'override_model_config': _noop(bool, False, 'maxnnx always takes model keys over the preset'),
    'log_config': _noop(bool, True, 'maxnnx prints the run in one line and keeps '
                        'train_options.json'),
    'hardware': _noop(str, 'tpu', 'maxnnx uses the devices JAX finds'),
    'enable_single_controller': _noop(bool, False, _TPU),
    'skip_jax_distributed_system': _noop(bool, False, 'multi-process runs join with '
                                         'coordinator= (docs/multihost.md)'),
    # Batch, sequence, steps
    'per_device_batch_size': _derive('global_batch_size', float, 12.0,
                                     'global_batch_size = per_device_batch_size x all devices'),
    'max_target_length': _map('seq_len', int, 2048),
    'steps': _derive('steps', int, 150_001, '-1: learning_rate_schedule_steps'),
    'gradient_accumulation_steps': _map('grad_accum_steps', int, 1),
    'init_weights_seed': _map('seed', int, 0),
    'data_shuffle_seed': _refuse(int, 0, 'maxnnx draws the data order from seed= (that is '
                                 'init_weights_seed) too'),
    # Optimizer and schedule
    'opt_type': _map('optimizer', str, 'adamw', _choice(
        {'adamw': 'adamw', 'sgd': 'sgd', 'muon': 'muon'}, 'opt_type')),
    'learning_rate': _map('learning_rate', float, 3e-5),
    'lr_schedule_type': _map('schedule', str, 'cosine',
                             _choice({'cosine': 'cosine', 'wsd': 'wsd'}, 'lr_schedule_type')),
    'warmup_steps_fraction': _derive('warmup_steps', float, 0.1,
                                     'warmup_steps = fraction x the schedule length'),
    'learning_rate_schedule_steps': _map('learning_rate_schedule_steps', int, -1,
                                         _none_if(-1), '-1: steps'),
    'learning_rate_final_fraction': _map('final_lr_fraction', float, 0.1),
    'cosine_learning_rate_final_fraction': _map('final_lr_fraction', float, 0.1),
    'wsd_decay_steps_fraction': _map('decay_fraction', float, 0.1),
    'wsd_decay_style': _map('decay_shape', str, 'linear'),
    'adam_b1': _map('b1', float, 0.9),
    'adam_b2': _map('b2', float, 0.95),
    'adam_eps': _map('eps', float, 1e-8),
    'adam_eps_root': _map('adam_eps_root', float, 0.0),
    'adam_weight_decay': _map('weight_decay', float, 0.1),
    'adamw_mask': _map('weight_decay_exclude', tuple[str, ...], ()),
    'mu_dtype': _map('mu_dtype', str, '', _none_if('')),
    'gradient_clipping_threshold': _map('clip_norm', float, 1.0, _none_if(0.0), '0: none'),
    'z_loss_multiplier': _map('z_loss', float, 0.0),
    'load_balance_loss_weight': _map('router_aux_loss_coef', float, 0.0),
    'skip_step_on_spikes': _refuse(bool, False, 'use skip_spike_factor= (a loss over this '
                                   'many times its running mean skips the update)'),
    'quantization': _map('quantization', str, '', _choice(_QUANT, 'quantization')),
    # Numerics and kernels
    'dtype': _map('dtype', str, 'bfloat16'),
    'weight_dtype': _map('model.runtime.param_dtype', str, 'float32'),
    'scan_layers': _map('scan_layers', bool, True),
    'param_scan_axis': _noop(int, 1, "a checkpoint layout detail; maxnnx's scanned layers "
                             'stack on axis 0'),
    'remat_policy': _map('remat_policy', str, 'full', _choice(_REMAT, 'remat_policy')),
    'attention': _map('attention_impl', str, 'autoselected', _choice(_ATTENTION, 'attention'),
                      'flash: auto (the fused kernel for the device)'),
    'megablox': _noop(bool, True,
                      "MaxText's MoE kernel choice; maxnnx: model.runtime.ragged_dot_impl"),
    'sparse_matmul': _noop(bool, True, "MaxText's MoE kernel choice; maxnnx's MoE is "
                           'dropless grouped matmuls (model.moe.dispatch)'),
    'use_ring_of_experts': _refuse(bool, False, 'no ring of experts (token all-gather); '
                                   'mesh.expert_parallel_strategy=all_to_all sends tokens to '
                                   'their experts by all-to-all'),
    'float32_qk_product': _noop(bool, False, 'maxnnx computes attention scores in float32'),
    'float32_logits': _noop(bool, False, 'maxnnx computes the softmax in float32'),
    'logits_dot_in_fp32': _noop(bool, False, 'the fused loss accumulates logits in float32'),
    'matmul_precision': _noop(str, 'default', 'maxnnx uses JAX default matmul precision'),
    'shard_mode': _refuse(str, 'auto', "maxnnx's sharding is automatic (GSPMD) only"),
    'allow_split_physical_axes': _noop(bool, False, _TPU),
    **{key: _derive('model.runtime.remat_save', str, 'remat',
                    f"with remat_policy=custom: device -> model.runtime.remat_save, offload -> "
                    f"model.runtime.remat_offload ({', '.join(tensors)})")
       for key, tensors in REMAT_TENSORS.items()},
    **{key: _refuse(str, 'remat', _NO_REMAT_TAG)
       for key in ('mlpwi', 'mlpwi_0', 'mlpwi_1', 'moe_mlpwi_0', 'moe_mlpwi_1')},
    **{key: _refuse(str, 'remat', 'maxnnx tags no such tensor')
       for key in ('query_wa_proj', 'kv_wa_proj', 'engram')},
    'decoder_layer_input': _refuse(str, 'device', 'the scanned stack keeps each block input on '
                                   'the device'),
    'optimizer_memory_host_offload': _map('optimizer_memory_host_offload', bool, False),
    'shard_optimizer_over_data': _map('shard_optimizer_over_data', bool, False),
    'parameter_memory_host_offload': _map('parameter_memory_host_offload', bool, False),
    'num_pipeline_microbatches': _map('mesh.pipeline_microbatches', int, -1, _none_if(-1)),
    'pipeline_parallel_layers': _refuse(int, -1, 'maxnnx pipelines every layer over stage'),
    'num_pipeline_repeats': _map('mesh.pipeline_repeats', int, -1, lambda v: 1 if v == -1 else v,
                                 '-1: 1 (GPipe); the same numbers, a larger bubble than '
                                 "MaxText's derived repeats"),
    'num_layers_per_pipeline_stage': _refuse(int, 1, 'give num_pipeline_repeats = num_layers / '
                                             '(stages x layers per stage) instead'),
    'num_slices': _noop(int, -1, 'the slices are the dcn_* axes'),
    'context_parallel_strategy': _map('mesh.context_parallel_strategy', str, 'all_gather',
                                      _choice({'all_gather': 'all_gather', 'ring': 'ring'},
                                              'context_parallel_strategy')),
    'context_parallel_load_balance': _map('mesh.context_load_balance', bool, True),
    **_mesh_rules(),
    # The model (over the preset of model_name)
    'base_emb_dim': _map('model.d_model', int, 2048),
    'base_num_query_heads': _map('model.num_heads', int, 16),
    'base_num_kv_heads': _map('model.num_kv_heads', int, 16),
    'base_mlp_dim': _map('model.mlp_dim', int, 7168),
    'base_num_decoder_layers': _map('model.num_layers', int, 16),
    'head_dim': _map('model.head_dim', int, 128),
    'vocab_size': _map('model.vocab_size', int, 32_000),
    'normalization_layer_epsilon': _map('model.norm_eps', float, 1e-5),
    'rope_max_timescale': _map('model.rope.theta', float, 10_000.0),
    'max_position_embeddings': _map('model.max_position_embeddings', int, 163_840),
    'logits_via_embedding': _map('model.tie_word_embeddings', bool, False),
    'mlp_activations': _derive('model.mlp_activation', tuple[str, ...], ('silu', 'linear'),
                               '[act, "linear"]: a gated MLP (model.mlp_gated)'),
    'use_qk_norm': _map('model.attention.qk_norm', bool, False,
                        lambda on: 'head' if on else 'none'),
    'sliding_window_size': _map('model.attention.sliding_window', int, 0, _none_if(0)),
    'attn_logits_soft_cap': _map('model.attention.logit_softcap', float, 0.0, _none_if(0.0)),
    'final_logits_soft_cap': _map('model.final_logit_softcap', float, 0.0, _none_if(0.0)),
    'num_experts': _map('model.moe.num_experts', int, 1, lambda n: 0 if n == 1 else n,
                        '1: a dense model (0 here)'),
    'num_experts_per_tok': _map('model.moe.num_experts_per_tok', int, 1),
    'base_moe_mlp_dim': _map('model.moe.mlp_dim', int, -1, _none_if(-1)),
    'first_num_dense_layers': _map('model.moe.first_k_dense_layers', int, 0),
    'shared_experts': _map('model.moe.num_shared_experts', int, 0),
    'ragged_buffer_factor': _map('model.moe.ragged_buffer_factor', float, -1.0,
                                 lambda f: f if f > 0 else None,
                                 '<= 0: worst-case buffers, nothing dropped; needs '
                                 'mesh.expert_parallel_strategy=all_to_all'),
    'decoder_block': _refuse(str, 'llama2', 'the architecture comes from model_name= (a '
                             'preset), whose block is set with it'),
    'dropout_rate': _map('model.dropout_rate', float, 0.0),
    'enable_dropout': _noop(bool, True, 'dropout runs in the train step whenever '
                            'model.dropout_rate > 0, and never outside it'),
    'trainable_position_size': _refuse(int, -1, 'learned positions come with the gpt3 presets'),
    # Data
    'dataset_type': _derive('data', str, 'tfds', 'synthetic; hf: hf_train_files or hf_path '
                            '(local); grain: grain_train_files; tfds: refused (no TFDS reader)'),
    'dataset_path': _derive('data', str, '', 'a local file or directory of documents'),
    'dataset_name': _noop(str, 'c4/en:3.1.0', 'a TFDS name; tfds is refused'),
    'hf_path': _derive('data', str, '', 'a local dataset directory (no Hub download)'),
    'hf_train_files': _derive('data', str, '', 'local JSONL/Parquet files'),
    'grain_train_files': _derive('data', str, '', 'ArrayRecord/Parquet files (one pattern; '
                                 'weighted mixtures: data.weights)'),
    'grain_file_type': _noop(str, 'arrayrecord', 'maxnnx tells the kind from the files'),
    'grain_worker_count': _map('data.worker_count', int, 1),
    'tokenizer_path': _map('tokenizer', str, ''),
    'tokenizer_type': _noop(str, 'sentencepiece', 'maxnnx tells the kind from the file'),
    'tokenize_train_data': _map('data.pretokenized', bool, True, lambda on: not on),
    'add_bos': _map('data.add_bos', bool, True),
    'add_eos': _map('data.add_eos', bool, True),
    'packing': _map('data.packing', bool, True, lambda on: 'first_fit' if on else 'none'),
    'train_split': _refuse(str, 'train', 'maxnnx trains on the whole source given'),
    'eval_split': _refuse(str, 'validation', "maxnnx holds out a slice of the training source"),
    'reuse_example_batch': _refuse(int, 0, 'use dataset_type=synthetic for throughput tests'),
    'expansion_factor_real_data': _noop(float, -1.0, 'every process reads its own rows'),
    'colocated_python_data_input': _noop(bool, False, _TPU),
    # Checkpoints, logging, evaluation
    'enable_checkpointing': _derive('checkpoint_every', bool, True,
                                    'false: no checkpoints (checkpoint_every=0)'),
    'checkpoint_period': _derive('checkpoint_every', int, 10_000, 'checkpoint_every'),
    'async_checkpointing': _noop(bool, True, 'maxnnx saves asynchronously'),
    'max_num_checkpoints_to_keep': _map('keep_checkpoints', int | None, None,
                                        lambda n: KEEP_ALL if n is None else n,
                                        'None: every checkpoint is kept'),
    'enable_emergency_checkpoint': _map('enable_emergency_checkpoint', bool, False),
    'local_checkpoint_directory': _map('local_checkpoint_directory', str, '',
                                       lambda path: path or None),
    'local_checkpoint_period': _map('local_checkpoint_period', int, 0),
    'load_parameters_path': _derive('model', str, '',
                                    "the run starts from this MaxText step directory's "
                                    'parameters (converted at the start; model_name and the '
                                    "model keys describe it)"),
    'load_full_state_path': _derive('model', str, '',
                                    "the run continues this MaxText step directory's training "
                                    'state: its parameters, adamw moments and step '
                                    '(maxtext_full_state=true; docs/from_maxtext.md)'),
    'log_period': _map('log_every', int, 100),
    'metrics_file': _map('metrics_jsonl', str, ''),
    'enable_tensorboard': _derive('tensorboard_dir', bool, True,
                                  'true: tensorboard_dir = <output_dir>/tensorboard'),
    'gcs_metrics': _noop(bool, False, 'metrics.jsonl goes to output_dir, a gs:// URL too'),
    'save_config_to_gcs': _noop(bool, False, 'train_options.json goes to output_dir'),
    'eval_interval': _map('eval_every', int, -1, lambda n: max(n, 0)),
    'eval_steps': _map('eval_batches', int, -1, lambda n: n if n > 0 else 4, '-1: 4'),
    'jax_cache_dir': _map('compile_cache', str, '~/jax_cache'),
    'enable_goodput_recording': _noop(bool, False, 'maxnnx always reports goodput'),
    'monitor_goodput': _noop(bool, False, 'maxnnx always reports goodput'),
    'profiler': _refuse(str, '', 'use profile=steps:FIRST-LAST (a jax.profiler trace)'),
    'compile_topology': _map('topology', str, ''),
    'compile_topology_num_slices': _map('topology_slices', int, -1, lambda n: max(n, 1)),
    # Inference keys of MaxText's train config
    'prompt': _noop(str, 'I love to', 'for maxnnx generate, prompt='),
    'max_prefill_predict_length': _noop(int, 64, 'an inference setting'),
}

# MaxText's defaults that shape a run, honoured under the keys given (docs/from_maxtext.md).
# Run length, batch, sequence, data and log period keep maxnnx's defaults: MaxText's
# (150,001 steps of 12 x 2048 tokens per device from a TFDS dataset) are sized for a pod.
MAXTEXT_DEFAULTS: dict[str, Any] = {
    'optimizer': 'adamw', 'learning_rate': 3e-5, 'schedule': 'cosine', 'final_lr_fraction': 0.1,
    'b1': 0.9, 'b2': 0.95, 'eps': 1e-8, 'adam_eps_root': 0.0, 'weight_decay': 0.1,
    'decay_all': True, 'clip_norm': 1.0, 'scan_layers': True, 'remat_policy': 'full',
    'mesh.data': 1, 'mesh.fsdp': -1, 'mesh.dcn_data': -1, 'checkpoint_every': 10_000,
}
# MaxText's default model (model_name=default): a Llama-2-style block of these sizes.
DEFAULT_MODEL = 'llama2-7b'
DEFAULT_MODEL_KEYS = ('base_emb_dim', 'base_num_query_heads', 'base_num_kv_heads', 'base_mlp_dim',
                      'base_num_decoder_layers', 'head_dim', 'vocab_size',
                      'normalization_layer_epsilon', 'rope_max_timescale')
WARMUP_FRACTION = 0.1
KEEP_ALL = 1_000_000  # keep_checkpoints for MaxText's max_num_checkpoints_to_keep: None

# Every model name MaxText takes (``model_name=``); each resolves to a preset or is refused.
MAXTEXT_MODEL_NAMES: tuple[str, ...] = (
    'default', 'llama2-7b', 'llama2-13b', 'llama2-70b', 'llama3-8b', 'llama3.1-8b-Instruct',
    'llama3-70b', 'llama3.1-70b-Instruct', 'llama3.1-8b', 'llama3.1-70b', 'llama3.1-405b',
    'llama3.3-70b', 'llama3-405b', 'mistral-7b', 'mixtral-8x7b', 'mixtral-8x22b',
    'deepseek2-16b', 'deepseek2-236b', 'deepseek3-671b', 'deepseek3-671b-2dfsdp',
    'deepseek3-671b-batchsplit', 'deepseek3-test', 'deepseek3-tiny', 'deepseek3.2-671b',
    'deepseek4-tiny', 'deepseek4-284b', 'deepseek-custom', 'kimi-k2-1t', 'gemma-7b', 'gemma-2b',
    'gemma2-2b', 'gemma2-9b', 'gemma2-27b', 'gemma3-4b', 'gemma3-12b', 'gemma3-27b',
    'gemma4-26b', 'gemma4-31b', 'gemma4-e2b', 'gemma4-e4b', 'qwen2.5-1.5b', 'qwen2.5-7b',
    'qwen2.5-14b', 'qwen3-0.6b', 'qwen3-1.7b', 'qwen3-1.7b-base', 'qwen3-4b', 'qwen3-4b-base',
    'qwen3-4b-thinking-2507', 'qwen3-8b', 'qwen3-8b-base', 'qwen3-14b', 'qwen3-14b-base',
    'qwen3-32b', 'qwen3-235b-a22b', 'qwen3-30b-a3b', 'qwen3-30b-a3b-base', 'qwen3-480b-a35b',
    'qwen3-vl-2b', 'qwen3-vl-4b', 'qwen3-vl-30b-a3b', 'qwen3-next-80b-a3b', 'qwen3-omni-30b-a3b',
    'qwen3-custom-30b-a3b', 'qwen3.5-35b-a3b', 'qwen3.5-397b-a17b', 'gpt3-175b', 'gpt3-22b',
    'gpt3-6b', 'gpt3-52k', 'gpt-oss-20b', 'gpt-oss-120b', 'llama4-17b-16e', 'llama4-17b-128e',
    'olmo3-7b', 'olmo3-7b-pt', 'olmo3-32b', 'envy-test', 'envy-switch-base',
    'envy-switch-large', 'envy-switch-xxl',
)

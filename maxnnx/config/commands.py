"""The settings of the CLI's commands, one config class each.

``maxnnx generate``, ``serve``, ``convert``, ``eval`` and ``compile`` take their keys from these
classes (and ``serve`` also from :class:`~maxnnx.config.EngineConfig`); the CLI holds no
defaults of its own. Training runs take theirs from :class:`RunConfig`, ``TrainConfig``,
``MeshConfig``, ``ModelConfig`` and ``DataConfig``; every command joins a multi-process run
through :class:`ProcessConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from maxnnx.config.base import ValidatedConfig


@dataclasses.dataclass(frozen=True)
class ProcessConfig(ValidatedConfig):
  """How this process joins a multi-process run (every command reads these keys before
  anything touches a device).

  Attributes:
    coordinator: multi-process run: host:port of process 0's coordinator (with num_processes and
      process_id), or auto: jax.distributed finds the cluster (SLURM, Kubernetes JobSet, TPU
      pods); empty: the MAXNNX_COORDINATOR_ADDRESS, MAXNNX_NUM_PROCESSES and MAXNNX_PROCESS_ID
      variables, else one process
    num_processes: how many processes take part (with coordinator=host:port)
    process_id: this process's rank, from 0 to num_processes - 1 (with coordinator=host:port)
  """

  coordinator: str = ''
  num_processes: int = 0
  process_id: int = -1


@dataclasses.dataclass(frozen=True)
class RunConfig(ValidatedConfig):
  """``maxnnx train`` and the fine-tuning commands: the run itself (``TrainConfig``,
  ``MeshConfig``, ``ModelConfig`` and ``DataConfig`` hold the rest; :class:`ProcessConfig` joins
  the processes).

  Attributes:
    model: preset name (see maxnnx.list_presets()) or a local Hugging Face checkpoint directory
      to start from
    data: training data: a UTF-8 .txt file, a JSONL/Parquet/ArrayRecord file or dataset
      directory, a URL fsspec reads (s3://bucket/shards/*.parquet, gs://, https://, hf://),
      'synthetic' (random tokens), or empty for the shipped Shakespeare corpus
    eval_data: held-out data evaluated every eval_every steps (eval_batches batches; eval_loss
      and eval_perplexity in metrics.jsonl and loss.png): any format and URL data= takes; empty:
      the held-out tail of a .txt corpus, else none
    eval_split: the split eval_data reads from a directory laid out as a Hugging Face Hub
      dataset (the first it has; data.split names the training one, 'train' by default)
    maxtext_config: with model=<a MaxText step directory> (MaxText's load_parameters_path): its
      settings, a MaxText YAML or key=value pairs joined by commas (decoder_block,
      rope_max_timescale...); the run starts from its parameters converted to Hugging Face
      format
    maxtext_full_state: with model=<a MaxText step directory> holding a full training state
      (MaxText's load_full_state_path): continue its adamw moments and step too (a resumed run
      of output_dir takes its own)
    tokenizer: tokenizer file or directory (sentencepiece, tokenizer.json, tiktoken); default:
      the checkpoint's own, or one trained on a .txt corpus
    output_dir: where tokenizer, metrics, plot and model go
    dtype: compute dtype: auto (bfloat16 on GPUs/TPUs and on CPUs with native bf16 (AVX-512
      BF16, AMX), else float32; printed at the start), bfloat16 (matmuls accumulate in float32)
      or float32; parameters stay float32
    scan_layers: run the layer stack as one scanned block (mesh.stage > 1 sets it)
    remat_policy: activation rematerialisation: none, minimal, save_dot_except_mlp,
      save_qkv_proj, save_out_proj, full, custom (per tensor: model.runtime.remat_save /
      model.runtime.remat_offload; empty: the model default)
    attention_impl: attention kernel strategy (empty: the model default)
    sample_tokens: tokens of the sample printed at the end (0: none)
    resume: auto: continue the run in output_dir when its stored config matches (a different one
      is refused); never: move an earlier run aside to output_dir/previous/<time>/ and start
      fresh
  """

  model: str = 'tiny'
  data: str = ''
  eval_data: str = ''
  eval_split: str = 'validation|test'
  maxtext_config: str = ''
  maxtext_full_state: bool = False
  tokenizer: str = ''
  output_dir: str = 'runs/tiny-shakespeare'
  dtype: str = 'auto'
  scan_layers: bool = False
  remat_policy: str = ''
  attention_impl: str = ''
  sample_tokens: int = 120
  resume: str = 'auto'


@dataclasses.dataclass(frozen=True)
class GenerateConfig(ValidatedConfig):
  """``maxnnx generate``: text from a trained run or checkpoint.

  Attributes:
    output_dir: a directory written by maxnnx train.
    prompt: text to continue.
    max_new_tokens: tokens to generate (capped, with a note, to what the model's context leaves
      after the prompt).
    temperature: sampling temperature (0: greedy).
    top_p: nucleus sampling mass.
    top_k: sample among the k most likely tokens (0: all; more than the vocabulary is clamped to it
      with a warning).
    seed: sampling seed.
    logit_bias: token ids and biases added to their logits, as id:bias,id:bias (each bias in [-100,
      100]; e.g. 5:-100 bans token 5).
    presence_penalty: OpenAI's, in [-2, 2]: subtracted once from every generated token's logit.
    frequency_penalty: OpenAI's, in [-2, 2]: subtracted per time a token was generated.
    repetition_penalty: HF's, > 0 (1: none): divides the positive logits and multiplies the negative
      ones of prompt and generated tokens.
    min_tokens: tokens generated before the end-of-sequence token may be.
    quantization: quantize the linear layers and experts for inference: int8, int4, fp8 (weights)
      or w8a8 (int8 weights and activations); checkpoint keeps a quantized release's own
      fp8/int8/int4 linear weights as stored.
    tensor_parallel: devices the model is sharded over (attention heads and MLP width; in a
      multi-process run, every process's devices).
    compile_cache: directory of JAX's persistent compilation cache (empty: off): a second run finds
      its programs compiled.
    kv_cache_dtype: how the KV cache stores keys and values: auto (the compute dtype), int8 or fp8
      (e4m3), each with a float32 scale per token and KV head.
  """

  output_dir: str = 'runs/tiny-shakespeare'
  prompt: str = 'ROMEO:'
  max_new_tokens: int = 120
  temperature: float = 0.8
  top_p: float = 0.95
  top_k: int = 0
  seed: int = 0
  logit_bias: str = ''
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  min_tokens: int = 0
  quantization: str = 'none'
  tensor_parallel: int = 1
  compile_cache: str = ''
  kv_cache_dtype: str = 'auto'


@dataclasses.dataclass(frozen=True)
class ServeConfig(ValidatedConfig):
  """``maxnnx serve``: the HTTP server's own settings (the engine's are
  :class:`~maxnnx.config.EngineConfig`'s).

  Attributes:
    model: a Hugging Face checkpoint directory with its tokenizer (and chat template), e.g. the
      final/ of a maxnnx train or sft run.
    host: address to listen on (0.0.0.0: every interface).
    port: TCP port to listen on.
    served_model_name: the name clients send as "model" (empty: model= as given).
    max_queue: requests waiting beyond the max_batch running ones; more are answered with HTTP 429.
    max_request_bytes: the longest request body taken (8 MiB; images in chat messages travel
      inline); longer ones are answered with HTTP 413.
    add_bos: start text prompts of /v1/completions with the tokenizer's BOS token.
    dtype: compute dtype (empty: the checkpoint's).
    quantization: quantize the linear layers and experts for inference: int8, int4, fp8 (weights)
      or w8a8 (int8 weights and activations); checkpoint keeps a quantized release's own
      fp8/int8/int4 linear weights as stored.
    tensor_parallel: devices the model is sharded over (attention heads and MLP width); the
      parameters load straight into their shards; in a multi-process run, every process's devices:
      process 0 serves HTTP, the others follow its engine.
    log_level: uvicorn log level: critical, error, warning, info, debug, trace.
    compile_cache: directory of JAX's persistent compilation cache (empty: off): a restarted server
      finds its engine's step programs compiled.
    reasoning_parser: deepseek_r1 or qwen3: a chat reply's <think> block comes back as
      reasoning_content, apart from the content (empty: the reply is all content).
  """

  model: str = ''
  host: str = '127.0.0.1'
  port: int = 8000
  served_model_name: str = ''
  max_queue: int = 64
  max_request_bytes: int = 8388608
  add_bos: bool = True
  dtype: str = ''
  quantization: str = 'none'
  tensor_parallel: int = 1
  log_level: str = 'info'
  compile_cache: str = ''
  reasoning_parser: str = ''


@dataclasses.dataclass(frozen=True)
class ConvertConfig(ValidatedConfig):
  """``maxnnx convert``: a checkpoint from one format to another.

  Attributes:
    src: a Hugging Face directory (config.json + safetensors), an orbax checkpoint directory
      (training or parameter-only), or a step directory MaxText wrote (.../checkpoints/<step>: full
      state or parameters only, scanned or not).
    dst: where to write the converted model (must not hold a checkpoint already).
    format: output format: 'hf', 'orbax' (empty: the other one than src; 'hf' for a MaxText src) or
      'maxtext' (a MaxText parameters-only checkpoint, dst/0/items, for MaxText's
      load_parameters_path; Llama, Mistral and Mixtral).
    maxtext_config: a MaxText src's settings: its YAML, or key=value pairs joined by commas
      (decoder_block, num_experts_per_tok, normalization_layer_epsilon, rope_max_timescale...;
      MaxText's defaults otherwise).
    scan_layers: layer layout of an orbax or maxtext output: stacked (true; MaxText's scan_layers
      default) or per layer.
    dtype: floating-point dtype of a Hugging Face output (bfloat16, float16 or float32; empty: the
      parameters' own) or of a maxtext one (its weight_dtype; empty: float32).
  """

  src: str = ''
  dst: str = ''
  format: str = ''
  maxtext_config: str = ''
  scan_layers: bool = False
  dtype: str = ''


@dataclasses.dataclass(frozen=True)
class EvalConfig(ValidatedConfig):
  """``maxnnx eval``: lm-evaluation-harness tasks, or the loss of a text file.

  Attributes:
    model: a Hugging Face checkpoint directory (or URL) with its tokenizer, e.g. the final/ of a
      maxnnx train or sft run.
    tasks: lm-evaluation-harness task names, comma-separated (the harness's own, or those of
      include_path).
    include_path: a directory of your own task YAML files.
    output: where the results JSON and per-sample logs go, as lm-evaluation-harness's
      EvaluationTracker writes them (empty: print only).
    data: instead of tasks=: a .txt file (one text) or .jsonl (its "text" fields) whose loss and
      perplexity per token to print.
    batch_size: rows scored (or prompts generated) in one forward pass, or auto: the most that
      fit the device at max_length tokens, as the compiler plans the scoring pass (a power of
      two up to 64).
    limit: documents per task at most (0: all; below 1: that fraction).
    dtype: compute dtype (empty: the checkpoint's).
    num_fewshot: examples in each prompt (-1: the task's own).
    max_length: the longest sequence scored, in tokens (0: the model's max_position_embeddings).
    seed: the harness's seeds (Python, NumPy, few-shot sampling).
    tensor_parallel: devices the model is sharded over (attention heads and MLP width).
  """

  model: str = ''
  tasks: str = ''
  include_path: str = ''
  output: str = ''
  data: str = ''
  batch_size: int | Literal['auto'] = 8
  limit: float = 0.0
  dtype: str = ''
  num_fewshot: int = -1
  max_length: int = 0
  seed: int = 0
  tensor_parallel: int = 1


@dataclasses.dataclass(frozen=True)
class CompileTarget(ValidatedConfig):
  """``maxnnx compile``'s target beside the run's keys: a TPU slice to compile for.

  Attributes:
    topology: compile for this TPU slice instead of the attached devices: a Cloud TPU name (v5p-128,
      v5e-16, v6e-64, v4-32) or a chip grid (v5p:4x4x8); needs libtpu on this machine (pip install
      'maxnnx[tpu]'), not the TPUs.
    topology_slices: slices of that topology (multi-slice; the mesh.dcn_* axes span them).
  """

  topology: str = ''
  topology_slices: int = 1

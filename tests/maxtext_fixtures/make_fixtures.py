"""Reproduce the MaxText-written checkpoint fixtures in this directory.

Every checkpoint here was written by MaxText's own code (its trainer
``maxtext.trainers.pre_train.train`` or ``maxtext.utils.generate_param_only_checkpoint``)
and every logits file was computed by
MaxText's own model code on the parameters restored from that checkpoint. No
MaxText code is copied into this repository: this script drives a separate
MaxText checkout from a separate virtual environment. Nothing in maxnnx's
default test suite needs MaxText; this script is only for regenerating the
fixtures.

Versions used for the committed fixtures
-----------------------------------------
* MaxText: github.com/AI-Hypercomputer/maxtext commit
  e591f30cbbf217ed67ef71263ec0538239f9c3b8 (2026-08-22); its package layout is
  ``src/maxtext/...`` (the old ``MaxText/`` tree no longer exists).
* Python 3.12.1, jax 0.12.0.1 / jaxlib 0.12.0.1 (CPU), flax 0.12.12,
  orbax-checkpoint 0.12.8, optax 0.2.8, tensorstore 0.1.86.
* MaxText defaults at that commit: ``enable_nnx=true``, ``pure_nnx=true``,
  ``pure_nnx_decoder=true``. The NNX trainer saves the Linen on-disk layout
  (``params/params/...``, ``opt_state``, ``step``) plus an ``nnx_aux`` subtree of
  RNG state (see LAYOUT.md).

Environment (steps that worked on a 2-core CPU machine without accelerator)
--------------------------------------------------------------------------
::

    # 1. MaxText source at the commit above (a git checkout, or `git archive`);
    #    a few tokenizer/golden-data blobs may be missing: they are not needed.
    git clone https://github.com/AI-Hypercomputer/maxtext "$MAXTEXT_SRC_ROOT"
    git -C "$MAXTEXT_SRC_ROOT" checkout e591f30cbbf217ed67ef71263ec0538239f9c3b8

    # 2. A separate Python 3.12 venv (MaxText requires >= 3.12).
    python3.12 -m venv "$MTVENV"
    "$MTVENV/bin/pip" install --upgrade pip
    "$MTVENV/bin/pip" install "jax>=0.10.0" "jaxlib>=0.10.0" "flax>=0.12.7" \
        "orbax-checkpoint>=0.12.1" "optax>=0.2.8" omegaconf pydantic absl-py \
        ml-collections numpy chex "qwix>=0.1.8" "aqtp>=0.9.0" "grain>=0.2.18" \
        tensorboardx jaxtyping sentencepiece tiktoken
    # then what `import maxtext.trainers.pre_train.train` asked for, one by one:
    "$MTVENV/bin/pip" install pathwaysutils jinja2 tokamax huggingface_hub \
        transformers drjax pillow sympy
    # TensorFlow is NOT needed: the trainer imports it optionally and
    # dataset_type=synthetic never touches it. No GPU/TPU wheel is installed;
    # the jaxlib wheel above is the CPU one.

    # 3. Run this script with the venv's interpreter:
    DECOUPLE_GCLOUD=TRUE "$MTVENV/bin/python" tests/maxtext_fixtures/make_fixtures.py \
        --maxtext-src "$MAXTEXT_SRC_ROOT" --work "$SCRATCH_DIR"

``DECOUPLE_GCLOUD=TRUE`` makes MaxText stub its Google Cloud integrations
(MaxText's docs/run_maxtext/decoupled_mode.md); the script sets it for its
children anyway. ``hardware=cpu`` together with ``skip_jax_distributed_system=true``
runs single-process on the CPU (``hardware=cpu`` alone tries a multi-process
``jax.distributed`` start that wants JOB_INDEX etc.).

What it does, per fixture (the table is ``FIXTURES``; LAYOUT.md describes the result)
-------------------------
1. "train" fixtures: ``python -m maxtext.trainers.pre_train.train
   <src>/src/maxtext/configs/base.yml <overrides>`` for ``steps=3`` with
   ``checkpoint_period=2``: MaxText saves step 0 (``save_checkpoint_on_start``)
   and step 2; step 2 is copied as ``<fixture>/checkpoints/2``.
   "param_only" fixtures: ``python -m maxtext.utils.generate_param_only_checkpoint``
   with ``load_full_state_path=<source fixture's step 2>/items`` (and, for the
   llama2 ones, ``force_unroll=true``); its step 0 is copied as
   ``<fixture>/checkpoints/0``. Sources in ``SCRATCH`` (trainer states of six or
   more layers, too large to keep) are made and checked like the others, then
   not kept.
   The copies are byte for byte, except that the scratch prefix of the absolute
   path orbax writes into ``commit_success.txt`` becomes ``<work>``.
2. ``<fixture>/keys.txt``: every leaf as ``path shape dtype``, from orbax's
   metadata reader; ``overrides.txt``: the overrides given to MaxText;
   ``tokens.json``: the forward pass's inputs.
3. In a fresh process per forward pass, with the same overrides plus
   ``load_parameters_path=<step>/items``, ``dtype=float32`` and
   ``matmul_precision=highest`` (``scan_layers=false`` for unrolled checkpoints):
   MaxText's Linen model (``enable_nnx=false ...``; ``maxtext_utils.setup_decode_state``
   -> ``checkpointing.load_params_from_path``, ``model.apply``) and/or its NNX model
   (``model_creation_utils.from_pretrained``, ``model(...)``), as in MaxText's
   tests/utils/forward_pass_logit_checker.py, compute the logits of ``TOKENS``
   (positions 0..7, segment id 1). Each pass first checks that the restored
   parameters equal the checkpoint's arrays; the passes must agree to 1e-5; the
   first is saved as ``<fixture>/logits.npy`` (float32, [1, 8, vocab]).

4. ``--next-step`` (run after the fixtures exist in ``--out``): for each of
   ``NEXT_STEP``, MaxText's trainer resumes the fixture's ``checkpoints/2`` for one
   more step and ``<fixture>/next_step/`` gets the parameters after it, the batch,
   the step's learning rate and its logged loss (LAYOUT.md, "MaxText's next step").

5. ``--check-written ITEMS --only NAME``: MaxText's own forward passes (Linen and NNX), as
   in 3, on a checkpoint maxnnx wrote (``python -m maxnnx convert ... format=maxtext``;
   ``ITEMS`` is its ``<dst>/0/items``) from fixture ``NAME``; prints how far their logits are
   from the fixture's. Nothing is written to ``--out``.

Reruns give bit-identical arrays and logits; orbax's file bytes (manifests,
timestamps, chunk names) differ from run to run.

Usage::

    python make_fixtures.py --maxtext-src SRC --work SCRATCH [--out DIR] [--only NAME ...]
    python make_fixtures.py --maxtext-src SRC --work SCRATCH --next-step [--only NAME ...]
    python make_fixtures.py --maxtext-src SRC --work SCRATCH --check-written ITEMS --only NAME
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

TOKENS = [[1, 5, 9, 13, 17, 21, 25, 29]]
STEP = 2

# Overrides shared by every fixture: a tiny llama2-style decoder on CPU.
COMMON = [
  "hardware=cpu",
  "skip_jax_distributed_system=true",
  "attention=dot_product",
  "base_emb_dim=16",
  "base_num_query_heads=4",
  "base_num_kv_heads=2",
  "base_mlp_dim=32",
  "base_num_decoder_layers=2",
  "head_dim=4",
  "vocab_size=256",
  "max_target_length=32",
  "per_device_batch_size=1",
  "dataset_type=synthetic",
  "steps=3",
  "checkpoint_period=2",
  "enable_checkpointing=true",
  "async_checkpointing=false",
  "enable_goodput_recording=false",
  "monitor_goodput=false",
  "enable_checkpoint_cloud_logger=false",
  # A large step size so that 3 adamw steps move every weight (norm scales included) well
  # away from its init: a loader that skips or mis-maps a tensor then changes the logits.
  "learning_rate=0.05",
]

LINEN = ["enable_nnx=false", "pure_nnx=false", "pure_nnx_decoder=false"]
NNX = ["enable_nnx=true", "pure_nnx=true", "pure_nnx_decoder=true"]
MOE = [
  "decoder_block=mixtral",
  "num_experts=4",
  "num_experts_per_tok=2",
  "base_moe_mlp_dim=32",
  "sparse_matmul=false",
  "megablox=false",
]

# DeepSeek-V3-style block: multi-head latent attention (low-rank q and kv), one dense layer
# then MoE layers with a shared expert, sigmoid routing scores with a learned correction bias
# (moved by MaxText's loss-free balancing update, so it is not zero), yarn rotary scaling.
# model_name=deepseek3-tiny (its sizes all overridden below) because MaxText picks the
# DeepSeek-V3 routing (the bias chooses the experts, the unbiased scores weight them) by
# model name: layers/moe.py get_topk, model_name.startswith("deepseek3").
DEEPSEEK = [
  "model_name=deepseek3-tiny",
  "override_model_config=true",
  "base_emb_dim=16",
  "base_mlp_dim=32",
  "base_num_decoder_layers=2",
  "vocab_size=256",
  "decoder_block=deepseek",
  "attention_type=mla",
  "base_num_kv_heads=4",
  "q_lora_rank=8",
  "kv_lora_rank=8",
  "qk_nope_head_dim=4",
  "qk_rope_head_dim=4",
  "v_head_dim=4",
  "num_experts=4",
  "num_experts_per_tok=2",
  "shared_experts=1",
  "base_moe_mlp_dim=16",
  "first_num_dense_layers=1",
  "routed_scaling_factor=2.5",
  "routed_score_func=sigmoid",
  "routed_bias=true",
  "routed_bias_update_rate=0.05",
  "normalization_layer_epsilon=1e-6",
  "n_routing_groups=2",
  "topk_routing_group=1",
  "rope_type=yarn",
  "max_position_embeddings=64",
  "original_max_position_embeddings=16",
  "rope_factor=4",
  "beta_fast=32",
  "beta_slow=1",
  "mscale=1.0",
  "sparse_matmul=false",
  "megablox=false",
]

# Gemma blocks: tied embedding (logits_via_embedding), gated GELU, norms around attention and
# MLP. Gemma 3 takes its query scale from the model name (models/gemma3.py
# get_query_pre_attn_scalar knows only gemma3-4b/12b/27b), hence model_name=gemma3-4b with
# its sizes overridden; six layers are one scanned block of its 5-local-1-global pattern. A
# window of 4 (< the 8 tokens) and small soft caps make sure those act on the logits.
GEMMA = [
  "mlp_activations=[gelu,linear]",
  "logits_via_embedding=true",
  "normalization_layer_epsilon=1e-6",
]
GEMMA1 = ["decoder_block=gemma", *GEMMA]
GEMMA2 = [
  "decoder_block=gemma2",
  *GEMMA,
  "use_post_attn_norm=true",
  "use_post_ffw_norm=true",
  "sliding_window_size=4",
  "attn_logits_soft_cap=2.0",
  "final_logits_soft_cap=5.0",
]
GEMMA3 = [
  "model_name=gemma3-4b",
  "override_model_config=true",
  "decoder_block=gemma3",
  *GEMMA,
  "base_num_decoder_layers=6",
  "base_emb_dim=16",
  "base_num_query_heads=4",
  "base_num_kv_heads=2",
  "head_dim=4",
  "base_mlp_dim=32",
  "vocab_size=256",
  "use_post_attn_norm=true",
  "use_post_ffw_norm=true",
  "sliding_window_size=4",
  "local_rope_max_timescale=10000",
  "rope_max_timescale=1000000",
  "rope_linear_scaling_factor=8.0",
]

# Llama 3.1's rotary embedding (rope_type=llama3.1: interleaved pairs, and with rope_use_scale
# the band-wise frequency scaling of layers/embeddings.py LLaMARotaryEmbedding, factor 8 from a
# context of 8192). head_dim=8 at llama3's base 500000 gives frequencies in each of the three
# bands (kept, blended, divided by 8).
LLAMA31 = ["rope_type=llama3.1", "rope_max_timescale=500000", "head_dim=8"]

# GPT-OSS block: biased q/k/v/o with attention sinks, sliding and full layers alternating,
# a routed MoE with biases on the router and the experts and a clamped "sigmoid, linear"
# (x * sigmoid(1.702 x) * (y + 1)) expert activation, yarn rotary on halves with its
# attention scaling.
GPT_OSS = [
  "decoder_block=gpt_oss",
  "attention_bias=true",
  "attention_sink=true",
  "sliding_window_size=4",
  "inhomogeneous_layer_cycle_interval=2",
  "rope_type=yarn",
  "rope_max_timescale=150000",
  "max_position_embeddings=64",
  "original_max_position_embeddings=16",
  "rope_factor=4",
  "beta_fast=32",
  "beta_slow=1",
  "rope_interleave=false",
  "rope_truncate=false",
  "rope_attention_scaling=true",
  "mlp_activations=[sigmoid,linear]",
  "mlp_activations_limit=0.5",  # gpt-oss: 7.0; small enough here that the clamp acts
  "routed_bias=true",
  "mlp_bias=true",
  "num_experts=4",
  "num_experts_per_tok=2",
  "base_moe_mlp_dim=32",
  "sparse_matmul=false",
  "megablox=false",
]

# Llama 4 block: a cycle of 4 layers (the 4th without rotary embedding, attending fully; the
# others chunked, window 4 < the 8 tokens), dense and MoE layers alternating (top-1 sigmoid
# routing on the expert input plus a shared expert), weightless L2 q/k norms in the rotary
# layers, llama3.1 rotary embedding.
LLAMA4 = [
  "decoder_block=llama4",
  "base_num_decoder_layers=4",
  "head_dim=8",
  "normalization_layer_epsilon=1e-6",
  "rope_type=llama3.1",
  "rope_max_timescale=500000",
  "use_qk_norm=true",
  "nope_layer_interval=4",
  "interleave_moe_layer_step=2",
  "inhomogeneous_layer_cycle_interval=4",
  "temperature_tuning=true",
  "chunk_attn_window_size=4",
  "num_experts=4",
  "num_experts_per_tok=1",
  "shared_experts=1",
  "base_moe_mlp_dim=16",
  "sparse_matmul=false",
  "megablox=false",
]

# name -> (how it is written, model overrides on top of COMMON, source fixture or None,
#          forward passes that must reproduce logits.npy).
# "train": MaxText's trainer writes a full training state (params, opt_state, step[, nnx_aux])
#   at steps 0 and 2; step 2 is kept.
# "param_only": maxtext.utils.generate_param_only_checkpoint reads the source fixture's
#   full state (load_full_state_path) and writes a bf16 parameters-only checkpoint at step 0;
#   force_unroll=true turns scanned layers into layers_0, layers_1.
FIXTURES = {
  # MaxText's default (NNX) trainer, layers scanned along param_scan_axis=1.
  "llama2_scanned": ("train", ["scan_layers=true"], None, ("linen", "nnx")),
  # Same model, one subtree per layer: decoder/layers_0, decoder/layers_1.
  "llama2_unscanned": ("train", ["scan_layers=false"], None, ("linen", "nnx")),
  # Mixtral-style MoE decoder block, 4 experts, top-2, dense (non-megablox) matmul on CPU.
  "mixtral_moe_scanned": ("train", ["scan_layers=true", *MOE], None, ("linen", "nnx")),
  # DeepSeek-V3-style MLA + MoE block with a shared expert, yarn rotary scaling.
  "deepseek_mla_moe_scanned": ("train", ["scan_layers=true", *DEEPSEEK], None, ("linen", "nnx")),
  # Llama 3.1 rotary embedding on the llama2 block.
  "llama31_rope_scanned": ("train", ["scan_layers=true", *LLAMA31], None, ("linen", "nnx")),
  # GPT-OSS block (two layers: one sliding, one full); as for Gemma 3, the trainer state
  # (~0.6 MB) is the source of the parameters-only checkpoint kept.
  "gpt_oss_scanned": ("train", ["scan_layers=true", *GPT_OSS], None, ("linen", "nnx")),
  "gpt_oss_params_only_nnx": ("param_only", ["scan_layers=true"], "gpt_oss_scanned", ("nnx",)),
  # Llama 4 block, one scanned cycle of 4 layers; trainer state kept as scratch.
  "llama4_scanned": ("train", ["scan_layers=true", *LLAMA4], None, ("linen", "nnx")),
  "llama4_params_only_nnx": ("param_only", ["scan_layers=true"], "llama4_scanned", ("nnx",)),
  # Gemma 1, 2 and 3 blocks (Gemma 2: each MaxText layer is a local and a global layer).
  "gemma_scanned": ("train", ["scan_layers=true", *GEMMA1], None, ("linen", "nnx")),
  "gemma2_scanned": ("train", ["scan_layers=true", *GEMMA2], None, ("linen", "nnx")),
  # Gemma 3's trainer state (six layers: 333 leaves, ~0.9 MB) is only the source of its
  # parameters-only checkpoint, which is kept (SCRATCH: written, checked, not kept).
  "gemma3_scanned": ("train", ["scan_layers=true", *GEMMA3], None, ("linen", "nnx")),
  "gemma3_params_only_nnx": ("param_only", ["scan_layers=true"], "gemma3_scanned", ("nnx",)),
  # The Linen trainer (enable_nnx=false): the classic layout without nnx_aux.
  "llama2_scanned_linen": ("train", ["scan_layers=true", *LINEN], None, ("linen", "nnx")),
  # Parameters only, written by the default (NNX) path: {path}/value leaves, no params/params.
  "llama2_params_only_nnx": (
    "param_only",
    ["scan_layers=true", "force_unroll=true"],
    "llama2_scanned",
    ("nnx",),
  ),
  # Parameters only, written by the Linen path: params/params/decoder/layers_N/...
  "llama2_params_only_linen": (
    "param_only",
    ["scan_layers=true", "force_unroll=true", *LINEN],
    "llama2_scanned_linen",
    ("linen", "nnx"),
  ),
}

# MaxText's next training step from a fixture's full state (``--next-step``): its trainer
# resumes from the committed ``checkpoints/2`` (step 3) for one more step, on the batch of
# dataset_type=synthetic (the same batch every step: input_pipeline/synthetic_data_processing.py
# draws randint(PRNGKey(0), [batch, max_target_length + 1], 0, vocab) once), in float32 at the
# highest matmul precision and without gradient clipping (a threshold clips by the global
# norm of the gradient, which depends on the parametrisation; see LAYOUT.md). steps=4 makes
# it the last step of a 4-step schedule; checkpoint_period=1 saves it.
# fixture -> (its step, overrides of its own). DeepSeek: MaxText's loss-free balancing moves
# the router bias after the step by a rule of its own; off here (routed_bias_update_rate=0).
NEXT_STEP = {
  "llama2_scanned": (2, []),
  "deepseek_mla_moe_scanned": (2, ["routed_bias_update_rate=0"]),
}
NEXT_STEP_OVERRIDES = [
  "steps=4",
  "checkpoint_period=1",
  "dtype=float32",
  "matmul_precision=highest",
  "gradient_clipping_threshold=0",
]

# Fixtures that are only the source of another: made and checked, then not kept.
SCRATCH = {"gemma3_scanned", "gpt_oss_scanned", "llama4_scanned"}

# The forward passes run in float32 at the highest matmul precision, so a converter's own
# float32 forward can be held to a tight tolerance.
FORWARD = ["dtype=float32", "matmul_precision=highest"]


def _merge(*lists):
  """Overrides in order, a later ``key=`` replacing an earlier one in place (MaxText's
  command line takes each key once)."""
  out = {}
  for item in (o for overrides in lists for o in overrides):
    out[item.split("=", 1)[0]] = item
  return list(out.values())


def _env(src):
  env = dict(os.environ)
  env["DECOUPLE_GCLOUD"] = "TRUE"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.path.join(src, "src") + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _base_yml(src):
  return os.path.join(src, "src", "maxtext", "configs", "base.yml")


def _run(src, work, log_name, cmd):
  log = os.path.join(work, log_name)
  with open(log, "w", encoding="utf-8") as f:
    cwd = os.path.join(src, "src")
    rc = subprocess.call(cmd, env=_env(src), stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
  if rc:
    raise SystemExit(f"{' '.join(cmd[:4])} ... failed (rc={rc}); see {log}")
  return log


def write(src, work, name, kind, overrides, source_step_dir):
  """Has MaxText write the fixture's checkpoint; returns the step directory it wrote."""
  run_dir = os.path.join(work, name)
  shutil.rmtree(run_dir, ignore_errors=True)
  if kind == "train":
    module, extra, step = "maxtext.trainers.pre_train.train", [], STEP
  else:
    module = "maxtext.utils.generate_param_only_checkpoint"
    extra, step = [f"load_full_state_path={os.path.join(source_step_dir, 'items')}"], 0
  cmd = [
    sys.executable,
    "-m",
    module,
    _base_yml(src),
    f"run_name={name}",
    f"base_output_directory={work}",
    *overrides,
    *extra,
  ]
  _run(src, work, f"{name}.write.log", cmd)
  return os.path.join(run_dir, "checkpoints", str(step))


def forward(src, work, name, mode, overrides, ckpt_items, out_npy):
  """MaxText's own forward pass (Linen or NNX model) on the parameters restored from ckpt_items."""
  unrolled = "force_unroll=true" in overrides
  drop = ("force_unroll=", "enable_nnx=", "pure_nnx")
  overrides = [o for o in overrides if not o.startswith(drop)]
  if (
    unrolled
  ):  # a parameters-only checkpoint written with force_unroll: an unscanned model reads it
    overrides = [o for o in overrides if not o.startswith("scan_layers=")] + ["scan_layers=false"]
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "_logits",
    mode,
    out_npy,
    _base_yml(src),
    f"run_name={name}_{mode}_logits",
    f"base_output_directory={work}",
    *overrides,
    *(LINEN if mode == "linen" else NNX),
    *FORWARD,
    f"load_parameters_path={ckpt_items}",
  ]
  _run(src, work, f"{name}.{mode}.logits.log", cmd)


def _flat(tree):
  """{'a/b/c': array} of a params tree, less Linen's 'params/params' and NNX's 'value' wrappers."""
  import jax
  import numpy as np

  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    while keys[:1] == ["params"]:
      keys = keys[1:]
    if keys[-1:] == ["value"]:
      keys = keys[:-1]
    out["/".join(keys)] = np.asarray(leaf, dtype=np.float32)
  return out


def _check_restored(ckpt_items, params):
  """The model must run on the checkpoint's arrays, not a fresh init: compare with orbax's read."""
  import numpy as np
  import orbax.checkpoint as ocp

  raw = ocp.PyTreeCheckpointer().restore(ckpt_items)
  raw = raw["params"] if "params" in raw else raw
  want, got = _flat(raw), _flat(params)
  assert sorted(want) == sorted(got), (sorted(want), sorted(got))
  for k, arr in want.items():
    np.testing.assert_array_equal(got[k], arr, err_msg=k)
  print("restored params equal the checkpoint's arrays:", len(want), "leaves")


def _logits_main(mode, out_npy, argv):
  """Runs inside the MaxText venv: restore params with MaxText's code and run its model.

  mode "linen": maxtext_utils.setup_decode_state (checkpointing.load_params_from_path) and
  models.transformer_as_linen; mode "nnx": model_creation_utils.from_pretrained and the NNX
  models.Transformer (MaxText's default path). Both are how MaxText's
  tests/utils/forward_pass_logit_checker.py runs a checkpoint.
  """
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from maxtext.configs import pyconfig
  from maxtext.layers import quantizations
  from maxtext.models import models
  from maxtext.utils import maxtext_utils, model_creation_utils

  config = pyconfig.initialize([None, *argv])
  devices_array = maxtext_utils.create_device_mesh(config)
  mesh = jax.sharding.Mesh(devices_array, config.mesh_axes)
  ids = jnp.asarray(TOKENS, dtype=jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
  segment_ids = jnp.ones_like(ids)
  rng = jax.random.PRNGKey(config.init_weights_seed)
  if mode == "linen":
    quant = quantizations.configure_quantization(config)
    model = models.transformer_as_linen(config, mesh=mesh, quant=quant, model_mode="train")
    init_state_fn = functools.partial(
      maxtext_utils.init_initial_state, model, None, config, False, rng
    )
    state, _ = maxtext_utils.setup_decode_state(config, mesh, None, init_state_fn)
    _check_restored(config.load_parameters_path, state.params)
    out = model.apply(
      state.params, ids, positions, segment_ids, enable_dropout=False, rngs={"aqt": rng}
    )
  else:
    model = model_creation_utils.from_pretrained(config, mesh=mesh, model_mode="train")
    _check_restored(config.load_parameters_path, nnx.state(model, nnx.Param).to_pure_dict())
    out = model(
      decoder_input_tokens=ids,
      decoder_positions=positions,
      decoder_segment_ids=segment_ids,
      enable_dropout=False,
    )
  out = np.asarray(jax.device_get(out), dtype=np.float32)
  np.save(out_npy, out)
  print("logits", mode, out.shape, out.dtype, float(np.abs(out).max()))


def scrub_commit_files(root, work):
  """orbax writes the absolute directory it committed to into commit_success.txt (a file whose
  existence, not content, is what orbax checks). Replace the scratch prefix with "<work>" so no
  machine path is committed; every other byte is as MaxText wrote it."""
  work = os.path.abspath(work)
  for dirpath, _, files in os.walk(root):
    for fn in files:
      if fn == "commit_success.txt":
        path = os.path.join(dirpath, fn)
        with open(path, encoding="utf-8") as f:
          text = f.read()
        with open(path, "w", encoding="utf-8") as f:
          f.write(text.replace(work, "<work>"))


def keys_txt(step_dir, out_txt):
  """Every leaf of the checkpoint's items, as orbax's metadata reader sees it."""
  import jax
  import orbax.checkpoint as ocp

  meta = ocp.PyTreeCheckpointer().metadata(os.path.join(step_dir, "items"))
  tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
  lines = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    lines.append(f"{key} {tuple(leaf.shape)} {leaf.dtype}")
  with open(out_txt, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


def check_written(src, work, out, name, items):
  """MaxText's forward passes on ``items`` (a checkpoint maxnnx wrote from fixture ``name``),
  against the fixture's logits; returns the largest absolute difference of each mode."""
  import numpy as np

  fixture = os.path.join(out, name)
  with open(os.path.join(fixture, "overrides.txt"), encoding="utf-8") as f:
    overrides = [line.strip() for line in f if line.strip()]
  want = np.load(os.path.join(fixture, "logits.npy"))
  gaps = {}
  for mode in FIXTURES[name][3]:
    out_npy = os.path.join(work, f"{name}.written.{mode}.logits.npy")
    forward(src, work, f"{name}_written", mode, overrides, items, out_npy)
    gaps[mode] = float(np.abs(np.load(out_npy) - want).max())
    print(f"{name}: MaxText's {mode} forward on {items}: max |logits - fixture| = {gaps[mode]}")
  return gaps


def next_step(src, work, out, name, step, extra):
  """MaxText's trainer takes one more step from fixture ``name``'s ``checkpoints/<step>``;
  ``<fixture>/next_step/`` gets the parameters after it (``params.npz``, MaxText's tree paths
  less ``params/params``), the batch, the learning rate of that step and the logged loss."""
  run = f"{name}_next_step"
  run_dir = os.path.join(work, run)
  shutil.rmtree(run_dir, ignore_errors=True)
  source = os.path.join(out, name, "checkpoints", str(step))
  shutil.copytree(source, os.path.join(run_dir, "checkpoints", str(step)))
  with open(os.path.join(out, name, "overrides.txt"), encoding="utf-8") as f:
    overrides = _merge(f.read().split(), NEXT_STEP_OVERRIDES, extra)
  cmd = [
    sys.executable,
    "-m",
    "maxtext.trainers.pre_train.train",
    _base_yml(src),
    f"run_name={run}",
    f"base_output_directory={work}",
    *overrides,
  ]
  log = _run(src, work, f"{run}.write.log", cmd)
  next_dir = os.path.join(run_dir, "checkpoints", str(step + 1))
  dest = os.path.join(out, name, "next_step")
  os.makedirs(dest, exist_ok=True)
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "_next_step",
    dest,
    os.path.join(next_dir, "items"),
    log,
    _base_yml(src),
    f"run_name={run}_read",
    f"base_output_directory={work}",
    *overrides,
  ]
  _run(src, work, f"{run}.read.log", cmd)
  with open(os.path.join(dest, "overrides.txt"), "w", encoding="utf-8") as f:
    f.write("\n".join(NEXT_STEP_OVERRIDES + extra) + "\n")


def _next_step_main(dest, items, log, argv):
  """Runs inside the MaxText venv: the parameters MaxText's step wrote, its batch, its
  learning rate (MaxText's own schedule) and the loss it logged."""
  import re

  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from maxtext.configs import pyconfig
  from maxtext.utils import maxtext_utils

  # MaxText's trainer draws with this generator (trainers/pre_train/train.py main), so the
  # synthetic batch is only the same with it.
  jax.config.update("jax_default_prng_impl", "unsafe_rbg")
  config = pyconfig.initialize([None, *argv])
  raw = ocp.PyTreeCheckpointer().restore(items)
  step = int(np.asarray(raw["step"]))
  tokens = jax.random.randint(
    jax.random.PRNGKey(0),
    (config.global_batch_size_to_load, config.max_target_length + 1),
    0,
    config.vocab_size,
    dtype=jax.numpy.int32,
  )
  lr = float(maxtext_utils.create_learning_rate_schedule(config)(step - 1))
  with open(log, encoding="utf-8") as f:
    losses = re.findall(r"completed step: (\d+), .*? loss: ([0-9.]+)", f.read())
  loss = {int(k): float(v) for k, v in losses}[step - 1]
  np.savez(os.path.join(dest, "params.npz"), **_flat(raw["params"]))
  with open(os.path.join(dest, "next_step.json"), "w", encoding="utf-8") as f:
    json.dump(
      {"step": step, "tokens": np.asarray(tokens).tolist(), "learning_rate": lr, "loss": loss}, f
    )
    f.write("\n")
  print("next step", step, "lr", lr, "loss", loss)


def main():
  if len(sys.argv) > 2 and sys.argv[1] == "_logits":
    _logits_main(sys.argv[2], sys.argv[3], sys.argv[4:])
    return
  if len(sys.argv) > 2 and sys.argv[1] == "_next_step":
    _next_step_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    return
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("--maxtext-src", required=True, help="a MaxText checkout (has src/maxtext)")
  p.add_argument("--work", required=True, help="scratch directory for MaxText's run output")
  p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  p.add_argument("--only", nargs="*", default=None, choices=sorted(FIXTURES))
  p.add_argument(
    "--next-step",
    action="store_true",
    help="only MaxText's next step from the NEXT_STEP fixtures already in --out",
  )
  p.add_argument(
    "--check-written",
    metavar="ITEMS",
    help="MaxText's forward on a checkpoint maxnnx wrote from the --only fixture",
  )
  a = p.parse_args()
  os.makedirs(a.work, exist_ok=True)
  if a.check_written:
    if not a.only or len(a.only) != 1:
      raise SystemExit("--check-written needs --only NAME: the fixture it was written from")
    check_written(a.maxtext_src, a.work, a.out, a.only[0], a.check_written)
    return
  if a.next_step:
    for name, (step, extra) in NEXT_STEP.items():
      if a.only and name not in a.only:
        continue
      print(f"== {name}: next step", flush=True)
      next_step(a.maxtext_src, a.work, a.out, name, step, extra)
    print("done")
    return
  import numpy as np

  written = {}
  for name, (kind, extra, source, modes) in FIXTURES.items():
    if a.only and name not in a.only and not any(FIXTURES[o][2] == name for o in a.only):
      continue
    if source is None:
      overrides = _merge(COMMON, extra)
      source_step = None
    else:
      overrides = _merge(COMMON, FIXTURES[source][1], extra)
      source_step = written[source]
    print(f"== {name}: {kind}", flush=True)
    step_dir = write(a.maxtext_src, a.work, name, kind, overrides, source_step)
    written[name] = step_dir
    dest = os.path.join(a.out, name)
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    shutil.copytree(step_dir, os.path.join(dest, "checkpoints", os.path.basename(step_dir)))
    scrub_commit_files(os.path.join(dest, "checkpoints"), a.work)
    keys_txt(step_dir, os.path.join(dest, "keys.txt"))
    with open(os.path.join(dest, "overrides.txt"), "w", encoding="utf-8") as f:
      f.write("\n".join(overrides) + "\n")
    with open(os.path.join(dest, "tokens.json"), "w", encoding="utf-8") as f:
      n = len(TOKENS[0])
      json.dump({"tokens": TOKENS, "positions": [list(range(n))], "segment_ids": [[1] * n]}, f)
      f.write("\n")
    outs = {}
    for mode in modes:
      print(f"== {name}: {mode} forward", flush=True)
      out_npy = os.path.join(a.work, f"{name}.{mode}.logits.npy")
      items = os.path.join(step_dir, "items")
      forward(a.maxtext_src, a.work, name, mode, overrides, items, out_npy)
      outs[mode] = np.load(out_npy)
    first = outs[modes[0]]
    for mode, out in outs.items():
      msg = f"{name}: {mode} vs {modes[0]}"
      np.testing.assert_allclose(out, first, atol=1e-5, rtol=1e-5, err_msg=msg)
    np.save(os.path.join(dest, "logits.npy"), first)
    if (a.only and name not in a.only) or name in SCRATCH:
      shutil.rmtree(dest)
  print("done")


if __name__ == "__main__":
  main()
